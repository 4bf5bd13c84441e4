"""On the H200: does FLA 0.6.0 find its Triton kernels in the carried Triton cache (no compile)?

    tar xJf .devpeer/fla_triton.tar.xz -C /tmp && export TRITON_CACHE_DIR=/tmp/fla_triton_cache
    PYTHONPATH=<extracted site> python benchmarks/peer_cache/fla_triton_check_gpu.py [--group gdn|bwd|cp|all]
        [--only REGEX] [--cp-tokens real|small] [--out results.json]

One FLA call per scenario of fla_triton_precompile.py (bench_gdn's 10 CONFIGS through impl_fla with
FLA_DISABLE_BACKEND_DISPATCH=1; bench_bwd's matrix through forward_fn("fla"), fwd+bwd then fwd, dispatch on;
bench_cp's make_fla on ranks 0 and 1 of 2 and the one-rank baseline, fwd then fwd+bwd, dispatch on, at bench_cp's
256K / 1M tokens unless --cp-tokens small, each rank through fla_scenarios.FakeDist on this one GPU), each group in
its own process (the scripts' env). Triton's compile entry is wrapped: per kernel, how many variants came
from the cache and how many compiled (misses, with their seconds); per call the wall time of its first run (the
autotuner still benchmarks every config on first use: that is in the wall time, not a compile).
First compares the Triton cache-key components (triton_key, ptxas, options, env) with the manifest, and points the
cache's group files (absolute paths, triton/runtime/cache.py FileCacheManager.get_group) at TRITON_CACHE_DIR if it
was unpacked elsewhere than /tmp/fla_triton_cache. bench_bwd's and bench_cp's groups also call FLA's one TileLang kernel: carry
fla_cache.tar.xz into TILELANG_CACHE_DIR, or its first calls include a TileLang JIT (not counted here).
Exit status 0 iff no Triton kernel compiled and no call failed.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def relocate(cache):
    """Rewrite the group files' absolute child paths to `cache` (Triton drops a child that does not exist, and a
    group without its metadata json is a miss). Returns the number of files rewritten."""
    n = 0
    for grp in glob.glob(os.path.join(cache, "*", "__grp__*.json")):
        data = json.load(open(grp))
        d = os.path.dirname(grp)
        new = {c: os.path.join(d, os.path.basename(p)) for c, p in data.get("child_paths", {}).items()}
        if new != data.get("child_paths"):
            json.dump({"child_paths": new}, open(grp, "w"))
            n += 1
    return n


def check_group(group, only, out, cp_mode="real"):
    os.environ["FLA_FLASH_QLA"] = "0"
    from fla_triton_precompile import GROUP_DISPATCH
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = GROUP_DISPATCH[group]
    import torch
    import triton
    from fla_scenarios import cp_inputs, cp_step
    from fla_triton_precompile import CompileTracker, cp_tokens, key_components, run_scenario, scenarios
    tracker = CompileTracker(log=lambda s: print(s, flush=True)).install()
    from triton.runtime import build
    gcc = []                                    # C launchers / cuda_utils not in the cache: built with gcc here
    orig_build = build._build

    def _build(name, *a, **k):
        t0 = time.perf_counter()
        try:
            return orig_build(name, *a, **k)
        finally:
            gcc.append((name, tracker.scenario, round(time.perf_counter() - t0, 2)))
    build._build = _build
    import fla  # noqa: F401
    from bench_gdn import make_inputs
    comps = key_components()
    res = dict(group=group, gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               fla=getattr(fla, "__version__", "?"), key_components=comps, calls=[])
    print(f"[{group}] {res['gpu']} torch {res['torch']} triton {res['triton']} fla {res['fla']}", flush=True)
    for label, grp, p in scenarios():
        if grp != group or (only and not re.search(only, label)):
            continue
        tracker.scenario = label
        n0 = len(tracker.events)
        dev = torch.device("cuda", torch.cuda.current_device())
        if group == "cp":
            T = cp_tokens(p, cp_mode)
            inputs = cp_inputs(p, T, dev, fill=True)
        else:
            inputs = make_inputs(p["Hqk"], p["Hv"], p["seqs"])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        err = None
        try:
            if group == "cp":
                cp_step(p, T, inputs, dev)
            else:
                run_scenario(group, p, inputs)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"[:300]
        wall = time.perf_counter() - t0
        evs = tracker.events[n0:]
        miss = [e for e in evs if not e["hit"]]
        res["calls"].append(dict(scenario=label, wall_s=round(wall, 2), lookups=len(evs), compiles=len(miss),
                                 launcher_builds=sum(1 for g in gcc if g[1] == label),
                                 compile_s=round(sum(e["seconds"] for e in miss), 2), error=err))
        print(f"{label}: first call {wall:.1f}s, {len(evs)} kernel variants loaded/compiled, {len(miss)} compiled "
              f"({sum(e['seconds'] for e in miss):.1f}s){' FAILED ' + err if err else ''}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    per = collections.OrderedDict()
    for e in tracker.events:
        k = per.setdefault(e["kernel"], dict(hits=0, compiles=0, compile_s=0.0))
        k["hits" if e["hit"] else "compiles"] += 1
        if not e["hit"]:
            k["compile_s"] = round(k["compile_s"] + e["seconds"], 2)
    res["kernels"] = per
    res["gcc_builds"] = gcc
    json.dump(res, open(out, "w"), indent=1)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", default="all", choices=["gdn", "bwd", "cp", "all"])
    ap.add_argument("--cp-tokens", default="real", choices=["real", "small"],
                    help="bench_cp's calls at its token counts (real) or at fla_triton_precompile.CP_SMALL_T")
    ap.add_argument("--only", default=None, help="regex on the scenario labels")
    ap.add_argument("--out", default="fla_triton_check.json")
    ap.add_argument("--no-relocate", action="store_true")
    ap.add_argument("--relocate-only", action="store_true", help="only point the group files at TRITON_CACHE_DIR")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return check_group(args.group, args.only, args.out, args.cp_tokens)
    cache = os.environ.get("TRITON_CACHE_DIR")
    mpath = os.path.join(cache or "", "fla_triton_manifest.json")
    if not cache or not os.path.exists(mpath):
        print("TRITON_CACHE_DIR must hold the carried cache (fla_triton_manifest.json)", file=sys.stderr)
        return 2
    manifest = json.load(open(mpath))
    if not args.no_relocate:
        n = relocate(cache)
        print(f"pointed {n} group files at {cache}" if n else f"group files already point at {cache}")
    if args.relocate_only:
        return 0
    from fla_triton_precompile import key_components
    mine, theirs = key_components(), manifest.get("key_components") or {}
    diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
    print("cache-key components " + ("match the manifest" if not diff else f"DIFFER (manifest, here): {diff}"), flush=True)
    groups = ["gdn", "bwd", "cp"] if args.group == "all" else [args.group]
    results, t_all = [], time.time()
    for g in groups:
        path = f"{args.out}.{g}"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--group", g, "--out", path,
               "--cp-tokens", args.cp_tokens]
        rc = subprocess.call(cmd + (["--only", args.only] if args.only else []))
        if rc != 0 or not os.path.exists(path):
            print(f"[{g}] worker failed (rc {rc})")
            results.append(dict(group=g, error=f"rc {rc}", calls=[], kernels={}))
            continue
        results.append(json.load(open(path)))
        os.remove(path)
    calls = [c for r in results for c in r["calls"]]
    compiles = sum(c["compiles"] for c in calls)
    failed = [c for c in calls if c["error"]] + [r for r in results if r.get("error")]
    print(f"\n{len(calls)} calls, {sum(c['lookups'] for c in calls)} kernel variants, {compiles} compiled "
          f"({sum(c['compile_s'] for c in calls):.1f}s), "
          f"{sum(len(r.get('gcc_builds', [])) for r in results)} C launchers built, {len(failed)} failed; first calls {sum(c['wall_s'] for c in calls):.0f}s, "
          f"total {time.time() - t_all:.0f}s")
    for r in results:
        for name, k in r.get("kernels", {}).items():
            if k["compiles"]:
                print(f"  [{r['group']}] MISS {name}: {k['compiles']} compiled ({k['compile_s']}s), {k['hits']} from cache")
    json.dump(dict(key_components_diff=diff, groups=results), open(args.out, "w"), indent=1)
    print(f"wrote {args.out}")
    return 0 if compiles == 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
