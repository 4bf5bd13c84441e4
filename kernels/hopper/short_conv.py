"""Causal depthwise short convolution (+ SiLU) over packed sequences, forward and backward.

The math (flashqla/layers/conv.py is the reference; ext = a sequence's tokens after its own prefix rows):

    pre[t] = sum_j w[j] ext[t - H + j]            fp32 accumulate, rounded to the input dtype
    y[t]   = silu(pre[t])                          (the host runs a conv without SiLU in torch)

Backward, with dp = dy * silu'(pre) rounded to the input dtype (as autograd of the reference rounds it):

    dx[s]         = sum_j w[j] dp[s + H - j]       terms whose row s + H - j lies in s's sequence
    dprefix[n, i] = sum_{j <= i} w[j] dp[start_n + i - j]      (same restriction)
    dw[j]         = sum_t dp[t] ext[t - H + j]     per-CTA partial sums, added by the host

Every kernel has W = 4 taps (H = 3 halo rows): the host runs a narrower conv (W = 2, 3) by padding the
weight with leading zero taps and the prefix with leading zero rows, so one kernel per dtype serves
every width (a zero tap adds nothing to y or dx, and the padded rows of dprefix and dw are dropped).

Tiling: one CTA per (64 token rows, 256 channels; 128 for fp32), its rows loaded once into shared memory
with the H rows before them (forward), or H rows on both sides (backward, which recomputes `pre` of the
H rows after the block too). A row finds its sequence by a binary search of cu_seqlens (one thread per
row). Rows past T and channels past C load as zeros and are never stored. The compute loops give each
thread one 16-byte channel vector of a row: a row whose window lies inside its sequence (all but the
first H rows of a sequence) takes a branch without conditions; in the other branch a tap before the
sequence start reads the prefix row from global memory instead of the shared tile, so no window reads
another sequence's tokens. A backward CTA walks `blocks_per_cta` consecutive token blocks (runtime),
each thread accumulating dw of its channel vector in registers, summed over the CTA's row groups once
at the end (per-CTA partials stay few); dprefix of sequence n is written by the CTA whose block holds
n's first token (the host zero-fills it for sequences without tokens). Launch bounds cap the registers
at 4 CTAs per SM (forward) and 2 (backward, ~107 KB of shared memory for bf16).

Channels are contiguous: tensors are seen as [..., C / VEC, VEC] with VEC channels per 16 bytes (the
host requires C % VEC == 0), so the main loads and stores are coalesced 16-byte accesses.

H200, bf16, T = 32768, C = 8192, 8 sequences (benchmarks/bench_layer_ops.py, 2026-11-30): forward
0.53 ms (42% of the 4.8 TB/s floor), backward 1.56 ms (22%); torch reference 7.97 / 10.04 ms.
"""
import tilelang.language as T

from .chunk_map import sequence_of_chunk

WIDTH = 4
HALO = WIDTH - 1
BLOCK_T = 64
THREADS = 256


def vec_for(dtype: str) -> int:
    """Channels per 16-byte vector: tensors are seen as [..., C / VEC, VEC] so every access is a 16-byte
    load or store (the host requires C % VEC == 0)."""
    return 4 if dtype == "float32" else 8


def block_c_for(dtype: str) -> int:
    """Channels per CTA: 256 for 16-bit inputs, 128 for fp32 (32 channel vectors, 8 rows per pass of 256 threads)."""
    return 128 if dtype == "float32" else 256


@T.macro
def _row_sequences(cu_seqlens, num_seqs, num_tokens, t0, rows, search_steps, seq_sh, start_sh):
    """seq_sh[r], start_sh[r]: sequence and first token of row t0 + r, for r < rows (rows <= THREADS)."""
    tx = T.get_thread_binding()
    if tx < rows:
        n = sequence_of_chunk(cu_seqlens, num_seqs, T.min(t0 + tx, num_tokens - 1), search_steps)
        seq_sh[tx] = n
        start_sh[tx] = cu_seqlens[n]


@T.macro
def _load_rows(src, dst, first, head, main, tail, num_tokens, cv0, channel_vecs):
    """dst[r] = src[first + r] for r < head + main + tail (zeros outside the tensor): the `main` rows (a
    multiple of the thread count in 16-byte vectors) in one vectorised loop, the halo rows in short
    scalar loops."""
    for part_start, part_rows in ((0, head), (head, main), (head + main, tail)):
        if part_rows > 0:
            for r, cv, v in T.Parallel(part_rows, dst.shape[1], dst.shape[2]):
                s = first + part_start + r
                dst[part_start + r, cv, v] = T.if_then_else(
                    s >= 0 and s < num_tokens and cv0 + cv < channel_vecs, src[s, cv0 + cv, v], T.cast(0, dst.dtype))


def _rnd(value, dtype):
    """An fp32 value rounded to `dtype` and back (the reference computes the conv in x's dtype)."""
    return T.cast(T.cast(value, dtype), "float32")


def _silu(pre):
    return pre / (1.0 + T.exp(-pre))


def _window(W_sh, X_sh, r, cv, v, t, start, prefix, seq, cg):
    """fp32 sum_j W_sh[j] ext[t - H + j] for token t (X_sh row r + j holds token t - H + j) of the sequence
    `seq` starting at `start`: a tap before the start reads prefix row t + j - start (channel vector cg).
    Plain Python: the taps are unrolled while the kernel is built."""
    acc = W_sh[HALO, cv, v] * T.cast(X_sh[r + HALO, cv, v], "float32")  # token t itself
    for j in range(HALO):
        acc = acc + W_sh[j, cv, v] * T.if_then_else(t - HALO + j >= start, T.cast(X_sh[r + j, cv, v], "float32"),
                                                     T.cast(prefix[seq, t + j - start, cg, v], "float32"))
    return acc


def _window_inside(W_sh, X_sh, r, cv, v):
    """_window for a token whose whole window lies in its sequence (no prefix taps, no conditions)."""
    acc = W_sh[HALO, cv, v] * T.cast(X_sh[r + HALO, cv, v], "float32")
    for j in range(HALO):
        acc = acc + W_sh[j, cv, v] * T.cast(X_sh[r + j, cv, v], "float32")
    return acc


def _silu_grad(dy, pre):
    """dy * silu'(pre) in fp32 (torch's silu_backward formula)."""
    sig = 1.0 / (1.0 + T.exp(-pre))
    return T.cast(dy, "float32") * sig * (1.0 + pre * (1.0 - sig))


def _back_taps(W_sh, DP_sh, seq_sh, k, i, cv, v):
    """fp32 sum_{j <= i} W_sh[j] DP_sh[k + i - j] over the rows k + i - j in row k's sequence: the gradient
    of the token read by tap H of row k (i = H: dx) or of its sequence's prefix row i (row k its start).
    Plain Python over j: unrolled while the kernel is built; `i` may be a loop variable."""
    acc = T.float32(0)
    for j in range(HALO + 1):
        term = T.if_then_else(seq_sh[k + i - j] == seq_sh[k],
                              W_sh[j, cv, v] * T.cast(DP_sh[k + i - j, cv, v], "float32"), 0.0)
        if isinstance(i, int):
            acc = acc + term if j <= i else acc
        else:
            acc = acc + T.if_then_else(j <= i, term, 0.0)
    return acc


def _back_taps_inside(W_sh, DP_sh, k, cv, v):
    """_back_taps(i = H) for a row whose next H rows are in its sequence (no masks)."""
    acc = W_sh[HALO, cv, v] * T.cast(DP_sh[k, cv, v], "float32")
    for j in range(HALO):
        acc = acc + W_sh[j, cv, v] * T.cast(DP_sh[k + HALO - j, cv, v], "float32")
    return acc


@T.macro
def _dp_rows(W_sh, X_sh, DP_sh, rows, t0, start_sh, seq_sh, prefix, num_tokens, cv0):
    """DP_sh[k] (holding dy) <- dy * silu'(pre) in place for k < rows; zero past T. One 16-byte channel
    vector per thread and row; rows whose window starts inside their sequence (all but the first H of
    a sequence) take the branch without prefix taps."""
    dtype = DP_sh.dtype
    bcv, vec = int(DP_sh.shape[1]), int(DP_sh.shape[2])
    tx = T.get_thread_binding()
    cv = tx % bcv
    for i in T.serial((rows + THREADS // bcv - 1) // (THREADS // bcv)):
        k = i * (THREADS // bcv) + tx // bcv
        t = t0 + k
        if k < rows:
            if t >= num_tokens:
                for v in T.vectorized(vec):
                    DP_sh[k, cv, v] = T.cast(0, dtype)
            elif t - HALO >= start_sh[k]:
                for v in T.vectorized(vec):
                    DP_sh[k, cv, v] = T.cast(_silu_grad(DP_sh[k, cv, v], _rnd(
                        _window_inside(W_sh, X_sh, k + HALO, cv, v), dtype)), dtype)
            else:
                for v in T.vectorized(vec):
                    DP_sh[k, cv, v] = T.cast(_silu_grad(DP_sh[k, cv, v], _rnd(
                        _window(W_sh, X_sh, k + HALO, cv, v, t, start_sh[k], prefix, seq_sh[k], cv0 + cv), dtype)),
                        dtype)


@T.macro
def _dw_rows(X_sh, DP_sh, dw_loc, rows, t0, start_sh, seq_sh, prefix, cv0):
    """dw_loc[j, v] += sum over this thread's rows k of dp[k] ext[t0 + k - H + j] (its channel vector,
    every THREADS / BCV-th row); a tap before the sequence start reads the prefix."""
    bcv, vec = int(DP_sh.shape[1]), int(DP_sh.shape[2])
    tx = T.get_thread_binding()
    cv = tx % bcv
    for i in T.serial(rows // (THREADS // bcv)):
        k = i * (THREADS // bcv) + tx // bcv
        t = t0 + k
        for j in T.unroll(WIDTH):
            if t - HALO + j >= start_sh[k]:
                for v in T.vectorized(vec):
                    dw_loc[j, v] += T.cast(DP_sh[k, cv, v], "float32") * T.cast(X_sh[k + HALO + j, cv, v], "float32")
            else:
                for v in T.vectorized(vec):
                    dw_loc[j, v] += T.cast(DP_sh[k, cv, v], "float32") * T.cast(
                        prefix[seq_sh[k], t + j - start_sh[k], cv0 + cv, v], "float32")


def _sum_rows(RED_sh, j, cv, v):
    """sum over the row groups g of RED_sh[g, j, cv, v] (unrolled while building)."""
    acc = RED_sh[0, j, cv, v]
    for g in range(1, int(RED_sh.shape[0])):
        acc = acc + RED_sh[g, j, cv, v]
    return acc


@T.macro
def _load_weight(weight, W_sh, cv0, channel_vecs):
    for j, cv, v in T.Parallel(WIDTH, W_sh.shape[1], W_sh.shape[2]):
        W_sh[j, cv, v] = T.if_then_else(cv0 + cv < channel_vecs, weight[cv0 + cv, v, j], 0.0)


def build_short_conv_fwd(dtype: str):
    """y [T, C] = silu(conv(x)) for x [T, C] in `dtype`; weight fp32 [C, 4]; prefix [N, 3, C] in `dtype`."""
    num_tokens = T.dynamic("num_tokens")
    channel_vecs = T.dynamic("channel_vecs")
    num_seqs = T.dynamic("num_seqs")
    H, BT, V = HALO, BLOCK_T, vec_for(dtype)
    BCV = block_c_for(dtype) // V

    @T.prim_func
    def short_conv_fwd(
        x: T.Tensor((num_tokens, channel_vecs, V), dtype),
        weight: T.Tensor((channel_vecs, V, WIDTH), "float32"),
        prefix: T.Tensor((num_seqs, H, channel_vecs, V), dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        y: T.Tensor((num_tokens, channel_vecs, V), dtype),
        search_steps: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, BT), T.ceildiv(channel_vecs, BCV), threads=THREADS) as (bt, bc):
            T.annotate_min_blocks_per_sm(4)  # <= 64 registers: 4 CTAs (32 warps) per SM
            X_sh = T.alloc_shared((H + BT, BCV, V), dtype)  # tokens t0 - H .. t0 + BT - 1
            W_sh = T.alloc_shared((WIDTH, BCV, V), "float32")
            seq_sh = T.alloc_shared((BT,), "int32")
            start_sh = T.alloc_shared((BT,), "int32")
            t0 = bt * BT
            cv0 = bc * BCV

            _row_sequences(cu_seqlens, num_seqs, num_tokens, t0, BT, search_steps, seq_sh, start_sh)
            _load_rows(x, X_sh, t0 - H, H, BT, 0, num_tokens, cv0, channel_vecs)
            _load_weight(weight, W_sh, cv0, channel_vecs)
            T.sync_threads()

            # one 16-byte channel vector per thread and row (explicit threads, so the prefix branch of the
            # first H rows of a sequence is a real branch, not a guarded load every row pays for)
            tx = T.get_thread_binding()
            cv = tx % BCV
            for i in T.serial(BT * BCV // THREADS):
                r = i * (THREADS // BCV) + tx // BCV
                t = t0 + r
                if t < num_tokens and cv0 + cv < channel_vecs:
                    if t - H >= start_sh[r]:  # the window lies in the sequence: no prefix taps
                        for v in T.vectorized(V):
                            y[t, cv0 + cv, v] = T.cast(_silu(_rnd(_window_inside(W_sh, X_sh, r, cv, v), dtype)), dtype)
                    else:
                        for v in T.vectorized(V):
                            y[t, cv0 + cv, v] = T.cast(_silu(_rnd(_window(W_sh, X_sh, r, cv, v, t, start_sh[r], prefix,
                                                                          seq_sh[r], cv0 + cv), dtype)), dtype)

    return short_conv_fwd


def build_short_conv_bwd(dtype: str):
    """dx [T, C] in `dtype`, dprefix fp32 [N, 3, C] (rows of sequences with tokens) and dw partial sums
    fp32 [G, C, 4] (one per CTA row of the grid) from dy [T, C], recomputing the conv."""
    num_tokens = T.dynamic("num_tokens")
    channel_vecs = T.dynamic("channel_vecs")
    num_seqs = T.dynamic("num_seqs")
    num_groups = T.dynamic("num_groups")
    H, BT, V = HALO, BLOCK_T, vec_for(dtype)
    BCV = block_c_for(dtype) // V

    @T.prim_func
    def short_conv_bwd(
        x: T.Tensor((num_tokens, channel_vecs, V), dtype),
        weight: T.Tensor((channel_vecs, V, WIDTH), "float32"),
        prefix: T.Tensor((num_seqs, H, channel_vecs, V), dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        dy: T.Tensor((num_tokens, channel_vecs, V), dtype),
        dx: T.Tensor((num_tokens, channel_vecs, V), dtype),
        dprefix: T.Tensor((num_seqs, H, channel_vecs, V), "float32"),
        dw_part: T.Tensor((num_groups, channel_vecs, V, WIDTH), "float32"),
        search_steps: T.int32,
        blocks_per_cta: T.int32,
    ):
        with T.Kernel(num_groups, T.ceildiv(channel_vecs, BCV), threads=THREADS) as (group, bc):
            T.annotate_min_blocks_per_sm(2)  # <= 128 registers: 2 CTAs per SM
            X_sh = T.alloc_shared((2 * H + BT + H, BCV, V), dtype)  # tokens t0 - 2H .. t0 + BT + H - 1
            DP_sh = T.alloc_shared((BT + H, BCV, V), dtype)  # dy, then dp, of tokens t0 .. t0 + BT + H - 1
            W_sh = T.alloc_shared((WIDTH, BCV, V), "float32")
            seq_sh = T.alloc_shared((BT + H,), "int32")
            start_sh = T.alloc_shared((BT + H,), "int32")
            dw_loc = T.alloc_local((WIDTH, V), "float32")  # this thread's dw partial: one channel vector
            RED_sh = T.alloc_shared((THREADS // BCV, WIDTH, BCV, V), "float32")
            cv0 = bc * BCV

            for j in T.unroll(WIDTH):
                for v in T.vectorized(V):
                    dw_loc[j, v] = 0.0
            _load_weight(weight, W_sh, cv0, channel_vecs)
            for blk in T.serial(blocks_per_cta):
                t0 = (group * blocks_per_cta + blk) * BT
                if t0 < num_tokens:
                    _row_sequences(cu_seqlens, num_seqs, num_tokens, t0, BT + H, search_steps, seq_sh, start_sh)
                    _load_rows(x, X_sh, t0 - 2 * H, 2 * H, BT, H, num_tokens, cv0, channel_vecs)
                    _load_rows(dy, DP_sh, t0, 0, BT, H, num_tokens, cv0, channel_vecs)
                    T.sync_threads()

                    _dp_rows(W_sh, X_sh, DP_sh, BT + H, t0, start_sh, seq_sh, prefix, num_tokens, cv0)
                    T.sync_threads()

                    # dx[s] = sum_j w[j] dp[s + H - j]; a row whose next H rows are in its sequence needs no masks
                    for k, cv, v in T.Parallel(BT, BCV, V):
                        if t0 + k < num_tokens and cv0 + cv < channel_vecs:
                            if seq_sh[k + H] == seq_sh[k]:
                                dx[t0 + k, cv0 + cv, v] = T.cast(_back_taps_inside(W_sh, DP_sh, k, cv, v), dtype)
                            else:
                                dx[t0 + k, cv0 + cv, v] = T.cast(_back_taps(W_sh, DP_sh, seq_sh, k, H, cv, v), dtype)

                    for k, cv, v in T.Parallel(BT, BCV, V):  # rows where a sequence starts
                        if t0 + k < num_tokens and start_sh[k] == t0 + k and cv0 + cv < channel_vecs:
                            for i in T.serial(H):
                                dprefix[seq_sh[k], i, cv0 + cv, v] = _back_taps(W_sh, DP_sh, seq_sh, k, i, cv, v)

                    _dw_rows(X_sh, DP_sh, dw_loc, BT, t0, start_sh, seq_sh, prefix, cv0)
                    T.sync_threads()  # the next block overwrites the tiles

            # sum the threads' partials over their row groups
            tx = T.get_thread_binding()
            for j in T.unroll(WIDTH):
                for v in T.vectorized(V):
                    RED_sh[tx // BCV, j, tx % BCV, v] = dw_loc[j, v]
            T.sync_threads()
            for j, cv, v in T.Parallel(WIDTH, BCV, V):
                if cv0 + cv < channel_vecs:
                    dw_part[group, cv0 + cv, v, j] = _sum_rows(RED_sh, j, cv, v)

    return short_conv_bwd
