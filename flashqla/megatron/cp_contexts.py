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

import weakref
from collections import OrderedDict

import torch

from flashqla.cp import CPContext, build_cp_context

CACHE_SIZE = 8  # a few batches' layouts (train, eval); entries are tiny

_contexts: OrderedDict[tuple, CPContext] = OrderedDict()
_host_offsets: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}


def host_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens as host ints, copied once per tensor (and again only after an in-place change)."""
    key = id(cu_seqlens)
    cached = _host_offsets.get(key)
    if cached is not None and cached[0]() is cu_seqlens and cached[1] == cu_seqlens._version:
        return cached[2]
    offsets = tuple(int(b) for b in cu_seqlens.tolist())
    _host_offsets[key] = (weakref.ref(cu_seqlens, lambda _, key=key: _host_offsets.pop(key, None)),
                          cu_seqlens._version, offsets)
    return offsets


_int32: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def int32_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as int32, the same tensor for every layer of a step (converted once per tensor, again only
    after an in-place change), so the op's host copy of the bounds, cached by tensor identity, is made once."""
    if cu_seqlens.dtype == torch.int32:
        return cu_seqlens
    key = id(cu_seqlens)
    cached = _int32.get(key)
    if cached is not None and cached[0]() is cu_seqlens and cached[1] == cu_seqlens._version:
        return cached[2]
    converted = cu_seqlens.to(torch.int32)
    _int32[key] = (weakref.ref(cu_seqlens, lambda _, key=key: _int32.pop(key, None)), cu_seqlens._version, converted)
    return converted


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
