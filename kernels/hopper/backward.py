"""Backward of GDN chunked prefill on SM90: four kernels over the forward's flat token layout.

    wy_inverse (store_a)  A (without beta), W, U and the chunk-local cumulative gates, recomputed
    chunk_states          the state entering every chunk (input dtype), the forward's walk again
    chunk_dstates         the reverse walk: the gradient of the state leaving every chunk, and dS0
    chunk_bwd_local       every chunk at once: dq, dk (per v-head), dv, dg, dbeta from those two

Nothing of the forward is saved but its inputs. Host work: dOs = scale dO, the GQA sums of dq and dk,
and casts to the input dtypes. Sequences of any length, GQA, initial state and dht as in the forward.
"""
from __future__ import annotations

import torch

from .launch import HEAD_DIM, block_v_on, compiled_chunk_bwd_local, compiled_chunk_dstates, prepare, walk


def chunk_gdn_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of `chunk_gdn_fwd`'s o (upstream `do`) and final state (`dht`).

    Shapes and dtypes as chunk_gdn_fwd's inputs (validated, contiguous); do [B, T, Hv, 128]; dht fp32
    [N, Hv, 128, 128] or None. dh0 is None without an initial state.
    """
    B, T, Hqk, D = q.shape
    Hv = v.shape[2]
    x = prepare(q, k, v, g, beta, cu_seqlens, store_a=True)
    N, device = x.num_seqs, q.device
    h, _, _ = walk(x, initial_state, store_final=False)

    dos = (do.reshape(B * T, Hv, D) * scale).to(q.dtype)
    dh = torch.empty_like(h)
    placeholder = torch.empty(1, D, D, dtype=torch.float32, device=device)
    dht_arg = placeholder if dht is None else dht.float().reshape(N * Hv, D, D).contiguous()
    dh0 = placeholder if initial_state is None else torch.empty(N * Hv, D, D, dtype=torch.float32, device=device)
    compiled_chunk_dstates(x.dtype, block_v_on(device, N, Hv))(
        x.q, x.k, x.w, dos, x.gcum, x.cu, x.offsets, dht_arg, dh, dh0, int(dht is not None),
        int(initial_state is not None))

    dq, dk, dv = (torch.empty(B * T, Hv, D, dtype=torch.float32, device=device) for _ in range(3))
    dg = torch.empty(Hv, B * T, dtype=torch.float32, device=device)
    dbeta = torch.empty(B * T, Hv, dtype=torch.float32, device=device)
    compiled_chunk_bwd_local(x.dtype)(
        x.q, x.k, v.view(B * T, Hv, D), dos, x.Ab, x.gcum, beta.reshape(B * T, Hv).float(), h, dh, x.cu, x.offsets,
        dq, dk, dv, dg, dbeta, N.bit_length())

    def qk_heads(dx):  # v-head h read k-head h // (Hv / Hqk): sum each group
        return dx.view(B, T, Hqk, Hv // Hqk, D).sum(3)

    return (qk_heads(dq).to(q.dtype), qk_heads(dk).to(k.dtype), dv.view(v.shape).to(v.dtype),
            dg.t().reshape(g.shape).to(g.dtype), dbeta.view(beta.shape).to(beta.dtype),
            None if initial_state is None else dh0.view(N, Hv, D, D).to(initial_state.dtype))
