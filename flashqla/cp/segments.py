"""Intra-card CP on the TileLang kernels: segments run as packed sequences (design doc §3-4).

A segment is a shorter sequence with its own initial state. After one `wy_inverse` over all chunks:

1. one state-only summary launch (chunk_states with store_chunks = 0): S*_j, every segment from zero,
   and in the same launch the transition product M_j (the walk of V = 0 from I; S_end = M_j S_0 + S*_j),
   each only where the chain reads it (no S* for a sequence's last segment; M only for a (segment,
   head) on the exact path, next to a nonzero state), from GA, v and beta;
2. the chain S_{j,0} = S*_{j-1} + [exact] M_{j-1} S_{j-1,0} in fp32 (one `segment_chain` launch), where a
   head takes the M term only when the previous segment's summed log-decay stays above `cp_warmup`;
   elsewhere S*_{j-1} is the warmup state, the walk of only the last chunks of segment j-1 whose gates
   sum below `cp_warmup`, from zero (the neglected term is below e^cp_warmup of the state it multiplies);
3. the walk from every S_{j,0}: `fused_fwd` (outputs in the walk; `fused=False`: the state walk storing the
   per-chunk states, then `chunk_output`, the split decomposition the tests compare).

Steps 1 and 3 run segments x heads x V tiles CTAs instead of sequences x heads x V tiles: that is the
parallelism CP buys for few long sequences. The backward (`segmented_backward`) mirrors it: the same
starts, one reverse walk per segment from zero (D_j), the fp32 mirror scan, then the kernel backward
over every segment at once.

No host synchronisation: the plan comes from host-side sequence lengths, the exact/warmup choice is a
device mask.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, fields

import torch

from ..kernels.hopper.launch import ALWAYS_M, FORCE_M, FORCE_S, HAS_NEXT, INTO_EXACT
from ..ops.layout import CHUNK
from .plan import SegmentPlan


@dataclass
class Kept:
    """What a forward on the kernels leaves for its backward (flashqla/ops/backends.py): the segments'
    (S_{j,0}, M_j, exact) (None unsegmented, or not kept) and the WY inverse (the kernels' `KeptInverse`: GA,
    the cumulative gates and fp32 beta, so the backward runs no second wy_inverse; None: recomputed).

    An autograd Function saves its tensors with `save_for_backward` (`to_saved` / `from_saved`), never as
    attributes of its context: saved-tensor hooks then see them, so non-reentrant activation checkpointing drops
    them after the forward and recomputes them for the backward, and CPU offload moves them, as it does the
    inputs."""

    starts: tuple | None = None
    inverse: object = None

    def to_saved(self) -> tuple[tuple, tuple]:
        """(tensors, layout): the tensors to save (None entries kept), and what `from_saved` needs besides them."""
        starts = () if self.starts is None else tuple(self.starts)
        inverse = () if self.inverse is None else tuple(getattr(self.inverse, f.name) for f in fields(self.inverse))
        layout = (self.starts is not None, len(starts), None if self.inverse is None else type(self.inverse))
        return starts + inverse, layout

    @staticmethod
    def from_saved(layout: tuple, tensors) -> Kept:
        """The Kept that `to_saved` took apart, from its layout and its tensors as the context returns them."""
        has_starts, num_starts, inverse_type = layout
        starts = tuple(tensors[:num_starts]) if has_starts else None
        inverse = None if inverse_type is None else inverse_type(*tensors[num_starts:])
        return Kept(starts, inverse)


@dataclass(frozen=True)
class _PlanTensors:
    """The plan's index tensors on one device, built once (no host-to-device copy per call, so a
    step can be captured in a CUDA graph after a warm-up call)."""

    cu: torch.Tensor  # segment offsets, int32 [rows + 1]
    chunk_offsets: torch.Tensor  # first chunk slot of every segment, int32 [rows + 1]
    has_next: torch.Tensor  # [rows] bool: the row's sequence continues in the next row
    first: torch.Tensor  # [sequences] first row of every sequence (int32)
    first_index: torch.Tensor  # the same as int64, for index_copy_
    last: torch.Tensor  # [sequences] its last row (int32)
    last_index: torch.Tensor  # the same as int64, for index_copy_
    # the sequences' first and last rows as `segment_chain` takes them: longest first, so that the chains that take
    # steps are issued before the one-row sequences, whose CTAs only write their start row (int32 [sequences])
    chain_first: torch.Tensor
    chain_last: torch.Tensor
    chains: int  # on the host: the sequences of more than one row, whose chains take steps
    # [has_h0, dht_given (None, False, True), leaving, rows] int32: each row's flags for the gate statistics
    # (`_gate_flags`, kernels/hopper/chunk_states.py `gate_statistics`); `gate_flags` picks one row of flags
    gate_flag_table: torch.Tensor
    # [rows, longest row's chunks] int64: the last token of every chunk of every row (a row's last token
    # past its own chunks), where the chunk-local cumulative gate holds the chunk's sum
    chunk_last_token: torch.Tensor
    num_tokens: int
    first_row: int  # on the host (indexing with a device scalar would sync): the first sequence's first row
    last_row: int  # the last sequence's last row

    def gate_flags(self, has_h0: bool, dht_given: bool | None, leaving: bool) -> torch.Tensor:
        """[rows] int32, a view of the table: no launch, no host-to-device copy (CUDA-graph capturable)."""
        return self.gate_flag_table[int(has_h0), (None, False, True).index(dht_given), int(leaving)]


@functools.lru_cache(maxsize=64)
def _plan_tensors(plan: SegmentPlan, num_tokens: int, device: torch.device) -> _PlanTensors:
    as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
    chunks = [-(-length // CHUNK) for length in plan.lengths]
    has_prev = [p > 0 for p in plan.position]
    has_next = has_prev[1:] + [False]
    cu = as_tensor(plan.starts + (plan.starts[-1] + plan.lengths[-1],), torch.int32)
    # what launch.chunk_offsets_of(cu) computes on the device, once per plan
    chunk_offsets = as_tensor(list(itertools.accumulate(chunks, initial=0)), torch.int32)
    last_row = plan.last_rows[-1]
    chunk_last_token = [[start + min(CHUNK * (c + 1), length) - 1 for c in range(max(chunks))]
                        for start, length in zip(plan.starts, plan.lengths)]
    longest_first = sorted(zip(plan.first_rows, plan.last_rows), key=lambda rows: rows[0] - rows[1])  # stable
    chains = sum(last > first for first, last in longest_first)
    return _PlanTensors(cu, chunk_offsets, as_tensor(has_next, torch.bool), as_tensor(plan.first_rows, torch.int32),
                        as_tensor(plan.first_rows), as_tensor(plan.last_rows, torch.int32), as_tensor(plan.last_rows),
                        *(as_tensor([rows[i] for rows in longest_first], torch.int32) for i in (0, 1)), chains,
                        as_tensor(_gate_flags(has_prev, has_next, last_row), torch.int32),
                        as_tensor(chunk_last_token), num_tokens, plan.first_rows[0], last_row)


def _gate_flags(has_prev: list, has_next: list, last_row: int) -> list:
    """_PlanTensors.gate_flag_table, built on the host once per plan: every row's bits for the summary
    walks' gate statistics (kernels/hopper/chunk_states.py `gate_statistics`).

    HAS_NEXT: the row's sequence continues in the next row. The forward chain reads M_j where it multiplies
    a maybe nonzero S_{j,0} (j not a sequence's first segment, unless there is an initial state) into
    segment j + 1 on the exact path (INTO_EXACT); the backward's mirror scan (dht_given not None) also where
    it multiplies M_j^T by X_j, the gradient into segment j + 1 on the exact path (INTO_EXACT) or, out of a
    sequence's last segment, a given final-state gradient (ALWAYS_M). leaving: S* and M of the last row for
    the state it passes on (`leaving_state`; M where that row's start can be nonzero)."""
    table = []
    for has_h0 in (False, True):
        forward = [n and (p or has_h0) for p, n in zip(has_prev, has_next)]
        by_dht = []
        for dht_given in (None, False, True):
            into = (forward if dht_given is None
                    else [f or (p and n) for f, p, n in zip(forward, has_prev, has_next)])
            always = [dht_given is True and p and not n for p, n in zip(has_prev, has_next)]
            flags = [HAS_NEXT * n + INTO_EXACT * i + ALWAYS_M * a for n, i, a in zip(has_next, into, always)]
            leaving = list(flags)
            leaving[last_row] |= FORCE_S | (FORCE_M if has_prev[last_row] or has_h0 else 0)
            by_dht.append([flags, leaving])
        table.append(by_dht)
    return table


def _into_next(idx: _PlanTensors, exact):
    """[rows, Hv] 0/1 in exact's dtype: whether the state leaving segment j reaches the sequence's next segment
    on the exact path, exact_{j+1}, and 0 out of its last one (the f of `exit_gradients` is 1 there instead;
    segment_chain computes that f itself from `exact`)."""
    exact_next = torch.zeros_like(exact)
    exact_next[:-1] = torch.where(idx.has_next[:-1, None], exact[1:], 0.0)
    return exact_next


def _segment_summaries(hopper, x, idx: _PlanTensors, cp_warmup, has_h0: bool, dht_given=None, leaving=False):
    """(S*_j, M_j, exact mask [rows, Hv] fp32 0/1) of every segment from zero: step 1 above (no initial state
    needed, only whether one will come), fp32, in one launch whose walks first read the gates of `x` (design
    doc §4): row j starts from the exact chain where row j - 1 does not warm up (the gates of none of its
    trailing runs of chunks sum below `cp_warmup`; None: exact everywhere); S*_j is walked where segment j + 1
    starts from it (a warmed-up row from the last chunk from which its gates sum below `cp_warmup`, as the
    torch backend restarts), M_j where a chain multiplies it by a state or gradient that can be nonzero
    (`_gate_flags`). has_h0: an initial state will be given; dht_given: None for no backward, else whether the
    final state has a gradient; leaving: also the last row's S* and M, for the state it passes on
    (`leaving_state`)."""
    threshold = -math.inf if cp_warmup is None else cp_warmup
    S_star, M, exact, _ = hopper.summaries_from_gates(x, idx.gate_flags(has_h0, dht_given, leaving), threshold)
    return S_star, M, exact


def _chain(hopper, S_star, M, exact, idx: _PlanTensors, initial_state):
    """S_{j,0} of every segment: step 2 above, S_{j,0} = S*_{j-1} + [exact_j] M_{j-1} S_{j-1,0}, the
    whole chain in one launch from the sequences' initial states (zero when None)."""
    S0 = torch.empty_like(S_star)  # the chain writes every row, and with no initial state the first rows' zeros
    if initial_state is not None:
        S0.index_copy_(0, idx.first_index, initial_state.to(S0.dtype))
    return hopper.fold_segments(S0, S_star, M, exact, idx.chain_first, idx.chain_last, reverse=False,
                                zero_start=initial_state is None, num_chains=idx.chains)


def _packed(idx, *tensors):
    return [t.reshape((1, idx.num_tokens) + t.shape[2:]) for t in tensors]


@dataclass
class ForwardSummaries:
    """What the forward computes before it needs the initial states (`forward_summaries`)."""

    idx: _PlanTensors
    packed: list
    x: object  # hopper.prepare's result
    S_star: torch.Tensor
    M: torch.Tensor
    exact: torch.Tensor
    v_shape: torch.Size
    fused: bool  # the last walk's kernel: fused_fwd, or the state walk and chunk_output
    keep_inverse: bool = False  # the backward reads the WY inverse (`Kept`)
    keep_states: bool = False  # and the per-chunk states the fused walk stores beside O


def forward_summaries(hopper, q, k, v, g, beta, plan: SegmentPlan, cp_warmup, has_h0: bool,
                      dht_given: bool | None = None, leaving: bool = False, fused=True,
                      keep_inverse=False, keep_states=False) -> ForwardSummaries:
    """The first half of `segmented_forward`: everything that does not read the initial states (the
    WY inverse and the summary launch), so inter-card CP runs it while the states are on their way.
    has_h0: an initial state will be given; dht_given, leaving: as `_summaries_needed` (dht_given None:
    no backward); fused: the last walk's kernel (fused_fwd, or the split walk and output); keep_inverse:
    the walk's `Kept` carries the WY inverse, which the backward then reads instead of computing it again;
    keep_states (fused, with keep_inverse): and the state entering every chunk of every segment, stored by the
    fused walk beside O, which the backward then does not recompute."""
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be True or False, got {fused!r}")
    if keep_states and not (fused and keep_inverse):
        raise ValueError("keep_states needs the fused walk and keep_inverse (the states ride on the inverse)")
    idx = _plan_tensors(plan, q.shape[0] * q.shape[1], q.device)
    # segments start on chunk boundaries of their sequence, so they chunk exactly like the sequences
    packed = _packed(idx, q, k, v, g, beta)
    x = hopper.prepare(*packed, idx.cu, chunk_offsets=idx.chunk_offsets)
    summaries = _segment_summaries(hopper, x, idx, cp_warmup, has_h0, dht_given, leaving)
    return ForwardSummaries(idx, packed, x, *summaries, v.shape, fused, keep_inverse, keep_states)


def forward_chain(hopper, summ: ForwardSummaries, initial_state):
    """S_{j,0} of every segment from the sequences' initial states (step 2 above)."""
    return _chain(hopper, summ.S_star, summ.M, summ.exact, summ.idx, initial_state)


def leaving_state(summ: ForwardSummaries, S0):
    """The final state of the call's last sequence before any walk, [Hv, K, V] fp32: S*_last + M_last
    S_{last,0}, from summaries asked with `leaving` (which computes M_last wherever S_{last,0} can be
    nonzero)."""
    last = summ.idx.last_row
    return summ.S_star[last] + summ.M[last] @ S0[last]


def forward_walk(hopper, summ: ForwardSummaries, S0, scale, output_final_state, with_starts=False):
    """Step 3 above from the segments' starts S0: (o, final state[, `Kept`: the starts, and the inverse when
    the summaries kept it])."""
    idx, x, v = summ.idx, summ.x, summ.packed[2]
    states = hopper.states_buffer(x) if summ.keep_states and with_starts else None
    if summ.fused:
        o, S_final = hopper.fused_forward(x, v, S0, scale, output_final_state, states)
    else:
        h, vnew, S_final = hopper.walk(x, S0, store_final=output_final_state)
        o = hopper.output(x, h, vnew, scale)
    final_state = S_final[idx.last] if output_final_state else None
    o = o.view(summ.v_shape)
    if not with_starts:
        return o, final_state
    return o, final_state, Kept((S0, summ.M, summ.exact), x.kept(states) if summ.keep_inverse else None)


def forward_from_summaries(hopper, summ: ForwardSummaries, scale, initial_state, output_final_state,
                           with_starts=False):
    """The second half of `segmented_forward`: the chain from the initial states, then the walk."""
    S0 = forward_chain(hopper, summ, initial_state)
    return forward_walk(hopper, summ, S0, scale, output_final_state, with_starts)


def segmented_forward(hopper, q, k, v, g, beta, scale, initial_state, output_final_state, plan: SegmentPlan,
                      cp_warmup, fused=True, with_starts=False, keep_inverse=False, keep_states=False):
    """Intra-card CP on the TileLang kernels (`hopper` = flashqla.kernels.hopper); returns what the
    unsegmented forward would return, (o, final_state), and with_starts a `Kept` with the segments'
    (S_{j,0}, M, exact) for `segmented_backward` (fp32 [rows, Hv, 128, 128] twice: small next to the
    activations, and the backward then skips the summary launch and the chain) and, with keep_inverse, the
    WY inverse (with keep_states, and the per-chunk states). fused: the final walk's kernel (fused_fwd, or the
    split walk and output)."""
    # kept for the backward: with the M its mirror scan reads (a final-state gradient exists only when
    # the final state is returned)
    summ = forward_summaries(hopper, q, k, v, g, beta, plan, cp_warmup, initial_state is not None,
                             dht_given=output_final_state if with_starts else None, fused=fused,
                             keep_inverse=keep_inverse, keep_states=keep_states)
    return forward_from_summaries(hopper, summ, scale, initial_state, output_final_state, with_starts)


def exit_gradients(hopper, D, M, exact, idx: _PlanTensors, dht):
    """X_j, the gradient of the state leaving every segment, fp32 [rows, Hv, K, V] (the mirror scan).

    A sequence's last segment leaves with dht (zero when None). Otherwise segment j+1 starts from
    S*_j + [exact_{j+1}] M_j S_{j,0}, so X_j = G_{j+1}, the gradient of that start, which is
    D_{j+1} (its own outputs' gradient, from zero) + f_{j+1} M_{j+1}^T X_{j+1}, with f = 1 into a
    sequence's final state and exact_{j+2} into the next segment's start.
    """
    X = torch.empty_like(D)  # the mirror scan writes every row, and with no dht the last rows' zeros
    if dht is not None:
        X.index_copy_(0, idx.last_index, dht.to(X.dtype))
    # row j - 1 reads f_j from `exact` itself (segment_chain.py): 1 out of a sequence's last row, else exact_{j+1}
    return hopper.fold_segments(X, D, M, exact, idx.chain_first, idx.chain_last, reverse=True, zero_start=dht is None,
                                num_chains=idx.chains)


def _reverse_walk_last_chunks(idx: _PlanTensors, gcum, cp_warmup: float):
    """[Hv, rows] int32: the last chunk of each segment that its reverse walk from zero (D_j) covers.

    Chunk c's outputs reach the segment's start state through the decay of every chunk before it, at most
    exp(sum of their gates): the walk covers the chunks up to the first one after which the gates from the
    segment's start sum below `cp_warmup`, which is the count of leading chunks whose running sum stays at
    or above it (design doc §4, the forward's warmup mirrored: the neglected part of D_j is below
    e^cp_warmup of the gradients it would have carried back). A head that never decays that far walks its
    whole segment (the kernel caps the count at the segment's chunks). The torch backend's backward restart
    is the same chunk (`intra.warmup_plans`, the first chunk whose running sum is below the threshold), from
    its own chunked layout."""
    running = gcum[:, idx.chunk_last_token].cumsum(-1)  # [Hv, rows, chunks]: gates from the start through c
    return (running >= cp_warmup).sum(-1, dtype=torch.int32)


@dataclass
class BackwardPrologue:
    """What the backward computes before it needs the final-state gradient (`backward_prologue`)."""

    idx: _PlanTensors
    packed: list
    x: object
    starts: tuple  # (S_{j,0}, M_j, exact)
    do: torch.Tensor  # as the kernels read it (hopper.output_gradient)
    scale: float
    D: torch.Tensor
    shapes: tuple
    has_h0: bool
    bounds: tuple  # the rows' token bounds on the host (`SegmentPlan.bounds`)
    states: torch.Tensor | None = None  # the per-chunk states the forward kept (`keep_states`), or None
    exits_without_dht: torch.Tensor | None = None  # the mirror scan with no dht, once `entering_gradient` ran it


def backward_prologue(hopper, q, k, v, g, beta, scale, initial_state, plan: SegmentPlan, cp_warmup, do,
                      dht_given: bool, kept: Kept | None = None) -> BackwardPrologue:
    """The first half of `segmented_backward`: the WY inverse (the forward's, or recomputed), the starts
    (likewise), and every segment's reverse walk from zero (D_j); nothing here reads the final-state
    gradient, so inter-card CP runs it while that gradient is on its way."""
    idx = _plan_tensors(plan, q.shape[0] * q.shape[1], q.device)
    packed = _packed(idx, q, k, v, g, beta)
    kept = kept or Kept()
    if kept.inverse is None:
        x = hopper.prepare(*packed, idx.cu, chunk_offsets=idx.chunk_offsets)
    else:  # the forward's packed layout and chunk grid are these (the same plan)
        x = hopper.prepare_from_kept(packed[0], packed[1], packed[2], kept.inverse, idx.cu,
                                     chunk_offsets=idx.chunk_offsets)
    starts = kept.starts
    if starts is None:  # not kept by the forward: recomputed, as the forward computed them
        S_star, M, exact = _segment_summaries(hopper, x, idx, cp_warmup, initial_state is not None, dht_given)
        starts = (_chain(hopper, S_star, M, exact, idx, initial_state), M, exact)
    do = hopper.output_gradient(x, do)
    # dS0 alone: no per-chunk dS stored; warmed up where the walks take more than a wave of CTAs (within one
    # wave the heads that walk whole segments set the launch's time anyway), each walk covers its segment's
    # first chunks only
    last_chunks = None
    if cp_warmup is not None and hopper.walks_exceed_a_wave(q.device, x.num_seqs, x.num_v_heads):
        last_chunks = _reverse_walk_last_chunks(idx, x.gcum, cp_warmup)
    _, D = hopper.state_gradients(x, do, scale, None, store_dh=False, last_chunks=last_chunks)
    return BackwardPrologue(idx, packed, x, starts, do, scale, D, tuple(t.shape for t in (q, k, v, g, beta)),
                            initial_state is not None, plan.bounds, None if kept.inverse is None else kept.inverse.states)


def backward_finish(hopper, pro: BackwardPrologue, dht):
    """The second half of `segmented_backward`: the mirror scan from `dht`, then the kernel backward of
    every segment at once; (dq, dk, dv, dg, dbeta, dh0 or None)."""
    S0, M, exact = pro.starts

    def exits():  # on the current stream, while the per-chunk states are recomputed beside it (backward_of)
        if dht is None and pro.exits_without_dht is not None:
            return pro.exits_without_dht
        return exit_gradients(hopper, pro.D, M, exact, pro.idx, dht)

    *grads, dS0 = hopper.backward_of(pro.x, *pro.packed, pro.do, pro.scale, S0, exits, pro.states, pro.bounds)
    grads = [grad.view(shape) for grad, shape in zip(grads, pro.shapes)]
    return (*grads, dS0[pro.idx.first] if pro.has_h0 else None)


def entering_gradient(hopper, pro: BackwardPrologue):
    """The gradient of the first sequence's initial state from the call's outputs alone (a zero gradient
    leaving its last sequence), [Hv, K, V] fp32, from the prologue: the mirror scan with no dht gives
    X_first, and S_{first+1,0} = S*_first + [exact_{first+1}] M_first h0 gives
    dh0 = D_first + [exact_{first+1}] M_first^T X_first (D_first alone for a one-segment sequence)."""
    S0, M, exact = pro.starts
    X = pro.exits_without_dht = exit_gradients(hopper, pro.D, M, exact, pro.idx, None)
    first = pro.idx.first_row
    into_next = _into_next(pro.idx, exact)[first].to(X.dtype)  # [Hv]
    return pro.D[first] + into_next[:, None, None] * (M[first].transpose(-1, -2) @ X[first])


def segmented_backward(hopper, q, k, v, g, beta, scale, initial_state, plan: SegmentPlan, cp_warmup, do, dht,
                       kept: Kept | None = None):
    """The gradients of `segmented_forward` (its o and final state): (dq, dk, dv, dg, dbeta, dh0).

    The segments' starts and WY inverse are the forward's (`kept`) or recomputed as in the forward; one
    reverse walk from zero gives every segment's D_j, the fp32 mirror scan (`exit_gradients`) the gradient
    leaving each segment, and the kernel backward then runs every segment at once from its start and its
    exit gradient. Where the forward dropped M_j S_{j,0} (warmup), the scan drops M_j^T likewise; the
    segment's own inputs still see the whole exit gradient, i.e. the gradient of the term the forward
    dropped, which is below e^cp_warmup of the state like the term itself.
    """
    pro = backward_prologue(hopper, q, k, v, g, beta, scale, initial_state, plan, cp_warmup, do, dht is not None,
                            kept)
    *grads, dh0 = backward_finish(hopper, pro, dht)
    return (*grads, None if dh0 is None else dh0.to(initial_state.dtype))
