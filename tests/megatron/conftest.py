"""The 2-rank Megatron checks run once per session: single-rank references here, then one gloo
process group that runs every scenario of mcore_worker.py; each test asserts on its scenario."""
import pytest
import torch

import gpt_harness
import mcore_harness as h
from megatron.core import dist_checkpointing
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.training.global_vars import destroy_global_vars

TWO_RANK_SCENARIOS = ["tp2", "cp2_head_a2a", "cp2_state_passing", "cp2_state_passing_odd_heads",
                      "contexts_shared", "load_tp2", "hybrid_gpt_cp2", "batch_slicing"]


def save_reference(path, seq_len, batch, cu_seqlens=None, A_log=(-4.0, 0.0, 1.0, 2.0), dtype=torch.float32, seed=0,
                   **config):
    """Run the TP1/CP1 module once and store weights, inputs and results for the workers. A_log
    spans no decay (exp(-4) ~ 0) to strong decay."""
    torch.manual_seed(seed)
    module = h.build_flashqla_gdn(h.gdn_config(params_dtype=dtype, **config))
    with torch.no_grad():
        module.A_log.copy_(torch.tensor(A_log))
    x = torch.randn(seq_len, batch, 32, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(seq_len, batch, 32, dtype=dtype)
    packed = None
    if cu_seqlens is not None:
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=128, max_seqlen_kv=128)
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


@pytest.fixture(scope="session")
def two_rank_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two_ranks")
    h.init_parallel(tp=1, cp=1)
    module = save_reference(workdir / "reference.pt", seq_len=72, batch=2)
    (workdir / "checkpoint").mkdir()
    dist_checkpointing.save(module.sharded_state_dict(), str(workdir / "checkpoint"))
    # sequence lengths divisible by 2 * cp, as Megatron's load-balanced THD layout needs; the 4-token
    # sequence gives every CP chunk one token
    save_reference(workdir / "reference_thd.pt", seq_len=100, batch=1,
                   cu_seqlens=torch.tensor([0, 4, 72, 100], dtype=torch.int32))
    # state passing reorders the sums over tokens (the S0 chain, the summed parameter grads): in fp32
    # the gate grads (dA_log, ddt_bias; sums over every token) land ~5e-5 apart, so exactness is checked
    # in fp64, where every output and gradient agrees to ~1e-13
    for name, seq_len, batch, cu_seqlens in (("padded", 72, 2, None), ("thd", 100, 1, [0, 4, 72, 100])):
        save_reference(workdir / f"reference_fp64_{name}.pt", seq_len, batch, dtype=torch.float64,
                       cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32))
    save_reference(workdir / "reference_fp64_odd_heads.pt", seq_len=40, batch=2, A_log=(-4.0, 0.0, 2.0),
                   dtype=torch.float64, linear_num_key_heads=1, linear_num_value_heads=3)
    try:
        losses, state = gpt_harness.train_tiny_hybrid(cp=1, steps=6)
    finally:
        destroy_global_vars()
        destroy_num_microbatches_calculator()
    torch.save({"state": state, "losses": losses}, workdir / "hybrid_gpt.pt")
    return h.run_ranks(TWO_RANK_SCENARIOS, 2, workdir)
