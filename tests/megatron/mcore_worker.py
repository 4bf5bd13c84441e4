"""One rank of a multi-rank Megatron test (started by mcore_harness.run_ranks).

    python mcore_worker.py SCENARIO WORKDIR

WORKDIR/reference.pt holds what the single-rank run produced: the full state dict, the input, the
output gradient, and the output, input gradient and parameter gradients. Each scenario rebuilds the
module under its parallel layout from those weights and asserts its local share equals the
reference; an assertion ends the rank with a non-zero exit code.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mcore_harness as h
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

TOLERANCE = 1e-5


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(name, got, want, tolerance=TOLERANCE):
    err = rel_err(got, want)
    assert err < tolerance, f"rank {dist.get_rank()}: {name} relative error {err:.3g} >= {tolerance}"


def tp_shard(module, name, full):
    """This TP rank's slice of a full (TP1) parameter, in Megatron's per-rank sectioned layout:
    in_proj rows [q|k|v|z|beta|alpha] and conv channels [q|k|v] are split section by section."""
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if name == "in_proj.weight":
        sections = [s * tp for s in module.in_proj_split_sections]
    elif name.startswith("conv1d."):
        sections = [module.qk_dim, module.qk_dim, module.v_dim]
    elif name in ("A_log", "dt_bias"):
        sections = [full.shape[0]]
    elif name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    else:  # out_norm.weight: one per-head-dim norm, replicated on every TP rank
        return full
    return torch.cat([piece.chunk(tp, dim=0)[rank] for piece in full.split(sections, dim=0)])


def run(module, x, grad_out, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out, _ = module(x, None, **kwargs)
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def tp2(workdir):
    """TP 2 (heads sharded) equals TP 1: outputs, input grads, and each rank's slice of the grads."""
    ref = torch.load(workdir / "reference.pt")
    h.init_parallel(tp=2)
    module = h.build_flashqla_gdn(h.gdn_config(tp=2))
    module.load_state_dict({n: tp_shard(module, n, p) for n, p in ref["state"].items()}, strict=False)
    out, dx, grads = run(module, ref["x"], ref["grad_out"])
    assert_close("output", out, ref["out"])
    assert_close("input grad", dx, ref["dx"])
    for name, grad in grads.items():
        if name == "out_norm.weight":  # replicated weight: each rank holds its heads' share of the grad
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        assert_close(f"{name} grad", grad, tp_shard(module, name, ref["grads"][name]))


def load_balanced(x, cp, rank, cu_seqlens=None):
    """Megatron's CP order: each sequence cut into 2*cp chunks, rank r holds chunks r and 2cp-1-r."""
    starts_ends = [(0, x.shape[0])] if cu_seqlens is None else zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    pieces = []
    for start, end in starts_ends:
        chunks = x[start:end].chunk(2 * cp)
        pieces += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(pieces)


def cp2(workdir):
    """CP 2 with Megatron's head all-to-all equals CP 1, for padded (sbhd) and packed (thd) input;
    the state-passing mode is refused until flashqla's inter-card CP is wired in."""
    h.init_parallel(cp=2)
    cp_group = parallel_state.get_context_parallel_group()
    rank = parallel_state.get_context_parallel_rank()
    for case in ("reference", "reference_thd"):
        ref = torch.load(workdir / f"{case}.pt")
        cu = ref.get("cu_seqlens")
        packed = None
        if cu is not None:
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64, max_seqlen_kv=64)
        module = h.build_flashqla_gdn(h.gdn_config(cp=2))
        module.load_state_dict(ref["state"], strict=False)
        out, dx, grads = run(
            module, load_balanced(ref["x"], 2, rank, cu), load_balanced(ref["grad_out"], 2, rank, cu),
            packed_seq_params=packed,
        )
        assert_close(f"{case} output", out, load_balanced(ref["out"], 2, rank, cu))
        assert_close(f"{case} input grad", dx, load_balanced(ref["dx"], 2, rank, cu))
        for name, grad in grads.items():
            dist.all_reduce(grad, group=cp_group)  # each CP rank saw half the tokens (and heads)
            assert_close(f"{case} {name} grad", grad, ref["grads"][name])

    state_passing = h.build_flashqla_gdn(h.gdn_config(cp=2), cp_mode="state_passing")
    try:
        state_passing(torch.zeros(8, 1, 32), None)
    except NotImplementedError as err:
        assert "state_passing" in str(err)
    else:
        raise AssertionError("cp_mode='state_passing' ran although flashqla's inter-card CP is not wired in")


def load_tp2(workdir):
    """A dist checkpoint saved at TP 1 loads at TP 2 and gives the TP 1 output."""
    ref = torch.load(workdir / "reference.pt")
    h.init_parallel(tp=2)
    module = h.build_flashqla_gdn(h.gdn_config(tp=2))
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    state = dist_checkpointing.load(module.sharded_state_dict(), str(workdir / "checkpoint"))
    module.load_state_dict(state, strict=False)
    out, _ = module(ref["x"], None)
    assert_close("output after TP1 -> TP2 load", out.detach(), ref["out"])


SCENARIOS = {"tp2": tp2, "cp2": cp2, "load_tp2": load_tp2}

if __name__ == "__main__":
    scenario, workdir = sys.argv[1], Path(sys.argv[2])
    SCENARIOS[scenario](workdir)
    dist.barrier()
    dist.destroy_process_group()
