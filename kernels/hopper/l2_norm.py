"""L2 normalisation of q and k over the head dim (the op's `use_qk_l2norm_in_kernel`), forward and backward.

The reference is `flashqla.ops.l2norm.l2norm_reference` (FLA's convention), every step in fp32 with one
rounding to the input dtype at the end (rnd):

    r  = rsqrt(sum(x^2) + eps)                  per row of D = 128
    y  = rnd(x r)

Backward, autograd of that chain (dy and x in fp32):

    dx = rnd(r dy - x r^3 sum(dy x))

The forward stores r (fp32, one per row) for the backward, which re-reads x: the torch chain keeps an
fp32 copy of x and runs five passes each way. A CTA of 128 threads holds ROWS = 32 rows; the row sums
are fragment reductions along D, rows past R load as zeros and are never stored, so each row segment is
one vectorised load or store.
"""
import tilelang.language as T

from .gated_norm import _load_rows

HEAD_DIM = 128
ROWS = 32
THREADS = 128


def build_l2norm_fwd(dtype: str):
    """y [R, 128] in `dtype` and rstd fp32 [R] from x [R, 128]; eps is runtime."""
    num_rows = T.dynamic("num_rows")
    D, BR = HEAD_DIM, ROWS

    @T.prim_func
    def l2norm_fwd(
        x: T.Tensor((num_rows, D), dtype),
        y: T.Tensor((num_rows, D), dtype),
        rstd: T.Tensor((num_rows,), "float32"),
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(num_rows, BR), threads=THREADS) as block:
            X = T.alloc_fragment((BR, D), "float32")
            sq = T.alloc_fragment((BR, D), "float32")
            r = T.alloc_fragment((BR,), "float32")
            r0 = block * BR

            _load_rows(x, X, r0, num_rows)
            for i, d in T.Parallel(BR, D):
                sq[i, d] = X[i, d] * X[i, d]
            T.reduce_sum(sq, r, dim=1)
            for i in T.Parallel(BR):
                r[i] = T.rsqrt(r[i] + eps)
            for i, d in T.Parallel(BR, D):
                if r0 + i < num_rows:
                    y[r0 + i, d] = T.cast(X[i, d] * r[i], dtype)
            for i in T.Parallel(BR):
                if r0 + i < num_rows:
                    rstd[r0 + i] = r[i]

    return l2norm_fwd


def build_l2norm_bwd(dtype: str):
    """dx [R, 128] in `dtype` from x, dy [R, 128] and the forward's rstd fp32 [R]."""
    num_rows = T.dynamic("num_rows")
    D, BR = HEAD_DIM, ROWS

    @T.prim_func
    def l2norm_bwd(
        x: T.Tensor((num_rows, D), dtype),
        dy: T.Tensor((num_rows, D), dtype),
        rstd: T.Tensor((num_rows,), "float32"),
        dx: T.Tensor((num_rows, D), dtype),
    ):
        with T.Kernel(T.ceildiv(num_rows, BR), threads=THREADS) as block:
            X = T.alloc_fragment((BR, D), "float32")
            G = T.alloc_fragment((BR, D), "float32")
            prod = T.alloc_fragment((BR, D), "float32")
            dot = T.alloc_fragment((BR,), "float32")
            r = T.alloc_fragment((BR,), "float32")
            r0 = block * BR

            _load_rows(x, X, r0, num_rows)
            _load_rows(dy, G, r0, num_rows)
            for i in T.Parallel(BR):
                r[i] = T.if_then_else(r0 + i < num_rows, rstd[r0 + i], 0.0)
            for i, d in T.Parallel(BR, D):
                prod[i, d] = G[i, d] * X[i, d]
            T.reduce_sum(prod, dot, dim=1)
            for i, d in T.Parallel(BR, D):
                if r0 + i < num_rows:
                    dx[r0 + i, d] = T.cast(r[i] * G[i, d] - X[i, d] * (r[i] * r[i] * r[i]) * dot[i], dtype)

    return l2norm_bwd
