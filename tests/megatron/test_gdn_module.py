"""flashqla.megatron.GatedDeltaNet on one gloo rank: parity with Megatron's own GDN module run with its
torch kernel, packed == padded, checkpoint layout, native GQA + in-kernel L2 norm, construction without FLA."""
import dataclasses

import pytest
import torch

import mcore_harness as h
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.ssm.gated_delta_net import common as mcore_gdn_common
from megatron.core.transformer.spec_utils import build_module

import flashqla
from flashqla.megatron import GatedDeltaNet, get_local_gdn_module_spec


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    h.init_parallel(tp=1, cp=1)


def fla_l2norm(x, dim=-1, eps=1e-6):
    """FLA's l2norm (x / sqrt(sum x^2 + eps)), which Megatron imports from FLA; FLA is not installed here."""
    return x * torch.rsqrt(x.square().sum(dim, keepdim=True) + eps)


def megatron_torch_gdn(config, monkeypatch):
    """Megatron's own GDN module in deterministic mode: its torch chunk kernel and F.conv1d."""
    monkeypatch.setattr(mcore_gdn_common, "HAVE_FLA", True)
    monkeypatch.setattr(mcore_gdn_common, "l2norm", fla_l2norm)
    spec = dataclasses.replace(get_local_gdn_module_spec(config), module=MegatronGatedDeltaNet, params={})
    return build_module(spec, config=config, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def run(module, x, grad_out, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out, bias = module(x, None, **kwargs)
    assert bias is None
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_flashqla_gdn_matches_megatron_gdn_with_torch_kernel_outputs_and_grads(monkeypatch):
    torch.manual_seed(0)
    ours = h.build_flashqla_gdn(h.gdn_config())
    reference = megatron_torch_gdn(h.gdn_config(deterministic_mode=True), monkeypatch)
    reference.load_state_dict(ours.state_dict())
    with torch.no_grad():  # a decay that matters: A in [1, 16) at init is too uniform for a tiny T
        ours.A_log.copy_(torch.tensor([-4.0, 0.0, 1.0, 2.0]))
        reference.A_log.copy_(ours.A_log)
    x = torch.randn(100, 2, 32)  # s, b, h; 100 tokens = one full chunk and a partial one
    grad_out = torch.randn(100, 2, 32)

    out, dx, grads = run(ours, x, grad_out)
    out_ref, dx_ref, grads_ref = run(reference, x, grad_out)

    assert rel_err(out, out_ref) < 1e-5
    assert rel_err(dx, dx_ref) < 1e-5
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        # dA_log and ddt_bias are sums over every token with heavy cancellation: in fp32 each
        # implementation is ~6e-6 (relative) off a float64 run, so they may differ by a few 1e-5.
        tolerance = 1e-4 if name in ("A_log", "dt_bias") else 1e-5
        assert rel_err(grads[name], grads_ref[name]) < tolerance, name


def test_packed_thd_sequences_equal_each_sequence_run_alone():
    torch.manual_seed(1)
    module = h.build_flashqla_gdn(h.gdn_config())
    lengths = [37, 64, 1, 19]  # a full chunk, a single token, lengths off the chunk grid
    cu = torch.tensor([0, 37, 101, 102, 121], dtype=torch.int32)
    x = torch.randn(121, 1, 32)
    grad_out = torch.randn(121, 1, 32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64, max_seqlen_kv=64)

    out, dx, grads = run(module, x, grad_out, packed_seq_params=packed)

    grads_alone = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    for start, length in zip(cu[:-1].tolist(), lengths):
        piece = slice(start, start + length)
        out_alone, dx_alone, g = run(module, x[piece], grad_out[piece])
        assert rel_err(out[piece], out_alone) < 1e-5
        assert rel_err(dx[piece], dx_alone) < 1e-5
        for name in grads_alone:
            grads_alone[name] += g[name]
    for name in grads:
        assert rel_err(grads[name], grads_alone[name]) < 1e-5, name


def test_kernel_gets_unrepeated_qk_heads_and_normalises_them_itself(monkeypatch):
    calls = []
    real_kernel = flashqla.chunk_gated_delta_rule

    def recording_kernel(q, k, v, g, beta, **kwargs):
        calls.append((q.shape, k.shape, v.shape, g.dtype, kwargs))
        return real_kernel(q, k, v, g, beta, **kwargs)

    monkeypatch.setattr(flashqla, "chunk_gated_delta_rule", recording_kernel)
    module = h.build_flashqla_gdn(h.gdn_config())
    module(torch.randn(10, 1, 32), None)

    (q_shape, k_shape, v_shape, g_dtype, kwargs), = calls
    assert q_shape == k_shape == (1, 10, 2, 16)  # 2 k-heads, not repeated to the 4 v-heads
    assert v_shape == (1, 10, 4, 16)
    assert g_dtype == torch.float32
    assert kwargs["use_qk_l2norm_in_kernel"] is True
    assert kwargs["backend"] == "torch"


def test_parameters_and_sharded_checkpoint_keys_are_megatrons(monkeypatch):
    ours = h.build_flashqla_gdn(h.gdn_config())
    reference = megatron_torch_gdn(h.gdn_config(deterministic_mode=True), monkeypatch)
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}
    ours_sharded = ours.sharded_state_dict(prefix="layer.")
    reference_sharded = reference.sharded_state_dict(prefix="layer.")
    assert ours_sharded.keys() == reference_sharded.keys()
    assert "layer.in_proj.weight" in ours_sharded  # split into query/key/value/z/beta/alpha pieces


def test_builds_without_fla_and_leaves_megatrons_fla_check_in_place():
    assert mcore_gdn_common.HAVE_FLA is False  # FLA is not installed in this venv
    module = h.build_flashqla_gdn(h.gdn_config())
    assert isinstance(module, MegatronGatedDeltaNet)
    assert mcore_gdn_common.HAVE_FLA is False
    with pytest.raises(ImportError, match="FLA"):
        build_module(
            dataclasses.replace(get_local_gdn_module_spec(h.gdn_config()), module=MegatronGatedDeltaNet, params={}),
            config=h.gdn_config(), layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )


def test_recomputed_output_norm_gives_the_same_outputs_and_grads():
    torch.manual_seed(2)
    plain = h.build_flashqla_gdn(h.gdn_config())
    recomputed = h.build_flashqla_gdn(
        h.gdn_config(recompute_granularity="selective", recompute_modules=["gdn_norm_out"])
    )
    assert recomputed.recompute_norm_out
    recomputed.load_state_dict(plain.state_dict())
    x, grad_out = torch.randn(30, 2, 32), torch.randn(30, 2, 32)
    out, dx, grads = run(plain, x, grad_out)
    out_r, dx_r, grads_r = run(recomputed, x, grad_out)
    assert torch.equal(out, out_r) and torch.equal(dx, dx_r)
    for name in grads:
        assert torch.allclose(grads[name], grads_r[name], rtol=1e-6, atol=1e-7), name


@pytest.mark.parametrize("bad", [{"kernel_backend": "fla"}, {"cp_mode": "ring"}])
def test_unknown_kernel_backend_or_cp_mode_is_a_value_error(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        h.build_flashqla_gdn(h.gdn_config(), **bad)


def test_silu_after_the_conv_is_asked_of_the_conv_so_the_fused_kernel_can_serve_it(monkeypatch):
    """Megatron's GDN applies SiLU right after its conv (FLA's conv fuses it); flashqla's module passes it
    to flashqla's conv, whose SM90 kernel always applies it (with a separate SiLU the fused kernel is
    refused and the conv runs in torch). A conv bias keeps the activation after the bias."""
    import flashqla.megatron.gdn as gdn_module

    asked = []
    real_conv = gdn_module.causal_conv1d

    def spy(*args, silu, **kwargs):
        asked.append(silu)
        return real_conv(*args, silu=silu, **kwargs)

    monkeypatch.setattr(gdn_module, "causal_conv1d", spy)
    x = torch.randn(24, 1, 32)
    for conv_bias, want in ((False, True), (True, False)):
        module = h.build_flashqla_gdn(h.gdn_config(), conv_bias=conv_bias)
        reference = h.build_flashqla_gdn(h.gdn_config(), conv_bias=conv_bias)
        reference.load_state_dict(module.state_dict())
        out, _ = module(x, None)
        monkeypatch.setattr(gdn_module, "causal_conv1d", real_conv)
        assert asked[-1] is want
        # the same output as SiLU applied separately after the unfused conv
        monkeypatch.setattr(reference, "activation", "not silu")
        expected, _ = reference(x, None)
        monkeypatch.setattr(gdn_module, "causal_conv1d", spy)
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_gated_output_norm_is_flashqlas_gated_rmsnorm_and_equals_megatrons(monkeypatch):
    """With an RMSNorm output norm and SiLU the module runs flashqla's gated RMSNorm (the fused SM90 kernel
    where it fits): same values and gradients as Megatron's own out_norm(x) * silu(gate); zero-centred gamma
    keeps Megatron's."""
    import flashqla.megatron.gdn as gdn_module

    calls = []
    real_norm = gdn_module.gated_rms_norm
    monkeypatch.setattr(gdn_module, "gated_rms_norm", lambda *a, **k: calls.append(1) or real_norm(*a, **k))
    module = h.build_flashqla_gdn(h.gdn_config())
    module.out_norm.weight.data.uniform_(0.5, 1.5)
    x, gate = torch.randn(40, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    ours = module._apply_gated_norm(x, gate)
    assert calls
    grads = torch.autograd.grad(ours.square().sum(), [x, gate, module.out_norm.weight])
    theirs = MegatronGatedDeltaNet._apply_gated_norm(module, x, gate)
    want = torch.autograd.grad(theirs.square().sum(), [x, gate, module.out_norm.weight])
    assert rel_err(ours, theirs) < 1e-6
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(grads, want))

    calls.clear()  # (the local spec's torch norm cannot be built zero-centred: flip the flag on the config)
    monkeypatch.setattr(module.config, "layernorm_zero_centered_gamma", True)
    module._apply_gated_norm(x, gate)
    assert not calls


def test_packed_offsets_are_checked_on_the_host_once_per_tensor(monkeypatch):
    """THD offsets are validated from the cached host copy (one copy per tensor, not Megatron's five host
    syncs per layer), int64 offsets become one int32 tensor shared by every layer, and bad offsets raise."""
    from flashqla.megatron import cp_contexts

    copies = []
    real_host_offsets = cp_contexts.host_offsets

    def counting(cu_seqlens):
        copies.append(cu_seqlens)
        return real_host_offsets(cu_seqlens)

    import flashqla.megatron.gdn as gdn_module
    monkeypatch.setattr(gdn_module, "host_offsets", counting)
    module = h.build_flashqla_gdn(h.gdn_config())
    monkeypatch.setattr(module, "_resolve_cu_seqlens",
                        lambda *a, **k: pytest.fail("Megatron's per-layer resolution (host syncs) was called"))
    cu = torch.tensor([0, 37, 101, 102, 121])  # int64, as some data pipelines hand it over
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=64, max_seqlen_kv=64)
    first = module._packed_cu_seqlens(packed, 121, 1)
    second = module._packed_cu_seqlens(packed, 121, 1)
    assert first.dtype == torch.int32 and first is second and first.tolist() == cu.tolist()
    assert all(c is cu for c in copies)  # only the step's own tensor is read, through the per-tensor cache
    other = torch.tensor([0, 36, 121], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q == cu_seqlens_kv"):
        module._packed_cu_seqlens(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=other,
                                                  max_seqlen_q=64, max_seqlen_kv=64), 121, 1)
    with pytest.raises(ValueError, match="is not the 120 tokens"):
        module._packed_cu_seqlens(packed, 120, 1)
    module.cp_size = 2
    with pytest.raises(ValueError, match="divisible by cp_size=2"):
        module._packed_cu_seqlens(packed, 121, 1)


def test_megatron_full_recompute_keeps_the_recomputed_forwards_states(monkeypatch):
    """Under Megatron's activation recompute (`tensor_parallel.checkpoint`, reentrant: what
    `--recompute-granularity full` wraps each layer in) the module's first forward runs without grad (nothing is
    kept for a backward) and the recompute inside the backward asks the op to keep its per-chunk states (the
    default keep_states="auto"); a plain forward and backward does not. Outputs and gradients are unchanged."""
    from megatron.core import tensor_parallel

    from flashqla.ops import backends

    asked = []
    real_forward = backends.forward
    monkeypatch.setattr(backends, "forward", lambda *a, **kw: asked.append(kw.get("keep_states")) or real_forward(*a, **kw))
    torch.manual_seed(3)
    module = h.build_flashqla_gdn(h.gdn_config())
    x, grad_out = torch.randn(70, 2, 32), torch.randn(70, 2, 32)
    out, dx, grads = run(module, x, grad_out)
    assert asked == [False]
    asked.clear()

    x_r = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out_r = tensor_parallel.checkpoint(lambda inp: module(inp, None)[0], False, x_r)
    out_r.backward(grad_out)
    assert asked == [False, True]
    assert torch.equal(out, out_r.detach()) and torch.equal(dx, x_r.grad)
    for name, p in module.named_parameters():
        assert torch.equal(grads[name], p.grad), name
