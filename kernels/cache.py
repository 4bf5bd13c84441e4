"""Where compiled kernels come from: TileLang's disk cache, seeded from prebuilt kernels, else a logged JIT.

A TileLang cache is a tree `<root>/<tilelang version>/<platform>/kernels/<key>/` (plus `cuda-binaries/`,
nvcc's output, which only saves time when an entry has to be rebuilt). Each entry directory holds the
lowered sources, the host library with the sm_90a cubin inside, `params.json` and `manifest.json`;
TileLang loads it without a GPU or nvcc and publishes new entries by renaming a finished staging
directory, so concurrent writers never expose half an entry.

The prebuilt kernels (`flashqla precompile`, docs/prebuilt_kernels.md) are such a tree, shipped inside
the package at `flashqla/kernels/prebuilt/` or named by FLASHQLA_PREBUILT_KERNELS ("off" disables
them). On the first compile in a process, entries missing from TileLang's cache (TILELANG_CACHE_DIR,
default ~/.tilelang/cache) are copied into it the same way TileLang writes them, so the prebuilt tree
may sit on a read-only path and TileLang's own JIT fallback keeps a writable cache.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

log = logging.getLogger("flashqla.kernels")

PREBUILT_ENV = "FLASHQLA_PREBUILT_KERNELS"
PACKAGED_PREBUILT = Path(__file__).resolve().parent / "prebuilt"
MANIFEST = "manifest.json"
_OFF = ("0", "off", "false", "no", "none")


def prebuilt_dir() -> Path | None:
    """The prebuilt kernel tree this process reads, or None when FLASHQLA_PREBUILT_KERNELS turns it off."""
    value = os.environ.get(PREBUILT_ENV)
    if value is None:
        return PACKAGED_PREBUILT
    if value.strip().lower() in _OFF or not value.strip():
        return None
    return Path(value).expanduser()


def tilelang_cache_dir() -> Path:
    """The cache TileLang reads and writes now (it reads TILELANG_CACHE_DIR at every use, unexpanded)."""
    from tilelang import env

    return Path(env.TILELANG_CACHE_DIR)


def is_complete(entry: Path) -> bool:
    """TileLang writes `manifest.json` last, listing every other file of the entry."""
    try:
        listed = json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((entry / name).is_file() for name in listed)


def entries(root: Path) -> dict[Path, Path]:
    """Complete kernel entries of a cache tree: path relative to `root` -> absolute path."""
    return {entry.relative_to(root): entry for entry in root.glob("*/*/kernels/*") if is_complete(entry)}


def seed(prebuilt: Path, cache: Path) -> int:
    """Copies the entries of `prebuilt` that `cache` lacks; returns how many it copied.

    Each copy is staged under `<namespace>/.staging/` (TileLang's staging root, same filesystem, whose
    leftovers TileLang removes after an hour) and published by one rename; when another process
    publishes the same entry first, the rename fails and this copy is dropped.
    """
    copied = 0
    for relative, source in entries(prebuilt).items():
        target = cache / relative
        if target.exists():
            continue
        staging_root = cache / relative.parent.parent / ".staging"
        staging_root.mkdir(parents=True, exist_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_root / f"flashqla-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(source, staging)
            os.rename(staging, target)
            copied += 1
        except OSError:
            if not target.exists():  # not a lost race: a real failure
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return copied


@functools.lru_cache(maxsize=None)
def _seed_once(prebuilt: Path | None, cache: Path) -> str | None:
    """Seeds `cache` from `prebuilt` once per process and pair; returns why nothing usable was found."""
    if prebuilt is None:
        return f"{PREBUILT_ENV} turns the prebuilt kernels off"
    if not entries(prebuilt):
        return f"there are no prebuilt kernels in {prebuilt} (build them with `flashqla precompile`)"
    try:
        copied = seed(prebuilt, cache)
    except OSError as exc:
        return f"the prebuilt kernels in {prebuilt} could not be copied into TileLang's cache {cache} ({exc})"
    if copied:
        log.info("flashqla: copied %d prebuilt kernels from %s into TileLang's cache %s", copied, prebuilt, cache)
    return None


def entry_of(kernel) -> Path | None:
    """The cache entry TileLang loaded `kernel` from or wrote it to (None when its cache is off)."""
    path = getattr(kernel, "_tilelang_cache_path", None)
    return None if path is None else Path(path)


def relative_entry(entry: Path) -> Path:
    """`<version>/<platform>/kernels/<key>`: an entry's place in any cache tree."""
    return entry.relative_to(entry.parents[3])


def _why_compiled(prebuilt: Path | None, missing_reason: str | None, entry: Path | None) -> str:
    if entry is None:
        return "TileLang's cache is disabled (TILELANG_DISABLE_CACHE), so nothing is loaded or kept"
    if missing_reason is not None:
        return missing_reason
    namespace = relative_entry(entry).parent.parent
    namespaces = sorted({str(relative.parent.parent) for relative in entries(prebuilt)})
    if str(namespace) not in namespaces:
        return (f"the prebuilt kernels in {prebuilt} were built for {', '.join(namespaces)}; "
                f"this process runs TileLang {namespace}")
    return f"the prebuilt kernels in {prebuilt} do not include this configuration"


def compile_kernel(prim_func, label: str, **compile_args):
    """`tilelang.compile(prim_func, **compile_args)` after seeding TileLang's cache from the prebuilt kernels.

    A load from the cache is silent; a real compile is logged once (the caller caches the result per
    configuration) with its duration and the reason no prebuilt kernel served it.
    """
    import tilelang

    cache = tilelang_cache_dir()
    prebuilt = prebuilt_dir()
    missing_reason = _seed_once(prebuilt, cache)
    present = {entry.relative_to(cache) for entry in cache.glob("*/*/kernels/*")}  # names only: cheap
    start = time.perf_counter()
    kernel = tilelang.compile(prim_func, **compile_args)
    entry = entry_of(kernel)
    if entry is None or relative_entry(entry) not in present:
        log.warning("flashqla: JIT-compiled %s in %.1f s: %s", label, time.perf_counter() - start,
                    _why_compiled(prebuilt, missing_reason, entry))
    return kernel
