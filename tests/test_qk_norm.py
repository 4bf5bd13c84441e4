"""The op's q/k L2 norm (flashqla/ops/qk_norm.py): the fused path's autograd glue on the CPU with the two
kernels emulated, against autograd of the torch chain; when each path is chosen. The kernels themselves
compile in tests/test_fused_layer_ops.py and run against the torch chain in tests/gpu/test_tilelang_layer_ops.py."""
import pytest
import torch

from flashqla.ops import qk_norm as l2n
from gdn_inputs import rel_err


def emulate_l2norm_fwd(x, eps):
    """The kernel's steps (fp32 row sums, one rounding), on rows [R, 128]."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().sum(-1) + eps)
    return (xf * rstd[:, None]).to(x.dtype), rstd


def emulate_l2norm_bwd(x, dy, rstd):
    xf, g, r = x.float(), dy.float(), rstd[:, None]
    return (r * g - xf * r ** 3 * (g * xf).sum(-1, keepdim=True)).to(x.dtype)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused path chosen on the CPU, its two kernels emulated, counting their launches."""
    from flashqla.kernels.hopper import layer_ops
    from flashqla.ops import backends

    launches = []
    monkeypatch.setenv(l2n.ENV, "1")
    monkeypatch.setattr(backends, "hopper_device_reason", lambda t, what: None)
    monkeypatch.setattr(layer_ops, "l2norm_fwd", lambda *a: launches.append("fwd") or emulate_l2norm_fwd(*a))
    monkeypatch.setattr(layer_ops, "l2norm_bwd", lambda *a: launches.append("bwd") or emulate_l2norm_bwd(*a))
    return launches


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_glue_matches_autograd_of_the_torch_chain(fused_on_cpu, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 37, 3, 2 * 128, generator=gen).to(dtype)
    x = base[..., 128:]  # a non-contiguous view [B, T, H, 128], as a split of the conv output is
    dy = torch.randn(x.shape, generator=gen).to(dtype)
    x_ref = x.detach().clone().requires_grad_(True)
    x_fused = x.detach().clone().requires_grad_(True)
    y_ref = l2n.l2norm_reference(x_ref)
    y_ref.backward(dy)
    y = l2n.l2norm(x_fused)
    y.backward(dy)
    assert fused_on_cpu == ["fwd", "bwd"]
    assert y.shape == x.shape and y.dtype == dtype and x_fused.grad.dtype == dtype
    assert rel_err(y, y_ref) <= tol and rel_err(x_fused.grad, x_ref.grad) <= tol, (
        rel_err(y, y_ref), rel_err(x_fused.grad, x_ref.grad))
    if dtype == torch.float32:  # same fp32 chain: equal to rounding, not merely close
        assert rel_err(x_fused.grad, x_ref.grad) <= 1e-6


def test_fused_path_is_on_by_default_can_be_turned_off_and_other_head_dims_use_torch(fused_on_cpu, monkeypatch):
    x = torch.randn(4, 128)
    monkeypatch.setenv(l2n.ENV, "0")
    assert "turns the fused L2 norm off" in l2n.fused_unsupported_reason(x)
    l2n.l2norm(x)
    monkeypatch.delenv(l2n.ENV)
    assert l2n.fused_unsupported_reason(x) is None
    assert "rows of 128" in l2n.fused_unsupported_reason(torch.randn(4, 64))
    assert "rows of 128" in l2n.fused_unsupported_reason(torch.randn(4, 128, dtype=torch.float64))
    assert l2n.fused_unsupported_reason(x) is None
    torch.testing.assert_close(l2n.l2norm(torch.randn(4, 64)).norm(dim=-1), torch.ones(4))
    assert fused_on_cpu == []


def test_op_option_normalises_through_the_same_function(fused_on_cpu):
    """use_qk_l2norm_in_kernel reaches the fused path for q and k (the torch backend runs the op itself)."""
    import flashqla
    from gdn_inputs import make_inputs

    args = make_inputs(1, 40, 2, 4, 128, 128, dtype=torch.float32, seed=5)
    o, _ = flashqla.chunk_gated_delta_rule(**args, use_qk_l2norm_in_kernel=True, backend="torch")
    assert fused_on_cpu == ["fwd", "fwd"]
    o.sum().backward()
    assert fused_on_cpu == ["fwd", "fwd", "bwd", "bwd"]
