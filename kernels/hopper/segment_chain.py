"""The fp32 chain over intra-card CP segments in one launch (design doc §3-4).

Forward (`reverse = 0`), for the rows r = first + 1 .. last of every sequence:

    out[r] = bias[r - 1] + mask[r] * mats[r - 1] @ out[r - 1]          (S_{j,0} = S*_{j-1} + M_{j-1} S_{j-1,0})

Backward (`reverse = 1`), for r = last - 1 down to first:

    out[r] = bias[r + 1] + mask[r] * mats[r + 1]^T @ out[r + 1]        (X_j = D_{j+1} + f M_{j+1}^T X_{j+1})

`out` holds the first (forward) or last (backward) row of every sequence on entry. All operands fp32
[rows * Hv, 128, 128] (mask [rows * Hv]); the products run on CUDA cores in fp32 (a fp32 T.gemm would
be TF32). One CTA per (V tile of 16 columns, sequence, v-head): what was one batched GEMM launch per
segment position on the host is one launch for the whole chain; a row whose mask is 0 skips its product.

Each step is a 128 x 16 x 128 product, serial along the chain, so a step's latency is the kernel's time:
- the next step's bias tile and matrix are in flight (cp.async into the second of two shared buffers)
  while this step multiplies;
- each thread holds a 4 x 4 block of the product, so every shared load feeds 8 FMAs: 16-byte reads of
  4 consecutive k of a row of M (forward) or of 4 consecutive rows of a row of M (backward, M^T) and of
  4 columns of a row of the state. The forward's 4 rows are i = a + 32 r, so the 8 rows a warp reads at
  once are consecutive and, with the matrix rows padded to 132 floats, on 8 different bank groups; the
  backward's are i = 4 a + r (one 16-byte read of row k holds all four).
"""
import tilelang.language as T

HEAD_DIM = 128
BLOCK_V = 16
ROW_PAD = 4  # floats after each matrix row in shared memory (see the bank-group note above)


def build_segment_chain():
    num_mats = T.dynamic("num_mats")
    num_seqs = T.dynamic("num_seqs")
    D, BV = HEAD_DIM, BLOCK_V

    @T.macro
    def prefetch(bias, mats, mask, M_s, B_s, num_heads, reverse, h, v0, first, last, step, buf):
        """Step `step`'s bias tile, and its matrix where its mask is not 0, into buffer `buf` (cp.async)."""
        row = T.if_then_else(reverse != 0, last - 1 - step, first + 1 + step)
        src = T.if_then_else(reverse != 0, row + 1, row - 1)
        T.async_copy(bias[src * num_heads + h, 0:D, v0:v0 + BV], B_s[buf, 0:D, 0:BV])
        if mask[row * num_heads + h] != 0:
            T.async_copy(mats[src * num_heads + h, 0:D, 0:D], M_s[buf, 0:D, 0:D])

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
            M_s = T.alloc_shared((2, D, D + ROW_PAD), "float32")  # this step's matrix and the next one's
            B_s = T.alloc_shared((2, D, BV), "float32")  # this step's bias tile and the next one's
            S_s = T.alloc_shared((D, BV), "float32")
            acc = T.alloc_local((4, 4), "float32")  # this thread's 4 rows x 4 columns of out[row]
            prod = T.alloc_local((4, 4), "float32")
            m_part = T.alloc_local((4, 4), "float32")
            s_part = T.alloc_local((4, 4), "float32")
            scale = T.alloc_var("float32")

            tx = T.get_thread_binding()
            a = tx // 4  # row group: rows a + 32 r (forward) or 4 a + r (backward)
            j0 = tx % 4 * 4  # first of this thread's 4 columns in the tile
            start = T.if_then_else(reverse != 0, last, first)
            steps = last - first
            T.copy(out[start * num_heads + h, 0:D, v0:v0 + BV], S_s)
            if steps > 0:
                prefetch(bias, mats, mask, M_s, B_s, num_heads, reverse, h, v0, first, last, 0, 0)
            for step in T.serial(steps):
                row = T.if_then_else(reverse != 0, last - 1 - step, first + 1 + step)
                buf = step % 2
                scale = mask[row * num_heads + h]
                T.ptx_wait_group(0)
                T.sync_threads()  # this step's tiles and the previous step's state visible to all
                if step + 1 < steps:  # the next step's tiles, into the buffers the previous step read
                    prefetch(bias, mats, mask, M_s, B_s, num_heads, reverse, h, v0, first, last, step + 1, 1 - buf)
                for r in T.unroll(4):
                    i = T.if_then_else(reverse != 0, 4 * a + r, a + 32 * r)
                    for c in T.vectorized(4):
                        acc[r, c] = B_s[buf, i, j0 + c]
                if scale != 0:
                    for r in T.unroll(4):
                        for c in T.unroll(4):
                            prod[r, c] = 0.0
                    if reverse != 0:  # prod[i, j] = sum_k M[k, i] S[k, j], rows i = 4 a + r
                        for kq in T.serial(D // 4):
                            for q in T.unroll(4):
                                for r in T.vectorized(4):
                                    m_part[q, r] = M_s[buf, 4 * kq + q, 4 * a + r]
                                for c in T.vectorized(4):
                                    s_part[q, c] = S_s[4 * kq + q, j0 + c]
                            for q in T.unroll(4):
                                for r in T.unroll(4):
                                    for c in T.unroll(4):
                                        prod[r, c] += m_part[q, r] * s_part[q, c]
                    else:  # prod[i, j] = sum_k M[i, k] S[k, j], rows i = a + 32 r, k four at a time
                        for kq in T.serial(D // 4):
                            for r in T.unroll(4):
                                for q in T.vectorized(4):
                                    m_part[r, q] = M_s[buf, a + 32 * r, 4 * kq + q]
                            for q in T.unroll(4):
                                for c in T.vectorized(4):
                                    s_part[q, c] = S_s[4 * kq + q, j0 + c]
                            for r in T.unroll(4):
                                for q in T.unroll(4):
                                    for c in T.unroll(4):
                                        prod[r, c] += m_part[r, q] * s_part[q, c]
                    for r in T.unroll(4):
                        for c in T.unroll(4):
                            acc[r, c] += scale * prod[r, c]
                T.sync_threads()  # every thread has read this step's state
                for r in T.unroll(4):
                    i = T.if_then_else(reverse != 0, 4 * a + r, a + 32 * r)
                    for c in T.vectorized(4):
                        S_s[i, j0 + c] = acc[r, c]
                    for c in T.vectorized(4):
                        out[row * num_heads + h, i, v0 + j0 + c] = acc[r, c]

    return segment_chain
