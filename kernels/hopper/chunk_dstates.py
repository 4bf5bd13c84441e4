"""Reverse state-gradient walk: the only serial part of the GDN backward (docs/algorithm.md B1-B3).

With W = diag(gamma) A diag(beta) K (so (gamma K)^T dVd = W^T dV') and dOs = scale dO, one chunk in
reverse is

    dV' = (Gamma o Q K^T)^T dOs + diag(gamma_last / gamma) K dS
    dS  = gamma_last dS + (diag(gamma) Q)^T dOs - W^T dV'

One CTA per (V tile, sequence, v-head) walks its chunks from the last to the first, dS [128 x block_v]
in fp32 fragments, writing per chunk the gradient of the state leaving it (`dh`, input dtype, at the
chunk's slot chunk_offsets[n] + c; not with `store_dh` = 0: intra-card CP's walks from zero and inter-card
CP's D_p want dS0 alone) and at the end dS0, the gradient of the initial state. The local term
(Gamma o Q K^T)^T dOs needs no state, so its Q K^T product is off the serial chain. With `use_last` the walk
of (n, h) starts from zero at chunk last_chunks[h, n] of its sequence instead of its last chunk (-1: no
chunk, dS0 = 0): intra-card CP's warmed-up walks from zero (flashqla/cp/segments.py, D_j of the heads whose
gates bound the later chunks' reach).

W: at block_v = 128 (one CTA per walk, chosen where the walks fill the GPU) the walk forms W per chunk from
the forward's GA, beta and the gates, W = GA diag(beta gamma) K (Gamma_rs gamma_s = gamma_r), a product
that goes out behind the chain's first two and is read by the last: no `chunk_w` launch and no W tensor
(T x Hv x 256 bytes). At narrower tiles every tile of a walk would form the same W again, and those walks
are latency-bound: they read `chunk_w`'s W (H200, 2026-12-02: the walk with its W 670 -> 583 us at (16, 32)
x 4K x 8, 1291 -> 1134 at (16, 64) x 8K x 4, but 1282 -> 1522 at (2, 8) x 32K x 1 at block_v 32). The
unused operands are stand-ins (`v` for W).

Sequences of any length: in a sequence's last, partial chunk the gates past its end repeat the last
one (factor 1) and the rows past its end are masked out of P, dOs and dV' (they hold the next
sequence's tokens, or zeros past the tensor end: the tile copies are bounds-checked); beta gamma is 0
there, so W's rows past the end are those of finite tiles times 0.

The kernel reads dO itself and applies `scale` in fp32 where dO enters the algebra (on the masked P and
on gamma dO, both formed elementwise anyway), so no scaled copy of dO is made.

The products are asynchronous WGMMA, issued in pairs so that the serial chain (K dS -> dV' -> W^T dV')
is three product stages instead of five: K dS beside Q K^T (with the dh store, gamma dOs and
gamma_last dS formed meanwhile), P^T dOs beside (gamma Q)^T dOs, then W^T dV'. H200, 2026-12-01, with
the same change in chunk_states: whole backward 6.31 -> 5.91 ms at (16, 32) x 32K x 1 sequence,
3.93 -> 3.53 at (2, 8) x 32K x 1, 4.41 -> 4.31 at (16, 32) x 32K x 8 (docs/benchmarks.md).
"""
import tilelang.language as T

from .chunk_states import threads_for

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_chunk_dstates(dtype: str, block_v: int, form_w: bool):
    """Build the walk for `dtype` and V tile `block_v`; with `form_w` it forms W from GA, beta and the gates
    (launch.walk_forms_w chooses), else it reads W."""
    if HEAD_DIM % block_v:
        raise ValueError(f"block_v must divide {HEAD_DIM}, got {block_v}")
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    num_dht = T.dynamic("num_dht")
    num_dh0 = T.dynamic("num_dh0")
    num_last = T.dynamic("num_last")
    C, D, BV = CHUNK, HEAD_DIM, block_v
    threads = threads_for(BV)
    loads = 6 if form_w else 5  # commit groups per chunk (load_chunk)

    @T.macro
    def load_chunk(q, k, w, GA, beta, do, gcum, t0, hk, h, v0, Q_s, K_s, W_s, b_s, dO_s, graw_s):
        """The chunk's tiles, `loads` commit groups: W_s holds GA (and b_s beta) when the walk forms W."""
        T.async_copy(q[t0:t0 + C, hk, 0:D], Q_s)
        T.async_copy(k[t0:t0 + C, hk, 0:D], K_s)
        if form_w:
            T.async_copy(GA[t0:t0 + C, h, 0:C], W_s)
            T.async_copy(beta[t0:t0 + C, h], b_s)
        else:
            T.async_copy(w[t0:t0 + C, h, 0:D], W_s)
        T.async_copy(do[t0:t0 + C, h, v0:v0 + BV], dO_s)
        T.async_copy(gcum[h, t0:t0 + C], graw_s)

    @T.macro
    def chunk_step(dh_out, store_dh, chunk_index, n_rows, h, v0, scale, Q_s, K_s, W_s, b_s, dO_s, graw_s, gc_sh,
                   dS_sh, X_sh, dOg_sh, P_sh, gs_sh, bg_sh, GAbg_sh, Wf_sh, dS, KdS, P, W, tail, decay):
        last = n_rows - 1
        for r in T.Parallel(C):
            gc_sh[r] = graw_s[T.min(r, last)] * LOG2E
            gs_sh[r] = T.exp2(graw_s[T.min(r, last)] * LOG2E) * scale  # gamma of each row, times the output scale
            if form_w:  # beta gamma of each row that exists
                bg_sh[r] = T.if_then_else(r < n_rows, T.exp2(graw_s[T.min(r, last)] * LOG2E) * b_s[T.min(r, last)],
                                          0.0)
        # K dS (the serial chain) and Q K^T issued together (asynchronous WGMMA); the store of dh, gamma dOs
        # and gamma_last dS run while they do (and GA diag(beta gamma), then W = that K goes out behind them)
        T.wgmma_gemm(K_s, dS_sh, KdS, clear_accum=True)
        T.wgmma_gemm(Q_s, K_s, P, transpose_B=True, clear_accum=True)
        if store_dh != 0:
            T.copy(dS_sh, dh_out[chunk_index, h, 0:D, v0:v0 + BV])
        for r, j in T.Parallel(C, BV):
            dOg_sh[r, j] = T.if_then_else(r < n_rows, dO_s[r, j] * gs_sh[r], 0.0)
        for r in T.Parallel(C):
            tail[r] = T.exp2(gc_sh[C - 1] - gc_sh[r])
        decay = T.exp2(gc_sh[C - 1])
        for i, j in T.Parallel(D, BV):
            dS[i, j] = dS[i, j] * decay
        if form_w:
            for r, s in T.Parallel(C, C):
                GAbg_sh[r, s] = T.cast(W_s[r, s] * bg_sh[s], dtype)
            T.fence_proxy_async()
            T.sync_threads()
            T.wgmma_gemm(GAbg_sh, K_s, W, clear_accum=True)
            T.wait_wgmma(1)  # K dS and Q K^T (W may still run)
        else:
            T.wait_wgmma(0)
        T.warpgroup_fence_operand(KdS, num_regs=C * BV // threads)
        T.warpgroup_fence_operand(P, num_regs=C * C // threads)
        # scale (Gamma o Q K^T) over the rows that exist; with it P^T dO = P^T dOs
        for r, s in T.Parallel(C, C):
            P[r, s] = T.Select(r < n_rows and r >= s, P[r, s] * T.exp2(gc_sh[r] - gc_sh[s]) * scale, 0.0)
        T.copy(P, P_sh)
        for r, j in T.Parallel(C, BV):
            KdS[r, j] = KdS[r, j] * tail[r]
        T.sync_threads()

        # dV' = P^T dOs + diag(gamma_last / gamma) K dS (chain), with dS += (gamma Q)^T dOs alongside
        T.wgmma_gemm(P_sh, dO_s, KdS, transpose_A=True)
        T.wgmma_gemm(Q_s, dOg_sh, dS, transpose_A=True)
        if form_w:
            T.wait_wgmma(2)  # W: to shared memory while dV' is computed
            T.warpgroup_fence_operand(W, num_regs=C * D // threads)
            T.copy(W, Wf_sh)
        T.wait_wgmma(1)
        T.warpgroup_fence_operand(KdS, num_regs=C * BV // threads)
        for r, j in T.Parallel(C, BV):
            KdS[r, j] = T.if_then_else(r < n_rows, -KdS[r, j], 0.0)  # dV', negated for the W^T product
        T.copy(KdS, X_sh)
        T.fence_proxy_async()
        T.sync_threads()

        # dS = gamma_last dS + (gamma Q)^T dOs - W^T dV'
        T.wgmma_gemm(Wf_sh if form_w else W_s, X_sh, dS, transpose_A=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(dS, num_regs=D * BV // threads)
        T.copy(dS, dS_sh)

    @T.prim_func
    def chunk_dstates(
        q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        w: T.Tensor((num_tokens, num_v_heads, D), dtype),
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
        with T.Kernel(D // BV, num_seqs, num_v_heads, threads=threads_for(BV)) as (bv, n, h):
            hk = T.alloc_var("int32")
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            hk = h // (num_v_heads // num_qk_heads)
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            v0 = bv * BV
            state_row = n * num_v_heads + h
            num_chunks = T.alloc_var("int32")  # the walk runs chunks num_chunks - 1 .. 0
            num_chunks = T.ceildiv(eos - bos, C)
            if use_last != 0:  # a warmed-up walk from zero: its sequence's chunks last_chunks[h, n] .. 0 only
                num_chunks = T.min(num_chunks, last_chunks[h * num_seqs + n] + 1)

            Q0, Q1 = T.alloc_shared((C, D), dtype), T.alloc_shared((C, D), dtype)
            K0, K1 = T.alloc_shared((C, D), dtype), T.alloc_shared((C, D), dtype)
            # per stage: GA and beta when the walk forms W, else W
            W0, W1 = (T.alloc_shared((C, C if form_w else D), dtype) for _ in range(2))
            b0, b1 = (T.alloc_shared((C,), "float32") for _ in range(2))
            dO0, dO1 = T.alloc_shared((C, BV), dtype), T.alloc_shared((C, BV), dtype)
            graw0, graw1 = T.alloc_shared((C,), "float32"), T.alloc_shared((C,), "float32")
            gc_sh = T.alloc_shared((C,), "float32")
            gs_sh = T.alloc_shared((C,), "float32")
            dS_sh = T.alloc_shared((D, BV), dtype)
            X_sh = T.alloc_shared((C, BV), dtype)
            dOg_sh = T.alloc_shared((C, BV), dtype)
            P_sh = T.alloc_shared((C, C), dtype)
            bg_sh = T.alloc_shared((C,), "float32")  # beta gamma (forming W)
            GAbg_sh = T.alloc_shared((C, C), dtype)  # GA diag(beta gamma) (forming W)
            Wf_sh = T.alloc_shared((C, D), dtype)  # the W formed (forming W)
            dS = T.alloc_fragment((D, BV), "float32")
            KdS = T.alloc_fragment((C, BV), "float32")
            P = T.alloc_fragment((C, C), "float32")
            W = T.alloc_fragment((C, D), "float32")  # forming W
            tail = T.alloc_fragment((C,), "float32")  # gamma_last / gamma of each row
            decay = T.alloc_var("float32")  # gamma_last

            if use_dht != 0:
                T.copy(dht[state_row, 0:D, v0:v0 + BV], dS)
            else:
                T.clear(dS)
            T.copy(dS, dS_sh)
            if num_chunks > 0:
                load_chunk(q, k, w, GA, beta, do, gcum, bos + (num_chunks - 1) * C, hk, h, v0, Q0, K0, W0, b0, dO0,
                           graw0)

            for i in T.serial(num_chunks):
                c = num_chunks - 1 - i
                chunk_index = chunk_offsets[n] + c
                n_rows = T.min(C, eos - bos - c * C)  # < C only in the sequence's last chunk
                if i % 2 == 0:
                    if i + 1 < num_chunks:
                        load_chunk(q, k, w, GA, beta, do, gcum, bos + (c - 1) * C, hk, h, v0, Q1, K1, W1, b1, dO1,
                                   graw1)
                        T.ptx_wait_group(loads)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    chunk_step(dh_out, store_dh, chunk_index, n_rows, h, v0, scale, Q0, K0, W0, b0, dO0, graw0, gc_sh,
                               dS_sh, X_sh, dOg_sh, P_sh, gs_sh, bg_sh, GAbg_sh, Wf_sh, dS, KdS, P, W, tail, decay)
                else:
                    if i + 1 < num_chunks:
                        load_chunk(q, k, w, GA, beta, do, gcum, bos + (c - 1) * C, hk, h, v0, Q0, K0, W0, b0, dO0,
                                   graw0)
                        T.ptx_wait_group(loads)
                    else:
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    chunk_step(dh_out, store_dh, chunk_index, n_rows, h, v0, scale, Q1, K1, W1, b1, dO1, graw1, gc_sh,
                               dS_sh, X_sh, dOg_sh, P_sh, gs_sh, bg_sh, GAbg_sh, Wf_sh, dS, KdS, P, W, tail, decay)
                T.sync_threads()

            if store_dh0 != 0:
                T.copy(dS, dh0[state_row, 0:D, v0:v0 + BV])

    return chunk_dstates
