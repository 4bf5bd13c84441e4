"""Inter-card CP context: which slice of the global token stream each rank holds, and where the packed
sequences cross slice boundaries.

The global stream (B == 1 packed layout, `cu_seqlens_global`) is cut into equal parts:
- layout="contiguous": W parts, rank r holds part r;
- layout="zigzag" (Megatron's load-balanced order): 2W parts, rank r holds parts r and 2W-1-r.
A part is a "piece" of the chain; pieces are chained in true token order whatever rank holds them.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Piece:
    """One contiguous part of the global stream held by this rank."""

    index: int  # position of the part in global token order
    global_start: int
    local_start: int  # where it starts in this rank's local stream
    length: int
    first_seq_continues: bool  # its first token belongs to a sequence that started in an earlier part
    last_seq_continues: bool  # its last sequence goes on into the next part


@dataclass(frozen=True)
class CPContext:
    group: object  # torch.distributed process group (None = the default group)
    rank: int
    world_size: int
    layout: str
    num_parts: int
    pieces: tuple[Piece, ...]  # this rank's parts, in local order
    part_flags: tuple[tuple[bool, bool], ...]  # (first_seq_continues, last_seq_continues) of every part
    cu_seqlens: torch.Tensor  # LOCAL offsets (int32) of the local stream, sequences cut at part boundaries
    local_bounds: tuple[int, ...]  # the same, as host ints
    conv1d_kernel_size: int | None
    fingerprint: int  # equal on every rank of a consistent group

    @property
    def local_tokens(self) -> int:
        return self.local_bounds[-1]

    @property
    def first_seq_continues(self) -> bool:
        """The local stream's first token continues a sequence from the previous part."""
        return self.pieces[0].first_seq_continues

    def first_sequence_of(self, piece: Piece) -> int:
        """Index (in local sequences) of the piece's first sequence."""
        return self.local_bounds.index(piece.local_start)

    def last_sequence_of(self, piece: Piece) -> int:
        return self.local_bounds.index(piece.local_start + piece.length) - 1


def _parts(total: int, world: int, rank: int, layout: str) -> tuple[int, list[int]]:
    if layout == "contiguous":
        return world, [rank]
    return 2 * world, [rank, 2 * world - 1 - rank]


def build_cp_context(cu_seqlens_global, group=None, layout: str = "contiguous", conv1d_kernel_size: int | None = None,
                     cu_seqlens_cpu=None) -> CPContext:
    """Builds this rank's CP context; every rank of `group` must call it with the same arguments.

    Mismatched arguments across ranks raise the same ValueError on every rank (an all-gather of a
    fingerprint, never a hang). `cu_seqlens_cpu` (optional) spares a device-to-host copy.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised")
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens_global
    if not isinstance(source, torch.Tensor) or source.dtype not in (torch.int32, torch.int64) or source.dim() != 1:
        raise TypeError("cu_seqlens_global must be a 1-D int32/int64 tensor")
    bounds = [int(b) for b in source.tolist()]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = bounds[-1] if bounds else 0
    problem = None
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        problem = "cu_seqlens_global must start at 0 and be non-decreasing"
    num_parts, mine = _parts(total, world, rank, layout)
    if problem is None and total % num_parts:
        problem = f"the {total} tokens do not split into {num_parts} equal parts ({layout} layout over {world} ranks)"
    fingerprint = zlib.crc32(repr((bounds, world, layout, conv1d_kernel_size)).encode())
    _agree_or_raise(fingerprint, problem, group)

    part = total // num_parts
    cuts = sorted(set(bounds) | {i * part for i in range(num_parts + 1)})
    starts = set(bounds)
    flags = tuple((i * part not in starts, (i + 1) * part not in starts) for i in range(num_parts))
    pieces, local_bounds, offset = [], [0], 0
    for index in mine:
        lo, hi = index * part, (index + 1) * part
        pieces.append(Piece(index, lo, offset, part, *flags[index]))
        local_bounds += [offset + c - lo for c in cuts if lo < c <= hi]
        offset += part
    device = cu_seqlens_global.device
    return CPContext(group, rank, world, layout, num_parts, tuple(pieces), flags,
                     torch.tensor(local_bounds, dtype=torch.int32, device=device), tuple(local_bounds),
                     conv1d_kernel_size, fingerprint)


def _agree_or_raise(fingerprint: int, problem: str | None, group) -> None:
    """Every rank learns whether any rank has a problem or a different fingerprint, then all raise."""
    mine = torch.tensor([fingerprint, 0 if problem is None else 1], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    gathered = torch.stack(gathered).cpu()
    if problem is not None:
        raise ValueError(problem)
    if gathered[:, 1].any():
        raise ValueError("build_cp_context failed on another rank of the group (see its error)")
    if not torch.all(gathered[:, 0] == fingerprint):
        raise ValueError("build_cp_context: ranks disagree on cu_seqlens_global, group size, layout or "
                         "conv1d_kernel_size; every rank must pass the same global values")
