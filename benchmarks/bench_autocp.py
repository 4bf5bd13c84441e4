"""AutoCP calibration on one GPU: the public op at every segment length, forward and fwd+bwd.

    python benchmarks/bench_autocp.py [--lengths off,32,64,128] [--reps 20] [--configs all|0,3]

Per configuration and intra_cp: forward (CUDA-graph median), fwd+bwd eager and CUDA-graph medians, and the
host time of one fwd+bwd call (issue time, before the GPU finishes). The table behind
flashqla.cp.plan.calibrated_segment_chunks (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashqla
from bench_gdn import eager_median_ms, graph_median_ms, make_inputs

CONFIGS = [(2, 8, [32768]), (2, 8, [16384]), (2, 8, [8192]), (4, 16, [32768]), (4, 16, [8192]), (8, 24, [32768]),
           (16, 16, [32768]), (32, 32, [32768])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="off,32,64,128", help="intra_cp values: 'off' and segment lengths in chunks")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default="all", help="indices into CONFIGS ('all' or '0,3')")
    args = ap.parse_args()
    picked = range(len(CONFIGS)) if args.configs == "all" else [int(i) for i in args.configs.split(",")]
    choices = [x if x == "off" else int(x) for x in args.lengths.split(",")]
    print("(Hqk,Hv) tokens, intra_cp: fwd graph ms | fwd+bwd eager ms, graph ms, host ms per fwd+bwd", flush=True)
    for Hqk, Hv, seqs in (CONFIGS[i] for i in picked):
        q, k, v, g, beta, cu = make_inputs(Hqk, Hv, seqs)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        do = torch.randn_like(v)
        cells = []
        for intra_cp in choices:
            if intra_cp != "off" and sum(seqs) // 64 <= intra_cp:
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
        print(f"({Hqk},{Hv}) {'+'.join(map(str, seqs))}: " + " ;; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
