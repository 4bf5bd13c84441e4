"""Host side of the fused layer-op kernels: the GDN layer's short conv (short_conv.py) and gated RMSNorm
(gated_norm.py), and the q/k L2 norm (l2_norm.py). Compile cache per configuration, launch-grid choices,
the launches.

Tensors reach these functions already checked, contiguous and in kernel layout (flashqla/layers/fused.py
does that and the autograd). Nothing here imports tilelang at import time.
"""
from __future__ import annotations

import functools

import torch

from .launch import compile_from

TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
LAYER_DTYPES = tuple(TORCH_TO_TL.values())
CONV_WIDTH = 4  # every conv kernel has 4 taps; narrower convs are zero-padded (short_conv.py)
NORM_HEAD_DIMS = (64, 128, 256)
# the kernels' tiles (short_conv.BLOCK_T, block_c_for; gated_norm.rows_for), repeated here so that launching
# a prebuilt kernel never imports a kernel module (nor tilelang); tests/test_fused_layer_ops.py checks them
CONV_BLOCK_T = 64
NORM_TILE_ELEMS = 4096
# Backward CTAs walk several blocks so the dw partial buffers stay small: about this many CTAs in all
# (a constant, so the partial sums, and the gradients, do not depend on the GPU model).
BWD_TARGET_CTAS = 2048


def conv_block_c(dtype: str) -> int:
    """Channels per conv CTA (short_conv.block_c_for)."""
    return 128 if dtype == "float32" else 256


@functools.lru_cache(maxsize=None)
def compiled_short_conv_fwd(dtype: str):
    return compile_from("short_conv", "build_short_conv_fwd", f"short_conv_fwd({dtype})", dtype)


@functools.lru_cache(maxsize=None)
def compiled_short_conv_bwd(dtype: str):
    return compile_from("short_conv", "build_short_conv_bwd", f"short_conv_bwd({dtype})", dtype)


@functools.lru_cache(maxsize=None)
def compiled_gated_norm_fwd(dtype: str, head_dim: int):
    return compile_from("gated_norm", "build_gated_norm_fwd", f"gated_norm_fwd({dtype}, {head_dim})", dtype, head_dim)


@functools.lru_cache(maxsize=None)
def compiled_gated_norm_bwd(dtype: str, head_dim: int):
    return compile_from("gated_norm", "build_gated_norm_bwd", f"gated_norm_bwd({dtype}, {head_dim})", dtype, head_dim)


@functools.lru_cache(maxsize=None)
def compiled_l2norm_fwd(dtype: str):
    return compile_from("l2_norm", "build_l2norm_fwd", f"l2norm_fwd({dtype})", dtype)


@functools.lru_cache(maxsize=None)
def compiled_l2norm_bwd(dtype: str):
    return compile_from("l2_norm", "build_l2norm_bwd", f"l2norm_bwd({dtype})", dtype)


def kernel_configs(dtypes=LAYER_DTYPES):
    """Every (kernel, args) pair the layer ops can choose for TileLang dtypes `dtypes` (all sizes are runtime)."""
    for dtype in dtypes:
        yield compiled_short_conv_fwd, (dtype,)
        yield compiled_short_conv_bwd, (dtype,)
        for head_dim in NORM_HEAD_DIMS:
            yield compiled_gated_norm_fwd, (dtype, head_dim)
            yield compiled_gated_norm_bwd, (dtype, head_dim)
        yield compiled_l2norm_fwd, (dtype,)
        yield compiled_l2norm_bwd, (dtype,)


def conv_vec(dtype: torch.dtype) -> int:
    """Channels per 16-byte vector, which must divide C."""
    return 16 // dtype.itemsize


def groups_for(blocks: int, other_ctas: int) -> tuple[int, int]:
    """(CTAs along the walked dimension, blocks each walks) for `blocks` blocks and `other_ctas` CTAs
    beside each: about BWD_TARGET_CTAS CTAs in all, every CTA with at least one block."""
    groups = max(1, min(blocks, BWD_TARGET_CTAS // max(other_ctas, 1)))
    per_cta = -(-blocks // groups)
    return -(-blocks // per_cta), per_cta


def _empty(like):
    """torch.empty (not empty_like: the GPU tests NaN-poison torch.empty to catch unwritten outputs)."""
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _conv_views(x, prefix):
    T, C = x.shape
    v = conv_vec(x.dtype)
    return x.view(T, C // v, v), prefix.view(prefix.shape[0], prefix.shape[1], C // v, v)


def short_conv_fwd(x, weight, prefix, cu_seqlens):
    """y = silu(conv(x)). x [T, C] (T > 0, C % VEC == 0); weight fp32 [C, 4]; prefix [N, 3, C] in x's
    dtype; cu_seqlens int32 [N + 1]. All contiguous on one CUDA device."""
    T, C = x.shape
    y = _empty(x)
    x3, p4 = _conv_views(x, prefix)
    N = cu_seqlens.numel() - 1
    compiled_short_conv_fwd(TORCH_TO_TL[x.dtype])(x3, weight.view(x3.shape[1], x3.shape[2], CONV_WIDTH), p4,
                                                  cu_seqlens, y.view(x3.shape), N.bit_length())
    return y


def short_conv_bwd(x, weight, prefix, cu_seqlens, dy):
    """(dx [T, C] in x's dtype, dprefix fp32 [N, 3, C], dw fp32 [C, 4]) of short_conv_fwd given dy."""
    T, C = x.shape
    N = cu_seqlens.numel() - 1
    dtype = TORCH_TO_TL[x.dtype]
    x3, p4 = _conv_views(x, prefix)
    groups, per_cta = groups_for(-(-T // CONV_BLOCK_T), -(-C // conv_block_c(dtype)))
    dx = _empty(x)
    dprefix = torch.zeros(prefix.shape, dtype=torch.float32, device=x.device)  # sequences without tokens: 0
    dw_part = torch.empty(groups, C, CONV_WIDTH, dtype=torch.float32, device=x.device)
    compiled_short_conv_bwd(dtype)(
        x3, weight.view(x3.shape[1], x3.shape[2], CONV_WIDTH), p4, cu_seqlens, dy.view(x3.shape), dx.view(x3.shape),
        dprefix.view(p4.shape), dw_part.view(groups, x3.shape[1], x3.shape[2], CONV_WIDTH), N.bit_length(), per_cta)
    return dx, dprefix, dw_part.sum(0)


def gated_norm_fwd(o, z, weight, eps: float, round_product: bool):
    """y [R, D] for o, z [R, D] (R > 0) in one dtype, weight fp32 [D]."""
    y = _empty(o)
    compiled_gated_norm_fwd(TORCH_TO_TL[o.dtype], o.shape[1])(o, z, weight, y, float(eps), int(round_product))
    return y


def gated_norm_bwd(o, z, weight, dy, eps: float, round_product: bool):
    """(do, dz [R, D] in o's dtype, dw fp32 [D]) of gated_norm_fwd given dy."""
    R, D = o.shape
    groups, per_cta = groups_for(-(-R // (NORM_TILE_ELEMS // D)), 1)
    do, dz = _empty(o), _empty(z)
    dw_part = torch.empty(groups, D, dtype=torch.float32, device=o.device)
    compiled_gated_norm_bwd(TORCH_TO_TL[o.dtype], D)(o, z, weight, dy, do, dz, dw_part, float(eps),
                                                     int(round_product), per_cta)
    return do, dz, dw_part.sum(0)


def l2norm_fwd(x, eps: float):
    """(y [R, 128] in x's dtype, rstd fp32 [R]) for x [R, 128], R > 0."""
    y = _empty(x)
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    compiled_l2norm_fwd(TORCH_TO_TL[x.dtype])(x, y, rstd, float(eps))
    return y, rstd


def l2norm_bwd(x, dy, rstd):
    """dx [R, 128] in x's dtype of l2norm_fwd given dy and its rstd."""
    dx = _empty(x)
    compiled_l2norm_bwd(TORCH_TO_TL[x.dtype])(x, dy, rstd, dx)
    return dx
