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
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


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
                if kind == "cp":
                    with S.FakeDist(p["world"], p["rank"]) as fd:
                        S.run(kind, p, "cpu", fd.group)
                else:
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


def _worker_init():
    import fla_cpu
    fla_cpu.import_fla()
    global HOOKS
    HOOKS = fla_cpu.Hooks().install()


def _compile_one(item):
    import fla_cpu
    sig, name, args, kwargs = item
    n0, k0 = len(HOOKS.compiles), len(HOOKS.keys)
    t0 = time.time()
    fla_cpu.resolve_jit(name)(*args, **kwargs)
    keys = HOOKS.keys[k0:]
    return dict(sig=sig, seconds=round(time.time() - t0, 1), compiled=len(HOOKS.compiles) > n0,
                key=keys[-1] if keys else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true", help="dry run only: list the distinct kernel configurations")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--verify-only", action="store_true")
    ap.add_argument("--only", default=None, help="regex on scenario labels")
    args = ap.parse_args()
    if "TILELANG_CACHE_DIR" not in os.environ and not args.list:
        ap.error("set TILELANG_CACHE_DIR")
    cache = os.environ.get("TILELANG_CACHE_DIR")
    t_start = time.time()
    if args.verify_only:
        return verify(cache, args.only)

    rec, _, failures = dry_run("record", args.only)
    calls = sorted(rec.calls.items())
    print(f"\n{len(calls)} distinct kernel configurations from the dry run ({time.time() - t_start:.0f}s):")
    for sig, c in calls:
        print(f"  {sig}   [{len(c['scenarios'])} scenarios]")
    if failures:
        print(f"{len(failures)} scenarios failed in the dry run")
    if args.list:
        return 1 if failures else 0

    items = [(sig, c["name"], c["args"], c["kwargs"]) for sig, c in calls]
    results = {}
    t0 = time.time()
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn"),
                                initializer=_worker_init) as ex:
        futs = {ex.submit(_compile_one, it): it[0] for it in items}
        for i, f in enumerate(cf.as_completed(futs), 1):
            sig = futs[f]
            try:
                r = f.result()
            except Exception as exc:  # noqa: BLE001
                r = dict(sig=sig, error=f"{type(exc).__name__}: {exc}")
            results[sig] = r
            state = r.get("error") or ("compiled" if r["compiled"] else "cached")
            print(f"[{i}/{len(items)}] {r.get('seconds', '-')}s {state}: {sig}", flush=True)
    t_compile = time.time() - t0

    import fla
    manifest = dict(
        fla=getattr(fla, "__version__", "?"), env=dict(FLA_FLASH_QLA="0", FLA_DISABLE_BACKEND_DISPATCH="0"),
        target=os.environ.get("TILELANG_DEFAULT_TARGET"), built=time.strftime("%Y-%m-%d %H:%M:%S"),
        target_str=next((r["key"]["target"] for r in results.values() if r.get("key")), None),
        kernels=[dict(sig=sig, factory=c["name"], key=(results[sig].get("key") or {}).get("key"),
                      kernel=(results[sig].get("key") or {}).get("kernel"), record=results[sig].get("key"),
                      seconds=results[sig].get("seconds"), compiled=results[sig].get("compiled"),
                      error=results[sig].get("error"), scenarios=c["scenarios"]) for sig, c in calls],
        dry_run_failures=failures)
    with open(os.path.join(cache, "fla_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    n_err = sum(1 for r in results.values() if "error" in r)
    print(f"\ncompile phase: {t_compile:.0f}s with {args.jobs} processes, {n_err} errors")
    rc = 0
    if not args.no_verify:
        rc = verify(cache, args.only)
    print(f"total {time.time() - t_start:.0f}s")
    return 1 if (n_err or failures or rc) else 0


def verify(cache, only=None):
    """Fresh process: every scenario with real factory calls; report compiles (should be none)."""
    cmd = [sys.executable, "-c", (
        "import sys; sys.path.insert(0, %r); import fla_precompile as p; rec, hooks, fails = p.dry_run('load', %r); "
        "print('VERIFY compiles=%%d lookups=%%d distinct_keys=%%d failures=%%d' %% (len(hooks.compiles), "
        "len(hooks.keys), len({k['key'] for k in hooks.keys}), len(fails))); "
        "print('VERIFY compiled:', sorted(set(hooks.compiles))); "
        "sys.exit(1 if hooks.compiles or fails else 0)") % (HERE, only)]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    print(f"\nverify (fresh process, {time.time() - t0:.0f}s):\n" + out.stdout)
    if out.returncode:
        print(out.stderr[-3000:])
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
