"""Precompile flash-qla 0.1.3's TileLang kernels for sm_90a on a CPU-only machine into a TileLang disk cache.

    TILELANG_CACHE_DIR=/tmp/fqla_cache PYTHONPATH=<extracted site>[:<cloudpickle+ml_dtypes>] \
        python precompile.py [--jobs 2] [--list] [--no-verify] [--only REGEX]

1. dry run: flash-qla's real host code (flash_qla.chunk_gated_delta_rule / _fwd / dual CP) runs on CPU tensors
   pretending to be one H200 (sm_90, 132 SMs; fqla_cpu.py), for every call in scenarios.py; each TileLang
   kernel factory call is recorded instead of compiled, and its kernel is a no-op stub.
2. compile: each distinct factory call is run for real in a pool of processes; TileLang compiles it for
   target {"kind": "cuda", "arch": "sm_90a"} and writes it to TILELANG_CACHE_DIR.
3. verify: a fresh process repeats the dry run with real factory calls; every kernel must come from the disk
   cache (0 compiles). Writes <cache>/fqla_manifest.json (factory call, cache key, scenarios) and prints a summary.
The compile and verify steps serve fla_precompile.py too (`Peer`).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def dry_run(mode, only=None, log=print):
    """Run every scenario through flash-qla's host code; returns (recorder, hooks, failures)."""
    import fqla_cpu
    import scenarios as S

    fqla_cpu.import_flash_qla()
    hooks = fqla_cpu.Hooks().install()
    rec = fqla_cpu.Recorder(mode)
    failures = []
    todo = [("single", s) for s in S.single_gpu_scenarios()] + [("dual", s) for s in S.dual_scenarios()]
    for fam, s in todo:
        label = s[0]
        if only and not re.search(only, label):
            continue
        rec.scenario = label
        n0, c0 = len(rec.calls), len(hooks.compiles)
        t0 = time.time()
        try:
            with fqla_cpu.fake_cuda():
                if fam == "single":
                    S.run_single(*s[1:], device="cpu")
                else:
                    _, _, Hqk, Hv, T, world, rank = s
                    with S.FakeDist(world, rank) as fd:
                        S.run_dual(Hqk, Hv, T, world, rank, "cpu", fd.group)
        except Exception as exc:  # noqa: BLE001
            failures.append((label, f"{type(exc).__name__}: {exc}"))
            log(f"FAILED {label}: {type(exc).__name__}: {exc}")
            continue
        if mode == "load":
            log(f"{label}: {time.time() - t0:.1f}s, compiled {len(hooks.compiles) - c0}")
        elif len(rec.calls) > n0:
            log(f"{label}: +{len(rec.calls) - n0} new kernel configs")
    rec.restore()
    return rec, hooks, failures


@dataclass(frozen=True)
class Peer:
    """What differs between the peers whose kernels are precompiled (FlashQLA here, FLA in fla_precompile.py)."""

    cpu_module: str  # fqla_cpu / fla_cpu: Hooks, resolve_jit and the importer below
    importer: str  # its function that imports the peer as on an H200
    runner: str  # the module whose dry_run(mode, only) runs every scenario (for the fresh verify process)
    manifest: str  # file written into the cache
    metadata: Callable[[], dict]  # the manifest's description of the peer
    order: Callable[[str, dict], object] = lambda sig, call: sig  # compile order of the recorded calls


FLASH_QLA = Peer("fqla_cpu", "import_flash_qla", "precompile", "fqla_manifest.json", lambda: dict(flash_qla="0.1.3"),
                 lambda sig, call: (COST.get(call["name"].split(":")[1], 9), sig))


def _worker_init(cpu_module: str, importer: str):
    global CPU, HOOKS
    CPU = importlib.import_module(cpu_module)
    getattr(CPU, importer)()
    HOOKS = CPU.Hooks().install()


def _compile_one(item):
    sig, name, args, kwargs = item
    n0, k0 = len(HOOKS.compiles), len(HOOKS.keys)
    t0 = time.time()
    CPU.resolve_jit(name)(*args, **kwargs)
    keys = HOOKS.keys[k0:]
    return dict(sig=sig, seconds=round(time.time() - t0, 1), compiled=len(HOOKS.compiles) > n0,
                key=keys[-1] if keys else None)


COST = {"tilelang_fused_chunk_gdr_bwd": 0, "tilelang_fused_chunk_gdr_fwd": 1, "tilelang_prepare_dh_ws": 2,
        "tilelang_prepare_h": 3, "tilelang_correct_h0": 4, "tilelang_kkt_solve": 5}


def main(peer: Peer = FLASH_QLA, dry_run=dry_run, doc=__doc__):
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--list", action="store_true", help="dry run only: list the distinct kernel configurations")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--only", default=None, help="regex on scenario labels")
    ap.add_argument("--verify-only", action="store_true")
    args = ap.parse_args()
    if "TILELANG_CACHE_DIR" not in os.environ and not args.list:
        ap.error("set TILELANG_CACHE_DIR")
    cache = os.environ.get("TILELANG_CACHE_DIR")
    t_start = time.time()

    if args.verify_only:
        return verify(peer, cache, args.only)

    rec, _, failures = dry_run("record", args.only)
    calls = sorted(rec.calls.items(), key=lambda kv: peer.order(*kv))
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
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, initializer=_worker_init,
                                initargs=(peer.cpu_module, peer.importer)) as ex:
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

    manifest = dict(
        **peer.metadata(), target=os.environ.get("TILELANG_DEFAULT_TARGET"), built=time.strftime("%Y-%m-%d %H:%M:%S"),
        target_str=next((r["key"]["target"] for r in results.values() if r.get("key")), None),
        kernels=[dict(sig=sig, factory=c["name"], key=(results[sig].get("key") or {}).get("key"),
                      kernel=(results[sig].get("key") or {}).get("kernel"),
                      record=results[sig].get("key"),
                      seconds=results[sig].get("seconds"), compiled=results[sig].get("compiled"),
                      error=results[sig].get("error"), scenarios=c["scenarios"]) for sig, c in calls],
        dry_run_failures=failures)
    with open(os.path.join(cache, peer.manifest), "w") as f:
        json.dump(manifest, f, indent=1)
    n_err = sum(1 for r in results.values() if "error" in r)
    print(f"\ncompile phase: {t_compile:.0f}s with {args.jobs} processes, {n_err} errors")
    rc = 0
    if not args.no_verify:
        rc = verify(peer, cache, args.only)
    print(f"total {time.time() - t_start:.0f}s")
    return 1 if (n_err or failures or rc) else 0


def verify(peer: Peer, cache, only=None):
    """Fresh process: every scenario with real factory calls; fails if any kernel compiles (none should)."""
    cmd = [sys.executable, "-c", (
        "import sys; sys.path.insert(0, %r); import %s as p; rec, hooks, fails = p.dry_run('load', %r); "
        "print('VERIFY compiles=%%d lookups=%%d distinct_keys=%%d failures=%%d' %% (len(hooks.compiles), "
        "len(hooks.keys), len({k['key'] for k in hooks.keys}), len(fails))); "
        "print('VERIFY compiled:', sorted(set(hooks.compiles))); "
        "sys.exit(1 if hooks.compiles or fails else 0)") % (HERE, peer.runner, only)]
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("VERIFY") or "FAILED" in line]
    print(f"\nverify (fresh process, {time.time() - t0:.0f}s):\n" + "\n".join(lines))
    if out.returncode:
        print(out.stderr[-3000:])
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
