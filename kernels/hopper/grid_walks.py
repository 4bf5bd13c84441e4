"""The backward's kernels over the reference's chunk grid: the path of intra-card CP segments.

`flashqla.ops.torch_backend.backward` works on the chunk grid (rows = segments) and hands the two serial
walks and the chunk-local gradients to a `walks` object; this one runs them as `chunk_states`,
`chunk_dstates` and `chunk_bwd_local`. (Unsegmented calls skip the grid: backward.py.) The grid [rows, chunks, Hv, C, D]
is laid out as a token stream in which every row is a sequence of chunks * C tokens: padding slots are
zeros (identity steps), so every sequence is a whole number of chunks, as chunk_dstates requires.
q and k are already expanded to the v-heads on the grid. Operands go to the kernels in the input dtype
(bf16/fp16); per-chunk states and state gradients stay in that dtype (half the memory of fp32) and are
widened block by block by the local math.
"""
from __future__ import annotations

import torch

from .launch import (
    _TORCH_TO_TL,
    CHUNK,
    HEAD_DIM,
    block_v_on,
    compiled_chunk_bwd_local,
    compiled_chunk_dstates,
    compiled_chunk_states,
)

def _stream(xc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, chunks, H, C, D] -> [rows * chunks * C, H, D] in `dtype`."""
    rows, chunks, H, C, D = xc.shape
    return xc.transpose(2, 3).reshape(rows * chunks * C, H, D).to(dtype).contiguous()


def _gate_stream(gc: torch.Tensor) -> torch.Tensor:
    """[rows, chunks, H, C] chunk-local cumulative gates -> [H, rows * chunks * C] fp32."""
    return gc.permute(2, 0, 1, 3).reshape(gc.shape[2], -1).float().contiguous()


class KernelWalks:
    """One backward call's walks (made per call: it keeps that call's W for the second walk)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.tl_dtype = _TORCH_TO_TL[dtype]
        self._w_of = None  # (ChunkInputs, its W stream)

    def _layout(self, x):
        rows, chunks, Hv = x.q.shape[:3]
        device = x.q.device
        cu = torch.arange(rows + 1, dtype=torch.int32, device=device) * (chunks * CHUNK)
        offsets = torch.arange(rows + 1, dtype=torch.int32, device=device) * chunks
        return rows, chunks, Hv, cu, offsets, block_v_on(device, rows, Hv)

    def _w_stream(self, x) -> torch.Tensor:
        """W = diag(gamma) A diag(beta) K per chunk (docs/algorithm.md W1) as a kernel stream, made once."""
        if self._w_of is None or self._w_of[0] is not x:
            w = x.decay.gamma.unsqueeze(-1) * (x.A @ (x.beta.unsqueeze(-1) * x.k))
            self._w_of = (x, _stream(w, self.dtype))
        return self._w_of[1]

    def states_in(self, x, S0: torch.Tensor) -> torch.Tensor:
        rows, chunks, Hv, cu, offsets, block_v = self._layout(x)
        U = (x.decay.Gamma * x.A) @ (x.beta.unsqueeze(-1) * x.v)
        k, u = _stream(x.k, self.dtype), _stream(U, self.dtype)
        w = self._w_stream(x)
        h = torch.empty(rows * chunks, Hv, HEAD_DIM, HEAD_DIM, dtype=self.dtype, device=k.device)
        vnew = torch.empty_like(u)
        h0 = S0.float().reshape(rows * Hv, HEAD_DIM, HEAD_DIM).contiguous()
        unused_ht = torch.empty(1, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=k.device)
        compiled_chunk_states(self.tl_dtype, block_v)(k, w, u, _gate_stream(x.gc), cu, offsets, h0, h, vnew,
                                                      unused_ht, 1, 0, 1, 1)
        return h.view(rows, chunks, Hv, HEAD_DIM, HEAD_DIM)  # input dtype; widened block by block

    def state_gradients(self, x, b, dS_final: torch.Tensor):
        rows, chunks, Hv, cu, offsets, block_v = self._layout(x)
        q, k, dOs = (_stream(t, self.dtype) for t in (x.q, x.k, b.dOs))
        w = self._w_stream(x)
        dh = torch.empty(rows * chunks, Hv, HEAD_DIM, HEAD_DIM, dtype=self.dtype, device=k.device)
        dht = dS_final.float().reshape(rows * Hv, HEAD_DIM, HEAD_DIM).contiguous()
        dh0 = torch.empty_like(dht)
        compiled_chunk_dstates(self.tl_dtype, block_v)(q, k, w, dOs, _gate_stream(x.gc), cu, offsets, dht, dh, dh0,
                                                       1, 1)
        return dh.view(rows, chunks, Hv, HEAD_DIM, HEAD_DIM), dh0.view(rows, Hv, HEAD_DIM, HEAD_DIM).to(x.q.dtype)

    def chunk_gradients(self, x, b, S_in: torch.Tensor, dS_out: torch.Tensor):
        """reference.chunk_backward on the chunk_bwd_local kernel: dq, dk, dv, dg, dbeta on the grid, with dg
        already the in-chunk reverse cumsum of dgc."""
        rows, chunks, Hv, cu, offsets, _ = self._layout(x)
        C, D = x.q.shape[-2:]
        N = rows * chunks * C
        device = x.q.device
        q, k, v, dOs, A = (_stream(t, self.dtype) for t in (x.q, x.k, x.v, b.dOs, x.A))
        beta = x.beta.transpose(2, 3).reshape(N, Hv).float().contiguous()
        h = S_in.reshape(rows * chunks, Hv, D, D).to(self.dtype).contiguous()
        dh = dS_out.reshape(rows * chunks, Hv, D, D).to(self.dtype).contiguous()
        dq, dk, dv = (torch.empty(N, Hv, D, dtype=torch.float32, device=device) for _ in range(3))
        dg = torch.empty(Hv, N, dtype=torch.float32, device=device)
        dbeta = torch.empty(N, Hv, dtype=torch.float32, device=device)
        compiled_chunk_bwd_local(self.tl_dtype)(q, k, v, dOs, A, _gate_stream(x.gc), beta, h, dh, cu, offsets, dq, dk,
                                                dv, dg, dbeta, rows.bit_length())
        work = x.q.dtype
        on_grid = lambda t: t.view(rows, chunks, C, Hv, -1).transpose(2, 3).to(work)  # noqa: E731
        dg = dg.view(Hv, rows, chunks, C).permute(1, 2, 0, 3).to(work)
        return on_grid(dq), on_grid(dk), on_grid(dv), dg, on_grid(dbeta).squeeze(-1)
