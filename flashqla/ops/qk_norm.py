"""L2 normalisation of q and k over the head dim, the op's `use_qk_l2norm_in_kernel` (FLA's convention).

`l2norm_reference` is the torch chain: x / sqrt(sum(x^2) + eps) in fp32, rounded once to x's dtype. On
an SM90 GPU the fused TileLang kernels (kernels/hopper/l2_norm.py) compute the same chain in one pass
each way and keep only one fp32 scale per row for the backward (the torch chain keeps an fp32 copy of
x). They are on by default where they can run (checked on the H200 against autograd of the torch chain,
tests/gpu/test_tilelang_layer_ops.py); FLASHQLA_FUSED_L2NORM=0 turns them off.
"""
from __future__ import annotations


import torch

ENV = "FLASHQLA_FUSED_L2NORM"
HEAD_DIM = 128
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32 (fp64 stays fp64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def fused_unsupported_reason(x: torch.Tensor) -> str | None:
    """None when the fused kernels can normalise `x`, else why not."""
    from .backends import hopper_device_reason, switched_on

    if not switched_on(ENV):
        return f"{ENV} turns the fused L2 norm off"
    reason = hopper_device_reason(x, "the fused L2 norm")
    if reason:
        return reason
    if x.dtype not in _DTYPES or x.numel() == 0 or x.shape[-1] != HEAD_DIM:
        return f"the fused L2 norm takes non-empty bf16/fp16/fp32 rows of {HEAD_DIM}, got {x.dtype} {tuple(x.shape)}"
    return None


class FusedL2Norm(torch.autograd.Function):
    """l2norm_reference on the fused kernels: saves x and the per-row scale rsqrt(sum(x^2) + eps)."""

    @staticmethod
    def forward(ctx, x, eps):
        from flashqla.kernels.hopper import layer_ops

        rows = x.reshape(-1, HEAD_DIM).contiguous()
        y, rstd = layer_ops.l2norm_fwd(rows, eps)
        ctx.save_for_backward(rows, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from flashqla.kernels.hopper import layer_ops

        rows, rstd = ctx.saved_tensors
        dx = layer_ops.l2norm_bwd(rows, dy.reshape(rows.shape).contiguous(), rstd)
        return dx.view(dy.shape), None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the head dim, in fp32 with one rounding to x's dtype: the fused kernels
    where `fused_unsupported_reason` allows, else the torch chain."""
    if fused_unsupported_reason(x) is None:
        return FusedL2Norm.apply(x, eps)
    return l2norm_reference(x, eps)
