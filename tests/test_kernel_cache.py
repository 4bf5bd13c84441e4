"""kernels/cache.py's direct loads without a GPU: a kernel loaded through tvm_ffi that fails its first call
switches to TileLang's loader once and repeats the call; one that works never touches the fallback.
(Loading real entries through the index, with and without tilelang imported: test_precompile.py.)"""
import logging
from pathlib import Path

import pytest

from flashqla.kernels import cache


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        return "launched"


def test_a_direct_load_failing_its_first_call_falls_back_for_good_and_repeats_the_call(caplog):
    def missing_runtime_function(*args):
        raise RuntimeError("Cannot find function __tvm_tensormap_create_tiled in the imported modules")

    through_tilelang, fallbacks = Recorder(), []
    kernel = cache.LoadedKernel(Path("/cache/0.1.15/linux-x86_64/kernels/abc"), missing_runtime_function,
                                lambda: fallbacks.append(1) or through_tilelang)
    with caplog.at_level(logging.WARNING, logger="flashqla.kernels"):
        assert kernel(1, 2.0) == "launched"
    assert kernel(3) == "launched"
    assert through_tilelang.calls == [(1, 2.0), (3,)] and fallbacks == [1]
    assert "abc failed on its first call" in caplog.text and "__tvm_tensormap_create_tiled" in caplog.text


def test_a_direct_load_that_works_never_builds_its_fallback():
    direct = Recorder()
    kernel = cache.LoadedKernel(Path("/cache/entry"), direct, lambda: pytest.fail("fell back after a good call"))
    assert [kernel(i) for i in range(3)] == ["launched"] * 3 and direct.calls == [(0,), (1,), (2,)]


def test_an_error_that_is_the_callers_surfaces_from_the_fallback_too():
    def bad_arguments(*args):
        raise ValueError("kernel wy_inverse input k dtype mismatch")

    kernel = cache.LoadedKernel(Path("/cache/entry"), bad_arguments, lambda: bad_arguments)
    with pytest.raises(ValueError, match="dtype mismatch"):
        kernel(0)
