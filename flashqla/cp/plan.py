"""Intra-card AutoCP planning: whether to cut long sequences into segments, and how long (design doc §4).

Planning reads only sequence lengths (host integers from cu_seqlens, cached by tensor identity in
flashqla.ops.checks), never device data, so a training step with a fixed pack can be graph-captured.
"""
from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass

from ..kernels.hopper.launch import sm_count_on  # the SM count the kernels' tile choices read
from ..ops.layout import CHUNK


@dataclass(frozen=True)
class SegmentPlan:
    """Rows of the chunk grid: each sequence cut into consecutive segments of `segment_chunks` chunks.

    Segment j of a sequence starts from the state the sequence has after segment j-1; segments of one
    sequence are consecutive rows, the last one possibly shorter.
    """

    segment_chunks: int  # L; 0 means "not cut" (one row per sequence)
    starts: tuple[int, ...]  # first token of each row in the flat stream
    lengths: tuple[int, ...]  # tokens in each row
    sequence: tuple[int, ...]  # the sequence each row belongs to
    position: tuple[int, ...]  # index of the row within its sequence (0 = first segment)

    @property
    def is_segmented(self) -> bool:
        return any(p > 0 for p in self.position)

    @property
    def bounds(self) -> tuple[int, ...]:
        """The rows' token bounds in the flat stream (rows are consecutive): the kernels' cu_seqlens, on the host."""
        return self.starts + (self.starts[-1] + self.lengths[-1],)

    @property
    def first_rows(self) -> tuple[int, ...]:
        return tuple(r for r, p in enumerate(self.position) if p == 0)

    @property
    def last_rows(self) -> tuple[int, ...]:
        n = len(self.position)
        return tuple(r for r in range(n) if r + 1 == n or self.position[r + 1] == 0)


@functools.lru_cache(maxsize=256)
def plan_segments(starts: tuple[int, ...], lengths: tuple[int, ...], segment_chunks: int) -> SegmentPlan:
    """Cuts every sequence longer than segment_chunks chunks (segment_chunks = 0: cut nothing)."""
    rows = ([], [], [], [])
    for seq, (start, length) in enumerate(zip(starts, lengths)):
        step = segment_chunks * CHUNK if segment_chunks > 0 else max(length, 1)
        offsets = range(0, max(length, 1), step)
        for pos, off in enumerate(offsets):
            for col, value in zip(rows, (start + off, min(step, length - off), seq, pos)):
                col.append(value)
    return SegmentPlan(segment_chunks, *(tuple(col) for col in rows))


def auto_segment_chunks(lengths: tuple[int, ...], heads: int, sm_count: int) -> int:
    """The published H200 rule (design doc §4), a starting point until our own calibration sweep.

    CP pays only when batch x heads cannot fill the GPU: effective batch Be = total chunks / longest
    sequence's chunks; enable when Be*H <= 40, or Be*H <= 56 with >= 128 chunks (8K tokens).
    Then L = 2^round(log2(3 sqrt(H * total_chunks / #SM))), at least 4 chunks. Returns 0 for "off".
    """
    chunks = [math.ceil(n / CHUNK) for n in lengths if n > 0]
    if not chunks:
        return 0
    total, longest = sum(chunks), max(chunks)
    load = total / longest * heads
    if not (load <= 40 or (load <= 56 and longest >= 128)):
        return 0
    L = max(4, 2 ** round(math.log2(3 * math.sqrt(heads * total / sm_count))))
    return L if longest > L else 0


# Our own H200 calibration of the TileLang path (thirty-first session, 2026-12-04, docs/benchmarks.md; the data in
# tests/data/autocp_sweep_h200.txt, `benchmarks/bench_autocp.py --sweep`): 50 configs (FlashQLA's backward
# matrix, bench_gdn's ten, eight more up to 128K tokens and 64 v-heads), each unsegmented and at L = 8 to 128
# chunks, forward and fwd+bwd in CUDA graphs. A call walks its rows (sequences, or segments of them) one chunk
# step at a time, a CTA per row and v-head; an SM holding w such walks at once steps each of them in about
# max(1, w / WALK_OVERLAP) times one walk's step (one walk alone leaves the SM mostly waiting). A segmented
# call walks each segment of a cut sequence about SEGMENTED_PASSES times (the summary and final walks, the
# backward's walks from zero and its reverse walk, against the forward and backward walks of an unsegmented
# one; a sequence of one row has no summary), and pays SEGMENT_STEPS chunk steps per segment of the longest
# sequence (the fp32 fold over segments, both ways):
#     cost(L)   = walks(every row) + (SEGMENTED_PASSES - 1) x walks(the rows of cut sequences)
#                 + SEGMENT_STEPS x segments of the longest sequence
#     cost(off) = walks(the sequences)
#     walks(rows) = max(longest row, sum over waves of the wave's mean row / WALK_OVERLAP)
# where the waves are the (row, v-head) walks longest first, SMs at a time (`_walks_time`). On rows of one length
# that is L x max(1, ceil(v-heads x rows / SMs) / WALK_OVERLAP), the form fitted on the sweep: the cheapest of
# off and the L of TILELANG_SEGMENT_CHOICES shorter than the longest sequence (off, then the longest L, on a tie)
# is within 1.033x of the best forward and 1.088x of the best fwd+bwd on every config, 0.2% and 0.4% off on the
# geometric mean; re-measured on an H100 with the kernels of the fiftieth session (tests/data/
# autocp_sweep_h100.txt, 42 configs) within 1.016x and 1.010x. The rule it replaces (a load threshold, 128
# chunks at least, waves x L x 4.8 us + 5 us per segment) was 2.4% and 3.1% off on the first 42, up to 1.42x on
# fwd+bwd (2 x 4K tokens at 4 v-heads, left unsegmented). The misses: 64 v-heads x 1 x 32K and 32 v-heads x 2 x
# 16K stay unsegmented where L = 64 is 8.8% and 5.4% faster fwd+bwd; 8 v-heads x 64K takes 64 where 32 is
# 2.5-3.3% faster.
# Rows packed with documents (fiftieth session, H100, tests/data/autocp_sweep_packs_h100.txt: 24 rows of 32K
# tokens, 3 to 60 lognormal documents, 4 to 32 v-heads): counting every row as long as the longest and every
# segment as walked SEGMENTED_PASSES times, the rule cut rows whose short documents already filled the GPU (at
# 32 v-heads L = 8 where off was 1.63x faster forward, 1.26x fwd+bwd; 17% and 8% off on the geometric mean);
# with the waves' mean rows and the passes on cut sequences only, 1.1% and 1.0% off, the one miss a 7-document
# row at 32 v-heads left unsegmented where L = 32 or 64 is 1.17x / 1.15x faster.
# One sequence of 256K to 1M tokens (fifty-seventh session, H100, tests/data/autocp_sweep_long_h100.txt, 7 configs at 8
# to 32 v-heads, segments of 64 to 512 chunks): with choices up to 128 the rule took 128 everywhere, up to 1.12x off the
# best forward at 1M tokens (fewer segments: fewer exact summaries and chain steps) and 1.044x off the best fwd+bwd;
# with 256 and 512 among them, within 1.016x and 1.020x (the cost model's own picks, unchanged). No config of the
# three sweeps above changes its L.
TILELANG_SEGMENT_CHOICES = (8, 16, 32, 64, 128, 256, 512)  # chunks
SEGMENTED_PASSES = 2.75
WALK_OVERLAP = 1.25
SEGMENT_STEPS = 2.5
H200_SMS = 132


def _walks_time(rows: list[int], heads: int, sm_count: int) -> float:
    """One pass of walks over `rows` (chunks each) with `heads` v-heads, in chunk steps of one walk: the (row,
    v-head) walks longest first, `sm_count` to a wave; each wave costs its mean row over WALK_OVERLAP (more walks
    than SMs share them), and no pass is shorter than its longest row. Rows of one length go in bulk (a 1M-token
    sequence at L = 8 is 2048 rows)."""
    waves, wave_sum, filled = 0.0, 0, 0  # whole waves' cost so far; the open wave's walks and their chunks
    for length, count in sorted(collections.Counter(rows).items(), reverse=True):
        left = count * heads
        if filled:  # top up the open wave first
            take = min(left, sm_count - filled)
            wave_sum, filled, left = wave_sum + take * length, filled + take, left - take
            if filled == sm_count:
                waves, wave_sum, filled = waves + wave_sum / sm_count, 0, 0
        full, rest = divmod(left, sm_count)  # left > 0 only with the open wave closed
        waves += full * length
        wave_sum, filled = wave_sum + rest * length, filled + rest
    if filled:
        waves += wave_sum / filled
    return max(max(rows), waves / WALK_OVERLAP)


@functools.lru_cache(maxsize=256)
def calibrated_segment_chunks(lengths: tuple[int, ...], heads: int, sm_count: int = H200_SMS) -> int:
    """"auto" on the TileLang kernels: the segment length in chunks (0 = off) of the lowest modelled cost
    (above) among off and the L of TILELANG_SEGMENT_CHOICES shorter than the longest sequence."""
    chunks = [math.ceil(n / CHUNK) for n in lengths if n > 0]
    if not chunks:
        return 0
    longest = max(chunks)

    def cost(L):
        if L >= longest:  # off
            return _walks_time(chunks, heads, sm_count)
        cut = [min(L, c - s) for c in chunks if c > L for s in range(0, c, L)]  # the segments of cut sequences
        whole = [c for c in chunks if c <= L]  # sequences of one row
        return (_walks_time(cut + whole, heads, sm_count) + (SEGMENTED_PASSES - 1) * _walks_time(cut, heads, sm_count)
                + SEGMENT_STEPS * math.ceil(longest / L))

    candidates = [longest] + [L for L in reversed(TILELANG_SEGMENT_CHOICES) if L < longest]
    best = min(candidates, key=cost)  # the first on a tie: off, then the longest L
    return 0 if best == longest else best


def resolve_segment_chunks(intra_cp, lengths: tuple[int, ...], heads: int, device, backend: str = "torch") -> int:
    """intra_cp = "off" | "auto" | int (forced segment length in chunks) -> L (0 = not cut).

    "auto" follows our calibration on the TileLang path, the published rule for the torch backend on a
    GPU, and stays off on the CPU (the reference gains nothing from more parallel rows)."""
    if intra_cp == "off":
        return 0
    if intra_cp == "auto":
        if backend == "tilelang":
            if device.type != "cuda":  # the emulated kernels of the CPU tests: the H200 the rule was fitted on
                return calibrated_segment_chunks(lengths, heads)
            return calibrated_segment_chunks(lengths, heads, sm_count_on(device))
        if device.type != "cuda":
            return 0
        return auto_segment_chunks(lengths, heads, sm_count_on(device))
    return int(intra_cp)
