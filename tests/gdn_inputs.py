"""Random GDN inputs drawn like real models, shared by the tests."""
import torch
import torch.nn.functional as F


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||x - ref|| / ||ref||, NaN-safe (NaN gives inf)."""
    x, ref = x.double(), ref.double()
    err = ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if err == err else float("inf")


def model_gates(B, T, Hv, generator=None, zero_heads=(0,), strong_heads=(), dtype=torch.float32):
    """g = -exp(A_log) * softplus(a + dt_bias), A_log = log U(0.01, 16) per head (fp32).

    zero_heads get g = 0 (no decay: the exact-M path of CP); strong_heads get A = 16 with large a.
    """
    A = torch.empty(Hv).uniform_(0.01, 16, generator=generator)
    A[list(strong_heads)] = 16.0
    a = torch.randn(B, T, Hv, generator=generator)
    a[..., list(strong_heads)] += 3.0
    dt_bias = torch.ones(Hv)
    g = -A * F.softplus(a + dt_bias)
    g[..., list(zero_heads)] = 0.0
    return g.to(dtype)


def make_inputs(B, T, Hqk, Hv, K, V, dtype=torch.float32, seed=0, num_seqs=None, with_h0=False,
                zero_heads=(0,), strong_heads=(), requires_grad=True):
    """q, k L2-normalised, beta = sigmoid(randn), model-like g. Returns a dict of call arguments."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, Hqk, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, Hqk, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, Hv, V, generator=gen).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen)).to(dtype)
    g = model_gates(B, T, Hv, gen, zero_heads, strong_heads,
                    dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    N = B if num_seqs is None else num_seqs
    if with_h0:
        args["initial_state"] = torch.randn(N, Hv, K, V, generator=gen,
                                            dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if requires_grad:
        for x in args.values():
            x.requires_grad_(True)
    return args


def random_cu_seqlens(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32)
