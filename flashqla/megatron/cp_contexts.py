"""State-passing CP contexts for Megatron's GDN layers, built once per batch and shared by every layer.

Megatron hands the same layout to every GDN layer of a step: padded input (`sbhd`, B rows of T tokens
over the whole CP group) or packed input (`thd`, the `PackedSeqParams` object of the step). Both are
Megatron's load-balanced CP order, so the context is always `layout="zigzag_per_sequence"` over the
global `cu_seqlens` (for padded input, [0, T, 2T, ..., BT]: row after row, the order in which the
layer lays its local rows out).

`build_cp_context` runs a collective, so every rank must build (or reuse) a context at the same
layer. The cache is keyed by the *contents* of the global offsets, plus group, conv width and device:
all ranks see the same offsets in the same order and therefore hit and miss together. Host copies of
packed offsets (and int32 copies of int64 ones) are cached by tensor identity and version, so a layer
after the first neither copies nor synchronises.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from flashqla.cp import CPContext, build_cp_context
from flashqla.ops.per_tensor import PerTensorCache

CACHE_SIZE = 8  # a few batches' layouts (train, eval); entries are tiny

_contexts: OrderedDict[tuple, CPContext] = OrderedDict()

# cu_seqlens as host ints, copied once per tensor (again only after an in-place change)
host_offsets = PerTensorCache(lambda cu_seqlens: tuple(int(b) for b in cu_seqlens.tolist()))
_to_int32 = PerTensorCache(lambda cu_seqlens: cu_seqlens.to(torch.int32))


def int32_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as int32, the same tensor for every layer of a step (converted once per tensor), so the
    op's host copy of the bounds, cached by tensor identity, is made once."""
    return cu_seqlens if cu_seqlens.dtype == torch.int32 else _to_int32(cu_seqlens)


def state_passing_context(offsets: tuple[int, ...], group, conv_kernel_size: int, device) -> CPContext:
    """This rank's context for global sequence offsets `offsets` in Megatron's load-balanced order."""
    key = (offsets, group, conv_kernel_size, str(device))  # the group itself: an id could be reused
    context = _contexts.get(key)
    if context is not None:
        _contexts.move_to_end(key)
        return context
    cu_cpu = torch.tensor(offsets, dtype=torch.int32)
    context = build_cp_context(cu_cpu.to(device), group=group, layout="zigzag_per_sequence",
                               conv1d_kernel_size=conv_kernel_size, cu_seqlens_cpu=cu_cpu)
    _contexts[key] = context
    if len(_contexts) > CACHE_SIZE:
        _contexts.popitem(last=False)
    return context
