"""The fp32 chain over intra-card CP segments in one launch (design doc §3-4).

Forward (`reverse = 0`), for the rows r = first + 1 .. last of every sequence:

    out[r] = bias[r - 1] + mask[r] * mats[r - 1] @ out[r - 1]          (S_{j,0} = S*_{j-1} + M_{j-1} S_{j-1,0})

Backward (`reverse = 1`), for r = last - 1 down to first:

    out[r] = bias[r + 1] + f_r * mats[r + 1]^T @ out[r + 1]            (X_j = D_{j+1} + f M_{j+1}^T X_{j+1})
    f_r = 1 for r = last - 1 (out of the sequence's last row: into its final state), else mask[r + 2]

so both directions read the forward's `exact` mask as it is (mask[r]: row r starts from the exact chain).
`out` holds the first (forward) or last (backward) row of every sequence on entry, or with `zero_start` the
chain starts from zero and writes that zero start row itself (no fill launch before it). All operands fp32
[rows * Hv, 128, 128] (mask [rows * Hv]); the products run on CUDA cores in fp32 (a fp32 T.gemm would
be TF32). One CTA per (V tile, v-head, sequence), the sequence slowest, so the CTAs are issued in the order of
`first_rows` (launch.fold_segments); what was one batched GEMM launch per segment position on the host is
one launch for the whole chain; a row whose mask is 0 skips its product.

Each step is a 128 x block_v x 128 product, serial along the chain, so a step's latency is the kernel's
time. What a step waits for, and how each wait is kept off it:
- the next step's matrix (64 KiB) is in flight while this step works, one TMA load (four boxes of 32
  columns) issued by one thread on its buffer's mbarrier (two buffers; as cp.async it was 4096 16-byte
  requests of all 128 threads); the bias tiles of the next three steps by cp.async (BIAS_STAGES buffers, one
  commit group per step): a step without a product is too short to cover even one bias load;
- the mask values, which decide whether a step multiplies and whether its matrix is loaded, are read
  MASK_BLOCK at a time into shared memory (one load round trip per block of steps); read where they were
  needed, a global round trip came before every prefetch;
- the product: each thread holds `rows_per_thread` rows x all `block_v` columns over a 1 / `k_groups`
  slice of k, so every element of M is read from shared memory once per step and a row of S is one
  broadcast to the threads of a k group (with each thread a 4 x 4 block of 16 columns over all of k, M was
  read four times and S 32 times: 512 KiB of shared-memory traffic per step); the k groups' partial blocks
  meet in shared memory, where each thread adds one row's four columns to the bias. A thread's rows are
  i = a + (128 / rows_per_thread) r in both directions, so the threads of a warp read consecutive rows of M
  (forward: 16 bytes of k each; M's tile is TMA's 128-byte swizzle, which puts the 16-byte chunks of 8
  consecutive rows on 8 different bank groups) or consecutive columns of one row (backward, M^T), and write
  consecutive rows of the partial tiles.
H200, 2026-12-01, CUDA-graph replays of the kernel alone (docs/kernels.md, "Fifteenth session"): 16 steps
x 8 heads all exact 69 -> 44 us, a quarter exact 43 -> 28, 32 steps x 4 heads 129 -> 80, 600 steps x 2
heads 1442 -> 835; float64 agreement 1e-7 -> 6e-8. The matrix by TMA instead of cp.async (2026-12-05, the
public op's chains under AutoCP, `ab_kernel.py`): 1.07-1.19x, outputs bitwise equal.

Barriers: the kernel is built with TileLang's thread storage sync pass off (launch.py's `MODULE_PASS_CONFIGS`; the pass put
six barriers in every step) and has two a step, placed by hand:
- after the partial tiles (part_s) are written: every read of this step's state and matrix is done;
- at the end of a step, after the wait for the next step's bias: the new state in S_s, the next bias tile
  and the mask block read MASK_BLOCK steps ahead are visible, and part_s and the buffers this step read
  are free for the next step's loads.
The step's matrix arrives on m_full, armed by warp 0 alone (its elected lane's expect_tx and TMA, a warp
sync, the warp's 32 arrivals), so no barrier sits between the expect_tx and the arrivals. The product's k
loop is unrolled for each direction apart on V tiles up to 8 columns; at 16 the unrolled loop is slower.
H100, 2026-12-05 (docs/kernels.md, "Forty-third session"), the kernel alone against the six-barrier build:
16 steps x 8 heads, 2 exact, V tile 8: 32.9 -> 27.2 us; 32 steps x 4 heads, V tile 4: 61.4 -> 51.0 us.
"""
import tilelang.language as T
from tilelang.layout import make_full_bank_swizzled_layout

HEAD_DIM = 128
ROWS_PER_THREAD = 4
K_GROUPS = 4
BIAS_STAGES = 4  # bias tiles in flight: a step without a product is too short to cover one load
MASK_BLOCK = 256  # mask values read together
MAX_SHARED_BYTES = 227 * 1024  # one SM90 CTA's limit
MAX_UNROLLED_BLOCK_V = 8  # the widest V tile whose product loop over k is unrolled


def build_segment_chain(block_v: int, rows_per_thread: int = ROWS_PER_THREAD, k_groups: int = K_GROUPS,
                        unroll_k: bool | None = None):
    num_mats = T.dynamic("num_mats")
    num_seqs = T.dynamic("num_seqs")
    D, BV, RT = HEAD_DIM, block_v, rows_per_thread
    if D % BV or BV % 4 or D % RT or D % (4 * k_groups):
        raise ValueError(f"unsupported tiling block_v={BV}, rows_per_thread={RT}, k_groups={k_groups}")
    k_loop = T.unroll if (BV <= MAX_UNROLLED_BLOCK_V if unroll_k is None else unroll_k) else T.serial
    row_groups = D // RT  # threads sharing a k group, one block of rows each
    threads = row_groups * k_groups
    k_span = D // k_groups  # the k range of one k group
    quads = D * BV // 4  # (row, 4 columns) items of the output tile
    if quads % threads:
        raise ValueError(f"{threads} threads do not divide the {quads} output items")
    shared_bytes = 4 * (2 * D * D + (BIAS_STAGES + 1 + k_groups) * D * BV + 2 * MASK_BLOCK)
    if shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"block_v={BV}, k_groups={k_groups} needs {shared_bytes} bytes of shared memory per CTA")

    @T.macro
    def row_of(reverse, first, last, step):
        """The row step `step` writes."""
        return T.if_then_else(reverse != 0, last - 1 - step, first + 1 + step)

    @T.macro
    def source_of(num_heads, reverse, h, first, last, step):
        """The flat index of the bias tile and matrix step `step` reads (row r - 1 forward, r + 1 backward)."""
        row = row_of(reverse, first, last, step)
        return T.if_then_else(reverse != 0, row + 1, row - 1) * num_heads + h

    @T.macro
    def mask_of(mask, num_heads, reverse, h, first, last, steps, step):
        """Step `step`'s factor (0 past the last step): mask[r] forward; backward 1 out of the last row, else
        mask[r + 2] (f_r above)."""
        row = T.max(T.min(row_of(reverse, first, last, step), last), first)
        into_final = reverse != 0 and row + 1 >= last
        read = T.min(T.if_then_else(reverse != 0, row + 2, row), last)
        return T.if_then_else(step < steps, T.if_then_else(into_final, 1.0, mask[read * num_heads + h]), 0.0)

    @T.macro
    def load_matrix(mats, M_s, m_full, num_heads, reverse, h, first, last, step, tx):
        """Step `step`'s matrix into its buffer: one TMA load on the buffer's mbarrier, issued by warp 0 (the
        copy elects one lane for the expect_tx and the load: an elect.sync over the whole warp, so this is a
        warp's branch, not a thread's), then the warp's 32 arrivals after a warp sync."""
        if tx < 32:
            T.tma_copy(mats[source_of(num_heads, reverse, h, first, last, step), 0:D, 0:D], M_s[step % 2, 0:D, 0:D],
                       barrier=m_full[step % 2])
            T.sync_warp()
            T.barrier_arrive(m_full[step % 2])

    @T.macro
    def add_k_block(S_s, s_part, m_part, prod, k):
        """prod += m_part @ S[k .. k + 3, :]: this thread's rows of M (or M^T, as the direction loaded m_part)
        over four k, times those four rows of the state."""
        for q in T.unroll(4):
            for c in T.vectorized(BV):
                s_part[q, c] = S_s[k + q, c]
        for r in T.unroll(RT):
            for q in T.unroll(4):
                for c in T.unroll(BV):
                    prod[r, c] += m_part[r, q] * s_part[q, c]

    @T.macro
    def load_bias(bias, B_s, num_heads, reverse, h, v0, first, last, steps, step):
        """Step `step`'s bias tile into its buffer (cp.async, one commit group); past the last step a repeat
        of the last one, so that every step commits a group."""
        src = source_of(num_heads, reverse, h, first, last, T.min(step, steps - 1))
        T.async_copy(bias[src, 0:D, v0:v0 + BV], B_s[step % BIAS_STAGES, 0:D, 0:BV])

    @T.macro
    def load_mask_block(mask, mask_s, num_heads, reverse, h, first, last, steps, block):
        """The mask values of steps block * MASK_BLOCK .. + MASK_BLOCK - 1 into their slot of mask_s: one
        load round trip per MASK_BLOCK steps instead of one before every prefetch."""
        for j in T.Parallel(MASK_BLOCK):
            mask_s[block % 2 * MASK_BLOCK + j] = mask_of(mask, num_heads, reverse, h, first, last, steps,
                                                         block * MASK_BLOCK + j)

    # built without the storage-sync pass (launch.MODULE_PASS_CONFIGS): no barrier below is automatic, so a new
    # shared-memory write or read needs its own ordering against the two barriers a step (module docstring)
    @T.prim_func
    def segment_chain(
        out: T.Tensor((num_mats, D, D), "float32"),
        bias: T.Tensor((num_mats, D, D), "float32"),
        mats: T.Tensor((num_mats, D, D), "float32"),
        mask: T.Tensor((num_mats,), "float32"),
        first_rows: T.Tensor((num_seqs,), "int32"),
        last_rows: T.Tensor((num_seqs,), "int32"),
        num_heads: T.int32,
        reverse: T.int32,
        zero_start: T.int32,
    ):
        # the sequence slowest: CTAs are issued in first_rows' order, all v-heads of a sequence together
        with T.Kernel(D // BV, num_heads, num_seqs, threads=threads) as (bv, h, n):
            v0 = bv * BV
            first = first_rows[n]
            last = last_rows[n]
            M_s = T.alloc_shared((2, D, D), "float32")  # this step's matrix and the next one's (swizzled, TMA)
            m_full = T.alloc_barrier(arrive_count=[32, 32])  # M_s[b] landed (warp 0 arms and arrives)
            loads0 = T.alloc_var("int32")  # matrices loaded into buffer 0 / 1 so far: the k-th load into a
            loads1 = T.alloc_var("int32")  # buffer completes phase k of its mbarrier
            B_s = T.alloc_shared((BIAS_STAGES, D, BV), "float32")  # bias tiles of this step and the next ones
            S_s = T.alloc_shared((D, BV), "float32")
            part_s = T.alloc_shared((k_groups, D, BV), "float32")  # each k group's partial product
            prod = T.alloc_local((RT, BV), "float32")  # this thread's rows x the tile's columns, over its k range
            m_part = T.alloc_local((RT, 4), "float32")  # M[i, k .. k + 3] of this thread's rows i
            s_part = T.alloc_local((4, BV), "float32")  # S[k .. k + 3, :]
            acc = T.alloc_local((4,), "float32")  # one row, four columns of out[row]
            total = T.alloc_local((4,), "float32")
            mask_s = T.alloc_shared((2 * MASK_BLOCK,), "float32")  # mask of step s at s % (2 MASK_BLOCK)
            scale = T.alloc_var("float32")  # this step's mask

            T.annotate_layout({M_s: make_full_bank_swizzled_layout(M_s)})
            tx = T.get_thread_binding()
            k0 = tx // row_groups * k_span  # first k of this thread's k group
            a = tx % row_groups  # this thread's rows: a + row_groups r
            start = T.if_then_else(reverse != 0, last, first)
            steps = last - first
            if zero_start != 0:
                for i, c in T.Parallel(D, BV):
                    S_s[i, c] = 0.0
                    out[start * num_heads + h, i, v0 + c] = 0.0
            else:
                T.copy(out[start * num_heads + h, 0:D, v0:v0 + BV], S_s)
            load_mask_block(mask, mask_s, num_heads, reverse, h, first, last, steps, 0)
            loads0 = 0
            loads1 = 0
            T.sync_threads()  # the first mask block visible
            if steps > 0:
                if mask_s[0] != 0:
                    load_matrix(mats, M_s, m_full, num_heads, reverse, h, first, last, 0, tx)
                    loads0 = 1
                for b in T.unroll(BIAS_STAGES - 1):
                    load_bias(bias, B_s, num_heads, reverse, h, v0, first, last, steps, b)
            T.ptx_wait_group(BIAS_STAGES - 2)  # step 0's bias landed
            T.sync_threads()  # ... and with the start state, visible to every thread
            for step in T.serial(steps):
                row = row_of(reverse, first, last, step)
                scale = mask_s[step % (2 * MASK_BLOCK)]
                if scale != 0:
                    T.barrier_wait(m_full[step % 2], (T.if_then_else(step % 2 == 0, loads0, loads1) + 1) % 2)
                if step % MASK_BLOCK == 0:  # read MASK_BLOCK steps on, after the end-of-step barriers between
                    load_mask_block(mask, mask_s, num_heads, reverse, h, first, last, steps, step // MASK_BLOCK + 1)
                # the buffers the previous step read (its end barrier passed): the next matrix, the bias 3 steps on
                if mask_s[(step + 1) % (2 * MASK_BLOCK)] != 0:
                    load_matrix(mats, M_s, m_full, num_heads, reverse, h, first, last, step + 1, tx)
                    if step % 2 == 0:
                        loads1 = loads1 + 1
                    else:
                        loads0 = loads0 + 1
                load_bias(bias, B_s, num_heads, reverse, h, v0, first, last, steps, step + BIAS_STAGES - 1)
                if scale != 0:
                    for r in T.unroll(RT):
                        for c in T.unroll(BV):
                            prod[r, c] = 0.0
                    if reverse != 0:  # M^T: m_part[r, q] = M[k + q, i]
                        for kq in k_loop(k_span // 4):
                            for r in T.unroll(RT):
                                for q in T.unroll(4):
                                    m_part[r, q] = M_s[step % 2, k0 + 4 * kq + q, a + row_groups * r]
                            add_k_block(S_s, s_part, m_part, prod, k0 + 4 * kq)
                    else:
                        for kq in k_loop(k_span // 4):
                            for r in T.unroll(RT):
                                for q in T.vectorized(4):
                                    m_part[r, q] = M_s[step % 2, a + row_groups * r, k0 + 4 * kq + q]
                            add_k_block(S_s, s_part, m_part, prod, k0 + 4 * kq)
                    for r in T.unroll(RT):
                        for c in T.vectorized(BV):
                            part_s[tx // row_groups, a + row_groups * r, c] = prod[r, c]
                T.sync_threads()  # every partial tile written, every read of this step's state and matrix done
                for p in T.serial(quads // threads):  # out[row] = bias + mask M S, a row's four columns per thread
                    item = p * threads + tx
                    i = item // (BV // 4)
                    c0 = item % (BV // 4) * 4
                    for c in T.vectorized(4):
                        acc[c] = B_s[step % BIAS_STAGES, i, c0 + c]
                    if scale != 0:
                        for c in T.vectorized(4):
                            total[c] = 0.0
                        for g in T.unroll(k_groups):
                            for c in T.vectorized(4):
                                total[c] = total[c] + part_s[g, i, c0 + c]
                        for c in T.vectorized(4):
                            acc[c] = acc[c] + scale * total[c]
                    for c in T.vectorized(4):
                        S_s[i, c0 + c] = acc[c]
                    for c in T.vectorized(4):
                        out[row * num_heads + h, i, v0 + c0 + c] = acc[c]
                T.ptx_wait_group(BIAS_STAGES - 2)  # the next step's bias landed
                T.sync_threads()  # the new state, the next bias and the next masks visible; part_s, B_s free
            T.ptx_wait_group(0)  # the loop's last bias copies (past the chain's end) land before the CTA exits

    return segment_chain
