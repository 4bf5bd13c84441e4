"""The fp32 chain over intra-card CP segments in one launch (design doc §3-4).

Forward (`reverse = 0`), for the rows r = first + 1 .. last of every sequence:

    out[r] = bias[r - 1] + mask[r] * mats[r - 1] @ out[r - 1]          (S_{j,0} = S*_{j-1} + M_{j-1} S_{j-1,0})

Backward (`reverse = 1`), for r = last - 1 down to first:

    out[r] = bias[r + 1] + mask[r] * mats[r + 1]^T @ out[r + 1]        (X_j = D_{j+1} + f M_{j+1}^T X_{j+1})

`out` holds the first (forward) or last (backward) row of every sequence on entry. All operands fp32
[rows * Hv, 128, 128] (mask [rows * Hv]); the products run on CUDA cores in fp32 (a fp32 T.gemm would
be TF32). One CTA per (V tile, sequence, v-head): what was one batched GEMM launch per segment position
on the host is one launch for the whole chain; a row whose mask is 0 skips its product.
"""
import tilelang.language as T

HEAD_DIM = 128
BLOCK_V = 32


def build_segment_chain():
    num_mats = T.dynamic("num_mats")
    num_seqs = T.dynamic("num_seqs")
    D, BV = HEAD_DIM, BLOCK_V

    @T.prim_func
    def segment_chain(
        out: T.Tensor((num_mats, D, D), "float32"),
        bias: T.Tensor((num_mats, D, D), "float32"),
        mats: T.Tensor((num_mats, D, D), "float32"),
        mask: T.Tensor((num_mats,), "float32"),
        first_rows: T.Tensor((num_seqs,), "int32"),
        last_rows: T.Tensor((num_seqs,), "int32"),
        num_heads: T.int32,
        reverse: T.int32,
    ):
        with T.Kernel(D // BV, num_seqs, num_heads, threads=128) as (bv, n, h):
            v0 = bv * BV
            first = first_rows[n]
            last = last_rows[n]
            M_s = T.alloc_shared((D, D), "float32")
            S_s = T.alloc_shared((D, BV), "float32")
            acc = T.alloc_fragment((D, BV), "float32")
            scale = T.alloc_var("float32")

            start = T.if_then_else(reverse != 0, last, first)
            T.copy(out[start * num_heads + h, 0:D, v0:v0 + BV], S_s)
            for step in T.serial(last - first):
                row = T.if_then_else(reverse != 0, last - 1 - step, first + 1 + step)
                src = T.if_then_else(reverse != 0, row + 1, row - 1)
                scale = mask[row * num_heads + h]
                T.copy(bias[src * num_heads + h, 0:D, v0:v0 + BV], acc)
                if scale != 0:
                    T.copy(mats[src * num_heads + h, 0:D, 0:D], M_s)
                    T.sync_threads()
                    for k in T.serial(D):
                        for i, j in T.Parallel(D, BV):
                            acc[i, j] += scale * T.if_then_else(reverse != 0, M_s[k, i], M_s[i, k]) * S_s[k, j]
                T.sync_threads()  # every thread has read S_s and M_s
                T.copy(acc, S_s)
                T.copy(acc, out[row * num_heads + h, 0:D, v0:v0 + BV])
                T.sync_threads()

    return segment_chain
