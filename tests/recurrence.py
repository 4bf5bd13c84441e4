"""Ground truth for the tests: the GDN recurrence token by token, in float64 (design doc §1).

Written here on purpose, independent of the package: S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
o_t = scale S_t^T q_t, a_t = exp(g_t). Differentiable, so autograd of this loop gives reference gradients.
"""
import torch


def gdn_recurrence(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None):
    """Same arguments as flashqla.chunk_gated_delta_rule; returns (o, final_state) in float64."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    group = Hv // Hqk
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(x) for x in cu_seqlens]
        spans = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    pieces, finals = [], []
    for n, (b, start, end) in enumerate(spans):
        S = torch.zeros(Hv, K, V, dtype=torch.float64, device=q.device)
        if initial_state is not None:
            S = initial_state[n].double()
        rows = []
        for t in range(start, end):
            kt, vt, qt = k[b, t], v[b, t], q[b, t]  # [Hv, K], [Hv, V], [Hv, K]
            a, bt = g[b, t].exp()[:, None, None], beta[b, t][:, None, None]
            S = a * S
            S = S - bt * kt[:, :, None] * (kt[:, None, :] @ S)
            S = S + bt * kt[:, :, None] * vt[:, None, :]
            rows.append(scale * (qt[:, None, :] @ S).squeeze(1))
        pieces.append(torch.stack(rows) if rows else q.new_zeros(0, Hv, V))
        finals.append(S)
    if cu_seqlens is None:
        return torch.stack(pieces), torch.stack(finals)
    return torch.cat(pieces)[None], torch.stack(finals)
