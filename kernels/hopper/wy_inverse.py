"""Per-chunk gate-free WY inverse and chunk-local cumulative gate (design doc §2).

For every 64-token chunk of every packed sequence and every v-head h (reading k-head h // (Hv/Hqk)):

    Ab   = (I + StrictLower(diag(beta) K K^T))^{-1} diag(beta)        [64 x 64], the fused forward's operand
    W    = diag(gamma) Ab K                                            [64 x 128]  (docs/algorithm.md W1)
    U    = (Gamma o Ab) V                                              [64 x 128]  (W2)
    gcum = cumsum_{t <= r} g_t                                         [64], fp32, natural log,
                                                                       stored head-major [Hv, T]

Ab, W and U are stored in the input dtype. diag(beta) is folded into the columns of A because the
forward only ever uses A diag(beta), and the gate factor Gamma commutes with that column scaling. The
backward needs A itself (its dbeta and dA terms, chunk_bwd_local.py): with the runtime flag `store_a`
the `Ab` output holds A = (I + StrictLower(diag(beta) K K^T))^{-1} instead (W and U are unchanged).
The inverse needs no exp; the gates enter only W and U (exp2 of base-2 differences, each <= 0).

Chunks never straddle sequences. CTA c of the grid finds its sequence by binary search in
`chunk_offsets` (exclusive prefix sum of chunks per sequence; `search_steps` = bit length of N); CTAs past the last chunk and rows past the
end of a sequence write nothing. Rows past the end are loaded as zero keys, so they cannot reach the rows
that exist (A is lower triangular).

Schedule (one warpgroup, 128 threads, per (chunk, v-head)):
  1. load the K and V tiles (rows beyond the sequence end zeroed), beta, g; cumsum g, store gcum;
  2. K K^T on tensor cores (fp32 accumulate), L = StrictLower(diag(beta) K K^T) to fp32 shared memory;
  3. invert the four 16x16 diagonal blocks of I + L by fp32 forward substitution (CUDA cores);
  4. merge 16 -> 32: X21 = -D1^{-1} L21 D0^{-1} for both 32-blocks (CUDA cores, fp32);
  5. merge 32 -> 64: X21 = -P1^{-1} L21 P0^{-1} with two 32x32x32 tensor-core GEMMs (fp32 operands, TF32);
  6. scale columns by beta, store Ab; W = diag(gamma) (Ab K) and U = (Gamma o Ab) V on tensor cores;
     store the rows that exist.
"""
import tilelang
import tilelang.language as T

from .chunk_map import sequence_of_chunk

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_wy_inverse(dtype: str):
    """Build the prim_func for q/k/v dtype `dtype` ("bfloat16" or "float16"); all sizes are dynamic."""
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    C, D = CHUNK, HEAD_DIM

    @T.prim_func
    def wy_inverse(
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), "float32"),
        g: T.Tensor((num_tokens, num_v_heads), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        v: T.Tensor((num_tokens, num_v_heads, D), dtype),
        Ab: T.Tensor((num_tokens, num_v_heads, C), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        w: T.Tensor((num_tokens, num_v_heads, D), dtype),
        u: T.Tensor((num_tokens, num_v_heads, D), dtype),
        num_chunk_slots: T.int32,
        search_steps: T.int32,
        store_a: T.int32,
    ):
        with T.Kernel(num_chunk_slots, num_v_heads, threads=128) as (chunk, h):
            hk = h // (num_v_heads // num_qk_heads)

            K_sh = T.alloc_shared((C, D), dtype)
            beta_sh = T.alloc_shared((C,), "float32")
            g_sh = T.alloc_shared((C,), "float32")
            KKt = T.alloc_fragment((C, C), "float32")
            L_sh = T.alloc_shared((C, C), "float32")
            X_sh = T.alloc_shared((C, C), "float32")
            acc16 = T.alloc_fragment((4, 16), "float32")
            tmp16 = T.alloc_fragment((2, 16, 16), "float32")
            tmp16_sh = T.alloc_shared((2, 16, 16), "float32")
            X11_sh = T.alloc_shared((32, 32), "float32")
            X22_sh = T.alloc_shared((32, 32), "float32")
            L21_sh = T.alloc_shared((32, 32), "float32")
            tmp32 = T.alloc_fragment((32, 32), "float32")
            tmp32_sh = T.alloc_shared((32, 32), "float32")
            out32 = T.alloc_fragment((32, 32), "float32")
            V_sh = T.alloc_shared((C, D), dtype)
            Ab_sh = T.alloc_shared((C, C), dtype)
            GAb_sh = T.alloc_shared((C, C), dtype)
            WU = T.alloc_fragment((C, D), "float32")

            # --- which sequence and chunk this CTA owns -------------------------------------------
            lo = sequence_of_chunk(chunk_offsets, num_seqs, chunk, search_steps)
            start = cu_seqlens[lo] + (chunk - chunk_offsets[lo]) * C
            # rows of this chunk inside the sequence (0 for CTAs past the last chunk)
            n_rows = T.if_then_else(chunk < chunk_offsets[num_seqs], T.min(C, cu_seqlens[lo + 1] - start), 0)
            last = T.max(n_rows - 1, 0)

            # --- loads -----------------------------------------------------------------------------
            T.async_copy(k[start:start + C, hk, 0:D], K_sh)  # both tiles in flight at once
            T.async_copy(v[start:start + C, h, 0:D], V_sh)
            T.ptx_wait_group(0)
            T.sync_threads()
            if n_rows < C:
                for r, d in T.Parallel(C, D):
                    if r >= n_rows:
                        K_sh[r, d] = T.cast(0, dtype)
                        V_sh[r, d] = T.cast(0, dtype)
            for r in T.Parallel(C):
                beta_sh[r] = T.if_then_else(r < n_rows, beta[start + T.min(r, last), h], 0.0)
                g_sh[r] = T.if_then_else(r < n_rows, g[start + T.min(r, last), h], 0.0)
            T.cumsum(src=g_sh, dst=g_sh, dim=0)
            for r in T.Parallel(C):
                if r < n_rows:
                    gcum[h, start + r] = g_sh[r]

            # --- L = StrictLower(diag(beta) K K^T) -------------------------------------------------
            T.gemm(K_sh, K_sh, KKt, transpose_B=True, clear_accum=True)
            for r, s in T.Parallel(C, C):
                L_sh[r, s] = T.if_then_else(r > s, beta_sh[r] * KKt[r, s], 0.0)
                X_sh[r, s] = T.if_then_else(r == s, 1.0, 0.0)

            # --- 16x16 diagonal blocks: X_bb = (I + L_bb)^{-1}, row i = e_i - sum_{j<i} L_ij X_j ----
            for i in T.serial(1, 16):
                T.clear(acc16)
                for j in T.serial(i):
                    for b, c in T.Parallel(4, 16):
                        acc16[b, c] += L_sh[b * 16 + i, b * 16 + j] * X_sh[b * 16 + j, b * 16 + c]
                for b, c in T.Parallel(4, 16):
                    X_sh[b * 16 + i, b * 16 + c] = X_sh[b * 16 + i, b * 16 + c] - acc16[b, c]

            # --- merge 16 -> 32 in both halves p: X21 = -X22 (L21 X11) ------------------------------
            T.clear(tmp16)
            for j in T.serial(16):
                for p, r, c in T.Parallel(2, 16, 16):
                    tmp16[p, r, c] += L_sh[p * 32 + 16 + r, p * 32 + j] * X_sh[p * 32 + j, p * 32 + c]
            T.copy(tmp16, tmp16_sh)
            T.clear(tmp16)
            for j in T.serial(16):
                for p, r, c in T.Parallel(2, 16, 16):
                    tmp16[p, r, c] += X_sh[p * 32 + 16 + r, p * 32 + 16 + j] * tmp16_sh[p, j, c]
            for p, r, c in T.Parallel(2, 16, 16):
                X_sh[p * 32 + 16 + r, p * 32 + c] = -tmp16[p, r, c]

            # --- merge 32 -> 64: X21 = -X22 (L21 X11), tensor cores (TF32) --------------------------
            for r, c in T.Parallel(32, 32):
                X11_sh[r, c] = X_sh[r, c]
                X22_sh[r, c] = X_sh[32 + r, 32 + c]
                L21_sh[r, c] = L_sh[32 + r, c]
            T.gemm(L21_sh, X11_sh, tmp32, clear_accum=True)
            T.copy(tmp32, tmp32_sh)
            T.gemm(X22_sh, tmp32_sh, out32, clear_accum=True)
            for r, c in T.Parallel(32, 32):
                X_sh[32 + r, c] = -out32[r, c]

            # --- Ab = X diag(beta) (or A = X for the backward), rows that exist ---------------------
            for r, s in T.Parallel(C, C):
                Ab_sh[r, s] = T.cast(X_sh[r, s] * beta_sh[s], dtype)
                GAb_sh[r, s] = T.if_then_else(
                    r >= s, T.cast(X_sh[r, s] * beta_sh[s] * T.exp2((g_sh[r] - g_sh[s]) * LOG2E), dtype),
                    T.cast(0, dtype))
                if r < n_rows:
                    Ab[start + r, h, s] = T.cast(X_sh[r, s] * T.if_then_else(store_a != 0, 1.0, beta_sh[s]), dtype)

            # --- W = diag(gamma) Ab K  (Gamma_rs gamma_s = gamma_r),  U = (Gamma o Ab) V -------------
            T.gemm(Ab_sh, K_sh, WU, clear_accum=True)
            for r, d in T.Parallel(C, D):
                if r < n_rows:
                    w[start + r, h, d] = T.cast(WU[r, d] * T.exp2(g_sh[r] * LOG2E), dtype)
            T.gemm(GAb_sh, V_sh, WU, clear_accum=True)
            for r, d in T.Parallel(C, D):
                if r < n_rows:
                    u[start + r, h, d] = T.cast(WU[r, d], dtype)

    return wy_inverse
