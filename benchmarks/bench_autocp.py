"""AutoCP calibration on one GPU: the public op at every segment length, forward and fwd+bwd.

    python benchmarks/bench_autocp.py [--lengths off,auto,32,64,128] [--reps 20] [--configs all|0,3]
    python benchmarks/bench_autocp.py --sweep [--out tests/data/autocp_sweep_h200.txt]
    python benchmarks/bench_autocp.py --sweep packs [--out tests/data/autocp_sweep_packs_h100.txt]
    python benchmarks/bench_autocp.py --sweep long [--out tests/data/autocp_sweep_long_h100.txt]

Per configuration and intra_cp: forward (CUDA-graph median), fwd+bwd eager and CUDA-graph medians, and the
host time of one fwd+bwd call (issue time, before the GPU finishes).
--sweep: the calibration behind flashqla.cp.plan.calibrated_segment_chunks (docs/benchmarks.md): FlashQLA's
backward matrix and bench_gdn's ten configs, off and every L of 8 to 128 chunks shorter than the longest
sequence, forward and fwd+bwd CUDA-graph medians only, one line per config in the form that
tests/test_intra_cp.py reads from tests/data/autocp_sweep_h200.txt.
--sweep packs: the same over training rows packed with documents (doc_packs.py: lognormal lengths in the
order drawn, the last one cut at the row's end), the planner's other case: rows of unequal length.
--sweep long: one sequence of 256K to 1M tokens at 8 to 32 v-heads, segments of 64 to 512 chunks (unsegmented
is a serial walk of up to 16K chunks there, left out): where the planner chooses beyond the first sweeps' 128K.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashqla
from bench_bwd import HEADS as BWD_HEADS
from bench_bwd import SEQS as BWD_SEQS
from bench_bwd import TOKENS as BWD_TOKENS
from bench_gdn import CONFIGS as GDN_CONFIGS
from bench_gdn import eager_median_ms, graph_median_ms, make_inputs, sequences_label
from doc_packs import pack_draws

CONFIGS = [(2, 8, [32768]), (2, 8, [16384]), (2, 8, [8192]), (4, 16, [32768]), (4, 16, [8192]), (8, 24, [32768]),
           (16, 16, [32768]), (32, 32, [32768]),
           # training rows packed with documents: long ones cut into segments beside many short ones of one row each
           (2, 8, [20480] + [512] * 24), (2, 8, [8192] * 2 + [1024] * 16), (4, 16, [16384] + [512] * 32)]


SWEEP_LENGTHS = (0, 8, 16, 32, 64, 128)  # chunks, 0 = off
LONG_LENGTHS = (64, 128, 256, 512)  # chunks, for the long sequences
# (Hqk, Hv, tokens) of the long-sequence sweep: fwd+bwd of the largest fits an 80 GB H100 inside a CUDA graph
LONG_CONFIGS = ((2, 8, 262144), (4, 16, 262144), (8, 32, 262144), (2, 8, 524288), (4, 16, 524288),
                (2, 8, 1048576), (4, 16, 1048576))
PACK_HEADS = ((1, 4), (2, 8), (4, 16), (8, 32))  # (Hqk, Hv) of the packed-row sweep


def pack_configs():
    """(label, Hqk, Hv, lengths) of the packed-row sweep: every PACK_HEADS x PACK_DRAWS."""
    return [(f"{Hqk},{Hv} {sequences_label(seqs)}", Hqk, Hv, seqs)
            for Hqk, Hv in PACK_HEADS for seqs in pack_draws()]


def sweep_configs():
    """(label, Hqk, Hv, lengths): bench_bwd's matrix, then bench_gdn's ten; "4096x8" is 8 sequences of 4096 tokens."""
    matrix = [(Hqk, Hv, [T // n] * n) for Hqk, Hv in BWD_HEADS for T in BWD_TOKENS for n in BWD_SEQS]
    named = [("", Hqk, Hv, seqs) for Hqk, Hv, seqs in matrix] + [(f"{name} ", *rest) for name, *rest in GDN_CONFIGS]
    return [(f"{name}{Hqk},{Hv} {sequences_label(seqs)}", Hqk, Hv, list(seqs)) for name, Hqk, Hv, seqs in named]


def long_configs():
    """(label, Hqk, Hv, lengths) of the long-sequence sweep."""
    return [(f"{Hqk},{Hv} {sequences_label([T])}", Hqk, Hv, [T]) for Hqk, Hv, T in LONG_CONFIGS]


def sweep_of(which):
    """(configs, segment lengths) of the --sweep named `which`: "matrix", "packs" or "long"."""
    configs, lengths = {"matrix": (sweep_configs, SWEEP_LENGTHS), "packs": (pack_configs, SWEEP_LENGTHS),
                        "long": (long_configs, LONG_LENGTHS)}[which]
    return configs(), lengths


def sweep(reps, out_path, configs, lengths):
    """One line per config of `configs` at each of `lengths` (and the planned L), as `sweep_of` gives them:
    'label: planned L (fwd/fwd+bwd); best fwd L.., fwd+bwd L..; L0=f/b L8=f/b ...'."""
    from flashqla.cp.plan import resolve_segment_chunks

    lines = []
    for label, Hqk, Hv, seqs in configs:
        q, k, v, g, beta, cu = make_inputs(Hqk, Hv, seqs)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        do = torch.randn_like(v)
        planned = resolve_segment_chunks("auto", tuple(seqs), Hv, q.device, "tilelang")
        times = {}
        for L in sorted(set(lengths) | {planned}):
            if L and L >= max(seqs) // 64:
                continue
            intra_cp = L if L else "off"

            def fwd():
                with torch.no_grad():
                    flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)

            def fwd_bwd():
                o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)
                torch.autograd.grad(o, leaves, do)

            times[L] = (graph_median_ms(fwd, reps), graph_median_ms(fwd_bwd, reps))
        best_fwd, best_all = (min(times, key=lambda L: times[L][i]) for i in (0, 1))
        cells = " ".join(f"L{L}={f:.3f}/{b:.3f}" for L, (f, b) in times.items())
        lines.append(f"{label}: planned {planned} ({times[planned][0]:.3f}/{times[planned][1]:.3f}); "
                     f"best fwd L{best_fwd}, fwd+bwd L{best_all}; {cells}")
        print(lines[-1], flush=True)
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", nargs="?", const="matrix", choices=("matrix", "packs", "long"),
                    help="the planner's calibration sweep (see above): FlashQLA's matrix and bench_gdn's configs, "
                    "rows packed with documents, or single sequences of 256K to 1M tokens")
    ap.add_argument("--out", default="", help="with --sweep: also write the lines here")
    ap.add_argument("--lengths", default="off,32,64,128", help="intra_cp values: 'off', 'auto' and segment lengths in "
                    "chunks")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="all", help="indices into CONFIGS ('all' or '0,3'; 8-10: packed rows)")
    args = ap.parse_args()
    if args.sweep:
        sweep(max(args.reps, 30), args.out, *sweep_of(args.sweep))
        return
    picked = range(len(CONFIGS)) if args.configs == "all" else [int(i) for i in args.configs.split(",")]
    choices = [x if x in ("off", "auto") else int(x) for x in args.lengths.split(",")]
    print("(Hqk,Hv) tokens, intra_cp: fwd graph ms | fwd+bwd eager ms, graph ms, host ms per fwd+bwd", flush=True)
    for Hqk, Hv, seqs in (CONFIGS[i] for i in picked):
        q, k, v, g, beta, cu = make_inputs(Hqk, Hv, seqs)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        do = torch.randn_like(v)
        cells = []
        for intra_cp in choices:
            if isinstance(intra_cp, int) and max(seqs) // 64 <= intra_cp:
                continue

            def fwd_bwd():
                o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)
                o.backward(do)

            def fwd():
                with torch.no_grad():
                    return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="tilelang",
                                                           intra_cp=intra_cp)

            for _ in range(2):
                fwd_bwd()
            torch.cuda.synchronize()
            host = []
            for _ in range(5):
                start = time.perf_counter()
                fwd_bwd()
                host.append(time.perf_counter() - start)
                torch.cuda.synchronize()
            eager = eager_median_ms(fwd_bwd, args.reps // 2)
            graph = graph_median_ms(fwd_bwd, args.reps)
            cells.append(f"{intra_cp}: {graph_median_ms(fwd, args.reps):.3f} | {eager:.3f} {graph:.3f} "
                         f"host {1e3 * statistics.median(host):.2f}")
        print(f"({Hqk},{Hv}) {sequences_label(seqs)}: " + " ;; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
