"""A model holding flashqla's GDN layers under torch.compile (CPU, torch backend).

The op and the layer's forward are opaque to Dynamo (`torch.compiler.disable`): a compiled model runs them
eagerly between its compiled regions, with the results of the eager model. Traced, their host side (checks,
planning, caches keyed by tensor identity and host values, kernel launches) broke the graph at every
data-dependent read and took ~1 minute to compile one small layer on the CPU.
"""
import pytest
import torch
import torch.nn.functional as F

import flashqla
from flashqla.layers import GatedDeltaNet
from flashqla.layers import gated_deltanet
from flashqla.ops import chunk


class TwoLayerModel(torch.nn.Module):
    """Two GDN layers around compiled-friendly torch ops (norm, projection, activation)."""

    def __init__(self, hidden=64):
        super().__init__()
        self.first = GatedDeltaNet(hidden, 2, 4, 32, 32)
        self.norm = torch.nn.LayerNorm(hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.second = GatedDeltaNet(hidden, 2, 4, 32, 32)

    def forward(self, x, attention_mask=None):
        x = x + self.first(self.norm(x), attention_mask=attention_mask)
        x = x + F.gelu(self.proj(x))
        return x + self.second(x, attention_mask=attention_mask)


@pytest.fixture
def compile_probes(monkeypatch):
    """Records, at every call of the op's input checks and of the layer's gate, whether Dynamo was tracing."""
    seen = []

    def probe(real):
        def call(*args, **kwargs):
            seen.append(torch.compiler.is_compiling())
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(chunk, "check_inputs", probe(chunk.check_inputs))
    monkeypatch.setattr(gated_deltanet, "qwen3_next_gate", probe(gated_deltanet.qwen3_next_gate))
    torch._dynamo.reset()
    yield seen
    torch._dynamo.reset()


def test_compiled_model_matches_eager_and_never_traces_flashqla(compile_probes):
    torch.manual_seed(0)
    model = TwoLayerModel().double()
    x = torch.randn(2, 70, 64, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 70, dtype=torch.bool)
    mask[1, :9] = False  # left padding on the second row

    eager = model(x, mask)
    eager.sum().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    compile_probes.clear()

    compiled = torch.compile(model)(x, mask)
    compiled.sum().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]

    assert compile_probes and not any(compile_probes), "Dynamo traced into flashqla's layer or op"
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_op_called_inside_a_compiled_function_runs_eagerly(compile_probes):
    torch.manual_seed(1)
    T, Hqk, Hv, D = 100, 2, 4, 32
    q = F.normalize(torch.randn(1, T, Hqk, D, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, Hqk, D, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, Hv, D, dtype=torch.float64)
    g = -torch.rand(1, T, Hv, dtype=torch.float64)
    beta = torch.rand(1, T, Hv, dtype=torch.float64)
    cu = torch.tensor([0, 37, 100])

    def loss(q, k, v, g, beta):
        o, _ = flashqla.chunk_gated_delta_rule(q * 1.0, k, v, g, beta, cu_seqlens=cu)
        return (o * o).sum()

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    want = loss(*leaves)
    want_grads = torch.autograd.grad(want, leaves)
    compile_probes.clear()
    got = torch.compile(loss)(*leaves)
    got_grads = torch.autograd.grad(got, leaves)

    assert compile_probes and not any(compile_probes)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
