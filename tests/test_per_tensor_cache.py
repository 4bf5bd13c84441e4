"""flashqla.ops.per_tensor.PerTensorCache: one computation per tensor, again after an in-place change, and
no entry outliving its tensor (the op's host bounds and Megatron's offsets rely on it)."""
import gc

import torch

from flashqla.ops.per_tensor import PerTensorCache


def test_computes_once_per_tensor_and_again_after_an_in_place_change():
    calls = []
    cache = PerTensorCache(lambda t: calls.append(1) or t.tolist())
    cu = torch.tensor([0, 3, 7])
    assert cache(cu) == [0, 3, 7] and cache(cu) == [0, 3, 7] and len(calls) == 1
    assert cache(cu.clone()) == [0, 3, 7] and len(calls) == 2  # another tensor, same values
    cu[2] = 9
    assert cache(cu) == [0, 3, 9] and len(calls) == 3


def test_entries_go_with_their_tensor():
    cache = PerTensorCache(lambda t: t.tolist())
    cu = torch.tensor([0, 5])
    cache(cu)
    assert len(cache._entries) == 1
    del cu
    gc.collect()
    assert not cache._entries
