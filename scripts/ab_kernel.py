"""One kernel of flashqla.kernels.hopper against a variant of it, on the arguments the public op passes it.

    # here, without a GPU: build the variant for sm_90a into its own TileLang cache (carry it to the device)
    .venv/bin/python scripts/ab_kernel.py compile path/to/variant.py build_wy_inverse bfloat16 False True --cache DIR
    # on the H200 (the committed kernels prebuilt, DIR merged into TILELANG_CACHE_DIR or given as --cache):
    python3 scripts/ab_kernel.py run wy_inverse path/to/variant.py build_wy_inverse bfloat16 False True \\
        --configs 16:64:8192x4,2:8:32768x1 [--intra-cp off] [--reps 20]
    # a previous version of a kernel whose builder takes other build arguments (--variant-args), or fewer runtime
    # arguments (--variant-takes: the first N of the recorded launch's; here the one before a trailing scalar)
    git show main:kernels/hopper/chunk_bwd_local.py > .devvar/cbl_main.py
    python3 scripts/ab_kernel.py run chunk_bwd_local .devvar/cbl_main.py build_chunk_bwd_local bfloat16 \\
        --variant-takes 18
    # the committed kernel with another value of its last runtime argument (here 2 v-heads per CTA)
    python3 scripts/ab_kernel.py run wy_inverse kernels/hopper/wy_inverse.py build_wy_inverse bfloat16 True True \\
        --variant-last-arg 2 --configs 2:8:16384x1
    # a later launch of the same build (fused_fwd's second in a fwd+bwd is the backward's state recompute; with
    # FLASHQLA_CHUNK_SCORES=0, as the forward at (2, 8) x 32K runs the scores build otherwise), against a variant
    # built with other arguments (a V tile of 64 where the committed kernel's is 32)
    FLASHQLA_CHUNK_SCORES=0 python3 scripts/ab_kernel.py run fused_fwd path/to/variant.py build_fused_fwd \
        bfloat16 32 --variant-args bfloat16,64 --launch-index 1 --configs 2:8:32768x1

KERNEL names `launch.compiled_<KERNEL>`, the builder's arguments (integers, True/False, strings) are its
build arguments. For every config (Hqk:Hv:tokens-per-sequence x sequences, bench_gdn's model-like inputs),
one fwd+bwd of the public op records the first launch of KERNEL with those build arguments (or the
--launch-index'th); the committed kernel and the variant then run on their own copies of its tensors. The
outputs are the tensors the committed kernel changes; both runs start with them NaN-filled, so memory one
of them leaves unwritten shows as a count of positions where exactly one is NaN. Prints, per config, both
times (CUDA-graph medians, on a GPU) and the relative L2 difference of every output. This is how kernel variants are judged
(docs/kernels.md, "Checking on the H200"): outputs and time side by side, in one process.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

from kernel_resources import kernel_module, load_builder, parse_build_args  # noqa: E402


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def record_launch(kernel: str, build_args: tuple, run, index: int = 0) -> tuple:
    """(the committed kernel, a copy of the arguments of its launch number `index` (0: the first) with
    `build_args`) while `run()` runs. Patches `compiled_<kernel>` wherever the kernels' host modules bound it."""
    from flashqla.kernels.hopper import backward, launch

    name = f"compiled_{kernel}"
    real = getattr(launch, name)
    seen = {"launches": 0}

    def spy(*args):
        compiled = real(*args)
        if tuple(args) != tuple(build_args):
            return compiled

        def call(*call_args):
            if seen["launches"] == index:
                seen["args"] = _clone(call_args)
            seen["launches"] += 1
            return compiled(*call_args)
        return call

    modules = [m for m in (launch, backward) if hasattr(m, name)]
    for module in modules:
        setattr(module, name, spy)
    try:
        run()
    finally:
        for module in modules:
            setattr(module, name, real)
    if "args" not in seen:
        raise RuntimeError(f"no launch of {kernel}{build_args} number {index} in this call "
                           f"({seen['launches']} launches)")
    return real(*build_args), seen["args"]


@dataclass
class Comparison:
    outputs: dict  # argument index -> (relative L2 difference over positions both wrote, positions one left NaN)


def _nan_fill(args, outputs):
    for i in outputs:
        if args[i].is_floating_point():
            args[i].fill_(float("nan"))
    return args


@dataclass
class Reference:
    args: list  # the recorded arguments, as the launch found them
    outputs: list  # indices of the arguments the committed kernel writes
    written: list  # the committed kernel's run on a copy of `args` with those outputs NaN-filled


def reference_of(committed, args) -> Reference:
    """Runs the committed kernel twice on copies of `args`: once to find what it writes, once on NaN-filled
    outputs, the run every variant is compared with."""
    probe = _clone(args)
    committed(*probe)
    outputs = [i for i, (a, b) in enumerate(zip(probe, args)) if isinstance(a, torch.Tensor)
               and bool(((a != b) & ~(a.isnan() & b.isnan())).any())]
    written = _nan_fill(_clone(args), outputs)
    committed(*written)
    return Reference(_clone(args), outputs, written)


def compare(reference: Reference, variant) -> Comparison:
    """Runs the variant on its own NaN-filled copy of the reference's arguments and compares what the committed
    kernel writes."""
    ours, theirs = reference.written, _nan_fill(_clone(reference.args), reference.outputs)
    variant(*theirs)
    result = {}
    for i in reference.outputs:
        a, b = ours[i].double(), theirs[i].double()
        one_nan = int((a.isnan() ^ b.isnan()).sum())
        both = ~(a.isnan() | b.isnan())
        ref = a[both].norm()
        diff = (a[both] - b[both]).norm()
        result[i] = ((diff / ref).item() if ref > 0 else diff.item(), one_nan)
    return Comparison(result)


def graph_time_us(fn, reps=20, rounds=15) -> float:
    """Median microseconds per call of fn(), from CUDA-graph replays of `reps` calls (bench_gdn's timer)."""
    from bench_gdn import graph_median_ms

    return graph_median_ms(lambda: [fn() for _ in range(reps)], rounds) * 1e3 / reps


def public_op_step(inputs, intra_cp):
    """fwd+bwd of the public op (TileLang backend) on bench_gdn's inputs."""
    import flashqla

    q, k, v, g, beta, cu = inputs
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)
    o.backward(torch.ones_like(o))


def parse_config(text):
    """"Hqk:Hv:LENxN" -> (Hqk, Hv, [LEN] * N)."""
    Hqk, Hv, seqs = text.split(":")
    length, count = seqs.split("x")
    return int(Hqk), int(Hv), [int(length)] * int(count)


def ab(kernel, build_args, variants, configs, make_inputs, intra_cp="off", reps=20, log=print, hang_seconds=None,
       launch_index=0):
    """For every config: record the launch once, compare every variant in `variants` ({name: kernel}) with the
    committed kernel and time them all (on a GPU). Returns the rows it printed, one per config and variant.

    With `hang_seconds`, a config that takes longer ends the process with every thread's traceback (the line
    that waits on the GPU shows which kernel never returned). faulthandler's watchdog is a C thread that needs
    no GIL, so it fires even while the main thread is blocked in a host read of a hung kernel's output."""
    rows = []
    for Hqk, Hv, lengths in configs:
        if hang_seconds:
            log(f"({Hqk}, {Hv}) {lengths[0]} x {len(lengths)}: starting (ends the process after {hang_seconds} s)")
            faulthandler.dump_traceback_later(hang_seconds, exit=True)
        inputs = make_inputs(Hqk, Hv, lengths)
        try:
            committed, args = record_launch(kernel, build_args, lambda: public_op_step(inputs, intra_cp), launch_index)
        except RuntimeError as error:
            if intra_cp != "off":
                raise
            raise RuntimeError(f"{error}; with --intra-cp off the public op launches no segment summaries, gates or "
                               "chain (try --intra-cp auto)") from error
        reference = reference_of(committed, args)  # before the timed runs below write into `args`
        committed_us = graph_time_us(lambda: committed(*args), reps) if torch.cuda.is_available() else None
        for name, variant in variants.items():
            comparison = compare(reference, variant)
            row = {"config": f"({Hqk}, {Hv}) {lengths[0]} x {len(lengths)}", "variant": name,
                   "outputs": comparison.outputs}
            if committed_us is not None:
                row["committed_us"] = committed_us
                row["variant_us"] = graph_time_us(lambda: variant(*args), reps)
            diffs = ", ".join(f"arg {i}: {err:.2e}" + (f" ({nan} unwritten)" if nan else "")
                              for i, (err, nan) in comparison.outputs.items())
            times = (f"committed {row['committed_us']:.1f} us, variant {row['variant_us']:.1f} us "
                     f"({row['committed_us'] / row['variant_us']:.3f}x); " if "variant_us" in row else "")
            log(f"{row['config']} {name}: {times}{diffs}")
            rows.append(row)
        faulthandler.cancel_dump_traceback_later()
    return rows


def first_arguments(kernel, count):
    """`kernel` called with the first `count` of the arguments it is given."""
    return lambda *args: kernel(*args[:count])


def with_last_argument(kernel, value):
    """`kernel` called with `value` in place of the last argument it is given."""
    return lambda *args: kernel(*args[:-1], value)


def compile_variant(path, builder, build_args):
    """The variant, built with the pass configs of the kernel module its builder names (`build_<module>`: the
    package's, with launch.MODULE_PASS_CONFIGS' for that module, as the committed kernel is built) plus those in
    AB_PASS_CONFIGS (a JSON object, e.g. '{"tl.disable_thread_storage_sync": true}'; set it alike where the
    variant is compiled and where it runs, the cache key includes them)."""
    import tilelang

    from flashqla.kernels.hopper import launch

    pass_configs = {**launch._pass_configs(kernel_module(path, builder)),
                    **json.loads(os.environ.get("AB_PASS_CONFIGS", "{}"))}
    return tilelang.compile(load_builder(path, builder)(*build_args), target=launch.TARGET, pass_configs=pass_configs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["compile", "run"])
    ap.add_argument("rest", nargs="+", help="compile: VARIANT BUILDER ARGS...; run: KERNEL VARIANT BUILDER ARGS... "
                    "(run: VARIANT may list several files, comma-separated, all timed on one recorded launch)")
    ap.add_argument("--cache", default=None, help="the variant's TileLang cache directory")
    ap.add_argument("--configs", default="16:32:4096x8,2:8:32768x1")
    ap.add_argument("--intra-cp", default="off")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--launch-index", type=int, default=0, help="run: which launch of the kernel with these build "
                    "arguments to record in one fwd+bwd (0: the first; fused_fwd's 1 is the backward's state recompute)")
    ap.add_argument("--hang-seconds", type=float, default=180, help="run: end the process, with tracebacks, when "
                    "one config takes longer (a kernel hung on an mbarrier never returns); 0 turns it off")
    ap.add_argument("--variant-args", default=None, help="run: build the variants with these arguments "
                    "(comma- or space-separated) instead of the committed kernel's")
    ap.add_argument("--variant-takes", type=int, default=None, help="run: the variants take the first N runtime "
                    "arguments of the recorded launch (a kernel before trailing arguments were added)")
    ap.add_argument("--variant-last-arg", type=int, default=None, help="run: the variants get this value as their "
                    "last runtime argument instead of the recorded launch's (another work split, e.g. wy_inverse's "
                    "heads per CTA)")
    opts = ap.parse_args(argv)
    if opts.cache:
        os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(opts.cache)
    if opts.mode == "compile":
        path, builder, *raw = opts.rest
        compile_variant(path, builder, parse_build_args(raw))
        print(f"compiled {path}:{builder}{parse_build_args(raw)} into {os.environ.get('TILELANG_CACHE_DIR')}")
        return
    kernel, path, builder, *raw = opts.rest
    build_args = parse_build_args(raw)
    from bench_gdn import make_inputs

    variant_args = (build_args if opts.variant_args is None
                    else parse_build_args(opts.variant_args.replace(",", " ").split()))
    variants = {os.path.basename(p): compile_variant(p, builder, variant_args) for p in path.split(",")}
    if opts.variant_takes is not None:
        variants = {name: first_arguments(kernel, opts.variant_takes) for name, kernel in variants.items()}
    if opts.variant_last_arg is not None:
        variants = {name: with_last_argument(kernel, opts.variant_last_arg) for name, kernel in variants.items()}
    intra_cp = opts.intra_cp if opts.intra_cp in ("off", "auto") else int(opts.intra_cp)
    log = lambda line: print(line, flush=True)  # noqa: E731 (the watchdog's exit drops unflushed lines)
    ab(kernel, build_args, variants, [parse_config(c) for c in opts.configs.split(",")], make_inputs, intra_cp,
       opts.reps, log, opts.hang_seconds, opts.launch_index)


if __name__ == "__main__":
    main()
