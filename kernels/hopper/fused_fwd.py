"""Fused GDN forward, warp-specialised: one CTA per (V tile, sequence, v-head) walks its sequence's chunks.

Per 64-token chunk, with the state S [128 x block_v] kept in fp32 registers (design doc §2):

    KS = K S,  QS = Q S,  P = Q K^T                                    (tensor cores, bf16/fp16 in, fp32 out)
    Vd = diag(beta) (V - diag(gamma) KS)                               ("V delta", beta applied here)
    V' = GA Vd                      with GA = Gamma o A from wy_inverse (gate mask included)
    O  = scale (diag(gamma) QS + (Lower(Gamma) o P) V')
    S  = gamma_last S + K^T diag(gamma_last / gamma) V'

Only O and the final state leave the kernel. Every column of S, V' and O depends on the same column of V
only, so the walk splits by columns without any exchange between the halves.

With the runtime flag `store_states` the kernel is the backward's state recompute instead: no O (Q is not
loaded, the chain hands no V' over), and the output warpgroup stores the state entering every chunk (input
dtype, from the chain's S_sh) at its chunk slot `chunk_offsets[n] + c` of `h_out`, what chunk_states.py
stores too. The `keep_states` build does both, O and every chunk's state, whatever `store_states` says (the
host passes 2): a forward that keeps its states for the backward (the op's `keep_states`). Its output
warpgroup stores S_sh by TMA as its Q S products start (issued after them, it spilled at V tile 128) and waits
for the stores to have read it before it lets the chain write the next state. A build of its own: the same
code behind a runtime branch slowed the plain forward by 1.5-3% at V tiles 32 and 64 (H100, 2026-12-06).

The `scores` build reads every chunk's masked, scaled P = scale (Lower(Gamma) o Q K^T) from chunk_scores.py (the
loader brings it by TMA with the chunk, into a stage of its own) instead of forming it. At V tile 32 the four
CTAs of a (sequence, v-head) each formed the same P, the output warpgroup's largest work per chunk (a 64 x 64 x
128 product beside the chain's on the same tensor cores, 32 exp2 a thread, a copy to shared memory), and that
warpgroup held the walk back (docs/kernels.md, "Fifty-second session"); launch.reads_chunk_scores says where the
build runs. O is bitwise the plain build's: chunk_scores forms P with the same products and gate arithmetic
and rounds it once, as the plain build's P_sh does.

Roles (512 threads, four warpgroups; `T.set_max_nreg` moves registers from the producer to the others):
  | warpgroup | holds                               | per chunk                                          |
  | 0, 1      | half of S's columns each (fp32)     | KS, Vd, V' (to shared memory for the output), the  |
  | (chain)   |                                     | decay and K^T (gamma_last / gamma) V' update, S to |
  |           |                                     | shared memory (bf16) for the next chunk's products |
  | 2 (output)| O (both halves) and P               | P = Q K^T and its mask, QS from the chain's S,     |
  |           |                                     | O = gamma QS + P V' from the chain's V'            |
  | 3         | warp 0: loader; warps 1-2: O store  | TMA loads of Q, K, V, GA, gates and beta of chunk  |
  |           | (block_v < 128)                     | c + 1 (.. c + 2 at V tile 32) into the free stages;|
  |           |                                     | O rows to global                                   |
The chain warpgroups never wait for each other: each owns its columns from the load of the chunk to the
state update, so a step of the serial walk is three products of one warpgroup (K S, GA Vd, K^T V') and no
hand-off. The output warpgroup runs beside them, half a chunk behind. mbarriers (arrive counts in the
allocations) carry every hand-off, with phase parity c % 2 (input stages: (c // NS) % 2, NS stages):
    ready[s]   loader -> all      stage s holds chunk c (TMA bytes + the loader warp's gate stores)
    free[s]    all -> loader      every consumer is done with stage s
    s_ready    chain -> output    S entering chunk c is in S_sh0 / S_sh1
    s_read     output -> chain    QS of chunk c is done: S_sh may take the next state
    vn_ready   chain -> output    V' of chunk c is in Vn_sh0 / Vn_sh1
    vn_free    output -> chain    P V' of chunk c is done: Vn_sh may take the next V'
    o_ready / o_free              output <-> store warps over O_sh (block_v < 128)
No barrier can complete a phase twice before its waiters pass it: every producer of a phase first waits
for the consumer's acknowledgement of the previous one. A `fence.proxy.async` follows every register ->
shared write that a tensor-core product reads.

Why this split, measured on the H200 against the previous kernel (two warpgroups sharing every product,
cp.async double buffer), fused walk alone, 2026-12-01: (16, 64) x 8K x 4 (block_v 128) 1104 -> 975 us,
(16, 32) x 32K x 8 4307 -> 3820, (2, 8) x 4K x 8 (64) 200 -> 159, (2, 8) x 32K x 1 (32) 1142 -> 916; final
states bitwise equal. A split by role instead (one warpgroup holding all of S, one computing V', one O:
each product on a single warpgroup and two hand-offs on the serial chain) was 0.88-0.90x the previous kernel
at block_v 128; O computed by the chain warpgroups themselves (one warpgroup for the masked scores) 0.83x
this one there. Without any output work the chain warpgroups alone take 770 us at (16, 64) x 8K x 4, so
the output warpgroup (2M of the 4.5M MACs per chunk, the mask, the store) sets the pace there
(docs/kernels.md, "Sixteenth session").

O leaves through O_sh. At block_v 128 the output warpgroup hands a full chunk's O_sh to one TMA store and
waits for it to have read O_sh only half a chunk later, before it writes O_sh again (a sequence's partial
last chunk leaves by 16-byte row stores of its rows alone: TMA would write the next sequence's rows);
against the row stores it had before, H200, 2026-12-02, kernel alone: 994 -> 813 us at (16, 64) x 8K x 4,
507 -> 416 at (16, 32) x 4K x 8, O bitwise equal. At block_v < 128 two producer warps store it by rows
(the output warpgroup only writes O_sh), which measured 183 -> 155 us at block_v 64 and 930 -> 900 at 32;
removing that store altogether gains nothing there.

Gates: the loader stores the chunk's gates in base 2 (gcum x log2 e) and beta, rows past the sequence end
repeating its last token, so no exp2 argument is positive and gamma_last is row C - 1. It loads them into
registers a chunk ahead and takes the k-head from a variable set once: at V tile 32 its serial loop set the
walk's pace, with two integer divisions and two remainders per TMA box and the gate loads waited for in
place (Nsight Compute: the loader warp busy all along, the chain warpgroups waiting for `ready` a fifth of
their time). Since, (2, 8) x 32K 711 -> 613 us, (32, 32) x 32K 937 -> 830 (H100, 2026-12-06, docs/kernels.md,
"Fifty-fourth session"). Rows past the end of a
sequence are loaded as they are (the next sequence's tokens, or TMA's zero fill past the tensor end:
finite); they reach only rows of V' and O that are not stored, except through the state update, where
gamma_last / gamma is set to 0 for them.

TileLang notes: the explicit named barriers (one warpgroup) use ids 8-10 because TileLang's own partial
barriers in warp-specialised branches take ids from 3 upwards; fragments are allocated per role (a
fragment's layout is inferred for the threads of the branch that uses it).
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .walk_gates import gate_regs_to_shared, gate_rows_to_regs

CHUNK = 64
HEAD_DIM = 128
WARPGROUP = 128
CHAIN_REGS, OUTPUT_REGS, PRODUCER_REGS = 168, 136, 40  # 2 x 168 + 136 + 40 = 512 per thread of a warpgroup
CHAIN_BARRIERS = (8, 9)
OUTPUT_BARRIER = 10


def build_fused_fwd(dtype: str, block_v: int, keep_states: bool = False, scores: bool = False):
    """Build the prim_func for q/k/v dtype `dtype` and V tile width `block_v`; all sizes are dynamic. With
    `keep_states`, the build that stores O and the state entering every chunk; with `scores`, the build that
    reads every chunk's masked, scaled P = scale (Lower(Gamma) o Q K^T) from chunk_scores.py (an argument `P_in`
    [T, Hv, 64] after `h_out`) instead of forming it.

    `scale` and the flags are runtime arguments, so new values never recompile. States are passed
    flattened to [N * Hv, 128, 128]; a [1, 128, 128] dummy stands in when a flag is 0.
    """
    if HEAD_DIM % block_v or block_v % 32:
        raise ValueError(f"block_v must be a multiple of 32 dividing {HEAD_DIM}, got {block_v}")
    if keep_states and scores:
        raise ValueError("the keep_states build forms its own P (no scores build of it)")
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_h0 = T.dynamic("num_h0")
    num_ht = T.dynamic("num_ht")
    num_slots = T.dynamic("num_slots")
    C, D, BV, WG = CHUNK, HEAD_DIM, block_v, WARPGROUP
    H = BV // 2  # columns per chain warpgroup
    store_by_producer = BV < 128
    # the output warpgroup's barrier before P V' waits for its P_sh rows, and at block_v 128 for the TMA store
    # that read O_sh; the scores build at block_v < 128 writes neither before it
    sync_before_pv = not (scores and store_by_producer)
    # input stages: three at V tile 32 (room in shared memory; the walk alone, H100, 2026-12-06, outputs bitwise
    # equal: the scores build 1.03x at (2, 8) x 16K and 32K, 0.99x at (4, 16) x 32K; the plain build 1.03x at (8, 24)
    # and (16, 16) x 32K, 1.01x at (32, 32)), two elsewhere
    NS = 3 if block_v == 32 and not keep_states else 2
    score_stages = NS if scores else 1  # P_in's tiles in shared memory, one per input stage (unused without)

    def computes_o(store_states):
        """Whether the walk computes O: always in the keep_states build (a constant there), else with
        store_states 0."""
        return True if keep_states else store_states == 0

    def states_only(store_states):
        """Whether the walk stores the states and no O: never in the keep_states build."""
        return False if keep_states else store_states != 0

    @T.macro
    def chain(half, barrier_id, v0, n_chunks, seq_len, state_row, h0, ht, use_h0, store_ht, store_states, K_s, V_s,
              GA_s, g_s, b_s, S_sh, Vd_sh, Vn_sh, S, KS, Vn, gam, tail, decay, ready, free, s_ready, s_read, vn_ready,
              vn_free):
        """Chain warpgroup `half`: columns v0 + half * H .. + H of S and V', chunk after chunk."""
        col0 = v0 + half * H
        T.set_max_nreg(CHAIN_REGS, 1)
        if use_h0 != 0:
            T.copy(h0[state_row, 0:D, col0:col0 + H], S)
        else:
            T.clear(S)
        T.copy(S, S_sh)
        T.fence_proxy_async()
        T.barrier_arrive(s_ready)
        for c in T.serial(n_chunks):
            stage = c % NS
            n_rows = T.min(C, seq_len - c * C)
            T.barrier_wait(ready[stage], (c // NS) % 2)
            T.sync_threads(barrier_id, WG)  # this warpgroup's S_sh stores are fenced before K S reads them
            T.wgmma_gemm(K_s[stage, :, :], S_sh, KS, clear_accum=True)
            for r in T.Parallel(C):  # meanwhile the row decays and gamma_last S
                gam[r] = T.exp2(g_s[stage, r])
                tail[r] = T.if_then_else(r < n_rows, T.exp2(g_s[stage, C - 1] - g_s[stage, r]), 0.0)
            decay = T.exp2(g_s[stage, C - 1])
            for i, j in T.Parallel(D, H):
                S[i, j] = S[i, j] * decay
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(KS, num_regs=C * H // WG)
            for r, j in T.Parallel(C, H):
                KS[r, j] = b_s[stage, r] * (V_s[stage, r, half * H + j] - gam[r] * KS[r, j])  # Vd
            T.copy(KS, Vd_sh)
            T.fence_proxy_async()
            T.sync_threads(barrier_id, WG)
            T.wgmma_gemm(GA_s[stage, :, :], Vd_sh, Vn, clear_accum=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(Vn, num_regs=C * H // WG)
            if computes_o(store_states):  # V' to the output warpgroup
                T.barrier_wait(vn_free, (c + 1) % 2)
                T.copy(Vn, Vn_sh)
                T.fence_proxy_async()
                T.barrier_arrive(vn_ready)
            for r, j in T.Parallel(C, H):
                Vn[r, j] = Vn[r, j] * tail[r]
            T.copy(Vn, Vd_sh)  # (gamma_last / gamma) V' over Vd, which the V' product has read
            T.fence_proxy_async()
            T.sync_threads(barrier_id, WG)
            T.wgmma_gemm(K_s[stage, :, :], Vd_sh, S, transpose_A=True)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(S, num_regs=D * H // WG)
            T.barrier_arrive(free[stage])
            T.barrier_wait(s_read, c % 2)
            T.copy(S, S_sh)
            T.fence_proxy_async()
            T.barrier_arrive(s_ready)
        if store_ht != 0:
            T.copy(S, ht[state_row, 0:D, col0:col0 + H])

    @T.macro
    def store_rows(o, O_sh, t0, h, v0, n_rows):
        for r, j in T.Parallel(C, BV):
            if r < n_rows:
                o[t0 + r, h, v0 + j] = O_sh[r, j]

    @T.macro
    def walk(q, k, v, GA, beta, gcum, cu_seqlens, chunk_offsets, h0, o, ht, h_out, P_in, scale, use_h0, store_ht,
             store_states):
        """The kernel, for both signatures below (P_in: the scores build's precomputed P, else None)."""
        with T.Kernel(D // BV, num_seqs, num_v_heads, threads=4 * WG) as (bv, n, h):
            hk = T.alloc_var("int32")  # the loader's k-head (set in its branch, so it lives there only)
            bos = cu_seqlens[n]
            seq_len = cu_seqlens[n + 1] - bos
            v0 = bv * BV
            state_row = n * num_v_heads + h
            n_chunks = T.ceildiv(seq_len, C)

            # NS stages of chunk inputs (TMA), the chain's hand-offs to the output, O on its way out
            Q_s = T.alloc_shared((NS, C, D), dtype)
            K_s = T.alloc_shared((NS, C, D), dtype)
            V_s = T.alloc_shared((NS, C, BV), dtype)
            GA_s = T.alloc_shared((NS, C, C), dtype)
            g_s = T.alloc_shared((NS, C), "float32")  # base-2 gates
            b_s = T.alloc_shared((NS, C), "float32")  # beta
            S_sh0, S_sh1 = T.alloc_shared((D, H), dtype), T.alloc_shared((D, H), dtype)
            Vd_sh0, Vd_sh1 = T.alloc_shared((C, H), dtype), T.alloc_shared((C, H), dtype)
            Vn_sh0, Vn_sh1 = T.alloc_shared((C, H), dtype), T.alloc_shared((C, H), dtype)
            P_sh = T.alloc_shared((C, C), dtype)
            P_s = T.alloc_shared((score_stages, C, C), dtype)  # the scores build's P of the stage's chunk
            O_sh = T.alloc_shared((C, BV), dtype)

            S0, S1 = T.alloc_fragment((D, H), "float32"), T.alloc_fragment((D, H), "float32")
            KS0, KS1 = T.alloc_fragment((C, H), "float32"), T.alloc_fragment((C, H), "float32")
            Vn0, Vn1 = T.alloc_fragment((C, H), "float32"), T.alloc_fragment((C, H), "float32")
            gam0, gam1 = T.alloc_fragment((C,), "float32"), T.alloc_fragment((C,), "float32")
            tail0, tail1 = T.alloc_fragment((C,), "float32"), T.alloc_fragment((C,), "float32")
            decay0, decay1 = T.alloc_var("float32"), T.alloc_var("float32")
            O0, O1 = T.alloc_fragment((C, H), "float32"), T.alloc_fragment((C, H), "float32")
            P = T.alloc_fragment((C, C), "float32")
            gam_o = T.alloc_fragment((C,), "float32")  # scale gamma of each row
            g_r, b_r = T.alloc_local((C // 32,), "float32"), T.alloc_local((C // 32,), "float32")  # loader: next gates

            ready = T.alloc_barrier(arrive_count=[32] * NS)  # the loader warp (and the TMA bytes)
            free = T.alloc_barrier(arrive_count=[3 * WG] * NS)
            s_ready = T.alloc_barrier(arrive_count=2 * WG)
            s_read = T.alloc_barrier(arrive_count=WG)
            vn_ready = T.alloc_barrier(arrive_count=2 * WG)
            vn_free = T.alloc_barrier(arrive_count=WG)
            o_ready = T.alloc_barrier(arrive_count=WG)
            o_free = T.alloc_barrier(arrive_count=64)

            # V_s and O_sh are read (the chain's Vd) and written (O) element by element in the accumulator layout,
            # 8 rows at once: row-major their rows share banks (8-way conflicts, L1 at 90% of its peak). Swizzled
            # (TMA loads and stores them swizzled too): (2, 8) x 4K x 8 155.4 -> 131.6 us on an H100, outputs equal.
            T.annotate_layout({V_s: make_swizzled_layout(V_s), O_sh: make_swizzled_layout(O_sh)})
            tx = T.get_thread_binding()
            if tx < WG:
                chain(0, CHAIN_BARRIERS[0], v0, n_chunks, seq_len, state_row, h0, ht, use_h0, store_ht, store_states,
                      K_s, V_s, GA_s, g_s, b_s, S_sh0, Vd_sh0, Vn_sh0, S0, KS0, Vn0, gam0, tail0, decay0, ready, free,
                      s_ready, s_read, vn_ready, vn_free)
            elif tx < 2 * WG:
                chain(1, CHAIN_BARRIERS[1], v0, n_chunks, seq_len, state_row, h0, ht, use_h0, store_ht, store_states,
                      K_s, V_s, GA_s, g_s, b_s, S_sh1, Vd_sh1, Vn_sh1, S1, KS1, Vn1, gam1, tail1, decay1, ready, free,
                      s_ready, s_read, vn_ready, vn_free)
            elif tx < 3 * WG:  # output
                T.set_max_nreg(OUTPUT_REGS, 1)
                if states_only(store_states):  # the state entering every chunk to its slot, as the chain hands it over
                    for c in T.serial(n_chunks):
                        slot = chunk_offsets[n] + c
                        T.barrier_wait(s_ready, c % 2)
                        T.copy(S_sh0, h_out[slot, h, 0:D, v0:v0 + H])
                        T.copy(S_sh1, h_out[slot, h, 0:D, v0 + H:v0 + BV])
                        T.barrier_arrive(s_read)
                        T.barrier_arrive(free[c % NS])
                else:  # O
                    for c in T.serial(n_chunks):
                        stage = c % NS
                        t0 = bos + c * C
                        n_rows = T.min(C, seq_len - c * C)
                        T.barrier_wait(ready[stage], (c // NS) % 2)
                        if not scores:
                            T.wgmma_gemm(Q_s[stage, :, :], K_s[stage, :, :], P, transpose_B=True, clear_accum=True)
                        T.barrier_wait(s_ready, c % 2)
                        if keep_states:  # the state entering chunk c to its slot too (TMA, read while Q S runs)
                            slot = chunk_offsets[n] + c
                            T.tma_copy(S_sh0, h_out[slot, h, 0:D, v0:v0 + H])
                            T.tma_copy(S_sh1, h_out[slot, h, 0:D, v0 + H:v0 + BV])
                        T.wgmma_gemm(Q_s[stage, :, :], S_sh0, O0, clear_accum=True)
                        T.wgmma_gemm(Q_s[stage, :, :], S_sh1, O1, clear_accum=True)
                        for r in T.Parallel(C):
                            gam_o[r] = T.exp2(g_s[stage, r]) * scale
                        if not scores:
                            T.wait_wgmma(2)
                            T.warpgroup_fence_operand(P, num_regs=C * C // WG)
                            for r, s in T.Parallel(C, C):
                                P[r, s] = T.Select(r >= s, P[r, s] * T.exp2(g_s[stage, r] - g_s[stage, s]) * scale,
                                                   0.0)
                            T.copy(P, P_sh)
                            T.fence_proxy_async()
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(O0, num_regs=C * H // WG)
                        T.warpgroup_fence_operand(O1, num_regs=C * H // WG)
                        if keep_states:  # the state stores have read S_sh (and the last O store, O_sh)
                            T.tma_store_wait(0)
                        T.barrier_arrive(s_read)
                        for r, j in T.Parallel(C, H):
                            O0[r, j] = O0[r, j] * gam_o[r]
                        for r, j in T.Parallel(C, H):
                            O1[r, j] = O1[r, j] * gam_o[r]
                        if not store_by_producer:  # the previous chunk's O store (TMA) has read O_sh
                            T.tma_store_wait(0)
                        if sync_before_pv:
                            T.sync_threads(OUTPUT_BARRIER, WG)  # every thread's P_sh rows before the product
                        T.barrier_wait(vn_ready, c % 2)
                        if scores:
                            T.wgmma_gemm(P_s[stage, :, :], Vn_sh0, O0)
                            T.wgmma_gemm(P_s[stage, :, :], Vn_sh1, O1)
                        else:
                            T.wgmma_gemm(P_sh, Vn_sh0, O0)
                            T.wgmma_gemm(P_sh, Vn_sh1, O1)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(O0, num_regs=C * H // WG)
                        T.warpgroup_fence_operand(O1, num_regs=C * H // WG)
                        T.barrier_arrive(vn_free)
                        T.barrier_arrive(free[stage])
                        if store_by_producer:
                            T.barrier_wait(o_free, (c + 1) % 2)
                        T.copy(O0, O_sh[0:C, 0:H])
                        T.copy(O1, O_sh[0:C, H:BV])
                        if store_by_producer:
                            T.barrier_arrive(o_ready)
                        else:
                            T.fence_proxy_async()
                            T.sync_threads(OUTPUT_BARRIER, WG)
                            if n_rows == C:  # one TMA store, waited for half a chunk later (above)
                                T.tma_copy(O_sh, o[t0:t0 + C, h, v0:v0 + BV])
                            else:  # a sequence's partial last chunk: its rows only (TMA would write the next's)
                                store_rows(o, O_sh, t0, h, v0, n_rows)
                    if not store_by_producer:
                        T.tma_store_wait(0)
            else:
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < 3 * WG + 32:  # loader: chunk c into stage c % NS once every consumer freed it
                    # the k-head once: an expression here would be expanded into every TMA box's coordinates, two
                    # integer divisions and two remainders each in this serial loop
                    hk = h // (num_v_heads // num_qk_heads)
                    lane = tx - 3 * WG
                    if n_chunks > 0:
                        gate_rows_to_regs(gcum, beta, g_r, b_r, h, bos, seq_len - 1, lane)
                    for c in T.serial(n_chunks):
                        stage = c % NS
                        t0 = bos + c * C
                        T.barrier_wait(free[stage], (c // NS + 1) % 2)
                        if computes_o(store_states):
                            T.tma_copy(q[t0:t0 + C, hk, 0:D], Q_s[stage, :, :], barrier=ready[stage])
                        T.tma_copy(k[t0:t0 + C, hk, 0:D], K_s[stage, :, :], barrier=ready[stage])
                        T.tma_copy(v[t0:t0 + C, h, v0:v0 + BV], V_s[stage, :, :], barrier=ready[stage])
                        T.tma_copy(GA[t0:t0 + C, h, 0:C], GA_s[stage, :, :], barrier=ready[stage])
                        if scores:
                            T.tma_copy(P_in[t0:t0 + C, h, 0:C], P_s[stage, :, :], barrier=ready[stage])
                        gate_regs_to_shared(g_r, b_r, g_s, b_s, stage, lane)
                        T.barrier_arrive(ready[stage])
                        if c + 1 < n_chunks:  # the next chunk's gates, in flight while the loader waits for its stage
                            gate_rows_to_regs(gcum, beta, g_r, b_r, h, t0 + C, seq_len - (c + 1) * C - 1, lane)
                elif tx < 3 * WG + 96:
                    if store_by_producer:  # two warps store O (16 bytes per thread and store)
                        if computes_o(store_states):
                            for c in T.serial(n_chunks):
                                T.barrier_wait(o_ready, c % 2)
                                store_rows(o, O_sh, bos + c * C, h, v0, T.min(C, seq_len - c * C))
                                T.barrier_arrive(o_free)

    # two signatures over one body: only the scores build takes P_in (the plain and keep builds' CUDA as before)
    if scores:
        @T.prim_func
        def fused_fwd(
            q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
            k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
            v: T.Tensor((num_tokens, num_v_heads, D), dtype),
            GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
            beta: T.Tensor((num_tokens, num_v_heads), "float32"),
            gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
            h0: T.Tensor((num_h0, D, D), "float32"),
            o: T.Tensor((num_tokens, num_v_heads, D), dtype),
            ht: T.Tensor((num_ht, D, D), "float32"),
            h_out: T.Tensor((num_slots, num_v_heads, D, D), dtype),
            P_in: T.Tensor((num_tokens, num_v_heads, C), dtype),
            scale: T.float32,
            use_h0: T.int32,
            store_ht: T.int32,
            store_states: T.int32,
        ):
            walk(q, k, v, GA, beta, gcum, cu_seqlens, chunk_offsets, h0, o, ht, h_out, P_in, scale, use_h0, store_ht,
                 store_states)
    else:
        @T.prim_func
        def fused_fwd(
            q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
            k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
            v: T.Tensor((num_tokens, num_v_heads, D), dtype),
            GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
            beta: T.Tensor((num_tokens, num_v_heads), "float32"),
            gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
            h0: T.Tensor((num_h0, D, D), "float32"),
            o: T.Tensor((num_tokens, num_v_heads, D), dtype),
            ht: T.Tensor((num_ht, D, D), "float32"),
            h_out: T.Tensor((num_slots, num_v_heads, D, D), dtype),
            scale: T.float32,
            use_h0: T.int32,
            store_ht: T.int32,
            store_states: T.int32,
        ):
            walk(q, k, v, GA, beta, gcum, cu_seqlens, chunk_offsets, h0, o, ht, h_out, None, scale, use_h0, store_ht,
                 store_states)

    return fused_fwd
