"""Fused TileLang SM90 kernels for the GDN layer's memory-bound steps, as autograd functions.

`causal_conv1d` and `gated_rms_norm` here have the contracts of flashqla/layers/conv.py and norm.py,
which dispatch to them when `conv_unsupported_reason` / `norm_unsupported_reason` answer None: tensors
on an SM90 GPU, TileLang importable, a supported shape and dtype, and FLASHQLA_FUSED_LAYER_OPS not set
to 0/off. The kernels are kernels/hopper/short_conv.py and gated_norm.py (launched through
kernels/hopper/layer_ops.py); their docstrings give the math and the precision.

The conv state (`new_prefix`, the last W - 1 rows of every sequence counting its prefix) is a gather of
N x (W - 1) rows done here in torch; its gradient is added onto dx and dprefix after the kernel.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..ops.backends import hopper_device_reason, switched_on

log = logging.getLogger("flashqla")

ENV = "FLASHQLA_FUSED_LAYER_OPS"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def enabled() -> bool:
    return switched_on(ENV)


def _device_reason(t: torch.Tensor) -> str | None:
    if not enabled():
        return f"{ENV} turns the fused layer ops off"
    return hopper_device_reason(t, "the fused layer ops")


def conv_unsupported_reason(x, weight, prefix=None, silu=True) -> str | None:
    """None when `causal_conv1d` below can run this call, else why not."""
    from flashqla.kernels.hopper.layer_ops import CONV_WIDTH, conv_vec

    reason = _device_reason(x)
    if reason:
        return reason
    if not silu:
        return "the fused conv always applies SiLU"
    if x.dim() != 2 or x.dtype not in _DTYPES or x.shape[0] == 0:
        return f"x must be a non-empty [T, C] bf16/fp16/fp32 tensor, got {x.dtype} {tuple(x.shape)}"
    if not weight.is_floating_point() or weight.dtype == torch.float64 or not 2 <= weight.shape[-1] <= CONV_WIDTH:
        return (f"the fused conv takes widths 2..{CONV_WIDTH} and a 16/32-bit weight, "
                f"got {weight.dtype} {tuple(weight.shape)}")
    if x.shape[1] % conv_vec(x.dtype):
        return f"the fused conv needs C % {conv_vec(x.dtype)} == 0 for {x.dtype}, got C = {x.shape[1]}"
    if prefix is not None and prefix.dtype == torch.float64:
        return "the fused conv takes no fp64 prefix"
    return None


def norm_unsupported_reason(o, z, weight) -> str | None:
    """None when `gated_rms_norm` below can run this call, else why not."""
    from flashqla.kernels.hopper.layer_ops import NORM_HEAD_DIMS

    reason = _device_reason(o)
    if reason:
        return reason
    if o.dtype not in _DTYPES or z.dtype != o.dtype or o.shape != z.shape or o.numel() == 0:
        return f"o and z must be non-empty, of one shape and dtype (bf16/fp16/fp32), got {o.dtype} {z.dtype}"
    if o.shape[-1] not in NORM_HEAD_DIMS or weight.shape != (o.shape[-1],):
        return (f"the fused norm takes head dims {NORM_HEAD_DIMS} and a [D] weight, "
                f"got {tuple(o.shape)}, {tuple(weight.shape)}")
    if torch.promote_types(weight.dtype, o.dtype) not in (o.dtype, torch.float32):
        return f"weight dtype {weight.dtype} with o dtype {o.dtype} is not supported by the fused norm"
    return None


@functools.lru_cache(maxsize=None)
def note_fallback_once(op: str, reason: str) -> None:
    log.info("flashqla: %s runs in torch: %s", op, reason)


# --- causal conv1d + SiLU -----------------------------------------------------------------------------

def _tail_index(cu_seqlens, halo: int, num_tokens: int):
    """Where row i of sequence n's new prefix comes from: (from_x [N, H] bool, token [N, H], prefix row [N, H]).
    The segment of n is [prefix_n (H rows), tokens]; its last H rows start at segment position len_n."""
    pos = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[:, None] + torch.arange(halo, device=cu_seqlens.device)
    token = (cu_seqlens[:-1].long()[:, None] + pos - halo).clamp(0, max(num_tokens - 1, 0))
    return pos >= halo, token, pos.clamp(max=halo - 1)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, prefix, cu_seqlens):
        from flashqla.kernels.hopper.layer_ops import CONV_WIDTH, short_conv_fwd

        T, C = x.shape
        N, W = cu_seqlens.numel() - 1, weight.shape[1]
        H, pad = W - 1, CONV_WIDTH - W
        x = x.contiguous()
        cu = cu_seqlens.to(device=x.device, dtype=torch.int32).contiguous()
        # the 4-tap kernel runs a W-tap conv with `pad` leading zero taps and zero prefix rows; the
        # reference casts the weight and the prefix to x's dtype first, and so does this
        w4 = torch.zeros(C, CONV_WIDTH, dtype=torch.float32, device=x.device)
        w4[:, pad:] = weight.detach().to(x.dtype)
        p3 = torch.zeros(N, CONV_WIDTH - 1, C, dtype=x.dtype, device=x.device)
        if prefix is not None:
            p3[:, pad:] = prefix.detach()
        y = short_conv_fwd(x, w4, p3, cu)
        from_x, token, row = _tail_index(cu, H, T)
        seq = torch.arange(N, device=x.device)[:, None]
        tail = torch.where(from_x[..., None], x[token], p3[:, pad:][seq, row])
        ctx.save_for_backward(x, w4, p3, cu)
        ctx.shapes = (W, prefix is not None, weight.dtype, None if prefix is None else prefix.dtype)
        ctx.set_materialize_grads(False)
        return y, tail

    @staticmethod
    def backward(ctx, dy, dtail):
        from flashqla.kernels.hopper.layer_ops import CONV_WIDTH, short_conv_bwd

        x, w4, p3, cu = ctx.saved_tensors
        W, has_prefix, weight_dtype, prefix_dtype = ctx.shapes
        H, pad = W - 1, CONV_WIDTH - W
        dx, dprefix, dw = short_conv_bwd(x, w4, p3, cu, torch.zeros_like(x) if dy is None else dy.contiguous())
        dprefix = dprefix[:, pad:]
        if dtail is not None:  # the new prefix gathered rows of x and of the prefix: send its gradient back
            from_x, token, row = _tail_index(cu, H, x.shape[0])
            zero = dtail.new_zeros(())
            dx.index_put_((token.reshape(-1),), torch.where(from_x[..., None], dtail, zero).reshape(-1, x.shape[1]),
                          accumulate=True)
            seq = torch.arange(cu.numel() - 1, device=x.device)[:, None].expand_as(row)
            dprefix.index_put_((seq, row), torch.where(from_x[..., None], zero, dtail).float(), accumulate=True)
        return dx, dw[:, pad:].to(weight_dtype), dprefix.to(prefix_dtype) if has_prefix else None, None


def causal_conv1d(x, weight, cu_seqlens, prefix=None):
    """flashqla.layers.conv.causal_conv1d(..., silu=True) on the fused kernels: (y [T, C], new_prefix [N, W - 1, C])."""
    return _CausalConv1d.apply(x, weight, prefix, cu_seqlens)


# --- gated RMSNorm ------------------------------------------------------------------------------------

class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, weight, eps):
        from flashqla.kernels.hopper.layer_ops import gated_norm_fwd

        D = o.shape[-1]
        o2, z2 = o.reshape(-1, D).contiguous(), z.reshape(-1, D).contiguous()
        w32 = weight.detach().float().contiguous()
        # torch multiplies the weight and the 16-bit normalised row in the promoted dtype: o's when the
        # weight has o's dtype (a rounded product), else fp32
        round_product = torch.promote_types(weight.dtype, o.dtype) == o.dtype != torch.float32
        y = gated_norm_fwd(o2, z2, w32, eps, round_product)
        ctx.save_for_backward(o2, z2, w32)
        ctx.args = (eps, round_product, o.shape, weight.dtype)
        return y.view(o.shape)

    @staticmethod
    def backward(ctx, dy):
        from flashqla.kernels.hopper.layer_ops import gated_norm_bwd

        o2, z2, w32 = ctx.saved_tensors
        eps, round_product, shape, weight_dtype = ctx.args
        do, dz, dw = gated_norm_bwd(o2, z2, w32, dy.reshape(o2.shape).contiguous(), eps, round_product)
        return do.view(shape), dz.view(shape), dw.to(weight_dtype), None


def gated_rms_norm(o, z, weight, eps: float):
    """flashqla.layers.norm.gated_rms_norm on the fused kernels."""
    return _GatedRMSNorm.apply(o, z, weight, eps)
