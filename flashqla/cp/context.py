"""Inter-card CP context: which slice of the global token stream each rank holds, and where the packed
sequences cross slice boundaries.

The global stream (B == 1 packed layout, `cu_seqlens_global`) is cut into parts:
- layout="contiguous": W equal parts, rank r holds part r;
- layout="zigzag": 2W equal parts of the stream, rank r holds parts r and 2W-1-r (load-balanced
  causal attention over one long sequence);
- layout="zigzag_per_sequence": Megatron's load-balanced CP order for packed (THD) and padded
  inputs: every sequence is cut into 2W equal parts and rank r holds parts r and 2W-1-r of each
  sequence, sequence after sequence.
The parts are chained in true token order whatever rank holds them.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag", "zigzag_per_sequence")


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
    parts_of_rank: tuple[tuple[int, ...], ...]  # the part indices each rank holds, in its local order
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


def _layout_parts(bounds: list[int], world: int, layout: str):
    """-> (parts as (global_start, length) in token order, part indices of each rank in local order),
    or a string saying why the stream cannot be laid out."""
    total = bounds[-1]
    if layout == "zigzag_per_sequence":
        parts, owned = [], [[] for _ in range(world)]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if (end - start) % (2 * world):
                return f"layout='zigzag_per_sequence' needs every sequence length divisible by {2 * world}, got {end - start}"
            size = (end - start) // (2 * world)
            if size == 0:
                continue
            first = len(parts)
            parts += [(start + i * size, size) for i in range(2 * world)]
            for rank in range(world):
                owned[rank] += [first + rank, first + 2 * world - 1 - rank]
        return parts, owned
    num_parts = world if layout == "contiguous" else 2 * world
    if total % num_parts:
        return f"the {total} tokens do not split into {num_parts} equal parts ({layout} layout over {world} ranks)"
    size = total // num_parts
    parts = [(i * size, size) for i in range(num_parts)]
    if layout == "contiguous":
        return parts, [[r] for r in range(world)]
    return parts, [[r, 2 * world - 1 - r] for r in range(world)]


def build_cp_context(cu_seqlens_global, group=None, conv1d_kernel_size: int | None = None, cu_seqlens_cpu=None,
                     use_tf32x3_affine_chain: bool = True, layout: str = "contiguous") -> CPContext:
    """Builds this rank's CP context; every rank of `group` must call it with the same arguments.

    FLA 0.6.0's `fla.ops.cp.build_cp_context` arguments in its order. Mismatched arguments across ranks
    raise the same ValueError on every rank (an all-gather of a fingerprint, never a hang).
    `cu_seqlens_cpu` (optional) spares a device-to-host copy. `use_tf32x3_affine_chain` must be True, as
    in FLA (where it is a legacy switch): flashqla's chain is fp32 on CUDA cores, never TF32.
    """
    if use_tf32x3_affine_chain is not True:
        raise ValueError("use_tf32x3_affine_chain must be True (as in FLA 0.6.0): the chain always runs in fp32")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised")
    source = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens_global
    if not isinstance(source, torch.Tensor) or source.dtype not in (torch.int32, torch.int64) or source.dim() != 1:
        raise TypeError("cu_seqlens_global must be a 1-D int32/int64 tensor")
    bounds = [int(b) for b in source.tolist()]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = None
    if len(bounds) < 2 or bounds[0] != 0 or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        problem = "cu_seqlens_global must start at 0 and be non-decreasing"
    else:
        laid_out = _layout_parts(bounds, world, layout)
        if isinstance(laid_out, str):
            problem = laid_out
    fingerprint = zlib.crc32(repr((bounds, world, layout, conv1d_kernel_size)).encode())
    _agree_or_raise(fingerprint, problem, group)

    parts, owned = laid_out
    starts = set(bounds)
    flags = tuple((lo not in starts, lo + n not in starts) for lo, n in parts)
    cuts = sorted(starts | {lo for lo, _ in parts})
    pieces, local_bounds, offset = [], [0], 0
    for index in owned[rank]:
        lo, n = parts[index]
        pieces.append(Piece(index, lo, offset, n, *flags[index]))
        local_bounds += [offset + c - lo for c in cuts if lo < c < lo + n] + [offset + n]
        offset += n
    device = cu_seqlens_global.device
    return CPContext(group, rank, world, layout, len(parts), tuple(pieces), flags, tuple(map(tuple, owned)),
                     torch.tensor(local_bounds, dtype=torch.int32, device=device), tuple(local_bounds),
                     conv1d_kernel_size, fingerprint)


def _agree_or_raise(fingerprint: int, problem: str | None, group) -> None:
    """Every rank learns whether any rank has a problem or a different fingerprint, then all raise."""
    gathered = gather_host_values([fingerprint, 0 if problem is None else 1], group)
    if problem is not None:
        raise ValueError(problem)
    if gathered[:, 1].any():
        raise ValueError("build_cp_context failed on another rank of the group (see its error)")
    if not torch.all(gathered[:, 0] == fingerprint):
        raise ValueError("build_cp_context: ranks disagree on cu_seqlens_global, group size, layout or "
                         "conv1d_kernel_size; every rank must pass the same global values")


_side_streams: dict[int, torch.cuda.Stream] = {}


def gather_host_values(values: list[int], group) -> torch.Tensor:
    """Every rank's `values` (int64 [world, len(values)] on the CPU), joined by every rank of `group`.

    On NCCL the gather runs from a side stream with no work of its own: NCCL orders it after the work
    queued on the current stream, so from the compute stream the host would wait for all of it to drain
    (and the GPU then idle while the host launches what follows). From the side stream the host waits
    only for the other ranks' hosts and the collectives already queued on the group.
    """
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    with torch.cuda.stream(_side_stream(device.index)) if nccl else contextlib.nullcontext():
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        return torch.stack(gathered).cpu()


def _side_stream(device_index: int) -> torch.cuda.Stream:
    if device_index not in _side_streams:
        _side_streams[device_index] = torch.cuda.Stream(device_index)
    return _side_streams[device_index]
