"""W of every chunk from the forward's gated inverse GA = Gamma o A (design doc §2), for the backward's
reverse walk at V tiles below 128 (at 128 `chunk_dstates` reads GA instead; launch.walk_reads_ga):

    W = diag(gamma) A diag(beta) K = GA diag(beta gamma) K        (Gamma_rs gamma_s = gamma_r)

a 64 x 64 x 128 product on tensor cores with fp32 accumulation (K scaled by row and rounded to the input
dtype first). gamma_s = exp(gcum_s) and Gamma_rs are each >= gamma_r (gates <= 0), so neither factor
underflows where the row W_r it builds is representable. The forward does not need W: its walks read GA,
v and beta.

One CTA per (chunk slot, v-head), 128 threads; rows past the end of a sequence are never written.
"""
import tilelang.language as T

from .chunk_map import chunk_of_slot

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_chunk_w(dtype: str):
    """Build the prim_func for q/k/v dtype `dtype` ("bfloat16" or "float16"); all sizes are dynamic."""
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    C, D = CHUNK, HEAD_DIM

    @T.prim_func
    def chunk_w(
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), "float32"),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        w: T.Tensor((num_tokens, num_v_heads, D), dtype),
        num_chunk_slots: T.int32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_chunk_slots, num_v_heads, threads=128) as (chunk, h):
            hk = h // (num_v_heads // num_qk_heads)
            GA_sh = T.alloc_shared((C, C), dtype)
            K_sh = T.alloc_shared((C, D), dtype)
            beta_gamma_sh = T.alloc_shared((C,), "float32")
            W = T.alloc_fragment((C, D), "float32")

            _, start, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)
            if n_rows > 0:
                T.async_copy(GA[start:start + C, h, 0:C], GA_sh)
                T.async_copy(k[start:start + C, hk, 0:D], K_sh)
                for r in T.Parallel(C):
                    beta_gamma_sh[r] = T.if_then_else(
                        r < n_rows, T.exp2(gcum[h, start + T.min(r, last)] * LOG2E) * beta[start + T.min(r, last), h],
                        0.0)
                T.ptx_wait_group(0)
                T.sync_threads()
                # rows past the sequence end: zero keys (the rows of GA that exist are zero in those columns,
                # but 0 x NaN is NaN); K scaled by beta gamma in place
                for r, d in T.Parallel(C, D):
                    K_sh[r, d] = T.if_then_else(r < n_rows, T.cast(K_sh[r, d] * beta_gamma_sh[r], dtype),
                                                T.cast(0, dtype))
                T.sync_threads()
                T.gemm(GA_sh, K_sh, W, clear_accum=True)
                T.sync_threads()  # every warp's K reads done before K holds W
                for r, d in T.Parallel(C, D):
                    K_sh[r, d] = T.cast(W[r, d], dtype)
                T.sync_threads()
                for r, d in T.Parallel(C, D):  # staged for 16-byte row stores
                    if r < n_rows:
                        w[start + r, h, d] = K_sh[r, d]

    return chunk_w
