"""The fused layer ops without a GPU: every kernel configuration compiles for sm_90a, and the host glue
(padding to 4 taps, the conv state and its gradient, dtype casts, dispatch) is right.

For the host glue the compiled launches (kernels/hopper/layer_ops.py) are replaced by torch stand-ins
that compute what the kernel docstrings say, step by step (explicit backward formulas, the same
roundings), and the autograd functions of flashqla/layers/fused.py are checked against autograd of the
torch references. The kernels themselves are checked on an H200 by tests/gpu/test_tilelang_layer_ops.py.
"""
import shutil

import pytest
import torch

from flashqla.layers import fused
from flashqla.layers.conv import causal_conv1d, causal_conv1d_reference
from flashqla.layers.norm import gated_rms_norm, gated_rms_norm_reference
from gdn_inputs import rel_err
from parallel_compile import compile_all

tilelang = pytest.importorskip("tilelang")

from flashqla.kernels.hopper import layer_ops  # noqa: E402

CONFIGS = list(layer_ops.kernel_configs())
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


# --- every configuration compiles ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled_in_parallel():
    """Compiles every configuration into TileLang's cache with one process per CPU, so the
    per-configuration tests below only load them."""
    compile_all(CONFIGS)


@needs_nvcc
@pytest.mark.parametrize("builder,args", CONFIGS, ids=[f"{b.__name__}{a}" for b, a in CONFIGS])
def test_kernel_compiles_for_sm90a(compiled_in_parallel, builder, args):
    source = builder(*args).get_kernel_source()
    assert "uint4" in source or "float4" in source, "the row loads must be 16-byte vectors"


def test_sizes_are_runtime_arguments():
    from flashqla.kernels.hopper.gated_norm import build_gated_norm_fwd
    from flashqla.kernels.hopper.short_conv import build_short_conv_bwd

    IntImm = tilelang.tvm.tirx.IntImm
    conv = {b.name: b for b in build_short_conv_bwd("bfloat16").buffer_map.values()}
    tokens, channel_vecs, vec = conv["x"].shape
    assert not isinstance(tokens, IntImm) and not isinstance(channel_vecs, IntImm) and int(vec) == 8
    assert not isinstance(conv["cu_seqlens"].shape[0], IntImm) and not isinstance(conv["dw_part"].shape[0], IntImm)
    norm = {b.name: b for b in build_gated_norm_fwd("float32", 128).buffer_map.values()}
    assert not isinstance(norm["o"].shape[0], IntImm) and int(norm["o"].shape[1]) == 128


def test_host_tile_constants_match_the_kernels():
    from flashqla.kernels.hopper import gated_norm, short_conv

    assert layer_ops.CONV_BLOCK_T == short_conv.BLOCK_T and layer_ops.CONV_WIDTH == short_conv.WIDTH
    assert all(layer_ops.conv_block_c(d) == short_conv.block_c_for(d) for d in layer_ops.LAYER_DTYPES)
    assert all(layer_ops.conv_vec(t) == short_conv.vec_for(d) for t, d in layer_ops.TORCH_TO_TL.items())
    assert all(layer_ops.NORM_TILE_ELEMS // D == gated_norm.rows_for(D) for D in layer_ops.NORM_HEAD_DIMS)


def test_backward_grids_cover_every_block_with_a_bounded_number_of_ctas():
    for blocks in (1, 7, 512, 513, 16384, 10 ** 6):
        for beside in (1, 3, 32, 5000):
            groups, per_cta = layer_ops.groups_for(blocks, beside)
            assert groups * per_cta >= blocks > (groups - 1) * per_cta  # no CTA without a block
            assert groups * beside <= max(layer_ops.BWD_TARGET_CTAS, beside)


# --- torch stand-ins for the compiled launches (the kernel docstrings, step by step) --------------------

def _seq_of_token(cu, T):
    return torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long(), output_size=T)


def _conv_taps(x, w4, p3, cu):
    """(ext value of every tap [4, T, C] fp32, sequence and start of every token)."""
    T = x.shape[0]
    seq = _seq_of_token(cu, T)
    start = cu.long()[seq]
    t = torch.arange(T)
    taps = []
    for j in range(4):
        s = t - 3 + j
        inside = (s >= start)[:, None]
        taps.append(torch.where(inside, x[s.clamp(min=0)], p3[seq, (t + j - start).clamp(0, 2)]).float())
    return torch.stack(taps), seq, start


def emulate_short_conv_fwd(x, w4, p3, cu):
    taps, _, _ = _conv_taps(x, w4, p3, cu)
    pre = (w4.t()[:, None, :] * taps).sum(0).to(x.dtype).float()
    return (pre / (1 + torch.exp(-pre))).to(x.dtype)


def emulate_short_conv_bwd(x, w4, p3, cu, dy):
    T = x.shape[0]
    taps, seq, start = _conv_taps(x, w4, p3, cu)
    pre = (w4.t()[:, None, :] * taps).sum(0).to(x.dtype).float()
    sig = 1 / (1 + torch.exp(-pre))
    dp = (dy.float() * sig * (1 + pre * (1 - sig))).to(x.dtype).float()
    dw = (dp[None] * taps).sum(1).t()  # [C, 4]
    t = torch.arange(T)

    def back_taps(rows, i):  # sum_{j <= i} w[j] dp[row + i - j], rows of the same sequence only
        acc = torch.zeros(rows.numel(), x.shape[1])
        for j in range(i + 1):
            r = rows + i - j
            ok = (r < T) & (seq[r.clamp(max=T - 1)] == seq[rows])
            acc += torch.where(ok[:, None], w4[:, j] * dp[r.clamp(max=T - 1)], 0.0)
        return acc

    dx = back_taps(t, 3).to(x.dtype)
    dprefix = torch.zeros(p3.shape)
    starts = torch.nonzero(start == t).flatten()
    for i in range(3):
        dprefix[seq[starts], i] = back_taps(starts, i)
    return dx, dprefix, dw


def emulate_gated_norm_fwd(o, z, w, eps, round_product):
    rnd = lambda v: v.to(o.dtype).float()  # noqa: E731
    o32, z32 = o.float(), z.float()
    r = torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    p = w * rnd(o32 * r)
    p = rnd(p) if round_product else p
    return (p * (z32 / (1 + torch.exp(-z32)))).to(o.dtype)


def emulate_gated_norm_bwd(o, z, w, dy, eps, round_product):
    rnd = lambda v: v.to(o.dtype).float()  # noqa: E731
    o32, z32, g = o.float(), z.float(), dy.float()
    r = torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    nb = rnd(o32 * r)
    p = rnd(w * nb) if round_product else w * nb
    sig = 1 / (1 + torch.exp(-z32))
    dp = g * z32 * sig
    dp = rnd(dp) if round_product else dp
    dz = (g * p * sig * (1 + z32 * (1 - sig))).to(o.dtype)
    dnb = rnd(dp * w)
    do = (r * dnb - o32 * r ** 3 * (dnb * o32).mean(-1, keepdim=True)).to(o.dtype)
    return do, dz, (dp * nb).sum(0)


@pytest.fixture
def emulated(monkeypatch):
    for name in ("short_conv_fwd", "short_conv_bwd", "gated_norm_fwd", "gated_norm_bwd"):
        monkeypatch.setattr(layer_ops, name, globals()[f"emulate_{name}"])


# --- the autograd functions against autograd of the references ------------------------------------------

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("with_prefix", [False, True], ids=["zeros", "prefix"])
def test_conv_glue_matches_the_reference_with_state_gradients(emulated, dtype, width, with_prefix):
    """Sequences of 1, 0, 3, 65 and 200 tokens: the padded 4-tap conv, the new prefix (which reaches
    into the prefix for the 1-token sequence), and gradients through y and the new prefix."""
    gen = torch.Generator().manual_seed(width)
    lengths = [1, 0, 3, 65, 200]
    cu = torch.tensor([0] + lengths).cumsum(0)
    T, C, N = sum(lengths), 64, len(lengths)
    x = torch.randn(T, C, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(C, width, generator=gen) * 0.5).requires_grad_()
    prefix = torch.randn(N, width - 1, C, generator=gen).to(dtype).requires_grad_() if with_prefix else None
    dy = torch.randn(T, C, generator=gen).to(dtype)
    dtail = torch.randn(N, width - 1, C, generator=gen).to(dtype)
    leaves = [x, w] + ([prefix] if with_prefix else [])

    out = fused.causal_conv1d(x, w, cu, prefix)
    ref = causal_conv1d_reference(x, w, cu, prefix)
    assert out[0].dtype == ref[0].dtype and out[1].shape == ref[1].shape
    assert torch.equal(out[1], ref[1]), "the new prefix is a gather: exact"
    assert rel_err(out[0], ref[0]) <= TOL[dtype][0]
    grads = torch.autograd.grad((out[0] * dy).sum() + (out[1] * dtail).sum(), leaves)
    grads_ref = torch.autograd.grad((ref[0] * dy).sum() + (ref[1] * dtail).sum(), leaves)
    for name, g, g_ref in zip(("x", "weight", "prefix"), grads, grads_ref):
        assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
        assert rel_err(g, g_ref) <= TOL[dtype][1], (name, rel_err(g, g_ref))


def test_conv_glue_when_only_y_or_only_the_new_prefix_is_used(emulated):
    cu = torch.tensor([0, 2, 9])
    x = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(16, 4, requires_grad=True)
    y, tail = fused.causal_conv1d(x, w, cu)
    (gx_tail,) = torch.autograd.grad(tail.sum(), x, retain_graph=True)
    (gx_y,) = torch.autograd.grad(y.sum(), x)
    y_ref, tail_ref = causal_conv1d_reference(x, w, cu)
    assert torch.allclose(gx_tail, torch.autograd.grad(tail_ref.sum(), x, retain_graph=True)[0])
    assert rel_err(gx_y, torch.autograd.grad(y_ref.sum(), x)[0]) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_dtype", ["fp32", "same"])
def test_norm_glue_matches_the_reference(emulated, dtype, weight_dtype):
    gen = torch.Generator().manual_seed(1)
    o = torch.randn(5, 3, 64, generator=gen).to(dtype).requires_grad_()
    z = torch.randn(5, 3, 64, generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(64, generator=gen)).to(torch.float32 if weight_dtype == "fp32" else dtype)
    w.requires_grad_()
    dy = torch.randn(5, 3, 64, generator=gen).to(dtype)
    y, y_ref = fused.gated_rms_norm(o, z, w, 1e-6), gated_rms_norm_reference(o, z, w, 1e-6)
    assert y.dtype == y_ref.dtype and rel_err(y, y_ref) <= TOL[dtype][0]
    grads = torch.autograd.grad(y, (o, z, w), dy)
    grads_ref = torch.autograd.grad(y_ref, (o, z, w), dy)
    for name, g, g_ref in zip(("o", "z", "weight"), grads, grads_ref):
        assert g.dtype == g_ref.dtype, name
        assert rel_err(g, g_ref) <= TOL[dtype][1], (name, rel_err(g, g_ref))


# --- dispatch ---------------------------------------------------------------------------------------------

def test_cpu_tensors_take_the_torch_path_and_name_why():
    x, w, cu = torch.randn(5, 16), torch.randn(16, 4), torch.tensor([0, 5])
    assert "CUDA" in fused.conv_unsupported_reason(x, w)
    assert torch.equal(causal_conv1d(x, w, cu)[0], causal_conv1d_reference(x, w, cu)[0])
    o = torch.randn(2, 64)
    assert torch.equal(gated_rms_norm(o, o, torch.ones(64), 1e-6), gated_rms_norm_reference(o, o, torch.ones(64), 1e-6))


def test_opt_out_environment_variable(monkeypatch):
    monkeypatch.setenv(fused.ENV, "0")
    assert fused.ENV in fused.conv_unsupported_reason(torch.randn(5, 16), torch.randn(16, 4))
    monkeypatch.setenv(fused.ENV, "1")
    assert fused.enabled()


@pytest.mark.parametrize("case,message", [
    (dict(silu=False), "SiLU"),
    (dict(x=torch.randn(5, 12, dtype=torch.bfloat16)), "C % 8"),
    (dict(x=torch.randn(5, 12, dtype=torch.float64)), "x must be"),
    (dict(x=torch.randn(0, 16)), "x must be"),
    (dict(weight=torch.randn(16, 5)), "widths"),
    (dict(weight=torch.randn(16, 1)), "widths"),
])
def test_conv_calls_the_kernels_cannot_run_are_named(monkeypatch, case, message):
    monkeypatch.setattr(fused, "_device_reason", lambda t: None)
    args = dict(x=torch.randn(5, 16, dtype=torch.bfloat16), weight=torch.randn(16, 4), prefix=None, silu=True)
    assert fused.conv_unsupported_reason(**args) is None
    args.update(case)
    assert message in fused.conv_unsupported_reason(**args)


@pytest.mark.parametrize("shape,z_dtype,weight,message", [
    ((4, 96), torch.bfloat16, torch.ones(96), "head dims"),
    ((4, 64), torch.float16, torch.ones(64), "one shape and dtype"),
    ((4, 64), torch.bfloat16, torch.ones(64, dtype=torch.float64), "not supported"),
    ((4, 64), torch.bfloat16, torch.ones(32), "head dims"),
])
def test_norm_calls_the_kernels_cannot_run_are_named(monkeypatch, shape, z_dtype, weight, message):
    monkeypatch.setattr(fused, "_device_reason", lambda t: None)
    ok = torch.randn(4, 64, dtype=torch.bfloat16)
    assert fused.norm_unsupported_reason(ok, ok, torch.ones(64)) is None
    o = torch.randn(*shape, dtype=torch.bfloat16)
    assert message in fused.norm_unsupported_reason(o, torch.randn(*shape).to(z_dtype), weight)
