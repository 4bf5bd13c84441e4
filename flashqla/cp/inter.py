"""Inter-card CP: the S0 chain across the parts of the token stream (design doc §3), forward and backward.

Forward, per part p (in true token order): the part's last sequence, if it goes on into part p+1, is
summarised from the zero state as S_end = M_p S_enter + S*_p (M_p = 0 when that sequence started in
p). One all-gather shares (S*, M); each rank folds the chain of the parts before each of its own,

    S_enter[p] = S*_{p-1} + M_{p-1} S_enter[p-1]     (fp32, or fp64 for fp64 inputs)

and runs the ordinary local op with S_enter as the initial state of the part's first sequence. The
summaries come from span.py: the span cut into segments summarised in parallel and folded, or, when
every head's gates decay by more than e^cp_warmup over the span, S* of its last few chunks and M = 0.
On NCCL the all-gather is started asynchronously and the local work that does not need S_enter (every
sequence that starts on this rank) runs while it is in flight.

Backward mirrors it: for its first sequence each part computes D_p, the gradient of the state entering
the part when the gradient leaving the part is zero (span.py: segments' reverse walks and a fold, or
the first few chunks under the same warmup rule), and M'_p (the transition product of that sequence
inside the part, 0 if it ends there or the forward's warmup dropped it); one all-gather; then
X_p = D_{p+1} + M'_{p+1}^T X_{p+1}
is the gradient of the state leaving part p, fed to the local backward as the last sequence's dht.

Every rank joins every all-gather, whether or not it needs the result. Before the summaries, a tiny
all-gather of each rank's error flag and shapes lets a bad call on one rank raise on all of them
(instead of leaving the others waiting) and guarantees equal payload sizes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops import backends, reference, torch_backend
from . import span
from .context import CPContext


def _span(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t[:, start:end]


class _Exchange:
    """One all-gather of per-part (state, matrix) pairs, joined by every rank.

    Asynchronous on NCCL, so local GPU work overlaps the transfer; synchronous on gloo, where the
    transfer and the CPU compute share the same cores and an overlap buys nothing.
    """

    def __init__(self, cp: CPContext, states: torch.Tensor, mats: torch.Tensor):
        self.cp = cp
        self.shapes = (states.shape, mats.shape)
        payload = torch.cat([states.reshape(-1), mats.reshape(-1)])
        self.gathered = [torch.empty_like(payload) for _ in range(cp.world_size)]
        overlap = dist.get_backend(cp.group) == "nccl"
        self.work = dist.all_gather(self.gathered, payload, group=cp.group, async_op=overlap)

    def wait(self):
        """-> states [parts, ...], mats [parts, ...] of every part in global order."""
        if self.work is not None:
            self.work.wait()
        (s_shape, m_shape), cp = self.shapes, self.cp
        n_states = s_shape.numel()
        states = torch.empty((cp.num_parts,) + s_shape[1:], dtype=self.gathered[0].dtype, device=self.gathered[0].device)
        mats = torch.empty((cp.num_parts,) + m_shape[1:], dtype=states.dtype, device=states.device)
        for rank, payload in enumerate(self.gathered):
            parts = list(cp.parts_of_rank[rank])
            states[parts] = payload[:n_states].reshape(s_shape)
            mats[parts] = payload[n_states:].reshape(m_shape)
        return states, mats


def local_error(cp: CPContext, q, cu_seqlens, initial_state, output_final_state) -> str | None:
    """What is wrong with this rank's call given its context (None if nothing); never raises."""
    if q.shape[0] != 1:
        return f"cp_context needs the packed layout (batch 1), got q with batch {q.shape[0]}"
    if q.shape[1] != cp.local_tokens:
        return f"q has {q.shape[1]} tokens on rank {cp.rank}, but cp_context gives this rank {cp.local_tokens}"
    if cu_seqlens is not None and (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.tolist() != list(cp.local_bounds)):
        return "cu_seqlens differs from cp_context's local offsets; pass cu_seqlens=None with cp_context"
    if initial_state is not None or output_final_state:
        return "initial_state / output_final_state are not supported with cp_context"
    return None


def agree_on_call(cp: CPContext, error: str | None, q, v) -> None:
    """A tiny all-gather of (error flag, head counts, dims, dtype) before the summaries, so payload sizes
    match on every rank and a bad call on one rank raises on all of them instead of hanging."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    if error:  # the shapes may be anything: send only the flag
        header = [1, 0, 0, 0, 0, 0]
    else:
        header = [0, q.shape[2], v.shape[2], q.shape[3], v.shape[3], dtypes.index(q.dtype) if q.dtype in dtypes else -1]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(cp.group) == "nccl" else "cpu"
    mine = torch.tensor(header, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(cp.world_size)]
    dist.all_gather(everyone, mine, group=cp.group)
    everyone = torch.stack(everyone).cpu()
    if error:
        raise ValueError(error)
    if everyone[:, 0].any():
        raise ValueError("chunk_gated_delta_rule with cp_context failed on another rank (see its error)")
    if not torch.all(everyone[:, 1:] == everyone[cp.rank, 1:]):  # no rank raised above: all rows are real
        raise ValueError("ranks of the CP group disagree on head counts, head dims or dtype: "
                         f"{everyone[:, 1:].tolist()} (rows = ranks: Hqk, Hv, K, V, dtype)")


class InterCardCPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, cp: CPContext, plan, cp_warmup, backend):
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        dtype = reference.work_dtype(q)
        S_star = q.new_zeros((len(cp.pieces), Hv, K, V), dtype=dtype)
        M = q.new_zeros((len(cp.pieces), Hv, K, K), dtype=dtype)
        for i, piece in enumerate(cp.pieces):
            if piece.last_seq_continues:
                s, e = _sequence_span(cp, cp.last_sequence_of(piece))
                spanning = cp.first_sequence_of(piece) == cp.last_sequence_of(piece) and piece.first_seq_continues
                S_star[i], M_piece = span.span_summary(backend, *[_span(t, s, e) for t in (q, k, v, g, beta)],
                                                       spanning, _segment_chunks(plan), cp_warmup)
                if M_piece is not None:  # None: not spanning, or the warmup dropped it
                    M[i] = M_piece
        exchange = _Exchange(cp, S_star, M)
        # while the summaries travel: every sequence that starts on this rank (zero initial state), each
        # sequence computed once (a sequence continuing from an earlier part waits for its state below)
        o = q.new_empty(v.shape)
        for s, e in _ranges_starting_here(cp):
            bounds = tuple(b - s for b in cp.local_bounds if s <= b <= e)
            cu_range = backends.device_offsets(bounds, q.device)
            o[:, s:e] = _local_forward(*[_span(t, s, e) for t in (q, k, v, g, beta)], scale, None, cu_range,
                                       _range_plan(plan, bounds), cp_warmup, backend)
        initial_state = q.new_zeros((len(cp.local_bounds) - 1, Hv, K, V), dtype=dtype)
        states, mats = exchange.wait()
        S_enter = _fold_forward(cp, states, mats)
        for piece in cp.pieces:
            if piece.first_seq_continues:
                n = cp.first_sequence_of(piece)
                initial_state[n] = S_enter[piece.index]
                s, e = _sequence_span(cp, n)
                o[:, s:e] = _local_forward(*[_span(t, s, e) for t in (q, k, v, g, beta)], scale,
                                           initial_state[n:n + 1], None, _range_plan(plan, (0, e - s)), cp_warmup, backend)
        # M of a sequence spanning a whole part is also that part's M'_p in backward (0 where the warmup
        # dropped it, and the backward's D then takes the warmup too: span.py): keep it
        ctx.save_for_backward(q, k, v, g, beta, initial_state, M)
        ctx.scale, ctx.cp, ctx.plan, ctx.cp_warmup, ctx.backend = scale, cp, plan, cp_warmup, backend
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, initial_state, M_spanning = ctx.saved_tensors
        cp, scale, plan, warmup = ctx.cp, ctx.scale, ctx.plan, ctx.cp_warmup
        do = do.contiguous()
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        D = torch.zeros((len(cp.pieces), Hv, K, V), dtype=initial_state.dtype, device=q.device)
        for i, piece in enumerate(cp.pieces):
            if piece.first_seq_continues:
                n = cp.first_sequence_of(piece)
                s, e = _sequence_span(cp, n)
                args = [_span(t, s, e) for t in (q, k, v, g, beta)]
                # D: gradient of the entering state with a zero gradient leaving the part (reverse walks
                # alone; the full local backward below gives the other gradients)
                D[i] = span.span_entering_gradient(ctx.backend, *args, scale, do[:, s:e], _segment_chunks(plan),
                                                   warmup)
        # M'_p is nonzero only where the first sequence also leaves the part: the forward's M
        exchange = _Exchange(cp, D, M_spanning)
        dD, dM = exchange.wait()
        X = _fold_backward(cp, dD, dM)
        dht = torch.zeros_like(initial_state)
        for piece in cp.pieces:
            if piece.last_seq_continues:
                dht[cp.last_sequence_of(piece)] = X[piece.index]
        call = backends.Call(q, k, v, g, beta, initial_state, cp.cu_seqlens)
        dq, dk, dv, dg, dbeta, _ = backends.backward(ctx.backend, call, scale, plan, warmup, do, dht)
        return dq, dk, dv, dg, dbeta, None, None, None, None, None


def _sequence_span(cp: CPContext, n: int) -> tuple[int, int]:
    return cp.local_bounds[n], cp.local_bounds[n + 1]


def _segment_chunks(plan) -> int:
    """Segment length of the span summaries: the call's intra-card one, else span.py's default."""
    return plan.segment_chunks if plan.segment_chunks > 0 else span.DEFAULT_SEGMENT_CHUNKS


def _ranges_starting_here(cp: CPContext) -> list[tuple[int, int]]:
    """Local token ranges [start, end) whose sequences all start on this rank: each piece without the
    sequence it continues from the part before (empty when that sequence fills the piece)."""
    ranges = []
    for piece in cp.pieces:
        start, end = piece.local_start, piece.local_start + piece.length
        if piece.first_seq_continues:
            start = cp.local_bounds[cp.first_sequence_of(piece) + 1]
        if start < end:
            ranges.append((start, end))
    return ranges


def _range_plan(plan, bounds: tuple[int, ...]):
    """The call's segment length, for the sequences at offsets `bounds` of a range of the local stream."""
    return torch_backend.make_plan(1, bounds[-1], list(bounds), plan.segment_chunks)


def _local_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, plan, cp_warmup, backend):
    call = backends.Call(q, k, v, g, beta, initial_state, cu_seqlens)
    o, _ = backends.forward(backend, call, scale, False, plan, cp_warmup)
    return o


def _fold_forward(cp: CPContext, S_star: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """S_enter[p] for every part: the chain of (S*, M) over the parts before it, in token order."""
    S_enter = torch.zeros_like(S_star)
    for p in range(1, cp.num_parts):
        if cp.part_flags[p][0]:  # the sequence entering part p started earlier
            S_enter[p] = S_star[p - 1] + M[p - 1] @ S_enter[p - 1]
    return S_enter


def _fold_backward(cp: CPContext, D: torch.Tensor, M_first: torch.Tensor) -> torch.Tensor:
    """X[p]: gradient of the state leaving part p, from the parts after it, in reverse token order."""
    X = torch.zeros_like(D)
    for p in reversed(range(cp.num_parts - 1)):
        if cp.part_flags[p][1]:  # the last sequence of part p goes on into part p+1
            X[p] = D[p + 1] + M_first[p + 1].transpose(-1, -2) @ X[p + 1]
    return X
