"""Intra-card CP on the TileLang kernels: segments run as packed sequences (design doc §3-4).

A segment is a shorter sequence with its own initial state. After one `wy_inverse` over all chunks:

1. the state-only summary walk (chunk_states with store_chunks = 0), every segment from zero: S*_j;
   the same walk with U = 0 from S0 = I: the transition product M_j (S_end = M_j S_0 + S*_j);
2. the chain S_{j,0} = S*_{j-1} + [exact] M_{j-1} S_{j-1,0} in fp32 (intra.chain_segments), where a
   head takes the M term only when the previous segment's summed log-decay stays above `cp_warmup`
   (the neglected term is then below e^cp_warmup of the state it multiplies);
3. the state walk from every S_{j,0}, storing the per-chunk states, then `chunk_output` for all chunks.

Steps 1 and 3 run segments x heads x V tiles CTAs instead of sequences x heads x V tiles: that is the
parallelism CP buys for few long sequences.

No host synchronisation: the plan comes from host-side sequence lengths, the exact/warmup choice is a
device mask.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .intra import chain_segments
from .plan import SegmentPlan


@dataclass(frozen=True)
class _PlanTensors:
    """The plan's index tensors on one device, built once (no host-to-device copy per call, so a
    step can be captured in a CUDA graph after a warm-up call)."""

    cu: torch.Tensor  # segment offsets, int32 [rows + 1]
    starts: torch.Tensor
    ends: torch.Tensor
    has_prev: torch.Tensor  # [rows] bool
    first: torch.Tensor
    last: torch.Tensor
    steps: tuple[torch.Tensor, ...]  # rows at position 1, 2, ... within their sequence
    segment_of_token: torch.Tensor  # [num_tokens] row of every token (the rows cover the stream)


@functools.lru_cache(maxsize=64)
def _plan_tensors(plan: SegmentPlan, num_tokens: int, device: torch.device) -> _PlanTensors:
    as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    starts = as_tensor(plan.starts)
    steps = tuple(as_tensor([r for r, p in enumerate(plan.position) if p == step])
                  for step in range(1, max(plan.position) + 1))
    return _PlanTensors(as_tensor(plan.starts + (plan.starts[-1] + plan.lengths[-1],), torch.int32), starts,
                        starts + as_tensor(plan.lengths), as_tensor(plan.position) > 0, as_tensor(plan.first_rows),
                        as_tensor(plan.last_rows), steps,
                        torch.repeat_interleave(torch.arange(len(plan.lengths), device=device), as_tensor(plan.lengths)))


def _segment_log_decay(g: torch.Tensor, idx: _PlanTensors) -> torch.Tensor:
    """Sum of g over every segment [rows, Hv] (fp32): one index_add over the stream (a prefix sum over
    the token dim would be an outer-dim scan, 8 ms at 32K tokens on an H200, and lose fp32 digits)."""
    flat = g.reshape(-1, g.shape[-1]).float()
    return flat.new_zeros(idx.cu.numel() - 1, flat.shape[1]).index_add_(0, idx.segment_of_token, flat)


def segmented_forward(hopper, q, k, v, g, beta, scale, initial_state, output_final_state, plan: SegmentPlan,
                      cp_warmup):
    """Intra-card CP on the TileLang kernels (`hopper` = flashqla.kernels.hopper); returns what the
    unsegmented forward would return, (o, final_state)."""
    B, T = q.shape[:2]
    Hv = v.shape[2]
    idx = _plan_tensors(plan, B * T, q.device)
    packed = [x.reshape((1, B * T) + x.shape[2:]) for x in (q, k, v, g, beta)]
    # segments start on chunk boundaries of their sequence, so they chunk exactly like the sequences
    x = hopper.prepare(*packed, idx.cu)
    S_star, M = hopper.summaries(x, with_transition=True)

    exact = idx.has_prev[:, None].expand(-1, Hv).clone()
    if cp_warmup is not None:
        exact[1:] &= _segment_log_decay(g, idx)[:-1] >= cp_warmup  # row j reads the decay of row j-1
    S0 = torch.zeros_like(S_star)
    if initial_state is not None:
        S0[idx.first] = initial_state.to(S0.dtype)
    S0 = chain_segments(S0, S_star, M, exact, idx.steps)
    h, vnew, S_final = hopper.walk(x, S0, store_final=output_final_state)
    o = hopper.output(x, h, vnew, scale)
    final_state = S_final[idx.last] if output_final_state else None
    return o.view(v.shape), final_state
