"""Intra-card CP on the TileLang path (segments run as packed sequences) against the float64 recurrence."""
import pytest
import torch

import flashqla
from flashqla.cp.plan import resolve_segment_chunks
from test_tilelang_forward import D, TOL, make_call, poisoned_outputs, recurrence64, reference, rel_err  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")


def op(call, **kw):
    c = dict(call)
    return flashqla.chunk_gated_delta_rule(c.pop("q"), c.pop("k"), c.pop("v"), c.pop("g"), c.pop("beta"),
                                           output_final_state=True, backend="tilelang", **c, **kw)


@pytest.mark.parametrize("cp_warmup", [None, -10.0])
def test_forced_segments_on_a_varlen_pack_match_recurrence(cp_warmup):
    call = make_call([1000, 65, 1, 2030], 2, 8, seed=3)
    o, ht = op(call, intra_cp=4, cp_warmup=cp_warmup)
    o_ref, ht_ref = reference(call)
    o_plain, _ = op(call, intra_cp="off")
    print(f"\nsegmented vs recurrence o {rel_err(o, o_ref):.2e} ht {rel_err(ht, ht_ref):.2e}; unsegmented vs recurrence "
          f"o {rel_err(o_plain, o_ref):.2e}; segmented vs unsegmented o {rel_err(o, o_plain.double()):.2e}")
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))
    # Segmenting must not cost accuracy. Both bf16 results carry ~4e-3 of independent rounding (H200,
    # 2026-11-30: 3.87e-3 and 3.83e-3 against the recurrence, 5.2e-3 apart), so comparing them with each
    # other measures that noise twice; compare their errors against the float64 recurrence instead
    # (warmup's own approximation is below e^-10 of the state).
    assert rel_err(o, o_ref) <= 1.1 * rel_err(o_plain, o_ref) + 1e-4, (rel_err(o, o_ref), rel_err(o_plain, o_ref))


@pytest.mark.parametrize("segment_chunks", [256, 512])
def test_segments_of_hundreds_of_chunks_match_recurrence(segment_chunks):
    """The planner's longest segments (256 and 512 chunks, chosen for one sequence of 256K tokens or more) on a pack
    whose long sequence they cut into two or three, the last one partial, beside a short sequence; g = 0 and
    strongly decaying heads, initial states. The float64 recurrence is the oracle, and the unsegmented call's error
    against it the bar, as in the forced-segments test above."""
    call = make_call([40000, 700], 2, 8, seed=6)
    o, ht = op(call, intra_cp=segment_chunks)
    o_ref, ht_ref = reference(call)
    o_plain, _ = op(call, intra_cp="off")
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))
    assert rel_err(o, o_ref) <= 1.1 * rel_err(o_plain, o_ref) + 1e-4, (rel_err(o, o_ref), rel_err(o_plain, o_ref))


def test_auto_plan_segments_one_long_sequence_at_tp8_and_matches_recurrence():
    call = make_call([16384], 2, 8, with_h0=False, seed=4)
    assert resolve_segment_chunks("auto", (16384,), 8, call["q"].device, "tilelang") > 0
    o, ht = op(call)
    o_ref, ht_ref = reference(call)
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))


def test_backward_reuses_the_forward_segmentation_plan(monkeypatch):
    from flashqla.ops import backends

    seen = {}
    real_forward, real_backward = backends.forward, backends.backward

    def spy_forward(name, call, scale, output_final_state, plan, cp_warmup, **kwargs):
        seen["forward"] = plan
        return real_forward(name, call, scale, output_final_state, plan, cp_warmup, **kwargs)

    def spy_backward(name, call, scale, plan, cp_warmup, do, dht, kept=None):
        seen["backward"], seen["kept"] = plan, kept
        return real_backward(name, call, scale, plan, cp_warmup, do, dht, kept)

    monkeypatch.setattr(backends, "forward", spy_forward)
    monkeypatch.setattr(backends, "backward", spy_backward)
    call = make_call([4096], 2, 8, with_h0=False, seed=5)
    for name in ("q", "k", "v", "g", "beta"):
        call[name].requires_grad_(True)
    o, ht = op(call, intra_cp=8)
    (o.float().sum() + ht.sum()).backward()
    assert seen["forward"] is seen["backward"] and seen["forward"].is_segmented
    assert seen["kept"] is not None  # the backward reuses the forward's segment starts


@pytest.mark.parametrize("longest_first", [False, True])
@pytest.mark.parametrize("block_v", [None, 4, 8, 16])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("zero_start", [False, True])
def test_segment_chain_kernel_matches_the_float64_fold(reverse, block_v, zero_start, longest_first):
    """The one-launch chain over segments (a pack: 5 rows, 1 row, 3 rows, 600 rows, so that the kernel
    reads its masks in more than two blocks; some masks 0) against the same fold in float64, row by row;
    fp32 products on CUDA cores keep it within fp32 rounding. The reverse chain reads the forward's mask two
    rows on (1 out of a sequence's last row). zero_start: the start rows are NaN on entry and the kernel
    starts from (and writes) zeros. block_v None: the tile `fold_segments` chooses; 4, 8 and 16: each compiled
    tile, forced. longest_first: the sequences handed over in the order intra-card CP gives them (the CTAs are
    issued in it), which must not change a value."""
    from flashqla.kernels.hopper import fold_segments

    gen = torch.Generator(device="cuda").manual_seed(11)
    rows, heads = 609, 3
    first, last = [0, 5, 6, 9], [4, 5, 8, 608]
    randn = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    out = torch.full((rows, heads, D, D), float("nan"), device="cuda")
    starts = last if reverse else first
    if not zero_start:
        out[starts] = randn(len(starts), heads, D, D)
    bias = randn(rows, heads, D, D)
    mats = randn(rows, heads, D, D) / D ** 0.5 * 0.9  # keeps the chain bounded
    mask = (torch.rand(rows, heads, generator=gen, device="cuda") > 0.3).float()
    want = out.double().clone()
    if zero_start:
        want[starts] = 0.0
    for f, l in zip(first, last):
        for r in (range(l - 1, f - 1, -1) if reverse else range(f + 1, l + 1)):
            src = r + 1 if reverse else r - 1
            M = mats[src].double().transpose(-1, -2) if reverse else mats[src].double()
            if not reverse:
                factor = mask[r].double()
            else:
                factor = torch.ones(heads, dtype=torch.float64, device="cuda") if r + 1 == l else mask[r + 2].double()
            want[r] = bias[src].double() + factor[:, None, None] * (M @ want[src])
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    if longest_first:
        first, last = zip(*sorted(zip(first, last), key=lambda rows: rows[0] - rows[1]))
    got = fold_segments(out, bias, mats, mask, as_int(first), as_int(last), reverse, zero_start=zero_start,
                        block_v=block_v, num_chains=3 if longest_first else None)
    assert not got.isnan().any()
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)


@pytest.mark.parametrize("threshold", [-10.0, -3.0, float("-inf")])
def test_summary_walks_gate_statistics_match_their_emulation(threshold, poisoned_outputs, monkeypatch):
    """The summary launch that computes its walks' gate statistics itself (chunk_states.py `gate_statistics`,
    `launch.summaries_from_gates`): exact and active element for element equal to the fp32 emulation the CPU
    suite runs, with rows of 1 to 100 chunks (two rounds of 64 chunk sums), GQA 2 -> 8, a g = 0 head, a strongly
    decaying one and every flag bit; S* and M bitwise equal to the same walks asked for by `active`, at every V
    tile. Outputs poisoned first (`poisoned_outputs`: NaN, -7) so that an unwritten element shows."""
    from flashqla.kernels.hopper import launch, prepare
    from kernel_emulator import gate_statistics

    lengths = [1, 63, 64, 65, 64 * 40 + 7, 64 * 100, 200, 64 * 32]
    call = make_call(lengths, 2, 8, seed=31)
    x = prepare(*[call[n] for n in ("q", "k", "v", "g", "beta")], call["cu_seqlens"])
    rows, Hv = len(lengths), 8
    gen = torch.Generator(device="cuda").manual_seed(17)
    flags = torch.randint(0, 32, (rows,), generator=gen, device="cuda", dtype=torch.int32)
    want_exact, want_active = gate_statistics(x.gcum, x.cu, flags, threshold)
    if threshold > float("-inf"):  # the inputs exercise both outcomes
        assert (want_active[0] > 1).any() and (want_exact[1:] == 1).any() and (want_exact[1:] == 0).any()
    for block_v in launch.BLOCK_V_CHOICES:
        monkeypatch.setattr(launch, "summary_block_v", lambda *_, bv=block_v: bv)
        S_star, M, exact, active = launch.summaries_from_gates(x, flags, threshold)
        assert torch.equal(exact.cpu(), want_exact) and torch.equal(active.cpu(), want_active), block_v
        want_S, want_M = launch.summaries(x, True, want_active.cuda())
        assert torch.equal(S_star, want_S) and torch.equal(M, want_M), block_v


def test_summary_walks_match_the_float64_recurrence_from_their_start(poisoned_outputs, monkeypatch):
    """`summaries`' S* (from zero) and M (the transition: v = 0 from S0 = I) of every (sequence, v-head) from
    the chunk its `active` entry names (a >= 1: chunk a - 1; 0: skipped, zeros) equal the float64 recurrence
    over the same tokens at every V tile. A pack with 1- and 65-token sequences, GQA 2 -> 8, g = 0 and
    strong decay heads; outputs NaN-poisoned."""
    from flashqla.kernels.hopper import launch, prepare

    lengths, Hqk, Hv = [1000, 65, 1, 2030], 2, 8
    call = make_call(lengths, Hqk, Hv, seed=7)
    args = [call[n] for n in ("q", "k", "v", "g", "beta")] + [call["cu_seqlens"]]
    x = prepare(*args)
    gen = torch.Generator(device="cuda").manual_seed(13)
    chunks = (call["cu_seqlens"].diff() + 63) // 64  # [N]
    N = chunks.numel()
    active = torch.randint(0, 1 << 20, (2, N, Hv), generator=gen, device="cuda") % (chunks[None, :, None] + 1)
    active[:, 0, :2] = torch.tensor([[1, 0]], device="cuda")  # a whole walk and a skipped one, surely
    active = active.int()

    # float64: the tokens before a walk's first chunk neither move nor decay its state (k = v = g = 0)
    bounds = call["cu_seqlens"].tolist()
    starts = torch.where(active >= 1, active - 1, chunks[None, :, None]).long()  # [2, N, Hv] chunk
    t = torch.arange(bounds[-1], device="cuda")
    seq_of = torch.bucketize(t, call["cu_seqlens"][1:].long(), right=True)
    group = Hv // Hqk
    k_heads = call["k"].repeat_interleave(group, 2)
    want = []
    for kind in (0, 1):
        before = t[:, None] < call["cu_seqlens"][seq_of].long()[:, None] + 64 * starts[kind][seq_of]  # [T, Hv]
        keep = (~before)[None]
        v = call["v"] * keep[..., None] if kind == 0 else torch.zeros_like(call["v"])
        h0 = None if kind == 0 else torch.eye(D, device="cuda").expand(N, Hv, D, D)
        _, finals = recurrence64(k_heads, k_heads * keep[..., None], v, call["g"] * keep, call["beta"], 1.0, h0,
                                 bounds)
        want.append(torch.where((active[kind] >= 1)[..., None, None], finals, 0.0))

    for block_v in launch.BLOCK_V_CHOICES:
        monkeypatch.setattr(launch, "summary_block_v", lambda *_, bv=block_v: bv)
        S_star, M = launch.summaries(x, True, active)
        for kind, got in enumerate((S_star, M)):
            err = rel_err(got, want[kind])
            assert err <= TOL, (block_v, kind, err)
            assert torch.equal(got[active[kind] == 0], torch.zeros_like(got[active[kind] == 0]))


def test_segmented_step_and_cp_hand_offs_issue_no_host_sync():
    """After a warm-up, a segmented fwd+bwd of the public op and inter-card CP's hand-offs (the state a call
    passes on, the gradient it sends back) run without one host synchronisation: in a CP step every sync
    drains the GPU's queue in every layer (an indexing by a device scalar did, 2026-11-30)."""
    from flashqla.ops import backends
    from flashqla.ops.torch_backend import make_plan

    T = 8192
    call = make_call([T], 2, 8, with_h0=False, seed=6)
    leaves = {n: call[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    plan = make_plan(1, T, [0, T], 16)
    handoff = backends.Call(*(call[n] for n in ("q", "k", "v", "g", "beta")), None,
                            backends.device_offsets((0, T), call["q"].device))
    do = torch.randn_like(call["v"])
    dht = torch.randn(1, 8, D, D, device="cuda")

    def step():
        o, _ = flashqla.chunk_gated_delta_rule(*leaves.values(), cu_seqlens=call["cu_seqlens"], backend="tilelang",
                                               intra_cp=16)
        o.backward(do)
        _, finish = backends.forward_passing_state("tilelang", handoff, D ** -0.5, plan, -10.0)
        _, _, kept = finish()
        _, finish_backward = backends.backward_passing_gradient("tilelang", handoff, D ** -0.5, plan, -10.0, do,
                                                                kept, True)
        finish_backward(dht)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
