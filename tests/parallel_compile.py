"""Compile kernel configurations for sm_90a into TileLang's cache with one process per CPU.

The compile tests call this once per module (a fixture), so their per-configuration tests only load the
entries: the same lowering and nvcc run per configuration, on both CI cores instead of one. A kernel that
fails to lower fails the fixture, with every failing configuration named.
"""
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context


def spawned_pool(tasks: int, **kwargs) -> ProcessPoolExecutor:
    """A pool of spawned processes (TileLang and CUDA state are not fork-safe), one per task up to one per CPU."""
    return ProcessPoolExecutor(max_workers=min(tasks, os.cpu_count() or 1), mp_context=get_context("spawn"), **kwargs)


def compile_all(configs) -> None:
    """configs: (builder, args) pairs, as `kernel_configs()` yields them."""
    from flashqla.kernels.cache import tilelang_cache_dir
    from flashqla.precompile import _compile_one, _init_worker

    with spawned_pool(len(configs), initializer=_init_worker, initargs=(str(tilelang_cache_dir()),)) as pool:
        list(pool.map(_compile_one, *zip(*[(b.__module__, b.__name__, a) for b, a in configs])))
