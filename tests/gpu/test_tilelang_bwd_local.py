"""The chunk_bwd_local kernel against reference.chunk_backward on the same chunk grid (skips without SM90):
the grid path of intra-card CP segments (the unsegmented backward is tested end to end in
test_tilelang_backward.py).

Inputs: a model-like varlen call (g = 0 head, strong-decay head, GQA) put on the reference's grid; the
per-chunk states and state gradients come from the torch walks in fp32 and reach the kernel in bf16, the
rounding the kernel path has. Thresholds: DEVELOPERS.md's bf16 gradient limits.
"""
import pytest
import torch

from test_tilelang_forward import make_call, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")

LIMITS = {"dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dg": 2e-2, "dbeta": 2e-2}


@pytest.mark.parametrize("lengths,Hqk,Hv", [([300, 65, 1, 128], 2, 8), ([1000], 4, 16)])
def test_chunk_bwd_local_matches_the_reference_chunk_backward(lengths, Hqk, Hv):
    from flashqla.kernels.hopper import KernelWalks
    from flashqla.ops import reference, torch_backend

    c = make_call(lengths, Hqk, Hv, seed=len(lengths) + Hv)
    plan = torch_backend.make_plan(1, sum(lengths), c["cu_seqlens"].tolist(), 0)
    p = torch_backend._Prepared(c["q"], c["k"], c["v"], c["g"], c["beta"], c["initial_state"], plan)
    x = p.x
    gen = torch.Generator(device="cuda").manual_seed(1)
    dO = torch.randn(x.v.shape, generator=gen, device="cuda")
    b = reference.backward_terms(x, dO, 128 ** -0.5)
    S_in = reference.ReferenceWalks.states_in(x, p.S0_sequences)
    dS_out, _ = reference.ReferenceWalks.state_gradients(x, b, torch.randn_like(p.S0_sequences) * 0.1)
    dq, dk, dv, dgc, dbeta = reference.chunk_backward(x, b, S_in, dS_out)
    want = (dq, dk, dv, reference.gate_gradient(dgc), dbeta)
    got = KernelWalks(torch.bfloat16).chunk_gradients(x, b, S_in.bfloat16(), dS_out.bfloat16())
    errors = {name: rel_err(g, w.double()) for name, g, w in zip(LIMITS, got, want)}
    assert all(g.shape == w.shape for g, w in zip(got, want))
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= LIMITS[n]}
    assert not bad, f"over the limits: {bad} (all: { {n: f'{e:.1e}' for n, e in errors.items()} })"
