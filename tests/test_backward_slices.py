"""The kernel backward in slices of sequences (kernels/hopper/backward.py, `row_slices`): above a budget of h and dh
(the per-chunk states and their gradients, 1 KB per token and v-head) the backward takes consecutive rows in turn.
On the CPU with the kernels emulated (tests/kernel_emulator.py): the slices' gradients are the same bits as one
pass's on every path (plain, intra-card segments with their deferred exit gradients, kept states, GQA pair sums and
group sums), and the peak holds one slice's h and dh instead of all of them."""
import pytest
import torch

import kernel_emulator
from gdn_inputs import make_inputs, random_cu_seqlens
from test_backward_memory import PeakStorage

pytest.importorskip("tilelang")

NAMES = ("q", "k", "v", "g", "beta")
GIB = 2 ** 30


def test_row_slices_hold_whole_waves_within_the_budget():
    from flashqla.kernels.hopper.backward import row_slices

    assert row_slices([8] * 6, 100, float("inf"), 1) == [(0, 6)]
    assert row_slices([8] * 6, 100, 4800, 1) == [(0, 6)]  # exactly the budget: one pass
    assert row_slices([8] * 6, 100, 4799, 1) == [(0, 5), (5, 6)]  # rows taken in order while they fit
    assert row_slices([8] * 6, 100, 1600, 1) == [(0, 2), (2, 4), (4, 6)]
    assert row_slices([8] * 6, 100, 1, 1) == [(r, r + 1) for r in range(6)]  # a row over the budget: alone
    # whole waves of rows (2 rows a wave here), as many as fit, one at least
    assert row_slices([8] * 6, 100, 1, 2) == [(0, 2), (2, 4), (4, 6)]
    assert row_slices([8] * 6, 100, 3200, 2) == [(0, 4), (4, 6)]
    assert row_slices([8] * 6, 100, 3199, 2) == [(0, 2), (2, 4), (4, 6)]
    assert row_slices([8] * 7, 100, 1600, 2) == [(0, 2), (2, 4), (4, 6), (6, 7)]  # the last wave is partial
    assert row_slices([8] * 6, 100, 1, 4) == [(0, 4), (4, 6)]
    assert row_slices([8] * 6, 100, 1, 6) == [(0, 6)]  # one wave in all: nothing to slice
    # 1M tokens x 32 v-heads in segments of 512 chunks on 132 SMs: 4 rows a wave, 4 GiB of h and dh each; a 5 GiB
    # budget holds one wave a slice (eight slices of 128 walks), 8.8 GiB two (four of 256)
    per_chunk = 2 * 32 * 128 * 128 * 2
    assert row_slices([512] * 32, per_chunk, 5 * GIB, 132 // 32) == [(r, r + 4) for r in range(0, 32, 4)]
    assert row_slices([512] * 32, per_chunk, 8.8 * GIB, 132 // 32) == [(r, r + 8) for r in range(0, 32, 8)]
    # unequal rows, one a wave: in order while they fit (12 chunks)
    assert row_slices([10, 1, 1, 4, 8], 1, 12, 1) == [(0, 3), (3, 5)]
    assert row_slices([1, 1, 1, 1, 20], 1, 8, 1) == [(0, 4), (4, 5)]
    assert row_slices([20, 1, 1, 1, 1], 1, 8, 1) == [(0, 1), (1, 5)]
    # rows without a chunk (empty sequences) join a neighbour: no slice of zero tokens
    assert row_slices([0, 0, 3], 1, 1, 1) == [(0, 3)]
    assert row_slices([0, 0], 1, 1e-9, 1) == [(0, 2)]  # no chunk at all
    assert row_slices([16384, 0, 0, 0, 0], per_chunk, 5 * GIB, 4) == [(0, 5)]
    assert row_slices([0] * 4 + [16384], per_chunk, 5 * GIB, 4) == [(0, 5)]
    assert row_slices([2048] * 8 + [0] * 4, per_chunk, 5 * GIB, 4) == [(0, 4), (4, 12)]
    assert row_slices([3, 0, 3, 0, 3], 1, 3, 1) == [(0, 2), (2, 4), (4, 5)]


@pytest.fixture
def hopper(monkeypatch):
    kernel_emulator.install(monkeypatch)
    from flashqla.kernels import hopper

    return hopper


def launches_of_chunk_bwd_local(monkeypatch):
    """The token count of every chunk_bwd_local launch, in order."""
    from flashqla.kernels.hopper import backward

    seen = []
    build = backward.compiled_chunk_bwd_local

    def spy(*build_args):
        kernel = build(*build_args)
        return lambda *a: seen.append(a[0].shape[0]) or kernel(*a)
    monkeypatch.setattr(backward, "compiled_chunk_bwd_local", spy)
    return seen


def assert_same_bits(got, want):
    for name, a, b in zip(NAMES + ("initial_state",), got, want):
        if b is None:
            assert a is None, name
        else:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


@pytest.mark.parametrize("Hqk,Hv", [(2, 4), (1, 4), (2, 6)], ids=["pairs", "pairs+group_sum", "group_sum"])
def test_sliced_backward_is_the_same_bits_as_one_pass(hopper, monkeypatch, Hqk, Hv):
    """chunk_gdn_bwd over a pack of 1- to 200-token sequences (partial chunks, a one-token row at a slice's edge),
    initial states and dht: with a budget of about two rows' states the pack runs in slices of whole rows, and
    every gradient, dS0 included, equals one pass's."""
    lengths = [0, 200, 1, 65, 130, 0, 64, 7, 129, 0]  # empty sequences at both ends and inside
    args = make_inputs(1, sum(lengths), Hqk, Hv, 128, 128, dtype=torch.bfloat16, num_seqs=len(lengths), with_h0=True,
                       strong_heads=(Hv - 1,), seed=5, requires_grad=False)
    cu = random_cu_seqlens(lengths)
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(args["initial_state"].shape, generator=gen) * 0.1
    case = ([args[n] for n in NAMES], 0.25, args["initial_state"], cu, do, dht)
    launched = launches_of_chunk_bwd_local(monkeypatch)
    whole = hopper.chunk_gdn_bwd(*case[0], *case[1:])
    assert launched == [sum(lengths)]  # no bounds: one pass

    bounds = tuple(cu.tolist())
    # chunks [0, 4, 1, 2, 3, 0, 1, 1, 3, 0]: with 4 chunks' h and dh, rows in order while they fit, the empty ones
    # with their neighbours
    monkeypatch.setenv("FLASHQLA_BWD_STATES_GIB", str(4 * 2 * Hv * 128 * 128 * 2 / GIB))
    launched.clear()
    sliced = hopper.chunk_gdn_bwd(*case[0], *case[1:], row_bounds=bounds)
    assert launched == [200, 1 + 65, 130 + 64, 7 + 129], launched
    assert_same_bits(sliced, whole)

    monkeypatch.setenv("FLASHQLA_BWD_STATES_GIB", "1e-9")  # a row a slice (an empty one with a neighbour)
    launched.clear()
    assert_same_bits(hopper.chunk_gdn_bwd(*case[0], *case[1:], row_bounds=bounds), whole)
    assert launched == [n for n in lengths if n], launched
    with pytest.raises(ValueError, match="row_bounds"):
        hopper.chunk_gdn_bwd(*case[0], *case[1:], row_bounds=bounds[:-1])


@pytest.mark.parametrize("keep_states", [False, True], ids=["recomputed", "kept_states"])
def test_sliced_segmented_backward_is_the_same_bits(hopper, monkeypatch, keep_states):
    """Intra-card segments (3 chunks each) of a pack with initial states: the mirror scan's exit gradients (a
    deferred dht, computed beside the first slice's state recompute) and the kept per-chunk states are sliced with
    the rows; every gradient equals one pass's."""
    from flashqla.ops import backends, torch_backend

    lengths, Hqk, Hv = [700, 1, 329], 2, 4
    args = make_inputs(1, sum(lengths), Hqk, Hv, 128, 128, dtype=torch.bfloat16, num_seqs=len(lengths), with_h0=True,
                       strong_heads=(Hv - 1,), seed=11, requires_grad=False)
    cu = random_cu_seqlens(lengths)
    plan = torch_backend.make_plan(1, sum(lengths), cu.tolist(), 3)
    assert plan.is_segmented and len(plan.starts) == 7
    gen = torch.Generator().manual_seed(12)
    do = torch.randn(args["v"].shape, generator=gen).bfloat16()
    dht = torch.randn(len(lengths), Hv, 128, 128, generator=gen) * 0.1
    call = backends.Call(*(args[n] for n in NAMES), args["initial_state"], cu)
    launched = launches_of_chunk_bwd_local(monkeypatch)

    def gradients():
        *_, kept = backends.forward("tilelang", call, 0.25, True, plan, -10.0, for_backward=True, keep_inverse=True,
                                    keep_states=keep_states)
        assert (kept.inverse.states is not None) == keep_states
        return backends.backward("tilelang", call, 0.25, plan, -10.0, do, dht, kept=kept)

    whole = gradients()
    assert launched == [sum(lengths)]
    monkeypatch.setenv("FLASHQLA_BWD_STATES_GIB", str(4 * 2 * Hv * 128 * 128 * 2 / GIB))  # 4 chunks' h and dh
    launched.clear()
    sliced = gradients()
    assert len(launched) > 2 and sum(launched) == sum(lengths), launched
    assert_same_bits(sliced, whole)


def test_sliced_backward_holds_one_slice_of_states(hopper, monkeypatch):
    """The backward's peak (tests/test_backward_memory.py's count) drops by the states of the rows a slice does not
    hold: 8 sequences of 4 chunks in 4 slices hold 2 sequences' h and dh at a time."""
    import flashqla
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU
    Hv, e, lengths = 2, 2, [256] * 8
    args = make_inputs(1, sum(lengths), 1, Hv, 128, 128, dtype=torch.bfloat16, num_seqs=len(lengths), seed=3)
    cu = random_cu_seqlens(lengths)
    per_chunk = 2 * Hv * 128 * 128 * e  # h and dh
    peaks = []
    for budget in (None, 8 * per_chunk):
        if budget is not None:
            monkeypatch.setenv("FLASHQLA_BWD_STATES_GIB", str(budget / GIB))
        o, _ = flashqla.chunk_gated_delta_rule(**args, cu_seqlens=cu, backend="tilelang", intra_cp="off")
        with PeakStorage() as memory:
            o.backward(torch.ones_like(o))
        peaks.append(memory.peak)
    whole_states = per_chunk * (sum(lengths) // 64 + len(lengths))  # one pass: a slot per chunk and per sequence
    slice_states = per_chunk * 8  # two sequences' chunks exactly
    # a slice adds its own dg and copy of the gates ([Hv, T] is not contiguous in a slice of tokens: 2 x 4 bytes per
    # token and v-head), its dS0 (64 KiB per sequence and head) and its rebased cu_seqlens and chunk offsets
    extra = 2 * 4 * 512 * Hv + 2 * Hv * 128 * 128 * 4 + 2 * 3 * 4
    assert peaks[0] - whole_states + slice_states <= peaks[1] <= peaks[0] - whole_states + slice_states + extra, peaks
