"""Output of every chunk at once, from the states `chunk_states` wrote (design doc §2, docs/algorithm.md F4):

    O = scale (diag(gamma) Q S + (Lower(Gamma) o Q K^T) V')

One CTA per (chunk slot, v-head) with the whole 128-wide V; chunk slot c finds its sequence by binary
search in `chunk_offsets` (as in wy_inverse). Slots past the last chunk and rows past the end of a
sequence store nothing. Tiles are copied whole (rows past the tensor end come in as zeros); V' rows
past the sequence end are then zeroed, so whatever lies behind them (the NaN poison of a test) cannot
reach a stored row through 0 * NaN; K rows there only reach P entries the causal mask removes.
"""
import tilelang.language as T

from .chunk_map import chunk_of_slot

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634


def build_chunk_output(dtype: str):
    num_tokens = T.dynamic("num_tokens")
    num_qk_heads = T.dynamic("num_qk_heads")
    num_v_heads = T.dynamic("num_v_heads")
    num_seqs = T.dynamic("num_seqs")
    num_chunk_slots = T.dynamic("num_chunk_slots")
    C, D = CHUNK, HEAD_DIM

    @T.prim_func
    def chunk_output(
        q: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        k: T.Tensor((num_tokens, num_qk_heads, D), dtype),
        vnew: T.Tensor((num_tokens, num_v_heads, D), dtype),
        gcum: T.Tensor((num_v_heads, num_tokens), "float32"),
        h_in: T.Tensor((num_chunk_slots, num_v_heads, D, D), dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        chunk_offsets: T.Tensor((num_seqs + 1,), "int32"),
        o: T.Tensor((num_tokens, num_v_heads, D), dtype),
        scale: T.float32,
        search_steps: T.int32,
    ):
        with T.Kernel(num_chunk_slots, num_v_heads, threads=128) as (chunk, h):
            hk = h // (num_v_heads // num_qk_heads)
            Q_s = T.alloc_shared((C, D), dtype)
            K_s = T.alloc_shared((C, D), dtype)
            S_s = T.alloc_shared((D, D), dtype)
            Vn_s = T.alloc_shared((C, D), dtype)
            P_s = T.alloc_shared((C, C), dtype)
            gc_sh = T.alloc_shared((C,), "float32")
            O = T.alloc_fragment((C, D), "float32")
            P = T.alloc_fragment((C, C), "float32")

            seq, start, n_rows = chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps)
            last = T.max(n_rows - 1, 0)

            if n_rows > 0:
                T.async_copy(q[start:start + C, hk, 0:D], Q_s)  # all four tiles in flight at once
                T.async_copy(k[start:start + C, hk, 0:D], K_s)
                T.async_copy(vnew[start:start + C, h, 0:D], Vn_s)
                T.async_copy(h_in[chunk, h, 0:D, 0:D], S_s)
                T.ptx_wait_group(0)
                T.sync_threads()
                for r in T.Parallel(C):
                    gc_sh[r] = gcum[h, start + T.min(r, last)] * LOG2E
                if n_rows < C:
                    for r, d in T.Parallel(C, D):
                        if r >= n_rows:
                            Vn_s[r, d] = T.cast(0, dtype)

                T.gemm(Q_s, S_s, O, clear_accum=True)
                T.gemm(Q_s, K_s, P, transpose_B=True, clear_accum=True)
                for r, s in T.Parallel(C, C):
                    P_s[r, s] = T.Select(r >= s, P[r, s] * T.exp2(gc_sh[r] - gc_sh[s]), 0.0)
                for r, j in T.Parallel(C, D):
                    O[r, j] = O[r, j] * T.exp2(gc_sh[r])
                T.gemm(P_s, Vn_s, O)
                for r, j in T.Parallel(C, D):
                    if r < n_rows:
                        o[start + r, h, j] = O[r, j] * scale

    return chunk_output
