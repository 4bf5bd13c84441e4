"""Chunk-local gradients of GDN (docs/algorithm.md, "Chunked backward"), every chunk at once.

The TileLang form of `flashqla.ops.reference.chunk_backward`, step for step and with its names, for one
chunk and one v-head per CTA. Given the state entering the chunk (S, from `chunk_states`) and the gradient
of the state leaving it (dS, from `chunk_dstates`), with dOs = scale dO:

    Vd      = V - diag(gamma) K S                  V_new = (Gamma o A) diag(beta) Vd
    P       = Gamma o Q K^T                        dV_new = P^T dOs + diag(gamma_last/gamma) K dS
    dX      = (Gamma o A)^T dV_new                 dVd = diag(beta) dX              (= dv)
    dP      = dOs V_new^T                          dq = diag(gamma) dOs S^T + (dP o Gamma) K
    dk      = (dP o Gamma)^T Q + diag(gamma_last/gamma) V_new dS^T + (G + G^T) K - diag(gamma) dVd S^T
    dA      = (dV_new (diag(beta) Vd)^T) o Gamma   dL = StrictLower(-A^T dA A^T),  G = diag(beta) dL
    dbeta   = rowsum(dX o Vd) + rowsum(dL o K K^T)
    dgc     = rowsum(dOs o diag(gamma) Q S) + rowsum(E_P) - colsum(E_P) + rowsum(E_A) - colsum(E_A)
              - F - gamma o rowsum(K o dVd S^T),  dgc_last += sum(F)
              with E_P = dP o P, E_A = dGamma_A o (Gamma o A), F = (gamma_last/gamma) o rowsum(K o V_new dS^T)

    dgc_last += gamma_last <S, dS>,   dg = reverse cumsum of dgc within the chunk (gc = cumsum g)

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
gamma rows, E_P), where `scale` is applied, so no scaled copy of dO is made.

256 threads; operands of the tensor-core products in the input dtype from shared memory, accumulators and
the elementwise algebra in fp32. Column sums run as a serial loop over rows of a shared fp32 tile.

Laid out for TileLang's layout inference, whose free-mode search is quadratic in the tile operators that
share fragments (docs/kernels.md, "Fifteenth session"): every stage has its own fragments, and what crosses
stages per row (gamma, gamma_last / gamma, each stage's share of dgc and dbeta) lives in small shared
arrays, summed at the end. Only Gamma, P and Vd stay fragments across stages. The compile of this kernel
went from 229 s (207 s of it in layout inference, all ~75 operators in one component) to ~40 s.
"""
import tilelang.language as T

from .chunk_map import chunk_of_slot

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_chunk_bwd_local(dtype: str):
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    C, D = CHUNK, HEAD_DIM

    @T.macro
    def row_minus_column_sums(E, E_sh, rows, col, part, slot):
        """part[slot] = rowsum(E) - colsum(E); the column sums run serially over rows of E's shared copy."""
        T.copy(E, E_sh)
        T.reduce_sum(E, rows, dim=1)
        for r in T.Parallel(C):
            part[slot, r] = rows[r]
        for s in T.Parallel(C):
            col[s] = 0.0
        for r in T.serial(C):
            for s in T.Parallel(C):
                col[s] = col[s] + E_sh[r, s]
        for s in T.Parallel(C):
            part[slot, s] = part[slot, s] - col[s]

    @T.macro
    def store_rows(tile, out, t0, hv, n_rows):
        """out[t0 + r, hv, :] = tile[r, :] for the rows that exist, from shared memory: 16 bytes per thread
        and store (writing from the accumulator fragments took 4-byte stores, each with its own bounds
        check and 64-bit address arithmetic: 14% of the kernel's instructions)."""
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
        with T.Kernel(num_chunk_slots, num_v_heads, threads=256) as (chunk, hv):
            hk = hv // (num_v_heads // num_qk_heads)
            Q_s = T.alloc_shared((C, D), dtype)
            K_s = T.alloc_shared((C, D), dtype)
            dO_s = T.alloc_shared((C, D), dtype)  # dO, then dq and dk on their way out
            S_s = T.alloc_shared((D, D), dtype)
            dS_s = T.alloc_shared((D, D), dtype)
            CD1_s = T.alloc_shared((C, D), dtype)  # V, then diag(beta) Vd
            CD2_s = T.alloc_shared((C, D), dtype)  # V_new, then dVd (after the last use of V_new)
            dVn_s = T.alloc_shared((C, D), dtype)
            GA_s = T.alloc_shared((C, C), dtype)  # Gamma o A
            CC1_s = T.alloc_shared((C, C), dtype)  # P, then dP o Gamma, then Lower(dGamma_A)
            CC2_s = T.alloc_shared((C, C), dtype)  # GA^T Lower(dGamma_A), then G
            E_sh = T.alloc_shared((C, C), "float32")  # E_P, then E_A (column sums)
            gc_sh = T.alloc_shared((C,), "float32")
            beta_sh = T.alloc_shared((C,), "float32")
            gam_sh = T.alloc_shared((C,), "float32")  # gamma of each row
            tail_sh = T.alloc_shared((C,), "float32")  # gamma_last / gamma of each row
            F_sh = T.alloc_shared((C,), "float32")
            dg_sh = T.alloc_shared((C,), "float32")
            # the stages' shares of dgc: E_P, (gamma Q S) o dOs, E_A, K o dVd S^T; then gamma_last <S, dS> by
            # row (it joins F in the last row); of dbeta: dX o Vd, dL o K K^T
            dgc_part = T.alloc_shared((5, C), "float32")
            dbeta_part = T.alloc_shared((2, C), "float32")

            # fragments that cross stages
            Vd = T.alloc_fragment((C, D), "float32")
            Gam = T.alloc_fragment((C, C), "float32")  # the decay mask Gamma, formed once for its four uses
            P = T.alloc_fragment((C, C), "float32")
            # each stage's own
            KS = T.alloc_fragment((C, D), "float32")
            Vn = T.alloc_fragment((C, D), "float32")
            KdS = T.alloc_fragment((C, D), "float32")
            QS = T.alloc_fragment((C, D), "float32")
            VndS = T.alloc_fragment((C, D), "float32")
            dX = T.alloc_fragment((C, D), "float32")
            dVdS = T.alloc_fragment((C, D), "float32")
            SdS = T.alloc_fragment((C, D), "float32")
            dVn = T.alloc_fragment((C, D), "float32")
            acc_q = T.alloc_fragment((C, D), "float32")
            acc_k = T.alloc_fragment((C, D), "float32")
            dP = T.alloc_fragment((C, C), "float32")
            dGA = T.alloc_fragment((C, C), "float32")
            dL = T.alloc_fragment((C, C), "float32")
            KK = T.alloc_fragment((C, C), "float32")
            E_P = T.alloc_fragment((C, C), "float32")
            E_A = T.alloc_fragment((C, C), "float32")
            rows_P = T.alloc_fragment((C,), "float32")
            rows_QS = T.alloc_fragment((C,), "float32")
            rows_F = T.alloc_fragment((C,), "float32")
            rows_dX = T.alloc_fragment((C,), "float32")
            rows_A = T.alloc_fragment((C,), "float32")
            rows_L = T.alloc_fragment((C,), "float32")
            rows_dVd = T.alloc_fragment((C,), "float32")
            rows_SdS = T.alloc_fragment((C,), "float32")
            col_P = T.alloc_shared((C,), "float32")
            col_A = T.alloc_shared((C,), "float32")
            Fsum = T.alloc_var("float32")

            seq, t0, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)

            if n_rows > 0:
                # all seven tiles in flight at once (cp.async, bounds-checked, one commit group each), in the
                # order of first use: the work on K, S, V and GA starts once those four have landed, while Q,
                # dS and dO are still on their way
                T.async_copy(k[t0:t0 + C, hk, 0:D], K_s)
                T.async_copy(h[chunk, hv, 0:D, 0:D], S_s)
                T.async_copy(v[t0:t0 + C, hv, 0:D], CD1_s)
                T.async_copy(GA[t0:t0 + C, hv, 0:C], GA_s)
                T.async_copy(q[t0:t0 + C, hk, 0:D], Q_s)
                T.async_copy(dh[chunk, hv, 0:D, 0:D], dS_s)
                T.async_copy(do[t0:t0 + C, hv, 0:D], dO_s)
                if n_rows < C:
                    T.ptx_wait_group(0)  # a sequence's last chunk: everything, for the zero padding below
                else:
                    T.ptx_wait_group(3)
                T.sync_threads()
                if n_rows < C:  # rows past the sequence end: the reference grid's zero padding
                    for r, j in T.Parallel(C, D):
                        if r >= n_rows:
                            Q_s[r, j] = T.cast(0, dtype)
                            K_s[r, j] = T.cast(0, dtype)
                            dO_s[r, j] = T.cast(0, dtype)
                            CD1_s[r, j] = T.cast(0, dtype)
                    for r, s in T.Parallel(C, C):
                        if r >= n_rows:
                            GA_s[r, s] = T.cast(0, dtype)
                for r in T.Parallel(C):
                    gc_sh[r] = gcum[hv, t0 + T.min(r, last)] * LOG2E
                    beta_sh[r] = T.if_then_else(r < n_rows, beta[t0 + T.min(r, last), hv], 0.0)
                for r in T.Parallel(C):  # the row decays, once per row
                    gam_sh[r] = T.exp2(gc_sh[r])
                    tail_sh[r] = T.exp2(gc_sh[C - 1] - gc_sh[r])

                # Vd = V - diag(gamma) K S;  CD1 <- diag(beta) Vd;  the mask Gamma
                T.gemm(K_s, S_s, KS, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    Vd[r, j] = CD1_s[r, j] - gam_sh[r] * KS[r, j]
                for r, j in T.Parallel(C, D):
                    CD1_s[r, j] = beta_sh[r] * Vd[r, j]
                for r, s in T.Parallel(C, C):
                    Gam[r, s] = T.if_then_else(r >= s, T.exp2(gc_sh[r] - gc_sh[s]), 0.0)

                # V_new = (Gamma o A) diag(beta) Vd -> CD2
                T.gemm(GA_s, CD1_s, Vn, clear_accum=True)
                T.copy(Vn, CD2_s)

                # P = Gamma o Q K^T (fp32 in P); CC1 <- scale P, so that CC1^T dO = P^T dOs
                T.ptx_wait_group(2)  # Q
                T.sync_threads()
                T.gemm(Q_s, K_s, P, transpose_B=True, clear_accum=True)
                for r, s in T.Parallel(C, C):
                    P[r, s] = P[r, s] * Gam[r, s]
                for r, s in T.Parallel(C, C):
                    CC1_s[r, s] = P[r, s] * scale

                # dV_new = P^T dOs + diag(gamma_last / gamma) K dS
                T.ptx_wait_group(0)  # dS, dO
                T.sync_threads()
                T.gemm(K_s, dS_s, KdS, clear_accum=True)
                T.gemm(CC1_s, dO_s, dVn, transpose_A=True, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    dVn[r, j] = dVn[r, j] + tail_sh[r] * KdS[r, j]
                T.copy(dVn, dVn_s)

                # dP = dOs V_new^T = scale dO V_new^T; E_P = dP o P; CC1 <- dP o Gamma
                T.gemm(dO_s, CD2_s, dP, transpose_B=True, clear_accum=True)
                for r, s in T.Parallel(C, C):
                    dP[r, s] = dP[r, s] * scale
                for r, s in T.Parallel(C, C):
                    E_P[r, s] = dP[r, s] * P[r, s]
                for r, s in T.Parallel(C, C):
                    CC1_s[r, s] = dP[r, s] * Gam[r, s]
                row_minus_column_sums(E_P, E_sh, rows_P, col_P, dgc_part, 0)

                # dgc += rowsum(dOs o diag(gamma) Q S)
                T.gemm(Q_s, S_s, QS, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    QS[r, j] = (gam_sh[r] * scale) * QS[r, j] * dO_s[r, j]
                T.reduce_sum(QS, rows_QS, dim=1)
                for r in T.Parallel(C):
                    dgc_part[1, r] = rows_QS[r]

                # dq = diag(gamma) dOs S^T + (dP o Gamma) K; dO is done after these: dq leaves through its tile
                T.gemm(dO_s, S_s, acc_q, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    acc_q[r, j] = acc_q[r, j] * (gam_sh[r] * scale)
                T.gemm(CC1_s, K_s, acc_q)
                T.copy(acc_q, dO_s)
                store_rows(dO_s, dq, t0, hv, n_rows)

                # dk = (dP o Gamma)^T Q + diag(gamma_last / gamma) V_new dS^T;  F = that scale o rowsum(K o V_new dS^T)
                T.gemm(CC1_s, Q_s, acc_k, transpose_A=True, clear_accum=True)
                T.gemm(CD2_s, dS_s, VndS, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    acc_k[r, j] = acc_k[r, j] + tail_sh[r] * VndS[r, j]
                for r, j in T.Parallel(C, D):
                    VndS[r, j] = K_s[r, j] * VndS[r, j]
                T.reduce_sum(VndS, rows_F, dim=1)
                for r in T.Parallel(C):
                    F_sh[r] = tail_sh[r] * rows_F[r]

                # dX = (Gamma o A)^T dV_new; dv = dVd = diag(beta) dX -> CD2 (V_new is done);
                # dbeta = rowsum(dX o Vd)
                T.gemm(GA_s, dVn_s, dX, transpose_A=True, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    CD2_s[r, j] = beta_sh[r] * dX[r, j]
                store_rows(CD2_s, dv, t0, hv, n_rows)
                for r, j in T.Parallel(C, D):
                    dX[r, j] = dX[r, j] * Vd[r, j]
                T.reduce_sum(dX, rows_dX, dim=1)
                for r in T.Parallel(C):
                    dbeta_part[0, r] = rows_dX[r]

                # dGamma_A = dV_new (diag(beta) Vd)^T; E_A = dGamma_A o (Gamma o A); CC1 <- Lower(dGamma_A)
                T.gemm(dVn_s, CD1_s, dGA, transpose_B=True, clear_accum=True)
                for r, s in T.Parallel(C, C):
                    E_A[r, s] = dGA[r, s] * GA_s[r, s]
                for r, s in T.Parallel(C, C):
                    CC1_s[r, s] = T.if_then_else(r >= s, dGA[r, s], 0.0)
                row_minus_column_sums(E_A, E_sh, rows_A, col_A, dgc_part, 2)

                # dL = StrictLower(-A^T dA A^T) with dA = dGamma_A o Gamma, from GA alone: with D = diag(gamma),
                # A = D^-1 GA D and dA = D Lower(dGamma_A) D^-1, so A^T dA A^T = D (GA^T Lower(dGamma_A) GA^T) D^-1,
                # whose strictly lower entries are Gamma_rs (GA^T Lower(dGamma_A) GA^T)_rs (every factor <= 1);
                # dbeta += rowsum(dL o K K^T); CC2 <- G = diag(beta) dL
                T.gemm(GA_s, CC1_s, dL, transpose_A=True, clear_accum=True)
                T.copy(dL, CC2_s)
                T.gemm(CC2_s, GA_s, dL, transpose_B=True, clear_accum=True)
                T.gemm(K_s, K_s, KK, transpose_B=True, clear_accum=True)
                for r, s in T.Parallel(C, C):
                    dL[r, s] = T.if_then_else(r > s, -dL[r, s] * Gam[r, s], 0.0)
                for r, s in T.Parallel(C, C):
                    KK[r, s] = dL[r, s] * KK[r, s]
                T.reduce_sum(KK, rows_L, dim=1)
                for r in T.Parallel(C):
                    dbeta_part[1, r] = rows_L[r]
                for r, s in T.Parallel(C, C):
                    CC2_s[r, s] = beta_sh[r] * dL[r, s]

                # dk += (G + G^T) K
                T.gemm(CC2_s, K_s, acc_k)
                T.gemm(CC2_s, K_s, acc_k, transpose_A=True)

                # dVd S^T: dk -= diag(gamma) dVd S^T; dgc -= gamma o rowsum(K o dVd S^T)
                T.gemm(CD2_s, S_s, dVdS, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, D):
                    acc_k[r, j] = acc_k[r, j] - gam_sh[r] * dVdS[r, j]
                for r, j in T.Parallel(C, D):
                    dVdS[r, j] = K_s[r, j] * dVdS[r, j]
                T.reduce_sum(dVdS, rows_dVd, dim=1)
                for r in T.Parallel(C):
                    dgc_part[3, r] = -gam_sh[r] * rows_dVd[r]
                T.copy(acc_k, dO_s)  # dk leaves through dO's tile too
                store_rows(dO_s, dk, t0, hv, n_rows)

                # gamma_last <S, dS> joins F (both belong to dgc of the last row), in two row halves of S
                for half in T.serial(2):
                    for r, j in T.Parallel(C, D):
                        SdS[r, j] = S_s[half * C + r, j] * dS_s[half * C + r, j]
                    T.reduce_sum(SdS, rows_SdS, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[4, r] = T.if_then_else(half == 0, 0.0, dgc_part[4, r]) + T.exp2(gc_sh[C - 1]) * rows_SdS[r]
                Fsum = 0.0
                for r in T.serial(C):
                    Fsum = Fsum + F_sh[r] + dgc_part[4, r]
                # dg = reverse cumsum of dgc over the rows that exist; the last row's sum(F) reaches all
                for r in T.Parallel(C):
                    dg_sh[r] = T.if_then_else(r < n_rows, dgc_part[0, r] + dgc_part[1, r] + dgc_part[2, r]
                                              + dgc_part[3, r] - F_sh[r], 0.0)
                T.cumsum(src=dg_sh, dst=dg_sh, dim=0, reverse=True)
                for r in T.Parallel(C):
                    if r < n_rows:
                        dg[hv, t0 + r] = dg_sh[r] + Fsum
                        dbeta[t0 + r, hv] = dbeta_part[0, r] + dbeta_part[1, r]

    return chunk_bwd_local
