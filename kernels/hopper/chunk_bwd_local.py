"""Chunk-local gradients of GDN (docs/algorithm.md, "Chunked backward"), every chunk at once.

The TileLang form of `flashqla.ops.reference.chunk_backward`, step for step and with its names, for one
chunk and one v-head per CTA. Given the state entering the chunk (S, the backward's state recompute) and the
gradient of the state leaving it (dS, from `chunk_dstates`), with dOs = scale dO:

    Vd      = V - diag(gamma) K S                  V_new = (Gamma o A) diag(beta) Vd
    P       = Gamma o Q K^T                        dV_new = P^T dOs + diag(gamma_last/gamma) K dS
    dX      = (Gamma o A)^T dV_new                 dVd = diag(beta) dX              (= dv)
    dP      = dOs V_new^T                          dq = diag(gamma) dOs S^T + (dP o Gamma) K
    dk      = (dP o Gamma)^T Q + diag(gamma_last/gamma) V_new dS^T + (G + G^T) K - diag(gamma) dVd S^T
    dA      = (dV_new (diag(beta) Vd)^T) o Gamma   dL = StrictLower(-A^T dA A^T),  G = diag(beta) dL
    dbeta   = rowsum(dX o Vd) + rowsum(dL o K K^T)
    dgc     = rowsum(dOs o diag(gamma) Q S) + rowsum(E_P) - colsum(E_P) + rowsum(E_A) - colsum(E_A)
              - F - gamma o rowsum(K o dVd S^T),  dgc_last += sum(F) + gamma_last <S, dS>
              with E_P = dP o P, E_A = dGamma_A o (Gamma o A), F = (gamma_last/gamma) o rowsum(K o V_new dS^T)
    dg      = reverse cumsum of dgc within the chunk (gc = cumsum g)

The column sums are row sums of tiles the kernel forms anyway (docs/algorithm.md, (D1)), taken from the same
rounded tiles as the terms they cancel against ((D2): a form that mixes roundings loses dg under strong
decay): colsum(E_P) = rowsum(V_new o dV_new) - F with P the bf16 scale P that dV_new is made from,
rowsum(E_A) = rowsum(dV_new o V_new) with the other side of each product rounded, colsum(E_A) =
rowsum(dX o diag(beta) Vd) with the bf16 diag(beta) Vd of dGamma_A, so F cancels and

    dgc     = rowsum(dOs o diag(gamma) Q S) + rowsum(E_P) - rowsum(bf(V_new) o dV_new - V_new o bf(dV_new))
              - rowsum(dX o bf(diag(beta) Vd)) - gamma o rowsum(K o dVd S^T)

(no column sum, no E_A tile). H200, against the kernel with the column sums (2026-12-02): 2004 -> 1884 us at
(16, 32) x 4K x 8, 4051 -> 3802 at (16, 64) x 8K x 4, 504 -> 467 at (4, 8) x 8K x 4; dq, dk, dv, dbeta bitwise
equal, dg within 3e-4 (docs/kernels.md, "Twentieth session").

Inputs in the flat token layout of the forward: q, k [T, Hqk, 128] (v-head h reads k-head h // (Hv/Hqk)), v
and dOs [T, Hv, 128], GA = Gamma o A [T, Hv, 64] (wy_inverse's, the fused forward's operand; the forward
keeps it for this kernel, and every A term above has an exact GA form, see the dL step), gcum [Hv, T]
(natural log, converted to base 2 once, for exp2), the per-chunk states h and state gradients dh at chunk
slots (fused_fwd's state recompute, chunk_dstates). CTA (slot, v-head) finds its sequence by binary search
in `chunk_offsets` as wy_inverse does; in a partial last chunk the rows past the sequence end are zeroed
after loading (they hold the next sequence) and their gates repeat the last one, which is exactly the zero
padding of the reference's chunk grid. Outputs, rows that exist only: dq, dk, dv per v-head in the input
dtype (the caller sums dq and dk over GQA groups, accumulating in fp32), dg [Hv, T] and dbeta in fp32. dq,
dk and dv leave through shared memory (dq and dk through dO's tile once dO is read for the last time, dv
through the tile that holds it for dk's last term), 16 bytes per thread and store.

The kernel reads dO itself: every product with dO feeds an elementwise fp32 step (the Gamma mask, the
gamma rows, E_P), where `scale` is applied, so no scaled copy of dO is made. The term rowsum(dOs o diag(gamma)
Q S) is read off dq's first product: rowsum(dO o Q S) = rowsum(Q o dO S^T), so Q S is never formed.

Warp-specialised: two warpgroups, each issuing whole m64 products (asynchronous WGMMA) of its own chain, and
meeting only where one reads the other's tile (mbarriers, one phase each):

  | warpgroup  | products                                        | hands over                            |
  | values     | K S, GA Vd (V_new), K dS + P^T dOs (dV_new),    | V_new, dVd (= dv), G = diag(beta) dL; |
  |            | GA^T dV_new, dV_new Vd^T, K K^T, the two dL     | frees dO's tile after dV_new          |
  |            | products; dbeta, gamma_last <S, dS>, dv; the    |                                       |
  |            | V_new and dX shares of dgc                      |                                       |
  | gradients  | Q K^T (P, E_P), dO S^T (dq), dO V_new^T (dP),   | scale P (for dV_new)                  |
  |            | V_new dS^T, (dP o Gamma) K, (dP o Gamma)^T Q,   |                                       |
  |            | dVd S^T, G K, G^T K; dq, dk, F                  |                                       |

H200, against the previous kernel (the two warpgroups splitting every product by columns, a CTA-wide barrier
between stages; 2026-12-02): 2175 -> 2035 us at (16, 32) x 4K x 8, 2179 -> 1994 at 32K x 1, 554 -> 503 at
(4, 8) x 8K x 4, 4366 -> 4029 at (16, 64) x 8K x 4 (docs/kernels.md, "Nineteenth session").

Operands of the tensor-core products in the input dtype from shared memory, accumulators and the elementwise
algebra in fp32. Every sum is a row sum, within a warp (TileLang's cross-warp reduction syncs on named
barriers 1 and 2 in every warpgroup, so two warpgroups must not use it at once; here none does). Each
warpgroup keeps at most three [64, 128] accumulators live (the order of the products is chosen for that):
one CTA per SM by registers and shared memory.

Laid out for TileLang's layout inference, whose free-mode search is quadratic in the tile operators that
share fragments (docs/kernels.md, "Fifteenth session"): fragments belong to one warpgroup and to few
stages, and what crosses stages or warpgroups per row (gamma, gamma_last / gamma, each stage's share of dgc
and dbeta) lives in small shared arrays, summed at the end (~20 s to compile on the 2-core CPU machine).
"""
import tilelang.language as T

from .chunk_map import chunk_of_slot

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634
WARPGROUP = 128
VALUES_BARRIER, GRADS_BARRIER = 12, 13  # named barriers of one warpgroup (TileLang's own start at 3)


def build_chunk_bwd_local(dtype: str):
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    C, D, WG = CHUNK, HEAD_DIM, WARPGROUP

    def gamma_mask(gc_sh, r, s, strict):
        """Gamma_rs = gamma_r / gamma_s on and below the diagonal (strictly below with `strict`), else 0. A select,
        not a branch: both sides are evaluated (above the diagonal the exponent may be large; it is discarded)."""
        return T.Select(r > s if strict else r >= s, T.exp2(gc_sh[r] - gc_sh[s]), 0.0)

    @T.macro
    def store_rows(tile, out, t0, hv, n_rows):
        """out[t0 + r, hv, :] = tile[r, :] for the rows that exist, from shared memory (16-byte stores)."""
        for r, j in T.Parallel(C, D):
            if r < n_rows:
                out[t0 + r, hv, j] = tile[r, j]

    @T.prim_func
    def chunk_bwd_local(
        q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        v: T.Tensor((num_tokens, num_v_heads, D), dtype),
        do: T.Tensor((num_tokens, num_v_heads, D), dtype),
        GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        beta: T.Tensor((num_tokens, num_v_heads), "float32"),
        h: T.Tensor((num_chunk_slots, num_v_heads, D, D), dtype),
        dh: T.Tensor((num_chunk_slots, num_v_heads, D, D), dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        dq: T.Tensor((num_tokens, num_v_heads, D), dtype),
        dk: T.Tensor((num_tokens, num_v_heads, D), dtype),
        dv: T.Tensor((num_tokens, num_v_heads, D), dtype),
        dg: T.Tensor((num_v_heads, num_tokens), "float32"),
        dbeta: T.Tensor((num_tokens, num_v_heads), "float32"),
        scale: T.float32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_chunk_slots, num_v_heads, threads=2 * WG) as (chunk, hv):
            hk = hv // (num_v_heads // num_qk_heads)
            Q_s = T.alloc_shared((C, D), dtype)
            K_s = T.alloc_shared((C, D), dtype)
            dO_s = T.alloc_shared((C, D), dtype)  # dO; then dq and dk on their way out
            S_s = T.alloc_shared((D, D), dtype)
            dS_s = T.alloc_shared((D, D), dtype)
            V_s = T.alloc_shared((C, D), dtype)  # V, then diag(beta) Vd
            Vn_s = T.alloc_shared((C, D), dtype)  # V_new, values -> gradients
            dVn_s = T.alloc_shared((C, D), dtype)  # dV_new, then dVd (values -> gradients)
            GA_s = T.alloc_shared((C, C), dtype)  # Gamma o A
            sP_s = T.alloc_shared((C, C), dtype)  # scale P (gradients -> values), then Lower(dGamma_A) (values)
            G_s = T.alloc_shared((C, C), dtype)  # values: GA^T Lower(dGamma_A), then G (-> gradients)
            dPG_s = T.alloc_shared((C, C), dtype)  # gradients: dP o Gamma
            gc_sh = T.alloc_shared((C,), "float32")
            beta_sh = T.alloc_shared((C,), "float32")
            gam_sh = T.alloc_shared((C,), "float32")  # gamma of each row
            tail_sh = T.alloc_shared((C,), "float32")  # gamma_last / gamma of each row
            F_sh = T.alloc_shared((C,), "float32")
            dg_sh = T.alloc_shared((2 * C,), "float32")  # dgc by row, then the shares every row's dg gets
            # shares of dgc by row: rowsum E_P, (gamma Q S) o dOs, the V_new o dV_new difference, K o dVd S^T,
            # gamma_last <S, dS> (the last row's), dX o diag(beta) Vd; of dbeta: dX o Vd, dL o K K^T
            dgc_part = T.alloc_shared((6, C), "float32")
            dbeta_part = T.alloc_shared((2, C), "float32")

            # the values warpgroup's fragments
            KS = T.alloc_fragment((C, D), "float32")  # K S, then Vd, then dX o Vd
            KdS = T.alloc_fragment((C, D), "float32")  # K dS, then dV_new
            Vn = T.alloc_fragment((C, D), "float32")
            dX = T.alloc_fragment((C, D), "float32")
            dGA = T.alloc_fragment((C, C), "float32")  # dGamma_A
            dL = T.alloc_fragment((C, C), "float32")
            KK = T.alloc_fragment((C, C), "float32")
            SdS = T.alloc_fragment((C, D), "float32")
            rows_A = T.alloc_fragment((C,), "float32")
            rows_Vn = T.alloc_fragment((C,), "float32")
            rows_dX = T.alloc_fragment((C,), "float32")
            rows_L = T.alloc_fragment((C,), "float32")
            rows_SdS = T.alloc_fragment((C,), "float32")
            # the gradients warpgroup's
            PY = T.alloc_fragment((C, C), "float32")
            acc_q = T.alloc_fragment((C, D), "float32")
            VndS = T.alloc_fragment((C, D), "float32")  # Q o dO S^T first, then V_new dS^T
            dP = T.alloc_fragment((C, C), "float32")
            acc_k = T.alloc_fragment((C, D), "float32")
            dVdS = T.alloc_fragment((C, D), "float32")
            rows_P = T.alloc_fragment((C,), "float32")
            rows_QS = T.alloc_fragment((C,), "float32")
            rows_F = T.alloc_fragment((C,), "float32")
            rows_dVd = T.alloc_fragment((C,), "float32")

            sp_ready = T.alloc_barrier(arrive_count=WG)  # scale P in sP_s
            vn_ready = T.alloc_barrier(arrive_count=WG)  # V_new in Vn_s
            do_free = T.alloc_barrier(arrive_count=WG)  # the values warpgroup has read dO
            g_ready = T.alloc_barrier(arrive_count=WG)  # G in G_s
            dvd_ready = T.alloc_barrier(arrive_count=WG)  # dVd in dVn_s

            seq, t0, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)
            tx = T.get_thread_binding()

            if n_rows > 0:
                T.async_copy(k[t0:t0 + C, hk, 0:D], K_s)
                T.async_copy(h[chunk, hv, 0:D, 0:D], S_s)
                T.async_copy(v[t0:t0 + C, hv, 0:D], V_s)
                T.async_copy(GA[t0:t0 + C, hv, 0:C], GA_s)
                T.async_copy(q[t0:t0 + C, hk, 0:D], Q_s)
                T.async_copy(dh[chunk, hv, 0:D, 0:D], dS_s)
                T.async_copy(do[t0:t0 + C, hv, 0:D], dO_s)
                for r in T.Parallel(C):
                    gc_sh[r] = gcum[hv, t0 + T.min(r, last)] * LOG2E
                    beta_sh[r] = T.if_then_else(r < n_rows, beta[t0 + T.min(r, last), hv], 0.0)
                T.ptx_wait_group(0)
                T.sync_threads()
                if n_rows < C:  # rows past the sequence end: the reference grid's zero padding
                    for r, j in T.Parallel(C, D):
                        if r >= n_rows:
                            Q_s[r, j] = T.cast(0, dtype)
                            K_s[r, j] = T.cast(0, dtype)
                            dO_s[r, j] = T.cast(0, dtype)
                            V_s[r, j] = T.cast(0, dtype)
                    for r, s in T.Parallel(C, C):
                        if r >= n_rows:
                            GA_s[r, s] = T.cast(0, dtype)
                for r in T.Parallel(C):  # the row decays, once per row
                    gam_sh[r] = T.exp2(gc_sh[r])
                    tail_sh[r] = T.exp2(gc_sh[C - 1] - gc_sh[r])
                T.fence_proxy_async()
                T.sync_threads()

                if tx < WG:  # values: V_new, dV_new, dv, the dA chain to G
                    T.wgmma_gemm(K_s, S_s, KS, clear_accum=True)
                    T.wgmma_gemm(K_s, dS_s, KdS, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(KS, num_regs=C * D // WG)
                    # Vd = V - diag(gamma) K S (kept for dbeta); V_s <- diag(beta) Vd; V_new = GA diag(beta) Vd
                    for r, j in T.Parallel(C, D):
                        KS[r, j] = V_s[r, j] - gam_sh[r] * KS[r, j]
                    for r, j in T.Parallel(C, D):
                        V_s[r, j] = beta_sh[r] * KS[r, j]
                    T.fence_proxy_async()
                    T.sync_threads(VALUES_BARRIER, WG)
                    T.wgmma_gemm(GA_s, V_s, Vn, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(KdS, num_regs=C * D // WG)
                    for r, j in T.Parallel(C, D):
                        KdS[r, j] = tail_sh[r] * KdS[r, j]
                    # dV_new = P^T dOs + diag(gamma_last / gamma) K dS, with scale P from the gradients warpgroup
                    T.barrier_wait(sp_ready, 0)
                    T.wgmma_gemm(sP_s, dO_s, KdS, transpose_A=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(Vn, num_regs=C * D // WG)
                    T.copy(Vn, Vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(vn_ready)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(KdS, num_regs=C * D // WG)
                    T.barrier_arrive(do_free)
                    T.copy(KdS, dVn_s)
                    T.fence_proxy_async()
                    # rowsum(E_A) - colsum(E_P) - F = rowsum(V_new o bf(dV_new) - bf(V_new) o dV_new)   (D2)
                    for r, j in T.Parallel(C, D):
                        Vn[r, j] = (Vn[r, j] * T.cast(T.cast(KdS[r, j], dtype), "float32")
                                    - T.cast(T.cast(Vn[r, j], dtype), "float32") * KdS[r, j])
                    T.reduce_sum(Vn, rows_Vn, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[2, r] = rows_Vn[r]
                    T.sync_threads(VALUES_BARRIER, WG)

                    # dGamma_A = dV_new (diag(beta) Vd)^T, dX = GA^T dV_new and K K^T together
                    T.wgmma_gemm(dVn_s, V_s, dGA, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(GA_s, dVn_s, dX, transpose_A=True, clear_accum=True)
                    T.wgmma_gemm(K_s, K_s, KK, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(2)
                    T.warpgroup_fence_operand(dGA, num_regs=C * C // WG)
                    # sP_s <- Lower(dGamma_A) (dV_new's product has read scale P)
                    for r, s in T.Parallel(C, C):
                        sP_s[r, s] = T.if_then_else(r >= s, dGA[r, s], 0.0)
                    T.fence_proxy_async()
                    T.sync_threads(VALUES_BARRIER, WG)
                    # dL = StrictLower(-A^T dA A^T) from GA alone (docs/kernels.md, "Seventeenth session"):
                    # A^T dA A^T = D (GA^T Lower(dGamma_A) GA^T) D^-1 with D = diag(gamma)
                    T.wgmma_gemm(GA_s, sP_s, dL, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(2)  # dX
                    T.warpgroup_fence_operand(dX, num_regs=C * D // WG)
                    # dbeta = rowsum(dX o Vd); dv = dVd = diag(beta) dX -> dVn_s (both products reading it are done)
                    for r, j in T.Parallel(C, D):
                        KS[r, j] = dX[r, j] * KS[r, j]
                    T.reduce_sum(KS, rows_dX, dim=1)
                    for r in T.Parallel(C):
                        dbeta_part[0, r] = rows_dX[r]
                    T.sync_threads(VALUES_BARRIER, WG)  # every warp's part of both products has read dVn_s
                    for r, j in T.Parallel(C, D):
                        dVn_s[r, j] = beta_sh[r] * dX[r, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(dvd_ready)
                    # colsum(E_A) = rowsum(dX o diag(beta) Vd), with the bf16 diag(beta) Vd of dGamma_A (V_s)   (D2)
                    for r, j in T.Parallel(C, D):
                        dX[r, j] = dX[r, j] * V_s[r, j]
                    T.reduce_sum(dX, rows_A, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[5, r] = rows_A[r]
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(KK, num_regs=C * C // WG)
                    T.warpgroup_fence_operand(dL, num_regs=C * C // WG)
                    T.copy(dL, G_s)
                    T.fence_proxy_async()
                    T.sync_threads(VALUES_BARRIER, WG)
                    T.wgmma_gemm(G_s, GA_s, dL, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dL, num_regs=C * C // WG)
                    # dL = StrictLower(-Gamma o that); G = diag(beta) dL -> G_s; dbeta += rowsum(dL o K K^T)
                    for r, s in T.Parallel(C, C):
                        dL[r, s] = -dL[r, s] * gamma_mask(gc_sh, r, s, True)
                    T.sync_threads(VALUES_BARRIER, WG)  # every warp's part of the product has read G_s
                    for r, s in T.Parallel(C, C):
                        G_s[r, s] = beta_sh[r] * dL[r, s]
                    T.fence_proxy_async()
                    T.barrier_arrive(g_ready)
                    for r, s in T.Parallel(C, C):
                        KK[r, s] = dL[r, s] * KK[r, s]
                    T.reduce_sum(KK, rows_L, dim=1)
                    for r in T.Parallel(C):
                        dbeta_part[1, r] = rows_L[r]
                    # gamma_last <S, dS> by row of S (it joins dgc of the last row), in two row halves
                    for half in T.serial(2):
                        for r, j in T.Parallel(C, D):
                            SdS[r, j] = S_s[half * C + r, j] * dS_s[half * C + r, j]
                        T.reduce_sum(SdS, rows_SdS, dim=1)
                        for r in T.Parallel(C):
                            dgc_part[4, r] = (T.if_then_else(half == 0, 0.0, dgc_part[4, r])
                                              + T.exp2(gc_sh[C - 1]) * rows_SdS[r])
                    store_rows(dVn_s, dv, t0, hv, n_rows)
                else:  # gradients: P and E_P, dP, dq, dk
                    T.wgmma_gemm(Q_s, K_s, PY, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(dO_s, S_s, acc_q, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(PY, num_regs=C * C // WG)
                    # scale P = scale Gamma o Q K^T -> sP_s for the values warpgroup's dV_new; PY keeps it rounded
                    # as sP_s holds it (E_P's row sum stands in for colsum(E_P) through dV_new, (D2))
                    for r, s in T.Parallel(C, C):
                        PY[r, s] = T.cast(PY[r, s] * gamma_mask(gc_sh, r, s, False) * scale, dtype)
                    for r, s in T.Parallel(C, C):
                        sP_s[r, s] = PY[r, s]
                    T.fence_proxy_async()
                    T.barrier_arrive(sp_ready)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_q, num_regs=C * D // WG)
                    # dgc += rowsum(dOs o diag(gamma) Q S) = gamma scale rowsum(Q o dO S^T)
                    for r, j in T.Parallel(C, D):
                        VndS[r, j] = Q_s[r, j] * acc_q[r, j]
                    T.reduce_sum(VndS, rows_QS, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[1, r] = gam_sh[r] * scale * rows_QS[r]
                    for r, j in T.Parallel(C, D):
                        acc_q[r, j] = acc_q[r, j] * (gam_sh[r] * scale)
                    # dP = dOs V_new^T and V_new dS^T, once V_new is there
                    T.barrier_wait(vn_ready, 0)
                    T.wgmma_gemm(dO_s, Vn_s, dP, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(Vn_s, dS_s, VndS, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(dP, num_regs=C * C // WG)
                    # dPG_s <- dP o Gamma; dq = diag(gamma) dOs S^T + (dP o Gamma) K while rowsum(E_P) = rowsum(dO V_new^T
                    # o scale P) is taken; then dk = (dP o Gamma)^T Q + ... (issued once P and dP are done with)
                    for r, s in T.Parallel(C, C):
                        dP[r, s] = dP[r, s] * scale
                    for r, s in T.Parallel(C, C):
                        dPG_s[r, s] = dP[r, s] * gamma_mask(gc_sh, r, s, False)
                    T.fence_proxy_async()
                    T.sync_threads(GRADS_BARRIER, WG)
                    T.wgmma_gemm(dPG_s, K_s, acc_q)
                    for r, s in T.Parallel(C, C):
                        dP[r, s] = dP[r, s] * PY[r, s]
                    T.reduce_sum(dP, rows_P, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[0, r] = rows_P[r] / scale
                    T.wgmma_gemm(dPG_s, Q_s, acc_k, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(VndS, num_regs=C * D // WG)
                    T.warpgroup_fence_operand(acc_q, num_regs=C * D // WG)
                    T.barrier_wait(do_free, 0)  # dq leaves through dO's tile
                    T.copy(acc_q, dO_s)
                    T.sync_threads(GRADS_BARRIER, WG)
                    store_rows(dO_s, dq, t0, hv, n_rows)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_k, num_regs=C * D // WG)
                    # dk += diag(gamma_last / gamma) V_new dS^T;  F = that scale o rowsum(K o V_new dS^T) (its sum
                    # joins the last row's dgc)
                    for r, j in T.Parallel(C, D):
                        acc_k[r, j] = acc_k[r, j] + tail_sh[r] * VndS[r, j]
                    for r, j in T.Parallel(C, D):
                        VndS[r, j] = K_s[r, j] * VndS[r, j]
                    T.reduce_sum(VndS, rows_F, dim=1)
                    for r in T.Parallel(C):
                        F_sh[r] = tail_sh[r] * rows_F[r]
                    # dk -= diag(gamma) dVd S^T, dgc -= gamma o rowsum(K o dVd S^T), as soon as dVd is there
                    T.barrier_wait(dvd_ready, 0)
                    T.wgmma_gemm(dVn_s, S_s, dVdS, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dVdS, num_regs=C * D // WG)
                    for r, j in T.Parallel(C, D):
                        acc_k[r, j] = acc_k[r, j] - gam_sh[r] * dVdS[r, j]
                    for r, j in T.Parallel(C, D):
                        dVdS[r, j] = K_s[r, j] * dVdS[r, j]
                    T.reduce_sum(dVdS, rows_dVd, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[3, r] = -gam_sh[r] * rows_dVd[r]
                    # dk += (G + G^T) K, the end of the values warpgroup's chain
                    T.barrier_wait(g_ready, 0)
                    T.wgmma_gemm(G_s, K_s, acc_k)
                    T.wgmma_gemm(G_s, K_s, acc_k, transpose_A=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_k, num_regs=C * D // WG)
                    T.sync_threads(GRADS_BARRIER, WG)  # dq's stores have read dO_s
                    T.copy(acc_k, dO_s)  # dk leaves through dO's tile too
                    T.sync_threads(GRADS_BARRIER, WG)
                    store_rows(dO_s, dk, t0, hv, n_rows)

                T.sync_threads()
                # dg = reverse cumsum of dgc over the rows that exist, plus the last row's sum(F) and gamma_last
                # <S, dS>, which reach every row: one reverse scan over [dgc, F + those shares], whose first C
                # entries are exactly that (no serial sum)
                for r in T.Parallel(C):
                    dg_sh[r] = T.if_then_else(r < n_rows, dgc_part[0, r] + dgc_part[1, r] + dgc_part[2, r]
                                              + dgc_part[3, r] - dgc_part[5, r], 0.0)
                    dg_sh[C + r] = F_sh[r] + dgc_part[4, r]
                T.cumsum(src=dg_sh, dst=dg_sh, dim=0, reverse=True)
                for r in T.Parallel(C):
                    if r < n_rows:
                        dg[hv, t0 + r] = dg_sh[r]
                        dbeta[t0 + r, hv] = dbeta_part[0, r] + dbeta_part[1, r]

    return chunk_bwd_local
