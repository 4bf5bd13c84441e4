"""The GQA sums of the backward: dq and dk per v-head -> per k-head, in one launch.

`chunk_bwd_local` writes dq and dk per v-head, [T, Hv, 128] in the input dtype. V-head h reads k-head
h // G (G = Hv / Hqk), so viewed as [T * Hqk, G, 128] the G rows of a k-head are adjacent, and

    dq_k[r, :] = rnd(sum_e dq[r, e, :])       accumulated in fp32, rounded once to the input dtype

(likewise dk). torch's `sum` over that middle dimension of size 2-8 ran at about 1.5 TB/s on the H200;
this is a plain streaming kernel. A CTA of 128 threads takes ROWS = 32 rows of both tensors' one
(grid y: 0 = dq, 1 = dk); G is a runtime size, so one compiled kernel serves every GQA ratio.
"""
import tilelang.language as T

HEAD_DIM = 128
ROWS = 32
THREADS = 128


def build_gqa_sum(dtype: str):
    num_rows = T.dynamic("num_rows")  # T * Hqk
    group = T.dynamic("group")  # Hv / Hqk
    D, BR = HEAD_DIM, ROWS

    @T.macro
    def sum_rows(src, dst, r0):
        acc = T.alloc_fragment((BR, D), "float32")
        T.clear(acc)
        for e in T.serial(group):
            for r, d in T.Parallel(BR, D):
                acc[r, d] += T.if_then_else(r0 + r < num_rows, T.cast(src[r0 + r, e, d], "float32"), 0.0)
        for r, d in T.Parallel(BR, D):
            if r0 + r < num_rows:
                dst[r0 + r, d] = T.cast(acc[r, d], dtype)

    @T.prim_func
    def gqa_sum(
        dq: T.Tensor((num_rows, group, D), dtype),
        dk: T.Tensor((num_rows, group, D), dtype),
        dq_out: T.Tensor((num_rows, D), dtype),
        dk_out: T.Tensor((num_rows, D), dtype),
    ):
        with T.Kernel(T.ceildiv(num_rows, BR), 2, threads=THREADS) as (block, which):
            if which == 0:
                sum_rows(dq, dq_out, block * BR)
            else:
                sum_rows(dk, dk_out, block * BR)

    return gqa_sum
