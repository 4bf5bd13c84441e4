"""Chunk-local gradients of GDN (docs/algorithm.md, "Chunked backward"), every chunk at once.

The TileLang form of `flashqla.ops.reference.chunk_backward`, step for step and with its names, for one
chunk and one v-head at a time (a work item). Given the state entering the chunk (S, the backward's state recompute) and the
gradient of the state leaving it (dS, from `chunk_dstates`), with dOs = scale dO:

    Vd      = V - diag(gamma) K S                  V_new = (Gamma o A) diag(beta) Vd
    P       = Gamma o Q K^T                        dV_new = P^T dOs + diag(gamma_last/gamma) K dS
    dX      = (Gamma o A)^T dV_new                 dVd = diag(beta) dX              (= dv)
    dP      = dOs V_new^T                          dq = diag(gamma) dOs S^T + (dP o Gamma) K
    dk      = (dP o Gamma)^T Q + diag(gamma_last/gamma) V_new dS^T + (G + G^T) K - diag(gamma) dVd S^T
    dA      = (dV_new (diag(beta) Vd)^T) o Gamma   dL = StrictLower(-A^T dA A^T),  G = diag(beta) dL
    dbeta   = rowsum(dX o Vd) + rowsum(dL o K K^T)
    dgc     = rowsum(dOs o diag(gamma) Q S) + rowsum(E_P) - colsum(E_P) + rowsum(E_A) - colsum(E_A)
              - F - gamma o rowsum(K o dVd S^T),  dgc_last += sum(F) + gamma_last <S, dS>
              with E_P = dP o P, E_A = dGamma_A o (Gamma o A), F = (gamma_last/gamma) o rowsum(K o V_new dS^T)
    dg      = reverse cumsum of dgc within the chunk (gc = cumsum g)

The column sums are row sums of tiles the kernel forms anyway (docs/algorithm.md, (D1)), taken from the same
rounded tiles as the terms they cancel against ((D2): a form that mixes roundings loses dg under strong
decay): colsum(E_P) = rowsum(V_new o dV_new) - F with P the bf16 scale P that dV_new is made from,
rowsum(E_A) = rowsum(dV_new o V_new) with the other side of each product rounded, colsum(E_A) =
rowsum(dX o diag(beta) Vd) with the bf16 diag(beta) Vd of dGamma_A, so F cancels and

    dgc     = rowsum(dOs o diag(gamma) Q S) + rowsum(E_P) - rowsum(bf(V_new) o dV_new - V_new o bf(dV_new))
              - rowsum(dX o bf(diag(beta) Vd)) - gamma o rowsum(K o dVd S^T)

(no column sum, no E_A tile). H200, against the kernel with the column sums (2026-12-02): 2004 -> 1884 us at
(16, 32) x 4K x 8, 4051 -> 3802 at (16, 64) x 8K x 4, 504 -> 467 at (4, 8) x 8K x 4; dq, dk, dv, dbeta bitwise
equal, dg within 3e-4 (docs/kernels.md, "Twentieth session").

Inputs in the flat token layout of the forward: q, k [T, Hqk, 128] (v-head h reads k-head h // (Hv/Hqk)), v
and dOs [T, Hv, 128], GA = Gamma o A [T, Hv, 64] (wy_inverse's, the fused forward's operand; the forward
keeps it for this kernel, and every A term above has an exact GA form, see the dL step), gcum [Hv, T]
(natural log, converted to base 2 once, for exp2), the per-chunk states h and state gradients dh at chunk
slots (fused_fwd's state recompute, chunk_dstates). An item finds its sequence by binary search in
`chunk_offsets` as wy_inverse does; in a partial last chunk the rows past the sequence end are zeroed after
loading (they hold the next sequence), each tile by the warpgroup that reads it first (K, V, GA: values; Q,
dO: gradients), and their gates repeat the last one, which is exactly the zero padding of the reference's
chunk grid. Outputs, rows that exist only: dq, dk, dv per v-head in the input dtype (the
caller sums dq and dk over GQA groups, accumulating in fp32), dg [Hv, T] and dbeta in fp32. dq, dk and dv
leave through shared memory (dq and dk through V_new's tile once both products that read it are done, dv
through the tile that holds it for dk's last term), 16 bytes per thread and store.

GQA pair sums (the "ordered" `pair_sum` build, for an even number of v-heads per k-head): v-heads 2m and
2m + 1 read the same Q and K, so their dq (and dk) tiles meet in row m of a [T, Hv / 2, 128] output. A CTA
takes both v-heads of a chunk as consecutive items, the even one storing its rows (then `fence.proxy.async`,
so the async proxy sees them), the odd one adding its tile by one TMA reduce (`cp.reduce.async.bulk.tensor
... .add`, performed in L2) an item later; no zeroing, and the two items of a pair share one search of
`chunk_offsets`. Two 16-bit addends give the same bits in either order (0 + a is exact, a + b is rounded
once), so the result is deterministic and equal to the GQA sum's at 2 v-heads per k-head, which then does not
run; at 4 or 8 it sums half the rows. A reduce covers all 64 rows: rows past the sequence end are zero (each
term of dq and dk there is a product with a zeroed row of dO, Q, K, V' or G, or with beta = 0), so they leave
the next sequence's rows as they are, before or after those rows' own writers; the TMA unit drops rows past
T. (A build where every item reduced into outputs the caller had zeroed timed from 2% faster to 5% slower and
was dropped, docs/kernels.md "Fortieth session".)

(A "grouped" build, a CTA taking all G v-heads of a chunk into [T, Hqk, 128], the first storing and the others
adding in v-head order, passed the GPU tests but was 3-12% slower at 4 v-heads per k-head and level at 8; removed,
docs/kernels.md "Forty-first session".)

Persistent: `num_ctas` CTAs (one per SM: one fits by registers and shared memory) take every num_ctas-th
item of the real chunks (chunk fastest), so that the next item's tiles load while this one computes. Each
tile arrives by TMA on its own mbarrier, requested by the warpgroup that reads it last as soon as it is done
with it: K into a second buffer at the item's start, Q, dS and dO once dq has left, V and GA near the end of
the values chain, S after dVd S^T; the gates by plain loads early in the values chain, into a second buffer.

The warpgroups meet only on mbarriers, never on a CTA-wide barrier inside the loop, so they may be an item
apart: the values warpgroup starts item i + 1 (K S, K dS, V_new) once it has handed G over, while the
gradients warpgroup ends item i (G K, G^T K, dk's exit, and the dg scan, which it runs alone, as the values
warpgroup stores dbeta alone). Nothing the values warpgroup writes early in item i + 1 is still read for item
i: the tiles it writes first (Vn_s, dVn_s, sP_s, G_s) it writes after sp_ready of i + 1, which the gradients
warpgroup signals only once it is done with item i; its shares of dgc, the item indices and the row decays
(which it computes for both, before `k_ready`) are kept by item parity. It never gets two items ahead (item
i + 2 waits for sp_ready of i + 1).
Two TileLang traps shaped the loop (docs/kernels.md, "Twenty-ninth session"): per-item indices are locals
(`T.alloc_var`) or read from `work_sh` (an expression such as `item // num_chunks`
is inlined into every index, in int64, as a call to the 64-bit division routine), and the stores that scale a
tile by beta read it from registers (`beta_rows`: read from shared memory there, the storage-sync pass put a
barrier inside every iteration of those loops). A third: TileLang's `T.cumsum` runs on the CTA's first warp
whatever branch calls it, so the dg scan inside the gradients warpgroup is a masked row sum of a fragment.

The kernel reads dO itself: every product with dO feeds an elementwise fp32 step (the Gamma mask, the
gamma rows, E_P), where `scale` is applied, so no scaled copy of dO is made. The term rowsum(dOs o diag(gamma)
Q S) is read off dq's first product: rowsum(dO o Q S) = rowsum(Q o dO S^T), so Q S is never formed.

Warp-specialised: two warpgroups, each issuing whole m64 products (asynchronous WGMMA) of its own chain, and
meeting only where one reads the other's tile (mbarriers, one phase each):

  | warpgroup  | products                                        | hands over                            |
  | values     | K S, GA Vd (V_new), K dS + P^T dOs (dV_new),    | K (zero-padded), V_new, dVd (= dv),   |
  |            | GA^T dV_new, dV_new Vd^T, K K^T, the two dL     | G = diag(beta) dL, its shares of dgc; |
  |            | products; dbeta, gamma_last <S, dS>, dv; the    | frees dO's tile after dV_new          |
  |            | V_new and dX shares of dgc                      |                                       |
  | gradients  | Q K^T (P, E_P), dO S^T (dq), dO V_new^T (dP),   | scale P (for dV_new)                  |
  |            | V_new dS^T, (dP o Gamma) K, (dP o Gamma)^T Q,   |                                       |
  |            | dVd S^T, G K, G^T K; dq, dk, F, dg              |                                       |

H200, against the previous kernel (the two warpgroups splitting every product by columns, a CTA-wide barrier
between stages; 2026-12-02): 2175 -> 2035 us at (16, 32) x 4K x 8, 2179 -> 1994 at 32K x 1, 554 -> 503 at
(4, 8) x 8K x 4, 4366 -> 4029 at (16, 64) x 8K x 4 (docs/kernels.md, "Nineteenth session").

Operands of the tensor-core products in the input dtype from shared memory, accumulators and the elementwise
algebra in fp32. Every sum is a row sum, within a warp (TileLang's cross-warp reduction syncs on named
barriers 1 and 2 in every warpgroup, so two warpgroups must not use it at once; here none does). Each
warpgroup keeps at most three [64, 128] accumulators live (the order of the products is chosen for that).

Laid out for TileLang's layout inference, whose free-mode search is quadratic in the tile operators that
share fragments (docs/kernels.md, "Fifteenth session"): fragments belong to one warpgroup and to few
stages, and what crosses stages or warpgroups per row (gamma, gamma_last / gamma, each stage's share of dgc
and dbeta) lives in small shared arrays, summed at the end (~20 s to compile on the 2-core CPU machine).
"""
import tilelang.language as T
from tilelang.cuda.language import atomic_add

from .chunk_map import chunk_of_slot
from .launch import PAIR_SUMS

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634
WARPGROUP = 128
VALUES_BARRIER, GRADS_BARRIER = 12, 13  # named barriers of one warpgroup (TileLang's own start at 3)
# the fence TileLang lacks: generic-proxy writes to global memory before an async-proxy (TMA) access to them
FENCE_PRELUDE = ('\n__device__ __forceinline__ void fence_proxy_async_all() '
                 '{ asm volatile("fence.proxy.async;" ::: "memory"); }\n')
PAIR = 2  # v-heads per unit of the "ordered" build


def build_chunk_bwd_local(dtype: str, pair_sum: str = "none"):
    """The kernel for input dtype `dtype`; the number of persistent CTAs (the SM count) is a runtime argument, so
    one build serves every device. With a `pair_sum` (an even GQA group: v-heads 2m and 2m + 1 read the same k-head)
    dq and dk are [T, Hv / 2, 128] and each pair's tiles are summed there (see "GQA pair sums" above): with
    "ordered", one CTA takes both v-heads of a chunk one after the other, the first storing its tiles and the
    second adding to them."""
    if pair_sum not in PAIR_SUMS:
        raise ValueError(f"pair_sum must be one of {PAIR_SUMS}, got {pair_sum!r}")
    ordered = pair_sum == "ordered"  # a CTA takes both v-heads of a (chunk, pair) as consecutive items
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_dqk_heads = T.dynamic("num_v_pairs") if ordered else num_v_heads
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    C, D, WG = CHUNK, HEAD_DIM, WARPGROUP

    def gamma_mask(gc_sh, buf, r, s, strict):
        """Gamma_rs = gamma_r / gamma_s on and below the diagonal (strictly below with `strict`), else 0. TileLang
        writes the select as C's `?:`, and nvcc branches per element around the exp2 and its two gate loads."""
        return T.Select(r > s if strict else r >= s, T.exp2(gc_sh[buf, r] - gc_sh[buf, s]), 0.0)

    def gamma_mask_unbranched(gc_sh, buf, r, s, strict):
        """gamma_mask without a branch per element: the select is of constants (the exponent pushed to -1e30 above
        the diagonal, exp2 of it +0), so the gate loads and the exp2 are unconditional; on and below the diagonal
        the same bits. Used in the dL and P passes (with <S, dS> moved, 5-13% of the ordered build, docs/kernels.md
        "Fortieth session"); in the dP o Gamma pass as well it gained at most 1% at the largest heads and lost
        at the smaller ones."""
        return T.exp2(gc_sh[buf, r] - gc_sh[buf, s] + T.if_then_else(r > s if strict else r >= s, 0.0, -1e30))

    @T.macro
    def store_rows(tile, out, t0, hv, n_rows):
        """out[t0 + r, hv, :] = tile[r, :] for the rows that exist, from shared memory (16-byte stores)."""
        for r, j in T.Parallel(C, D):
            if r < n_rows:
                out[t0 + r, hv, j] = tile[r, j]

    @T.macro
    def leave(tile, out, t0, hv, n_rows, first):
        """dq or dk of v-head hv from shared memory: its rows (`store_rows`), or ("ordered") into row hv // 2 of its
        pair: the pair's `first` v-head stores its rows and fences them for the second's whole chunk, added by one
        TMA reduce, issued by one thread, which waits until the tile is read. Rows past the sequence end are zero
        there (built from zeroed Q, K, dO, V', G rows) and leave the rows they land on as they are, whatever order
        their own writers come in, so a partial chunk needs no mask; rows past T are clipped by the TMA unit."""
        if ordered:
            if first:
                store_rows(tile, out, t0, hv // PAIR, n_rows)
                T.call_extern("handle", "fence_proxy_async_all")
            else:
                atomic_add(out[t0:t0 + C, hv // PAIR, 0:D], tile, use_tma=True)
        else:
            store_rows(tile, out, t0, hv, n_rows)

    @T.macro
    def gates_of(gcum, beta, t0, n_rows, hv, gc_sh, beta_sh, buf):
        """gc (base 2) and beta of the chunk of v-head hv at token t0 with n_rows rows into buffer `buf`, rows
        past the sequence end as the reference's zero padding (the last gate repeated, beta 0)."""
        last = T.max(n_rows - 1, 0)
        for r in T.Parallel(C):
            gc_sh[buf, r] = gcum[hv, t0 + T.min(r, last)] * LOG2E
            beta_sh[buf, r] = T.if_then_else(r < n_rows, beta[t0 + T.min(r, last), hv], 0.0)

    @T.macro
    def begin_item(work, gam, tail, gc_sh, buf, item, nitem, num_chunks, group, t0, n_rows, nt0, nn_rows):
        """The values warpgroup's start of an item: this item's and the next one's indices into `work` (every thread
        writes the same values), and the row decays once per row. Returns this item's (t0, rows, v-head) and the
        next one's (t0, v-head, chunk slot, k-head, rows), read from `work` where used."""
        work[buf, 0] = t0
        work[buf, 1] = n_rows
        work[buf, 2] = item // num_chunks
        work[buf, 3] = nt0
        work[buf, 4] = nitem // num_chunks
        work[buf, 5] = nitem % num_chunks
        work[buf, 6] = nitem // num_chunks // group
        work[buf, 7] = nn_rows
        T.sync_threads(VALUES_BARRIER, WG)
        for r in T.Parallel(C):
            gam[buf, r] = T.exp2(gc_sh[buf, r])
            tail[buf, r] = T.exp2(gc_sh[buf, C - 1] - gc_sh[buf, r])
        T.sync_threads(VALUES_BARRIER, WG)
        return (work[buf, 0], work[buf, 1], work[buf, 2],
                work[buf, 3], work[buf, 4], work[buf, 5], work[buf, 6], work[buf, 7])

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
        dq: T.Tensor((num_tokens, num_dqk_heads, D), dtype),
        dk: T.Tensor((num_tokens, num_dqk_heads, D), dtype),
        dv: T.Tensor((num_tokens, num_v_heads, D), dtype),
        dg: T.Tensor((num_v_heads, num_tokens), "float32"),
        dbeta: T.Tensor((num_tokens, num_v_heads), "float32"),
        scale: T.float32,
        search_steps: T.int32,
        num_ctas: T.int32,
    ):
        prelude = FENCE_PRELUDE if ordered else None
        with T.Kernel(num_ctas, threads=2 * WG, prelude=prelude) as (cta,):
            group = T.alloc_var("int32")
            group = num_v_heads // num_qk_heads
            Q_s = T.alloc_shared((C, D), dtype)
            K_s = T.alloc_shared((2, C, D), dtype)  # by item parity: the next item's K arrives during this one
            dO_s = T.alloc_shared((C, D), dtype)
            S_s = T.alloc_shared((D, D), dtype)
            dS_s = T.alloc_shared((D, D), dtype)
            V_s = T.alloc_shared((C, D), dtype)  # V, then diag(beta) Vd
            Vn_s = T.alloc_shared((C, D), dtype)  # V_new, values -> gradients; then dq and dk on their way out
            dVn_s = T.alloc_shared((C, D), dtype)  # dV_new, then dVd (values -> gradients)
            GA_s = T.alloc_shared((C, C), dtype)  # Gamma o A
            sP_s = T.alloc_shared((C, C), dtype)  # scale P (gradients -> values), then Lower(dGamma_A) (values)
            G_s = T.alloc_shared((C, C), dtype)  # values: GA^T Lower(dGamma_A), then G (-> gradients)
            dPG_s = T.alloc_shared((C, C), dtype)  # gradients: dP o Gamma
            gc_sh = T.alloc_shared((2, C), "float32")  # by item parity, like K
            beta_sh = T.alloc_shared((2, C), "float32")
            # by item parity (the warpgroups may be an item apart), written by the values warpgroup before k_ready:
            # t0, rows, v-head; the next item's t0, v-head, slot, k-head, rows; gamma and gamma_last / gamma by row
            work_sh = T.alloc_shared((2, 8), "int32")
            gam_sh = T.alloc_shared((2, C), "float32")
            tail_sh = T.alloc_shared((2, C), "float32")
            F_sh = T.alloc_shared((C,), "float32")
            dg_sh = T.alloc_shared((2 * C,), "float32")  # dgc by row, then the shares every row's dg gets
            # shares of dgc by row, by item parity: rowsum E_P, (gamma Q S) o dOs, the V_new o dV_new difference,
            # K o dVd S^T, gamma_last <S, dS> (the last row's), dX o diag(beta) Vd; of dbeta: dX o Vd, dL o K K^T
            dgc_part = T.alloc_shared((2, 6, C), "float32")
            dbeta_part = T.alloc_shared((2, C), "float32")

            # the values warpgroup's fragments
            KS = T.alloc_fragment((C, D), "float32")  # K S, then Vd, then dX o Vd
            KdS = T.alloc_fragment((C, D), "float32")  # K dS, then dV_new
            Vn = T.alloc_fragment((C, D), "float32")
            dX = T.alloc_fragment((C, D), "float32")
            dGA = T.alloc_fragment((C, C), "float32")  # dGamma_A
            dL = T.alloc_fragment((C, C), "float32")
            KK = T.alloc_fragment((C, C), "float32")
            rows_A = T.alloc_fragment((C,), "float32")
            beta_rows = T.alloc_fragment((C,), "float32")
            rows_Vn = T.alloc_fragment((C,), "float32")
            rows_dX = T.alloc_fragment((C,), "float32")
            rows_L = T.alloc_fragment((C,), "float32")
            # the gradients warpgroup's
            rows_SdS = T.alloc_fragment((C,), "float32")
            PY = T.alloc_fragment((C, C), "float32")
            acc_q = T.alloc_fragment((C, D), "float32")
            VndS = T.alloc_fragment((C, D), "float32")  # Q o dO S^T first, then V_new dS^T
            dP = T.alloc_fragment((C, C), "float32")
            acc_k = T.alloc_fragment((C, D), "float32")
            dVdS = T.alloc_fragment((C, D), "float32")
            rows_P = T.alloc_fragment((C,), "float32")
            rows_QS = T.alloc_fragment((C,), "float32")
            rows_F = T.alloc_fragment((C,), "float32")
            rows_dVd = T.alloc_fragment((C,), "float32")

            sp_ready = T.alloc_barrier(arrive_count=WG)  # scale P in sP_s
            vn_ready = T.alloc_barrier(arrive_count=WG)  # V_new in Vn_s
            do_free = T.alloc_barrier(arrive_count=WG)  # the values warpgroup has read dO
            g_ready = T.alloc_barrier(arrive_count=WG)  # G in G_s
            dvd_ready = T.alloc_barrier(arrive_count=WG)  # dVd in dVn_s
            k_ready = T.alloc_barrier(arrive_count=WG)  # K landed, its rows past the sequence end zeroed
            # a tile of an item has arrived (TMA bytes and the arrivals of the warpgroup that issued it)
            q_full = T.alloc_barrier(arrive_count=WG)
            k_full = T.alloc_barrier(arrive_count=[WG, WG])
            v_full = T.alloc_barrier(arrive_count=WG)
            ga_full = T.alloc_barrier(arrive_count=WG)
            s_full = T.alloc_barrier(arrive_count=WG)
            ds_full = T.alloc_barrier(arrive_count=WG)
            do_full = T.alloc_barrier(arrive_count=WG)

            tx = T.get_thread_binding()
            # work items (chunk, v-head), chunk fastest, the real chunks only; CTA cta takes every num_ctas-th
            # ("ordered": every num_ctas-th (chunk, v-head pair), as two items, the pair's v-heads in order)
            num_chunks = T.alloc_var("int32")
            my_items = T.alloc_var("int32")
            num_chunks = chunk_offsets[num_seqs]
            if ordered:
                my_items = PAIR * T.max((num_chunks * (num_v_heads // PAIR) - cta + num_ctas - 1) // num_ctas, 0)
            else:
                my_items = T.max((num_chunks * num_v_heads - cta + num_ctas - 1) // num_ctas, 0)

            if my_items > 0:  # the first item's tiles and gates
                chunk0 = T.alloc_var("int32")
                hv0 = T.alloc_var("int32")
                chunk0 = cta % num_chunks
                hv0 = cta // num_chunks * (PAIR if ordered else 1)
                seq0, s0, n0 = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk0, search_steps)
                if tx < WG:
                    T.tma_copy(v[s0:s0 + C, hv0, 0:D], V_s, barrier=v_full)
                    T.tma_copy(GA[s0:s0 + C, hv0, 0:C], GA_s, barrier=ga_full)
                    T.tma_copy(h[chunk0, hv0, 0:D, 0:D], S_s, barrier=s_full)
                    T.barrier_arrive(v_full)
                    T.barrier_arrive(ga_full)
                    T.barrier_arrive(s_full)
                    gates_of(gcum, beta, s0, n0, hv0, gc_sh, beta_sh, 0)
                else:
                    T.tma_copy(q[s0:s0 + C, hv0 // group, 0:D], Q_s, barrier=q_full)
                    T.tma_copy(k[s0:s0 + C, hv0 // group, 0:D], K_s[0, :, :], barrier=k_full[0])
                    T.tma_copy(dh[chunk0, hv0, 0:D, 0:D], dS_s, barrier=ds_full)
                    T.tma_copy(do[s0:s0 + C, hv0, 0:D], dO_s, barrier=do_full)
                    T.barrier_arrive(q_full)
                    T.barrier_arrive(k_full[0])
                    T.barrier_arrive(ds_full)
                    T.barrier_arrive(do_full)
            T.sync_threads()  # the first item's gates; from here on the warpgroups meet only on mbarriers

            for it in T.serial(my_items):
                buf = it % 2
                par = it % 2
                kpar = (it // 2) % 2
                has_next = it + 1 < my_items
                if tx < WG:  # values: V_new, dV_new, dv, dbeta, the dA chain to G
                    # this item and the next (whose tiles are loaded as this item's last readers of each tile
                    # finish), for both warpgroups: the gradients warpgroup reads them after k_ready
                    item = T.alloc_var("int32")
                    nitem = T.alloc_var("int32")
                    if ordered:  # item = v-head x num_chunks + chunk, of unit cta + (it // 2) num_ctas
                        unit = T.alloc_var("int32")
                        unit = cta + it // PAIR * num_ctas
                        item = PAIR * unit - (PAIR - 1) * (unit % num_chunks) + it % PAIR * num_chunks
                        unit = cta + (it + 1) // PAIR * num_ctas
                        nitem = PAIR * unit - (PAIR - 1) * (unit % num_chunks) + (it + 1) % PAIR * num_chunks
                        # one search per pair: this item's chunk was the previous item's next (the first item's is
                        # searched), and the next item's is this one's (the pair's second v-head) or searched
                        t0_ = T.alloc_var("int32")
                        n_rows_ = T.alloc_var("int32")
                        nt0_ = T.alloc_var("int32")
                        nn_rows_ = T.alloc_var("int32")
                        if it == 0:
                            _, first_t0, first_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs,
                                                                    item % num_chunks, search_steps)
                            t0_ = first_t0
                            n_rows_ = first_rows
                        else:
                            t0_ = work_sh[1 - buf, 3]
                            n_rows_ = work_sh[1 - buf, 7]
                        if it % PAIR == 0:  # the next item is this pair's second v-head
                            nt0_ = t0_
                            nn_rows_ = n_rows_
                        else:
                            _, unit_t0, unit_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs,
                                                                  nitem % num_chunks, search_steps)
                            nt0_ = unit_t0
                            nn_rows_ = unit_rows
                    else:
                        item = cta + it * num_ctas
                        nitem = item + num_ctas
                        _, t0_, n_rows_ = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, item % num_chunks,
                                                        search_steps)
                        _, nt0_, nn_rows_ = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, nitem % num_chunks,
                                                          search_steps)
                    t0, n_rows, hv, nt0, nhv, nchunk, nkh, nn_rows = begin_item(
                        work_sh, gam_sh, tail_sh, gc_sh, buf, item, nitem, num_chunks, group, t0_, n_rows_, nt0_,
                        nn_rows_)
                    T.barrier_wait(k_full[buf], kpar)
                    # rows past the sequence end: the reference grid's zero padding (Q's and dO's: the gradients
                    # warpgroup's); K's first, which the gradients warpgroup waits for (k_ready)
                    if n_rows < C:
                        for r, j in T.Parallel(C, D):
                            if r >= n_rows:
                                K_s[buf, r, j] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.sync_threads(VALUES_BARRIER, WG)
                    T.barrier_arrive(k_ready)
                    if n_rows < C:
                        T.barrier_wait(v_full, par)
                        T.barrier_wait(ga_full, par)
                        for r, j in T.Parallel(C, D):
                            if r >= n_rows:
                                V_s[r, j] = T.cast(0, dtype)
                        for r, s in T.Parallel(C, C):
                            if r >= n_rows:
                                GA_s[r, s] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.sync_threads(VALUES_BARRIER, WG)
                    T.barrier_wait(s_full, par)
                    T.barrier_wait(ds_full, par)
                    T.wgmma_gemm(K_s[buf, :, :], S_s, KS, clear_accum=True)
                    T.wgmma_gemm(K_s[buf, :, :], dS_s, KdS, clear_accum=True)
                    # while they run: the next item's gates
                    if has_next:
                        gates_of(gcum, beta, nt0, nn_rows, nhv, gc_sh, beta_sh, 1 - buf)
                    for r in T.Parallel(C):  # beta by row in registers: the tiles' stores read no shared memory
                        beta_rows[r] = beta_sh[buf, r]
                    T.barrier_wait(v_full, par)
                    T.barrier_wait(ga_full, par)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(KS, num_regs=C * D // WG)
                    # Vd = V - diag(gamma) K S (kept for dbeta); V_s <- diag(beta) Vd; V_new = GA diag(beta) Vd
                    for r, j in T.Parallel(C, D):
                        KS[r, j] = V_s[r, j] - gam_sh[buf, r] * KS[r, j]
                    for r, j in T.Parallel(C, D):
                        V_s[r, j] = beta_rows[r] * KS[r, j]
                    T.fence_proxy_async()
                    T.sync_threads(VALUES_BARRIER, WG)
                    T.wgmma_gemm(GA_s, V_s, Vn, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(KdS, num_regs=C * D // WG)
                    for r, j in T.Parallel(C, D):
                        KdS[r, j] = tail_sh[buf, r] * KdS[r, j]
                    # dV_new = P^T dOs + diag(gamma_last / gamma) K dS, with scale P from the gradients warpgroup
                    T.barrier_wait(sp_ready, par)
                    T.barrier_wait(do_full, par)
                    T.wgmma_gemm(sP_s, dO_s, KdS, transpose_A=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(Vn, num_regs=C * D // WG)
                    T.copy(Vn, Vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(vn_ready)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(KdS, num_regs=C * D // WG)
                    T.barrier_arrive(do_free)
                    T.copy(KdS, dVn_s)
                    T.fence_proxy_async()
                    # rowsum(E_A) - colsum(E_P) - F = rowsum(V_new o bf(dV_new) - bf(V_new) o dV_new)   (D2)
                    for r, j in T.Parallel(C, D):
                        Vn[r, j] = (Vn[r, j] * T.cast(T.cast(KdS[r, j], dtype), "float32")
                                    - T.cast(T.cast(Vn[r, j], dtype), "float32") * KdS[r, j])
                    T.reduce_sum(Vn, rows_Vn, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[buf, 2, r] = rows_Vn[r]
                    T.sync_threads(VALUES_BARRIER, WG)

                    # dGamma_A = dV_new (diag(beta) Vd)^T, dX = GA^T dV_new and K K^T together
                    T.wgmma_gemm(dVn_s, V_s, dGA, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(GA_s, dVn_s, dX, transpose_A=True, clear_accum=True)
                    T.wgmma_gemm(K_s[buf, :, :], K_s[buf, :, :], KK, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(2)
                    T.warpgroup_fence_operand(dGA, num_regs=C * C // WG)
                    # sP_s <- Lower(dGamma_A) (dV_new's product has read scale P)
                    for r, s in T.Parallel(C, C):
                        sP_s[r, s] = T.if_then_else(r >= s, dGA[r, s], 0.0)
                    T.fence_proxy_async()
                    T.sync_threads(VALUES_BARRIER, WG)
                    # dL = StrictLower(-A^T dA A^T) from GA alone (docs/kernels.md, "Seventeenth session"):
                    # A^T dA A^T = D (GA^T Lower(dGamma_A) GA^T) D^-1 with D = diag(gamma)
                    T.wgmma_gemm(GA_s, sP_s, dL, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(2)  # dX
                    T.warpgroup_fence_operand(dX, num_regs=C * D // WG)
                    # dbeta = rowsum(dX o Vd); dv = dVd = diag(beta) dX -> dVn_s (both products reading it are done)
                    for r, j in T.Parallel(C, D):
                        KS[r, j] = dX[r, j] * KS[r, j]
                    T.reduce_sum(KS, rows_dX, dim=1)
                    for r in T.Parallel(C):
                        dbeta_part[0, r] = rows_dX[r]
                    T.sync_threads(VALUES_BARRIER, WG)  # every warp's part of both products has read dVn_s
                    for r, j in T.Parallel(C, D):
                        dVn_s[r, j] = beta_rows[r] * dX[r, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(dvd_ready)
                    # colsum(E_A) = rowsum(dX o diag(beta) Vd), with the bf16 diag(beta) Vd of dGamma_A (V_s)   (D2)
                    for r, j in T.Parallel(C, D):
                        dX[r, j] = dX[r, j] * V_s[r, j]
                    T.reduce_sum(dX, rows_A, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[buf, 5, r] = rows_A[r]
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(KK, num_regs=C * C // WG)
                    T.warpgroup_fence_operand(dL, num_regs=C * C // WG)
                    T.copy(dL, G_s)
                    T.fence_proxy_async()
                    T.sync_threads(VALUES_BARRIER, WG)  # and every warp has read V_s: the next item's V
                    if has_next:
                        T.tma_copy(v[nt0:nt0 + C, nhv, 0:D], V_s, barrier=v_full)
                        T.barrier_arrive(v_full)
                    T.wgmma_gemm(G_s, GA_s, dL, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dL, num_regs=C * C // WG)
                    # dL = StrictLower(-Gamma o that); G = diag(beta) dL -> G_s; dbeta += rowsum(dL o K K^T)
                    for r, s in T.Parallel(C, C):
                        dL[r, s] = -dL[r, s] * gamma_mask_unbranched(gc_sh, buf, r, s, True)
                    T.sync_threads(VALUES_BARRIER, WG)  # every warp's part of the product has read G_s and GA_s
                    if has_next:
                        T.tma_copy(GA[nt0:nt0 + C, nhv, 0:C], GA_s, barrier=ga_full)
                        T.barrier_arrive(ga_full)
                    for r, s in T.Parallel(C, C):
                        G_s[r, s] = beta_rows[r] * dL[r, s]
                    T.fence_proxy_async()
                    T.barrier_arrive(g_ready)
                    for r, s in T.Parallel(C, C):
                        KK[r, s] = dL[r, s] * KK[r, s]
                    T.reduce_sum(KK, rows_L, dim=1)
                    for r in T.Parallel(C):
                        dbeta_part[1, r] = rows_L[r]
                    store_rows(dVn_s, dv, t0, hv, n_rows)
                    T.sync_threads(VALUES_BARRIER, WG)
                    for r in T.Parallel(C):
                        if r < n_rows:
                            dbeta[t0 + r, hv] = dbeta_part[0, r] + dbeta_part[1, r]
                else:  # gradients: P and E_P, dP, dq, dk, dg
                    T.barrier_wait(k_ready, par)  # and the item's indices and row decays
                    t0, n_rows, hv = work_sh[buf, 0], work_sh[buf, 1], work_sh[buf, 2]
                    nt0, nhv, nchunk, nkh = work_sh[buf, 3], work_sh[buf, 4], work_sh[buf, 5], work_sh[buf, 6]
                    if n_rows < C:  # rows past the sequence end (K's: the values warpgroup's, k_ready)
                        T.barrier_wait(q_full, par)
                        T.barrier_wait(do_full, par)
                        for r, j in T.Parallel(C, D):
                            if r >= n_rows:
                                Q_s[r, j] = T.cast(0, dtype)
                                dO_s[r, j] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.sync_threads(GRADS_BARRIER, WG)
                    if has_next:  # the next item's K into the other buffer (its last item ended)
                        T.tma_copy(k[nt0:nt0 + C, nkh, 0:D], K_s[1 - buf, :, :], barrier=k_full[1 - buf])
                        T.barrier_arrive(k_full[1 - buf])
                    T.barrier_wait(q_full, par)
                    T.barrier_wait(k_full[buf], kpar)
                    T.wgmma_gemm(Q_s, K_s[buf, :, :], PY, transpose_B=True, clear_accum=True)
                    T.barrier_wait(do_full, par)
                    T.barrier_wait(s_full, par)
                    T.wgmma_gemm(dO_s, S_s, acc_q, transpose_B=True, clear_accum=True)
                    # while they run: gamma_last <S, dS> by row of S (it joins dgc of the last row), in two row halves
                    # (moved here from the values warpgroup, the kernel's critical path)
                    T.barrier_wait(ds_full, par)
                    for half in T.serial(2):
                        for r, j in T.Parallel(C, D):
                            VndS[r, j] = S_s[half * C + r, j] * dS_s[half * C + r, j]
                        T.reduce_sum(VndS, rows_SdS, dim=1)
                        for r in T.Parallel(C):
                            dgc_part[buf, 4, r] = (T.if_then_else(half == 0, 0.0, dgc_part[buf, 4, r])
                                                   + gam_sh[buf, C - 1] * rows_SdS[r])
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(PY, num_regs=C * C // WG)
                    # scale P = scale Gamma o Q K^T -> sP_s for the values warpgroup's dV_new; PY keeps it rounded
                    # as sP_s holds it (E_P's row sum stands in for colsum(E_P) through dV_new, (D2))
                    for r, s in T.Parallel(C, C):
                        PY[r, s] = T.cast(PY[r, s] * gamma_mask_unbranched(gc_sh, buf, r, s, False) * scale, dtype)
                    for r, s in T.Parallel(C, C):
                        sP_s[r, s] = PY[r, s]
                    T.fence_proxy_async()
                    T.barrier_arrive(sp_ready)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_q, num_regs=C * D // WG)
                    # dgc += rowsum(dOs o diag(gamma) Q S) = gamma scale rowsum(Q o dO S^T)
                    for r, j in T.Parallel(C, D):
                        VndS[r, j] = Q_s[r, j] * acc_q[r, j]
                    T.reduce_sum(VndS, rows_QS, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[buf, 1, r] = gam_sh[buf, r] * scale * rows_QS[r]
                    for r, j in T.Parallel(C, D):
                        acc_q[r, j] = acc_q[r, j] * (gam_sh[buf, r] * scale)
                    # dP = dOs V_new^T and V_new dS^T, once V_new is there
                    T.barrier_wait(vn_ready, par)
                    T.barrier_wait(ds_full, par)
                    T.wgmma_gemm(dO_s, Vn_s, dP, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(Vn_s, dS_s, VndS, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(dP, num_regs=C * C // WG)
                    # dPG_s <- dP o Gamma; dq = diag(gamma) dOs S^T + (dP o Gamma) K while rowsum(E_P) = rowsum(dO V_new^T
                    # o scale P) is taken; then dk = (dP o Gamma)^T Q + ... (issued once P and dP are done with)
                    for r, s in T.Parallel(C, C):
                        dP[r, s] = dP[r, s] * scale
                    for r, s in T.Parallel(C, C):
                        dPG_s[r, s] = dP[r, s] * gamma_mask(gc_sh, buf, r, s, False)
                    T.fence_proxy_async()
                    T.sync_threads(GRADS_BARRIER, WG)
                    T.wgmma_gemm(dPG_s, K_s[buf, :, :], acc_q)
                    for r, s in T.Parallel(C, C):
                        dP[r, s] = dP[r, s] * PY[r, s]
                    T.reduce_sum(dP, rows_P, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[buf, 0, r] = rows_P[r] / scale
                    T.wgmma_gemm(dPG_s, Q_s, acc_k, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(VndS, num_regs=C * D // WG)
                    T.warpgroup_fence_operand(acc_q, num_regs=C * D // WG)
                    # dq leaves through V_new's tile (both products reading it are done)
                    T.copy(acc_q, Vn_s)
                    if ordered:
                        T.fence_proxy_async()  # the TMA reduce reads it (after the barrier below)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_k, num_regs=C * D // WG)
                    T.barrier_wait(do_free, par)
                    T.sync_threads(GRADS_BARRIER, WG)  # dq in Vn_s; Q, dS and dO read by every product here
                    if has_next:  # and by the values warpgroup (do_free; dS before vn_ready): the next item's
                        T.tma_copy(q[nt0:nt0 + C, nkh, 0:D], Q_s, barrier=q_full)
                        T.tma_copy(dh[nchunk, nhv, 0:D, 0:D], dS_s, barrier=ds_full)
                        T.tma_copy(do[nt0:nt0 + C, nhv, 0:D], dO_s, barrier=do_full)
                        T.barrier_arrive(q_full)
                        T.barrier_arrive(ds_full)
                        T.barrier_arrive(do_full)
                    leave(Vn_s, dq, t0, hv, n_rows, it % PAIR == 0)
                    # dk += diag(gamma_last / gamma) V_new dS^T;  F = that scale o rowsum(K o V_new dS^T) (its sum
                    # joins the last row's dgc)
                    for r, j in T.Parallel(C, D):
                        acc_k[r, j] = acc_k[r, j] + tail_sh[buf, r] * VndS[r, j]
                    for r, j in T.Parallel(C, D):
                        VndS[r, j] = K_s[buf, r, j] * VndS[r, j]
                    T.reduce_sum(VndS, rows_F, dim=1)
                    for r in T.Parallel(C):
                        F_sh[r] = tail_sh[buf, r] * rows_F[r]
                    # dk -= diag(gamma) dVd S^T, dgc -= gamma o rowsum(K o dVd S^T), as soon as dVd is there
                    T.barrier_wait(dvd_ready, par)
                    T.wgmma_gemm(dVn_s, S_s, dVdS, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(dVdS, num_regs=C * D // WG)
                    T.sync_threads(GRADS_BARRIER, WG)  # every warp's part of the product has read S
                    if has_next:  # (the values warpgroup read it before its first hand-over)
                        T.tma_copy(h[nchunk, nhv, 0:D, 0:D], S_s, barrier=s_full)
                        T.barrier_arrive(s_full)
                    for r, j in T.Parallel(C, D):
                        acc_k[r, j] = acc_k[r, j] - gam_sh[buf, r] * dVdS[r, j]
                    for r, j in T.Parallel(C, D):
                        dVdS[r, j] = K_s[buf, r, j] * dVdS[r, j]
                    T.reduce_sum(dVdS, rows_dVd, dim=1)
                    for r in T.Parallel(C):
                        dgc_part[buf, 3, r] = -gam_sh[buf, r] * rows_dVd[r]
                    # dk += (G + G^T) K, the end of the values warpgroup's chain
                    T.barrier_wait(g_ready, par)
                    T.wgmma_gemm(G_s, K_s[buf, :, :], acc_k)
                    T.wgmma_gemm(G_s, K_s[buf, :, :], acc_k, transpose_A=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_k, num_regs=C * D // WG)
                    T.sync_threads(GRADS_BARRIER, WG)  # dq's stores have read Vn_s
                    T.copy(acc_k, Vn_s)  # dk leaves through V_new's tile too
                    if ordered:
                        T.fence_proxy_async()
                    T.sync_threads(GRADS_BARRIER, WG)
                    leave(Vn_s, dk, t0, hv, n_rows, it % PAIR == 0)
                    # dg = reverse cumsum of dgc over the rows that exist, plus the last row's sum(F) and gamma_last
                    # <S, dS>, which reach every row: row r of [s >= r] dgc[s] + (F + those shares)[s], summed over s
                    # (the values warpgroup's shares of dgc were written before g_ready)
                    for r in T.Parallel(C):
                        dg_sh[r] = T.if_then_else(r < n_rows, dgc_part[buf, 0, r] + dgc_part[buf, 1, r]
                                                  + dgc_part[buf, 2, r] + dgc_part[buf, 3, r] - dgc_part[buf, 5, r],
                                                  0.0)
                        dg_sh[C + r] = F_sh[r] + dgc_part[buf, 4, r]
                    T.sync_threads(GRADS_BARRIER, WG)
                    for r, s in T.Parallel(C, C):
                        dP[r, s] = T.if_then_else(s >= r, dg_sh[s], 0.0) + dg_sh[C + s]
                    T.reduce_sum(dP, rows_P, dim=1)
                    for r in T.Parallel(C):
                        if r < n_rows:
                            dg[hv, t0 + r] = rows_P[r]

    return chunk_bwd_local
