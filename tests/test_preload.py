"""flashqla.preload_kernels without TileLang: it says why, and bad dtypes are a ValueError naming them
(the loading itself is tested in test_precompile.py, which needs TileLang and nvcc)."""
import pytest

import flashqla
from flashqla.ops import backends


def test_preload_kernels_returns_why_the_kernels_cannot_be_used(monkeypatch):
    monkeypatch.setattr(backends, "_hopper_kernels", lambda: (None, "tilelang is not importable (ImportError)"))
    assert flashqla.preload_kernels() == "tilelang is not importable (ImportError)"


def test_preload_kernels_rejects_unknown_dtypes_before_anything_loads(monkeypatch):
    monkeypatch.setattr(backends, "_hopper_kernels", lambda: pytest.fail("looked for kernels before checking dtypes"))
    with pytest.raises(ValueError, match="dtypes"):
        flashqla.preload_kernels(("int8",))
