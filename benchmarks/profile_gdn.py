"""Where the time of one flashqla call goes, on the GPU: per-kernel CUDA time and host time.

    python benchmarks/profile_gdn.py step [--heads 16,32] [--tokens 32768] [--seqs 1] [--top 30] [--intra-cp 64]
    python benchmarks/profile_gdn.py first-call [--top 40]
    python benchmarks/profile_gdn.py plain [--heads 16,32] [--tokens 32768] [--seqs 8] [--steps 3] [--intra-cp auto]
    python benchmarks/profile_gdn.py graph [--heads 2,8] [--tokens 32768] [--seqs 1] [--intra-cp auto] [--backward]
                                           [--impl flash_qla]

`step`: torch.profiler over a few warm fwd+bwd calls; prints the CUDA kernels by total time (one table for
the forward alone, one for fwd+bwd) and the host wall time per call, to find the stage to work on next.
`first-call`: cProfile of the first fwd+bwd in this (fresh) process, sorted by cumulative time: run with
an empty TILELANG_CACHE_DIR and FLASHQLA_PREBUILT_KERNELS pointing at a prebuilt tree to see what the
first call of a user's process spends (issue 12).
`graph`: the forward (or, with --backward, fwd+bwd) captured in one CUDA graph and replayed under the
profiler: every kernel of one replay in launch order with its start and duration, and the replay's span
against the sum of its kernels (what the boundaries between kernels cost). `--impl` names another
implementation of bench_bwd.py (`flash_qla`, `fla`, `flashqla_L16`, ...) to list its kernels the same way.
`plain`: a few fwd+bwd calls and nothing else (no profiler of its own), for Nsight Compute to attach to
(scripts/device_ncu.sh).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import flashqla
from bench_bwd import forward_fn
from bench_gdn import captured_graph, make_inputs


def _call(inputs, intra_cp="off"):
    q, k, v, g, beta, cu = inputs
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
    o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)
    return o


def _setup(args):
    """The run `args` describe: (its label, the op's inputs, dO, the intra_cp argument)."""
    Hqk, Hv = map(int, args.heads.split(","))
    inputs = make_inputs(Hqk, Hv, [args.tokens // args.seqs] * args.seqs)
    intra_cp = args.intra_cp if args.intra_cp in ("off", "auto") else int(args.intra_cp)
    label = f"({Hqk},{Hv}) {args.tokens} tokens x{args.seqs}, intra_cp={intra_cp}"
    return label, inputs, torch.randn_like(inputs[2]), intra_cp


def _fwd_bwd(inputs, do, intra_cp, calls):
    for _ in range(calls):
        _call(inputs, intra_cp).backward(do)
    torch.cuda.synchronize()


def profile_step(args):
    label, inputs, do, intra_cp = _setup(args)
    _fwd_bwd(inputs, do, intra_cp, 2)
    for what, fn in [("forward", lambda: _call(inputs, intra_cp)),
                     ("fwd+bwd", lambda: _call(inputs, intra_cp).backward(do))]:
        reps = 3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / reps
        print(f"\n=== {label}: {what}, {wall_ms:.2f} ms wall per call (profiler on) ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


def profile_first_call(args):
    inputs = make_inputs(8, 16, [3000, 5192])
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    _call(inputs).float().square().sum().backward()
    torch.cuda.synchronize()
    profiler.disable()
    print(f"first fwd+bwd: {time.perf_counter() - start:.2f} s")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)


def _replay_kernels(graph, reps):
    """[(name, start us, duration us)] of the kernels of the last of `reps` replays of `graph`."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.start_ns() / 1e3, e.duration_ns() / 1e3, e.name())
                     for e in prof.profiler.kineto_results.events()
                     if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    per_replay = len(kernels) // reps
    return [(name, start, duration) for start, duration, name in kernels[-per_replay:]]


def profile_graph(args):
    label, inputs, do, intra_cp = _setup(args)
    leaves = [t.detach().requires_grad_(args.backward) for t in inputs[:5]]

    if args.impl:
        if args.intra_cp != "off":
            raise SystemExit("--intra-cp is flashqla's public op's; with --impl name a flashqla_L<n> implementation")
        label = f"{args.impl} {label.split(', intra_cp')[0]}"
    # flashqla's public op by bench_bwd.py's name for this intra_cp
    run = forward_fn(args.impl or {"off": "flashqla", "auto": "flashqla_cp"}.get(intra_cp, f"flashqla_L{intra_cp}"))

    def step():
        o = run(*leaves, inputs[5])
        if args.backward:  # the gradients returned, not accumulated into .grad (as bench_bwd.py times them)
            torch.autograd.grad(o, leaves, do)

    graph = captured_graph(step)
    for _ in range(20):
        graph.replay()
    kernels = _replay_kernels(graph, 5)
    first = kernels[0][1]
    span = max(start + duration for _, start, duration in kernels) - first
    busy = sum(duration for _, _, duration in kernels)
    print(f"\n=== {label}: {'fwd+bwd' if args.backward else 'forward'} in one CUDA graph ===")
    for name, start, duration in kernels:
        print(f"  {start - first:9.1f} us  {duration:8.1f} us  {name[:90]}")
    print(f"  {len(kernels)} kernels, span {span:.1f} us, sum of kernels {busy:.1f} us, "
          f"difference {span - busy:.1f} us (boundaries, or overlap when negative)")


def plain_steps(args):
    label, inputs, do, intra_cp = _setup(args)
    _fwd_bwd(inputs, do, intra_cp, args.steps)
    print(f"{label}: {args.steps} fwd+bwd calls done")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["step", "first-call", "plain", "graph"])
    ap.add_argument("--heads", default="16,32")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3, help="plain: fwd+bwd calls")
    ap.add_argument("--intra-cp", default="off", help="'off', 'auto' or a segment length in chunks")
    ap.add_argument("--backward", action="store_true", help="graph: capture fwd+bwd instead of the forward")
    ap.add_argument("--impl", default=None, help="graph: a bench_bwd.py implementation instead of flashqla's "
                    "public op (e.g. flash_qla)")
    args = ap.parse_args()
    {"step": profile_step, "first-call": profile_first_call, "plain": plain_steps,
     "graph": profile_graph}[args.what](args)


if __name__ == "__main__":
    main()
