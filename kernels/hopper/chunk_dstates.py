"""Reverse state-gradient walk: the only serial part of the GDN backward (docs/algorithm.md B1-B3).

With W = diag(gamma) A diag(beta) K (so (gamma K)^T dVd = W^T dV') and dOs = scale dO, one chunk in
reverse is

    dV' = (Gamma o Q K^T)^T dOs + diag(gamma_last / gamma) K dS
    dS  = gamma_last dS + (diag(gamma) Q)^T dOs - W^T dV'

W is never formed: with W = GA diag(beta gamma) K (Gamma_rs gamma_s = gamma_r), W^T dV' = K^T diag(beta gamma)
(GA^T dV'), two products on the chain from the forward's GA, beta and the gates (no W tensor, T x Hv x 256
bytes, and no kernel to form it).

One CTA per (V tile, sequence, v-head) walks its chunks from the last to the first, writing per chunk the
gradient of the state leaving it (`dh`, input dtype, at the chunk's slot chunk_offsets[n] + c; not with
`store_dh` = 0: intra-card CP's walks from zero and inter-card CP's D_p want dS0 alone) and at the end dS0,
the gradient of the initial state. With `use_last` the walk of (n, h) starts from zero at chunk
last_chunks[h, n] of its sequence instead of its last chunk (-1: no chunk, dS0 = 0): intra-card CP's
warmed-up walks from zero (flashqla/cp/segments.py, D_j of the heads whose gates bound the later chunks' reach).

Warp-specialised like fused_fwd.py, split by columns: every column of dS and dV' depends on the same column
of dO only, so two chain warpgroups each own half of the V tile's columns and never exchange anything.

  | warpgroup  | holds                       | per chunk                                                      |
  | 0, 1       | half of dS's columns (fp32) | dh out (TMA store of dS_sh), K dS, dS *= gamma_last,           |
  | (chain)    |                             | dS += (gamma Q)^T dOs, P^T dOs, dV' -> X_sh, dS -= W^T dV',    |
  |            |                             | dS -> dS_sh (bf16) for the next chunk's K dS and dh            |
  | 2 (local)  | P                           | P = Gamma o Q K^T (masked, scaled): it needs no state, so it   |
  |            |                             | runs a chunk ahead of the chains into a second buffer          |
  | 3          | warp 0: loader              | TMA loads of Q, K, GA, dO (two halves), gates and beta         |
  |            |                             | of the next chunk into the other stage                         |

A chain step is K dS beside (gamma Q)^T dOs, then P^T dOs into K dS's accumulator once it is scaled by
gamma_last / gamma (a third [64, BV/2] accumulator spills), then GA^T dV' and K^T (beta gamma GA^T dV'), with
named barriers of its own
warpgroup only; the masked scores, the dh store and every load are off the chain. mbarriers, phase parity
(i // 2) % 2 for the i-th chunk walked (stage and buffer i % 2):
    ready[s]     loader -> all             stage s holds the chunk (TMA bytes + the loader warp's gate stores)
    free[s]      chains, local -> loader   stage s is read
    pw_ready[s]  local -> chains           P_sh[s] holds the chunk's P
    pw_free[s]   chains -> local           both chains' products have read P_sh[s]
No phase completes twice before its waiters pass it: every producer of a phase first waits for the consumer's
acknowledgement of the one before.

H200, 2026-12-04 (docs/kernels.md, "Thirty-second session", "Thirty-third session"), the walk alone on the public op's
arguments: against the previous walk (256 threads sharing every product, cp.async double buffer, CTA-wide
barriers), the first layout of this one, with W formed by the local warpgroup, was 1.22-1.24x faster at V tile
128 (561.6 -> 458.4 us at (16, 32) x 4K x 8), 1.64-1.66x at 64 (421 -> 256 at (4, 8) x 8K x 8), 1.66-1.88x at 32
(383 -> 204 at (2, 4) x 8K x 1), outputs bitwise equal; FlashQLA's backward matrix 0.77x -> 0.82x. The local
warpgroup set the pace at 128 (the chains alone: 330 us): without W, 458.8 -> 374.5 us at (16, 32) x 4K x 8,
899.7 -> 719.7 at (16, 64) x 8K x 4 (dh within 3.5e-3 of the W form's: other roundings). At V tiles 64 and 32 the
GA form is 0.91-0.95x the walk reading a precomputed W, but the whole backward without the kernel that formed W
is 1.00-1.06x faster (fwd+bwd, (4, 8) 8K x 8 2.057 -> 1.941 ms), so every tile reads GA.

Sequences of any length: in a sequence's last, partial chunk the gates past its end repeat the last one
(factor 1) and the rows past its end are masked out of P, dOs and dV' (they hold the next sequence's tokens,
or TMA's zero fill past the tensor end: finite); beta gamma is 0 there, so they add nothing through W.

The kernel reads dO itself and applies `scale` in fp32 where dO enters the algebra (on the masked P and on
gamma dO, both formed elementwise anyway), so no scaled copy of dO is made.

TileLang notes (fused_fwd.py's apply): explicit named barriers use ids 8-10; every register -> shared write
that a tensor-core product or a TMA store reads is followed by `fence.proxy.async`.
"""
import tilelang.language as T

from .walk_gates import load_gate_rows

CHUNK = 64
HEAD_DIM = 128
WARPGROUP = 128
CHAIN_REGS, LOCAL_REGS, PRODUCER_REGS = 168, 136, 40  # 2 x 168 + 136 + 40 = 512 per thread of a warpgroup
CHAIN_BARRIERS = (8, 9)


def build_chunk_dstates(dtype: str, block_v: int):
    """Build the walk for `dtype` and V tile `block_v`."""
    if HEAD_DIM % block_v or block_v % 32:
        raise ValueError(f"block_v must be a multiple of 32 dividing {HEAD_DIM}, got {block_v}")
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")
    num_last = T.dynamic("num_last")
    C, D, BV, WG = CHUNK, HEAD_DIM, block_v, WARPGROUP
    H = BV // 2  # columns per chain warpgroup
    # below V tile 128 the loader's serial loop is the walk's pace, and it gets the k-head as a variable set once:
    # as an expression TileLang expands it into every TMA box's coordinates, two integer divisions and two
    # remainders by dynamic sizes each ((2, 8) x 32K at V tile 32: 851 -> 799 us, H100, 2026-12-06). At 128 the
    # same variable made the walk 3.5% slower ((16, 32) 4K x 8: 468 -> 485 us), so that build keeps the expression.
    narrow = BV < 128

    @T.macro
    def chain(half, barrier_id, v0, n, h, num_chunks, seq_len, state_row, chunk_offsets, dht, dh_out, dh0, use_dht,
              store_dh0, store_dh, scale, Q_s, K_s, GA_s, dO_s, g_s, b_s, P_sh, dS_sh, X_sh, dS, KdS, tail, bg,
              decay, ready, free, pw_ready, pw_free):
        """Chain warpgroup `half`: columns v0 + half * H .. + H of dS, chunks in reverse."""
        col0 = v0 + half * H
        T.set_max_nreg(CHAIN_REGS, 1)
        if use_dht != 0:
            T.copy(dht[state_row, 0:D, col0:col0 + H], dS)
        else:
            T.clear(dS)
        T.copy(dS, dS_sh)
        T.fence_proxy_async()
        T.sync_threads(barrier_id, WG)
        for i in T.serial(num_chunks):
            c = num_chunks - 1 - i
            stage = i % 2
            n_rows = T.min(C, seq_len - c * C)  # < C only in the sequence's last chunk
            T.barrier_wait(ready[stage], (i // 2) % 2)
            if store_dh != 0:  # the gradient of the state leaving chunk c, read by TMA while the chunk runs
                T.tma_copy(dS_sh, dh_out[chunk_offsets[n] + c, h, 0:D, col0:col0 + H])
            T.wgmma_gemm(K_s[stage, :, :], dS_sh, KdS, clear_accum=True)  # the chain's first product
            for r in T.Parallel(C):  # meanwhile gamma_last / gamma of each row (and beta gamma, 0 past the end)
                tail[r] = T.exp2(g_s[stage, C - 1] - g_s[stage, r])
                bg[r] = T.if_then_else(r < n_rows, T.exp2(g_s[stage, r]) * b_s[stage, r], 0.0)
            decay = T.exp2(g_s[stage, C - 1])
            for r, j in T.Parallel(C, H):  # gamma dOs over the rows that exist, into X_sh
                X_sh[r, j] = T.if_then_else(r < n_rows, dO_s[stage, half, r, j] * (T.exp2(g_s[stage, r]) * scale), 0.0)
            for a, j in T.Parallel(D, H):
                dS[a, j] = dS[a, j] * decay
            T.fence_proxy_async()
            T.sync_threads(barrier_id, WG)
            T.wgmma_gemm(Q_s[stage, :, :], X_sh, dS, transpose_A=True)  # dS += (gamma Q)^T dOs
            T.wait_wgmma(1)  # K dS ((gamma Q)^T dOs may still run)
            T.warpgroup_fence_operand(KdS, num_regs=C * H // WG)
            for r, j in T.Parallel(C, H):
                KdS[r, j] = KdS[r, j] * tail[r]
            T.barrier_wait(pw_ready[stage], (i // 2) % 2)
            # dV' = P^T dOs + diag(gamma_last / gamma) K dS, in K dS's accumulator (a third [64, H] one spills)
            T.wgmma_gemm(P_sh[stage, :, :], dO_s[stage, half, :, :], KdS, transpose_A=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(KdS, num_regs=C * H // WG)
            T.warpgroup_fence_operand(dS, num_regs=D * H // WG)
            for r, j in T.Parallel(C, H):  # dV' over the rows that exist, negated for the W^T dV' products
                KdS[r, j] = T.if_then_else(r < n_rows, -KdS[r, j], 0.0)
            T.copy(KdS, X_sh)
            if store_dh != 0:
                T.tma_store_wait(0)  # dh has left dS_sh (before the barrier below, so dS_sh may be written after it)
            T.fence_proxy_async()
            T.sync_threads(barrier_id, WG)
            # W^T dV' = K^T diag(beta gamma) (GA^T dV'): two products, no W formed
            T.wgmma_gemm(GA_s[stage, :, :], X_sh, KdS, transpose_A=True, clear_accum=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(KdS, num_regs=C * H // WG)
            for r, j in T.Parallel(C, H):
                KdS[r, j] = KdS[r, j] * bg[r]
            T.copy(KdS, X_sh)
            T.fence_proxy_async()
            T.sync_threads(barrier_id, WG)
            T.wgmma_gemm(K_s[stage, :, :], X_sh, dS, transpose_A=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(dS, num_regs=D * H // WG)
            T.barrier_arrive(pw_free[stage])
            T.barrier_arrive(free[stage])
            T.copy(dS, dS_sh)
            T.fence_proxy_async()
            T.sync_threads(barrier_id, WG)
        if store_dh0 != 0:
            T.copy(dS, dh0[state_row, 0:D, col0:col0 + H])

    @T.prim_func
    def chunk_dstates(
        q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), "float32"),
        do: T.Tensor((num_tokens, num_v_heads, D), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        dht: T.Tensor((num_dht, D, D), "float32"),
        dh_out: T.Tensor((num_chunk_slots, num_v_heads, D, D), dtype),
        dh0: T.Tensor((num_dh0, D, D), "float32"),
        last_chunks: T.Tensor((num_last,), "int32"),
        scale: T.float32,
        use_dht: T.int32,
        store_dh0: T.int32,
        store_dh: T.int32,
        use_last: T.int32,
    ):
        with T.Kernel(D // BV, num_seqs, num_v_heads, threads=4 * WG) as (bv, n, h):
            if narrow:
                hk = T.alloc_var("int32")  # the loader's k-head (set in its branch, so it lives there only)
            else:
                hk = h // (num_v_heads // num_qk_heads)
            bos = cu_seqlens[n]
            seq_len = cu_seqlens[n + 1] - bos
            v0 = bv * BV
            state_row = n * num_v_heads + h
            num_chunks = T.alloc_var("int32")  # the walk runs chunks num_chunks - 1 .. 0
            num_chunks = T.ceildiv(seq_len, C)
            if use_last != 0:  # a warmed-up walk from zero: its sequence's chunks last_chunks[h, n] .. 0 only
                num_chunks = T.min(num_chunks, last_chunks[h * num_seqs + n] + 1)

            # two stages of chunk inputs (TMA); P a chunk ahead; each chain's dS and dV' tiles
            Q_s = T.alloc_shared((2, C, D), dtype)
            K_s = T.alloc_shared((2, C, D), dtype)
            GA_s = T.alloc_shared((2, C, C), dtype)
            dO_s = T.alloc_shared((2, 2, C, H), dtype)  # the two chains' halves
            g_s = T.alloc_shared((2, C), "float32")  # base-2 gates
            b_s = T.alloc_shared((2, C), "float32")  # beta
            P_sh = T.alloc_shared((2, C, C), dtype)
            dS_sh0, dS_sh1 = T.alloc_shared((D, H), dtype), T.alloc_shared((D, H), dtype)
            X_sh0, X_sh1 = T.alloc_shared((C, H), dtype), T.alloc_shared((C, H), dtype)  # gamma dOs, then dV'

            dS0, dS1 = T.alloc_fragment((D, H), "float32"), T.alloc_fragment((D, H), "float32")
            KdS0, KdS1 = T.alloc_fragment((C, H), "float32"), T.alloc_fragment((C, H), "float32")
            tail0, tail1 = T.alloc_fragment((C,), "float32"), T.alloc_fragment((C,), "float32")
            bg0, bg1 = T.alloc_fragment((C,), "float32"), T.alloc_fragment((C,), "float32")
            decay0, decay1 = T.alloc_var("float32"), T.alloc_var("float32")
            P = T.alloc_fragment((C, C), "float32")

            ready = T.alloc_barrier(arrive_count=[32, 32])  # the loader warp (and the TMA bytes)
            free = T.alloc_barrier(arrive_count=[3 * WG, 3 * WG])
            pw_ready = T.alloc_barrier(arrive_count=[WG, WG])
            pw_free = T.alloc_barrier(arrive_count=[2 * WG, 2 * WG])

            tx = T.get_thread_binding()
            if tx < WG:
                chain(0, CHAIN_BARRIERS[0], v0, n, h, num_chunks, seq_len, state_row, chunk_offsets, dht, dh_out, dh0,
                      use_dht, store_dh0, store_dh, scale, Q_s, K_s, GA_s, dO_s, g_s, b_s, P_sh, dS_sh0, X_sh0, dS0,
                      KdS0, tail0, bg0, decay0, ready, free, pw_ready, pw_free)
            elif tx < 2 * WG:
                chain(1, CHAIN_BARRIERS[1], v0, n, h, num_chunks, seq_len, state_row, chunk_offsets, dht, dh_out, dh0,
                      use_dht, store_dh0, store_dh, scale, Q_s, K_s, GA_s, dO_s, g_s, b_s, P_sh, dS_sh1, X_sh1, dS1,
                      KdS1, tail1, bg1, decay1, ready, free, pw_ready, pw_free)
            elif tx < 3 * WG:  # local: the chunk's masked scores P, a chunk ahead of the chains
                T.set_max_nreg(LOCAL_REGS, 1)
                for i in T.serial(num_chunks):
                    c = num_chunks - 1 - i
                    stage = i % 2
                    n_rows = T.min(C, seq_len - c * C)
                    T.barrier_wait(ready[stage], (i // 2) % 2)
                    T.barrier_wait(pw_free[stage], (i // 2 + 1) % 2)
                    T.wgmma_gemm(Q_s[stage, :, :], K_s[stage, :, :], P, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(P, num_regs=C * C // WG)
                    # scale (Gamma o Q K^T) over the rows that exist; with it P^T dO = P^T dOs
                    for r, s in T.Parallel(C, C):
                        P[r, s] = T.Select(r < n_rows and r >= s,
                                           P[r, s] * T.exp2(g_s[stage, r] - g_s[stage, s]) * scale, 0.0)
                    T.copy(P, P_sh[stage, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(pw_ready[stage])
                    T.barrier_arrive(free[stage])
            else:
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < 3 * WG + 32:  # loader: the i-th chunk walked into stage i % 2 once every consumer freed it
                    if narrow:
                        hk = h // (num_v_heads // num_qk_heads)
                    for i in T.serial(num_chunks):
                        c = num_chunks - 1 - i
                        stage = i % 2
                        t0 = bos + c * C
                        T.barrier_wait(free[stage], (i // 2 + 1) % 2)
                        T.tma_copy(q[t0:t0 + C, hk, 0:D], Q_s[stage, :, :], barrier=ready[stage])
                        T.tma_copy(k[t0:t0 + C, hk, 0:D], K_s[stage, :, :], barrier=ready[stage])
                        T.tma_copy(GA[t0:t0 + C, h, 0:C], GA_s[stage, :, :], barrier=ready[stage])
                        T.tma_copy(do[t0:t0 + C, h, v0:v0 + H], dO_s[stage, 0, :, :], barrier=ready[stage])
                        T.tma_copy(do[t0:t0 + C, h, v0 + H:v0 + BV], dO_s[stage, 1, :, :], barrier=ready[stage])
                        load_gate_rows(gcum, beta, g_s, b_s, stage, h, t0, seq_len - c * C - 1)
                        T.barrier_arrive(ready[stage])

    return chunk_dstates
