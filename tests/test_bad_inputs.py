"""Every malformed call raises ValueError / TypeError naming the argument, before any compute."""
import pytest
import torch

import flashqla
from gdn_inputs import make_inputs


def base(B=1, T=8, Hqk=2, Hv=4, K=16, V=16):
    return make_inputs(B, T, Hqk, Hv, K, V, requires_grad=False)


def call(**overrides):
    args = base()
    args.update(overrides)
    return flashqla.chunk_gated_delta_rule(**args)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_non_tensor_argument_is_a_type_error(name):
    with pytest.raises(TypeError, match=name):
        call(**{name: [1.0, 2.0]})


def test_k_shape_mismatch():
    with pytest.raises(ValueError, match="k must have q's shape"):
        call(k=torch.randn(1, 8, 2, 32))


def test_q_not_4d():
    with pytest.raises(ValueError, match="q must be"):
        call(q=torch.randn(8, 2, 16), k=torch.randn(8, 2, 16))


def test_v_wrong_length():
    with pytest.raises(ValueError, match="v must be"):
        call(v=torch.randn(1, 7, 4, 16))


@pytest.mark.parametrize("name", ["g", "beta"])
def test_gate_shape_mismatch(name):
    with pytest.raises(ValueError, match=name):
        call(**{name: torch.randn(1, 8, 3)})


def test_hv_not_multiple_of_hqk():
    with pytest.raises(ValueError, match="multiple"):
        call(v=torch.randn(1, 8, 3, 16), g=torch.zeros(1, 8, 3), beta=torch.rand(1, 8, 3))


def test_integer_g_is_a_type_error():
    with pytest.raises(TypeError, match="g must be a floating-point"):
        call(g=torch.zeros(1, 8, 4, dtype=torch.int32))


def test_mixed_qkv_dtypes():
    with pytest.raises(TypeError, match="share a dtype"):
        call(v=torch.randn(1, 8, 4, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("K,V", [(48, 16), (16, 512)])
def test_unsupported_head_dims(K, V):
    args = base(K=K, V=V)
    with pytest.raises(ValueError, match="head dim"):
        flashqla.chunk_gated_delta_rule(**args)


def test_cu_seqlens_float_is_a_type_error():
    with pytest.raises(TypeError, match="cu_seqlens"):
        call(cu_seqlens=torch.tensor([0.0, 8.0]))


def test_cu_seqlens_with_batch_above_one():
    args = base(B=2)
    with pytest.raises(ValueError, match="cu_seqlens requires batch size 1"):
        flashqla.chunk_gated_delta_rule(**args, cu_seqlens=torch.tensor([0, 8]))


@pytest.mark.parametrize("bounds,match", [([1, 8], "start at 0"), ([0, 7], "end at"), ([0, 5, 3, 8], "non-decreasing"),
                                          ([0], "at least 2")])
def test_cu_seqlens_values(bounds, match):
    with pytest.raises(ValueError, match=match):
        call(cu_seqlens=torch.tensor(bounds, dtype=torch.int32))


def test_cu_seqlens_not_a_tensor():
    with pytest.raises(TypeError, match="cu_seqlens"):
        call(cu_seqlens=[0, 8])


def test_initial_state_wrong_shape():
    with pytest.raises(ValueError, match="initial_state"):
        call(initial_state=torch.zeros(2, 4, 16, 16))


def test_initial_state_rows_follow_packed_sequences():
    with pytest.raises(ValueError, match="initial_state"):
        call(initial_state=torch.zeros(1, 4, 16, 16), cu_seqlens=torch.tensor([0, 3, 8]))


def test_tensors_on_different_devices():
    meta_v = torch.empty(1, 8, 4, 16, device="meta")
    with pytest.raises(ValueError, match="v is on meta"):
        call(v=meta_v)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        call(backend="triton")


def test_tilelang_backend_on_cpu_is_a_clear_error_not_a_fallback():
    with pytest.raises(RuntimeError, match="backend='tilelang' cannot run this call"):
        call(backend="tilelang")


def test_scale_must_be_a_number():
    with pytest.raises(TypeError, match="scale"):
        call(scale=torch.tensor(0.1))


def test_cu_seqlens_edited_in_place_is_checked_again():
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    call(cu_seqlens=cu)
    cu[1] = 9
    with pytest.raises(ValueError, match="non-decreasing"):
        call(cu_seqlens=cu)
