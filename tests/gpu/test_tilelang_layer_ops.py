"""The fused layer-op kernels (short conv + SiLU, gated RMSNorm; flashqla/layers/fused.py) against the torch
references on an SM90 GPU, and the GatedDeltaNet layer with them against the layer without them.

Buffers from torch.empty are NaN-poisoned while the fused ops run, so an output element a kernel forgets
to write fails. Metric: relative L2 error against the reference in the same dtype; fp32 <= 1e-5,
bf16/fp16 <= 5e-3 for outputs and <= 1e-2 for gradients. TF32 is off, so fp32 references are fp32.
"""
import pytest
import torch

from flashqla.layers import GatedDeltaNet, fused
from flashqla.layers.conv import causal_conv1d_reference
from flashqla.layers.norm import gated_rms_norm_reference
from test_tilelang_forward import poisoned_outputs, rel_err  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 1e-2), torch.float16: (5e-3, 1e-2)}


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def grads_of(fn, leaves, cotangents):
    outs = fn()
    loss = sum((o.float() * c.float()).sum() for o, c in zip(outs, cotangents))
    return outs, torch.autograd.grad(loss, leaves)


def conv_case(dtype, width, with_prefix, lengths, C, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    T, N = sum(lengths), len(lengths)
    x = randn(T, C).to(dtype).requires_grad_()
    w = (randn(C, width) * 0.5).requires_grad_()
    prefix = randn(N, width - 1, C).to(dtype).requires_grad_() if with_prefix else None
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    cotangents = (randn(T, C).to(dtype), randn(N, width - 1, C).to(dtype))
    return x, w, prefix, cu, cotangents


def check_conv(x, w, prefix, cu, cotangents):
    assert fused.conv_unsupported_reason(x, w, prefix) is None
    leaves = [x, w] + ([prefix] if prefix is not None else [])
    (y, tail), grads = grads_of(lambda: fused.causal_conv1d(x, w, cu, prefix), leaves, cotangents)
    (y_ref, tail_ref), grads_ref = grads_of(lambda: causal_conv1d_reference(x, w, cu, prefix), leaves, cotangents)
    out_tol, grad_tol = TOL[x.dtype]
    assert torch.equal(tail, tail_ref)
    assert rel_err(y, y_ref) <= out_tol, rel_err(y, y_ref)
    for name, g, g_ref in zip(("dx", "dweight", "dprefix"), grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) <= grad_tol, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("with_prefix", [False, True], ids=["zeros", "prefix"])
def test_conv_on_a_varlen_pack_matches_the_reference(poisoned_outputs, dtype, width, with_prefix):
    """Sequences of 1, 3, 65 and 1000 tokens; C = 1000 is no multiple of the 256-channel block."""
    check_conv(*conv_case(dtype, width, with_prefix, [1, 3, 65, 1000], C=1000, seed=width))


def test_conv_with_many_short_and_empty_sequences_and_long_blocks(poisoned_outputs):
    """1- and 2-token sequences (several starting in one block, windows reaching the prefix), an empty
    sequence, and enough tokens that backward CTAs walk several blocks."""
    lengths = [1, 2, 0, 1, 5, 2, 300, 1, 70000, 3]
    check_conv(*conv_case(torch.bfloat16, 4, True, lengths, C=512, seed=7))


def norm_case(dtype, head_dim, weight_dtype, rows=1000, heads=3, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    o = (randn(rows, heads, head_dim) * 3).to(dtype).requires_grad_()
    z = (randn(rows, heads, head_dim) * 2).to(dtype).requires_grad_()
    w = (1 + 0.5 * randn(head_dim)).to(weight_dtype).requires_grad_()
    return o, z, w, randn(rows, heads, head_dim).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("weight_dtype", ["fp32", "same"])
def test_gated_norm_matches_the_reference(poisoned_outputs, dtype, head_dim, weight_dtype):
    """1000 x 3 rows: no multiple of the row block; a weight in o's dtype rounds the product (norm.py)."""
    o, z, w, dy = norm_case(dtype, head_dim, torch.float32 if weight_dtype == "fp32" else dtype, seed=head_dim)
    assert fused.norm_unsupported_reason(o, z, w) is None
    (y,), grads = grads_of(lambda: (fused.gated_rms_norm(o, z, w, 1e-6),), (o, z, w), (dy,))
    (y_ref,), grads_ref = grads_of(lambda: (gated_rms_norm_reference(o, z, w, 1e-6),), (o, z, w), (dy,))
    out_tol, grad_tol = TOL[dtype]
    assert y.dtype == y_ref.dtype and rel_err(y, y_ref) <= out_tol, rel_err(y, y_ref)
    for name, g, g_ref in zip(("do", "dz", "dweight"), grads, grads_ref):
        assert g.dtype == g_ref.dtype, name
        assert rel_err(g, g_ref) <= grad_tol, (name, rel_err(g, g_ref))


def test_gated_norm_rows_of_zeros_stay_finite(poisoned_outputs):
    o, z, w, dy = norm_case(torch.bfloat16, 128, torch.float32, rows=64, heads=1)
    with torch.no_grad():
        o[5:9].zero_()
    y = fused.gated_rms_norm(o, z, w, 1e-6)
    do, dz, dw = torch.autograd.grad(y, (o, z, w), dy)
    assert all(t.isfinite().all() for t in (y, do, dz, dw))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_l2norm_matches_autograd_of_the_torch_chain(poisoned_outputs, monkeypatch, dtype):
    """q/k L2 norm (flashqla/ops/qk_norm.py, opt-in) on 1000 x 3 rows of a strided view (no multiple of
    the row block); a zero row stays finite (its scale is rsqrt(eps))."""
    from flashqla.ops import qk_norm

    monkeypatch.setenv(qk_norm.ENV, "1")
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(1000, 3, 2 * 128, generator=gen, device="cuda").to(dtype)[..., :128].requires_grad_(True)
    with torch.no_grad():
        x[11].zero_()
    dy = torch.randn(x.shape, generator=gen, device="cuda").to(dtype)
    assert qk_norm.fused_unsupported_reason(x) is None
    (y,), (dx,) = grads_of(lambda: (qk_norm.l2norm(x),), (x,), (dy,))
    (y_ref,), (dx_ref,) = grads_of(lambda: (qk_norm.l2norm_reference(x),), (x,), (dy,))
    out_tol, grad_tol = TOL[dtype]
    assert y.dtype == dtype and dx.dtype == dtype and y.isfinite().all() and dx.isfinite().all()
    assert rel_err(y, y_ref) <= out_tol and rel_err(dx, dx_ref) <= grad_tol, (rel_err(y, y_ref), rel_err(dx, dx_ref))


# the layer: head dims 64 keep the chunk op on its torch backend (the kernels need 128), so the two
# runs differ only by the fused conv and norm
LAYER_TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (5e-3, 2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_deltanet_layer_with_fused_ops_matches_the_layer_without(monkeypatch, dtype):
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=256, num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64).cuda()
    with torch.no_grad():
        layer.norm.weight.copy_(1 + 0.5 * torch.randn_like(layer.norm.weight))
    layer = layer.to(dtype)
    lengths = [1, 3, 65, 1000]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    x = torch.randn(1, sum(lengths), 256, device="cuda", dtype=dtype)
    probe = torch.empty(1, layer.conv_dim, device="cuda", dtype=dtype)
    assert fused.conv_unsupported_reason(probe, layer.conv1d.weight[:, 0]) is None
    assert fused.norm_unsupported_reason(probe[:, :64], probe[:, :64], layer.norm.weight) is None
    dout = torch.randn_like(x)
    params = dict(layer.named_parameters())

    def run(fused_on):
        monkeypatch.setenv(fused.ENV, "1" if fused_on else "0")
        out = layer(x, cu_seqlens=cu)
        return out, torch.autograd.grad(out, list(params.values()), dout)

    (out, grads), (out_ref, grads_ref) = run(True), run(False)
    out_tol, grad_tol = LAYER_TOL[dtype]
    assert rel_err(out, out_ref) <= out_tol, rel_err(out, out_ref)
    errors = {name: rel_err(g, g_ref) for name, g, g_ref in zip(params, grads, grads_ref)}
    assert all(e <= grad_tol for e in errors.values()), errors
