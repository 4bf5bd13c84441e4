"""Runs flashqla's chunk_gated_delta_rule forward and backward on a packed batch and checks it against
a float64 token-by-token recurrence. GPU (bf16) when one is present, else CPU (fp32)."""
import argparse
import time

import torch
import torch.nn.functional as F

import flashqla


def recurrence(q, k, v, g, beta, scale, cu):
    """float64 token loop, GQA by repeating q/k heads (design doc §1)."""
    group = v.shape[2] // q.shape[2]
    q, k = q.double().repeat_interleave(group, 2)[0], k.double().repeat_interleave(group, 2)[0]
    v, g, beta = v.double()[0], g.double()[0], beta.double()[0]
    out = torch.zeros_like(v)
    for s, e in zip(cu[:-1], cu[1:]):
        S = q.new_zeros(v.shape[1], q.shape[2], v.shape[2])
        for t in range(s, e):
            S = g[t].exp()[:, None, None] * S
            S = S + beta[t][:, None, None] * k[t][:, :, None] * (v[t][:, None, :] - (k[t][:, None, :] @ S))
            out[t] = scale * (q[t][:, None, :] @ S).squeeze(1)
    return out[None]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="300,1,65,130", help="packed sequence lengths")
    parser.add_argument("--heads", default="2,8", help="Hqk,Hv")
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [int(x) for x in args.lengths.split(",")]
    Hqk, Hv = (int(x) for x in args.heads.split(","))
    D, T = args.head_dim, sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)

    torch.manual_seed(0)
    q = F.normalize(torch.randn(1, T, Hqk, D, device=device), dim=-1).to(dtype).requires_grad_()
    k = F.normalize(torch.randn(1, T, Hqk, D, device=device), dim=-1).to(dtype).requires_grad_()
    v = torch.randn(1, T, Hv, D, device=device).to(dtype).requires_grad_()
    g = (-torch.rand(Hv, device=device) * 2 * F.softplus(torch.randn(1, T, Hv, device=device))).requires_grad_()
    beta = torch.sigmoid(torch.randn(1, T, Hv, device=device)).to(dtype).requires_grad_()

    start = time.perf_counter()
    o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    o.float().square().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    ref = recurrence(q.detach(), k.detach(), v.detach(), g.detach(), beta.detach(), D ** -0.5, cu.tolist())
    err = ((o.double() - ref).norm() / ref.norm()).item()
    print(f"flashqla {flashqla.__version__} on {device} ({dtype}): {len(lengths)} sequences, {T} tokens, "
          f"Hqk={Hqk} Hv={Hv} K=V={D}")
    print(f"forward + backward: {elapsed * 1e3:.1f} ms; final state {tuple(ht.shape)}; "
          f"relative L2 error of o vs float64 recurrence: {err:.2e}")
    print("grad norms: " + ", ".join(f"d{n}={t.grad.float().norm():.3e}" for n, t in
                                     zip("q k v g beta".split(), (q, k, v, g, beta))))
    limit = 5e-3 if dtype == torch.bfloat16 else 1e-5
    if not err <= limit:
        raise SystemExit(f"error {err:.2e} is over the limit {limit:.0e}")


if __name__ == "__main__":
    main()
