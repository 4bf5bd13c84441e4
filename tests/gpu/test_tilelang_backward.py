"""Gradients of the public op on backend="tilelang" (the kernel backward, kernels/hopper/backward.py, and its
intra-card CP composition, flashqla/cp/segments.py) against a float64 token recurrence differentiated by
autograd (skips without an SM90 GPU).

Metric: relative L2 error per gradient; bf16 thresholds from DEVELOPERS.md: dq, dk, dv, dh0 <= 1e-2,
dg, dbeta <= 2e-2. Gates are drawn like real models (make_call: g = -A softplus(x + dt_bias), one head at
g = 0, one at strong decay). Buffers from torch.empty are NaN-poisoned while the op runs.
"""
import pytest
import torch

import flashqla
from test_tilelang_forward import D, make_call, poisoned_outputs, rel_err  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")

TOL = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "initial_state": 1e-2, "g": 2e-2, "beta": 2e-2}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def recurrence64_with_grads(call, do, dht, scale=D ** -0.5):
    """float64 token recurrence of one packed stream [1, T] (or a batch, row by row) and its autograd grads."""
    leaves = {n: call[n].detach().double().requires_grad_(True) for n in NAMES if call.get(n) is not None}
    q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, Hv = v.shape[:3]
    group = Hv // q.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    if call["cu_seqlens"] is not None:
        spans = [(0, s, e) for s, e in zip(call["cu_seqlens"][:-1].tolist(), call["cu_seqlens"][1:].tolist())]
    else:
        spans = [(b, 0, T) for b in range(B)]
    outs, loss = [], 0.0
    for n, (b, s, e) in enumerate(spans):
        S = leaves["initial_state"][n] if "initial_state" in leaves else v.new_zeros(Hv, D, D)
        for t in range(s, e):
            kt, bt = k[b, t], beta[b, t][:, None]
            S = S * g[b, t].exp()[:, None, None]
            S = S + (bt * kt)[:, :, None] * (v[b, t] - torch.einsum("hk,hkv->hv", kt, S))[:, None, :]
            outs.append((b, t, scale * torch.einsum("hk,hkv->hv", q[b, t], S)))
        loss = loss + (S * dht[n].double()).sum()
    o = torch.stack([x for _, _, x in outs]).reshape(B, T, Hv, D) if call["cu_seqlens"] is None else \
        torch.stack([x for _, _, x in outs])[None]
    loss = loss + (o * do.double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads))


def op_grads(call, do, dht, **kw):
    leaves = {n: call[n].detach().clone().requires_grad_(True) for n in NAMES if call.get(n) is not None}
    o, ht = flashqla.chunk_gated_delta_rule(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves.get("initial_state"),
        output_final_state=True, cu_seqlens=call["cu_seqlens"], **kw)
    grads = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
    return dict(zip(leaves, grads))


def assert_grads_match(call, **kw):
    gen = torch.Generator(device="cuda").manual_seed(99)
    v = call["v"]
    N = len(call["cu_seqlens"]) - 1 if call["cu_seqlens"] is not None else v.shape[0]
    do = torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)
    dht = torch.randn(N, v.shape[2], D, D, generator=gen, device="cuda") * 0.1
    got = op_grads(call, do, dht, backend="tilelang", **kw)
    ref = recurrence64_with_grads(call, do, dht)
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    assert all(got[n].dtype == call[n].dtype and got[n].shape == call[n].shape for n in ref)
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= TOL[n]}
    assert not bad, f"gradients over threshold: {bad} (all: { {n: f'{e:.1e}' for n, e in errors.items()} })"
    return errors


@pytest.mark.parametrize("Hqk,Hv", [(2, 8), (4, 16), (8, 24), (16, 32)])
def test_gqa_head_configs_match_recurrence(Hqk, Hv, poisoned_outputs):
    assert_grads_match(make_call([300], Hqk, Hv, seed=Hqk + Hv))


def test_varlen_pack_with_1_and_65_token_sequences(poisoned_outputs):
    assert_grads_match(make_call([1, 65, 64, 130, 7, 200, 1, 129], 2, 6, seed=3))


def test_equal_length_batch_without_initial_state(poisoned_outputs):
    assert_grads_match(make_call([150], 4, 8, with_h0=False, batch=3, seed=4))


def test_fp16_inputs(poisoned_outputs):
    assert_grads_match(make_call([1, 190, 64], 4, 16, dtype=torch.float16, seed=5))


def twice_then_per_head(call, intra_cp, seed, monkeypatch):
    """The gradients of one (dO, dht) drawn from `seed`: from two runs as the environment stands, then from one with
    FLASHQLA_GQA_PAIR_SUM=0 (dq and dk per v-head, summed by the GQA sum kernel alone)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v = call["v"]
    do = torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)
    dht = torch.randn(len(call["cu_seqlens"]) - 1, v.shape[-2], D, D, generator=gen, device="cuda") * 0.1
    runs = [op_grads(call, do, dht, backend="tilelang", intra_cp=intra_cp) for _ in range(2)]
    monkeypatch.setenv("FLASHQLA_GQA_PAIR_SUM", "0")
    return runs, op_grads(call, do, dht, backend="tilelang", intra_cp=intra_cp)


@pytest.mark.parametrize("Hqk,Hv,dtype", [(2, 4, torch.bfloat16), (4, 8, torch.float16), (1, 4, torch.bfloat16),
                                          (2, 16, torch.bfloat16)], ids=["gqa2", "gqa2_fp16", "gqa4", "gqa8"])
@pytest.mark.parametrize("intra_cp", ["off", 3])
def test_gqa_pair_sums_in_the_kernel(Hqk, Hv, dtype, intra_cp, poisoned_outputs, monkeypatch):
    """At an even GQA group chunk_bwd_local's "ordered" build sums each v-head pair's dq and dk
    (kernels/hopper/chunk_bwd_local.py, "GQA pair sums"; into NaN-poisoned outputs, so a row its first v-head did
    not store shows). On a pack with 1- and 65-token sequences (a reduce's rows past a sequence end
    land on the next sequence's rows, as zeros) every gradient passes the float64 thresholds, two runs give the
    same bits (the reduce order does not show), and at 2 v-heads per k-head the gradients are bitwise those with
    FLASHQLA_GQA_PAIR_SUM=0 (the GQA sum of the same rounded tiles)."""
    call = make_call([1, 65, 64, 130, 7, 200, 1, 129], Hqk, Hv, dtype=dtype, seed=40 + Hv)
    assert_grads_match(call, intra_cp=intra_cp)
    paired, unpaired = twice_then_per_head(call, intra_cp, 41, monkeypatch)
    for name in unpaired:
        assert torch.equal(paired[0][name], paired[1][name]), f"d{name} differs between two runs"
        if Hv // Hqk == 2:
            assert torch.equal(paired[0][name], unpaired[name]), f"d{name} differs from the GQA sum's"


@pytest.mark.parametrize("cp_warmup", [None, -10.0])
def test_forced_intra_card_segments(cp_warmup, poisoned_outputs):
    assert_grads_match(make_call([700, 65, 1, 500], 2, 8, seed=6), intra_cp=3, cp_warmup=cp_warmup)


@pytest.mark.parametrize("intra_cp", ["off", 3])
def test_backward_that_recomputes_the_inverse(intra_cp, poisoned_outputs, monkeypatch):
    """FLASHQLA_KEEP_INVERSE=0: the forward keeps no A and the backward runs wy_inverse again (store_a); every
    other test here takes the default, the backward reading the forward's GA."""
    monkeypatch.setenv("FLASHQLA_KEEP_INVERSE", "0")
    assert_grads_match(make_call([1, 65, 64, 130, 7, 200, 1, 129], 2, 6, seed=8), intra_cp=intra_cp)


def kept_against_recomputed(call, intra_cp, seed):
    """(kept, recomputed): o, the final state and every gradient of one (dO, dht) drawn from `seed`, with
    keep_states=True (the forward's walk stores the per-chunk states beside O, the backward reads them) and False
    (the backward recomputes them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    v = call["v"]
    N = len(call["cu_seqlens"]) - 1 if call["cu_seqlens"] is not None else v.shape[0]
    do = torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)
    dht = torch.randn(N, v.shape[2], D, D, generator=gen, device="cuda") * 0.1
    runs = []
    for keep_states in (True, False):
        leaves = {n: call[n].detach().clone().requires_grad_(True) for n in NAMES if call.get(n) is not None}
        o, ht = flashqla.chunk_gated_delta_rule(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
            initial_state=leaves.get("initial_state"), output_final_state=True, cu_seqlens=call["cu_seqlens"],
            backend="tilelang", intra_cp=intra_cp, keep_states=keep_states)
        grads = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
        runs.append({"o": o, "ht": ht, **{f"d{n}": g for n, g in zip(leaves, grads)}})
    return runs


@pytest.mark.parametrize("intra_cp", ["off", 3])
@pytest.mark.parametrize("lengths,Hv,dtype", [([1, 65, 64, 130, 7, 200, 1, 129], 6, torch.bfloat16),
                                              ([1, 65, 64, 130, 7, 200, 1, 129], 6, torch.float16),
                                              ([333] * 24 + [1, 64], 8, torch.bfloat16)],
                         ids=["narrow-tiles", "narrow-tiles-fp16", "tile-128"])
def test_forward_that_keeps_its_states(intra_cp, lengths, Hv, dtype, poisoned_outputs):
    """keep_states=True: fused_fwd's keep_states build stores the state entering every chunk beside O (TMA stores
    from the output warpgroup) into a NaN-poisoned buffer, and the backward reads it instead of walking again. o,
    the final state and every gradient are bitwise those of keep_states=False (store_states 1 recomputes the same
    states), at narrow V tiles (few walks) and at 128 (26 x 8 walks, and with segments more), unsegmented and
    with intra-card segments, bf16 and fp16; the small packs also against the float64 recurrence."""
    call = make_call(lengths, 2, Hv, dtype=dtype, seed=50 + Hv)
    if Hv == 6:
        assert_grads_match(call, intra_cp=intra_cp, keep_states=True)
    kept, recomputed = kept_against_recomputed(call, intra_cp, 51)
    for name in recomputed:
        assert not kept[name].isnan().any(), f"{name} has NaN (an unwritten state slot)"
        assert torch.equal(kept[name], recomputed[name]), f"{name} differs with the states kept"


@pytest.mark.parametrize("lengths", [[1, 65, 64, 130, 7, 200, 1, 129, 333], [0, 1, 65, 0, 130, 7, 200, 333, 0]],
                         ids=["pack", "empty-sequences"])
@pytest.mark.parametrize("intra_cp", ["off", 3])
@pytest.mark.parametrize("keep_states", [False, True], ids=["recomputed", "kept_states"])
def test_backward_in_slices_of_sequences(intra_cp, keep_states, lengths, poisoned_outputs, monkeypatch):
    """FLASHQLA_BWD_STATES_GIB below the pack's h and dh: the backward runs in slices of consecutive rows (with a
    slice as narrow as a row allowed here; the dispatch keeps a wave of walks a slice), each slice's walks and
    chunk_bwd_local on token views of the inputs and outputs. Every gradient is the same bits as one pass's and
    within the limits of the float64 recurrence, unsegmented and with intra-card segments, states recomputed or
    kept; GQA group 4 (pair sums, then the group sum); empty sequences at both ends and inside join a neighbour's
    slice (a slice of zero tokens would hand the kernels zero-sized TMA boxes)."""
    from flashqla.kernels.hopper import backward

    call = make_call(lengths, 2, 8, seed=70)
    slices = []
    real = backward.row_slices

    def any_width(chunks, state_bytes, budget, wave_rows):
        slices.append(real(chunks, state_bytes, budget, 1))
        return slices[-1]
    monkeypatch.setattr(backward, "row_slices", any_width)
    gen = torch.Generator(device="cuda").manual_seed(71)
    do = torch.randn(call["v"].shape, generator=gen, device="cuda").to(call["v"].dtype)
    dht = torch.randn(len(lengths), 8, D, D, generator=gen, device="cuda") * 0.1
    whole = op_grads(call, do, dht, backend="tilelang", intra_cp=intra_cp, keep_states=keep_states)
    assert len(slices[-1]) == 1
    monkeypatch.setenv("FLASHQLA_BWD_STATES_GIB", str(4 * 2 * 8 * D * D * 2 / 2 ** 30))  # 4 chunks' h and dh
    sliced = op_grads(call, do, dht, backend="tilelang", intra_cp=intra_cp, keep_states=keep_states)
    assert len(slices[-1]) >= 4, slices[-1]
    for name in whole:
        assert torch.equal(sliced[name], whole[name]), f"d{name} differs in slices"
    assert_grads_match(call, intra_cp=intra_cp, keep_states=keep_states)


def test_32k_sequence_against_float64_chunked_reference():
    """512 chunks: the long-sequence precision check. Oracle: the torch backend in float64 (itself checked
    against the token recurrence on CPU), on the same bf16 inputs."""
    call = make_call([32768], 2, 8, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(call["v"].shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(1, 8, D, D, generator=gen, device="cuda") * 0.1
    got = op_grads(call, do, dht, backend="tilelang")
    call64 = {n: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for n, x in call.items()}
    ref = op_grads(call64, do.double(), dht.double(), backend="torch")
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= TOL[n]}
    assert not bad, f"gradients over threshold at 32K: {bad} (all: { {n: f'{e:.1e}' for n, e in errors.items()} })"
    print("32K gradient errors:", {n: f"{e:.1e}" for n, e in errors.items()})


def test_fp32_beta_as_the_beta_sigmoid_option_hands_the_kernels(poisoned_outputs):
    call = make_call([1, 190, 64], 2, 8, seed=8)
    call["beta"] = call["beta"].float()
    assert_grads_match(call)


def test_fla_options_on_the_kernel_path_against_the_float64_torch_backend(poisoned_outputs):
    """FLA's beta logits, in-kernel gate, V-first states and host offsets (flashqla/ops/options.py) on the
    kernels, against the same call on the torch backend in float64 from the same inputs."""
    call = make_call([65, 1, 300], 2, 8, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(10)
    raw = dict(q=call["q"], k=call["k"], v=call["v"], beta=torch.randn(call["beta"].shape, generator=gen,
               device="cuda"), g=torch.randn(call["g"].shape, generator=gen, device="cuda"),
               initial_state=call["initial_state"].transpose(-1, -2).contiguous(),
               A_log=torch.empty(8, device="cuda").uniform_(0.01, 16, generator=gen).log(),
               dt_bias=torch.randn(8, generator=gen, device="cuda"))
    do = torch.randn(call["v"].shape, generator=gen, device="cuda").bfloat16()
    dht = torch.randn(3, 8, D, D, generator=gen, device="cuda") * 0.1
    cu = call["cu_seqlens"]

    def grads(inputs, backend):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()}
        o, ht = flashqla.chunk_gated_delta_rule(
            leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
            output_final_state=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu,
            cu_seqlens_cpu=cu.cpu(), use_gate_in_kernel=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
            backend=backend)
        out = torch.autograd.grad([o, ht], list(leaves.values()), [do.to(o.dtype), dht.transpose(-1, -2).to(ht.dtype)])
        return dict(zip(leaves, out), o=o, ht=ht)

    got = grads(raw, "tilelang")
    ref = grads({n: x.double() for n, x in raw.items()}, "torch")
    tol = {**TOL, "o": 5e-3, "ht": 5e-3, "A_log": 2e-2, "dt_bias": 2e-2}
    errors = {n: rel_err(got[n], ref[n]) for n in ref}
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= tol[n]}
    assert not bad, f"over threshold with FLA's options: {bad} (all: { {n: f'{e:.1e}' for n, e in errors.items()} })"


@pytest.mark.parametrize("group", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gqa_sum_kernel_is_the_fp32_sum_rounded_once(group, dtype):
    """gqa_sum (dq and dk per v-head -> per k-head) on row counts that leave a partial last block: every row
    is its group's sum in fp32 rounded once (sums of a few 16-bit values are exact in fp32, so any order
    gives the same bits); outputs start as NaN so an unwritten row shows."""
    from flashqla.kernels.hopper import launch

    gen = torch.Generator(device="cuda").manual_seed(group)
    for rows in (1, 31, 33, 4099):
        dq, dk = (torch.randn(rows, group, D, generator=gen, device="cuda").to(dtype) for _ in range(2))
        dq_out, dk_out = (torch.full((rows, D), float("nan"), dtype=dtype, device="cuda") for _ in range(2))
        launch.compiled_gqa_sum(launch._TORCH_TO_TL[dtype])(dq, dk, dq_out, dk_out)
        assert torch.equal(dq_out, dq.float().sum(1).to(dtype)), (group, rows)
        assert torch.equal(dk_out, dk.float().sum(1).to(dtype)), (group, rows)


def test_reverse_walk_from_zero_over_each_walks_leading_chunks_matches_float64(poisoned_outputs, monkeypatch):
    """chunk_dstates with `last_chunks` (intra-card CP's warmed-up D_j walks) at every V tile: dS0 of (n, h) is
    the float64 gradient of the initial state from the outputs of chunks last_chunks[h, n] .. 0 alone (dO
    zero past them, no final-state gradient); -1 walks nothing (zeros), past the end the whole sequence. A
    pack with 1- and 65-token sequences, GQA 2 -> 8, g = 0 and strong decay heads; outputs NaN-poisoned."""
    from flashqla.kernels.hopper import backward, launch

    lengths, Hv = [1000, 65, 1, 2030], 8
    call = make_call(lengths, 2, Hv, seed=31)
    gen = torch.Generator(device="cuda").manual_seed(32)
    chunks = (call["cu_seqlens"].diff() + 63) // 64  # [N]
    last = (torch.randint(0, 1 << 20, (Hv, len(lengths)), generator=gen, device="cuda") % (chunks + 3) - 1).int()
    last[0, 0], last[1, 0] = -1, 1 << 20  # a walk over nothing and one past the end, surely
    do = torch.randn(call["v"].shape, generator=gen, device="cuda").to(call["v"].dtype)
    # float64: the outputs past each walk's last chunk carry no gradient
    t = torch.arange(sum(lengths), device="cuda")
    seq = torch.bucketize(t, call["cu_seqlens"][1:].long(), right=True)
    covered = t[:, None] < call["cu_seqlens"][seq].long()[:, None] + 64 * (last.t()[seq].long() + 1)  # [T, Hv]
    do_walked = do * covered[None, :, :, None]
    want = recurrence64_with_grads(call, do_walked, torch.zeros_like(call["initial_state"]))["initial_state"]
    x = launch.prepare(*[call[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")])
    for block_v in launch.BLOCK_V_CHOICES:
        monkeypatch.setattr(backward, "block_v_on", lambda *_, bv=block_v: bv)
        _, dS0 = backward.state_gradients(x, backward.output_gradient(x, do), D ** -0.5, None, store_dh=False,
                                          last_chunks=last)
        err = rel_err(dS0, want)
        assert err <= TOL["initial_state"], (block_v, err)
        assert torch.equal(dS0[0, 0], torch.zeros_like(dS0[0, 0]))
