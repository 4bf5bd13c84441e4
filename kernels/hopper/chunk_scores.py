"""Every chunk's masked, scaled scores at once, for the fused walk at narrow V tiles (fused_fwd.py's `scores`
build). For every 64-token chunk and v-head h (k-head h // (Hv / Hqk)), design doc §2, docs/algorithm.md F4:

    P = scale (Lower(Gamma) o Q K^T)        [64 x 64], Gamma_rs = gamma_r / gamma_s (exp2 of base-2 gates)

stored [T, Hv, 64] in the input dtype, row r at the chunk's token r: the intra-chunk term of
O = scale diag(gamma) Q S + P V'. The values are the ones fused_fwd's output warpgroup forms in its walk
(the same products, the same gate arithmetic, one rounding to the input dtype), so O does not change.

Why: at V tile 32 a (sequence, v-head) is walked by four CTAs, and each one's output warpgroup formed the same
P for every chunk (the 64 x 64 x 128 product, its mask, its copy to shared memory): (2, 8) x 32K with CP off,
fused walk alone, H100, 2026-12-06: 833 us with O, 530 without (docs/kernels.md, "Fifty-second session").

One CTA per (v-head, chunk slot), the v-heads fastest: Q and K (read by the group's CTAs side by side, from L2
after the first) and the gates while they load, Q K^T, the mask, a 16-byte store per thread of the rows inside
the sequence: 37.7 us at (2, 8) x 32K on an H100 (1.8 TB/s), 225 at (32, 32) x 32K (3.0 TB/s, its memory
bound). A CTA per (chunk, k-head) forming Q K^T once for its group's v-heads one after another took 44.6 and
250. Chunk slot c finds its sequence by binary search in `chunk_offsets` (chunk_map.py); slots past the last
chunk store nothing. Rows past the end of a sequence (the next sequence's tokens, or zeros past the tensor
end) reach only rows that are not stored, or entries the causal mask removes; their gates repeat the
sequence's last (walk_gates.py's convention).
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .chunk_map import chunk_of_slot

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_chunk_scores(dtype: str):
    """Build the prim_func for q/k dtype `dtype`; all sizes and `scale` are runtime arguments."""
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    C, D = CHUNK, HEAD_DIM

    @T.prim_func
    def chunk_scores(
        q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        scores: T.Tensor((num_tokens, num_v_heads, C), dtype),
        scale: T.float32,
        num_chunk_slots: T.int32,
        search_steps: T.int32,
    ):
        # the v-heads of a chunk side by side (x fastest): a GQA group's CTAs read one Q and K tile, mostly from L2
        with T.Kernel(num_v_heads, num_chunk_slots, threads=128) as (h, chunk):
            hk = h // (num_v_heads // num_qk_heads)
            Q_s = T.alloc_shared((C, D), dtype)
            K_s = T.alloc_shared((C, D), dtype)
            P_sh = T.alloc_shared((C, C), dtype)
            g_sh = T.alloc_shared((C,), "float32")  # base-2 gates
            P = T.alloc_fragment((C, C), "float32")
            # P's rows leave the accumulator by stmatrix, 8 rows at once: row-major they share banks (8-way)
            T.annotate_layout({P_sh: make_swizzled_layout(P_sh)})

            seq, start, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)
            if n_rows > 0:
                T.async_copy(q[start:start + C, hk, 0:D], Q_s)
                T.async_copy(k[start:start + C, hk, 0:D], K_s)
                for r in T.Parallel(C):  # while Q and K are in flight
                    g_sh[r] = gcum[h, start + T.min(r, last)] * LOG2E
                T.ptx_wait_group(0)
                T.sync_threads()
                T.gemm(Q_s, K_s, P, transpose_B=True, clear_accum=True)
                # as fused_fwd masks it (T.Select evaluates both sides: above the diagonal the discarded one may be
                # Q K^T x inf)
                for r, s in T.Parallel(C, C):
                    P[r, s] = T.Select(r >= s, P[r, s] * T.exp2(g_sh[r] - g_sh[s]) * scale, 0.0)
                T.copy(P, P_sh)
                for r, s in T.Parallel(C, C):
                    if r < n_rows:
                        scores[start + r, h, s] = P_sh[r, s]

    return chunk_scores
