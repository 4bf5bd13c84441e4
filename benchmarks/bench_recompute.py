"""The op under activation recompute on one GPU: what keeping the per-chunk states (`keep_states`) saves.

Two measurements per config, the public op with AutoCP, CUDA-graph replays, median of --reps:
- the forward with grad on, keep_states False against True: the cost of the walk's state stores;
- a step of `torch.utils.checkpoint(use_reentrant=True)` around the op (a no-grad forward, the recompute inside the
  backward, the backward), FLASHQLA_KEEP_STATES=0 against the default "auto" (which keeps the recompute's states):
  what Megatron's full recompute and DeepSpeed's activation checkpointing run per GDN call.
With --memory, also what one call holds from its forward to its backward beyond its output, plain and under both
kinds of checkpointing (the memory allocated after the forward of a checkpointed call, less the output).

    python benchmarks/bench_recompute.py [--configs 2:8:32768x1,16:32:4096x8] [--reps 50] [--memory] [--out recompute.md]
"""
from __future__ import annotations

import argparse
import datetime

from bench_bwd import environment

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from bench_gdn import graph_median_ms, make_inputs, versions  # noqa: E402

CONFIGS = "2:8:32768x1,2:8:16384x1,4:16:32768x1,16:32:32768x1,2:8:4096x8,16:32:4096x8,16:64:8192x4,8:16:4096x8"


def parse_configs(text: str) -> list[tuple[int, int, list[int]]]:
    """'Hqk:Hv:TOKENSxSEQS,...' -> [(Hqk, Hv, [tokens] * seqs), ...]."""
    configs = []
    for item in filter(None, text.split(",")):
        try:
            Hqk, Hv, shape = item.split(":")
            tokens, seqs = shape.split("x")
            configs.append((int(Hqk), int(Hv), [int(tokens)] * int(seqs)))
        except ValueError:
            raise ValueError(f"--configs: {item!r} is not Hqk:Hv:TOKENSxSEQS") from None
    return configs


def op_on(Hqk, Hv, lengths):
    """(the public op's o as a function of q, k, v, g, beta and keep_states, those five as leaves) on bench_gdn's
    model-like inputs."""
    import flashqla

    q, k, v, g, beta, cu = make_inputs(Hqk, Hv, lengths)

    def op(*x, keep="auto"):
        return flashqla.chunk_gated_delta_rule(*x, cu_seqlens=cu, backend="tilelang", keep_states=keep)[0]
    return op, [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]


def time_config(Hqk, Hv, lengths, reps):
    """(forward ms, forward ms storing the states, checkpointed step ms, the same with "auto" keeping them)."""
    op, leaves = op_on(Hqk, Hv, lengths)
    do = torch.randn_like(leaves[2])
    times = []
    for keep in (False, True):
        forward = lambda: op(*leaves, keep=keep)  # noqa: E731
        forward()
        times.append(graph_median_ms(forward, reps))

    def checkpointed_step():
        torch.autograd.backward(checkpoint(op, *leaves, use_reentrant=True), do)

    for setting in ("0", "auto"):
        with environment({"FLASHQLA_KEEP_STATES": setting}):
            checkpointed_step()
            times.append(graph_median_ms(checkpointed_step, reps))
    return times


def held_mib(Hqk, Hv, lengths) -> list[float]:
    """MiB one call holds after its forward beyond its output: plain, checkpoint(use_reentrant=False), and
    checkpoint(use_reentrant=True)."""
    op, leaves = op_on(Hqk, Hv, lengths)
    held = []
    for run in (lambda: op(*leaves), lambda: checkpoint(op, *leaves, use_reentrant=False),
                lambda: checkpoint(op, *leaves, use_reentrant=True)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        o = run()
        torch.cuda.synchronize()
        held.append((torch.cuda.memory_allocated() - base - o.numel() * o.element_size()) / 2**20)
        o.float().sum().backward()
        del o  # before the next call's baseline
    return held


def memory_table(rows) -> str:
    lines = ["| config | held after the forward, plain MiB | checkpoint(use_reentrant=False) | "
             "checkpoint(use_reentrant=True) |", "|---|---|---|---|"]
    lines += [f"| {label} | {a:.1f} | {b:.1f} | {c:.1f} |" for label, (a, b, c) in rows]
    return "\n".join(lines) + "\n"


def table(rows) -> str:
    lines = ["| config | forward ms | forward, states stored ms | checkpointed step ms | checkpointed, kept ms | step gain |",
             "|---|---|---|---|---|---|"]
    for label, (f0, f1, c0, c1) in rows:
        lines.append(f"| {label} | {f0:.3f} | {f1:.3f} (+{100 * (f1 / f0 - 1):.1f}%) | {c0:.3f} | {c1:.3f} | "
                     f"{c0 / c1:.3f}x |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=CONFIGS, help="Hqk:Hv:TOKENSxSEQS, comma-separated")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--memory", action="store_true", help="also the memory one call holds until its backward")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows, memory_rows = [], []
    for Hqk, Hv, lengths in parse_configs(args.configs):
        label = f"({Hqk}, {Hv}) {lengths[0]} x {len(lengths)}"
        rows.append((label, time_config(Hqk, Hv, lengths, args.reps)))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.memory:
            memory_rows.append((label, held_mib(Hqk, Hv, lengths)))
            print(memory_table(memory_rows[-1:]).splitlines()[-1], flush=True)
        torch.cuda.empty_cache()
    vers = versions()
    report = (f"# keep_states under activation recompute ({datetime.date.today()}, {vers['gpu']}, torch "
              f"{vers['torch']})\n\n" + table(rows) + (f"\n{memory_table(memory_rows)}" if memory_rows else ""))
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    print(report)


if __name__ == "__main__":
    main()
