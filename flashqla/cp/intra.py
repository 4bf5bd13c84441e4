"""Intra-card CP on the chunk grid: the segment states and their mirror in backward (design doc §3-4).

Rows of the grid are segments (plan.py). A segment's incoming state comes either from the exact chain

    S_{j,0} = S*_{j-1} + M_{j-1} S_{j-1,0}                (forward, fp32 or wider)
    X_j     = D_{j+1} + M_{j+1}^T X_{j+1}                 (backward: X_j = gradient of the state leaving j)

or, for a (segment, head) whose gates decay enough, from a warmup: rerun only the last W chunks of the
previous segment from zero (forward), or the first W chunks of the next segment from a zero gradient
(backward). One walk over every segment from zero, restarted at the warmup chunk, gives S* for exact
heads and the warmup state for the others at once; M is built only for (segment, head) pairs on the
exact path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import reference
from .plan import SegmentPlan


@dataclass
class WarmupPlan:
    """Per (row, chunk, head) restart flags and per (row, head) exact-chain flags, for one direction."""

    restart: torch.Tensor  # [rows, chunks, Hv] bool
    exact: torch.Tensor  # [rows, Hv] bool: this row's boundary state comes from the exact chain


def _row_index(rows, device):
    return torch.tensor(rows, dtype=torch.long, device=device)


def rows_at_positions(plan: SegmentPlan, device) -> tuple:
    """The rows at position 1, 2, ... within their sequence, one entry per position: a slice when they
    are consecutive rows (always, for one segmented sequence), else an index tensor on `device`."""
    steps = []
    for k in range(1, max(plan.position) + 1):
        rows = [r for r, p in enumerate(plan.position) if p == k]
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        steps.append(slice(rows[0], rows[0] + len(rows)) if consecutive else _row_index(rows, device))
    return tuple(steps)


def shifted(rows, by: int):
    """`rows` (a slice or an index tensor) moved by `by` rows."""
    if isinstance(rows, slice):
        return slice(rows.start + by, rows.stop + by)
    return rows + by


def fold_step(out, rows, bias, mats, states):
    """out[rows] = bias + mats @ states over [rows, Hv, ...] operands: one batched GEMM, written in place
    when `rows` is a slice (the operands are then views)."""
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    if isinstance(rows, slice):
        torch.baddbmm(flat(bias), flat(mats), flat(states), out=flat(out[rows]))
    else:
        out[rows] = torch.baddbmm(flat(bias), flat(mats), flat(states)).view(bias.shape)


def warmup_plans(plan: SegmentPlan, gc: torch.Tensor, threshold: float | None):
    """Gate statistics -> (forward WarmupPlan, backward WarmupPlan).

    chunk_decay[row, c, h] = sum of g over chunk c (= gc at the chunk's last slot). Forward: walking back
    from the end of segment j-1, the restart chunk is the last c where the decay summed over chunks
    c..end drops below `threshold`; none found means the exact M path. Backward mirrors it forward from
    the start of segment j+1. threshold None: exact everywhere.
    """
    chunk_decay = gc[..., -1].transpose(1, 2)  # [rows, Hv, chunks]
    rows, heads, chunks = chunk_decay.shape
    position = torch.tensor(plan.position, device=gc.device)
    has_next = torch.cat([position[1:] > 0, position.new_zeros(1, dtype=torch.bool)])
    has_prev = position > 0
    chunk_ids = torch.arange(chunks, device=gc.device)
    if threshold is None:
        never = torch.zeros(rows, heads, chunks, dtype=torch.bool, device=gc.device)
        back_ok, fwd_ok = never, never
    else:
        back_ok = chunk_decay.flip(-1).cumsum(-1).flip(-1) < threshold  # from chunk c to the row end
        fwd_ok = chunk_decay.cumsum(-1) < threshold  # from the row start to chunk c
    # forward: restart of row j (feeding row j+1) at the largest c with back_ok
    back_found = back_ok.any(-1)
    back_at = torch.where(back_ok, chunk_ids, -1).amax(-1)
    # backward: restart of row j (feeding row j-1) at the smallest c with fwd_ok
    fwd_found = fwd_ok.any(-1)
    fwd_at = torch.where(fwd_ok, chunk_ids, chunks).amin(-1)

    def flags(found, at, feeds):
        restart = (chunk_ids == at.unsqueeze(-1)) & (found & feeds[:, None]).unsqueeze(-1)
        return restart.transpose(1, 2)  # [rows, chunks, Hv]

    fwd = WarmupPlan(flags(back_found, back_at, has_next), torch.zeros(rows, heads, dtype=torch.bool, device=gc.device))
    bwd = WarmupPlan(flags(fwd_found, fwd_at, has_prev), torch.zeros_like(fwd.exact))
    # exact flags live on the row that receives the boundary state
    fwd.exact[1:] = ~back_found[:-1] & has_prev[1:, None]
    bwd.exact[:-1] = ~fwd_found[1:] & has_next[:-1, None]
    return fwd, bwd


def _products_where_needed(x: reference.ChunkInputs, needed: torch.Tensor) -> torch.Tensor:
    """M [rows, Hv, K, K] for the (row, head) pairs in `needed` (zeros elsewhere, never read)."""
    rows, heads = needed.nonzero(as_tuple=True)
    K = x.k.shape[-1]
    M = x.k.new_zeros(needed.shape + (K, K))
    if rows.numel():
        pick = lambda t: t[rows, :, heads].unsqueeze(2)  # [pairs, chunks, 1, ...]
        sub = reference.ChunkInputs(pick(x.q), pick(x.k), pick(x.v), pick(x.gc), pick(x.beta), pick(x.A),
                                    reference.decay_factors(pick(x.gc)))
        M[rows, heads] = reference.transition_product(sub).squeeze(1)
    return M


def segment_initial_states(x, plan: SegmentPlan, fwd: WarmupPlan, bwd: WarmupPlan | None,
                           S0_sequences: torch.Tensor):
    """The state entering every segment [rows, Hv, K, V], and M (built for the backward scan too when
    `bwd` is given)."""
    zeros = S0_sequences.new_zeros((len(plan.position),) + S0_sequences.shape[1:])
    _, _, S_tail = reference.state_walk(x, zeros, scale=1.0, with_output=False, restart=fwd.restart)
    needed = torch.zeros_like(fwd.exact)
    needed[:-1] |= fwd.exact[1:]
    if bwd is not None:
        needed[1:] |= bwd.exact[:-1]
    M = _products_where_needed(x, needed)
    S0 = torch.empty_like(zeros)
    S0[_row_index(plan.first_rows, x.q.device)] = S0_sequences.to(S0.dtype)
    return chain_segments(S0, S_tail, M, fwd.exact, rows_at_positions(plan, x.q.device)), M


def chain_segments(S0, S_tail, M, exact, steps):
    """S_{j,0} = S_tail_{j-1} + [exact] M_{j-1} S_{j-1,0}, in place on S0 (its first rows already set).

    steps: `rows_at_positions`, the rows at position 1, 2, ... within their sequence; each step depends on
    the one before and is one batched GEMM (the exact mask is folded into M once).
    """
    if not steps:
        return S0
    M_kept = M[:-1] * exact[1:, :, None, None].to(M.dtype)  # row j + 1 reads M_j only where exact
    for rows in steps:
        before = shifted(rows, -1)
        fold_step(S0, rows, S_tail[before], M_kept[before], S0[before])
    return S0


def segment_final_gradients(x, b: reference.BackwardTerms, plan: SegmentPlan, bwd: WarmupPlan, M: torch.Tensor,
                            dS_sequences: torch.Tensor):
    """X_j, the gradient of the state leaving every segment [rows, Hv, K, V] (the mirror scan)."""
    zeros = dS_sequences.new_zeros((len(plan.position),) + dS_sequences.shape[1:])
    *_, D_head = reference.reverse_walk(x, b, zeros, restart=bwd.restart)
    X = torch.empty_like(zeros)
    last = _row_index(plan.last_rows, x.q.device)
    X[last] = dS_sequences.to(X.dtype)
    steps = rows_at_positions(plan, x.q.device)
    if not steps:
        return X
    # row j - 1 reads M_j^T only where its exit was chained exactly (the mask folded into M once)
    MT_kept = M[1:].transpose(-1, -2) * bwd.exact[:-1, :, None, None].to(M.dtype)
    for rows in reversed(steps):  # rows at position p, from the deepest position back
        before = shifted(rows, -1)
        fold_step(X, before, D_head[rows], MT_kept[before], X[rows])
    return X
