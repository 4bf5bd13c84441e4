"""TileLang SM90 (Hopper) kernels for GDN chunked prefill, forward and backward.

Dispatch contract (flashqla/ops/backends.py):
    unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens) -> str | None
    chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens) -> (o, ht | None)
        (keep_inverse=True: a third item, the KeptInverse for the backward; keep_states=True: carrying the
        per-chunk states the fused walk stored beside O, so that the backward recomputes none)
    chunk_gdn_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, kept=None)
        -> (dq, dk, dv, dg, dbeta, dh0)

Forward: `wy_inverse` (GA = Gamma o A and the chunk-local cumsum of g, per chunk and v-head), then
`fused_fwd` (one walk computing the outputs too); or, split (`fused=False`), `chunk_states` (the serial
state walk per sequence, v-head and V tile) and `chunk_output` (all chunks at once). The segmented forward
(flashqla/cp/segments.py) adds the summary walks (`chunk_states` without per-chunk stores, computing
intra-card CP's gate statistics first) and `segment_chain`. Backward (`chunk_gdn_bwd`, backward.py): from the
forward's kept GA, gates and fp32 beta (`KeptInverse`; `wy_inverse` again when it kept none), `fused_fwd`'s state walk (the
state entering every chunk) beside the reverse walk `chunk_dstates`, then `chunk_bwd_local` (every chunk's
gradients at once) and `gqa_sum`. Intra-card and inter-card CP
(flashqla/cp) compose the same pieces: prepare, walk, summaries, fold_segments, output, state_gradients,
backward_of.
Nothing here imports tilelang or touches CUDA at import time; kernels compile on first use (or load
from TileLang's cache).
"""
from __future__ import annotations

import torch

from .backward import (backward_of, chunk_gdn_bwd, entering_state_gradients, output_gradient,
                       state_gradients)
from .launch import (HEAD_DIM, KeptInverse, block_v_for, chunk_gdn_fwd, fold_segments, fused_forward, output, prepare,
                     prepare_from_kept, states_buffer, summaries, summaries_from_gates, walk,
                     walks_exceed_a_wave)

__all__ = ["unsupported_reason", "chunk_gdn_fwd", "chunk_gdn_bwd", "block_v_for", "prepare", "prepare_from_kept",
           "KeptInverse", "walk", "summaries", "summaries_from_gates", "output", "fused_forward", "fold_segments",
           "state_gradients", "backward_of", "output_gradient", "entering_state_gradients",
           "walks_exceed_a_wave", "states_buffer"]

_DTYPES = (torch.bfloat16, torch.float16)


def unsupported_reason(q, k, v, g, beta, initial_state, cu_seqlens) -> str | None:
    """None when these kernels can run the call, else why not (inputs are already validated)."""
    if q.dtype not in _DTYPES:
        return f"q/k/v dtype {q.dtype} is not supported by the TileLang kernels (bf16 or fp16 only)"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"the TileLang kernels need K = V = {HEAD_DIM}, got K = {q.shape[-1]}, V = {v.shape[-1]}"
    if beta.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"beta dtype {beta.dtype} is not supported by the TileLang kernels"
    return None
