"""The kernel backward's memory on the CPU (kernels emulated, tests/kernel_emulator.py): the peak of the
storages its host code allocates is what kernels/hopper/backward.py says it holds, and no more.

At the chunk-local kernel the backward holds, per token and v-head (input dtype of e bytes): GA (64 e), gcum
(4) and beta (4) in fp32, which it allocates only when the forward kept none (FLASHQLA_KEEP_INVERSE=0; else
they are the forward's), the per-chunk states h and their gradients dh (128 e each per token, plus
one slot per sequence), dq, dk and dv per v-head (3 x 128 e; at an even GQA group dq and dk per v-head pair,
2 x 128 e, unless FLASHQLA_GQA_PAIR_SUM=0), dg and dbeta in fp32 (4 + 4),
and dS0 (64 KiB per sequence and head). W (128 e) must be gone by then, and h and dh before
the GQA sums allocate; a copy of any [T, Hv, 128] tensor more (e.g. a scaled copy of dO: the kernels
apply the output scale themselves) breaks the bound.
"""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernel_emulator
from gdn_inputs import make_inputs

pytest.importorskip("tilelang")


class PeakStorage(TorchDispatchMode):
    """Bytes of the storages that ops create outside the emulated kernels: live now, and at the peak.
    A storage counts from the op that allocates it (not a view, not an op writing into its inputs) until
    it is freed (a finalizer on its Python object)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if kernel_emulator.called_from_an_emulator():  # its own fp64 temporaries are not the kernels' memory
            return out
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not func.is_view and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, storage.nbytes())
                self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("pair_sum", ["1", "0"], ids=["paired", "unpaired"])
@pytest.mark.parametrize("keep", ["1", "0"], ids=["kept", "recomputed"])
@pytest.mark.parametrize("Hqk,Hv", [(1, 2), (2, 2)])
def test_kernel_backward_peak_is_the_documented_set(monkeypatch, Hqk, Hv, keep, pair_sum):
    import flashqla
    from flashqla.ops import backends

    kernel_emulator.install(monkeypatch)
    monkeypatch.setenv("FLASHQLA_KEEP_INVERSE", keep)
    monkeypatch.setenv("FLASHQLA_GQA_PAIR_SUM", pair_sum)
    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    T, e = 1024, 2
    args = make_inputs(1, T, Hqk, Hv, 128, 128, dtype=torch.bfloat16, seed=3)
    o, _ = flashqla.chunk_gated_delta_rule(**args, backend="tilelang", intra_cp="off")
    do = torch.randn_like(o)
    with PeakStorage() as memory:
        o.backward(do)

    inverse = 64 * e + 4 + 4 if keep == "0" else 0  # GA, gcum and the fp32 beta
    paired = pair_sum != "0" and (Hv // Hqk) % 2 == 0
    per_token_head = inverse + (2 if paired else 3) * 128 * e + 4 + 4
    states = 2 * (T // 64 + 1) * 128 * 128 * e  # h and dh: a slot per chunk and one per sequence
    dS0 = 128 * 128 * 4
    expected = T * Hv * per_token_head + Hv * (states + dS0)
    assert expected <= memory.peak <= expected * 1.02, (
        f"backward peak {memory.peak} bytes, documented set {expected} ({memory.peak / (T * Hv):.0f} vs "
        f"{expected / (T * Hv):.0f} bytes per token and v-head)")
    assert all(args[n].grad is not None for n in ("q", "k", "v", "g", "beta"))
