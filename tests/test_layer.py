"""flashqla.layers.GatedDeltaNet against HF transformers' Qwen3NextGatedDeltaNet (fp32, CPU).

HF's pure-torch path is the oracle: it ignores cu_seqlens, so packed inputs are compared with HF run
on each sequence separately (field_notes §5, "Oracle traps").
"""
import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flashqla.layers import GatedDeltaNet, GatedDeltaNetState
from flashqla.layers.conv import causal_conv1d

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig  # noqa: E402
from transformers.utils.import_utils import is_kernels_available  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet  # noqa: E402

HIDDEN = 32
# dA_log and ddt_bias are sums over every token and head with heavy cancellation: in fp32 both HF and
# flashqla sit 3e-5..7e-5 (relative L2) from a float64 run of the same layer, so they get a wider bar.
TOLERANCE = {"A_log": 2e-4, "dt_bias": 2e-4}


def tiny_config(**overrides):
    fields = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=32, linear_conv_kernel_dim=4, num_hidden_layers=1,
                  layer_types=["linear_attention"], rms_norm_eps=1e-6)
    fields.update(overrides)
    return Qwen3NextConfig(**fields)


@pytest.fixture(scope="module", autouse=True)
def hf_runs_its_pure_torch_path():
    for package in ("fla", "causal_conv1d"):  # HF imports these by module name when present
        assert importlib.util.find_spec(package) is None, (
            f"{package} is importable: HF's Qwen3-Next would leave its pure-torch path, which is the oracle here")
    # the hub `kernels` package is detected by distribution (this repo's top-level kernels/ does not count)
    assert not is_kernels_available(), "HF hub kernels are installed: HF would leave its pure-torch path"


def randomized_pair(config, seed=0):
    """HF's layer with every parameter randomised (gates, decay, norm weight too) and ours loaded from it."""
    torch.manual_seed(seed)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name in ("dt_bias", "norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    ours = GatedDeltaNet.from_config(config)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def rel_err(ref, out):
    return ((ref - out).norm() / (ref.norm() + 1e-12)).item()


def assert_close(name, ref, out, tol=1e-5):
    err = rel_err(ref.detach().double(), out.detach().double())
    assert err <= tol, f"{name}: relative L2 error {err:.3e} > {tol}"


def grads(module, x):
    return {"input": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def run_with_grads(module, x, probe, **kwargs):
    """Output and gradients (input and every parameter) of <module(x), probe>."""
    module.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = module(x, **kwargs)
    (out * probe).sum().backward()
    return out.detach(), grads(module, x)


def test_bf16_layer_is_as_close_to_fp32_as_hf_bf16_is():
    hf, ours = randomized_pair(tiny_config())
    torch.manual_seed(8)
    x, probe = torch.randn(2, 70, HIDDEN), torch.randn(2, 70, HIDDEN)
    truth_out, truth_grads = run_with_grads(ours, x, probe)
    hf_out, hf_grads = run_with_grads(copy.deepcopy(hf).bfloat16(), x.bfloat16(), probe.bfloat16())
    out, our_grads = run_with_grads(copy.deepcopy(ours).bfloat16(), x.bfloat16(), probe.bfloat16())
    assert out.dtype == torch.bfloat16
    pairs = {"output": (truth_out, hf_out, out)}
    pairs.update({f"d{n}": (truth_grads[n], hf_grads[n], our_grads[n]) for n in truth_grads})
    for name, (truth, hf_value, value) in pairs.items():
        hf_err, err = rel_err(truth.double(), hf_value.double()), rel_err(truth.double(), value.double())
        assert err <= 2 * hf_err, f"{name}: bf16 error {err:.3e} vs HF's {hf_err:.3e}"


def test_parameter_names_shapes_and_state_dict_match_hf_both_ways():
    hf, ours = randomized_pair(tiny_config())
    assert {n: p.shape for n, p in hf.state_dict().items()} == {n: p.shape for n, p in ours.state_dict().items()}
    hf.load_state_dict(ours.state_dict(), strict=True)


def test_same_outputs_and_gradients_as_hf_on_a_batch_with_gqa():
    hf, ours = randomized_pair(tiny_config())
    torch.manual_seed(1)
    x, probe = torch.randn(2, 70, HIDDEN), torch.randn(2, 70, HIDDEN)
    ref_out, ref_grads = run_with_grads(hf, x, probe)
    out, our_grads = run_with_grads(ours, x, probe)
    assert_close("output", ref_out, out)
    for name, ref in ref_grads.items():
        assert_close(f"d{name}", ref, our_grads[name], TOLERANCE.get(name, 1e-5))


def test_packed_sequences_equal_hf_run_on_each_sequence_separately():
    hf, ours = randomized_pair(tiny_config(linear_num_key_heads=1))
    lengths = [5, 66, 1, 2, 37]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    torch.manual_seed(2)
    x, probe = torch.randn(1, sum(lengths), HIDDEN), torch.randn(1, sum(lengths), HIDDEN)

    hf.zero_grad()
    x_ref = x.detach().clone().requires_grad_(True)
    ref_out = torch.cat([hf(x_ref[:, s:e]) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    (ref_out * probe).sum().backward()
    out, our_grads = run_with_grads(ours, x, probe, cu_seqlens=cu)

    assert_close("output", ref_out, out)
    for name, ref in grads(hf, x_ref).items():
        assert_close(f"d{name}", ref, our_grads[name], TOLERANCE.get(name, 1e-5))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_sequence_alone_and_padding_reads_nothing(side):
    hf, ours = randomized_pair(tiny_config())
    lengths, T = [70, 9, 33], 70
    torch.manual_seed(3)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        (mask[row, T - n:] if side == "left" else mask[row, :n]).fill_(1)
    x, probe = torch.randn(len(lengths), T, HIDDEN), torch.randn(len(lengths), T, HIDDEN)
    out, our_grads = run_with_grads(ours, x, probe, attention_mask=mask)

    keep = mask.bool()
    assert out[~keep].abs().max() == 0, "padded positions must come out as zeros"
    assert our_grads["input"][~keep].abs().max() == 0, "padded positions must get no gradient"

    hf.zero_grad()
    x_ref = x.detach().clone().requires_grad_(True)
    for row in range(len(lengths)):
        ref_row = hf(x_ref[row, keep[row]][None])
        assert_close(f"output row {row}", ref_row[0], out[row, keep[row]])
        (ref_row[0] * probe[row, keep[row]]).sum().backward()
    for name, ref in grads(hf, x_ref).items():
        assert_close(f"d{name}", ref, our_grads[name], TOLERANCE.get(name, 1e-5))

    garbage = torch.where(keep[..., None], x, 1e3 * torch.randn_like(x))
    assert torch.equal(ours(garbage, attention_mask=mask), out), "padded inputs leaked into real tokens"


def test_left_padded_batch_agrees_with_hf_own_masked_forward():
    hf, ours = randomized_pair(tiny_config())
    torch.manual_seed(4)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :13] = 0
    x = torch.randn(2, 40, HIDDEN)
    ref, out = hf(x, attention_mask=mask), ours(x, attention_mask=mask)
    assert_close("real tokens", ref[mask.bool()], out[mask.bool()])


def test_prefill_then_continue_then_decode_equals_one_pass_on_a_batch():
    _, ours = randomized_pair(tiny_config())
    torch.manual_seed(5)
    x = torch.randn(2, 81, HIDDEN)
    whole_state = GatedDeltaNetState()
    whole = ours(x, state=whole_state)

    state = GatedDeltaNetState()
    pieces = [ours(x[:, :50], state=state), ours(x[:, 50:52], state=state), ours(x[:, 52:80], state=state),
              ours(x[:, 80:], state=state)]
    assert_close("output", whole, torch.cat(pieces, dim=1))
    assert_close("conv_state", whole_state.conv_state, state.conv_state)
    assert_close("recurrent_state", whole_state.recurrent_state, state.recurrent_state)
    assert state.conv_state.shape == (2, ours.conv_dim, 3)
    assert state.recurrent_state.shape == (2, 4, 16, 32) and state.recurrent_state.dtype == torch.float32


def test_prefill_then_continue_equals_one_pass_on_packed_and_padded_inputs():
    _, ours = randomized_pair(tiny_config())
    torch.manual_seed(6)
    first, second = [7, 1, 20], [3, 9, 1]  # sequence n gets first[n] tokens, then second[n] more
    seqs = [torch.randn(a + b, HIDDEN) for a, b in zip(first, second)]
    whole = [ours(s[None])[0] for s in seqs]

    def pack(parts):
        lengths = torch.tensor([p.shape[0] for p in parts])
        return torch.cat(parts)[None], F.pad(lengths.cumsum(0), (1, 0))

    state = GatedDeltaNetState()
    x1, cu1 = pack([s[:a] for s, a in zip(seqs, first)])
    x2, cu2 = pack([s[a:] for s, a in zip(seqs, first)])
    out1, out2 = ours(x1, cu_seqlens=cu1, state=state)[0], ours(x2, cu_seqlens=cu2, state=state)[0]
    for n, ref in enumerate(whole):
        got = torch.cat([out1[cu1[n]:cu1[n + 1]], out2[cu2[n]:cu2[n + 1]]])
        assert_close(f"packed sequence {n}", ref, got)

    # the same continuation through a left-padded batch
    state = GatedDeltaNetState()
    T1, T2 = max(first), max(second)
    x1, m1 = torch.zeros(3, T1, HIDDEN), torch.zeros(3, T1, dtype=torch.bool)
    x2, m2 = torch.zeros(3, T2, HIDDEN), torch.zeros(3, T2, dtype=torch.bool)
    for n, (s, a, b) in enumerate(zip(seqs, first, second)):
        x1[n, T1 - a:], m1[n, T1 - a:] = s[:a], True
        x2[n, T2 - b:], m2[n, T2 - b:] = s[a:], True
    out1, out2 = ours(x1, attention_mask=m1, state=state), ours(x2, attention_mask=m2, state=state)
    for n, ref in enumerate(whole):
        assert_close(f"padded sequence {n}", ref, torch.cat([out1[n, m1[n]], out2[n, m2[n]]]))


def test_fully_padded_rows_output_zeros_and_leave_their_state_unchanged():
    _, ours = randomized_pair(tiny_config())
    torch.manual_seed(9)
    state = GatedDeltaNetState()
    ours(torch.randn(2, 6, HIDDEN), state=state)
    before = GatedDeltaNetState(state.conv_state.clone(), state.recurrent_state.clone())

    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    out = ours(torch.randn(2, 3, HIDDEN), attention_mask=mask, state=state)
    assert out[1].abs().max() == 0
    assert torch.equal(state.conv_state[1], before.conv_state[1])
    assert torch.equal(state.recurrent_state[1], before.recurrent_state[1])
    assert not torch.equal(state.recurrent_state[0], before.recurrent_state[0])

    out = ours(torch.randn(2, 3, HIDDEN), attention_mask=torch.zeros(2, 3, dtype=torch.bool), state=state)
    assert out.abs().max() == 0 and torch.equal(state.recurrent_state[1], before.recurrent_state[1])


def test_plain_constructor_equals_from_config():
    config = tiny_config()
    a = GatedDeltaNet.from_config(config)
    b = GatedDeltaNet(hidden_size=HIDDEN, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32,
                      conv_kernel_size=4, eps=1e-6)
    assert {n: p.shape for n, p in a.state_dict().items()} == {n: p.shape for n, p in b.state_dict().items()}
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 10, HIDDEN)
    assert torch.equal(a(x), b(x))


def test_causal_conv1d_restarts_every_sequence_and_reads_its_prefix():
    torch.manual_seed(7)
    C, W = 6, 4
    lengths = [7, 1, 0, 2, 10]
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    x = torch.randn(int(cu[-1]), C, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(C, W, dtype=torch.float64, requires_grad=True)
    prefix = torch.randn(len(lengths), W - 1, C, dtype=torch.float64, requires_grad=True)
    y, tail = causal_conv1d(x, weight, cu, prefix, silu=False)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seq = torch.cat([prefix[n], x[s:e]])
        assert torch.equal(tail[n], seq[-(W - 1):])
        if e > s:
            ref = F.conv1d(seq.T[None], weight[:, None, :], groups=C)[0].T
            torch.testing.assert_close(y[s:e], ref, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(lambda a, w, p: causal_conv1d(a, w, cu, p)[0], (x, weight, prefix))


# ---- bad inputs ------------------------------------------------------------------------------

def test_wrong_hidden_size_is_rejected():
    layer = GatedDeltaNet.from_config(tiny_config())
    with pytest.raises(ValueError, match="hidden size 31"):
        layer(torch.randn(1, 4, HIDDEN - 1))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(4, HIDDEN))


def test_bad_attention_masks_are_rejected():
    layer = GatedDeltaNet.from_config(tiny_config())
    x = torch.randn(2, 5, HIDDEN)
    with pytest.raises(ValueError, match="attention_mask must be a \\[B, T\\]"):
        layer(x, attention_mask=torch.ones(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0 and 1"):
        layer(x, attention_mask=torch.full((2, 5), 2))
    with pytest.raises(TypeError, match="attention_mask must be bool or integer"):
        layer(x, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="not both"):
        layer(x[:1], attention_mask=torch.ones(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))


def test_bad_cu_seqlens_and_state_are_rejected():
    layer = GatedDeltaNet.from_config(tiny_config())
    with pytest.raises(ValueError, match="batch size 1"):
        layer(torch.randn(2, 5, HIDDEN), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="end at"):
        layer(torch.randn(1, 5, HIDDEN), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="state.recurrent_state"):
        layer(torch.randn(2, 5, HIDDEN), state=GatedDeltaNetState(recurrent_state=torch.zeros(1, 4, 16, 32)))
    with pytest.raises(ValueError, match="state.conv_state"):
        layer(torch.randn(2, 5, HIDDEN), state=GatedDeltaNetState(conv_state=torch.zeros(2, 3, 3)))
    with pytest.raises(TypeError, match="GatedDeltaNetState"):
        layer(torch.randn(2, 5, HIDDEN), state={"conv_state": None})
    context = SimpleNamespace(group=None, rank=0, world_size=1, cu_seqlens=torch.tensor([0, 5]),
                              first_seq_continues=False)
    with pytest.raises(ValueError, match="batch 2"):
        layer(torch.randn(2, 5, HIDDEN), cp_context=context)


def test_configs_whose_heads_do_not_divide_are_rejected():
    with pytest.raises(ValueError, match="num_v_heads \\(6\\) must be a multiple of num_k_heads \\(4\\)"):
        GatedDeltaNet.from_config(config_namespace(linear_num_key_heads=4, linear_num_value_heads=6))
    with pytest.raises(ValueError, match="head_k_dim must be a positive int"):
        GatedDeltaNet(HIDDEN, 2, 4, 0, 32)
    with pytest.raises(ValueError, match="hidden_act"):
        GatedDeltaNet.from_config(config_namespace(hidden_act="gelu"))


def config_namespace(**overrides):
    fields = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
    fields.update(overrides)
    return SimpleNamespace(**fields)
