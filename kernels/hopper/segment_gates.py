"""Intra-card CP's gate statistics in one launch: which segments warm up, which start from the exact chain,
and which summary walks run from which chunk (design doc §4, `flashqla/cp/segments.py`).

For row (segment) j of the plan and v-head h, with c_j the chunks of row j and G(c) the gates of chunk c
summed (`gcum`, wy_inverse's chunk-local cumulative gate, at the chunk's last token):

    warm_j      = some c with  G(c) + G(c + 1) + ... + G(c_j - 1) < threshold
    walk_from_j = 1 + the last such c (1 where not warm: the whole segment)

and from the row's host-built flags (bits defined in launch.py, set by `segments._gate_flags`):

    exact[j + 1]    = has_next_j and not warm_j           (exact[0] = 0: a row after no row)
    active[0, j]    = 1 with FORCE_S, else has_next_j * walk_from_j     (S*_j from chunk walk_from_j - 1)
    active[1, j]    = FORCE_M or ALWAYS_M or (INTO_EXACT and not warm_j)   (M_j)

`threshold` = -inf makes every row exact (`cp_warmup=None`). The sums run from the row's last chunk
back in fp32, in the order the torch emulation sums them. These were a dozen small torch launches on
the forward's critical path (about 25 us of GPU time at TP8 x 32K, H200, 2026-12-03).

One CTA per (row, block of HEADS heads): its threads load the chunk sums of BACK chunks at a time, from
the row's end back, into shared memory (independent loads, all in flight at once); then one thread per
head adds them up in order and stops at the first sum below the threshold.
"""
import tilelang.language as T

from .launch import ALWAYS_M, FORCE_M, FORCE_S, HAS_NEXT, INTO_EXACT

CHUNK = 64
HEADS = 32  # v-heads per CTA
BACK = 32  # chunks loaded per round
THREADS = 128


def build_segment_gates():
    num_heads = T.dynamic("num_heads")
    num_tokens = T.dynamic("num_tokens")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def segment_gates(
        gcum: T.Tensor((num_heads, num_tokens), "float32"),
        cu: T.Tensor((num_rows + 1,), "int32"),
        flags: T.Tensor((num_rows,), "int32"),
        exact: T.Tensor((num_rows, num_heads), "float32"),
        active: T.Tensor((2, num_rows, num_heads), "int32"),
        threshold: T.float32,
    ):
        with T.Kernel(num_rows, T.ceildiv(num_heads, HEADS), threads=THREADS) as (j, hb):
            # [head, chunks back from the row's end], rows padded by one float: the HEADS threads that add
            # them up read one column at a time, 32 banks apart without the pad
            sums = T.alloc_shared((HEADS, BACK + 1), "float32")
            total = T.alloc_var("float32")
            warm = T.alloc_var("int32")
            walk_from = T.alloc_var("int32")
            tx = T.get_thread_binding()
            h0 = hb * HEADS
            start = cu[j]
            end = cu[j + 1]
            chunks = T.ceildiv(end - start, CHUNK)
            total = 0.0
            warm = 0
            walk_from = 1
            for r in T.serial(T.ceildiv(chunks, BACK)):
                for hh, p in T.Parallel(HEADS, BACK):
                    back = r * BACK + p
                    # chunk chunks - 1 - back ends at token min(start + (chunks - back) * 64, end) - 1
                    sums[hh, p] = T.if_then_else(
                        back < chunks and h0 + hh < num_heads,
                        gcum[h0 + hh, T.min(start + (chunks - back) * CHUNK, end) - 1], 0.0)
                T.sync_threads()
                if tx < HEADS:
                    for p in T.serial(BACK):
                        if warm == 0 and r * BACK + p < chunks:
                            total += sums[tx, p]
                            if total < threshold:
                                warm = 1
                                walk_from = chunks - r * BACK - p
                T.sync_threads()  # every sum read before the next round overwrites them
            h = h0 + tx
            if tx < HEADS and h < num_heads:
                row_flags = flags[j]
                has_next = T.if_then_else(T.bitwise_and(row_flags, HAS_NEXT) != 0, 1, 0)
                if T.bitwise_and(row_flags, FORCE_S) != 0:
                    active[0, j, h] = 1
                else:
                    active[0, j, h] = has_next * walk_from
                if T.bitwise_and(row_flags, FORCE_M | ALWAYS_M) != 0:
                    active[1, j, h] = 1
                elif T.bitwise_and(row_flags, INTO_EXACT) != 0 and warm == 0:
                    active[1, j, h] = 1
                else:
                    active[1, j, h] = 0
                if j + 1 < num_rows:
                    exact[j + 1, h] = T.if_then_else(has_next == 1 and warm == 0, 1.0, 0.0)
                if j == 0:
                    exact[0, h] = 0.0

    return segment_gates
