"""Intra-card CP on the TileLang kernels: segments run as packed sequences (design doc §3-4).

A segment is a shorter sequence with its own initial state. After one `wy_inverse` over all chunks:

1. the state-only summary walk (chunk_states with store_chunks = 0), every segment from zero: S*_j;
   the same walk with U = 0 from S0 = I: the transition product M_j (S_end = M_j S_0 + S*_j);
2. the chain S_{j,0} = S*_{j-1} + [exact] M_{j-1} S_{j-1,0} in fp32 (intra.chain_segments), where a
   head takes the M term only when the previous segment's summed log-decay stays above `cp_warmup`
   (the neglected term is then below e^cp_warmup of the state it multiplies);
3. the state walk from every S_{j,0}, storing the per-chunk states, then `chunk_output` for all chunks.

Steps 1 and 3 run segments x heads x V tiles CTAs instead of sequences x heads x V tiles: that is the
parallelism CP buys for few long sequences. The backward (`segmented_backward`) mirrors it: the same
starts, one reverse walk per segment from zero (D_j), the fp32 mirror scan, then the kernel backward
over every segment at once.

No host synchronisation: the plan comes from host-side sequence lengths, the exact/warmup choice is a
device mask.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .intra import chain_segments, fold_step, rows_at_positions, shifted
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
    steps: tuple  # rows at position 1, 2, ... within their sequence (intra.rows_at_positions)
    segment_of_token: torch.Tensor  # [num_tokens] row of every token (the rows cover the stream)


@functools.lru_cache(maxsize=64)
def _plan_tensors(plan: SegmentPlan, num_tokens: int, device: torch.device) -> _PlanTensors:
    as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    starts = as_tensor(plan.starts)
    steps = rows_at_positions(plan, device)
    return _PlanTensors(as_tensor(plan.starts + (plan.starts[-1] + plan.lengths[-1],), torch.int32), starts,
                        starts + as_tensor(plan.lengths), as_tensor(plan.position) > 0, as_tensor(plan.first_rows),
                        as_tensor(plan.last_rows), steps,
                        torch.repeat_interleave(torch.arange(len(plan.lengths), device=device), as_tensor(plan.lengths)))


def _segment_log_decay(g: torch.Tensor, idx: _PlanTensors) -> torch.Tensor:
    """Sum of g over every segment [rows, Hv] (fp32): one index_add over the stream (a prefix sum over
    the token dim would be an outer-dim scan, 8 ms at 32K tokens on an H200, and lose fp32 digits)."""
    flat = g.reshape(-1, g.shape[-1]).float()
    return flat.new_zeros(idx.cu.numel() - 1, flat.shape[1]).index_add_(0, idx.segment_of_token, flat)


def _segment_starts(hopper, x, g, initial_state, idx: _PlanTensors, cp_warmup):
    """(S_{j,0} of every segment, M_j, exact mask [rows, Hv]): steps 1-2 above, fp32."""
    S_star, M = hopper.summaries(x, with_transition=True)
    exact = idx.has_prev[:, None].expand(-1, g.shape[-1]).clone()
    if cp_warmup is not None:
        exact[1:] &= _segment_log_decay(g, idx)[:-1] >= cp_warmup  # row j reads the decay of row j-1
    S0 = torch.zeros_like(S_star)
    if initial_state is not None:
        S0[idx.first] = initial_state.to(S0.dtype)
    return chain_segments(S0, S_star, M, exact, idx.steps), M, exact


def _packed(idx, *tensors):
    return [t.reshape((1, idx.segment_of_token.numel()) + t.shape[2:]) for t in tensors]


def segmented_forward(hopper, q, k, v, g, beta, scale, initial_state, output_final_state, plan: SegmentPlan,
                      cp_warmup):
    """Intra-card CP on the TileLang kernels (`hopper` = flashqla.kernels.hopper); returns what the
    unsegmented forward would return, (o, final_state)."""
    idx = _plan_tensors(plan, q.shape[0] * q.shape[1], q.device)
    # segments start on chunk boundaries of their sequence, so they chunk exactly like the sequences
    x = hopper.prepare(*_packed(idx, q, k, v, g, beta), idx.cu)
    S0, _, _ = _segment_starts(hopper, x, g, initial_state, idx, cp_warmup)
    h, vnew, S_final = hopper.walk(x, S0, store_final=output_final_state)
    o = hopper.output(x, h, vnew, scale)
    final_state = S_final[idx.last] if output_final_state else None
    return o.view(v.shape), final_state


def exit_gradients(D, M, exact, idx: _PlanTensors, dht):
    """X_j, the gradient of the state leaving every segment, fp32 [rows, Hv, K, V] (the mirror scan).

    A sequence's last segment leaves with dht (zero when None). Otherwise segment j+1 starts from
    S*_j + [exact_{j+1}] M_j S_{j,0}, so X_j = G_{j+1}, the gradient of that start, which is
    D_{j+1} (its own outputs' gradient, from zero) + f_{j+1} M_{j+1}^T X_{j+1}, with f = 1 into a
    sequence's final state and exact_{j+2} into the next segment's start.
    """
    X = torch.zeros_like(D)
    if dht is not None:
        X[idx.last] = dht.to(X.dtype)
    into_next = torch.ones_like(exact, dtype=D.dtype)
    into_next[:-1] = torch.where(idx.has_prev[1:, None], exact[1:].to(D.dtype), 1.0)
    if not idx.steps:
        return X
    MT_kept = M.transpose(-1, -2) * into_next[:, :, None, None]
    for rows in reversed(idx.steps):  # rows at position p, from the deepest position back
        fold_step(X, shifted(rows, -1), D[rows], MT_kept[rows], X[rows])
    return X


def segmented_backward(hopper, q, k, v, g, beta, scale, initial_state, plan: SegmentPlan, cp_warmup, do, dht):
    """The gradients of `segmented_forward` (its o and final state): (dq, dk, dv, dg, dbeta, dh0).

    The segments' starts are recomputed as in the forward; one reverse walk from zero gives every
    segment's D_j, the fp32 mirror scan (`exit_gradients`) the gradient leaving each segment, and the
    kernel backward then runs every segment at once from its start and its exit gradient. Where the
    forward dropped M_j S_{j,0} (warmup), the scan drops M_j^T likewise; the segment's own inputs still
    see the whole exit gradient, i.e. the gradient of the term the forward dropped, which is below
    e^cp_warmup of the state like the term itself.
    """
    idx = _plan_tensors(plan, q.shape[0] * q.shape[1], q.device)
    packed = _packed(idx, q, k, v, g, beta)
    x = hopper.prepare(*packed, idx.cu, store_a=True)
    S0, M, exact = _segment_starts(hopper, x, g, initial_state, idx, cp_warmup)
    dos = hopper.scaled_output_gradient(x, do, scale)
    _, D = hopper.state_gradients(x, dos, None)
    X = exit_gradients(D, M, exact, idx, dht)
    *grads, dS0 = hopper.backward_of(x, *packed, dos, S0, X)
    grads = [grad.view(t.shape) for grad, t in zip(grads, (q, k, v, g, beta))]
    return (*grads, None if initial_state is None else dS0[idx.first].to(initial_state.dtype))
