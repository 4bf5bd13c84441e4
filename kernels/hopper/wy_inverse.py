"""Per-chunk gate-free WY inverse and chunk-local cumulative gate (design doc §2).

For every 64-token chunk of every packed sequence and every v-head h (reading k-head h // (Hv/Hqk)):

    A    = (I + StrictLower(diag(beta) K K^T))^{-1}                     [64 x 64]
    GA   = Gamma o A                                                   [64 x 64], every walk's operand
    gcum = cumsum_{t <= r} g_t                                         [64], fp32, natural log,
                                                                       stored head-major [Hv, T]

GA is stored in the input dtype. The lower-triangular decay mask Gamma (exp2 of base-2 gate differences,
each <= 0) is applied before the one rounding to the input dtype, so the walks use GA as it is (beta
scales the rows of the V tile it multiplies: V' = GA diag(beta) Vd, fused_fwd.py, chunk_states.py). GA
keeps beta out so that the backward can read it as well (chunk_bwd_local.py: every A term there has an
exact GA form, and a column scaled by beta = 0 could not be undone): a forward whose backward will run
keeps GA and gcum, and the backward computes no second inverse. W = diag(gamma) A diag(beta) K and U =
GA diag(beta) V (docs/algorithm.md W1-W2) are not formed here or anywhere: the walks form what they need of
them from GA. K K^T is kept in shared memory over K's bytes (32.5 KiB in all for one v-head, 36 with the shared
build's gate rows): both builds fit 80 registers and 6 CTAs per SM without spills. The inverse needs no exp; the
gates enter only GA.

L = StrictLower(diag(beta) K K^T) is never formed: each step reads only strictly lower elements of K K^T (the
diagonal blocks' rows left of the diagonal, the lower-left blocks) and scales the rows of its result by beta,
so a CTA that inverts for several v-heads (the shared build) stores K K^T once instead of one L per v-head.
H100, 2026-12-07 (Nsight Compute, docs/kernels.md "Fifty-ninth session"): the kernel was bound by shared-memory
throughput (L1 81-93%), and the per-v-head L (a conflicted store of the K K^T accumulator, a shared load of
beta per element) was 23% of its stall samples; its fragment also held the shared build at 96 registers, 5 CTAs
per SM (at 80 it spilled). Kernel alone against that form, same process (GA within 1.1e-4, the fp32 inverse's
roundings in another order before bf16; gcum and beta's copy bitwise): (2, 8) x 32K 57.4 -> 48.1 us, (16, 64) x 8K x 4
381.0 -> 311.2, (16, 32) x 4K x 8 212.1 -> 177.6, (8, 24) x 32K 148.8 -> 122.3, one-v-head (32, 32) x 32K 216.8 ->
202.2, with GA's loads made conflict-free (step 5) and the heads rule at 6 CTAs per SM.

A CTA takes one chunk and one v-head, or, in the `shared_k` build, `heads_per_cta` v-heads of one GQA group
(launch.wy_heads_per_cta: the most of the group that still leaves 1.5 waves of CTAs, or a pair one), which share K: K is
loaded and K K^T formed once, then the inverse runs for each of its v-heads (their beta, gates and GA). The
one-v-head build reads its gates while K is in flight (the shared build at one v-head per CTA, which reads
them after, was 0.95-0.97x it at (16, 16) and (32, 32) x 32K). H200, 2026-12-04, against the one-v-head kernel
alone: (16, 64) x 8K x 4 442 -> 389 us (4 v-heads per CTA), (2, 8) x 4K x 8 59.7 -> 54.8 (4), (8, 24) x 32K
163 -> 150 (3), (16, 32) x 4K x 8 227 -> 211 (2); GA and gcum bitwise equal (docs/kernels.md, "Thirty-third
session"). The shared build reads the gates of all its v-heads (up to MAX_HEADS, a row each) while K is in
flight and scans them in one 2-D cumsum, instead of each v-head's before its inverse behind two CTA barriers of
its own: H100, 2026-12-06, kernel alone, GA, gcum and beta's copy bitwise equal: (16, 32) x 4K x 8 235.8 -> 211.0
us, (8, 24) x 32K 161.6 -> 151.5, (2, 8) x 32K 60.9 -> 58.5, (16, 64) x 8K x 4 390.3 -> 379.4, (2, 8) x 4K x 8
57.1 -> 55.6, (2, 8) x 16K 31.0 -> 31.2 (docs/kernels.md, "Fifty-second session"). The one-v-head build is
unchanged.

Chunks never straddle sequences. The CTA of chunk slot c finds its sequence by binary search in
`chunk_offsets` (exclusive prefix sum of chunks per sequence; `search_steps` = bit length of N); CTAs past
the last chunk and rows past the end of a sequence write nothing. Rows past the end are loaded as zero
keys, so they cannot reach the rows that exist (A is lower triangular).

Schedule (one warpgroup, 128 threads; the K tile and K K^T once per CTA, the rest once per v-head):
  1. load the K tile (rows beyond the sequence end zeroed) and form K K^T on tensor cores (fp32
     accumulate), stored to fp32 shared memory over K; read beta and g, cumsum g and store gcum (X, the
     inverse, is written in full by steps 2-4 before it is read: no identity fill);
  2. invert the four 16x16 diagonal blocks of I + L by fp32 forward substitution, one column per
     thread held in registers (64 threads, no barrier inside the substitution; two partial sums per row,
     x_i = e_i - beta_i sum_{j<i} (K K^T)_ij x_j);
  3. merge 16 -> 32: X21 = -D1^{-1} L21 D0^{-1} for both 32-blocks (fp32, each thread 4 rows of a column);
  4. merge 32 -> 64: X21 = -P1^{-1} L21 P0^{-1}, two 32 x 32 x 32 products on tensor cores (TF32 mma.sync
     from the fp32 tiles, fp32 accumulation); both merges form L21 X11 as diag(beta) ((K K^T)21 X11) and stage
     it in the upper-right block of X (zero in X; the 16 x 16 blocks zeroed again after use, as the 32 -> 64
     products read them);
  5. mask by Gamma and store GA straight from X's tile (4 columns of a row in each half per thread, two
     8-byte stores, no branch).
Steps 2-4 on CUDA cores in fp32 replaced a barrier per substituted row and TF32 tensor-core merges with
staging copies (H200, 2026-11-30: 0.34 -> 0.24 ms at (2, 8) x 32K tokens, 1.25 -> 0.94 ms at (16, 32)).
The 32 -> 64 merge, 65K of the CTA's FMAs and 29% of its time there, went back to TF32 tensor cores as two
`T.gemm` on regions of the fp32 tiles (no staging copies): forward build 748 -> 595 us at (16, 64) x 8K x 4,
GA against a float64 inverse 2.09e-4 -> 2.20e-4 relative (the bf16 rounding of GA dominates; o against the
float64 torch backend 3.97e-3 -> 3.98e-3), docs/kernels.md "Eighteenth session". The gates read
during the K load, beta folded into L, two partial sums in the substitution and GA stored from X's tile without the branchy per-element
staging pass (one thread per column, a divergent branch and a 2-byte shared store per element), then X's
identity fill dropped: 570 -> 460 -> 438 us at (16, 64) x 8K x 4, 294 -> 236 -> 226 at (16, 32) x 4K x 8,
75 -> 60 -> 57 at (2, 8) x 32K (H200, 2026-12-02; GA within 1.1e-6 of before, the substitution's summation
order; FlashQLA 0.1.3's kkt_solve + chunk cumsum on the same inputs 450, 227, 62), docs/kernels.md
"Twenty-first session".
"""
import tilelang.language as T

from .chunk_map import chunk_of_slot
from .launch import WY_MAX_HEADS_PER_CTA as MAX_HEADS  # the shared build's gate rows

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_wy_inverse(dtype: str, shared_k: bool, copy_beta: bool):
    """Build the prim_func for q/k/v dtype `dtype` ("bfloat16" or "float16"); all sizes are dynamic. With
    `shared_k` a CTA takes `heads_per_cta` v-heads of one GQA group, else one v-head (and `heads_per_cta` must
    be 1): its gates then load while K is in flight. With `copy_beta` beta comes in `dtype` and the kernel
    writes the fp32 copy the walks read (`beta32`) as it reads it, in place of a conversion launch before it
    (~4 us at (2, 8) x 32K on an H100); without, beta is fp32 and `beta32` is not touched."""
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    C, D = CHUNK, HEAD_DIM

    @T.macro
    def load_gates(beta, beta32, g, gcum, beta_sh, g_sh, start, n_rows, last, h):
        """beta and the chunk-local cumsum of g to shared memory (zero past the sequence end); gcum stored, and
        with `copy_beta` beta's fp32 copy."""
        for r in T.Parallel(C):
            beta_sh[r] = T.if_then_else(r < n_rows, T.cast(beta[start + T.min(r, last), h], "float32"), 0.0)
            g_sh[r] = T.if_then_else(r < n_rows, g[start + T.min(r, last), h], 0.0)
        T.cumsum(src=g_sh, dst=g_sh, dim=0)
        for r in T.Parallel(C):
            if r < n_rows:
                gcum[h, start + r] = g_sh[r]
                if copy_beta:
                    beta32[start + r, h] = beta_sh[r]

    @T.macro
    def load_group_gates(beta, beta32, g, gcum, beta_all, g_all, start, n_rows, last, h0, heads):
        """load_gates for the `heads` v-heads from h0 at once (rows past `heads` zero), one scan over them."""
        for hh, r in T.Parallel(MAX_HEADS, C):
            beta_all[hh, r] = T.if_then_else(hh < heads and r < n_rows,
                                             T.cast(beta[start + T.min(r, last), h0 + T.min(hh, heads - 1)],
                                                    "float32"), 0.0)
            g_all[hh, r] = T.if_then_else(hh < heads and r < n_rows,
                                          g[start + T.min(r, last), h0 + T.min(hh, heads - 1)], 0.0)
        T.cumsum(src=g_all, dst=g_all, dim=1)
        for hh, r in T.Parallel(MAX_HEADS, C):
            if hh < heads and r < n_rows:
                gcum[h0 + hh, start + r] = g_all[hh, r]
                if copy_beta:
                    beta32[start + r, h0 + hh] = beta_all[hh, r]

    @T.prim_func
    def wy_inverse(
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        beta: T.Tensor((num_tokens, num_v_heads), dtype if copy_beta else "float32"),
        beta32: T.Tensor((num_tokens, num_v_heads), "float32"),
        g: T.Tensor((num_tokens, num_v_heads), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        GA: T.Tensor((num_tokens, num_v_heads, C), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        num_chunk_slots: T.int32,
        search_steps: T.int32,
        heads_per_cta: T.int32,
    ):
        with T.Kernel(num_chunk_slots * (num_v_heads // heads_per_cta) if shared_k else num_chunk_slots,
                      1 if shared_k else num_v_heads, threads=128) as (cta, hv):
            # 6 CTAs per SM: <= 85 registers (80 allocated), which both builds meet without spills
            T.annotate_min_blocks_per_sm(6)
            chunk = T.alloc_var("int32")
            h0 = T.alloc_var("int32")  # the CTA's first v-head
            h = T.alloc_var("int32")  # the v-head in work
            if shared_k:  # CTA -> (chunk, heads_per_cta v-heads of one GQA group), the head blocks fastest
                chunk = cta // (num_v_heads // heads_per_cta)
                h0 = cta % (num_v_heads // heads_per_cta) * heads_per_cta
            else:
                chunk = cta
                h0 = hv
            hk = h0 // (num_v_heads // num_qk_heads)

            K_sh = T.alloc_shared((C, D), dtype)
            if shared_k:  # every v-head's gates of the CTA (row: v-head), read while K is in flight
                beta_sh = T.alloc_shared((MAX_HEADS, C), "float32")
                g_sh = T.alloc_shared((MAX_HEADS, C), "float32")
            else:
                beta_sh = T.alloc_shared((C,), "float32")
                g_sh = T.alloc_shared((C,), "float32")
            KKt = T.alloc_fragment((C, C), "float32")
            KKt_sh = T.alloc_shared((C, C), "float32")  # K K^T for every v-head of the CTA (over K's bytes)
            X_sh = T.alloc_shared((C, C), "float32")
            X_row = T.alloc_local((8,), "float32")  # step 5: 8 columns of one row of X, their gates, of GA
            g_cols = T.alloc_local((8,), "float32")
            GA_row = T.alloc_local((8,), dtype)
            col = T.alloc_local((16,), "float32")  # step 3: this thread's column of a diagonal block
            acc = T.alloc_local((4,), "float32")
            Y = T.alloc_fragment((32, 32), "float32")  # step 4's products

            # --- which sequence and chunk this CTA owns -------------------------------------------
            seq, start, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)

            # --- K and K K^T, once for the CTA's v-heads (one GQA group shares K); one v-head's gates meanwhile ----
            T.async_copy(k[start:start + C, hk, 0:D], K_sh)
            if shared_k:
                load_group_gates(beta, beta32, g, gcum, beta_sh, g_sh, start, n_rows, last, h0, heads_per_cta)
            else:
                load_gates(beta, beta32, g, gcum, beta_sh, g_sh, start, n_rows, last, h0)
            T.ptx_wait_group(0)
            T.sync_threads()
            if n_rows < C:
                for r, d in T.Parallel(C, D):
                    if r >= n_rows:
                        K_sh[r, d] = T.cast(0, dtype)
            T.gemm(K_sh, K_sh, KKt, transpose_B=True, clear_accum=True)
            T.copy(KKt, KKt_sh)
            for head in T.serial(heads_per_cta if shared_k else 1):
                h = h0 + head
                # this v-head's beta and gate at a row of the chunk (the shared build holds a row per v-head)
                beta_at = (lambda row: beta_sh[head, row]) if shared_k else (lambda row: beta_sh[row])  # noqa: E731
                gate_at = (lambda row: g_sh[head, row]) if shared_k else (lambda row: g_sh[row])  # noqa: E731
                # the last v-head's steps are done with X (and K K^T is in KKt_sh)
                T.sync_threads()
                # --- X = (I + L)^{-1}, L = StrictLower(diag(beta) K K^T). L is never formed: every step reads
                # only strictly lower elements of K K^T and applies beta to the rows of its result. X needs no
                # initial value: the steps below write every element of it before any is read (the diagonal
                # blocks with their zeros above the diagonal, the lower blocks, the upper blocks as staging: the
                # 16 x 16 ones zeroed after use, the 32 x 32 one left stale) ---------------------------------------

                # --- 16x16 diagonal blocks, one column per thread in registers: x_i = e_i - sum_{j<i} L_ij x_j
                tx = T.get_thread_binding()
                for i in T.unroll(16):  # read only where j < i after unrolling; zeroed for TileLang's init check
                    col[i] = 0.0
                if tx < 64:  # two partial sums (even and odd j) halve each row's chain of dependent FMAs
                    blk = tx // 16
                    c = tx % 16
                    for i in T.unroll(16):
                        acc[0] = 0.0
                        acc[1] = 0.0
                        for j in T.unroll(16):
                            if j < i:
                                acc[j % 2] = acc[j % 2] + KKt_sh[blk * 16 + i, blk * 16 + j] * col[j]
                        col[i] = T.if_then_else(i == c, 1.0, 0.0) - beta_at(blk * 16 + i) * (acc[0] + acc[1])
                    for i in T.unroll(16):
                        X_sh[blk * 16 + i, blk * 16 + c] = col[i]
                T.sync_threads()

                # --- merge 16 -> 32 in both halves p: X21 = -X22 (L21 X11); thread = (p, 4 rows, column)
                p = tx // 64
                r0 = (tx // 16) % 4 * 4
                c2 = tx % 16
                for r in T.unroll(4):
                    acc[r] = 0.0
                    for j in T.unroll(16):
                        acc[r] = acc[r] + KKt_sh[p * 32 + 16 + r0 + r, p * 32 + j] * X_sh[p * 32 + j, p * 32 + c2]
                # L21 X11 = diag(beta) (K K^T)21 X11 staged in the upper-right 16x16 block of the 32-block (zero in
                # X, restored below). beta is applied in a loop of its own: read from shared memory in the loop that
                # stores to X, TileLang's storage-sync pass puts a barrier inside every iteration
                for r in T.unroll(4):
                    acc[r] = beta_at(p * 32 + 16 + r0 + r) * acc[r]
                for r in T.unroll(4):
                    X_sh[p * 32 + r0 + r, p * 32 + 16 + c2] = acc[r]
                T.sync_threads()
                for r in T.unroll(4):
                    acc[r] = 0.0
                    for j in T.unroll(16):
                        acc[r] = (acc[r] + X_sh[p * 32 + 16 + r0 + r, p * 32 + 16 + j]
                                  * X_sh[p * 32 + j, p * 32 + 16 + c2])
                for r in T.unroll(4):
                    X_sh[p * 32 + 16 + r0 + r, p * 32 + c2] = -acc[r]
                T.sync_threads()
                for r in T.unroll(4):
                    X_sh[p * 32 + r0 + r, p * 32 + 16 + c2] = 0.0
                T.sync_threads()

                # --- merge 32 -> 64: X21 = -X22 (L21 X11), two 32 x 32 x 32 products on tensor cores (TF32) --
                T.gemm(KKt_sh[32:64, 0:32], X_sh[0:32, 0:32], Y, clear_accum=True)
                # L21 X11 = diag(beta) (K K^T)21 X11 staged in the upper-right quadrant (left as it is after: step 5
                # masks X's upper triangle by select, and the next v-head's steps write it before reading it)
                for r, s in T.Parallel(32, 32):
                    Y[r, s] = beta_at(32 + r) * Y[r, s]
                T.copy(Y, X_sh[0:32, 32:64])
                T.gemm(X_sh[32:64, 32:64], X_sh[0:32, 32:64], Y, clear_accum=True)
                for r, s in T.Parallel(32, 32):
                    X_sh[32 + r, s] = -Y[r, s]
                T.sync_threads()

                # --- GA = Gamma o X (its gate mask applied once here, so the fused walk takes it as a product
                # operand), straight from X's tile to global memory: 4 columns of one row in each half of X per
                # thread, two 8-byte stores, no branch (T.Select evaluates both sides: above the diagonal the
                # discarded one may be 0 x inf, or X's stale staging). X's halves of 32 columns each lie in their
                # own 8 KiB with the 16-byte groups of a row swizzled over all 32 banks, so the 8 threads of a row
                # reading the 8 groups of one half are conflict-free (8 consecutive columns per thread put two
                # threads of a phase on the same banks, one in each half: Nsight Compute had this step's shared
                # loads at 64% of ideal) ----------------------------------------------------------------------------
                c0 = (tx % 8) * 4
                for j in T.vectorized(4):  # the thread's 8 column gates, the same in each of its 4 rows
                    g_cols[j] = gate_at(c0 + j)
                for j in T.vectorized(4):
                    g_cols[4 + j] = gate_at(32 + c0 + j)
                for i in T.unroll(4):
                    r = i * 16 + tx // 8
                    for j in T.vectorized(4):
                        X_row[j] = X_sh[r, c0 + j]
                    for j in T.vectorized(4):
                        X_row[4 + j] = X_sh[r, 32 + c0 + j]
                    for j in T.unroll(8):
                        GA_row[j] = T.cast(T.Select(r >= c0 + j % 4 + 32 * (j // 4),
                                                    X_row[j] * T.exp2((gate_at(r) - g_cols[j]) * LOG2E), 0.0), dtype)
                    if r < n_rows:
                        for j in T.vectorized(4):
                            GA[start + r, h, c0 + j] = GA_row[j]
                        for j in T.vectorized(4):
                            GA[start + r, h, 32 + c0 + j] = GA_row[4 + j]

    return wy_inverse
