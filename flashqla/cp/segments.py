"""Intra-card CP for a whole-sequence forward kernel: segments run as packed sequences (design doc §3-4).

A segment is just a shorter sequence with its own initial state, so any forward that takes
`cu_seqlens` and `initial_state` (the TileLang kernels) runs intra-card CP in three steps:

1. every segment from the zero state: its final state is S*_j (one launch over the segment pack);
2. the chain S_{j,0} = S*_{j-1} + [exact] M_{j-1} S_{j-1,0} in fp32, where a head takes the exact M
   term only when the previous segment's summed log-decay stays above `cp_warmup` (a warmup over the
   whole previous segment already brought the neglected term under e^cp_warmup). M is formed from the
   chunk transitions T = gamma_last (I - K^T A diag(beta) K) in fp32 with torch;
3. every segment from its S_{j,0} (one launch): the outputs.

No host synchronisation: the plan comes from host-side sequence lengths, the exact/warmup choice is a
device mask.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ops import reference
from ..ops.layout import runs_from_lengths
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
    grid: object  # ChunkGrid of the segments, token index on the device


@functools.lru_cache(maxsize=64)
def _plan_tensors(plan: SegmentPlan, num_tokens: int, device: torch.device) -> _PlanTensors:
    as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    starts = as_tensor(plan.starts)
    grid = runs_from_lengths(plan.starts, plan.lengths, num_tokens)
    grid = type(grid)(grid.token_index.to(device), num_tokens)
    steps = tuple(as_tensor([r for r, p in enumerate(plan.position) if p == step])
                  for step in range(1, max(plan.position) + 1))
    return _PlanTensors(as_tensor(plan.starts + (plan.starts[-1] + plan.lengths[-1],), torch.int32), starts,
                        starts + as_tensor(plan.lengths), as_tensor(plan.position) > 0, as_tensor(plan.first_rows),
                        as_tensor(plan.last_rows), steps, grid)


def _segment_log_decay(g: torch.Tensor, idx: _PlanTensors) -> torch.Tensor:
    """Sum of g over every segment [rows, Hv] (fp32), from one cumulative sum over the stream."""
    flat = g.reshape(-1, g.shape[-1]).float()
    prefix = torch.cat([flat.new_zeros(1, flat.shape[1]), flat.cumsum(0)])
    return prefix[idx.ends] - prefix[idx.starts]


def _transition_products(q, k, v, g, beta, idx: _PlanTensors) -> torch.Tensor:
    """M of every segment [rows, Hv, K, K] in fp32."""
    flat = [x.reshape((-1,) + x.shape[2:]) for x in (q, k, v, g, beta)]
    return reference.transition_product(reference.to_chunk_inputs(idx.grid, *flat))


def segmented_forward(forward, q, k, v, g, beta, scale, initial_state, output_final_state, plan: SegmentPlan,
                      cp_warmup):
    """forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens) -> (o, final_state)
    is a whole-sequence forward; returns what it would return on the unsegmented call."""
    B, T = q.shape[:2]
    idx = _plan_tensors(plan, B * T, q.device)
    packed = [x.reshape((1, B * T) + x.shape[2:]) for x in (q, k, v, g, beta)]
    _, S_star = forward(*packed, scale, None, True, idx.cu)

    exact = idx.has_prev[:, None].expand(-1, v.shape[2]).clone()
    if cp_warmup is not None:
        exact[1:] &= _segment_log_decay(g, idx)[:-1] >= cp_warmup  # row j reads the decay of row j-1
    M = _transition_products(q, k, v, g, beta, idx).to(S_star.dtype)  # fp32 (fp64 for fp64 inputs)

    S0 = torch.zeros_like(S_star)
    if initial_state is not None:
        S0[idx.first] = initial_state.to(S0.dtype)
    S0 = chain_segments(S0, S_star, M, exact, idx.steps)
    o, S_final = forward(*packed, scale, S0, output_final_state, idx.cu)
    final_state = S_final[idx.last] if output_final_state else None
    return o.reshape(v.shape[:3] + (v.shape[3],)), final_state
