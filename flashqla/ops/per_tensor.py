"""Values derived from a tensor, computed once per tensor and again only after an in-place change.

Keyed by identity (with a weak reference, so a later tensor reusing a dead one's id starts fresh) and by
the tensor's version counter. Used for cu_seqlens read back to the host: a training step that hands the
same offsets tensor to every layer pays the device-to-host copy (a host sync) once.
"""
from __future__ import annotations

import weakref
from typing import Callable, Generic, TypeVar

import torch

Value = TypeVar("Value")


class PerTensorCache(Generic[Value]):
    def __init__(self, make: Callable[[torch.Tensor], Value]):
        self.make = make
        self._entries: dict[int, tuple[weakref.ref, int, Value]] = {}

    def __call__(self, tensor: torch.Tensor) -> Value:
        key = id(tensor)
        cached = self._entries.get(key)
        if cached is not None and cached[0]() is tensor and cached[1] == tensor._version:
            return cached[2]
        value = self.make(tensor)
        self._entries[key] = (weakref.ref(tensor, lambda _, key=key: self._entries.pop(key, None)), tensor._version,
                              value)
        return value
