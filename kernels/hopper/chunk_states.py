"""State walk: the serial part of the split GDN forward and of intra-card CP's summaries.

One chunk of the recurrence from the forward's GA = Gamma o A and beta (`wy_inverse`, design doc §2;
W = GA diag(beta gamma) K and U = GA diag(beta) V are never formed), the identity the fused forward uses:

    V' = GA diag(beta) (V - diag(gamma) K S)       (V' = "V new" of the reference)
    S  = gamma_last S + K^T diag(gamma_last / gamma) V'

three products on the chain (K S, GA Vd, the update). One CTA per (V tile, sequence, v-head) walks the
chunks of its sequence with S [128 x block_v] in fp32 fragments and writes, per chunk, the state entering
it (`h`, in the input dtype, at the chunk's global index `chunk_offsets[n] + c`) and V' (token layout).
`chunk_output` then computes O for all chunks in parallel.

Runtime flags make the same kernel the state-only summary of intra-card CP (design doc §3, §5):
`store_chunks = 0` writes only the final state (S* of a segment from S0 = 0), and `with_transition = 1`
doubles the grid's V tiles: the second half walks V = 0 from S0 = I and ends at the segment's transition
product M (S_end = M S0 + S*), stored in `mt`. The columns of S evolve independently (V' and the update
act column by column), so S* and M are one walk of [V | 0] from [S0 | I], run as separate CTAs.
`active[kind, n, h]` (with `use_active`) skips the walks nobody reads (0: a skipped walk stores zeros) and
says where the others start: a walk with active = a >= 1 starts from S0 at chunk a - 1 of its sequence,
skipping the chunks before it (intra-card CP's warmup restart, design doc §4: the state leaving a segment
from its last few chunks only, where the gates decay enough over them; summaries only, store_chunks = 0).
With `use_active = FROM_GATES` the walks decide that themselves (`gate_statistics`: the chunk sums of their row's
gates against the warmup threshold, and the row's flags), store what they decided in `active` and the chain's
exact mask in `exact`. (A launch of its own between the inverse and this one computed them until 2026-12-07;
folded in, TP8 1 x 32K's forward took 253.9 -> 249.6 us on an H100, docs/kernels.md "Sixty-first session".)

Reading GA rather than W and U formed by a separate launch: H200, 2026-12-03, public op forward in CUDA
graphs, the launch forming W and U + a walk reading them against this: TP8 32K 0.310 -> 0.304 ms (the walk
48 -> 76 us, the 37 us launch and 2 x 256 bytes per token and v-head written and read again gone), TP8
16K 0.197 -> 0.189, 27B TP2 0.794 -> 0.734, but TP4 32K 0.517 -> 0.524 (64-chunk segments: the longer
chain per step costs more there than the launch did). Scaling GA's columns by beta in place instead, to
take a multiply off the chain, was slower (TP8 32K 0.314, h32 1.04 against 0.94): an elementwise pass over
a 64 x 64 tile costs more than the multiply. The W/U build was dropped on 2026-12-04 (docs/kernels.md,
"Twenty-eighth session").

Rows past the end of a sequence: K rows and beta are zeroed after they land (the GA and V rows there are
the next sequence's, or never written), and so are the V' rows that enter the update, so neither can touch
S; gate rows repeat the last valid one (gamma_last is the gate at the last token, no exp2 argument is
positive), and the V' rows they produce are not stored.

Loads are double buffered with cp.async (chunk c + 1 lands while chunk c computes); 128 threads for
block_v <= 64 (one warpgroup), 256 for block_v = 128. The products are asynchronous WGMMA: the decay of S
is applied while K S runs, and V' is stored while the state update runs.
"""
import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .launch import ALWAYS_M, FORCE_M, FORCE_S, FROM_GATES, HAS_NEXT, INTO_EXACT

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def threads_for(block_v: int) -> int:
    return 128 if block_v <= 64 else 256


def build_chunk_states(dtype: str, block_v: int):
    """The prim_func for q/k/v dtype `dtype` and V tile width `block_v`; all sizes are dynamic."""
    if HEAD_DIM % block_v:
        raise ValueError(f"block_v must divide {HEAD_DIM}, got {block_v}")
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    num_h0 = T.dynamic("num_h0")
    num_ht = T.dynamic("num_ht")
    num_mt = T.dynamic("num_mt")
    num_active = T.dynamic("num_active")
    num_flags = T.dynamic("num_flags")
    num_exact = T.dynamic("num_exact")
    C, D, BV = CHUNK, HEAD_DIM, block_v
    threads = threads_for(BV)
    loads = 5  # commit groups per chunk (load_chunk)
    BACK = 64  # chunk sums a round of the gate statistics loads

    @T.macro
    def load_chunk(k, v, GA, beta, gcum, t0, hk, h, v0, K_s, GA_s, V_s, b_s, graw_s):
        """cp.async the chunk starting at token t0 into one stage (`loads` commit groups)."""
        T.async_copy(k[t0:t0 + C, hk, 0:D], K_s)
        T.async_copy(GA[t0:t0 + C, h, 0:C], GA_s)
        T.async_copy(v[t0:t0 + C, h, v0:v0 + BV], V_s)
        T.async_copy(beta[t0:t0 + C, h], b_s)
        T.async_copy(gcum[h, t0:t0 + C], graw_s)

    @T.macro
    def chunk_step(h_out, vnew, t0, n_rows, chunk_index, h, v0, store_chunks, use_v, K_s, GA_s, V_s, b_s, graw_s, gc_sh,
                   bg_sh, gam_sh, S_sh, Vd_sh, Vs_sh, S, Vn, tail, decay):
        """One chunk of the walk; use_v = 0 walks V = 0 (the transition product's columns)."""
        if n_rows < C:
            for r, d in T.Parallel(C, D):
                if r >= n_rows:
                    K_s[r, d] = T.cast(0, dtype)
        # beta of the rows that exist (0 past the end: V there is the next sequence's). The row index is clamped at 0
        # too: unclamped it may be -1 (n_rows = 0), which TileLang answered with partial barriers in one pipeline
        # stage, and racecheck found 4000 RAW hazards in the S* walks (46th session); clamped, none.
        for r in T.Parallel(C):
            row = T.max(T.min(r, n_rows - 1), 0)
            gc_sh[r] = graw_s[row] * LOG2E
            bg_sh[r] = T.if_then_else(r < n_rows, b_s[row], 0.0)
            gam_sh[r] = T.exp2(graw_s[row] * LOG2E)
        if store_chunks != 0:
            T.copy(S_sh, h_out[chunk_index, h, 0:D, v0:v0 + BV])

        # K S first (asynchronous WGMMA: gamma_last S is formed while it runs)
        T.wgmma_gemm(K_s, S_sh, Vn, clear_accum=True)
        for r in T.Parallel(C):
            tail[r] = T.exp2(gc_sh[C - 1] - gc_sh[r])
        decay = T.exp2(gc_sh[C - 1])
        for i, j in T.Parallel(D, BV):
            S[i, j] = S[i, j] * decay
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(Vn, num_regs=C * BV // threads)
        # Vd = diag(beta) (V - diag(gamma) K S), then V' = GA Vd
        if use_v != 0:
            for r, j in T.Parallel(C, BV):
                Vd_sh[r, j] = T.cast(bg_sh[r] * (V_s[r, j] - gam_sh[r] * Vn[r, j]), dtype)
        else:
            for r, j in T.Parallel(C, BV):
                Vd_sh[r, j] = T.cast(-bg_sh[r] * gam_sh[r] * Vn[r, j], dtype)
        T.fence_proxy_async()
        T.sync_threads()
        T.wgmma_gemm(GA_s, Vd_sh, Vn, clear_accum=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(Vn, num_regs=C * BV // threads)
        # rows past the sequence end are zero: the GA bytes there are the next sequence's, or never written
        # (NaN in the GPU tests), and 0 x NaN in K^T V' would be NaN
        for r, j in T.Parallel(C, BV):
            Vs_sh[r, j] = T.if_then_else(r < n_rows, Vn[r, j] * tail[r], 0.0)
        T.sync_threads()

        # S = gamma_last S + K^T diag(gamma_last / gamma) V'; V' leaves while the product runs
        T.wgmma_gemm(K_s, Vs_sh, S, transpose_A=True)
        if store_chunks != 0:
            for r, j in T.Parallel(C, BV):
                if r < n_rows:
                    vnew[t0 + r, h, v0 + j] = Vn[r, j]
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(S, num_regs=D * BV // threads)
        T.copy(S, S_sh)

    @T.macro
    def gate_statistics(gcum, flags, exact, active, threshold, bos, eos, num_chunks, n, h, bv, num_seqs, num_v_heads,
                        back_sh, walk_sh):
        """Intra-card CP's gate statistics of row n and v-head h (design doc §4), with G(c) the gates of chunk c
        summed (gcum at its last token),

            warm      = some c with G(c) + G(c + 1) + ... + G(last chunk) < threshold
            walk_from = 1 + the last such c (1 where not warm: the whole row)

        added from the row's last chunk back, one at a time in fp32 (the order of the emulation), by one thread,
        BACK chunk sums loaded at a time by the others. From the row's flags (launch.py's bits, set by
        `segments._gate_flags`), the walk this CTA runs: S* from chunk walk_from - 1 where the next row reads it
        (or FORCE_S), M where a chain multiplies it by a state that can be nonzero (FORCE_M, ALWAYS_M, or
        INTO_EXACT on a row that does not warm up), left in walk_sh[0]. The first V tile's CTA also stores both
        walks' `active` and exact[n + 1] = has_next and not warm (exact[0] = 0), which the chain reads."""
        tx = T.get_thread_binding()
        total = T.alloc_var("float32")
        warm = T.alloc_var("int32")
        walk_from = T.alloc_var("int32")
        total = 0.0
        warm = 0
        walk_from = 1
        for r in T.serial(T.ceildiv(num_chunks, BACK)):
            if tx < BACK:
                back = r * BACK + tx  # chunk num_chunks - 1 - back ends at token min(bos + (num_chunks - back) C, eos) - 1
                back_sh[tx] = T.if_then_else(back < num_chunks,
                                              gcum[h, T.max(T.min(bos + (num_chunks - back) * C, eos), bos + 1) - 1],
                                              0.0)
            T.sync_threads()
            if tx == 0:
                for p in T.serial(T.min(BACK, num_chunks - r * BACK)):
                    if warm == 0:
                        total += back_sh[p]
                        if total < threshold:
                            warm = 1
                            walk_from = num_chunks - r * BACK - p
            T.sync_threads()  # every sum read before the next round overwrites them
        if tx == 0:  # warm and walk_from are thread 0's alone: it decides, the others read walk_sh[0]
            row_flags = flags[n]
            has_next = T.if_then_else(T.bitwise_and(row_flags, HAS_NEXT) != 0, 1, 0)
            from_s = T.if_then_else(T.bitwise_and(row_flags, FORCE_S) != 0, 1, has_next * walk_from)
            from_m = T.if_then_else(T.bitwise_and(row_flags, FORCE_M | ALWAYS_M) != 0
                                    or (T.bitwise_and(row_flags, INTO_EXACT) != 0 and warm == 0), 1, 0)
            walk_sh[0] = T.if_then_else(bv < D // BV, from_s, from_m)
            if bv == 0:
                active[n * num_v_heads + h] = from_s
                active[(num_seqs + n) * num_v_heads + h] = from_m
                if n + 1 < num_seqs:
                    exact[(n + 1) * num_v_heads + h] = T.if_then_else(has_next == 1 and warm == 0, 1.0, 0.0)
                if n == 0:
                    exact[h] = 0.0
        T.sync_threads()

    @T.prim_func
    def chunk_states(
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        v: T.Tensor((num_tokens, num_v_heads, D), dtype),
        GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), "float32"),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        h0: T.Tensor((num_h0, D, D), "float32"),
        h_out: T.Tensor((num_chunk_slots, num_v_heads, D, D), dtype),
        vnew: T.Tensor((num_tokens, num_v_heads, D), dtype),
        ht: T.Tensor((num_ht, D, D), "float32"),
        mt: T.Tensor((num_mt, D, D), "float32"),
        active: T.Tensor((num_active,), "int32"),
        flags: T.Tensor((num_flags,), "int32"),
        exact: T.Tensor((num_exact,), "float32"),
        use_h0: T.int32,
        store_ht: T.int32,
        store_chunks: T.int32,
        with_transition: T.int32,
        use_active: T.int32,
        threshold: T.float32,
    ):
        with T.Kernel(D // BV * (1 + with_transition), num_seqs, num_v_heads, threads=threads_for(BV)) as (bv, n, h):
            hk = T.alloc_var("int32")
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = h // (num_v_heads // num_qk_heads)
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            # tiles [0, D / BV) walk V from S0 (-> S*, or the states); tiles [D / BV, 2 D / BV) walk 0 from I (-> M)
            walks_v = T.if_then_else(bv < D // BV, 1, 0)
            v0 = (bv % (D // BV)) * BV
            state_row = n * num_v_heads + h
            back_sh = T.alloc_shared((BACK,), "float32")  # chunk sums of the row, BACK at a time from its end
            walk_sh = T.alloc_shared((1,), "int32")  # this CTA's walk, decided by gate_statistics
            num_chunks = T.alloc_var("int32")
            first_chunk = T.alloc_var("int32")  # the walk runs chunks first_chunk .. num_chunks - 1
            skipped = T.alloc_var("int32")
            num_chunks = T.ceildiv(eos - bos, C)
            first_chunk = 0
            skipped = 0
            walk_active = T.alloc_var("int32")
            walk_active = 1
            if use_active == FROM_GATES:
                gate_statistics(gcum, flags, exact, active, threshold, bos, eos, num_chunks, n, h, bv, num_seqs,
                                num_v_heads, back_sh, walk_sh)
                walk_active = walk_sh[0]
                T.sync_threads()  # read by every thread before S_sh, laid over walk_sh, is stored
            elif use_active != 0:
                walk_active = active[((bv // (D // BV)) * num_seqs + n) * num_v_heads + h]
            if use_active != 0:
                skipped = T.if_then_else(walk_active >= 1, 0, 1)
                # a >= 1 starts at chunk a - 1; a skipped walk (a = 0) starts past the end
                first_chunk = T.min(T.if_then_else(walk_active >= 1, walk_active - 1, num_chunks), num_chunks)

            K0, K1 = T.alloc_shared((C, D), dtype), T.alloc_shared((C, D), dtype)
            GA0, GA1 = T.alloc_shared((C, C), dtype), T.alloc_shared((C, C), dtype)
            V0, V1 = T.alloc_shared((C, BV), dtype), T.alloc_shared((C, BV), dtype)
            b0, b1 = T.alloc_shared((C,), "float32"), T.alloc_shared((C,), "float32")
            graw0, graw1 = T.alloc_shared((C,), "float32"), T.alloc_shared((C,), "float32")
            gc_sh = T.alloc_shared((C,), "float32")
            bg_sh = T.alloc_shared((C,), "float32")  # beta
            gam_sh = T.alloc_shared((C,), "float32")  # gamma
            S_sh = T.alloc_shared((D, BV), dtype)
            Vd_sh = T.alloc_shared((C, BV), dtype)  # diag(beta) (V - diag(gamma) K S)
            Vs_sh = T.alloc_shared((C, BV), dtype)
            S = T.alloc_fragment((D, BV), "float32")
            Vn = T.alloc_fragment((C, BV), "float32")
            tail = T.alloc_fragment((C,), "float32")  # gamma_last / gamma of each row
            decay = T.alloc_var("float32")  # gamma_last

            # V is read element by element in the accumulator layout (Vd): swizzled, its rows do not share banks
            # (fused_fwd.py); summary walks 1.06x at V tiles 64 and 128, level at 32 (H100, outputs equal)
            T.annotate_layout({V0: make_swizzled_layout(V0), V1: make_swizzled_layout(V1)})
            if walks_v == 0:
                for i, j in T.Parallel(D, BV):
                    S[i, j] = T.if_then_else(i == v0 + j, 1.0, 0.0)
            elif use_h0 != 0:
                T.copy(h0[state_row, 0:D, v0:v0 + BV], S)
            else:
                T.clear(S)
            if skipped != 0:  # a walk nobody reads stores zeros
                T.clear(S)
            T.copy(S, S_sh)
            if first_chunk < num_chunks:
                load_chunk(k, v, GA, beta, gcum, bos + first_chunk * C, hk, h, v0, K0, GA0, V0, b0, graw0)

            for i in T.serial(num_chunks - first_chunk):  # i counts the walk's chunks: its parity picks the stage
                c = first_chunk + i
                t0 = bos + c * C
                n_rows = T.min(C, eos - t0)
                chunk_index = chunk_offsets[n] + c
                if i % 2 == 0:
                    if c + 1 < num_chunks:
                        load_chunk(k, v, GA, beta, gcum, t0 + C, hk, h, v0, K1, GA1, V1, b1, graw1)
                        T.ptx_wait_group(loads)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    chunk_step(h_out, vnew, t0, n_rows, chunk_index, h, v0, store_chunks, walks_v, K0, GA0, V0, b0, graw0, gc_sh,
                               bg_sh, gam_sh, S_sh, Vd_sh, Vs_sh, S, Vn, tail, decay)
                else:
                    if c + 1 < num_chunks:
                        load_chunk(k, v, GA, beta, gcum, t0 + C, hk, h, v0, K0, GA0, V0, b0, graw0)
                        T.ptx_wait_group(loads)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    chunk_step(h_out, vnew, t0, n_rows, chunk_index, h, v0, store_chunks, walks_v, K1, GA1, V1, b1, graw1, gc_sh,
                               bg_sh, gam_sh, S_sh, Vd_sh, Vs_sh, S, Vn, tail, decay)
                T.sync_threads()  # the stage just used is refilled by the next iteration's loads

            if store_ht != 0:
                if walks_v != 0:
                    T.copy(S, ht[state_row, 0:D, v0:v0 + BV])
                else:
                    T.copy(S, mt[state_row, 0:D, v0:v0 + BV])

    return chunk_states
