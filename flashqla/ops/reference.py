"""Pure-PyTorch chunked GDN: the CPU backend and the oracle for the TileLang kernels.

Every step has the name the kernels use (design doc ../shared/design/gdn_algorithm.md, §2):

    gc      chunk-local cumulative log-decay (natural log), gamma = exp(gc), gamma_last = gamma[C-1]
    A       gate-free WY inverse (I + StrictLower(diag(beta) K K^T))^{-1}
    Gamma   Gamma[r, s] = gamma_r / gamma_s on r >= s, 0 above the diagonal
    Vd      V - diag(gamma) K S                    ("V delta")
    V_new   (Gamma o A) diag(beta) Vd              (V' in the design doc)
    O       scale (diag(gamma) Q S + (Gamma o Q K^T) V_new)
    S       S_next = gamma_last S + K^T diag(gamma_last / gamma) V_new

Tensors on the chunk grid are laid out [rows, chunks, H, C, D] (see layout.py); all arithmetic runs
in fp32 (fp64 when an input is fp64). The state walk is the only serial part; everything local to a
chunk is computed for all chunks at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .layout import ChunkGrid


def work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def chunk_local_cumsum(g: torch.Tensor) -> torch.Tensor:
    """[..., C] log-decays -> cumulative sums that restart at every chunk."""
    return g.cumsum(-1)


def wy_inverse(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """A = (I + StrictLower(diag(beta) K K^T))^{-1}, k [..., C, K], beta [..., C] -> [..., C, C].

    No gate enters A: the gated inverse is Gamma o A (design doc §2).
    """
    C = k.shape[-2]
    L = torch.tril(beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)), diagonal=-1)
    eye = torch.eye(C, dtype=k.dtype, device=k.device).expand_as(L)
    return torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)


@dataclass
class DecayFactors:
    gamma: torch.Tensor  # [..., C]       exp(gc)
    gamma_last: torch.Tensor  # [..., 1]       exp(gc[C-1])
    to_end: torch.Tensor  # [..., C]       gamma_last / gamma
    Gamma: torch.Tensor  # [..., C, C]    gamma_r / gamma_s on r >= s, else 0


def chunk_range(terms, start: int, stop: int):
    """The same dataclass (DecayFactors, ChunkInputs, BackwardTerms) restricted to chunks [start, stop)
    of every [rows, chunks, ...] field."""
    def cut(value):
        return chunk_range(value, start, stop) if dataclasses.is_dataclass(value) else value[:, start:stop]
    return dataclasses.replace(terms, **{f.name: cut(getattr(terms, f.name)) for f in dataclasses.fields(terms)})


def decay_factors(gc: torch.Tensor) -> DecayFactors:
    gc_last = gc[..., -1:]
    C = gc.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=gc.device).tril()
    # mask before exp: above the diagonal gc_r - gc_s > 0 can overflow
    log_Gamma = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~lower, -torch.inf)
    return DecayFactors(gc.exp(), gc_last.exp(), (gc_last - gc).exp(), log_Gamma.exp())


@dataclass
class ChunkInputs:
    """One call's inputs on the chunk grid, in the work dtype, v-head layout [rows, chunks, Hv, C, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gc: torch.Tensor  # [rows, chunks, Hv, C]
    beta: torch.Tensor  # [rows, chunks, Hv, C]
    A: torch.Tensor  # [rows, chunks, Hv, C, C]
    decay: DecayFactors


def to_chunk_inputs(grid: ChunkGrid, q, k, v, g, beta) -> ChunkInputs:
    """Flat [B*T, H, D] tensors -> chunk-grid tensors with q/k expanded to the v-heads (GQA)."""
    dtype = work_dtype(q, k, v, g, beta)
    group = v.shape[1] // q.shape[1]

    def on_grid(x):  # [B*T, H, ...] -> [rows, chunks, H, C, ...]
        return grid.gather(x.to(dtype)).movedim(3, 2)

    qc = on_grid(q.repeat_interleave(group, dim=1))
    kc = on_grid(k.repeat_interleave(group, dim=1))
    gc = chunk_local_cumsum(on_grid(g))
    betac = on_grid(beta)
    return ChunkInputs(qc, kc, on_grid(v), gc, betac, wy_inverse(kc, betac), decay_factors(gc))


def state_walk(x: ChunkInputs, S0: torch.Tensor, scale: float, with_output: bool = True, restart=None):
    """Walk the chunks in order from S0 [rows, Hv, K, V].

    restart [rows, chunks, Hv] (bool, optional): zero the state of that (row, head) before the chunk,
    which is how a CP warmup restarts W chunks before a segment ends (design doc §4).
    Returns (O or None, S_in [rows, chunks, Hv, K, V] = the state entering each chunk, S_final).
    """
    d = x.decay
    Gamma_A = d.Gamma * x.A
    Gamma_QK = d.Gamma * (x.q @ x.k.transpose(-1, -2)) if with_output else None
    K_gamma = d.gamma.unsqueeze(-1) * x.k
    K_to_end = d.to_end.unsqueeze(-1) * x.k
    S = S0.to(x.q.dtype)
    S_in, O = [], []
    for c in range(x.q.shape[1]):
        if restart is not None:
            S = S.masked_fill(restart[:, c, :, None, None], 0.0)
        S_in.append(S)
        Vd = x.v[:, c] - K_gamma[:, c] @ S
        V_new = Gamma_A[:, c] @ (x.beta[:, c].unsqueeze(-1) * Vd)
        if with_output:
            O.append(scale * (d.gamma[:, c].unsqueeze(-1) * (x.q[:, c] @ S) + Gamma_QK[:, c] @ V_new))
        S = d.gamma_last[:, c].unsqueeze(-1) * S + K_to_end[:, c].transpose(-1, -2) @ V_new
    O = torch.stack(O, 1) if with_output else None
    return O, torch.stack(S_in, 1), S


def transition(x: ChunkInputs) -> torch.Tensor:
    """T = gamma_last (I - K^T A diag(beta) K) per chunk [rows, chunks, Hv, K, K]: S_next = T S + R (§3)."""
    K = x.k.shape[-1]
    eye = torch.eye(K, dtype=x.k.dtype, device=x.k.device)
    KtAbK = x.k.transpose(-1, -2) @ (x.A @ (x.beta.unsqueeze(-1) * x.k))
    return x.decay.gamma_last.unsqueeze(-1) * (eye - KtAbK)


def transition_product(x: ChunkInputs) -> torch.Tensor:
    """M = T_{n-1} ... T_0 over each row's chunks [rows, Hv, K, K]; empty slots are identity steps.

    Multiplied pairwise (T_{2j+1} T_{2j}, then pairs of pairs, ...): log2(chunks) batched products
    instead of a serial walk, so a long sequence costs a few launches.
    """
    T = transition(x)
    while T.shape[1] > 1:
        if T.shape[1] % 2:
            eye = torch.eye(T.shape[-1], dtype=T.dtype, device=T.device)
            T = torch.cat([T, eye.expand(T.shape[:1] + (1,) + T.shape[2:])], 1)
        T = T[:, 1::2] @ T[:, 0::2]
    return T[:, 0]


@dataclass
class BackwardTerms:
    """Chunk-local quantities shared by the reverse walk and the local gradients."""

    dOs: torch.Tensor
    P: torch.Tensor  # Gamma o Q K^T
    Gamma_A: torch.Tensor  # Gamma o A
    K_gamma: torch.Tensor  # diag(gamma) K
    Q_gamma: torch.Tensor  # diag(gamma) Q
    K_to_end: torch.Tensor  # diag(gamma_last / gamma) K


def backward_terms(x: ChunkInputs, dO: torch.Tensor, scale: float) -> BackwardTerms:
    d = x.decay
    return BackwardTerms(scale * dO, d.Gamma * (x.q @ x.k.transpose(-1, -2)), d.Gamma * x.A,
                         d.gamma.unsqueeze(-1) * x.k, d.gamma.unsqueeze(-1) * x.q, d.to_end.unsqueeze(-1) * x.k)


def reverse_walk(x: ChunkInputs, b: BackwardTerms, dS_final: torch.Tensor, restart=None):
    """The serial part of the backward: dS (gradient of the state leaving each chunk) in reverse,
        dV_new = (Gamma o QK^T)^T dOs + K_to_end dS_next                      (docs/algorithm.md B1)
        dVd    = diag(beta) (Gamma o A)^T dV_new                              (B2)
        dS     = gamma_last dS_next + (gamma Q)^T dOs - (gamma K)^T dVd       (B3)
    restart [rows, chunks, Hv] (optional): zero dS of that (row, head) before processing the chunk
    (the mirror of the forward warmup). Returns dS_out (stacked over chunks) and dS0.
    """
    betau = x.beta.unsqueeze(-1)
    chunks = x.q.shape[1]
    dS = dS_final.to(x.q.dtype)
    dS_out = [None] * chunks
    for c in reversed(range(chunks)):
        if restart is not None:
            dS = dS.masked_fill(restart[:, c, :, None, None], 0.0)
        dS_out[c] = dS
        dV_new = b.P[:, c].transpose(-1, -2) @ b.dOs[:, c] + b.K_to_end[:, c] @ dS
        dVd = betau[:, c] * (b.Gamma_A[:, c].transpose(-1, -2) @ dV_new)
        dS = (x.decay.gamma_last[:, c].unsqueeze(-1) * dS + b.Q_gamma[:, c].transpose(-1, -2) @ b.dOs[:, c]
              - b.K_gamma[:, c].transpose(-1, -2) @ dVd)
    return torch.stack(dS_out, 1), dS


def states_in(x: ChunkInputs, S0: torch.Tensor) -> torch.Tensor:
    """The state entering every chunk [rows, chunks, Hv, K, V] from S0 [rows, Hv, K, V]."""
    return state_walk(x, S0, 1.0, with_output=False)[1]


def gate_gradient(dgc: torch.Tensor) -> torch.Tensor:
    """dg from dgc on the grid: gc = cumsum(g) inside each chunk, so dg is the reverse cumsum of dgc."""
    return dgc.flip(-1).cumsum(-1).flip(-1)


def chunk_backward_in_blocks(x: ChunkInputs, b: BackwardTerms, S_in: torch.Tensor, dS_out: torch.Tensor,
                             block_chunks: int):
    """chunk_backward over blocks of `block_chunks` chunks: the same gradients, with the temporaries of
    one block alive at a time (a [rows, chunks, Hv, K, V] product is 1 GiB at 32K tokens and Hv 32)."""
    chunks = x.q.shape[1]
    parts = [chunk_backward(chunk_range(x, c0, c0 + block_chunks), chunk_range(b, c0, c0 + block_chunks),
                            S_in[:, c0:c0 + block_chunks], dS_out[:, c0:c0 + block_chunks])
             for c0 in range(0, chunks, block_chunks)]
    return tuple(torch.cat(grads, 1) if len(parts) > 1 else grads[0] for grads in zip(*parts))


def chunk_backward(x: ChunkInputs, b: BackwardTerms, S_in: torch.Tensor, dS_out: torch.Tensor):
    """Gradients of the chunked forward (docs/algorithm.md, "Chunked backward"), local to every chunk.

    S_in / dS_out: the state entering / the gradient of the state leaving every chunk, from the two
    serial walks.
    Everything here is computed for all chunks at once. Returns dq, dk, dv, dgc, dbeta on the grid
    (v-head layout).
    """
    d = x.decay
    S_in, dS_out = S_in.to(x.q.dtype), dS_out.to(x.q.dtype)
    betau = x.beta.unsqueeze(-1)
    dOs, P, Gamma_A = b.dOs, b.P, b.Gamma_A
    # B1, B2 for every chunk at once from dS_out
    dV_new = P.transpose(-1, -2) @ dOs + b.K_to_end @ dS_out
    dVd = betau * (Gamma_A.transpose(-1, -2) @ dV_new)

    # forward quantities that depend on the state entering each chunk
    Vd = x.v - b.K_gamma @ S_in
    V_new = Gamma_A @ (betau * Vd)

    # O = scale (diag(gamma) Q S + P V_new)
    dP = dOs @ V_new.transpose(-1, -2)
    dP_Gamma = dP * d.Gamma
    dq = d.gamma.unsqueeze(-1) * (dOs @ S_in.transpose(-1, -2)) + dP_Gamma @ x.k
    dk = dP_Gamma.transpose(-1, -2) @ x.q
    E_P = dP * P
    dgc = (dOs * (b.Q_gamma @ S_in)).sum(-1) + E_P.sum(-1) - E_P.sum(-2)

    # S_next = gamma_last S + K_to_end^T V_new
    V_dS = V_new @ dS_out.transpose(-1, -2)  # gradient of K_to_end
    dk = dk + d.to_end.unsqueeze(-1) * V_dS
    F = d.to_end * (x.k * V_dS).sum(-1)
    dgc = dgc - F
    dgc[..., -1] += F.sum(-1) + d.gamma_last.squeeze(-1) * (S_in * dS_out).sum((-1, -2))

    # V_new = (Gamma o A) diag(beta) Vd
    dGamma_A = dV_new @ (betau * Vd).transpose(-1, -2)
    dX = Gamma_A.transpose(-1, -2) @ dV_new  # so that dVd = diag(beta) dX
    dbeta = (dX * Vd).sum(-1)
    E_A = dGamma_A * Gamma_A
    dgc = dgc + E_A.sum(-1) - E_A.sum(-2)
    dA = dGamma_A * d.Gamma
    # A = (I + L)^{-1}, L = StrictLower(diag(beta) K K^T):  dL = StrictLower(-A^T dA A^T)
    dL = torch.tril(-(x.A.transpose(-1, -2) @ dA @ x.A.transpose(-1, -2)), diagonal=-1)
    dbeta = dbeta + (dL * (x.k @ x.k.transpose(-1, -2))).sum(-1)
    G = betau * dL
    dk = dk + (G + G.transpose(-1, -2)) @ x.k

    # Vd = V - diag(gamma) K S
    dVd_S = dVd @ S_in.transpose(-1, -2)
    dk = dk - d.gamma.unsqueeze(-1) * dVd_S
    dgc = dgc - (b.K_gamma * dVd_S).sum(-1)
    return dq, dk, dVd, dgc, dbeta
