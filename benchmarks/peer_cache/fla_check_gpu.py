"""On the H200: does FLA 0.6.0 find its TileLang kernels in the carried cache (no JIT compile)?

    tar xJf .devpeer/fla_cache.tar.xz -C /tmp && cp -r /tmp/fla_cache/. $TILELANG_CACHE_DIR/
    TILELANG_CACHE_DIR=... PYTHONPATH=<extracted site> python benchmarks/peer_cache/fla_check_gpu.py [--all] [--allow-compile]

By default one call per precompiled kernel (fla_manifest.json: the scenario with the fewest tokens that needs
it); --all runs every scenario of fla_scenarios.py (the CP ranks through a torch.distributed stand-in on the one
GPU). Prints per call the wall time, disk loads and compiles (FLA's Triton kernels still compile / autotune
on first use: that time is in the first calls). A TileLang compile is refused unless --allow-compile.
Exit status 0 iff nothing was compiled and nothing failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback

os.environ["FLA_FLASH_QLA"] = "0"
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-compile", action="store_true")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--only", default=None, help="regex on the scenario labels")
    args = ap.parse_args()
    cache = os.environ.get("TILELANG_CACHE_DIR")
    mpath = os.path.join(cache or "", "fla_manifest.json")
    if not cache or not os.path.exists(mpath):
        print("TILELANG_CACHE_DIR must hold the carried FLA cache (fla_manifest.json)", file=sys.stderr)
        return 2
    manifest = json.load(open(mpath))
    import torch
    from check_gpu import CompileRefused, explain_miss, install_hooks
    st = install_hooks(args.allow_compile)
    import fla
    import fla_scenarios as S

    todo = S.scenarios()
    if not args.all:
        want = set()
        for k in manifest["kernels"]:
            want.add(min(k["scenarios"], key=lambda s: (int(re.search(r"T=(\d+)", s).group(1)), s)))
        todo = [s for s in todo if s[0] in want]
    if args.only:
        todo = [s for s in todo if re.search(args.only, s[0])]
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()} fla {fla.__version__} torch {torch.__version__}; {len(todo)} calls")
    bad = 0
    t_start = time.time()
    for label, kind, p in todo:
        l0, c0, m0 = st["loads"], len(st["compiles"]), len(st["misses"])
        torch.cuda.synchronize()
        t0 = time.time()
        err = None
        try:
            S.run(kind, p, dev, fill=True)
            torch.cuda.synchronize()
        except CompileRefused as exc:
            err = str(exc)
        except torch.cuda.OutOfMemoryError as exc:
            err = f"OutOfMemoryError: {str(exc)[:120]}"
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        n_comp = len(st["compiles"]) - c0
        bad += bool(n_comp or err)
        status = "OK" if not (n_comp or err) else ("COMPILED" if n_comp and not err else "FAIL")
        print(f"{status:8s} {time.time() - t0:7.2f}s  disk loads {st['loads'] - l0}  compiles {n_comp}  | {label}"
              + (f"\n    {err}" if err else ""), flush=True)
        for miss in st["misses"][m0:]:
            print(f"    miss: kernel {miss.get('kernel')} key {miss.get('key')}\n{explain_miss(miss, manifest)}")
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t_start:.0f}s: {len(todo)} calls, {st['loads']} disk loads, "
          f"{len(st['compiles'])} compiles, {bad} calls compiled or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
