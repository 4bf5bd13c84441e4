"""The torch backend against the float64 token-by-token recurrence (forward and every gradient)."""
import pytest
import torch

import flashqla
from gdn_inputs import make_inputs, random_cu_seqlens, rel_err
from recurrence import gdn_recurrence

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def run_both(args, cu_seqlens=None, scale=None, backend="torch"):
    """Forward + backward of flashqla and of the recurrence on the same inputs with the same cotangents."""
    o, ht = flashqla.chunk_gated_delta_rule(**args, scale=scale, output_final_state=True,
                                            cu_seqlens=cu_seqlens, backend=backend)
    o_ref, ht_ref = gdn_recurrence(**args, scale=scale, cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    inputs = [args[n] for n in GRAD_NAMES if n in args]
    grads = torch.autograd.grad((o.double() * do).sum() + (ht.double() * dht).sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), inputs)
    errors = {"o": rel_err(o, o_ref), "final_state": rel_err(ht, ht_ref)}
    for name, gr, gr_ref in zip([n for n in GRAD_NAMES if n in args], grads, grads_ref):
        errors["d" + name] = rel_err(gr, gr_ref)
    return o, ht, errors


def assert_within(errors, limits):
    bad = {k: v for k, v in errors.items() if v > limits.get(k, limits["default"])}
    assert not bad, f"relative errors over the limit: {bad} (all: {errors})"


FP32 = {"default": 1e-5}


@pytest.mark.parametrize("Hqk,Hv", [(1, 1), (2, 8), (4, 8), (2, 6)])
def test_fp32_matches_recurrence_gqa(Hqk, Hv):
    args = make_inputs(2, 130, Hqk, Hv, 32, 16, with_h0=True, zero_heads=(0,), strong_heads=(Hv - 1,), seed=Hv)
    _, _, errors = run_both(args)
    assert_within(errors, FP32)


def test_fp32_matches_recurrence_varlen_with_tiny_and_odd_sequences():
    lengths = [1, 65, 3, 64, 127, 1, 29]
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, sum(lengths), 2, 4, 16, 32, num_seqs=len(lengths), with_h0=True,
                       zero_heads=(0,), strong_heads=(3,), seed=7)
    _, _, errors = run_both(args, cu_seqlens=cu)
    assert_within(errors, FP32)


def test_fp32_varlen_without_initial_state_and_int64_offsets():
    lengths = [70, 1, 60]
    cu = random_cu_seqlens(lengths).long()
    args = make_inputs(1, sum(lengths), 1, 2, 64, 64, num_seqs=3, seed=3)
    _, _, errors = run_both(args, cu_seqlens=cu)
    assert_within(errors, FP32)


@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (256, 16)])
def test_fp32_head_dims(K, V):
    args = make_inputs(1, 70, 1, 2, K, V, with_h0=True, seed=K + V)
    _, _, errors = run_both(args, scale=0.1)
    assert_within(errors, FP32)


def test_no_decay_heads_are_exact_in_fp32():
    args = make_inputs(1, 200, 2, 2, 16, 16, zero_heads=(0, 1), seed=11)
    assert torch.all(args["g"] == 0)
    _, _, errors = run_both(args)
    assert_within(errors, FP32)


def test_bf16_inputs_within_bf16_limits():
    args = make_inputs(1, 150, 2, 4, 32, 32, dtype=torch.bfloat16, with_h0=True, zero_heads=(0,),
                       strong_heads=(3,), seed=5)
    o, _, errors = run_both(args)
    assert o.dtype == torch.bfloat16
    assert_within(errors, {"o": 5e-3, "final_state": 5e-3, "default": 2e-2})


def test_final_state_is_fp32_and_none_unless_requested():
    args = make_inputs(2, 10, 1, 1, 16, 16, dtype=torch.bfloat16, requires_grad=False)
    o, ht = flashqla.chunk_gated_delta_rule(**args)
    assert ht is None and o.shape == (2, 10, 1, 16)
    _, ht = flashqla.chunk_gated_delta_rule(**args, output_final_state=True)
    assert ht.dtype == torch.float32 and ht.shape == (2, 1, 16, 16)


def test_default_scale_is_inverse_sqrt_head_dim():
    args = make_inputs(1, 20, 1, 1, 64, 16, requires_grad=False)
    o_default, _ = flashqla.chunk_gated_delta_rule(**args)
    o_explicit, _ = flashqla.chunk_gated_delta_rule(**args, scale=64 ** -0.5)
    assert torch.equal(o_default, o_explicit)


def test_qk_l2norm_in_kernel_equals_normalising_first():
    args = make_inputs(1, 40, 2, 2, 16, 16, requires_grad=False)
    raw = {**args, "q": args["q"] * 3.0, "k": args["k"] * 0.5}
    o_in, _ = flashqla.chunk_gated_delta_rule(**raw, use_qk_l2norm_in_kernel=True)
    o_pre, _ = flashqla.chunk_gated_delta_rule(**args)
    assert rel_err(o_in, o_pre) < 1e-5


def test_gradcheck_float64():
    lengths = [3, 70]
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, sum(lengths), 1, 2, 16, 16, dtype=torch.float64, num_seqs=2, with_h0=True,
                       strong_heads=(1,), seed=2)
    names = list(args)

    def fn(*tensors):
        o, ht = flashqla.chunk_gated_delta_rule(**dict(zip(names, tensors)), output_final_state=True,
                                                cu_seqlens=cu, backend="torch")
        return o, ht

    # fast mode checks random projections of the Jacobian (a full numerical Jacobian is ~10^4 forwards)
    assert torch.autograd.gradcheck(fn, tuple(args[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_zero_tokens_pass_the_state_through_forward_and_backward():
    args = make_inputs(1, 0, 1, 2, 16, 16, with_h0=True)
    o, ht = flashqla.chunk_gated_delta_rule(**args, output_final_state=True)
    assert o.shape == (1, 0, 2, 16) and torch.equal(ht, args["initial_state"])
    (o.sum() + (ht * 2).sum()).backward()
    assert torch.equal(args["initial_state"].grad, torch.full_like(ht, 2.0))


@pytest.mark.parametrize("segment_chunks", [0, 2])
def test_backward_in_chunk_blocks_equals_one_block(segment_chunks):
    """The chunk-local gradient math runs block by block (bounded memory); the blocks must not change
    a single gradient: a block boundary inside every sequence, a last block that is partial."""
    from flashqla.ops import torch_backend

    lengths = [700, 1, 130, 65]
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, sum(lengths), 2, 4, 16, 32, dtype=torch.float64, num_seqs=len(lengths), with_h0=True,
                       strong_heads=(3,), seed=31, requires_grad=False)
    plan = torch_backend.make_plan(1, sum(lengths), cu.tolist(), segment_chunks)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(args["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(args["initial_state"].shape, generator=gen, dtype=torch.float64)
    call = [args[n] for n in ("q", "k", "v", "g", "beta")]
    whole = torch_backend.backward(*call, 0.25, args["initial_state"], plan, do, dht, None, block_chunks=10 ** 6)
    blocked = torch_backend.backward(*call, 0.25, args["initial_state"], plan, do, dht, None, block_chunks=3)
    for name, a, b in zip(GRAD_NAMES, blocked, whole):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-13, (name, rel_err(a, b))
