"""The two serial walks alone (chunk_states, chunk_dstates) at every V tile width: calibrates the walks'
tile choice (`launch.block_v_for`), which decides how many CTAs share an SM.

Nsight Compute on one long sequence (docs/kernels.md) found the walks instruction-issue bound with one
warp per scheduler: a narrower V tile does less work per chunk and lets more CTAs (walks) share an SM,
at the price of re-reading K and GA once per tile. This prints, per configuration, the time of each
walk at block_v = 32, 64, 128 and the width dispatch picks today.

    python benchmarks/bench_walks.py [--reps 20]
"""
from __future__ import annotations

import argparse
import functools

import torch

from bench_gdn import eager_median_ms, make_inputs

CONFIGS = [  # (Hqk, Hv, sequence lengths): one long sequence, packs, many walks
    (2, 8, [32768]), (16, 32, [32768]), (2, 8, [4096] * 8), (16, 32, [8192] * 4), (16, 64, [8192] * 4),
    (2, 8, [2048] * 64),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    from flashqla.kernels.hopper import launch

    D = launch.HEAD_DIM
    print(f"{'Hqk,Hv':>7s} {'seqs':>10s} | " + " | ".join(f"states bv{b:<3d} dstates bv{b:<3d}" for b in
                                                          launch.BLOCK_V_CHOICES) + " | dispatch")
    for Hqk, Hv, lengths in CONFIGS:
        q, k, v, g, beta, cu = make_inputs(Hqk, Hv, lengths)
        x = launch.prepare(q, k, v, g, beta, cu)
        N = len(lengths)
        unused = torch.empty(1, D, D, device="cuda")
        no_active = torch.zeros(1, dtype=torch.int32, device="cuda")
        h = torch.empty(x.chunk_slots, Hv, D, D, dtype=x.v.dtype, device="cuda")
        vnew, do = torch.empty_like(x.v), torch.randn_like(x.v)
        dS0 = torch.empty(N * Hv, D, D, device="cuda")
        cells = []
        for block_v in launch.BLOCK_V_CHOICES:
            states = launch.compiled_chunk_states(x.dtype, block_v)
            dstates = launch.compiled_chunk_dstates(x.dtype, block_v)
            # the plain walk storing every chunk's state: no h0, final state, transition or active list
            run_states = functools.partial(states, x.k, x.v, x.GA, x.beta, x.gcum, x.cu, x.offsets, unused, h, vnew,
                                           unused, unused, no_active, 0, 0, 1, 0, 0)
            run_dstates = functools.partial(dstates, x.q, x.k, x.GA, x.beta, do, x.gcum, x.cu, x.offsets, unused,
                                            h, dS0, x.cu, D ** -0.5, 0, 1, 1, 0)
            run_states(), run_dstates()
            states_ms, dstates_ms = eager_median_ms(run_states, args.reps), eager_median_ms(run_dstates, args.reps)
            cells.append(f"{states_ms:8.3f} ms {dstates_ms:8.3f} ms")
        picked = launch.block_v_on(q.device, N, Hv)
        print(f"{Hqk:>3d},{Hv:<3d} {len(lengths):>4d}x{lengths[0]:<5d} | " + " | ".join(cells) + f" | {picked}",
              flush=True)


if __name__ == "__main__":
    main()
