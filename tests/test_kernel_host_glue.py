"""The host side of the TileLang kernels on the CPU, with torch emulators in place of the compiled kernels
(tests/kernel_emulator.py): every layout, offset and flag the kernels receive, against the torch backend.

Covers the split and fused forwards, intra-card segments on the kernel path, the kernel backward (plain and
segmented), and the inter-card summaries and entering-state gradients. Inputs are bf16 (what the kernels take); the emulators compute in fp64, so
the limits are bf16's (the kernels' own precision is tested on the H200 in tests/gpu).
"""
import contextlib
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernel_emulator
from gdn_inputs import make_inputs, random_cu_seqlens, rel_err

pytest.importorskip("tilelang")

TOL = 5e-3
NAMES = ("q", "k", "v", "g", "beta")


@pytest.fixture
def hopper(monkeypatch):
    kernel_emulator.install(monkeypatch)
    from flashqla.kernels import hopper

    return hopper


def call(lengths, Hqk=2, Hv=4, with_h0=True, seed=0):
    args = make_inputs(1, sum(lengths), Hqk, Hv, 128, 128, dtype=torch.bfloat16, num_seqs=len(lengths),
                       with_h0=with_h0, strong_heads=(Hv - 1,), seed=seed, requires_grad=False)
    return args, random_cu_seqlens(lengths)


def torch_forward(args, cu, plan_chunks=0, scale=128 ** -0.5):
    from flashqla.ops import torch_backend

    plan = torch_backend.make_plan(1, args["q"].shape[1], cu.tolist(), plan_chunks)
    return torch_backend.forward(*(args[n] for n in NAMES), scale, args.get("initial_state"), True, plan)


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_forward_paths_match_the_torch_backend(hopper, fused):
    args, cu = call([1, 65, 130, 64, 7], Hqk=2, Hv=6)
    o, ht = hopper.chunk_gdn_fwd(*(args[n] for n in NAMES), 128 ** -0.5, args["initial_state"], True, cu, fused=fused)
    o_ref, ht_ref = torch_forward(args, cu)
    assert o.shape == o_ref.shape and ht.shape == ht_ref.shape and o.dtype == torch.bfloat16
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_forward_paths_launch_their_kernels_once_and_leave_the_inputs_alone(hopper, monkeypatch, fused):
    """Both forwards start from one wy_inverse (GA and gcum); the fused one then runs fused_fwd alone, the
    split one the state walk storing every chunk's state and V', then chunk_output. No input is written."""
    from flashqla.kernels.hopper import launch

    ran = []
    for name in ("compiled_wy_inverse", "compiled_fused_fwd", "compiled_chunk_states", "compiled_chunk_output"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, real=real, name=name: ran.append(name[9:]) or real(*a))
    args, cu = call([1, 65, 130], Hqk=2, Hv=4, seed=3)
    before = {n: args[n].clone() for n in NAMES}
    o, _ = hopper.chunk_gdn_fwd(*(args[n] for n in NAMES), 128 ** -0.5, args["initial_state"], True, cu, fused=fused)
    assert ran == (["wy_inverse", "fused_fwd"] if fused else ["wy_inverse", "chunk_states", "chunk_output"])
    assert all(torch.equal(args[n], before[n]) for n in NAMES)
    assert rel_err(o, torch_forward(args, cu)[0]) <= TOL


def test_summary_walks_take_the_narrowest_v_tile_within_eight_ctas_per_sm():
    """The H200 measurements behind SUMMARY_MAX_CTAS_PER_SM (132 SMs): TP8 32K and h32 (256 walks) got
    faster with tiles of 32, TP4 32K and 2B (512) with 64, 27B (768) kept 128."""
    from flashqla.kernels.hopper.launch import summary_block_v

    assert [summary_block_v(walks, 132) for walks in (128, 256, 512, 768, 4096)] == [32, 32, 64, 128, 128]


def test_forward_takes_the_fused_walk_at_any_number_of_walks(hopper, monkeypatch):
    """Since fused_fwd is warp-specialised it beats the split forward from one walk up (H200): one sequence
    of one head runs fused_fwd and no split kernel."""
    from flashqla.kernels.hopper import launch

    ran = []
    for name in ("compiled_fused_fwd", "compiled_chunk_states", "compiled_chunk_output"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    args, cu = call([130], Hqk=1, Hv=1, seed=5)
    o, _ = hopper.chunk_gdn_fwd(*(args[n] for n in NAMES), 128 ** -0.5, args["initial_state"], True, cu)
    assert ran == ["compiled_fused_fwd"]
    assert rel_err(o, torch_forward(args, cu)[0]) <= TOL
    with pytest.raises(TypeError, match="fused"):  # no third value that would quietly pick a path
        hopper.chunk_gdn_fwd(*(args[n] for n in NAMES), 128 ** -0.5, args["initial_state"], True, cu, fused=None)


def test_the_scores_path_runs_where_its_traffic_is_smaller_than_what_it_saves_the_walk():
    """chunk_scores' Q, K and P traffic per token of a walk (every sequence's) against SCORES_MAX_BYTES: the H100
    A/B's winners ((2, 8) and (4, 16) at one sequence, (2, 8) at two) take it, its losers ((8, 24), (16, 16), (32,
    32) x 32K; (2, 8) x 4K x 8 at V tile 64) do not, and no V tile but 32 does."""
    from flashqla.kernels.hopper.launch import reads_chunk_scores

    assert [reads_chunk_scores(n, hqk, hv, 32) for n, hqk, hv in [(1, 2, 8), (1, 4, 16), (2, 2, 8)]] == [True] * 3
    assert not any(reads_chunk_scores(n, hqk, hv, 32) for n, hqk, hv in [(1, 8, 24), (1, 16, 16), (1, 32, 32),
                                                                         (3, 2, 8)])
    assert not reads_chunk_scores(8, 2, 8, 64) and not reads_chunk_scores(1, 2, 8, 64)


@pytest.mark.parametrize("lengths, sms, keep, env, scores", [([1, 65, 130], 132, False, "1", True),
                                                             ([1, 65, 130], 132, True, "1", False),
                                                             ([1, 65, 130], 132, False, "0", False),
                                                             ([1, 65, 130, 64], 132, False, "1", False),
                                                             ([1, 65, 130], 8, False, "1", False)])
def test_narrow_tile_walks_read_their_scores_from_one_chunk_parallel_launch(hopper, monkeypatch, lengths, sms, keep,
                                                                            env, scores):
    """At V tile 32 (3 or 4 sequences x 4 v-heads on 132 SMs) and within SCORES_MAX_BYTES (3 sequences of (2, 4):
    6 KiB a token) the fused forward runs chunk_scores and the walk's scores build, which reads P from it; with a
    fourth sequence, at V tile 128 (8 SMs), in the keep_states build and with FLASHQLA_CHUNK_SCORES=0 the walk
    forms P itself. O matches the torch backend either way."""
    from flashqla.kernels.hopper import launch

    monkeypatch.setattr(launch, "_sm_count", lambda index: sms)
    monkeypatch.setenv(launch.SCORES_ENV, env)
    ran = []  # (kernel, build arguments after the dtype) of every launch, in order
    for name in ("compiled_chunk_scores", "compiled_fused_fwd"):
        def compiled(*build, real=getattr(launch, name), name=name):
            kernel = real(*build)
            return lambda *args: ran.append((name[9:],) + build[1:]) or kernel(*args)
        monkeypatch.setattr(launch, name, compiled)
    args, cu = call(lengths, Hqk=2, Hv=4, seed=3)
    x = launch.prepare(*(args[n] for n in ("q", "k", "v", "g", "beta")), cu)
    block_v = launch.block_v_on(x.q.device, x.num_seqs, x.num_v_heads)
    o, _ = launch.fused_forward(x, args["v"], args["initial_state"], 128 ** -0.5, True,
                                launch.states_buffer(x) if keep else None)
    assert block_v == (32 if sms == 132 else 128)
    plain = [("fused_fwd", block_v, True)] if keep else [("fused_fwd", block_v)]
    assert ran == ([("chunk_scores",), ("fused_fwd", block_v, False, True)] if scores else plain)
    assert rel_err(o.view(args["v"].shape), torch_forward(args, cu)[0]) <= TOL


@pytest.mark.parametrize("fused,with_h0,cp_warmup", [(False, True, None), (True, True, None), (False, False, None),
                                                     (True, True, -3.0), (True, False, -3.0)])
def test_segmented_kernel_path_matches_unsegmented(hopper, fused, with_h0, cp_warmup):
    """Segments of a varlen pack: one summary launch (S*, M where read), the fold, the final walk split or
    fused; without h0 no first segment's M is computed. Fused: the summary walks read GA, v and beta, no W
    or U (the emulated wy_inverse leaves none); with cp_warmup the strong-decay head's walks start late,
    against the torch backend's own warmup."""
    from flashqla.cp import segments
    from flashqla.ops import torch_backend

    args, cu = call([700, 65, 1, 300], seed=1)
    if not with_h0:
        args["initial_state"] = None
    args["g"][..., -1] = -0.2  # the strong-decay head: -12.8 over a chunk
    plan = torch_backend.make_plan(1, args["q"].shape[1], cu.tolist(), 3)
    assert plan.is_segmented
    o, ht = segments.segmented_forward(hopper, *(args[n] for n in NAMES), 128 ** -0.5, args["initial_state"], True,
                                       plan, cp_warmup, fused=fused)
    if cp_warmup is None:
        o_ref, ht_ref = torch_forward(args, cu)
    else:
        o_ref, ht_ref = torch_backend.forward(*(args[n] for n in NAMES), 128 ** -0.5, args["initial_state"], True,
                                              plan, cp_warmup)
    assert not o.isnan().any()
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))


@pytest.mark.parametrize("segment_chunks,cp_warmup,with_states", [(0, None, True), (2, None, True), (2, -10.0, True),
                                                                   (3, -2.0, True), (2, None, False)])
def test_backward_dispatch_on_the_kernel_path_matches_the_torch_backend(hopper, segment_chunks, cp_warmup,
                                                                        with_states):
    """backends.backward("tilelang"): the kernel backward, with intra-card segments run as sequences (their
    starts, D_j, the mirror scan of exit gradients); a pack with 1-token and odd-length sequences, h0 and dht
    (or neither: then the summary launch skips every first and last segment's M)."""
    from flashqla.ops import backends, torch_backend

    args, cu = call([200, 1, 129, 300], Hqk=2, Hv=4, seed=2)
    if not with_states:
        args["initial_state"] = None
    plan = torch_backend.make_plan(1, args["q"].shape[1], cu.tolist(), segment_chunks)
    assert plan.is_segmented == (segment_chunks > 0)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(4, 4, 128, 128, generator=gen) * 0.1 if with_states else None
    inputs = [args[n] for n in NAMES]
    call_ = backends.Call(*inputs, args["initial_state"], cu)
    got = backends.backward("tilelang", call_, 0.25, plan, cp_warmup, do, dht)
    # reference: the unsegmented exact gradients (warmup heads may differ below e^cp_warmup)
    want = torch_backend.backward(*inputs, 0.25, args["initial_state"], torch_backend.make_plan(
        1, args["q"].shape[1], cu.tolist(), 0), do, dht, None)
    limits = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "g": 2e-2, "beta": 2e-2, "initial_state": 1e-2}
    for name, a, b in zip(limits, got, want):
        if name == "initial_state" and not with_states:
            assert a is None and b is None
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= limits[name], (name, rel_err(a, b))


def test_reverse_walks_from_zero_end_where_the_gates_bound_the_rest_when_they_exceed_a_wave(hopper, monkeypatch):
    """With cp_warmup, where the segments' reverse walks from zero (D_j) take more CTAs than there are SMs, each
    covers its segment's chunks up to the first after which the gates from the segment's start sum below
    cp_warmup (counted here from g itself): the whole segment for the g = 0 head, fewer chunks for the
    strong-decay head. The gradients stay those of the untruncated walks within e^cp_warmup's reach; within
    one wave no walk is truncated."""
    from flashqla.kernels.hopper import launch
    from flashqla.ops import backends, torch_backend

    seen = []
    real = hopper.state_gradients

    def spy(x, do, scale, dht, store_dh=True, last_chunks=None):
        if not store_dh:
            seen.append(last_chunks)
        return real(x, do, scale, dht, store_dh, last_chunks)

    monkeypatch.setattr(hopper, "state_gradients", spy)
    lengths, Hv, cp_warmup = [700, 1, 329], 4, -10.0
    args, cu = call(lengths, Hqk=2, Hv=Hv, seed=21)
    plan = torch_backend.make_plan(1, args["q"].shape[1], cu.tolist(), 4)  # segments of 4 chunks
    gen = torch.Generator().manual_seed(22)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(len(lengths), Hv, 128, 128, generator=gen) * 0.1
    entering = backends.Call(*(args[n] for n in NAMES), args["initial_state"], cu)
    grads = {}
    exceeds = hopper.walks_exceed_a_wave
    # 6 segments x 4 heads: 96 CTAs at V tile 32 on 132 SMs (one wave), 24 at 128 on 4 SMs (truncated, and
    # untruncated for comparison)
    for sm_count, truncate in ((132, True), (4, False), (4, True)):
        monkeypatch.setattr(launch, "_sm_count", lambda index, sm_count=sm_count: sm_count)
        monkeypatch.setattr(hopper, "walks_exceed_a_wave", exceeds if truncate else lambda *a: False)
        seen.clear()
        grads[sm_count, truncate] = backends.backward("tilelang", entering, 0.25, plan, cp_warmup, do, dht)
        assert len(seen) == 1 and (seen[0] is None) == (sm_count == 132 or not truncate)
    assert seen[0] is not None and seen[0].dtype == torch.int32 and seen[0].shape == (Hv, len(plan.starts))
    want = torch.empty(Hv, len(plan.starts), dtype=torch.int32)
    chunks = []
    for row, (start, length) in enumerate(zip(plan.starts, plan.lengths)):
        sums = torch.stack([args["g"][0, t:min(t + 64, start + length)].double().sum(0)
                            for t in range(start, start + length, 64)])  # [chunks, Hv]
        want[:, row] = (sums.cumsum(0) >= cp_warmup).sum(0)
        chunks.append(len(sums))
    chunks = torch.tensor(chunks)
    assert torch.equal(torch.minimum(seen[0], chunks - 1), torch.minimum(want, chunks - 1))
    assert (seen[0][0] >= chunks - 1).all()  # g = 0: every chunk
    assert (seen[0][-1] < chunks - 1).any()  # strong decay: truncated
    for name, a, b in zip(NAMES + ("initial_state",), grads[4, True], grads[4, False]):
        assert rel_err(a, b) <= 1e-4, (name, rel_err(a, b))
    x = launch.prepare(*(args[n] for n in NAMES), cu)
    with pytest.raises(ValueError, match="last_chunks"):  # only a walk from zero that stores dS0 alone
        real(x, hopper.output_gradient(x, do), 0.25, None, store_dh=True, last_chunks=seen[0])


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen_h0_dht", "batch"])
def test_kernel_backward_matches_the_torch_backend(hopper, varlen):
    """chunk_gdn_bwd on the token layout: partial chunks, 1-token sequences, GQA, h0 and dht (varlen), and
    an equal-length batch without either."""
    from flashqla.ops import torch_backend

    if varlen:
        args, cu = call([1, 65, 130, 64, 7], Hqk=2, Hv=6, seed=7)
    else:
        args = make_inputs(2, 100, 1, 3, 128, 128, dtype=torch.bfloat16, with_h0=False, seed=8, requires_grad=False)
        cu = None
    h0 = args.get("initial_state")
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(h0.shape, generator=gen) * 0.1 if h0 is not None else None
    inputs = [args[n] for n in NAMES]
    got = hopper.chunk_gdn_bwd(*inputs, 0.25, h0, cu, do, dht)
    B, T = args["q"].shape[:2]
    plan = torch_backend.make_plan(B, T, None if cu is None else cu.tolist(), 0)
    want = torch_backend.backward(*inputs, 0.25, h0, plan, do, dht, None)
    limits = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "g": 2e-2, "beta": 2e-2, "initial_state": 1e-2}
    for name, a, b in zip(limits, got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= limits[name], (name, rel_err(a, b))


def gqa_sum_case(monkeypatch, Hqk, Hv, seed):
    """A backward call of the GQA-sum tests (a pack of 1- to 130-token sequences, initial state and dht), and the
    list every chunk_bwd_local and gqa_sum launch appends to: (kernel, build arguments, first argument's shape)."""
    from flashqla.kernels.hopper import backward

    args, cu = call([1, 65, 130, 64, 7], Hqk=Hqk, Hv=Hv, seed=seed)
    h0 = args["initial_state"]
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(h0.shape, generator=gen) * 0.1
    launched = []
    for name in ("compiled_chunk_bwd_local", "compiled_gqa_sum"):
        build = getattr(backward, name)

        def spy(*build_args, build=build, name=name):
            kernel = build(*build_args)
            return lambda *a: launched.append((name, build_args, tuple(a[0].shape))) or kernel(*a)
        monkeypatch.setattr(backward, name, spy)
    return ([args[n] for n in NAMES], h0, cu, do, dht), launched


def assert_sums_agree(got, per_head, case, rounded):
    """Every gradient of `got` equal to the per-v-head path's, bitwise except those named in `rounded` (within
    bf16's rounding of it, and not the same bits), and within the kernels' limits of the torch backend's."""
    from flashqla.ops import torch_backend

    inputs, h0, cu, do, dht = case
    plan = torch_backend.make_plan(1, inputs[0].shape[1], cu.tolist(), 0)
    want = torch_backend.backward(*inputs, 0.25, h0, plan, do, dht, None)
    limits = {"q": 1e-2, "k": 1e-2, "v": 1e-2, "g": 2e-2, "beta": 2e-2, "initial_state": 1e-2}
    for name, a, b, w in zip(limits, got, per_head, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name in rounded:
            assert 0 < rel_err(a, b) <= 1e-2, (name, rel_err(a, b))  # rounded after each add: not the same bits
        else:
            assert torch.equal(a, b), name
        assert rel_err(a, w) <= limits[name], (name, rel_err(a, w))


@pytest.mark.parametrize("Hqk,Hv", [(2, 4), (1, 4), (2, 6)], ids=["gqa2", "gqa4", "gqa3"])
def test_kernel_backward_sums_gqa_pairs_in_the_kernel(hopper, monkeypatch, Hqk, Hv):
    """At an even GQA group chunk_bwd_local's "ordered" pair_sum build writes dq and dk per v-head pair, and the
    GQA sum runs over the rest of the group (not at all at 2); at an odd group, or with FLASHQLA_GQA_PAIR_SUM=0,
    the "none" build writes them per v-head and the GQA sum adds the whole group. Every gradient equals the
    switched-off path's: bitwise at groups 2 and 3, within bf16's rounding at 4 (two roundings more), and against
    the torch backend within the kernels' limits."""
    case, launched = gqa_sum_case(monkeypatch, Hqk, Hv, seed=17)
    monkeypatch.setenv("FLASHQLA_GQA_PAIR_SUM", "0")
    default = hopper.chunk_gdn_bwd(*case[0], 0.25, *case[1:])
    group, T = Hv // Hqk, case[0][0].shape[1]
    unpaired = [("compiled_chunk_bwd_local", ("bfloat16", "none"), (T, Hqk, 128)),
                ("compiled_gqa_sum", ("bfloat16",), (T * Hqk, group, 128))]
    assert launched == unpaired
    monkeypatch.delenv("FLASHQLA_GQA_PAIR_SUM")
    launched.clear()
    paired = hopper.chunk_gdn_bwd(*case[0], 0.25, *case[1:])

    if group % 2:
        assert launched == unpaired
    else:
        assert launched[0] == ("compiled_chunk_bwd_local", ("bfloat16", "ordered"), (T, Hqk, 128))
        sums = [(T * Hqk, group // 2, 128)] if group > 2 else []
        assert [shape for name, _, shape in launched[1:]] == sums
    assert_sums_agree(paired, default, case, ("q", "k") if group == 4 else ())


def test_summaries_on_the_kernel_path_match_the_torch_path(hopper):
    from flashqla.ops import backends

    args, _ = call([500], Hqk=2, Hv=4, with_h0=False, seed=3)
    S_tl, M_tl = backends.summary("tilelang", *(args[n] for n in NAMES), True)
    S_pt, M_pt = backends.summary("torch", *(args[n] for n in NAMES), True)
    assert S_tl.shape == S_pt.shape == (1, 4, 128, 128) and M_tl.shape == M_pt.shape == (1, 4, 128, 128)
    assert rel_err(S_tl, S_pt) <= TOL and rel_err(M_tl, M_pt) <= TOL, (rel_err(S_tl, S_pt), rel_err(M_tl, M_pt))
    assert backends.summary("tilelang", *(args[n] for n in NAMES), False)[1] is None


def _inter_card_cp_on_the_kernel_path(rank, world, lengths, intra_cp):
    import torch.distributed as dist

    import flashqla
    from flashqla.cp import build_cp_context
    from flashqla.ops import backends

    patches = pytest.MonkeyPatch()
    kernel_emulator.install(patches)
    patches.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    args, cu = call(lengths, Hqk=1, Hv=2, with_h0=False, seed=4)
    do = torch.randn(args["v"].shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    inputs = {n: args[n].requires_grad_(True) for n in NAMES}
    o_ref, _ = flashqla.chunk_gated_delta_rule(**inputs, cu_seqlens=cu, backend="torch")
    ref_grads = torch.autograd.grad((o_ref.float() * do.float()).sum(), [inputs[n] for n in NAMES])

    part = sum(lengths) // world
    mine = slice(rank * part, (rank + 1) * part)
    local = {n: args[n].detach()[:, mine].clone().requires_grad_(True) for n in NAMES}
    ctx = build_cp_context(cu, group=dist.group.WORLD, layout="contiguous")
    o, _ = flashqla.chunk_gated_delta_rule(**local, cp_context=ctx, backend="tilelang", intra_cp=intra_cp)
    grads = torch.autograd.grad((o.float() * do[:, mine].float()).sum(), [local[n] for n in NAMES])
    errors = {"o": rel_err(o, o_ref[:, mine])}
    errors.update({"d" + n: rel_err(gr, ref[:, mine]) for n, gr, ref in zip(NAMES, grads, ref_grads)})
    limits = {"o": TOL, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2, "dg": 2e-2, "dbeta": 2e-2}
    bad = {n: e for n, e in errors.items() if not e <= limits[n]}
    assert not bad, f"rank {rank}/{world}: {bad}"
    # keep_states: every local walk stores its states beside o (store_states 2), no backward recomputes them, and
    # the outputs and gradients are the same bits
    modes = _fused_walk_spy(patches)
    local = {n: args[n].detach()[:, mine].clone().requires_grad_(True) for n in NAMES}
    o_kept, _ = flashqla.chunk_gated_delta_rule(**local, cp_context=ctx, backend="tilelang", intra_cp=intra_cp,
                                                keep_states=True)
    forward_modes = list(modes)
    modes.clear()
    grads_kept = torch.autograd.grad((o_kept.float() * do[:, mine].float()).sum(), [local[n] for n in NAMES])
    assert forward_modes and set(forward_modes) == {2} and modes == [], (rank, forward_modes, modes)
    assert torch.equal(o_kept, o) and all(torch.equal(a, b) for a, b in zip(grads_kept, grads)), rank
    patches.undo()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, lengths, intra_cp", [(2, [130, 300, 82], "off"), (2, [130, 300, 82], 2),
                                                      (3, [100, 600, 68], 2)])
def test_inter_card_cp_on_the_kernel_path_equals_one_process(world, lengths, intra_cp):
    """gloo ranks, a pack whose middle sequence crosses the cuts, on the (emulated) kernels: summaries,
    exchange, the local kernel forward with the entering state, D_p and the kernel backward. With three
    ranks the middle one holds a piece of that sequence only: its call both receives a state and passes
    one on (the two-phase forward and backward with an initial state and a final-state gradient). With
    keep_states=True every local walk keeps its states and no backward recomputes them, the same bits."""
    from multiprocess import run_on_ranks

    run_on_ranks(world, _inter_card_cp_on_the_kernel_path, lengths, intra_cp)


def _cp_work_order(rank, world):
    """On each rank, the order of the segmented kernel path's phases and the exchange waits."""
    import torch.distributed as dist

    import flashqla
    from flashqla.cp import build_cp_context, inter, segments
    from flashqla.kernels import hopper as hopper_kernels
    from flashqla.ops import backends

    patches = pytest.MonkeyPatch()
    kernel_emulator.install(patches)
    patches.setattr(backends, "tilelang_unsupported_reason", lambda call: None)
    events = []

    def recorded(owner, name):
        fn = getattr(owner, name)
        patches.setattr(owner, name, lambda *a, **kw: events.append(name) or fn(*a, **kw))

    for name in ("forward_summaries", "_segment_summaries", "forward_chain", "forward_walk", "backward_prologue",
                 "entering_gradient", "backward_finish"):
        recorded(segments, name)
    for name in ("prepare", "prepare_from_kept"):  # the WY inverse, or the forward's kept one
        recorded(hopper_kernels, name)
    recorded(inter._Exchange, "wait")
    args, cu = call([640], Hqk=1, Hv=2, with_h0=False, seed=8)
    part = 640 // world
    local = {n: args[n].detach()[:, rank * part:(rank + 1) * part].clone().requires_grad_(True) for n in NAMES}
    ctx = build_cp_context(cu, group=dist.group.WORLD, layout="contiguous")
    o, _ = flashqla.chunk_gated_delta_rule(**local, cp_context=ctx, backend="tilelang", intra_cp=2, cp_warmup=None)
    forward_events = list(events)
    # what the forward keeps (each local call's starts, inverse and entering state) is in the saved tensors, where
    # saved-tensor hooks see it, not on the context (which holds the CP context, the caller's)
    assert not _holds_tensor(o.grad_fn.kept_layouts)
    assert not any(_holds_tensor(vars(call)) for call in o.grad_fn.calls)
    events.clear()
    o.float().sum().backward()
    patches.undo()
    # rank 0 sends the state (its own chain's, before its walk) and receives the exit gradient; rank 1 sends
    # the gradient of its entering state (from its own backward prologue) and receives the state
    expected_forward = ["forward_summaries", "prepare", "_segment_summaries", "forward_chain", "forward_walk", "wait"]
    expected_backward = ["backward_prologue", "prepare_from_kept", "wait", "backward_finish"]
    if rank == 1:
        expected_forward = ["forward_summaries", "prepare", "_segment_summaries", "wait", "forward_chain",
                            "forward_walk"]
        expected_backward = ["backward_prologue", "prepare_from_kept", "entering_gradient", "backward_finish", "wait"]
    assert forward_events == expected_forward, (rank, forward_events)
    # no _segment_summaries and no WY inverse: the forward kept the starts and its inverse
    assert events == expected_backward, (rank, events)


@pytest.mark.multiprocess
def test_inter_card_cp_overlaps_the_exchange_and_reuses_the_forward_starts():
    """One 640-token sequence over two ranks, segments of 2 chunks. Forward: the rank that sends the state
    takes it from its own summaries and chain, and walks while the exchange is in flight; the rank that
    receives it runs its WY inverse and summaries before it waits, and only the chain and walk after.
    Backward: the gradient sent back comes from the receiving rank's own prologue; the rank that receives
    the exit gradient runs its prologue (reverse walks) before the wait; neither rank's backward recomputes
    the segment summaries or the WY inverse (the forward kept its starts and its inverse)."""
    from multiprocess import run_on_ranks

    run_on_ranks(2, _cp_work_order)


def test_public_op_on_the_kernel_path_segments_by_the_calibrated_rule(hopper, monkeypatch):
    """backend="tilelang", intra_cp="auto": one sequence of 256 chunks with one v-head is cut into 16-chunk
    segments (the H200 calibration: 256 head-chunks), and the result is the torch backend's."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    seen = {}
    real_forward = backends.forward

    def spy(name, call_, scale, output_final_state, plan, cp_warmup, **kwargs):
        seen["name"], seen["plan"] = name, plan
        return real_forward(name, call_, scale, output_final_state, plan, cp_warmup, **kwargs)

    monkeypatch.setattr(backends, "forward", spy)
    args, cu = call([64 * 256], Hqk=1, Hv=1, with_h0=False, seed=5)
    o, ht = flashqla.chunk_gated_delta_rule(*(args[n] for n in NAMES), cu_seqlens=cu, output_final_state=True,
                                            backend="tilelang")
    assert seen["name"] == "tilelang" and seen["plan"].segment_chunks == 16 and len(seen["plan"].lengths) == 16
    o_ref, ht_ref = torch_forward(args, cu)
    assert rel_err(o, o_ref) <= TOL and rel_err(ht, ht_ref) <= TOL, (rel_err(o, o_ref), rel_err(ht, ht_ref))


def test_public_op_backward_reuses_the_forward_segment_starts(hopper, monkeypatch):
    """Autograd through the public op on the kernel path with intra-card segments: the forward keeps every
    segment's entering state and M, so the backward runs no summary launch of its own, and its gradients
    (incl. through the final state) are the torch backend's."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    launches = []
    real_summaries = hopper.summaries_from_gates
    monkeypatch.setattr(hopper, "summaries_from_gates",
                        lambda *a, **kw: launches.append(1) or real_summaries(*a, **kw))
    lengths = [200, 1, 129, 300]
    args, cu = call(lengths, Hqk=2, Hv=4, seed=6)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(args["initial_state"].shape, generator=gen) * 0.1
    grads = {}
    for backend, intra_cp in (("tilelang", 2), ("torch", "off")):
        leaves = {n: args[n].clone().requires_grad_(True) for n in NAMES + ("initial_state",)}
        o, ht = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True, backend=backend,
                                                intra_cp=intra_cp)
        if backend == "tilelang":
            assert len(launches) == 1
        torch.autograd.backward((o, ht), (do, dht))
        grads[backend] = [leaves[n].grad for n in NAMES + ("initial_state",)]
    assert len(launches) == 1  # the forward's; none in the backward
    limits = (1e-2, 1e-2, 1e-2, 2e-2, 2e-2, 1e-2)
    for name, a, b, limit in zip(NAMES + ("initial_state",), grads["tilelang"], grads["torch"], limits):
        assert rel_err(a, b) <= limit, (name, rel_err(a, b))


class TorchOpsOutsideKernels(TorchDispatchMode):
    """The torch ops a call runs outside the (emulated) compiled kernels, by name: on a GPU each is a launch of
    its own beside the kernels (views and allocations are none; a host read such as `.item()` shows too)."""

    FREE = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
            "aten.lift_fresh.default"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not kernel_emulator.called_from_an_emulator() and not func.is_view and str(func) not in self.FREE:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_segmented_fwd_bwd_launches_nothing_but_its_kernels_and_the_dtype_casts(hopper, monkeypatch):
    """The public op's segmented fwd+bwd on the kernel path, no initial state: beside the kernels only dbeta's
    cast back runs (wy_inverse writes beta's fp32 copy, which the backward reads). The chain starts from
    zero and the mirror scan reads the forward's exact mask itself (segment_chain's zero_start and f_r), so no
    fill, mask or index launch sits between the kernels (each a few us on a GPU: 6-8% of a one-sequence
    backward at (2, 4) x 8K, H100, docs/kernels.md, "Forty-second session")."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    args, cu = call([300, 1, 200], Hqk=2, Hv=4, with_h0=False, seed=8)
    leaves = [args[n].clone().requires_grad_(True) for n in NAMES]
    do = torch.randn(args["v"].shape).bfloat16()
    for _ in range(2):  # the second call: plan tensors and host checks cached, as in a training step
        with TorchOpsOutsideKernels() as forward:
            o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend="tilelang", intra_cp=2)
        with TorchOpsOutsideKernels() as backward:
            grads = torch.autograd.grad(o, leaves, do)
    assert forward.ops == [], forward.ops
    assert backward.ops == ["aten._to_copy.default"], backward.ops  # dbeta as bf16
    o_ref, _ = torch_forward(args, cu)
    assert rel_err(o, o_ref) <= TOL and all(g is not None for g in grads)


def test_mirror_scan_carries_the_final_state_gradient_out_of_a_last_segment_that_started_warm(hopper, monkeypatch):
    """The backward's mirror scan multiplies the final state's gradient by M^T out of a sequence's last segment
    whatever the warmup: the final state is S*_last + M_last S_{last,0}, so f = 1 there even where segment
    last - 1 decays enough for the last one to start warm (exact_last = 0; segment_chain.py's f_r). Here head 0
    decays strongly (g = -1 per token) in the middle segment of three only, and not at all in the last, so
    M_last^T dht carries the gradient of segment 1's inputs; with f = exact_last instead, dk, dv and dbeta
    lose it (0.08, 0.10 and 0.04 relative off, against 3e-3 here)."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    args, cu = call([64 * 6], Hqk=1, Hv=2, with_h0=False, seed=11)
    g = torch.zeros_like(args["g"])
    g[:, 128:256, 0] = -1.0  # head 0: segment 1 (chunks 2-3) sums to -128, far below cp_warmup = -10
    g[:, :, 1] = args["g"][:, :, 1]
    args["g"] = g
    gen = torch.Generator().manual_seed(12)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(1, 2, 128, 128, generator=gen)
    grads = {}
    for backend, intra_cp in (("tilelang", 2), ("torch", "off")):
        leaves = {n: args[n].clone().requires_grad_(True) for n in NAMES}
        o, ht = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True, backend=backend,
                                                intra_cp=intra_cp, cp_warmup=-10.0)
        torch.autograd.backward((o, ht), (do, dht))
        grads[backend] = [leaves[n].grad for n in NAMES]
    for name, a, b, limit in zip(NAMES, grads["tilelang"], grads["torch"], (1e-2, 1e-2, 1e-2, 2e-2, 2e-2)):
        assert rel_err(a, b) <= limit, (name, rel_err(a, b))


def test_plan_chunk_offsets_are_the_kernels_own():
    from flashqla.cp.segments import _plan_tensors
    from flashqla.cp.plan import plan_segments
    from flashqla.kernels.hopper.launch import chunk_offsets_of

    lengths = (300, 1, 0, 200, 64, 129)
    plan = plan_segments(tuple(random_cu_seqlens(lengths)[:-1].tolist()), lengths, 2)
    idx = _plan_tensors(plan, sum(lengths), torch.device("cpu"))
    assert torch.equal(idx.chunk_offsets, chunk_offsets_of(idx.cu))


def test_sequence_layout_is_the_kernels_own(monkeypatch):
    """backends.sequence_layout (the unsegmented path's cu_seqlens and chunk offsets, built on the host once
    per layout, the last MAX_SEQUENCE_LAYOUTS kept) holds what the kernels' host code computes on the device,
    empty and 1-token sequences too."""
    from flashqla.kernels.hopper.launch import chunk_offsets_of
    from flashqla.ops import backends, torch_backend

    monkeypatch.setattr(backends, "_SEQUENCE_LAYOUTS", type(backends._SEQUENCE_LAYOUTS)())

    for batch, lengths in ((1, (300, 1, 0, 200, 64, 129)), (1, (7,)), (3, (128, 128, 128))):
        cu = None if batch > 1 else random_cu_seqlens(lengths)
        plan = torch_backend.make_plan(batch, sum(lengths) // batch, None if cu is None else cu.tolist(), 0)
        got_cu, got_offsets = backends.sequence_layout(plan.starts, plan.lengths, torch.device("cpu"))
        want_cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        assert got_cu.dtype == torch.int32 and torch.equal(got_cu, want_cu)
        assert got_offsets.dtype == torch.int32 and torch.equal(got_offsets, chunk_offsets_of(want_cu))
        assert backends.sequence_layout(plan.starts, plan.lengths, torch.device("cpu"))[1] is got_offsets
    assert backends.sequence_layout((0,), (5,), torch.device("cpu"), build=False) is None
    cpu = torch.device("cpu")
    layouts = [backends.sequence_layout((0,), (n,), cpu) for n in range(backends.MAX_SEQUENCE_LAYOUTS + 1)]
    assert len(backends._SEQUENCE_LAYOUTS) == backends.MAX_SEQUENCE_LAYOUTS  # the oldest dropped
    assert backends.sequence_layout((0,), (0,), cpu, build=False) is None
    assert backends.sequence_layout((0,), (1,), cpu, build=False) is layouts[1]


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "capture_of_a_new_layout"])
@pytest.mark.parametrize("batch", [1, 2], ids=["varlen_int64", "batch_no_cu"])
def test_public_op_unsegmented_passes_its_layout_to_the_kernels(hopper, monkeypatch, batch, capturing):
    """The public op's unsegmented kernel path hands the kernels the plan's cu_seqlens and chunk offsets
    (int32, built once per layout), so neither the forward nor the backward computes chunk offsets on the
    device, for an int64 varlen pack and for a batch without cu_seqlens; while a CUDA graph is captured
    with a layout not built yet (no host-to-device copy allowed) the kernels get the call's own cu_seqlens
    and compute them as before. Gradients are the torch backend's either way."""
    import flashqla
    from flashqla.kernels.hopper import launch
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    monkeypatch.setattr(backends, "_SEQUENCE_LAYOUTS", type(backends._SEQUENCE_LAYOUTS)())
    monkeypatch.setattr(backends, "_capturing", lambda x: capturing)
    lengths = [200, 1, 129] if batch == 1 else [192, 192]
    args = make_inputs(batch, sum(lengths) // batch, 2, 4, 128, 128, dtype=torch.bfloat16,
                       num_seqs=len(lengths), with_h0=True, strong_heads=(3,), seed=21, requires_grad=False)
    cu = random_cu_seqlens(lengths).long() if batch == 1 else None
    computed = []
    real_offsets = launch.chunk_offsets_of
    monkeypatch.setattr(launch, "chunk_offsets_of", lambda c: computed.append(c) or real_offsets(c))
    gen = torch.Generator().manual_seed(22)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    names = NAMES + ("initial_state",)
    grads = {}
    for backend in ("tilelang", "torch"):
        leaves = {n: args[n].clone().requires_grad_(True) for n in names}
        o, _ = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend=backend, intra_cp="off")
        o.backward(do)
        grads[backend] = [leaves[n].grad for n in names]
        if backend == "tilelang":
            assert len(computed) == (2 if capturing else 0)  # the forward's and the backward's
            assert len(backends._SEQUENCE_LAYOUTS) == (0 if capturing else 1)
    for name, a, b, limit in zip(names, grads["tilelang"], grads["torch"], (1e-2, 1e-2, 1e-2, 2e-2, 2e-2, 1e-2)):
        assert rel_err(a, b) <= limit, (name, rel_err(a, b))


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("cp_warmup", [None, -10.0])
def test_passing_state_and_gradient_equal_the_whole_calls(hopper, monkeypatch, cp_warmup, fused):
    """Inter-card CP's own-prologue hand-offs on the segmented kernel path: the state a call passes on
    (`forward_passing_state`, before the walk) is the final state of its whole forward, and the gradient
    of the entering state (`backward_passing_gradient`, before the kernel backward) is the whole
    backward's dh0 with no final-state gradient; a g = 0 head (exact chain) and decaying heads (warmup).
    After the split walk the passed state is the walk's own to fp32 rounding (both read wy_inverse's W and
    U); after the fused walk (GA) the summaries form V' from GA, v and beta (chunk_states' GA form): then
    both states are the torch backend's to bf16 precision. The entering-state gradient (from the forward's
    kept transitions) is the whole backward's to bf16 precision: the backward's reverse walk reads W
    (rounded to bf16), which the forward's transitions read behind the split walk (wy_inverse's W) and do
    not behind the fused one."""
    from flashqla.cp import segments
    from flashqla.ops import backends, torch_backend

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call_: None)
    summaries = segments.forward_summaries
    monkeypatch.setattr(segments, "forward_summaries", lambda *a, **kw: summaries(*a, **{**kw, "fused": fused}))

    def assert_passed(S_end, final, passed_call, plan_chunks, seq):
        if not fused:
            assert rel_err(S_end, final) <= 1e-5, rel_err(S_end, final)
            return
        inputs = {n: getattr(passed_call, n) for n in NAMES + ("initial_state",)}
        ref = torch_forward(inputs, passed_call.cu_seqlens, plan_chunks, scale)[1][seq]
        assert rel_err(S_end, ref) <= TOL and rel_err(final, ref) <= TOL, (rel_err(S_end, ref), rel_err(final, ref))
    args, cu = call([64 * 7 + 5], Hqk=1, Hv=3, seed=9)
    args["g"][..., 0] = 0.0
    plan = torch_backend.make_plan(1, args["q"].shape[1], cu.tolist(), 2)  # 4 segments
    scale = 128 ** -0.5
    fresh = backends.Call(*(args[n] for n in NAMES), None, cu)
    S_end, walk = backends.forward_passing_state("tilelang", fresh, scale, plan, cp_warmup)
    o_split, final_split, kept = walk()
    o, final = backends.forward("tilelang", fresh, scale, True, plan, cp_warmup)
    assert torch.equal(final_split, final) and torch.equal(o_split, o)
    assert_passed(S_end, final[0], fresh, 2, 0)
    # with initial states, the last sequence one segment long (its start is its initial state itself)
    pack, pack_cu = call([300, 100], Hqk=1, Hv=3, seed=13)
    pack["g"][..., 0] = 0.0
    pack_plan = torch_backend.make_plan(1, 400, pack_cu.tolist(), 2)
    with_h0 = backends.Call(*(pack[n] for n in NAMES), pack["initial_state"], pack_cu)
    S_end, _ = backends.forward_passing_state("tilelang", with_h0, scale, pack_plan, cp_warmup)
    final = backends.forward("tilelang", with_h0, scale, True, pack_plan, cp_warmup)[1]
    assert_passed(S_end, final[-1], with_h0, 2, -1)

    entering = backends.Call(*(args[n] for n in NAMES), args["initial_state"], cu)
    _, _, kept = backends.forward("tilelang", entering, scale, False, plan, cp_warmup, for_backward=True)
    do = torch.randn(args["v"].shape, generator=torch.Generator().manual_seed(10)).bfloat16()
    D, finish = backends.backward_passing_gradient("tilelang", entering, scale, plan, cp_warmup, do, kept, False)
    *grads, dh0 = backends.backward("tilelang", entering, scale, plan, cp_warmup, do, None, kept)
    *grads_split, dh0_split = finish(None)
    assert rel_err(D, dh0[0]) <= TOL, rel_err(D, dh0[0])
    assert all(torch.equal(a, b) for a, b in zip(grads_split + [dh0_split], grads + [dh0]))


def test_wy_inverse_shares_k_over_as_much_of_a_gqa_group_as_leaves_whole_waves():
    """One CTA per (chunk, divisor of the GQA group) v-heads: the largest divisor above two that keeps 1.5 waves of
    CTAs at six CTAs per SM (1188 on an H200's 132 SMs), else a pair where it keeps one wave (792)."""
    from flashqla.kernels.hopper.launch import wy_heads_per_cta

    assert wy_heads_per_cta(520, 2, 8, 132) == 2  # 8 x 4K tokens: 1040 CTAs of 4 heads are 1.3 waves
    assert wy_heads_per_cta(1040, 2, 8, 132) == 4  # 8 x 8K tokens: 2080 CTAs of 4 heads
    assert wy_heads_per_cta(257, 2, 8, 132) == 2  # 16K tokens: 1028 CTAs of 2 heads, 1.3 waves, beat 2056 of 1
    assert wy_heads_per_cta(180, 2, 8, 132) == 1  # 720 CTAs of 2 heads would be under a wave
    assert wy_heads_per_cta(50, 2, 8, 132) == 1  # 3 x 1000 tokens
    assert wy_heads_per_cta(513, 8, 24, 132) == 3
    assert wy_heads_per_cta(513, 1, 6, 132) == 2  # 6 and 3 fail the waves (4 does not divide the group)
    assert wy_heads_per_cta(800, 1, 6, 132) == 3
    assert wy_heads_per_cta(10 ** 6, 16, 16, 132) == 1  # no GQA
    assert wy_heads_per_cta(10 ** 6, 1, 16, 132) == 8  # the shared build holds the gates of 8 v-heads at most
    assert wy_heads_per_cta(10 ** 6, 1, 12, 132) == 6


def test_prepare_launches_the_shared_k_build_with_a_gqa_group_per_cta_where_waves_allow(hopper, monkeypatch):
    """On a one-SM device 7 chunk slots x 8 v-heads leave waves enough for a whole group of 4 per CTA: prepare
    launches the shared-K build with 4 (the emulator refuses a count that splits a group, or more than one
    v-head per CTA on the other build); on 132 SMs the one-v-head build. GA and gcum are the same."""
    from flashqla.kernels.hopper import launch

    launched = []
    real = launch.compiled_wy_inverse
    monkeypatch.setattr(launch, "compiled_wy_inverse", lambda dtype, shared_k, copy_beta: lambda *a: launched.append(
        (shared_k, a[-1])) or real(dtype, shared_k, copy_beta)(*a))
    args, cu = call([130, 1, 64], Hqk=2, Hv=8, seed=15)
    inputs = [args[n] for n in NAMES]
    wide = launch.prepare(*inputs, cu)
    monkeypatch.setattr(launch, "_sm_count", lambda index: 1)
    shared = launch.prepare(*inputs, cu)
    assert launched == [(False, 1), (True, 4)]
    assert torch.equal(wide.GA, shared.GA) and torch.equal(wide.gcum, shared.gcum)


@pytest.mark.parametrize("beta_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_prepare_gives_wy_inverse_beta_as_its_build_reads_it(hopper, monkeypatch, beta_dtype):
    """bf16 q and k: beta in bf16 goes to wy_inverse's copy_beta build, which writes the fp32 beta the walks read
    (no conversion launch); fp32 beta to the fp32 build, the walks reading beta itself (no copy); beta in a third
    dtype is converted first. The emulator refuses a beta whose dtype the launched build does not take."""
    from flashqla.kernels.hopper import launch

    builds = []
    real = launch.compiled_wy_inverse
    monkeypatch.setattr(launch, "compiled_wy_inverse", lambda dtype, shared_k, copy_beta: builds.append(copy_beta)
                        or real(dtype, shared_k, copy_beta))
    args, cu = call([130, 1, 64], Hqk=2, Hv=4, seed=16)
    beta = args["beta"].to(beta_dtype)
    x = launch.prepare(args["q"], args["k"], args["v"], args["g"], beta, cu)
    assert builds == [beta_dtype == torch.bfloat16]
    assert x.beta.dtype == torch.float32 and torch.equal(x.beta, beta.reshape(x.beta.shape).float())
    assert (x.beta.data_ptr() == beta.data_ptr()) == (beta_dtype == torch.float32)
    kept = launch.prepare_from_kept(args["q"], args["k"], args["v"], x.kept(), cu)
    assert kept.beta is x.beta  # the backward reads the forward's fp32 beta


def test_the_backward_walks_go_side_by_side_only_where_one_walk_leaves_sms_idle(hopper, monkeypatch):
    """launch.walks_fill on an H200's 132 SMs: one walk at the narrowest V tile (32, four CTAs per sequence
    and v-head) needs 0.7 x 132 CTAs to fill the GPU; below that the backward runs its two walks on two
    streams."""
    from flashqla.kernels.hopper import launch

    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    h200 = torch.device("cuda", 0)
    assert not launch.walks_fill(h200, 1, 8) and not launch.walks_fill(h200, 1, 16)  # 32, 64 CTAs
    assert launch.walks_fill(h200, 1, 32) and launch.walks_fill(h200, 4, 8)  # 128 CTAs


@pytest.mark.parametrize("sm_count", [132, 4], ids=["narrow-walks", "wide-walks"])
@pytest.mark.parametrize("intra_cp", ["off", 2])
@pytest.mark.parametrize("keep", ["1", "0"], ids=["kept", "recomputed"])
def test_backward_reads_the_inverse_its_forward_kept(hopper, monkeypatch, intra_cp, keep, sm_count):
    """A forward whose backward will run keeps its GA and gates, and its backward runs no wy_inverse (with
    FLASHQLA_KEEP_INVERSE=0 it runs it again); either way the backward's states come from
    fused_fwd's state walk (no chunk_states) and the reverse walk reads GA (no kernel forms W), at narrow V
    tiles and where the walks fill the SMs (V tile 128), unsegmented and with intra-card segments (whose walk from zero stores no per-chunk dS), and the gradients
    are the torch backend's. Under no_grad nothing is kept."""
    import flashqla
    from flashqla.kernels.hopper import backward, launch
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    monkeypatch.setenv("FLASHQLA_KEEP_INVERSE", keep)
    monkeypatch.setattr(launch, "_sm_count", lambda index: sm_count)
    launches = []

    def spy(name, flags):
        real = getattr(launch, name)

        def compiled(*build_args):
            kernel = real(*build_args)
            return lambda *args: launches.append((name[len("compiled_"):],) + flags(build_args, args)) or kernel(*args)
        for module in (launch, backward):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, compiled)

    spy("compiled_wy_inverse", lambda build, args: ())
    spy("compiled_fused_fwd", lambda build, args: (args[-1],))  # store_states
    spy("compiled_chunk_states", lambda build, args: ())
    spy("compiled_chunk_dstates", lambda build, args: (args[-2], build[1]))  # store_dh, block_v
    kept_flags = []
    real_forward = backends.forward
    monkeypatch.setattr(backends, "forward", lambda *a, **kw: kept_flags.append(kw.get("keep_inverse"))
                        or real_forward(*a, **kw))
    args, cu = call([200, 1, 129, 300], Hqk=2, Hv=4, seed=13)
    gen = torch.Generator().manual_seed(14)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(args["initial_state"].shape, generator=gen) * 0.1
    names = NAMES + ("initial_state",)

    leaves = {n: args[n].clone().requires_grad_(True) for n in names}
    with torch.no_grad():
        flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)
    assert kept_flags == [False]
    grads = {}
    for backend, cp in (("tilelang", intra_cp), ("torch", "off")):
        leaves = {n: args[n].clone().requires_grad_(True) for n in names}
        o, ht = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True, backend=backend,
                                                intra_cp=cp)
        launches.clear()
        torch.autograd.backward((o, ht), (do, dht))
        grads[backend] = [leaves[n].grad for n in names]
        if backend == "tilelang":
            backward_launches = sorted(launches)
    assert kept_flags[1] == (keep == "1")
    recompute = [] if keep == "1" else [("wy_inverse",)]
    # the reverse walk stores every chunk's dS for the chunk-local kernel; the segments' walk from zero (D_j)
    # wants dS0 alone
    block_v = 32 if sm_count == 132 else 128  # 4 sequences x 4 heads (x 2 segments) against the SMs
    walks = [("chunk_dstates", 1, block_v)] + ([] if intra_cp == "off" else [("chunk_dstates", 0, block_v)])
    assert backward_launches == sorted(recompute + walks + [("fused_fwd", 1)]), backward_launches
    limits = (1e-2, 1e-2, 1e-2, 2e-2, 2e-2, 1e-2)
    for name, a, b, limit in zip(names, grads["tilelang"], grads["torch"], limits):
        assert rel_err(a, b) <= limit, (name, rel_err(a, b))


def _fused_walk_spy(monkeypatch):
    """Every fused_fwd launch's store_states (0: O, 1: the backward's state recompute, 2: O and the states),
    appended to the returned list."""
    from flashqla.kernels.hopper import launch

    modes = []
    real = launch.compiled_fused_fwd

    def compiled(*build_args):
        kernel = real(*build_args)
        return lambda *args: modes.append(args[-1]) or kernel(*args)
    monkeypatch.setattr(launch, "compiled_fused_fwd", compiled)
    return modes


@pytest.mark.parametrize("intra_cp", ["off", 2])
def test_a_forward_that_keeps_its_states_spares_the_backward_its_state_walk(hopper, monkeypatch, intra_cp):
    """keep_states=True: the forward's walk stores the state entering every chunk beside O (store_states 2) and
    the backward runs no state recompute; its gradients are those of keep_states=False (which recomputes them,
    store_states 1) bit for bit, and the torch backend's. With FLASHQLA_KEEP_INVERSE=0 nothing rides on the
    inverse, so nothing is kept."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    modes = _fused_walk_spy(monkeypatch)
    args, cu = call([200, 1, 129, 300], Hqk=2, Hv=4, seed=21)
    gen = torch.Generator().manual_seed(22)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(args["initial_state"].shape, generator=gen) * 0.1
    names = NAMES + ("initial_state",)

    def fwd_bwd(backend, keep_states):
        leaves = {n: args[n].clone().requires_grad_(True) for n in names}
        modes.clear()
        o, ht = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True, backend=backend,
                                                intra_cp=intra_cp if backend == "tilelang" else "off",
                                                keep_states=keep_states)
        forward_modes = list(modes)
        modes.clear()
        torch.autograd.backward((o, ht), (do, dht))
        return (o, ht), [leaves[n].grad for n in names], forward_modes, list(modes)

    out_kept, grads_kept, fwd_kept, bwd_kept = fwd_bwd("tilelang", True)
    out_walked, grads_walked, fwd_walked, bwd_walked = fwd_bwd("tilelang", False)
    assert (fwd_kept, bwd_kept) == ([2], [])
    assert (fwd_walked, bwd_walked) == ([0], [1])
    for a, b in zip(out_kept + tuple(grads_kept), out_walked + tuple(grads_walked)):
        assert torch.equal(a, b)
    _, grads_torch, _, _ = fwd_bwd("torch", True)
    limits = (1e-2, 1e-2, 1e-2, 2e-2, 2e-2, 1e-2)
    for name, a, b, limit in zip(names, grads_kept, grads_torch, limits):
        assert rel_err(a, b) <= limit, (name, rel_err(a, b))

    monkeypatch.setenv("FLASHQLA_KEEP_INVERSE", "0")
    assert fwd_bwd("tilelang", True)[2:] == ([0], [1])


@pytest.mark.parametrize("how", ["plain", "reentrant", "non-reentrant", "saved-tensor hooks"])
def test_keep_states_auto_keeps_them_only_in_a_reentrant_recompute(hopper, monkeypatch, how):
    """keep_states="auto" (the default) keeps the states where the forward runs inside a backward pass with no
    saved-tensor hooks, as reentrant activation checkpointing recomputes it (its backward follows at once): not
    in a plain forward, not under non-reentrant checkpointing (whose recompute's own Function is never
    differentiated) nor under other saved-tensor hooks (CPU offload)."""
    import flashqla
    from flashqla.ops import backends
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)
    modes = _fused_walk_spy(monkeypatch)
    args, cu = call([130, 70], Hqk=1, Hv=2, with_h0=False, seed=23)
    leaves = {n: args[n].clone().requires_grad_(True) for n in NAMES}

    def layer(q, k, v, g, beta):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="tilelang", intra_cp="off")[0]

    if how == "plain":
        o = layer(**leaves)
    elif how == "saved-tensor hooks":
        with torch.autograd.graph.save_on_cpu():
            o = layer(**leaves)
    else:
        o = checkpoint(layer, *(leaves[n] for n in NAMES), use_reentrant=how == "reentrant")
    o.float().square().sum().backward()
    # reentrant: the first forward runs without grad (nothing kept), the recompute keeps them for the backward
    expected = {"plain": [0, 1], "reentrant": [0, 2], "non-reentrant": [0, 0, 1], "saved-tensor hooks": [0, 1]}
    assert modes == expected[how]


@pytest.mark.parametrize("setting, modes", [("1", [2]), ("on", [2]), ("0", [0, 1]), ("auto", [0, 1])])
def test_keep_states_auto_follows_the_environment_where_set(hopper, monkeypatch, setting, modes):
    """FLASHQLA_KEEP_STATES=1 (0) makes the default "auto" keep (not keep) the states in a plain forward, for
    frameworks whose layers call the op themselves; "auto" leaves the recompute detection; anything else raises,
    naming the variable. An explicit keep_states=False is not overridden."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)
    modes_seen = _fused_walk_spy(monkeypatch)
    args, cu = call([130, 70], Hqk=1, Hv=2, with_h0=False, seed=24)

    def fwd_bwd(**kw):
        leaves = {n: args[n].clone().requires_grad_(True) for n in NAMES}
        modes_seen.clear()
        o, _ = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend="tilelang", intra_cp="off", **kw)
        o.float().sum().backward()
        return list(modes_seen)

    monkeypatch.setenv("FLASHQLA_KEEP_STATES", setting)
    assert fwd_bwd() == modes
    assert fwd_bwd(keep_states=False) == [0, 1]
    monkeypatch.setenv("FLASHQLA_KEEP_STATES", "sometimes")
    with pytest.raises(ValueError, match="FLASHQLA_KEEP_STATES"):
        fwd_bwd()


@pytest.mark.parametrize("value, error", [("yes", ValueError), (1, TypeError), (None, TypeError)])
def test_keep_states_must_be_auto_true_or_false(value, error):
    import flashqla

    args, _ = call([64], Hqk=1, Hv=1, with_h0=False)
    with pytest.raises(error, match="keep_states"):
        flashqla.chunk_gated_delta_rule(*(args[n] for n in NAMES), keep_states=value)


@pytest.mark.parametrize("intra_cp", ["off", 2])
def test_what_the_forward_keeps_goes_through_saved_tensor_hooks(hopper, monkeypatch, intra_cp):
    """The kept WY inverse (GA [T, Hv, 64], the gates), the segments' starts and the kept states are saved with
    save_for_backward, not held on the autograd context: saved-tensor hooks see every one of them (CPU offload
    moves them, non-reentrant checkpointing drops them after the forward), nothing tensor-valued is left on the
    node, and the backward's gradients through the hooks are those without hooks, bit for bit."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)
    args, cu = call([200, 1, 129, 300], Hqk=2, Hv=4, seed=25)
    T, Hv = args["v"].shape[1], args["v"].shape[2]
    gen = torch.Generator().manual_seed(26)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    names = NAMES + ("initial_state",)

    def fwd_bwd(hooks, keep_states):
        leaves = {n: args[n].clone().requires_grad_(True) for n in names}
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t.clone()  # a copy, as an offload hook hands back
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hooks else contextlib.nullcontext():
            o, _ = flashqla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp,
                                                   keep_states=keep_states)
        held = [name for name, value in vars(o.grad_fn).items() if _holds_tensor(value)]
        o.backward(do)
        return packed, held, [leaves[n].grad for n in names]

    states_shaped = lambda packed: sorted(s for s in packed if len(s) == 4 and s[1:] == (Hv, 128, 128))  # noqa: E731
    walked = fwd_bwd(hooks=True, keep_states=False)
    kept = fwd_bwd(hooks=True, keep_states=True)
    for packed, held, grads in (walked, kept):
        assert held == []
        assert (T, Hv, 64) in packed and (Hv, T) in packed  # GA and the cumulative gates
        for a, b in zip(grads, fwd_bwd(hooks=False, keep_states=False)[2]):
            assert torch.equal(a, b)
    # the kept states ([chunk slots, Hv, 128, 128]) on top of h0 (and, segmented, S_{j,0} and M)
    extra = list(states_shaped(kept[0]))
    for shape in states_shaped(walked[0]):
        extra.remove(shape)
    assert len(extra) == 1 and extra[0][0] > args["initial_state"].shape[0], extra


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return (hasattr(value, "__dataclass_fields__") and not isinstance(value, type)
            and any(_holds_tensor(getattr(value, f)) for f in value.__dataclass_fields__))


@pytest.mark.parametrize("intra_cp", ["off", 2])
def test_non_reentrant_checkpointing_recomputes_what_the_forward_keeps(hopper, monkeypatch, intra_cp):
    """Under torch.utils.checkpoint(use_reentrant=False) the kept tensors are dropped after the forward and come
    back from the recompute (its saved tensors match the forward's in number and metadata, or checkpointing
    would raise), and the gradients are those of the plain run, bit for bit; FLASHQLA_KEEP_STATES=1 keeps the
    states in both forwards alike."""
    import flashqla
    from flashqla.ops import backends
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)
    args, cu = call([200, 1, 129, 300], Hqk=2, Hv=4, with_h0=False, seed=27)
    gen = torch.Generator().manual_seed(28)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()

    def op(q, k, v, g, beta):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="tilelang",
                                               intra_cp=intra_cp)[0]

    def grads(checkpointed):
        leaves = [args[n].clone().requires_grad_(True) for n in NAMES]
        o = checkpoint(op, *leaves, use_reentrant=False) if checkpointed else op(*leaves)
        o.backward(do)
        return [leaf.grad for leaf in leaves]

    plain = grads(False)
    for setting in ("auto", "1"):
        monkeypatch.setenv("FLASHQLA_KEEP_STATES", setting)
        for a, b in zip(grads(True), plain):
            assert torch.equal(a, b)
