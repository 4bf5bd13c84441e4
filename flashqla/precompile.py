"""Compile every kernel dispatch can choose into a TileLang cache, in parallel, without a GPU.

The kernels target sm_90a explicitly, so nvcc alone builds them; TileLang then loads the cache entries
on any H200 with the same TileLang version and platform (docs/prebuilt_kernels.md). What to compile is
`kernel_configs()` below, which chains those of the kernel host modules (the GDN kernels of
kernels/hopper/launch.py, the layer ops of kernels/hopper/layer_ops.py): new kernels are picked up
when they are listed there.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

log = logging.getLogger("flashqla.precompile")

DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel configuration and the cache entry that now holds it."""

    kernel: str  # e.g. "compiled_fused_fwd('bfloat16', 64)"
    entry: Path  # <cache_dir>/<tilelang version>/<platform>/kernels/<key>
    seconds: float
    compiled: bool  # False: the entry was already in the cache


def precompile(cache_dir=None, jobs=None, dtypes=("bf16", "fp16"), heads=None, progress=True):
    """Compiles every kernel configuration for `dtypes` into `cache_dir`; returns a CompiledKernel each.

    cache_dir: the TileLang cache to fill (default: the one TileLang uses now, TILELANG_CACHE_DIR or
        ~/.tilelang/cache); ship it inside the package (`kernels/prebuilt`) or point
        FLASHQLA_PREBUILT_KERNELS or TILELANG_CACHE_DIR at it.
    jobs: compile processes (default: one per kernel, at most one per CPU).
    dtypes: names among bf16, fp16 (or bfloat16, float16).
    heads: (Hqk, Hv) pairs. No kernel is specialised by head count today (heads are runtime sizes), so
        they only get validated and noted; head-specialised kernels would take them in kernel_configs().
    progress: a tqdm bar when tqdm is importable (each kernel is logged either way).
    """
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # ImportError, or an ABI mismatch that aborts the import
        raise RuntimeError(f"precompile needs tilelang ({exc}); pip install 'flashqla[tilelang]'") from exc
    from flashqla.kernels.cache import tilelang_cache_dir

    tl_dtypes = _tilelang_dtypes(dtypes)
    heads = _checked_heads(heads)
    cache_dir = Path(cache_dir if cache_dir is not None else tilelang_cache_dir()).expanduser().resolve()
    configs = [(builder.__module__, builder.__name__, args) for builder, args in kernel_configs(tl_dtypes)]
    if jobs is None:
        jobs = min(len(configs), os.cpu_count() or 1)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    if heads:
        log.info("kernels are not specialised by head count: the %d kernels below serve every head "
                 "configuration, including %s", len(configs), ", ".join(f"{hqk}:{hv}" for hqk, hv in heads))

    log.info("compiling %d kernels for sm_90a (%s) into %s with %d processes",
             len(configs), ", ".join(tl_dtypes), cache_dir, jobs)
    start = time.perf_counter()
    results, failures = [], []
    with contextlib.ExitStack() as stack:
        bar = _progress_bar(len(configs), stack) if progress else None
        pool = stack.enter_context(ProcessPoolExecutor(
            max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_worker,
            initargs=(str(cache_dir),)))
        futures = {pool.submit(_compile_one, *config): config for config in configs}
        for future in as_completed(futures):
            module, name, args = futures[future]
            label = f"{name}{args}"
            try:
                result = future.result()
            except Exception as exc:  # a lowering/nvcc error, or a worker killed (e.g. out of memory)
                failures.append(f"{label}: {exc.__class__.__name__}: {exc}")
                log.error("[%d/%d] %s failed: %s", len(results) + len(failures), len(configs), label, exc)
            else:
                results.append(result)
                log.info("[%d/%d] %s %s in %.1f s -> %s", len(results) + len(failures), len(configs), label,
                         "compiled" if result.compiled else "already cached", result.seconds, result.entry.name)
            if bar is not None:
                bar.update(1)
    if failures:
        raise RuntimeError(f"precompile failed for {len(failures)} of {len(configs)} kernels:\n" + "\n".join(failures))
    size = sum(f.stat().st_size for r in results for f in r.entry.iterdir())
    log.info("%d kernels (%d compiled, %d already cached), %.1f MB of entries, in %.1f s",
             len(results), sum(r.compiled for r in results), sum(not r.compiled for r in results),
             size / 2**20, time.perf_counter() - start)
    return sorted(results, key=lambda r: r.kernel)


def preload_kernels(dtypes=("bf16",)) -> str | None:
    """Loads every kernel configuration for `dtypes` into this process now.

    The first forward and backward then load no kernels (a few ms each through flashqla's cache index,
    which does not import TileLang; a JIT compile where nothing prebuilt serves them). Call it once at
    start-up, e.g. while the data loader warms up. Needs no GPU. Returns None, or why the TileLang
    kernels cannot be used in this process (then nothing is loaded and the torch backend serves calls).
    """
    from flashqla.ops.backends import _hopper_kernels

    tl_dtypes = _tilelang_dtypes(dtypes)
    _, reason = _hopper_kernels()
    if reason:
        return reason
    for builder, args in kernel_configs(tl_dtypes):
        builder(*args)
    return None


def kernel_configs(tl_dtypes):
    """Every (compiled-kernel builder, args) pair for TileLang dtypes `tl_dtypes`: the GDN kernels, then the
    fused layer ops (short conv, gated RMSNorm; their fp32 variants compile on first use)."""
    from flashqla.kernels.hopper import launch, layer_ops

    yield from launch.kernel_configs(tl_dtypes)
    yield from layer_ops.kernel_configs(tl_dtypes)


def _tilelang_dtypes(dtypes) -> tuple[str, ...]:
    if isinstance(dtypes, str):
        dtypes = dtypes.split(",")
    names = tuple(dict.fromkeys(DTYPE_NAMES.get(str(d).strip().lower()) for d in dtypes))
    if not names or None in names:
        raise ValueError(f"dtypes must be a non-empty list of {sorted(DTYPE_NAMES)}, got {dtypes!r}")
    return names


def _checked_heads(heads) -> list[tuple[int, int]]:
    """(Hqk, Hv) pairs from pairs or a string "16:32,8:16"; Hv must be a multiple of Hqk."""
    if heads is None:
        return []
    if isinstance(heads, str):
        try:
            heads = [tuple(int(n) for n in pair.split(":")) for pair in heads.split(",")]
        except ValueError:
            raise ValueError(f"heads must look like 'Hqk:Hv,Hqk:Hv' (e.g. '16:32,8:16'), got {heads!r}") from None
    checked = []
    for pair in heads:
        if len(pair) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in pair) \
                or pair[1] % pair[0]:
            raise ValueError(f"heads must be (Hqk, Hv) pairs of positive ints with Hv % Hqk == 0, got {pair!r}")
        checked.append(tuple(pair))
    return checked


def _progress_bar(total, stack):
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        return None  # the "[done/total]" prefix of each log line is the progress report
    stack.enter_context(logging_redirect_tqdm())
    return stack.enter_context(tqdm(total=total, unit="kernel", desc="flashqla precompile"))


def _init_worker(cache_dir: str):
    """A spawned compile process: TileLang's cache is `cache_dir`, nothing is copied in from prebuilt kernels."""
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    os.environ["FLASHQLA_PREBUILT_KERNELS"] = "off"
    import tilelang  # sets its logger to INFO on import

    tilelang.set_log_level("WARNING")  # the parent logs one line per kernel
    logging.getLogger("flashqla.kernels").setLevel(logging.ERROR)  # "JIT-compiled" is the point here


def _compile_one(module: str, name: str, args: tuple) -> CompiledKernel:
    from flashqla.kernels import cache

    builder = getattr(importlib.import_module(module), name)
    present = set(cache.entries(cache.tilelang_cache_dir()))
    start = time.perf_counter()
    kernel = builder(*args)
    seconds = time.perf_counter() - start
    entry = cache.entry_of(kernel)
    if entry is None:
        raise RuntimeError("TileLang's cache is disabled in this process (TILELANG_DISABLE_CACHE)")
    return CompiledKernel(f"{name}{args}", entry.resolve(), seconds, cache.relative_entry(entry) not in present)
