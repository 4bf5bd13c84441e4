"""Inter-card CP: the S0 chain across the parts of the token stream (design doc §3), forward and backward.

Forward, per part p (in true token order): the part's last sequence, if it goes on into part p+1, is
summarised from the zero state as S_end = M_p S_enter + S*_p (M_p = 0 when that sequence started in
p). One all-gather shares (S*, M); each rank folds the chain of the parts before each of its own,

    S_enter[p] = S*_{p-1} + M_{p-1} S_enter[p-1]     (fp32, or fp64 for fp64 inputs)

and runs the ordinary local op with S_enter as the initial state of the part's first sequence. A
sequence that started in p is summarised by the local call that runs it, on the segmented kernel path:
its own segment summaries and chain give S*_p before its walk (backends.forward_passing_state; exact,
and no work beyond that call's own). Otherwise (a sequence spanning the part, the torch backend, a call
too short to segment) the summaries come from span.py: the span cut into segments summarised in
parallel and folded, or, when every head's gates decay by more than e^cp_warmup over the span, S* of its
last few chunks and M = 0. On NCCL the all-gather is started asynchronously and the local work that does
not need S_enter runs while it is in flight: every sequence that starts on this rank, and of a sequence
entering from the part before, its WY inverse and segment summaries (backends.forward_in_two); only the
segment chain and the walk wait for the state. The forward keeps each local call's segment starts for
the backward.

Backward mirrors it: for its first sequence each part computes D_p, the gradient of the state entering
the part when the gradient leaving the part is zero (on the segmented kernel path from the local
backward's own prologue, backends.backward_passing_gradient; else span.py: segments' reverse walks and a
fold, or the first few chunks under the same warmup rule), and M'_p (the transition product of that
sequence inside the part, 0 if it ends there or the forward's warmup dropped it); one all-gather; then
X_p = D_{p+1} + M'_{p+1}^T X_{p+1}
is the gradient of the state leaving part p, fed to the local backward as the last sequence's dht. While
the D travel, the calls whose last sequence ends in this part run their whole backward, and the others
their WY inverse and reverse walks from zero (backends.backward_in_two); only the mirror scan and the
kernel backward wait for X.

Every rank joins every all-gather, whether or not it needs the result. Before the summaries, a tiny
all-gather of each rank's error flag and shapes lets a bad call on one rank raise on all of them
(instead of leaving the others waiting) and guarantees equal payload sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ops import backends, reference, torch_backend
from . import span
from .segments import Kept
from .context import CPContext, gather_host_values


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
            rank_states, rank_mats = payload[:n_states].reshape(s_shape), payload[n_states:].reshape(m_shape)
            # one part at a time: integer indices, where a list would be copied to the device from pageable
            # memory, which blocks the host until the stream drains
            for slot, part in enumerate(cp.parts_of_rank[rank]):
                states[part], mats[part] = rank_states[slot], rank_mats[slot]
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
    everyone = gather_host_values(header, cp.group)  # no wait for this rank's queued GPU work
    if error:
        raise ValueError(error)
    if everyone[:, 0].any():
        raise ValueError("chunk_gated_delta_rule with cp_context failed on another rank (see its error)")
    if not torch.all(everyone[:, 1:] == everyone[cp.rank, 1:]):  # no rank raised above: all rows are real
        raise ValueError("ranks of the CP group disagree on head counts, head dims or dtype: "
                         f"{everyone[:, 1:].tolist()} (rows = ranks: Hqk, Hv, K, V, dtype)")


@dataclass
class _LocalCall:
    """One local op call of the forward over tokens [start, end) of this rank's stream, kept for the
    backward: a run of sequences that start in this part, or a sequence entering from the part before
    (`entering`: the piece whose S_enter is its initial state). `leaving`: the piece whose chain state
    its last sequence carries on (its backward then waits for X), else None."""

    start: int
    end: int
    bounds: tuple[int, ...]  # its sequences' offsets, from 0
    slot: int  # its piece's position in cp.pieces (the rows of this rank's summaries)
    entering: int | None  # part indices, in the global chain
    leaving: int | None
    initial_state: torch.Tensor | None = None
    kept: object = None  # what the forward left for the backward (backends.forward, for_backward)

    def inputs(self, *tensors):
        return [_span(t, self.start, self.end) for t in tensors]

    def op_call(self, q, k, v, g, beta):
        offsets = backends.device_offsets(self.bounds, q.device)
        return backends.Call(*self.inputs(q, k, v, g, beta), self.initial_state, offsets)


def _local_calls(cp: CPContext) -> list[_LocalCall]:
    """The forward's local calls, in token order: per piece, the sequence entering it (if any), then the
    sequences that start in it."""
    calls = []
    for slot, piece in enumerate(cp.pieces):
        start, end = piece.local_start, piece.local_start + piece.length
        leaving = piece.index if piece.last_seq_continues else None
        if piece.first_seq_continues:
            n = cp.first_sequence_of(piece)
            s, e = _sequence_span(cp, n)
            spanning = cp.last_sequence_of(piece) == n
            calls.append(_LocalCall(s, e, (0, e - s), slot, piece.index, leaving if spanning else None))
            start = e
        if start < end:
            bounds = tuple(b - start for b in cp.local_bounds if start <= b <= end)
            calls.append(_LocalCall(start, end, bounds, slot, None, leaving))
    return calls


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Token ranges [1, t_i, ...] in order -> [1, sum t_i, ...] (no copy for a single range)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class InterCardCPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, cp: CPContext, plan, cp_warmup, backend, keep_inverse, keep_states):
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        dtype = reference.work_dtype(q)
        S_star = q.new_zeros((len(cp.pieces), Hv, K, V), dtype=dtype)
        M = q.new_zeros((len(cp.pieces), Hv, K, K), dtype=dtype)
        calls, outputs, walks = _local_calls(cp), {}, {}
        for call in calls:
            if call.leaving is None:
                continue
            # the state this call's last sequence passes on: from the call's own summaries and chain where
            # the kernels give it before the walk (a sequence that started in this part), else the span
            # summary of that sequence (a sequence spanning the part, or off the segmented kernel path)
            split = None if call.entering is not None else backends.forward_passing_state(
                backend, call.op_call(q, k, v, g, beta), scale, _range_plan(plan, call.bounds), cp_warmup,
                keep_inverse, keep_states)
            if split is not None:
                S_star[call.slot], walks[call.start] = split
                continue
            s, e = call.start + call.bounds[-2], call.end
            S_star[call.slot], M_piece = span.span_summary(backend, *[_span(t, s, e) for t in (q, k, v, g, beta)],
                                                           call.entering is not None, _segment_chunks(plan),
                                                           cp_warmup)
            if M_piece is not None:  # None: not spanning, or the warmup dropped it
                M[call.slot] = M_piece
        exchange = _Exchange(cp, S_star, M)
        # while the summaries travel: every sequence that starts on this rank (zero initial state), and of
        # each sequence entering from the part before, all that does not read its state (backends.forward_in_two)
        waiting = []
        for call in calls:
            plan_of_call = _range_plan(plan, call.bounds)
            op_call = call.op_call(q, k, v, g, beta)
            if call.start in walks:
                outputs[call.start], _, call.kept = walks[call.start]()
            elif call.entering is None:
                outputs[call.start], _, call.kept = backends.forward(backend, op_call, scale, call.leaving is not None,
                                                                     plan_of_call, cp_warmup, for_backward=True,
                                                                     keep_inverse=keep_inverse,
                                                                     keep_states=keep_states)
            else:
                waiting.append((call, backends.forward_in_two(backend, op_call, scale, call.leaving is not None,
                                                              plan_of_call, cp_warmup, keep_inverse, keep_states)))
        states, mats = exchange.wait()
        S_enter = _fold_forward(cp, states, mats)
        for call, finish in waiting:
            call.initial_state = S_enter[call.entering].unsqueeze(0)
            outputs[call.start], _, call.kept = finish(call.initial_state)
        # M of a sequence spanning a whole part is also that part's M'_p in backward (0 where the warmup
        # dropped it, and the backward's D then takes the warmup too: span.py): keep it. Every call's initial
        # state and kept tensors are saved with it (save_for_backward: saved-tensor hooks see them), not on ctx
        kept_tensors, ctx.kept_layouts = [], []
        for call in calls:
            tensors, layout = ((), None) if call.kept is None else call.kept.to_saved()
            kept_tensors += [call.initial_state, *tensors]
            ctx.kept_layouts.append((len(tensors), layout))
            call.initial_state = call.kept = None
        ctx.save_for_backward(q, k, v, g, beta, M, *kept_tensors)
        ctx.scale, ctx.cp, ctx.plan, ctx.cp_warmup, ctx.backend, ctx.calls = scale, cp, plan, cp_warmup, backend, calls
        return _joined([outputs[call.start] for call in calls])

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, M_spanning, *kept_tensors = ctx.saved_tensors
        cp, scale, plan, warmup, backend, calls = ctx.cp, ctx.scale, ctx.plan, ctx.cp_warmup, ctx.backend, ctx.calls
        position = 0
        for call, (count, layout) in zip(calls, ctx.kept_layouts):
            call.initial_state = kept_tensors[position]
            tensors = kept_tensors[position + 1:position + 1 + count]
            call.kept = None if layout is None else Kept.from_saved(layout, tensors)
            position += 1 + count
        do = do.contiguous()
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        D = torch.zeros((len(cp.pieces), Hv, K, V), dtype=reference.work_dtype(q), device=q.device)
        finishes = {}
        for call in calls:
            if call.entering is None:
                continue
            # D: gradient of the entering state with a zero gradient leaving the part; from the call's own
            # backward prologue where the kernels give it (segmented), else from the span's reverse walks
            args = (backend, call.op_call(q, k, v, g, beta), scale, _range_plan(plan, call.bounds), warmup,
                    call.inputs(do)[0], call.kept)
            split = backends.backward_passing_gradient(*args, call.leaving is not None)
            if split is not None:
                D[call.slot], finishes[call.start] = split
            else:
                D[call.slot] = span.span_entering_gradient(backend, *call.inputs(q, k, v, g, beta), scale,
                                                           call.inputs(do)[0], _segment_chunks(plan), warmup)
        # M'_p is nonzero only where the first sequence also leaves the part: the forward's M
        exchange = _Exchange(cp, D, M_spanning)
        # while the D travel: the backward of every call whose last sequence stays in this part, and of the
        # others all that does not read the gradient leaving the part (backends.backward_in_two)
        grads, waiting = {}, []
        for call in calls:
            args = (backend, call.op_call(q, k, v, g, beta), scale, _range_plan(plan, call.bounds), warmup,
                    call.inputs(do)[0])
            finish = finishes.get(call.start)
            if call.leaving is None:
                grads[call.start] = finish(None) if finish else backends.backward(*args, None, call.kept)
            else:
                waiting.append((call, finish or backends.backward_in_two(*args, call.kept)))
        dD, dM = exchange.wait()
        X = _fold_backward(cp, dD, dM)
        for call, finish in waiting:
            dht = X.new_zeros((len(call.bounds) - 1, Hv, K, V))
            dht[-1] = X[call.leaving]
            grads[call.start] = finish(dht)
        dq, dk, dv, dg, dbeta = (_joined([grads[call.start][i] for call in calls]) for i in range(5))
        for call in calls:  # the saved tensors are the context's alone again
            call.initial_state = call.kept = None
        return dq, dk, dv, dg, dbeta, None, None, None, None, None, None, None


def _sequence_span(cp: CPContext, n: int) -> tuple[int, int]:
    return cp.local_bounds[n], cp.local_bounds[n + 1]


def _segment_chunks(plan) -> int:
    """Segment length of the span summaries: the call's intra-card one, else span.py's default."""
    return plan.segment_chunks if plan.segment_chunks > 0 else span.DEFAULT_SEGMENT_CHUNKS


def _range_plan(plan, bounds: tuple[int, ...]):
    """The call's segment length, for the sequences at offsets `bounds` of a range of the local stream."""
    return torch_backend.make_plan(1, bounds[-1], list(bounds), plan.segment_chunks)


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
