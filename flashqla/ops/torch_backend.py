"""The "torch" backend: runs the reference algebra (reference.py) on the chunk grid (layout.py)."""
from __future__ import annotations

import torch

from . import reference
from .layout import ChunkGrid, runs_from_lengths, sequence_bounds


def sequence_grid(batch: int, seq_len: int, cu_seqlens: list[int] | None) -> ChunkGrid:
    return runs_from_lengths(*sequence_bounds(batch, seq_len, cu_seqlens), batch * seq_len)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape((-1,) + x.shape[2:])


def _from_grid(grid: ChunkGrid, xc: torch.Tensor, batch: int) -> torch.Tensor:
    """[rows, chunks, H, C, *] on the grid -> [B, T, H, *] in the work dtype."""
    x = grid.scatter(xc.movedim(2, 3))
    return x.reshape((batch, -1) + x.shape[1:])


def _initial_state(initial_state, rows, v, K, dtype):
    if initial_state is not None:
        return initial_state.to(dtype)
    return torch.zeros(rows, v.shape[2], K, v.shape[3], dtype=dtype, device=v.device)


def forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    grid = sequence_grid(q.shape[0], q.shape[1], cu_seqlens)
    x = reference.to_chunk_inputs(grid, _flat(q), _flat(k), _flat(v), _flat(g), _flat(beta))
    S0 = _initial_state(initial_state, grid.rows, v, q.shape[-1], x.q.dtype)
    O, _, S_final = reference.state_walk(x, S0, scale)
    o = _from_grid(grid, O, q.shape[0]).to(q.dtype)
    final_state = S_final.to(torch.promote_types(x.q.dtype, torch.float32)) if output_final_state else None
    return o, final_state


def backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) in the dtypes of (q, k, v, g, beta, initial_state)."""
    grid = sequence_grid(q.shape[0], q.shape[1], cu_seqlens)
    x = reference.to_chunk_inputs(grid, _flat(q), _flat(k), _flat(v), _flat(g), _flat(beta))
    S0 = _initial_state(initial_state, grid.rows, v, q.shape[-1], x.q.dtype)
    _, S_in, _ = reference.state_walk(x, S0, scale, with_output=False)
    dO = grid.gather(_flat(do).to(x.q.dtype)).movedim(3, 2)
    dS_final = dht if dht is not None else torch.zeros_like(S0)
    dq, dk, dv, dgc, dbeta, dS0 = reference.chunk_backward(x, S_in, dO, dS_final, scale)
    # gc = cumsum(g) inside each chunk, so dg is the reverse cumsum of dgc
    dg = dgc.flip(-1).cumsum(-1).flip(-1)

    B, Hqk = q.shape[0], q.shape[2]

    def to_qk_heads(dx):  # sum, in the work dtype, the GQA group of v-heads that read each q/k head
        dx = _from_grid(grid, dx, B)
        return dx.reshape(dx.shape[:2] + (Hqk, -1) + dx.shape[3:]).sum(3)

    dq, dk = to_qk_heads(dq).to(q.dtype), to_qk_heads(dk).to(k.dtype)
    dv = _from_grid(grid, dv, B).to(v.dtype)
    dg = _from_grid(grid, dg.unsqueeze(-1), B).reshape(g.shape).to(g.dtype)
    dbeta = _from_grid(grid, dbeta.unsqueeze(-1), B).reshape(beta.shape).to(beta.dtype)
    dh0 = dS0.to(initial_state.dtype) if initial_state is not None else None
    return dq, dk, dv, dg, dbeta, dh0
