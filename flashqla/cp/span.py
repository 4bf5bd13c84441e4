"""Inter-card CP on one rank: a sequence's summary over its span of a part, and the mirror in backward.

A span (the tokens of one sequence inside one part, [1, T]) is cut into segments of `segment_chunks`
chunks that run as one packed varlen batch, every segment from zero (design doc §3):

    forward    (S*_j, M_j) of every segment, folded in order:  S = M_j S + S*_j,  M = M_j M
    backward   D_j (the gradient of segment j's entering state with a zero gradient leaving it) and
               M_j, folded from the end:  D = D_0 + M_0^T (D_1 + M_1^T (D_2 + ...))

so the serial part is one segment long instead of the whole span. The folds run in fp32 (fp64 for fp64
inputs), pairwise (log2(segments) batched products).

Warmup (design doc §4, the threshold `cp_warmup` that intra-card CP uses): when the gates of EVERY
v-head decay by more than e^cp_warmup over the last W chunks of the span (W fewer than all of them),
the state entering those chunks reaches the span's end scaled by at most that much (||M|| <= e^(sum g)).
The forward then sends M = 0 and S* of those W chunks from zero, W the fewest such chunks; the backward
takes D over the fewest leading chunks that decay that much, with a zero gradient leaving them. The
backward folds the M the forward sent (0 where it took the warmup), so it differentiates what the
forward computed. One head that does not decay that much, or a span no longer than its warmup, takes
the exact segmented path: real models' gates always decay (g = 0 heads occur only in tests), and a
short span costs little either way (and small packs stay exact). The decision costs a few small
kernels and one scalar copied to the host per span.
"""
from __future__ import annotations

import math

import torch

from ..ops import backends, reference
from ..ops.layout import CHUNK

# segment length when the call has no intra-card plan: long enough that the summary walks fill the GPU
# with segments x heads CTAs, short enough that the serial walk is a small part of the local forward
DEFAULT_SEGMENT_CHUNKS = 64


def segment_bounds(length: int, segment_chunks: int) -> tuple[int, ...]:
    """Offsets of the segments of a span of `length` tokens: (0, L*64, 2L*64, ..., length)."""
    return tuple(range(0, length, segment_chunks * CHUNK)) + (length,)


def cumulative_chunk_decay(g: torch.Tensor) -> torch.Tensor:
    """g [1, T, Hv] -> fp64 [chunks + 1, Hv] on g's device: row c is the sum of g over the span's first c
    chunks (chunks counted from the span start)."""
    T = g.shape[1]
    chunks = math.ceil(T / CHUNK)
    padded = torch.nn.functional.pad(g[0], (0, 0, 0, chunks * CHUNK - T))
    per_chunk = padded.reshape(chunks, CHUNK, -1).sum(1, dtype=torch.float64)
    # the scan along the contiguous dim (heads-major): a scan over the outer dim took 0.36 ms on the
    # H200 for 2048 chunks x 8 heads, more than the rest of the decision
    cumulative = per_chunk.t().contiguous().cumsum(-1)
    return torch.nn.functional.pad(cumulative, (1, 0)).t()


def warm_chunks(cumulative: torch.Tensor, threshold: float | None, from_end: bool) -> int | None:
    """The fewest trailing (from_end) or leading chunks of a span whose summed g is below `threshold`
    for every head, given `cumulative_chunk_decay`; None (the exact path) when threshold is None or no
    run shorter than the whole span decays that much for every head (a head with g = 0, or a span so
    short that its warmup would be all of it, which would save nothing but the M walk of a short span).
    Computed where `cumulative` lives; the answer is one scalar copied to the host."""
    if threshold is None:
        return None
    chunks = cumulative.shape[0] - 1
    sums = cumulative[-1] - cumulative.flip(0) if from_end else cumulative  # sums[w]: last / first w chunks
    warm = (sums[:chunks] < threshold).all(-1)
    first = int(torch.where(warm.any(), warm.int().argmax(), -1))
    return None if first < 0 else first


def fold(states: torch.Tensor, mats: torch.Tensor):
    """(S, M) of a run of pieces from theirs [n, ...] in order: S = M_j S + S*_j, M = M_j M (design §3).

    Pairwise: each round composes neighbours (the later one applied after the earlier one), so n pieces
    take log2(n) batched products."""
    while states.shape[0] > 1:
        n = states.shape[0] - states.shape[0] % 2  # pieces that have a neighbour this round
        paired_states = mats[1:n:2] @ states[0:n:2] + states[1:n:2]
        paired_mats = mats[1:n:2] @ mats[0:n:2]
        states, mats = torch.cat([paired_states, states[n:]]), torch.cat([paired_mats, mats[n:]])
    return states[0], mats[0]


def _tokens(tensors, start: int, end: int):
    return [t[:, start:end] for t in tensors]


def _segmented_summary(backend, inputs, segment_chunks: int, with_transition: bool):
    """(S*, M or None) of the whole of `inputs` ([1, T] tensors) from its segments' summaries."""
    dtype = reference.work_dtype(inputs[0])
    bounds = segment_bounds(inputs[0].shape[1], segment_chunks)
    several = len(bounds) > 2  # folding S* needs the M_j of later segments
    S_star, M = backends.summary(backend, *inputs, with_transition or several, bounds)
    S_star, M = S_star.to(dtype), None if M is None else M.to(dtype)
    if several:
        S_star, M = fold(S_star, M)
    else:
        S_star, M = S_star[0], None if M is None else M[0]
    return S_star, M if with_transition else None


def span_summary(backend, q, k, v, g, beta, spanning: bool, segment_chunks: int, cp_warmup):
    """(S*, M or None) of a span [1, T] from the zero state: S_end = M S_start + S* (design doc §3).

    M (the transition product, needed only for a sequence `spanning` the whole part) is None when not
    spanning or when the warmup drops it. Shapes [Hv, K, V] and [Hv, K, K], fp32 (fp64 for fp64 inputs).
    """
    inputs = (q, k, v, g, beta)
    tail = None if cp_warmup is None else warm_chunks(cumulative_chunk_decay(g), cp_warmup, from_end=True)
    if tail is None:
        return _segmented_summary(backend, inputs, segment_chunks, spanning)
    start = (math.ceil(q.shape[1] / CHUNK) - tail) * CHUNK
    return _segmented_summary(backend, _tokens(inputs, start, q.shape[1]), segment_chunks, False)


def _segmented_entering_gradient(backend, inputs, scale: float, do, segment_chunks: int):
    """D of the whole of `inputs` ([1, T] tensors, output gradient `do`) from its segments' D_j and M_j."""
    dtype = reference.work_dtype(inputs[0])
    bounds = segment_bounds(inputs[0].shape[1], segment_chunks)
    D = backends.entering_state_gradient(backend, *inputs, scale, do, bounds).to(dtype)
    if len(bounds) == 2:
        return D[0]
    M = backends.summary(backend, *inputs, True, bounds)[1].to(dtype)
    # the forward fold read from the end, with M_j^T: D_{n-1}, then M_{n-2}^T D + D_{n-2}, ...
    return fold(D.flip(0), M.transpose(-1, -2).flip(0))[0]


def span_entering_gradient(backend, q, k, v, g, beta, scale: float, do, segment_chunks: int, cp_warmup):
    """D: the gradient of the state entering a span [1, T] from its outputs' gradient `do` when the
    gradient leaving the span is zero; [Hv, K, V], fp32 (fp64 for fp64 inputs). With the warmup, D of
    the span's first W chunks alone (the rest reaches the entering state scaled by < e^cp_warmup)."""
    inputs = (q, k, v, g, beta)
    head = None if cp_warmup is None else warm_chunks(cumulative_chunk_decay(g), cp_warmup, from_end=False)
    if head is None:
        return _segmented_entering_gradient(backend, inputs, scale, do, segment_chunks)
    end = min(head * CHUNK, q.shape[1])
    return _segmented_entering_gradient(backend, _tokens(inputs, 0, end), scale, do[:, :end], segment_chunks)
