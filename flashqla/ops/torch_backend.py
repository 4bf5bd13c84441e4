"""The "torch" backend: runs the reference algebra (reference.py) on the chunk grid (layout.py).

Rows of the grid are the segments of an intra-card CP plan (flashqla/cp/plan.py); with CP off every
sequence is one row.
"""
from __future__ import annotations

import functools

import torch

from ..cp import intra
from ..cp.plan import SegmentPlan, plan_segments
from . import reference
from .layout import ChunkGrid, runs_from_lengths, sequence_bounds


def make_plan(batch: int, seq_len: int, cu_seqlens: list[int] | None, segment_chunks: int) -> SegmentPlan:
    starts, lengths = sequence_bounds(batch, seq_len, cu_seqlens)
    return plan_segments(tuple(starts), tuple(lengths), segment_chunks)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape((-1,) + x.shape[2:])


def _from_grid(grid: ChunkGrid, xc: torch.Tensor, batch: int) -> torch.Tensor:
    """[rows, chunks, H, C, *] on the grid -> [B, T, H, *] in the work dtype."""
    x = grid.scatter(xc.movedim(2, 3))
    return x.reshape((batch, -1) + x.shape[1:])


@functools.lru_cache(maxsize=64)
def _grid_on(plan: SegmentPlan, num_tokens: int, device: torch.device) -> ChunkGrid:
    """The plan's chunk grid with its token index already on `device`: built once per plan (a training
    step reuses its pack), so a call does no host-side index work and no host-to-device copy."""
    grid = runs_from_lengths(plan.starts, plan.lengths, num_tokens)
    return ChunkGrid(grid.token_index.to(device), num_tokens)


class _Prepared:
    """Grid, chunk inputs and per-sequence initial states of one call."""

    def __init__(self, q, k, v, g, beta, initial_state, plan: SegmentPlan):
        self.plan = plan
        self.grid = _grid_on(plan, q.shape[0] * q.shape[1], q.device)
        self.x = reference.to_chunk_inputs(self.grid, _flat(q), _flat(k), _flat(v), _flat(g), _flat(beta))
        dtype = self.x.q.dtype
        sequences = len(plan.first_rows)
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        self.S0_sequences = (initial_state.to(dtype) if initial_state is not None
                             else torch.zeros(sequences, Hv, K, V, dtype=dtype, device=q.device))

    def segment_states(self, cp_warmup, for_backward: bool):
        """(S0 per row, M, backward warmup plan) following the plan; no CP: the sequences' own states."""
        if not self.plan.is_segmented:
            return self.S0_sequences, None, None
        fwd, bwd = intra.warmup_plans(self.plan, self.x.gc, cp_warmup)
        S0, M = intra.segment_initial_states(self.x, self.plan, fwd, bwd if for_backward else None, self.S0_sequences)
        return S0, M, bwd


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, plan: SegmentPlan, cp_warmup=-10.0):
    p = _Prepared(q, k, v, g, beta, initial_state, plan)
    S0, _, _ = p.segment_states(cp_warmup, for_backward=False)
    O, _, S_final = reference.state_walk(p.x, S0, scale)
    o = _from_grid(p.grid, O, q.shape[0]).to(q.dtype)
    final_state = None
    if output_final_state:
        last = torch.tensor(plan.last_rows, device=q.device)
        final_state = S_final[last].to(torch.promote_types(p.x.q.dtype, torch.float32))
    return o, final_state


# chunk-local gradient math in blocks of this many chunks: bounds its temporaries (~20 [.., C, D]-sized
# fp32 tensors and a few [.., K, V]-sized ones per block) independently of the sequence length
BACKWARD_BLOCK_CHUNKS = 64


def backward(q, k, v, g, beta, scale, initial_state, plan: SegmentPlan, do, dht, cp_warmup=-10.0,
             block_chunks: int = BACKWARD_BLOCK_CHUNKS):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) in the dtypes of (q, k, v, g, beta, initial_state).

    The two serial walks (states forward, state gradients in reverse) run over whole rows; everything
    local to a chunk is computed `block_chunks` chunks at a time.
    """
    p = _Prepared(q, k, v, g, beta, initial_state, plan)
    x = p.x
    S0, M, bwd = p.segment_states(cp_warmup, for_backward=True)
    S_in = reference.states_in(x, S0)
    dO = p.grid.gather(_flat(do).to(x.q.dtype)).movedim(3, 2)
    b = reference.backward_terms(x, dO, scale)
    dS_sequences = dht.to(x.q.dtype) if dht is not None else torch.zeros_like(p.S0_sequences)
    if plan.is_segmented:
        dS_final = intra.segment_final_gradients(x, b, plan, bwd, M, dS_sequences)
    else:
        dS_final = dS_sequences
    dS_out, dS0 = reference.reverse_walk(x, b, dS_final)
    dq, dk, dv, dgc, dbeta = reference.chunk_backward_in_blocks(x, b, S_in, dS_out, block_chunks)
    dg = reference.gate_gradient(dgc)

    B, Hqk = q.shape[0], q.shape[2]

    def to_qk_heads(dx):  # sum, in the work dtype, the GQA group of v-heads that read each q/k head
        dx = _from_grid(p.grid, dx, B)
        return dx.reshape(dx.shape[:2] + (Hqk, dx.shape[2] // Hqk) + dx.shape[3:]).sum(3)

    dq, dk = to_qk_heads(dq).to(q.dtype), to_qk_heads(dk).to(k.dtype)
    dv = _from_grid(p.grid, dv, B).to(v.dtype)
    dg = _from_grid(p.grid, dg.unsqueeze(-1), B).reshape(g.shape).to(g.dtype)
    dbeta = _from_grid(p.grid, dbeta.unsqueeze(-1), B).reshape(beta.shape).to(beta.dtype)
    dh0 = None
    if initial_state is not None:
        dh0 = dS0[torch.tensor(plan.first_rows, device=q.device)].to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dh0


def entering_state_gradient(q, k, v, g, beta, scale, do, segments: tuple[int, ...] | None = None):
    """dS0 of every run of [1, T] (the whole sequence, or the segments at offsets `segments`, one grid row
    each) when the gradient of its final state is zero: the reverse walk alone (no state recompute, no
    chunk-local gradients). Inter-card CP's D (flashqla/cp/span.py); [runs, Hv, K, V]."""
    p = _Prepared(q, k, v, g, beta, None, make_plan(1, q.shape[1], segments, 0))
    dO = p.grid.gather(_flat(do).to(p.x.q.dtype)).movedim(3, 2)
    b = reference.backward_terms(p.x, dO, scale)
    _, dS0 = reference.reverse_walk(p.x, b, torch.zeros_like(p.S0_sequences))
    return dS0


def summary(q, k, v, g, beta, with_transition: bool, segments: tuple[int, ...] | None = None):
    """(S*, M or None) of every run of [1, T] (as in `entering_state_gradient`) from one chunk grid: the
    state walk from zero and the pairwise transition product (S_end = M S_start + S*, design doc §3);
    [runs, Hv, K, V] and [runs, Hv, K, K]."""
    p = _Prepared(q, k, v, g, beta, None, make_plan(1, q.shape[1], segments, 0))
    _, _, S_star = reference.state_walk(p.x, p.S0_sequences, 1.0, with_output=False)  # fp32 (fp64 for fp64)
    return S_star, reference.transition_product(p.x) if with_transition else None
