"""Precompile FLA 0.6.0's Triton kernels (every autotune config) for the H200 into a Triton disk cache, on a CPU.

    PYTHONPATH=/tmp/tri36:<extracted site>:/tmp/fdeps TRITON_CACHE_DIR=/tmp/fla_triton_cache \
        python fla_triton_precompile.py [--jobs 2] [--only REGEX] [--no-verify] [--verify-only] [--list]
            [--cp-tokens small|real] [--verify-cp-tokens small|real]

Needs triton == 3.6.0 exactly (the device image's): Triton's disk-cache key hashes its own sources, libtriton,
the bundled ptxas' --version, the target and the compile options (triton/runtime/cache.py triton_key,
get_cache_key; backends/nvidia/compiler.py CUDABackend.hash, CUDAOptions.hash).
1. compile: workers (at most --jobs at a time, one per head shape and benchmark) run FLA's real host code on CPU
   tensors as on one H200 (fla_cpu.py: torch.cuda and Triton's driver answer as cc 9.0 / GPUTarget("cuda", 90, 32)),
   for the calls bench_gdn.py (impl_fla, its 10 CONFIGS, FLA_DISABLE_BACKEND_DISPATCH=1) and bench_bwd.py
   (forward_fn("fla"), its 4 x 2 x 4 matrix, fwd+bwd then fwd under no_grad, dispatch on) and bench_cp.py (make_fla:
   FLA's CP context over a torch.distributed stand-in, ranks 0 and 1 of 2 on contiguous shards and the one-rank
   baseline on the whole sequence; fwd, then fwd+bwd; dispatch on) make. Every Triton
   launch compiles its kernel (warmup=True) and returns without launching; the autotuner's benchmark compiles
   each config and reports a dummy time. FLA_CACHE_RESULTS=0, so no autotune result (with the dummy times) is
   written: on the GPU the autotuner still benchmarks every config, from the cache.
2. verify: fresh processes repeat the calls; every compile must be a cache hit. Writes <cache>/fla_triton_manifest.json.
bench_cp's calls run at CP_SMALL_T tokens by default (--cp-tokens real: bench_cp's 256K / 1M, ~18 GB of CPU tensors
for the 1M-token calls): Triton's cache key sees T only through its integer specialization (divisible by 16, == 1,
32/64-bit) and FLA's host code takes the same paths at both sizes; --verify-only --verify-cp-tokens real checks
that claim (every real-size call must be a cache hit) and records it in the manifest's "checks".
FLA's one TileLang kernel (bench_bwd, dispatch on) is only recorded here: fla_precompile.py builds it.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
MANIFEST = "fla_triton_manifest.json"
TRITON_VERSION = "3.6.0"


# --------------------------------------------------------------------------------------------------
# scenarios (shared with fla_triton_check_gpu.py): the FLA calls of bench_gdn.py and bench_bwd.py
# --------------------------------------------------------------------------------------------------
# bench_cp's FLA calls at a smaller token count (see the module doc): the whole sequence (world 1), the 2 shards and
# their chunk counts stay multiples of 16 (and > 1), and the chunk count stays above the H200's 132 SMs
CP_SMALL_T = 32768
GROUP_DISPATCH = dict(gdn="1", bwd="0", cp="0")   # FLA_DISABLE_BACKEND_DISPATCH as each script runs FLA


def scenarios():
    """[(label, group, params)]; group "gdn" runs with FLA_DISABLE_BACKEND_DISPATCH=1, "bwd" and "cp" with 0 (as the
    scripts: bench_cp does not set it, FLA's default is dispatch on)."""
    sys.path.insert(0, BENCH)
    out = []
    from bench_gdn import CONFIGS
    for i, (name, Hqk, Hv, seqs) in enumerate(CONFIGS):
        out.append((f"gdn[{i}] {name} Hqk={Hqk} Hv={Hv} seqs={'+'.join(map(str, seqs))}", "gdn",
                    dict(Hqk=Hqk, Hv=Hv, seqs=list(seqs))))
    from bench_bwd import HEADS, SEQS, TOKENS
    for Hqk, Hv in HEADS:
        for T in TOKENS:
            for n in SEQS:
                out.append((f"bwd Hqk={Hqk} Hv={Hv} T={T} seqs={T // n}x{n}", "bwd",
                            dict(Hqk=Hqk, Hv=Hv, seqs=[T // n] * n)))
    sys.path.insert(0, HERE)
    from fla_scenarios import scenarios as fla_scenarios   # bench_cp's defaults (--tokens, --heads), 2 ranks
    out += [(label, kind, p) for label, kind, p in fla_scenarios() if kind == "cp"]
    return out


def cp_tokens(p, mode):
    """The token count a cp scenario runs at: bench_cp's ("real") or CP_SMALL_T ("small")."""
    return p["T"] if mode == "real" else CP_SMALL_T


def cpu_inputs(Hqk, Hv, lengths):
    """bench_gdn.make_inputs' shapes, dtypes and layout (contiguous), without values (torch.empty on the CPU)."""
    import torch
    D, T = 128, sum(lengths)
    q = torch.empty(1, T, Hqk, D, dtype=torch.bfloat16)
    k = torch.empty(1, T, Hqk, D, dtype=torch.bfloat16)
    v = torch.empty(1, T, Hv, D, dtype=torch.bfloat16)
    beta = torch.empty(1, T, Hv, dtype=torch.bfloat16)
    g = torch.empty(1, T, Hv, dtype=torch.float32)
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    return q, k, v, g, beta, cu


def run_scenario(group, p, inputs):
    """One scenario exactly as the benchmark calls FLA (its first calls, before any timing)."""
    import torch
    if group == "gdn":
        from bench_gdn import impl_fla
        impl_fla()(*inputs)              # bench_gdn main: loaded["fla"](*inputs)
        return
    from bench_bwd import forward_fn
    fwd = forward_fn("fla")
    q, k, v, g, beta, cu = inputs
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
    do = torch.empty_like(v) if v.device.type == "cpu" else torch.randn_like(v)
    torch.autograd.grad(fwd(*leaves, cu), leaves, do)   # bench_bwd time_impl: fwd_bwd() first, then fwd_only
    with torch.no_grad():
        fwd(*leaves, cu)


# --------------------------------------------------------------------------------------------------
# Triton hooks: what Triton compiles, what it finds in the cache
# --------------------------------------------------------------------------------------------------
def key_components():
    """The target-independent parts of Triton's disk-cache key, hashed (compare CPU vs device)."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.cache import triton_key
    backend = make_backend(GPUTarget("cuda", 90, 32))
    return dict(triton=triton.__version__, triton_key_sha256=hashlib.sha256(triton_key().encode()).hexdigest(),
                backend_hash=backend.hash(), default_options_sha256=backend.parse_options({}).hash(),
                cache_invalidating_env=dict(sorted(get_cache_invalidating_env_vars().items())))


def describe(src, options):
    """(kernel, config) of one compile: num_warps/num_stages and the constexprs."""
    fn = getattr(src, "fn", None)
    name = f"{getattr(fn, '__module__', '?')}:{getattr(src, 'name', '?')}"
    consts = []
    arg_names = getattr(fn, "arg_names", [])
    for path, val in sorted(getattr(src, "constants", {}).items(), key=lambda kv: str(kv[0])):
        if isinstance(path, tuple) and len(path) == 1 and path[0] < len(arg_names):
            consts.append(f"{arg_names[path[0]]}={getattr(val, 'value', val)}")
    opts = options or {}
    cfg = f"w{opts.get('num_warps', 4)} s{opts.get('num_stages', 3)}" + (" " + ",".join(consts) if consts else "")
    return name, cfg


class CompileTracker:
    """Wraps triton.compiler.compile (what JITFunction binds on its first run) and Triton's compilation listener:
    every call is a disk-cache hit or a compile (a miss), with its wall time."""

    def __init__(self, log=None, launchers=None):
        self.events = []
        self.scenario = None
        self.log = log
        self.launchers = launchers     # a LauncherBuilder: also build each kernel's C launcher (CPU side)

    def install(self):
        import triton.compiler as tc
        from triton import knobs
        orig = tc.compile
        state = {}

        def listener(src, metadata, metadata_group, times, cache_hit):
            state["hit"] = cache_hit

        def compile(src, target=None, options=None, _env_vars=None):
            state.clear()
            name, cfg = describe(src, options)
            t0 = time.perf_counter()
            try:
                res = orig(src, target=target, options=options, _env_vars=_env_vars)
            except Exception as exc:
                self.events.append(dict(kernel=name, config=cfg, hit=False, failed=f"{type(exc).__name__}: {exc}"[:300],
                                        seconds=round(time.perf_counter() - t0, 3), scenario=self.scenario))
                raise
            ev = dict(kernel=name, config=cfg, hit=bool(state.get("hit")), seconds=round(time.perf_counter() - t0, 3),
                      scenario=self.scenario, hash=getattr(res, "hash", None))
            if self.launchers is not None:
                b0 = self.launchers.builds
                self.launchers.launcher(src, res.metadata)
                ev["launcher_built"] = self.launchers.builds > b0
            self.events.append(ev)
            if self.log and not ev["hit"]:
                self.log(f"  compiled {name} [{cfg}] {ev['seconds']:.1f}s")
            return res

        knobs.compilation.listener = listener
        tc.compile = compile
        return self


def make_libcuda_stub(stubdir):
    """A libcuda.so.1 that only defines the driver entry points Triton's C launchers call (no libcuda here): the
    launchers built against it record DT_NEEDED libcuda.so.1 and bind to the real driver on the GPU machine."""
    import glob as _glob
    import triton.backends.nvidia as nv
    names = set()
    for path in _glob.glob(os.path.join(os.path.dirname(nv.__file__), "driver.*")):
        if path.endswith((".py", ".c")):
            names |= set(re.findall(r"\b(cu[A-Z][A-Za-z0-9]*)\s*\(", open(path).read()))
    names |= {n + "_v2" for n in names}
    os.makedirs(stubdir, exist_ok=True)
    src = os.path.join(stubdir, "libcuda_stub.c")
    open(src, "w").write("".join(f"int {n}(void) {{ return 999; }}\n" for n in sorted(names)))
    so = os.path.join(stubdir, "libcuda.so.1")
    subprocess.check_call(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", so, src])
    if not os.path.exists(os.path.join(stubdir, "libcuda.so")):
        os.symlink("libcuda.so.1", os.path.join(stubdir, "libcuda.so"))
    return stubdir


class LauncherBuilder:
    """Triton 3.6 builds a C launcher per kernel signature (backends/nvidia/driver.py CudaLauncher ->
    runtime/build.py compile_module_from_src, gcc) and one cuda_utils module, cached in TRITON_CACHE_DIR under
    sha256(C source + platform_key()). Build them here (linked against the stub libcuda) and do not load them."""

    def __init__(self, stubdir):
        from triton import knobs
        from triton.runtime import build
        knobs.nvidia.libcuda_path = make_libcuda_stub(stubdir)
        self.builds, self.seconds, self.seen = 0, 0.0, set()
        orig_build = build._build

        def _build(*args, **kwargs):
            t0 = time.perf_counter()
            out = orig_build(*args, **kwargs)
            self.builds += 1
            self.seconds += time.perf_counter() - t0
            return out

        class _Stub:
            def __getattr__(self, name):
                return None

        build._build = _build
        build._load_module_from_path = lambda name, path: _Stub()

    def utils(self):
        from triton.backends.nvidia import driver as nd
        nd.CudaUtils.__new__(nd.CudaUtils).__init__()

    def launcher(self, src, metadata):
        from triton.backends.nvidia import driver as nd
        nd.CudaLauncher(src, metadata)


def install_compile_only():
    """Every Triton launch compiles (or loads) its kernel and returns before launching; the autotuner's benchmark
    runs each config once that way and reports the same dummy time for all."""
    from triton.runtime import autotuner, jit
    orig_run = jit.JITFunction.run

    def run(self, *args, grid=None, warmup=False, **kwargs):
        return orig_run(self, *args, grid=grid, warmup=True, **kwargs)

    def fake_bench(kernel_call, quantiles=None, **kwargs):
        kernel_call()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    jit.JITFunction.run = run
    autotuner.Autotuner.do_bench = property(lambda self: fake_bench)


# --------------------------------------------------------------------------------------------------
# worker: one process, one group (its dispatch env), some head shapes
# --------------------------------------------------------------------------------------------------
def worker(args):
    group = args.group
    os.environ["FLA_FLASH_QLA"] = "0"
    os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = GROUP_DISPATCH[group]
    os.environ["FLA_CACHE_RESULTS"] = "0"      # no autotune results (dummy timings) in the cache
    sys.path.insert(0, HERE)
    sys.path.insert(0, BENCH)
    import triton
    assert triton.__version__ == TRITON_VERSION, f"triton {triton.__version__} (need {TRITON_VERSION}: PYTHONPATH)"
    from triton.runtime import autotuner, jit
    saved = (jit.JITFunction.run, autotuner.Autotuner.run, autotuner.Heuristics.run)
    import fla_cpu
    fla_cpu.import_fla()                        # fake H200 + Triton driver; it stubs launches: undo that
    jit.JITFunction.run, autotuner.Autotuner.run, autotuner.Heuristics.run = saved
    install_compile_only()
    out = open(args.out, "a")
    launchers = LauncherBuilder(os.path.join(os.path.dirname(os.path.abspath(args.out)), "libcuda_stub"))
    launchers.utils()
    tracker = CompileTracker(log=lambda s: print(s, flush=True), launchers=launchers).install()
    rec = fla_cpu.make_recorder("record")       # FLA's TileLang kernel (dispatch on): record only
    heads = {tuple(map(int, h.split(":"))) for h in args.heads.split(",")}
    for label, grp, p in scenarios():
        if grp != group or (p["Hqk"], p["Hv"]) not in heads or (args.only and not re.search(args.only, label)):
            continue
        tracker.scenario = label
        n0 = len(tracker.events)
        t0 = time.time()
        err = None
        try:
            with fla_cpu.fake_h200():
                if group == "cp":
                    import fla_scenarios as S
                    T = cp_tokens(p, args.cp_tokens)
                    x = S.cp_inputs(p, T, "cpu")
                    S.cp_step(p, T, x, "cpu", exact_backward=T == CP_SMALL_T)
                    del x
                else:
                    run_scenario(group, p, cpu_inputs(p["Hqk"], p["Hv"], p["seqs"]))
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"[:500]
            if os.environ.get("FTP_TRACEBACK"):
                import traceback
                traceback.print_exc()
        evs = tracker.events[n0:]
        miss = [e for e in evs if not e["hit"]]
        at = f" (at T={cp_tokens(p, args.cp_tokens)})" if group == "cp" else ""
        print(f"{args.phase} {label}{at}: {time.time() - t0:.1f}s, {len(evs)} kernel lookups, {len(miss)} compiled "
              f"({sum(e['seconds'] for e in miss):.1f}s), {sum(bool(e.get('launcher_built')) for e in evs)} "
              f"launchers built{' FAILED ' + err if err else ''}", flush=True)
        out.write(json.dumps(dict(scenario=label, group=group, seconds=round(time.time() - t0, 2), error=err,
                                  tokens=cp_tokens(p, args.cp_tokens) if group == "cp" else sum(p["seqs"]),
                                  events=evs)) + "\n")
        out.flush()
    rec.restore()
    out.write(json.dumps(dict(key_components=key_components(), pid=os.getpid(), launcher_builds=launchers.builds,
                              launcher_s=round(launchers.seconds, 1))) + "\n")
    return 0


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------
def tasks(only=None):
    """(group, heads): one per head shape and benchmark; bench_bwd's (fwd+bwd, 8 calls each) first, then bench_cp's."""
    seen = collections.OrderedDict()
    for label, group, p in scenarios():
        if only and not re.search(only, label):
            continue
        seen.setdefault((group, p["Hqk"], p["Hv"]), 0)
        seen[(group, p["Hqk"], p["Hv"])] += 1
    return sorted(seen, key=lambda t: (dict(bwd=0, cp=1).get(t[0], 2), -t[1] * t[2]))


def run_workers(phase, jobs, work, only, cp_mode="small"):
    """Run the tasks in subprocesses, at most `jobs` at a time; returns the records they wrote."""
    todo = [(g, f"{a}:{b}") for g, a, b in tasks(only)]
    if phase == "verify":   # one fresh process per group is enough (nothing compiles), per head at bench_cp's sizes
        by = collections.OrderedDict()
        for g, h in todo:
            by.setdefault(g if g != "cp" or cp_mode == "small" else f"cp {h}", (g, []))[1].append(h)
        todo = [(g, ",".join(hs)) for g, hs in by.values()]
    running, files, dead = [], [], []
    while todo or running:
        while todo and len(running) < jobs:
            g, h = todo.pop(0)
            path = os.path.join(work, f"{phase}-{g}-{h.replace(':', '_').replace(',', '-')}.jsonl")
            if os.path.exists(path):
                os.remove(path)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--phase", phase, "--group", g,
                   "--heads", h, "--out", path, "--cp-tokens", cp_mode] + (["--only", only] if only else [])
            print(f"[{phase}] start {g} {h}", flush=True)
            running.append((subprocess.Popen(cmd), g, h, time.time()))
            files.append(path)
        time.sleep(1)
        for item in list(running):
            proc, g, h, t0 = item
            if proc.poll() is not None:
                running.remove(item)
                print(f"[{phase}] done {g} {h}: rc {proc.returncode}, {time.time() - t0:.0f}s", flush=True)
                if proc.returncode != 0:   # e.g. killed for memory: its unfinished calls are not in its records
                    dead.append(dict(scenario=f"worker {g} {h}", group=g, error=f"worker rc {proc.returncode}"))
    recs = []
    for path in files:
        if os.path.exists(path):
            recs += [json.loads(line) for line in open(path)]
    return recs + [dict(d, events=[]) for d in dead]


def summarize(recs):
    events = [e for r in recs for e in r.get("events", [])]
    miss = [e for e in events if not e["hit"]]
    kernels = collections.OrderedDict()
    for e in events:
        k = kernels.setdefault(e["kernel"], dict(configs=set(), compiled=0, compile_s=0.0, failed=0, scenarios=set()))
        k["configs"].add(e.get("hash") or e["config"])
        k["scenarios"].add(e["scenario"])
        if not e["hit"]:
            k["compiled"] += 1
            k["compile_s"] += e["seconds"]
        if e.get("failed"):
            k["failed"] += 1
    return events, miss, kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default=None, help="regex on the scenario labels")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--verify-only", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--cp-tokens", choices=["small", "real"], default="small",
                    help=f"bench_cp's calls at {CP_SMALL_T} tokens (small) or at bench_cp's (real) when compiling")
    ap.add_argument("--verify-cp-tokens", choices=["small", "real"], default="small",
                    help="the same for the fresh-process check (real: one process per head shape, ~18 GB at 1M)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="compile", help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--heads", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.list:
        for label, group, _ in scenarios():
            print(group, label)
        print(tasks(args.only))
        return 0
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        print("set TRITON_CACHE_DIR", file=sys.stderr)
        return 2
    os.makedirs(cache, exist_ok=True)
    work = os.path.join(os.path.dirname(os.path.abspath(cache)), os.path.basename(cache) + ".work")
    os.makedirs(work, exist_ok=True)
    result = dict(cache=cache)
    if not args.verify_only:
        t0 = time.time()
        recs = run_workers("compile", args.jobs, work, args.only, args.cp_tokens)
        events, miss, kernels = summarize(recs)
        failed = [e for e in events if e.get("failed")]
        errors = [(r["scenario"], r["error"]) for r in recs if r.get("error")]
        print(f"\ncompile: {len(kernels)} kernels, {len({e.get('hash') for e in events if e.get('hash')})} compiled "
              f"variants (kernel x specialization x config), {len(miss)} compiles, "
              f"{sum(e['seconds'] for e in miss):.0f} s compiling, {time.time() - t0:.0f} s wall; "
              f"{len(failed)} configs failed to compile, {len(errors)} scenarios failed")
        for name, k in kernels.items():
            print(f"  {name}: {len(k['configs'])} variants, {k['compiled']} compiled ({k['compile_s']:.0f}s)"
                  + (f", {k['failed']} failed" if k["failed"] else ""))
        for s, e in errors:
            print(f"  FAILED {s}: {e}")
        result["compile"] = dict(wall_s=round(time.time() - t0), compiles=len(miss),
                                 compile_s=round(sum(e["seconds"] for e in miss), 1), failed_configs=failed,
                                 failed_scenarios=errors)
    if not args.no_verify:
        t0 = time.time()
        recs = run_workers("verify", args.jobs, work, args.only, args.verify_cp_tokens)
        events, miss, kernels = summarize(recs)
        comps = [r["key_components"] for r in recs if "key_components" in r]
        errors = [(r["scenario"], r["error"]) for r in recs if r.get("error")]
        lb = sum(r.get("launcher_builds", 0) for r in recs)
        print(f"\nverify (fresh processes): {len([r for r in recs if 'scenario' in r])} scenarios, "
              f"{len(events)} kernel lookups, {len(events) - len(miss)} cache hits, {len(miss)} compiles, "
              f"{lb} C launchers built (0 once all are cached), "
              f"{len(errors)} failed, {time.time() - t0:.0f} s")
        for e in miss:
            print(f"  MISS {e['kernel']} [{e['config']}] in {e['scenario']}")
        result["verify"] = dict(lookups=len(events), hits=len(events) - len(miss), compiles=len(miss), launcher_builds=lb,
                                failed_scenarios=errors, wall_s=round(time.time() - t0), only=args.only,
                                cp_tokens=args.verify_cp_tokens, calls=len([r for r in recs if "scenario" in r]))
        result["key_components"] = comps[0] if comps else None
        result["kernels"] = {n: dict(variants=sorted(k["configs"]), scenarios=sorted(k["scenarios"]))
                             for n, k in kernels.items()}
        result["scenarios"] = [dict(scenario=r["scenario"], group=r["group"], tokens=r.get("tokens"), lookups=len(r["events"]),
                                    compiles=sum(not e["hit"] for e in r["events"])) for r in recs if "scenario" in r]
        import importlib.metadata as md
        result["fla"] = md.version("fla-core")
        result["env"] = dict(FLA_FLASH_QLA="0", FLA_DISABLE_BACKEND_DISPATCH="gdn: 1, bwd: 0, cp: 0")
        result["cp_small_tokens"] = CP_SMALL_T
        old = {}
        mpath = os.path.join(cache, MANIFEST)
        if args.verify_only and os.path.exists(mpath):
            old = json.load(open(mpath))
        if args.verify_only and old and (args.only or args.verify_cp_tokens != "small"):
            # a partial or real-size check: recorded next to the full one, which it leaves as it is
            check = dict(result["verify"], scenarios=result["scenarios"], when=time.strftime("%Y-%m-%d %H:%M"))
            result = dict(checks=old.get("checks", []) + [check])
        json.dump({**old, **result}, open(mpath, "w"), indent=1, sort_keys=True)
        print(f"wrote {mpath}")
        autotune = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".autotune.json")]
        if autotune:
            print(f"WARNING: {len(autotune)} autotune results in the cache (dummy timings): delete them")
        return 1 if miss or errors else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
