"""Gated RMSNorm of the GDN output, forward and backward, per row of head_dim D.

The reference is flashqla/layers/norm.py (Qwen3-Next precision), and every rounding it does is done here
(rnd = round to the input dtype; a no-op for fp32):

    r  = rsqrt(mean(o^2) + eps)                        fp32
    nb = rnd(o r)                                      the normalised row, back in the input dtype
    p  = w nb, rounded by rnd when `round_product`     (weight in the input dtype: torch multiplies two
                                                        16-bit tensors; an fp32 weight promotes to fp32)
    s  = silu(z)                                       fp32
    y  = rnd(p s)

Backward (the same chain as autograd of the reference):

    dp  = dy s, rounded when `round_product`;   ds = dy p;   dz = rnd(ds silu'(z))
    dnb = rnd(dp w)                                    the gradient of the 16-bit normalised row
    do  = rnd(r dnb - o r^3 mean(dnb o))
    dw  = sum over rows of dp nb                       per-CTA partial sums [G, D], added by the host

Tiling: a CTA of 128 threads (256 in the backward) holds ROWS x D values per step (ROWS = 4096 / D), the
row sums of squares and of dnb o are fragment reductions along D. The forward has one CTA per row block;
a backward CTA walks `blocks_per_cta` row blocks (runtime) accumulating dp nb elementwise and reduces it over rows
once at the end. Rows past R load as zeros and are never stored. D is static, so row segments are
vectorised loads and stores.

H200, bf16, 32768 x 32 rows of 128 (benchmarks/bench_layer_ops.py, 2026-11-30): forward 0.23 ms (73% of
the 4.8 TB/s floor), backward 0.46 ms (61%); torch reference 3.19 / 6.46 ms.
"""
import tilelang.language as T

THREADS = 128
BWD_THREADS = 256
TILE_ELEMS = 4096


def rows_for(head_dim: int) -> int:
    return TILE_ELEMS // head_dim


def _rnd(value, dtype):
    """Round an fp32 value to `dtype` and back (the casts of the reference)."""
    return T.cast(T.cast(value, dtype), "float32")


@T.macro
def _load_rows(src, dst, r0, num_rows):
    for r, d in T.Parallel(dst.shape[0], dst.shape[1]):
        dst[r, d] = T.if_then_else(r0 + r < num_rows, T.cast(src[r0 + r, d], "float32"), 0.0)


@T.macro
def _inv_rms(O, sq, rstd, eps):
    """rstd[r] = rsqrt(mean_d O[r, d]^2 + eps)."""
    for r, d in T.Parallel(O.shape[0], O.shape[1]):
        sq[r, d] = O[r, d] * O[r, d]
    T.reduce_sum(sq, rstd, dim=1)
    for r in T.Parallel(O.shape[0]):
        rstd[r] = T.rsqrt(rstd[r] / O.shape[1] + eps)


def build_gated_norm_fwd(dtype: str, head_dim: int):
    """y [R, D] from o, z [R, D] in `dtype` and weight fp32 [D]; eps and round_product are runtime."""
    num_rows = T.dynamic("num_rows")
    D, BR = head_dim, rows_for(head_dim)

    @T.prim_func
    def gated_norm_fwd(
        o: T.Tensor((num_rows, D), dtype),
        z: T.Tensor((num_rows, D), dtype),
        weight: T.Tensor((D,), "float32"),
        y: T.Tensor((num_rows, D), dtype),
        eps: T.float32,
        round_product: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_rows, BR), threads=THREADS) as block:
            O = T.alloc_fragment((BR, D), "float32")
            sq = T.alloc_fragment((BR, D), "float32")
            rstd = T.alloc_fragment((BR,), "float32")
            W_sh = T.alloc_shared((D,), "float32")
            r0 = block * BR

            T.copy(weight, W_sh)
            _load_rows(o, O, r0, num_rows)
            _inv_rms(O, sq, rstd, eps)
            for r, d in T.Parallel(BR, D):
                if r0 + r < num_rows:
                    p = W_sh[d] * _rnd(O[r, d] * rstd[r], dtype)
                    p = T.if_then_else(round_product != 0, _rnd(p, dtype), p)
                    zz = T.cast(z[r0 + r, d], "float32")
                    y[r0 + r, d] = T.cast(p * (zz / (1.0 + T.exp(-zz))), dtype)

    return gated_norm_fwd


def build_gated_norm_bwd(dtype: str, head_dim: int):
    """do, dz [R, D] in `dtype` and dw partial sums fp32 [G, D] (one per CTA) from dy [R, D]."""
    num_rows = T.dynamic("num_rows")
    num_groups = T.dynamic("num_groups")
    D, BR = head_dim, rows_for(head_dim)

    @T.prim_func
    def gated_norm_bwd(
        o: T.Tensor((num_rows, D), dtype),
        z: T.Tensor((num_rows, D), dtype),
        weight: T.Tensor((D,), "float32"),
        dy: T.Tensor((num_rows, D), dtype),
        do: T.Tensor((num_rows, D), dtype),
        dz: T.Tensor((num_rows, D), dtype),
        dw_part: T.Tensor((num_groups, D), "float32"),
        eps: T.float32,
        round_product: T.int32,
        blocks_per_cta: T.int32,
    ):
        with T.Kernel(num_groups, threads=BWD_THREADS) as group:
            T.annotate_min_blocks_per_sm(3)  # <= 85 registers: 24 warps per SM
            O = T.alloc_fragment((BR, D), "float32")
            sq = T.alloc_fragment((BR, D), "float32")  # o^2, then dnb o
            dnb = T.alloc_fragment((BR, D), "float32")
            dw_acc = T.alloc_fragment((BR, D), "float32")
            rstd = T.alloc_fragment((BR,), "float32")
            dot = T.alloc_fragment((BR,), "float32")
            dw_sum = T.alloc_fragment((D,), "float32")
            W_sh = T.alloc_shared((D,), "float32")

            T.copy(weight, W_sh)
            T.clear(dw_acc)
            for blk in T.serial(blocks_per_cta):
                r0 = (group * blocks_per_cta + blk) * BR
                if r0 < num_rows:
                    _load_rows(o, O, r0, num_rows)
                    _inv_rms(O, sq, rstd, eps)
                    for r, d in T.Parallel(BR, D):
                        valid = r0 + r < num_rows
                        nb = _rnd(O[r, d] * rstd[r], dtype)
                        p = W_sh[d] * nb
                        p = T.if_then_else(round_product != 0, _rnd(p, dtype), p)
                        zz = T.if_then_else(valid, T.cast(z[r0 + r, d], "float32"), 0.0)
                        g = T.if_then_else(valid, T.cast(dy[r0 + r, d], "float32"), 0.0)
                        sig = 1.0 / (1.0 + T.exp(-zz))
                        dp = g * zz * sig
                        dp = T.if_then_else(round_product != 0, _rnd(dp, dtype), dp)
                        if valid:
                            dz[r0 + r, d] = T.cast(g * p * sig * (1.0 + zz * (1.0 - sig)), dtype)
                        dw_acc[r, d] += dp * nb
                        dnb[r, d] = _rnd(dp * W_sh[d], dtype)
                        sq[r, d] = dnb[r, d] * O[r, d]
                    T.reduce_sum(sq, dot, dim=1)
                    for r, d in T.Parallel(BR, D):
                        if r0 + r < num_rows:
                            do[r0 + r, d] = T.cast(
                                rstd[r] * dnb[r, d] - O[r, d] * rstd[r] * rstd[r] * rstd[r] * dot[r] / D, dtype)
            T.reduce_sum(dw_acc, dw_sum, dim=0)
            for d in T.Parallel(D):
                dw_part[group, d] = dw_sum[d]

    return gated_norm_bwd
