"""chunk_gated_delta_rule takes FLA 0.6.0's arguments (positions, names, defaults, extra keywords), so a
call written for `fla.ops.gated_delta_rule.chunk_gated_delta_rule` runs unchanged: each FLA option gives
what the same transform done by hand gives, in outputs and gradients (fp32, torch backend, CPU)."""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import flashqla
from flashqla.ops import checks, chunk_gdn
from gdn_inputs import make_inputs, random_cu_seqlens, rel_err

# fla-core 0.6.0, fla/ops/gated_delta_rule/chunk.py: the parameters before **kwargs, with their defaults
FLA_PARAMETERS = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty), ("scale", None), ("initial_state", None),
    ("output_final_state", False), ("use_qk_l2norm_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
    ("allow_neg_eigval", False), ("state_v_first", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
    ("chunk_indices", None), ("cp_context", None),
]
TOL = 1e-6
NAMES = ("q", "k", "v", "g", "beta")


def test_positions_names_and_defaults_are_fla_060s():
    params = inspect.signature(flashqla.chunk_gated_delta_rule).parameters.values()
    positional = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FLA_PARAMETERS
    assert any(p.kind == p.VAR_KEYWORD for p in params)
    assert chunk_gdn is flashqla.chunk_gated_delta_rule


def inputs(K=32, V=32, with_h0=False, seed=0):
    return make_inputs(1, 150, 2, 4, K, V, num_seqs=3, with_h0=with_h0, strong_heads=(3,), seed=seed)


def outputs_and_grads(fn, leaves, state_layout=lambda ht: ht):
    """fn(**leaves) -> (o, final state); o, ht (put in the [N, Hv, K, V] layout by `state_layout`) and the
    gradients of a fixed random loss of the two w.r.t. the leaves."""
    o, ht = fn(**leaves)
    ht = None if ht is None else state_layout(ht)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    if ht is not None:
        loss = loss + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return [o, ht] + list(grads)


def assert_same(got, want):
    for i, (x, ref) in enumerate(zip(got, want)):
        if ref is None:
            assert x is None
        else:
            assert x.shape == ref.shape and rel_err(x, ref) <= TOL, f"result {i}: {rel_err(x, ref)}"


CU = random_cu_seqlens([40, 1, 109])


def test_a_positional_fla_call_runs_as_the_keyword_call():
    args = inputs(with_h0=True)
    h0 = args.pop("initial_state")
    o, ht = flashqla.chunk_gated_delta_rule(*(args[n] for n in NAMES), None, h0, True, False, False, False, False, CU)
    o_kw, ht_kw = flashqla.chunk_gated_delta_rule(**args, initial_state=h0, output_final_state=True, cu_seqlens=CU)
    assert torch.equal(o, o_kw) and torch.equal(ht, ht_kw)


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_beta_sigmoid_in_kernel_equals_sigmoid_first(neg_eigval):
    args = inputs()
    leaves = {n: args[n] for n in NAMES}
    factor = 2.0 if neg_eigval else 1.0
    got = outputs_and_grads(lambda **x: flashqla.chunk_gated_delta_rule(
        **x, cu_seqlens=CU, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval), leaves)
    want = outputs_and_grads(lambda beta, **x: flashqla.chunk_gated_delta_rule(
        **x, beta=factor * beta.sigmoid(), cu_seqlens=CU), leaves)
    assert_same(got, want)


def test_gate_in_kernel_equals_the_qwen3_next_gate_first():
    args = inputs()
    gen = torch.Generator().manual_seed(3)
    leaves = {n: args[n] for n in ("q", "k", "v", "beta")}
    leaves["g"] = torch.randn(1, 150, 4, generator=gen).requires_grad_(True)  # the raw gate input a
    leaves["A_log"] = torch.empty(4).uniform_(0.01, 16, generator=gen).log().requires_grad_(True)
    leaves["dt_bias"] = torch.randn(4, generator=gen).requires_grad_(True)
    got = outputs_and_grads(lambda A_log, dt_bias, **x: flashqla.chunk_gated_delta_rule(
        **x, cu_seqlens=CU, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias), leaves)
    want = outputs_and_grads(lambda g, A_log, dt_bias, **x: flashqla.chunk_gated_delta_rule(
        **x, g=-A_log.exp() * F.softplus(g + dt_bias), cu_seqlens=CU), leaves)
    assert_same(got, want)


@pytest.mark.parametrize("flag", ["state_v_first", "transpose_state_layout"])
def test_v_first_states_are_the_transposed_states(flag):
    args = inputs(K=32, V=64, with_h0=True)  # K != V: a transpose that went missing would not fit
    h0 = args.pop("initial_state")
    leaves = {n: args[n] for n in NAMES}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = outputs_and_grads(lambda initial_state, **x: flashqla.chunk_gated_delta_rule(
            **x, initial_state=initial_state, output_final_state=True, cu_seqlens=CU, **{flag: True}),
            {**leaves, "initial_state": h0.transpose(-1, -2).contiguous().detach().requires_grad_(True)},
            state_layout=check_v_first)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught) == (flag == "transpose_state_layout")
    want = outputs_and_grads(lambda initial_state, **x: flashqla.chunk_gated_delta_rule(
        **x, initial_state=initial_state, output_final_state=True, cu_seqlens=CU), {**leaves, "initial_state": h0})
    want[-1] = want[-1].transpose(-1, -2)  # dh0 in the layout h0 was given in
    assert_same(got, want)


def check_v_first(ht):
    assert ht.shape == (3, 4, 64, 32) and ht.is_contiguous()
    return ht.transpose(-1, -2)


def test_cu_seqlens_cpu_gives_the_bounds_without_reading_cu_seqlens_back(monkeypatch):
    args = {n: x.detach() for n, x in inputs().items()}
    o_ref, _ = flashqla.chunk_gated_delta_rule(**args, cu_seqlens=CU)

    def no_read_back(cu_seqlens):
        raise AssertionError("cu_seqlens was read back although cu_seqlens_cpu was given")

    monkeypatch.setattr(checks, "_host_bounds", no_read_back)
    o, _ = flashqla.chunk_gated_delta_rule(**args, cu_seqlens=CU.clone(), cu_seqlens_cpu=CU.long(),
                                           chunk_indices=torch.zeros(3, 2, dtype=torch.int64))
    assert torch.equal(o, o_ref)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(cu_seqlens_cpu=CU), ValueError, "pass cu_seqlens as well"),
    (dict(cu_seqlens=CU, cu_seqlens_cpu=random_cu_seqlens([41, 1, 108])), ValueError, "same offsets"),
    (dict(cu_seqlens=CU, cu_seqlens_cpu=CU[:-1]), ValueError, "cu_seqlens_cpu must have"),
    (dict(cu_seqlens=CU, cu_seqlens_cpu=CU.float()), TypeError, "cu_seqlens_cpu must be int32 or int64"),
    (dict(chunk_size=32), ValueError, "chunk_size must be 64"),
    (dict(head_first=False), ValueError, "head_first"),
    (dict(chunk_szie=64), TypeError, "chunk_szie"),
    (dict(allow_neg_eigval=True), ValueError, "use_beta_sigmoid_in_kernel"),
    (dict(use_gate_in_kernel=True), ValueError, "A_log must be given"),
    (dict(A_log=torch.zeros(4)), ValueError, "use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, r"A_log must be \[Hv\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=[0.0] * 4), TypeError, "dt_bias"),
    (dict(state_v_first=True, transpose_state_layout=True), ValueError, "not both"),
])
def test_bad_fla_options_raise_naming_the_argument(kwargs, error, match):
    args = {n: x.detach() for n, x in inputs().items()}
    with pytest.raises(error, match=match):
        flashqla.chunk_gated_delta_rule(**args, **kwargs)


def test_default_chunk_size_is_accepted():
    args = {n: x.detach() for n, x in inputs().items()}
    o, _ = flashqla.chunk_gated_delta_rule(**args, chunk_size=64)
    assert torch.equal(o, flashqla.chunk_gated_delta_rule(**args)[0])


def test_build_cp_context_takes_fla_060s_arguments_in_its_order():
    from flashqla.cp import build_cp_context

    names = list(inspect.signature(build_cp_context).parameters)
    # FLA names the first one cu_seqlens; callers pass it by position
    assert names[1:] == ["group", "conv1d_kernel_size", "cu_seqlens_cpu", "use_tf32x3_affine_chain", "layout"]
    with pytest.raises(ValueError, match="use_tf32x3_affine_chain"):
        build_cp_context(CU, None, 4, CU, False)
