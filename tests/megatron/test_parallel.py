"""Tensor and context parallel layouts and resharded checkpoints equal the single-rank module.

The single-rank reference runs here; each layout runs on 2 gloo ranks (mcore_worker.py), which
assert their share of outputs and gradients against it (relative error < 1e-5, fp32)."""
import pytest
import torch

import mcore_harness as h
from megatron.core import dist_checkpointing
from megatron.core.packed_seq_params import PackedSeqParams

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    h.init_parallel(tp=1, cp=1)


def save_reference(path, seq_len, batch, cu_seqlens=None, seed=0):
    """Run the TP1/CP1 module once and store weights, inputs and results for the workers."""
    torch.manual_seed(seed)
    module = h.build_flashqla_gdn(h.gdn_config())
    with torch.no_grad():
        module.A_log.copy_(torch.tensor([-4.0, 0.0, 1.0, 2.0]))
    x = torch.randn(seq_len, batch, 32, requires_grad=True)
    grad_out = torch.randn(seq_len, batch, 32)
    packed = None
    if cu_seqlens is not None:
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=64, max_seqlen_kv=64)
    out, _ = module(x, None, packed_seq_params=packed)
    out.backward(grad_out)
    torch.save(
        {
            "state": {n: p.detach() for n, p in module.named_parameters()},
            "x": x.detach(), "grad_out": grad_out, "out": out.detach(), "dx": x.grad,
            "grads": {n: p.grad for n, p in module.named_parameters()},
            "cu_seqlens": cu_seqlens,
        },
        path,
    )
    return module


def test_tensor_parallel_2_equals_tp_1_outputs_and_grads(tmp_path):
    save_reference(tmp_path / "reference.pt", seq_len=72, batch=2)
    h.run_ranks("tp2", 2, tmp_path)


def test_head_all_to_all_context_parallel_2_equals_cp_1_padded_and_packed(tmp_path):
    save_reference(tmp_path / "reference.pt", seq_len=72, batch=2)
    # sequence lengths divisible by 2 * cp, as Megatron's load-balanced THD layout needs
    save_reference(tmp_path / "reference_thd.pt", seq_len=100, batch=1, cu_seqlens=torch.tensor([0, 4, 72, 100], dtype=torch.int32))
    h.run_ranks("cp2", 2, tmp_path)


def test_checkpoint_saved_at_tp_1_loads_at_tp_2(tmp_path):
    module = save_reference(tmp_path / "reference.pt", seq_len=40, batch=1)
    (tmp_path / "checkpoint").mkdir()
    dist_checkpointing.save(module.sharded_state_dict(), str(tmp_path / "checkpoint"))
    h.run_ranks("load_tp2", 2, tmp_path)
