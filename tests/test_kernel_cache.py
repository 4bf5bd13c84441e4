"""kernels/cache.py without a GPU: a kernel loaded through tvm_ffi that fails its first call switches to
TileLang's loader once and repeats the call; one that works never touches the fallback; seeding a cache from
prebuilt kernels survives TileLang's cleanup of stale staging copies.
(Loading real entries through the index, with and without tilelang imported: test_precompile.py.)"""
import json
import logging
import os
import shutil
import time
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


def _prebuilt_entry(root: Path, name: str, age_seconds: float) -> Path:
    """A complete cache entry (its manifest listing its one file) whose files and directory are that old."""
    entry = root / "0.1.15" / "linux-x86_64" / "kernels" / name
    entry.mkdir(parents=True)
    (entry / "kernel.bin").write_bytes(bytes(16))
    (entry / cache.MANIFEST).write_text(json.dumps({"files": ["kernel.bin"]}))
    then = time.time() - age_seconds
    for path in (entry / "kernel.bin", entry / cache.MANIFEST, entry):
        os.utime(path, (then, then))
    return entry


def test_seeding_survives_tilelangs_cleanup_of_stale_staging_copies(tmp_path, monkeypatch):
    """TileLang removes the entries of its staging directory older than an hour (what a crashed writer left)
    when a process first opens the cache. Prebuilt kernels are usually older than that, and a copy staged with
    their timestamps (copytree keeps them) looks stale: a rank starting beside this one could delete it before
    it is renamed into place (the racing-ranks test of test_precompile.py failed so once). TileLang's cleanup
    runs here right after every copy."""
    pytest.importorskip("tilelang")
    from tilelang.cache.kernel_cache import KernelCache

    prebuilt, fresh = tmp_path / "prebuilt", tmp_path / "cache"
    names = [f"{i:064x}" for i in range(3)]
    for name in names:
        _prebuilt_entry(prebuilt, name, age_seconds=2 * 86400)
    staging_root = fresh / "0.1.15" / "linux-x86_64" / ".staging"
    monkeypatch.setattr(KernelCache, "_get_staging_root", staticmethod(lambda: str(staging_root)))
    real_copytree = shutil.copytree

    def copy_then_clean(*args, **kwargs):
        copied = real_copytree(*args, **kwargs)
        KernelCache._cleanup_stale_staging_dirs()  # a process opening the cache at this moment
        return copied

    monkeypatch.setattr(shutil, "copytree", copy_then_clean)
    assert cache.seed(prebuilt, fresh) == len(names)
    assert set(cache.entries(fresh)) == {Path("0.1.15/linux-x86_64/kernels") / name for name in names}
    assert not any(staging_root.iterdir()), "a staged copy was left behind"
