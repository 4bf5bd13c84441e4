"""On the H200: does flash-qla 0.1.3 find every TileLang kernel in the carried cache (no JIT compile)?

    tar xJf fqla_cache.tar.xz -C /tmp            # -> /tmp/fqla_cache
    TILELANG_CACHE_DIR=/tmp/fqla_cache PYTHONPATH=<extracted site> python check_gpu.py [--allow-compile] [--only REGEX]
    # real 2-rank dual CP (optional, 2 GPUs):
    TILELANG_CACHE_DIR=... PYTHONPATH=... torchrun --nproc-per-node 2 check_gpu.py --dual-only

Runs one flash-qla call per configuration of scenarios.py (fwd+bwd through the autograd op, the autograd op
under no_grad, chunk_gated_delta_rule_fwd as bench_gdn calls it, and dual CP). In a single process the dual-CP
calls of rank 0 and rank 1 of 2 (and of the 1-rank baseline) run on the one GPU with a stand-in for
torch.distributed (each rank's all-gather sees its own state): the kernels and their TileLang keys are the ones
a real 2-rank run builds; the numbers are not meaningful.

Per call it prints the wall time, how many kernels were loaded from the disk cache and how many TileLang
compiled. By default a compile is refused (the call fails at once, with the key and what differs from the
precompiled entry of the same factory call, see fqla_manifest.json in the cache), so the script never spends
minutes in nvcc; --allow-compile lets TileLang compile instead. Exit status 0 iff nothing was compiled.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class CompileRefused(RuntimeError):
    pass


def install_hooks(allow_compile):
    from tilelang.cache.kernel_cache import KernelCache
    from tilelang.jit.kernel import JITKernel
    from tilelang.utils.language import get_prim_func_name

    st = dict(keys=[], loads=0, compiles=[], misses=[])
    orig_key, orig_load, orig_compile = (KernelCache._generate_key, KernelCache._load_kernel_from_disk,
                                         JITKernel._compile_and_create_adapter)

    def _generate_key(self, func, out_idx, execution_backend="tvm_ffi", args=None, target="auto", target_host=None,
                      pass_configs=None, compile_flags=None):
        key = orig_key(self, func, out_idx, execution_backend, args, target, target_host, pass_configs, compile_flags)
        st["keys"].append(dict(kernel=get_prim_func_name(func, "?"), key=key, target=str(target),
                               target_host=str(target_host) if target_host else None, backend=execution_backend,
                               pass_configs={str(k): v for k, v in (pass_configs or {}).items()},
                               func_sha=hashlib.sha256(func.script(show_meta=True).encode()).hexdigest(),
                               base=KernelCache._get_base_key(), path=self._get_cache_path(key)))
        return key

    def _load(self, key, *a, **k):
        kern = orig_load(self, key, *a, **k)
        if kern is not None:
            st["loads"] += 1
        else:
            st["misses"].append(dict(st["keys"][-1]) if st["keys"] else dict(key=key))
        return kern

    def _compile(self, func, out_idx):
        name = str(func.attrs.get("global_symbol", "?"))
        st["compiles"].append(name)
        if not allow_compile:
            raise CompileRefused(f"TileLang would compile {name} (not in the cache); refused (--allow-compile to permit)")
        return orig_compile(self, func, out_idx)

    KernelCache._generate_key = _generate_key
    KernelCache._load_kernel_from_disk = _load
    JITKernel._compile_and_create_adapter = _compile
    return st


def explain_miss(miss, manifest):
    """Compare a missed key's ingredients with the precompiled entries of the same kernel name."""
    if not manifest:
        return "  (no fqla_manifest.json in the cache to compare with)"
    same = [k for k in manifest["kernels"] if k.get("kernel") == miss.get("kernel") and k.get("record")]
    if not same:
        return f"  no precompiled entry for kernel {miss.get('kernel')}"
    out = []
    for field in ("target", "target_host", "backend", "pass_configs", "base"):
        vals = {json.dumps(k["record"].get(field), sort_keys=True) for k in same}
        mine = json.dumps(miss.get(field), sort_keys=True)
        if mine not in vals:
            out.append(f"  {field}: here {mine} vs precompiled {sorted(vals)[:2]}")
    if not out:
        out.append("  target/backend/pass_configs/version all match the precompiled entries: the TIR differs "
                   "(a static argument of the kernel factory: heads, dtypes, flags, block_DV, scale)")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-compile", action="store_true")
    ap.add_argument("--only", default=None, help="regex on the call labels")
    ap.add_argument("--dual-only", action="store_true")
    ap.add_argument("--no-dual", action="store_true")
    args = ap.parse_args()

    t_start = time.time()
    cache = os.environ.get("TILELANG_CACHE_DIR")
    if not cache or not os.path.isdir(cache):
        print("TILELANG_CACHE_DIR must point at the carried cache", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    import tilelang
    st = install_hooks(args.allow_compile)
    import flash_qla
    import scenarios as S
    from tilelang.backend.module import create_backend_context

    torchrun = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank = 0
    if torchrun:
        dist.init_process_group("nccl")
        rank = dist.get_rank()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    manifest = None
    mpath = os.path.join(cache, "fqla_manifest.json")
    if os.path.exists(mpath):
        manifest = json.load(open(mpath))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"GPU {props.name}, {props.multi_processor_count} SMs (precompiled for 132), cc {props.major}.{props.minor}; "
        f"tilelang {tilelang.__version__}, flash_qla {flash_qla.__version__}, torch {torch.__version__}")
    from tilelang.env import env as tl_env
    # what TileLang's cache key will contain (tilelang/cache/__init__.py _resolve_cache_dispatch)
    tgt = str(create_backend_context(tl_env.get_default_target(), None, tl_env.get_default_execution_backend()).target)
    want = manifest and manifest.get("target_str")
    say(f"resolved target: {tgt}" + ("" if not want else ("  [matches the precompiled one]" if tgt == want else
                                                          f"  [DIFFERS from the precompiled {want}]")))
    for var in ("TILELANG_DEFAULT_TARGET", "TILELANG_EXECUTION_BACKEND", "TILELANG_LAYOUT_COST_MODEL",
                "TILELANG_KERNEL_CACHE_USE_LIB_STAMP", "TILELANG_DISABLE_CACHE"):
        if os.environ.get(var):
            say(f"note: {var}={os.environ[var]}")

    calls = []
    if not args.dual_only and not torchrun:
        calls += [("single", s) for s in S.single_gpu_scenarios()]
    if not args.no_dual:
        if torchrun:
            calls += [("dual-real", s) for s in S.dual_scenarios() if s[5] == dist.get_world_size() and s[6] == rank]
        else:
            calls += [("dual-fake", s) for s in S.dual_scenarios()]
    if args.only:
        calls = [c for c in calls if re.search(args.only, c[1][0])]

    bad = 0
    for fam, s in calls:
        label = s[0]
        k0, l0, c0, m0 = len(st["keys"]), st["loads"], len(st["compiles"]), len(st["misses"])
        torch.cuda.synchronize()
        t0 = time.time()
        err = None
        try:
            if fam == "single":
                S.run_single(*s[1:], device=dev, fill=True)
            elif fam == "dual-real":
                _, _, Hqk, Hv, T, world, r = s
                S.run_dual(Hqk, Hv, T, world, r, dev, dist.group.WORLD, fill=True)
            else:
                _, _, Hqk, Hv, T, world, r = s
                with S.FakeDist(world, r) as fd:
                    S.run_dual(Hqk, Hv, T, world, r, dev, fd.group, fill=True)
            torch.cuda.synchronize()
        except CompileRefused as exc:
            err = str(exc)
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        dt = time.time() - t0
        n_comp = len(st["compiles"]) - c0
        bad += bool(n_comp or err)
        status = "OK" if not (n_comp or err) else ("COMPILED" if n_comp and not err else "FAIL")
        print(f"[rank {rank}] {status:8s} {dt:7.2f}s  lookups {len(st['keys']) - k0:2d}  disk loads "
              f"{st['loads'] - l0:2d}  compiles {n_comp}  | {label}" + (f"\n    {err}" if err else ""), flush=True)
        for miss in st["misses"][m0:]:
            print(f"    miss: kernel {miss.get('kernel')} key {miss.get('key')}\n{explain_miss(miss, manifest)}")
        if torchrun and err:
            # the other rank may now wait in a collective of this call; torchrun stops it when we exit
            print(f"[rank {rank}] stopping (the ranks' collectives are out of step after a failed call)", flush=True)
            os._exit(1)
        torch.cuda.empty_cache()

    print(f"[rank {rank}] done in {time.time() - t_start:.0f}s: {len(calls)} calls, {st['loads']} disk loads, "
          f"{len(st['compiles'])} compiles, {bad} calls compiled or failed")
    if torchrun:
        dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
