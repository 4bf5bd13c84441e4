"""Intra-card AutoCP planning: whether to cut long sequences into segments, and how long (design doc §4).

Planning reads only sequence lengths (host integers from cu_seqlens, cached by tensor identity in
flashqla.ops.checks), never device data, so a training step with a fixed pack can be graph-captured.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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
# on 2026-12-01 (fourteenth session: cheaper summaries and chain, docs/benchmarks.md) over 19 configs:
# the best L grows with the work, v-heads x total chunks (HC), as the cost model's sqrt(N) says: at loads
# <= 24, HC <= 2048 wants 16 chunks (TP8 16K 1.037 -> 0.983 ms fwd+bwd, (2, 4) 8K 0.506 -> 0.446, (4, 8)
# 8K 0.677 -> 0.614, (2, 4) 4 x 8K 1.012 -> 0.927), above it 32 (Hv 24 32K: 64 loses 8%; Hv 16 32K: 64
# wins 3%); at loads 25-32, HC / 128 chunks (Hv 16 2 x 16K: 64, 3.53 -> 3.00; Hv 32 32K: 128; Hv 32 8K:
# 32, 1.785 off -> 1.588).
TILELANG_MAX_LOAD = 32  # effective batch x v-heads
TILELANG_MIN_CHUNKS = 128  # longest sequence (8K tokens); shorter ones were not measured
TILELANG_SHORT_SEGMENTS_MAX_LOAD = 24  # L of 16 or 32 chunks up to this load, HC / 128 above
TILELANG_SHORTEST_MAX_WORK = 2048  # v-heads x total chunks up to which L = 16


def calibrated_segment_chunks(lengths: tuple[int, ...], heads: int) -> int:
    """"auto" on the TileLang kernels, for a longest sequence of >= 128 chunks and effective batch x heads
    (load) <= 32: with HC = heads x total chunks, L = 16 chunks (HC <= 2048) or 32 at loads <= 24, else
    HC / 128 (a power of two, 32 to 128); 0 (off) otherwise or when the longest sequence fits one segment."""
    chunks = [math.ceil(n / CHUNK) for n in lengths if n > 0]
    if not chunks:
        return 0
    total, longest = sum(chunks), max(chunks)
    load = total / longest * heads
    if load > TILELANG_MAX_LOAD or longest < TILELANG_MIN_CHUNKS:
        return 0
    work = heads * total
    if load <= TILELANG_SHORT_SEGMENTS_MAX_LOAD:
        L = 16 if work <= TILELANG_SHORTEST_MAX_WORK else 32
    else:
        L = min(128, max(32, 2 ** round(math.log2(work / 128))))
    return L if longest > L else 0


def resolve_segment_chunks(intra_cp, lengths: tuple[int, ...], heads: int, device, backend: str = "torch") -> int:
    """intra_cp = "off" | "auto" | int (forced segment length in chunks) -> L (0 = not cut).

    "auto" follows our calibration on the TileLang path, the published rule for the torch backend on a
    GPU, and stays off on the CPU (the reference gains nothing from more parallel rows)."""
    if intra_cp == "off":
        return 0
    if intra_cp == "auto":
        if backend == "tilelang":
            return calibrated_segment_chunks(lengths, heads)
        if device.type != "cuda":
            return 0
        import torch

        return auto_segment_chunks(lengths, heads, torch.cuda.get_device_properties(device).multi_processor_count)
    return int(intra_cp)
