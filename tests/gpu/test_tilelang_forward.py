"""The TileLang SM90 forward against a float64 token recurrence and the torch backend (skips without CUDA).

Every output buffer the kernels allocate is poisoned with NaN, so a row the kernels forget to write fails.
Tolerance: relative L2 error <= 5e-3 for o and the final state (bf16/fp16 inputs).
"""
import time

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")

TOL = 5e-3
D = 128


def recurrence64(q, k, v, g, beta, scale, h0, bounds):
    """S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = scale S_t^T q_t, in float64 on the GPU."""
    q, k, v, g, beta = (x[0].double() for x in (q, k, v, g, beta))
    Hv = v.shape[1]
    group = Hv // q.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    o = torch.zeros_like(v)
    finals = []
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = h0[n].double().clone() if h0 is not None else v.new_zeros(Hv, D, D)
        for t in range(bos, eos):
            kt, bt = k[t], beta[t][:, None]
            S = S * g[t].exp()[:, None, None]
            S = S + (bt * kt)[:, :, None] * (v[t] - torch.einsum("hk,hkv->hv", kt, S))[:, None, :]
            o[t] = scale * torch.einsum("hk,hkv->hv", q[t], S)
        finals.append(S)
    return o[None], torch.stack(finals)


def make_call(lengths, Hqk, Hv, dtype=torch.bfloat16, with_h0=True, batch=None, seed=0):
    """Model-like inputs: q, k L2-normalised, beta = sigmoid(randn), g = -exp(A_log) softplus(x + dt_bias)
    with A = exp(A_log) ~ U(0.01, 16), head 0 at g = 0 and the last head at strong decay."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    B, T = (1, sum(lengths)) if batch is None else (batch, lengths[0])
    N = len(lengths) if batch is None else batch
    randn = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    q = F.normalize(randn(B, T, Hqk, D), dim=-1).to(dtype)
    k = F.normalize(randn(B, T, Hqk, D), dim=-1).to(dtype)
    v = randn(B, T, Hv, D).to(dtype)
    beta = torch.sigmoid(randn(B, T, Hv)).to(dtype)
    A = torch.empty(Hv, device="cuda").uniform_(0.01, 16, generator=gen)
    A[-1] = 16.0
    g = -A * F.softplus(randn(B, T, Hv) + 1.0 + 3.0 * (torch.arange(Hv, device="cuda") == Hv - 1))
    g[..., 0] = 0.0
    h0 = randn(N, Hv, D, D) * 0.1 if with_h0 else None
    cu = None
    if batch is None:
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """torch.empty returns poisoned tensors while the kernels run: NaN-filled floating ones, integer ones
    filled with -7 (no index, count or flag a kernel writes is negative)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        x = real_empty(*args, **kwargs)
        if x.dtype == torch.bool:
            return x
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(-7)

    monkeypatch.setattr(torch, "empty", poisoned)


def run_kernels(call, scale=D ** -0.5, fused=True):
    from flashqla.kernels.hopper import chunk_gdn_fwd, unsupported_reason

    c = call
    assert unsupported_reason(c["q"], c["k"], c["v"], c["g"], c["beta"], c["initial_state"], c["cu_seqlens"]) is None
    return chunk_gdn_fwd(c["q"], c["k"], c["v"], c["g"], c["beta"], scale, c["initial_state"], True, c["cu_seqlens"],
                         fused=fused)


def reference(call, scale=D ** -0.5):
    c = call
    B, T = c["q"].shape[:2]
    if c["cu_seqlens"] is not None:
        return recurrence64(c["q"], c["k"], c["v"], c["g"], c["beta"], scale, c["initial_state"],
                            c["cu_seqlens"].tolist())
    outs, finals = [], []
    for b in range(B):
        h0 = None if c["initial_state"] is None else c["initial_state"][b:b + 1]
        o, ht = recurrence64(*(c[x][b:b + 1] for x in ("q", "k", "v", "g", "beta")), scale, h0, [0, T])
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs), torch.cat(finals)


def rel_err(x, ref):
    err = ((x.double() - ref).norm() / ref.norm()).item()
    return err if err == err else float("inf")


def assert_matches(call, scale=D ** -0.5, fused=True):
    o, ht = run_kernels(call, scale, fused)
    torch.cuda.synchronize()
    o_ref, ht_ref = reference(call, scale)
    assert o.dtype == call["q"].dtype and ht.dtype == torch.float32
    assert rel_err(o, o_ref) <= TOL, f"o: {rel_err(o, o_ref):.2e}"
    assert rel_err(ht, ht_ref) <= TOL, f"final state: {rel_err(ht, ht_ref):.2e}"
    return o, ht


@pytest.mark.parametrize("Hqk,Hv", [(2, 8), (4, 16), (8, 24), (16, 16), (32, 32), (16, 32), (16, 64), (1, 8)])
def test_benchmark_head_configs_match_recurrence(Hqk, Hv, poisoned_outputs):
    assert_matches(make_call([700], Hqk, Hv, seed=Hv + Hqk))


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_varlen_pack_with_1_and_65_token_sequences_matches_recurrence(fused, poisoned_outputs):
    assert_matches(make_call([1, 65, 64, 130, 7, 300, 1, 129], 2, 6, seed=3), fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("Hqk,Hv", [(2, 8), (16, 32)])
def test_both_forward_paths_on_head_configs(Hqk, Hv, fused, poisoned_outputs):
    assert_matches(make_call([700], Hqk, Hv, seed=Hv), fused=fused)


def test_equal_length_batch_without_initial_state_matches_recurrence(poisoned_outputs):
    assert_matches(make_call([200], 4, 8, with_h0=False, batch=3, seed=4))


def test_fp16_inputs_match_recurrence(poisoned_outputs):
    assert_matches(make_call([1, 190, 64], 4, 16, dtype=torch.float16, seed=5))


def test_one_token_sequence_alone_matches_recurrence(poisoned_outputs):
    assert_matches(make_call([1], 2, 8, seed=6))


def test_scale_is_a_runtime_argument(poisoned_outputs):
    from flashqla.kernels.hopper import launch

    call = make_call([100], 2, 8, seed=7)
    assert_matches(call, scale=0.3)
    misses = launch.compiled_chunk_output.cache_info().misses
    assert_matches(call, scale=0.05)
    assert launch.compiled_chunk_output.cache_info().misses == misses


def test_new_lengths_and_packs_do_not_recompile(poisoned_outputs):
    from flashqla.kernels.hopper import launch

    run_kernels(make_call([100, 30], 2, 8, seed=8))
    torch.cuda.synchronize()
    compiled = (launch.compiled_wy_inverse, launch.compiled_chunk_states, launch.compiled_chunk_output)
    misses = [f.cache_info().misses for f in compiled]
    start = time.perf_counter()
    assert_matches(make_call([333, 1, 77, 64], 2, 8, seed=9))
    assert_matches(make_call([257], 2, 8, seed=10))
    assert [f.cache_info().misses for f in compiled] == misses
    assert time.perf_counter() - start < 30  # two recurrences in float64; a TileLang recompile adds ~10 s each


@pytest.mark.parametrize("Hqk,Hv,heads", [(2, 8, 4), (2, 8, 2), (1, 3, 3), (4, 8, 2)])
def test_wy_inverse_with_gqa_heads_sharing_a_cta(Hqk, Hv, heads, poisoned_outputs, monkeypatch):
    """wy_inverse's shared-K build with `heads` v-heads of a GQA group per CTA (K and K K^T shared; what dispatch
    picks on long inputs) writes GA and gcum bitwise equal to the one-v-head build, and the forward on them
    matches the float64 recurrence. A pack with 1-, 65- and 129-token sequences, g = 0 and strong-decay heads,
    outputs NaN-poisoned."""
    from flashqla.kernels.hopper import launch

    call = make_call([1, 65, 700, 64, 129], Hqk, Hv, seed=21)
    args = [call[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    monkeypatch.setattr(launch, "wy_heads_per_cta", lambda chunk_slots, qk_heads, v_heads, sms: 1)
    one = launch.prepare(*args)
    monkeypatch.setattr(launch, "wy_heads_per_cta", lambda chunk_slots, qk_heads, v_heads, sms: heads)
    group = launch.prepare(*args)
    assert not one.GA.isnan().any() and not one.gcum.isnan().any()
    assert torch.equal(one.GA, group.GA) and torch.equal(one.gcum, group.gcum)
    assert_matches(call)


@pytest.mark.parametrize("heads", [1, 4])
def test_wy_inverse_writes_the_fp32_beta_it_reads_in_the_input_dtype(heads, poisoned_outputs, monkeypatch):
    """beta in q's dtype: wy_inverse's copy_beta build writes the walks' fp32 beta itself (no conversion launch),
    every row of it (outputs NaN-poisoned), equal to beta.float(); GA and gcum bitwise those of the fp32-beta build
    on the converted beta. One v-head per CTA and a GQA group of 4 per CTA; 1-, 65- and 129-token sequences."""
    from flashqla.kernels.hopper import launch

    call = make_call([1, 65, 700, 64, 129], 2, 8, seed=23)
    args = [call[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    monkeypatch.setattr(launch, "wy_heads_per_cta", lambda chunk_slots, qk_heads, v_heads, sms: heads)
    builds = []
    real = launch.compiled_wy_inverse
    monkeypatch.setattr(launch, "compiled_wy_inverse", lambda dtype, shared_k, copy_beta: builds.append(copy_beta)
                        or real(dtype, shared_k, copy_beta))
    copied = launch.prepare(*args)
    args[4] = call["beta"].float()
    converted = launch.prepare(*args)
    assert builds == [True, False]  # the copy build, then the fp32-beta build
    assert torch.equal(copied.beta, converted.beta.view_as(copied.beta))
    assert torch.equal(copied.GA, converted.GA) and torch.equal(copied.gcum, converted.gcum)


@pytest.mark.parametrize("Hqk,Hv,dtype", [(2, 8, torch.bfloat16), (1, 3, torch.float16), (4, 8, torch.bfloat16)])
def test_narrow_tile_walk_reads_chunk_scores(Hqk, Hv, dtype, poisoned_outputs, monkeypatch):
    """The fused walk's scores build (V tile 32) reads every chunk's P from chunk_scores. P is scale (Lower(Gamma) o
    Q K^T) of every chunk (float64 within TOL, every row written: outputs NaN-poisoned); O and the final state
    are bit for bit those of the build that forms P itself (FLASHQLA_CHUNK_SCORES=0: the same products and one
    rounding), and match the float64 recurrence. A pack with 1-, 65-, 700-, 64- and 129-token sequences (taken
    at V tile 32 whatever their traffic), g = 0 and strong-decay heads, GQA groups of 4, 3 and 2."""
    from flashqla.kernels.hopper import launch

    call = make_call([1, 65, 700, 64, 129], Hqk, Hv, dtype=dtype, seed=25)
    monkeypatch.setattr(launch, "block_v_on", lambda device, num_seqs, num_v_heads: launch.SCORES_BLOCK_V)
    monkeypatch.setattr(launch, "SCORES_MAX_BYTES", 1 << 30)
    builds = []
    real = launch.compiled_fused_fwd
    monkeypatch.setattr(launch, "compiled_fused_fwd", lambda *args: builds.append(args[2:]) or real(*args))
    o, ht = assert_matches(call)
    monkeypatch.setenv(launch.SCORES_ENV, "0")
    o_own, ht_own = run_kernels(call)
    assert builds == [(False, True), ()]  # the scores build, then the plain one
    assert torch.equal(o, o_own) and torch.equal(ht, ht_own)

    x = launch.prepare(*(call[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")))
    P = launch.chunk_scores(x, 0.3)
    bounds = call["cu_seqlens"].tolist()
    group = Hv // Hqk
    q, k = (call[n][0].double().repeat_interleave(group, 1) for n in ("q", "k"))
    gcum = x.gcum.double()
    worst = 0.0
    for bos, eos in zip(bounds[:-1], bounds[1:]):
        for t0 in range(bos, eos, 64):
            n = min(64, eos - t0)
            rows = slice(t0, t0 + n)
            scores = torch.einsum("rhd,shd->hrs", q[rows], k[rows])
            gates = gcum[:, rows]
            mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
            ref = 0.3 * torch.where(mask, scores * (gates[:, :, None] - gates[:, None, :]).clamp(max=0).exp(), 0.0)
            worst = max(worst, rel_err(P[rows, :, :n].permute(1, 0, 2), ref))
            assert (P[rows, :, n:] == 0).all()  # the columns past the sequence end are masked
    assert worst <= TOL, worst


def test_32k_sequence_matches_recurrence(poisoned_outputs):
    """Precision on a long sequence: 512 chunks of bf16 states, strong-decay and g = 0 heads."""
    assert_matches(make_call([32768], 2, 8, seed=12))


def test_public_op_dispatches_to_tilelang_and_agrees_with_torch_backend():
    import flashqla

    c = make_call([90, 200], 4, 8, seed=11)
    kwargs = dict(initial_state=c["initial_state"], output_final_state=True, cu_seqlens=c["cu_seqlens"])
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    o_tl, ht_tl = flashqla.chunk_gated_delta_rule(*args, backend="tilelang", **kwargs)
    o_pt, ht_pt = flashqla.chunk_gated_delta_rule(*args, backend="torch", **kwargs)
    assert rel_err(o_tl, o_pt.double()) <= TOL
    assert rel_err(ht_tl, ht_pt.double()) <= TOL
