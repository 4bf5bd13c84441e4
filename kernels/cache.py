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

TileLang finds an entry by a hash of the kernel's PrimFunc, so even a cache hit first builds the
PrimFunc from the Python kernel (TileLang parses and re-compiles every macro: ~0.1-1 s per kernel).
flashqla keeps its own index next to the entries, `<version>/<platform>/flashqla-index/`: per kernel
label, compile arguments, TileLang version and a digest of the kernel sources, the entry's key and the
PrimFunc serialised by TVM. A hit loads the entry from those without running the builder; anything
unexpected falls back to the normal path, which (re)writes the index.

A hit does not even import tilelang (1-2 s of TVM start-up): the entry's host library is loaded with
tvm_ffi next to TileLang's runtime libraries (they register the loader of the embedded cubin and the
functions the host code looks up by name, checked per library) and called with the kernel's arguments, which is all TileLang's own adapter does for a kernel whose outputs
are arguments (every flashqla kernel). Argument checks (devices, dtypes, shapes) live in that library.
"""
from __future__ import annotations

import ctypes
import functools
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

log = logging.getLogger("flashqla.kernels")

PREBUILT_ENV = "FLASHQLA_PREBUILT_KERNELS"
PACKAGED_PREBUILT = Path(__file__).resolve().parent / "prebuilt"
KERNEL_SOURCES = Path(__file__).resolve().parent / "hopper"
MANIFEST = "manifest.json"
INDEX_DIR = "flashqla-index"
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
    if "tilelang" in sys.modules:  # its env may have been set in code
        from tilelang import env

        return Path(env.TILELANG_CACHE_DIR)
    return Path(os.environ.get("TILELANG_CACHE_DIR", os.path.expanduser("~/.tilelang/cache")))


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
    publishes the same entry first, the rename fails and this copy is dropped. The copy goes one level
    below a directory made now: copytree gives a directory its source's timestamps, and a prebuilt entry is
    usually older than an hour, so a staged copy at the top would look stale to the cleanup a process
    starting beside this one runs, which would delete it before its rename.
    """
    copied = 0
    for index in prebuilt.glob(f"*/*/{INDEX_DIR}/*.json.gz"):
        target = cache / index.relative_to(prebuilt)
        if not target.exists():
            _publish(target, index.read_bytes())
    for relative, source in entries(prebuilt).items():
        target = cache / relative
        if target.exists():
            continue
        staging_root = cache / relative.parent.parent / ".staging"
        staging_root.mkdir(parents=True, exist_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_root / f"flashqla-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            staging.mkdir()
            shutil.copytree(source, staging / target.name)
            os.rename(staging / target.name, target)
            copied += 1
        except OSError:
            if not target.exists():  # not a lost race: a real failure
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return copied


def _publish(target: Path, data: bytes) -> None:
    """A small file written under a unique name and renamed into place (readers never see half of it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.write_bytes(data)
    os.replace(staging, target)


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


class LoadedKernel:
    """A cache entry's host library called through tvm_ffi with the kernel's arguments, in order.

    If its first call raises (say, a runtime function this process lacks), the kernel switches to
    `fallback()`, the same entry through TileLang's own loader, for good and repeats the call: the host
    code checks its arguments and looks up what it needs before it launches, so the failed call wrote
    nothing. Argument errors then surface from TileLang's loader the same way.
    """

    def __init__(self, entry: Path, module, fallback):
        self.entry = entry
        self._module = module
        self._fallback = fallback  # None once a call succeeded

    def __call__(self, *args):
        if self._fallback is None:
            return self._module(*args)
        try:
            result = self._module(*args)
        except Exception as exc:
            log.warning("flashqla: the direct load of kernel entry %s failed on its first call (%s: %s); "
                        "using TileLang's loader", self.entry.name, exc.__class__.__name__, exc)
            self._module = self._fallback()
            result = self._module(*args)
        self._fallback = None
        return result

    def get_kernel_source(self) -> str:
        return (self.entry / "device_kernel.cu").read_text()


def entry_of(kernel) -> Path | None:
    """The cache entry TileLang loaded `kernel` from or wrote it to (None when its cache is off)."""
    if isinstance(kernel, LoadedKernel):
        return kernel.entry
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


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """sha256 over the kernel sources: an index written by other kernel code never matches."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_SOURCES.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def index_key(label: str, compile_args: dict) -> str:
    """Names a kernel's index record; computed without importing tilelang."""
    configs = {str(getattr(k, "value", k)): v for k, v in (compile_args.get("pass_configs") or {}).items()}
    args = {**compile_args, "pass_configs": configs}
    fields = [label, json.dumps(args, sort_keys=True, default=str), importlib.metadata.version("tilelang"),
              _sources_digest()]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _ffi_runtime():
    """tvm_ffi with TileLang's runtime libraries loaded, or None. libtvm_runtime.so registers the loader of
    the embedded cubin and `__tvm_set_device`; libtilelang.so the TMA descriptor builders
    (`__tvm_tensormap_create_tiled`) the host code of a TMA kernel calls."""
    try:
        import tvm_ffi

        lib = Path(importlib.util.find_spec("tilelang").submodule_search_locations[0]) / "lib"
        for name in ("libtvm_runtime.so", "libtilelang.so"):
            ctypes.CDLL(str(lib / name), mode=ctypes.RTLD_GLOBAL)
        return tvm_ffi if tvm_ffi.get_global_func(_CUBIN_LOADER, allow_missing=True) is not None else None
    except Exception as exc:  # no tvm_ffi, another layout of the tilelang wheel: TileLang's loader then
        log.debug("flashqla: direct kernel loading unavailable (%s: %s)", exc.__class__.__name__, exc)
        return None


_CUBIN_LOADER = "ffi.Module.load_from_bytes.cuda"
_HOST_LOOKUP = re.compile(rb"__tvm_[a-z_]+")


def _resolvable(ffi, library: Path) -> bool:
    """Whether every runtime function the host library looks up by name is registered in this process."""
    names = {m.decode() for m in _HOST_LOOKUP.findall(library.read_bytes())}
    looked_up = {n for n in names if not n.startswith("__tvm_ffi_") and not n.endswith("_packed")}  # not handles
    return all(ffi.get_global_func(name, allow_missing=True) is not None for name in looked_up)


def _load_indexed(cache: Path, key: str, compile_args: dict, fallback):
    """The kernel the index names under `key`, loaded without building its PrimFunc; None on any miss.
    Directly through tvm_ffi unless `fallback` (what a direct load falls back to) is None."""
    found = list(cache.glob(f"*/*/{INDEX_DIR}/{key}.json.gz"))
    if len(found) != 1:
        return None
    try:
        record = json.loads(gzip.decompress(found[0].read_bytes()))
        entry = found[0].parent.parent / "kernels" / record["entry"]
        if not is_complete(entry):
            return None
        ffi = _ffi_runtime()
        library = entry / "executable.so"
        if fallback is not None and ffi is not None and _resolvable(ffi, library):
            return LoadedKernel(entry, ffi.load_module(str(library)), fallback)
        from tilelang import tvm
        from tilelang.cache import _resolve_cache_dispatch
        from tilelang.transform.pass_config import normalize_pass_configs

        # TileLang's own loader for this target's execution backend (tilelang.compile's path, minus the key)
        loader, context, _ = _resolve_cache_dispatch(compile_args.get("target"), None, None, False)
        kernel = loader._load_kernel_from_disk(
            record["entry"], context, None, normalize_pass_configs(compile_args.get("pass_configs")), None,
            tvm.ir.load_json(record["prim_func"]), False)
    except Exception as exc:  # a stale or foreign index entry: the normal path decides
        log.debug("flashqla: index entry %s not usable (%s: %s)", found[0], exc.__class__.__name__, exc)
        return None
    if kernel is not None and entry_of(kernel) == entry:
        return kernel
    return None


def _write_index(key: str, label: str, prim_func, entry: Path) -> None:
    from tilelang import tvm

    record = {"label": label, "entry": entry.name, "prim_func": tvm.ir.save_json(prim_func)}
    target = entry.parents[1] / INDEX_DIR / f"{key}.json.gz"
    try:
        _publish(target, gzip.compress(json.dumps(record).encode(), 6))
    except OSError as exc:  # a read-only cache still serves its entries
        log.debug("flashqla: could not write the kernel index %s (%s)", target, exc)


def compile_kernel(build, label: str, *, direct: bool = True, **compile_args):
    """`tilelang.compile(build(), **compile_args)` after seeding TileLang's cache from the prebuilt kernels.

    `build` makes the PrimFunc; it does not run when flashqla's index knows the cache entry (see the
    module docstring), which is then loaded through tvm_ffi unless `direct` is False. A load from the
    cache is silent; a real compile is logged once (the caller caches the result per configuration) with
    its duration and the reason no prebuilt kernel served it.
    """
    cache = tilelang_cache_dir()
    prebuilt = prebuilt_dir()
    missing_reason = _seed_once(prebuilt, cache)
    key = index_key(label, compile_args)
    fallback = functools.partial(compile_kernel, build, label, direct=False, **compile_args) if direct else None
    kernel = _load_indexed(cache, key, compile_args, fallback)
    if kernel is not None:
        return kernel
    try:
        import tilelang
    except Exception as exc:  # ImportError, or an ABI mismatch that aborts the import
        raise RuntimeError(f"flashqla needs tilelang to compile {label}, which no prebuilt or cached kernel "
                           f"serves, and tilelang does not import ({exc.__class__.__name__}: {exc})") from exc
    present = {entry.relative_to(cache) for entry in cache.glob("*/*/kernels/*")}  # names only: cheap
    start = time.perf_counter()
    prim_func = build()
    kernel = tilelang.compile(prim_func, **compile_args)
    entry = entry_of(kernel)
    if entry is None or relative_entry(entry) not in present:
        log.warning("flashqla: JIT-compiled %s in %.1f s: %s", label, time.perf_counter() - start,
                    _why_compiled(prebuilt, missing_reason, entry))
    if entry is not None:
        _write_index(key, label, prim_func, entry)
    return kernel
