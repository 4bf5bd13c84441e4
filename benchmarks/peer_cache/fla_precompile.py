"""Precompile FLA 0.6.0's TileLang kernels (its GDN backward's chunk_bwd_dqkwg) for sm_90a on a CPU-only machine.

    TILELANG_CACHE_DIR=/tmp/fla_cache PYTHONPATH=<extracted site>:<cloudpickle+ml_dtypes+einops> \
        python fla_precompile.py [--jobs 2] [--list] [--no-verify] [--verify-only] [--only REGEX]

1. dry run: FLA's real host code (fla.ops.gated_delta_rule.chunk_gated_delta_rule with and without a CP context)
   runs on CPU tensors as if on one H200 (fla_cpu.py) for every call in fla_scenarios.py; Triton launches are
   no-ops and each TileLang kernel factory call is recorded instead of compiled.
2. compile: each distinct factory call runs for real in a pool of processes; TileLang compiles it for
   {"kind": "cuda", "arch": "sm_90a"} into TILELANG_CACHE_DIR.
3. verify: a fresh process repeats the dry run with real factory calls; every kernel must come from the disk
   cache (0 compiles). Writes <cache>/fla_manifest.json.
Steps 2-3 are precompile.py's (precompile.Peer); this file holds FLA's dry run.
"""
from __future__ import annotations

import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import precompile  # noqa: E402


def dry_run(mode, only=None, log=print):
    """Run every scenario through FLA's host code; returns (recorder, hooks, failures)."""
    import fla_cpu
    import fla_scenarios as S

    fla_cpu.import_fla()
    hooks = fla_cpu.Hooks().install()
    rec = fla_cpu.make_recorder(mode)
    failures = []
    for label, kind, p in S.scenarios():
        if only and not re.search(only, label):
            continue
        rec.scenario = label
        n0, c0, k0 = len(rec.calls), len(hooks.compiles), len(hooks.keys)
        t0 = time.time()
        try:
            with fla_cpu.fake_h200():
                S.run(kind, p, "cpu")
        except Exception as exc:  # noqa: BLE001
            failures.append((label, f"{type(exc).__name__}: {exc}"))
            log(f"FAILED {label}: {type(exc).__name__}: {exc}")
            continue
        if mode == "load":
            log(f"{label}: {time.time() - t0:.1f}s, lookups {len(hooks.keys) - k0}, compiled {len(hooks.compiles) - c0}")
        elif len(rec.calls) > n0:
            log(f"{label}: +{len(rec.calls) - n0} new kernel configs ({time.time() - t0:.1f}s)")
    rec.restore()
    return rec, hooks, failures


def _metadata():
    import fla
    return dict(fla=getattr(fla, "__version__", "?"), env=dict(FLA_FLASH_QLA="0", FLA_DISABLE_BACKEND_DISPATCH="0"))


FLA = precompile.Peer("fla_cpu", "import_fla", "fla_precompile", "fla_manifest.json", _metadata)


if __name__ == "__main__":
    sys.exit(precompile.main(FLA, dry_run, __doc__))
