"""Intra-card AutoCP planning: whether to cut long sequences into segments, and how long (design doc §4).

Planning reads only sequence lengths (host integers from cu_seqlens, cached by tensor identity in
flashqla.ops.checks), never device data, so a training step with a fixed pack can be graph-captured.
"""
from __future__ import annotations

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


# Our own H200 calibration of the TileLang path. Sweep of 2026-11-30 (fifth session, after S* and M became
# one summary launch and the final walk fused): CUDA-graph ms, forward / fwd+bwd, off vs the best L: Hv 8
# 32K 1.58 / 5.86 -> 0.79 / 2.94 (L 32), Hv 24 32K 2.66 / 9.30 -> 1.90 / 7.65 (32), Hv 32 32K 2.88 /
# 11.70 -> 2.22 / 10.25 (128); loads above 32 (e.g. 4 x 8K x 64 heads) were not measured to gain. Re-swept
# on 2026-12-01 (fourteenth session, 19 configs) and 2026-12-03 (twenty-sixth, 14 configs at L = 16 to 128,
# docs/benchmarks.md): the best L is where the walks (segments x v-heads) fill whole waves of the GPU with
# the fewest segments. A walk's chunk steps run in parallel across CTAs, so the walks take about waves x L
# chunk steps, and each segment of the longest sequence adds a step of the fp32 fold (forward and backward)
# and per-segment work (warm-up walks):
#     cost(L) = ceil(heads x segments / SMs) x L x WALK_STEP + segments of the longest sequence x SEGMENT_STEP
# WALK_STEP is the H200's time per chunk of the final and summary walks at TP8 32K; SEGMENT_STEP is fitted
# to the sweeps (between 3.2 and 6.4 us every measured best holds; the fold alone is ~2.5 us a step each
# way). The cheapest L of 16, 32, 64, 128 (the longest on a tie) is the measured best, forward and fwd+bwd,
# on 13 of the last sweep's 14 configs (h32 32K: 128 against 64, within 1%), and on the fourteenth
# session's 19 (where Hv 16 x 32K was 3% faster at 64 too, and Hv 4 x 32K 8% faster forward at 32 with
# fwd+bwd tied, than the previous rule's 32 and 16), e.g. Hv 8 32K: 32; Hv 8 128K: 128 (forward 15%
# faster than at 32); Hv 16 32K: 64 (3-4%); Hv 12 32K: 64 (forward 5-10% faster than at 16 and 32); Hv 24
# 32K: 32, where 64 and 128 would leave a wave part-filled.
TILELANG_MAX_LOAD = 32  # effective batch x v-heads
TILELANG_MIN_CHUNKS = 128  # longest sequence (8K tokens); shorter ones were not measured
TILELANG_SEGMENT_CHOICES = (16, 32, 64, 128)  # chunks; shorter and longer ones were not measured to win
WALK_STEP_US = 4.8  # one chunk of the final and summary walks (H200)
SEGMENT_STEP_US = 5.0  # one segment of the longest sequence (fitted, H200)
H200_SMS = 132


@functools.lru_cache(maxsize=256)
def calibrated_segment_chunks(lengths: tuple[int, ...], heads: int, sm_count: int = H200_SMS) -> int:
    """"auto" on the TileLang kernels: for a longest sequence of >= 128 chunks and effective batch x heads
    (load) <= 32, the L of TILELANG_SEGMENT_CHOICES with the lowest modelled cost (above; the longest on a
    tie) among those shorter than the longest sequence; 0 (off) otherwise."""
    chunks = [math.ceil(n / CHUNK) for n in lengths if n > 0]
    if not chunks:
        return 0
    total, longest = sum(chunks), max(chunks)
    if total / longest * heads > TILELANG_MAX_LOAD or longest < TILELANG_MIN_CHUNKS:
        return 0

    def cost(L):
        segments = sum(math.ceil(c / L) for c in chunks)
        waves = math.ceil(heads * segments / sm_count)
        return waves * L * WALK_STEP_US + math.ceil(longest / L) * SEGMENT_STEP_US

    candidates = [L for L in TILELANG_SEGMENT_CHOICES if longest > L]
    return min(reversed(candidates), key=cost) if candidates else 0


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
