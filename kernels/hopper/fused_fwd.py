"""Fused GDN forward: one CTA per (V tile, sequence, v-head) walks the chunks of its sequence.

Per 64-token chunk, with the state S [128 x block_v] kept in fp32 fragments (design doc §2):

    KS = K S,  QS = Q S,  P = Q K^T                                    (tensor cores, bf16/fp16 in, fp32 out)
    Vd = V - diag(gamma) KS                                            ("V delta")
    V' = Ab Vd                      with Ab = Gamma o (A diag(beta)) from wy_inverse (gate mask included)
    O  = scale * (diag(gamma) QS + (Lower(Gamma) o P) V')
    S  = gamma_last S + K^T diag(gamma_last / gamma) V'

Only O and the final state leave the kernel. g is natural log: the chunk-local cumsum `gcum` from
wy_inverse is multiplied by log2(e) once when it is loaded, and every decay is then exp2 of a difference
of those base-2 cumulative gates (each difference is <= 0, so no factor exceeds 1). The per-row decays
gamma and gamma_last / gamma live in per-row fragments (two rows per thread), gamma_last in a register.

Rows past the end of a sequence: K rows are zeroed after they land (they cannot touch S), gcum rows
repeat the last valid row (so gamma_last is the gate at the last token and no exp2 argument is positive),
Q/V/Ab rows hold whatever follows (the next sequence, or zeros past the tensor end: finite values) and
only reach rows of O that are not stored and rows of V' that meet zero rows of K.

Schedule (256 threads = two warpgroups, both consumers; one serial loop over chunks, two smem stages):
  | step | work                                                                  | unit            |
  | 1    | cp.async Q, K (k-head h // group), V tile, Ab, gcum of chunk c + 1     | LSU -> smem     |
  |      | into the other stage; wait for chunk c's five groups                   |                 |
  | 2    | issue KS = K S, QS = Q S, P = Q K^T; meanwhile the row decays          | WGMMA, CUDA     |
  | 3    | (KS landed) Vd = V - gamma KS -> smem (stmatrix)                       | CUDA cores      |
  | 4    | issue V' = Ab Vd; meanwhile (QS, P landed) Pm = Lower(Gamma) o P,      | WGMMA, CUDA     |
  |      | gamma QS, gamma_last S; (V' landed) V', (gamma_last / gamma) V' -> smem |                 |
  | 5    | issue S += K^T (gamma_last / gamma) V' and O = gamma QS + Pm V';       | WGMMA           |
  |      | (S landed) S -> smem (bf16); (O landed) scale O -> smem -> 16-byte     | LSU             |
  |      | row stores                                                             |                 |
The products are asynchronous WGMMA (`T.wgmma_gemm`, waited for with `T.wait_wgmma`, oldest first), so
what is off the walk's serial chain (K S -> V' -> S) runs beside it: H200, 2026-12-01, whole forward
2.34 -> 2.17 ms at (16, 32) x 32K x 1 sequence (block_v 32), 0.61 -> 0.56 at (4, 8) x 32K x 4, level at
block_v 64 and 128 (docs/benchmarks.md, eleventh session). The gate mask of Ab moved to wy_inverse, the
row decays computed once per row instead of per element (192 exp2 per thread and chunk in the
generated code, now 21) and the tiles leaving through stmatrix / 16-byte stores: with the same changes in
the walks, the public op's forward 1.15-1.35x faster on issue #3's configs (2.33 -> 1.94 ms at (16, 64) x
8K x 4, 0.425 -> 0.315 at (2, 8) x 4K x 8; docs/kernels.md and docs/benchmarks.md, twelfth session).
A warp-specialised producer/consumer version (TMA + mbarriers) is future work.
"""
import tilelang
import tilelang.language as T

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_fused_fwd(dtype: str, block_v: int, threads: int = 256):
    """Build the prim_func for q/k/v dtype `dtype` and V tile width `block_v`; all sizes are dynamic.

    `scale` and the two flags are runtime arguments, so new values never recompile. States are passed
    flattened to [N * Hv, 128, 128]; a [1, 128, 128] dummy stands in when a flag is 0.
    """
    if HEAD_DIM % block_v:
        raise ValueError(f"block_v must divide {HEAD_DIM}, got {block_v}")
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")
    num_ht = T.dynamic("num_ht")
    C, D, BV = CHUNK, HEAD_DIM, block_v

    @T.macro
    def load_chunk(q, k, v, Ab, gcum, t0, hk, h, v0, Q_s, K_s, V_s, Ab_s, graw_s):
        """Step 1: cp.async the chunk starting at token t0 into one stage (five commit groups)."""
        T.async_copy(q[t0:t0 + C, hk, 0:D], Q_s)
        T.async_copy(k[t0:t0 + C, hk, 0:D], K_s)
        T.async_copy(v[t0:t0 + C, h, v0:v0 + BV], V_s)
        T.async_copy(Ab[t0:t0 + C, h, 0:C], Ab_s)
        T.async_copy(gcum[h, t0:t0 + C], graw_s)

    @T.macro
    def chunk_step(o, t0, n_rows, h, v0, scale, Q_s, K_s, V_s, Ab_s, graw_s, gc_sh, S_sh, P_sh,
                   Vd_sh, Vn_sh, Vs_sh, O_sh, S, KS, O, P, Vn, gam, tail, decay):
        """Steps 2-6 on one stage whose loads have landed."""
        # rows past the sequence end: zero keys, gates repeat the last valid row (base 2)
        if n_rows < C:
            for r, d in T.Parallel(C, D):
                if r >= n_rows:
                    K_s[r, d] = T.cast(0, dtype)
        for r in T.Parallel(C):
            gc_sh[r] = graw_s[T.min(r, n_rows - 1)] * LOG2E

        # 2. the products with the incoming state and the scores, issued together (asynchronous WGMMA);
        # KS is on the walk's critical path and is waited for first, QS and P later. The per-row decays
        # gamma, gamma_last / gamma and gamma_last are formed once while they run
        T.wgmma_gemm(K_s, S_sh, KS, clear_accum=True)
        T.wgmma_gemm(Q_s, S_sh, O, clear_accum=True)
        T.wgmma_gemm(Q_s, K_s, P, transpose_B=True, clear_accum=True)
        for r in T.Parallel(C):
            gam[r] = T.exp2(gc_sh[r])
            tail[r] = T.exp2(gc_sh[C - 1] - gc_sh[r])
        decay = T.exp2(gc_sh[C - 1])
        T.wait_wgmma(2)
        T.warpgroup_fence_operand(KS, num_regs=C * BV // threads)
        for r, j in T.Parallel(C, BV):
            KS[r, j] = V_s[r, j] - gam[r] * KS[r, j]
        T.copy(KS, Vd_sh)
        T.sync_threads()

        # 4. V' = Ab Vd (Ab carries its gate mask from wy_inverse); meanwhile the score mask, gamma on QS,
        # gamma_last on S
        T.wgmma_gemm(Ab_s, Vd_sh, Vn, clear_accum=True)
        T.wait_wgmma(1)
        T.warpgroup_fence_operand(O, num_regs=C * BV // threads)
        T.warpgroup_fence_operand(P, num_regs=C * C // threads)
        for r, s in T.Parallel(C, C):
            P[r, s] = T.if_then_else(r >= s, P[r, s] * T.exp2(gc_sh[r] - gc_sh[s]), 0.0)
        T.copy(P, P_sh)
        for r, j in T.Parallel(C, BV):
            O[r, j] = O[r, j] * gam[r]
        for i, j in T.Parallel(D, BV):
            S[i, j] = S[i, j] * decay
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(Vn, num_regs=C * BV // threads)
        T.copy(Vn, Vn_sh)
        for r, j in T.Parallel(C, BV):
            Vn[r, j] = Vn[r, j] * tail[r]
        T.copy(Vn, Vs_sh)
        T.sync_threads()

        # 5-6. the state update (critical path) and O = scale (gamma QS + Pm V'), issued together; O leaves
        # through its own shared tile, 16 bytes per thread and store
        T.wgmma_gemm(K_s, Vs_sh, S, transpose_A=True)
        T.wgmma_gemm(P_sh, Vn_sh, O)
        T.wait_wgmma(1)
        T.warpgroup_fence_operand(S, num_regs=D * BV // threads)
        T.copy(S, S_sh)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(O, num_regs=C * BV // threads)
        for r, j in T.Parallel(C, BV):
            O[r, j] = O[r, j] * scale
        T.copy(O, O_sh)
        T.sync_threads()
        for r, j in T.Parallel(C, BV):
            if r < n_rows:
                o[t0 + r, h, v0 + j] = O_sh[r, j]

    @T.prim_func
    def fused_fwd(
        q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        v: T.Tensor((num_tokens, num_v_heads, D), dtype),
        Ab: T.Tensor((num_tokens, num_v_heads, C), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        h0: T.Tensor((num_h0, D, D), "float32"),
        o: T.Tensor((num_tokens, num_v_heads, D), dtype),
        ht: T.Tensor((num_ht, D, D), "float32"),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
    ):
        with T.Kernel(D // BV, num_seqs, num_v_heads, threads=threads) as (bv, n, h):
            hk = T.alloc_var("int32")
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = h // (num_v_heads // num_qk_heads)
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            v0 = bv * BV
            state_row = n * num_v_heads + h
            num_chunks = T.ceildiv(eos - bos, C)

            # two stages of chunk inputs: chunk c + 1 lands in one while chunk c computes from the other
            Q0, Q1 = T.alloc_shared((C, D), dtype), T.alloc_shared((C, D), dtype)
            K0, K1 = T.alloc_shared((C, D), dtype), T.alloc_shared((C, D), dtype)
            V0, V1 = T.alloc_shared((C, BV), dtype), T.alloc_shared((C, BV), dtype)
            Ab0, Ab1 = T.alloc_shared((C, C), dtype), T.alloc_shared((C, C), dtype)
            graw0, graw1 = T.alloc_shared((C,), "float32"), T.alloc_shared((C,), "float32")
            gc_sh = T.alloc_shared((C,), "float32")
            S_sh = T.alloc_shared((D, BV), dtype)
            P_sh = T.alloc_shared((C, C), dtype)
            Vd_sh = T.alloc_shared((C, BV), dtype)
            Vn_sh = T.alloc_shared((C, BV), dtype)
            Vs_sh = T.alloc_shared((C, BV), dtype)
            O_sh = T.alloc_shared((C, BV), dtype)

            S = T.alloc_fragment((D, BV), "float32")
            KS = T.alloc_fragment((C, BV), "float32")
            O = T.alloc_fragment((C, BV), "float32")
            P = T.alloc_fragment((C, C), "float32")
            Vn = T.alloc_fragment((C, BV), "float32")
            gam = T.alloc_fragment((C,), "float32")
            tail = T.alloc_fragment((C,), "float32")
            decay = T.alloc_var("float32")

            if use_h0 != 0:
                T.copy(h0[state_row, 0:D, v0:v0 + BV], S)
            else:
                T.clear(S)
            T.copy(S, S_sh)
            load_chunk(q, k, v, Ab, gcum, bos, hk, h, v0, Q0, K0, V0, Ab0, graw0)

            for c in T.serial(num_chunks):
                t0 = bos + c * C
                n_rows = T.min(C, eos - t0)
                if c % 2 == 0:
                    if c + 1 < num_chunks:
                        load_chunk(q, k, v, Ab, gcum, t0 + C, hk, h, v0, Q1, K1, V1, Ab1, graw1)
                        T.ptx_wait_group(5)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    chunk_step(o, t0, n_rows, h, v0, scale, Q0, K0, V0, Ab0, graw0, gc_sh, S_sh, P_sh,
                               Vd_sh, Vn_sh, Vs_sh, O_sh, S, KS, O, P, Vn, gam, tail, decay)
                else:
                    if c + 1 < num_chunks:
                        load_chunk(q, k, v, Ab, gcum, t0 + C, hk, h, v0, Q0, K0, V0, Ab0, graw0)
                        T.ptx_wait_group(5)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    chunk_step(o, t0, n_rows, h, v0, scale, Q1, K1, V1, Ab1, graw1, gc_sh, S_sh, P_sh,
                               Vd_sh, Vn_sh, Vs_sh, O_sh, S, KS, O, P, Vn, gam, tail, decay)
                T.sync_threads()  # the stage just used is refilled by the next iteration's loads

            if store_ht != 0:
                T.copy(S, ht[state_row, 0:D, v0:v0 + BV])

    return fused_fwd
