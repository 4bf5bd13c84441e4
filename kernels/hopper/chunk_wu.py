"""W and U of the chunks a walk reads, from the forward's gated inverse GA = Gamma o A (design doc §2-3).

In the segmented forward the last walk is the fused one, which reads GA, beta and gcum alone; W and U are
read only by the summary walk (chunk_states.py), and that walk visits every chunk of a (segment, v-head)
only on the exact path: a warmed-up head walks the last few chunks of its segment, and some walks do not
run (`segments._summaries_needed`). `wy_inverse` then runs without W and U for every chunk, and this kernel
writes them for the chunks a walk reads, without a second inverse:

    W = diag(gamma) A diag(beta) K = GA diag(beta gamma) K        (Gamma_rs gamma_s = gamma_r)
    U = (Gamma o A) diag(beta) V = GA diag(beta) V

both 64 x 64 x 128 products on tensor cores with fp32 accumulation (K and V scaled by row and rounded to
the input dtype first). gamma_s = exp(gcum_s) and Gamma_rs are each >= gamma_r (gates <= 0), so neither
factor underflows where the row W_r it builds is representable. The backward's reverse walk reads W only:
with `store_u` = 0 the U product and its stores are skipped.

One CTA per (chunk slot, v-head), 128 threads. active [2, N, Hv] is the summary walk's own (launch.summaries,
decoded by chunk_states.summary_walk_start): a >= 1 starts that walk (S*, then M) at chunk a - 1, zero skips
it. A CTA whose chunk lies before the first chunk either walk reads writes nothing; rows past the end
of a sequence are never written.
"""
import tilelang.language as T

from .chunk_map import chunk_of_slot
from .chunk_states import summary_walk_start

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_chunk_wu(dtype: str):
    """Build the prim_func for q/k/v dtype `dtype` ("bfloat16" or "float16"); all sizes are dynamic."""
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_walks = T.dynamic("num_walks")
    C, D = CHUNK, HEAD_DIM

    @T.prim_func
    def chunk_wu(
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        v: T.Tensor((num_tokens, num_v_heads, D), dtype),
        GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), "float32"),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        active: T.Tensor((num_walks,), "int32"),  # [2, N, Hv] flattened
        w: T.Tensor((num_tokens, num_v_heads, D), dtype),
        u: T.Tensor((num_tokens, num_v_heads, D), dtype),
        num_chunk_slots: T.int32,
        search_steps: T.int32,
        store_u: T.int32,
    ):
        with T.Kernel(num_chunk_slots, num_v_heads, threads=128) as (chunk, h):
            hk = h // (num_v_heads // num_qk_heads)
            GA_sh = T.alloc_shared((C, C), dtype)
            K_sh = T.alloc_shared((C, D), dtype)
            V_sh = T.alloc_shared((C, D), dtype)
            beta_gamma_sh = T.alloc_shared((C,), "float32")
            beta_sh = T.alloc_shared((C,), "float32")
            WU = T.alloc_fragment((C, D), "float32")  # W, then U

            seq, start, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)
            # the first chunk (within its sequence) that a summary walk of (seq, h) reads, decoded as
            # chunk_states decodes it; past every chunk where neither walk runs
            first = T.min(summary_walk_start(active[seq * num_v_heads + h], num_chunk_slots),
                          summary_walk_start(active[(num_seqs + seq) * num_v_heads + h], num_chunk_slots))

            if n_rows > 0 and chunk - chunk_offsets[seq] >= first:
                T.async_copy(GA[start:start + C, h, 0:C], GA_sh)
                T.async_copy(k[start:start + C, hk, 0:D], K_sh)
                if store_u != 0:
                    T.async_copy(v[start:start + C, h, 0:D], V_sh)
                for r in T.Parallel(C):
                    beta_sh[r] = T.if_then_else(r < n_rows, beta[start + T.min(r, last), h], 0.0)
                    beta_gamma_sh[r] = T.exp2(gcum[h, start + T.min(r, last)] * LOG2E) * beta_sh[r]
                T.ptx_wait_group(0)
                T.sync_threads()
                # rows past the sequence end: zero keys and values (the rows of GA that exist are zero in
                # those columns, but 0 x NaN is NaN); K scaled by beta gamma and V by beta in place
                for r, d in T.Parallel(C, D):
                    K_sh[r, d] = T.if_then_else(r < n_rows, T.cast(K_sh[r, d] * beta_gamma_sh[r], dtype),
                                                T.cast(0, dtype))
                if store_u != 0:
                    for r, d in T.Parallel(C, D):
                        V_sh[r, d] = T.if_then_else(r < n_rows, T.cast(V_sh[r, d] * beta_sh[r], dtype),
                                                    T.cast(0, dtype))
                T.sync_threads()
                T.gemm(GA_sh, K_sh, WU, clear_accum=True)
                T.sync_threads()  # every warp's K reads done before K holds W
                for r, d in T.Parallel(C, D):
                    K_sh[r, d] = T.cast(WU[r, d], dtype)
                if store_u != 0:
                    T.gemm(GA_sh, V_sh, WU, clear_accum=True)
                    T.sync_threads()
                    for r, d in T.Parallel(C, D):
                        V_sh[r, d] = T.cast(WU[r, d], dtype)
                T.sync_threads()
                for r, d in T.Parallel(C, D):  # staged for 16-byte row stores
                    if r < n_rows:
                        w[start + r, h, d] = K_sh[r, d]
                if store_u != 0:
                    for r, d in T.Parallel(C, D):
                        if r < n_rows:
                            u[start + r, h, d] = V_sh[r, d]

    return chunk_wu
