"""A training step's GDN call captured in a CUDA graph (skips without SM90).

Megatron's CUDA-graph mode and torch.compile's cudagraphs replay the forward and backward of every layer:
nothing in flashqla's call may synchronise with the host or allocate outside the graph's pool once the
shapes are known (the AutoCP plan is cached from the first call by cu_seqlens' identity). The test warms
the call up, captures forward + backward on a side stream, then copies new inputs into the captured
buffers, replays, and compares outputs and every gradient with an eager call on those inputs: they must
be identical up to the order of floating-point sums (the same kernels run).
"""
import pytest
import torch

import flashqla
from test_tilelang_backward import NAMES
from test_tilelang_forward import D, make_call, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")


def step(leaves, cu_seqlens, do, dht, intra_cp):
    o, ht = flashqla.chunk_gated_delta_rule(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
        output_final_state=True, cu_seqlens=cu_seqlens, backend="tilelang", intra_cp=intra_cp)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    return o, ht


# a pack with a one-token sequence (3 sequences x 8 v-heads: one walk fills an H200), 4-chunk segments when
# forced; one 3000-token sequence x 8 v-heads, whose backward runs its two walks on two streams
PACKS = {"pack": [700, 1, 2395], "one sequence": [3000]}


@pytest.mark.parametrize("lengths", PACKS.values(), ids=PACKS.keys())
@pytest.mark.parametrize("intra_cp", ["off", 4])
@pytest.mark.parametrize("sums", [{}, {"FLASHQLA_GQA_PAIR_SUM": "0"}], ids=["pair_ordered", "pair_none"])
def test_forward_and_backward_replay_from_a_cuda_graph(intra_cp, lengths, sums, monkeypatch):
    """(sums: the backward's GQA sums at 4 v-heads per k-head: by pairs inside chunk_bwd_local, then the GQA sum
    kernel, or by the GQA sum kernel alone.)"""
    for env, value in sums.items():
        monkeypatch.setenv(env, value)
    call = make_call(lengths, 2, 8)
    cu = call["cu_seqlens"]
    N = len(lengths)
    static = {n: call[n].detach().clone().requires_grad_(True) for n in NAMES}
    gen = torch.Generator(device="cuda").manual_seed(5)
    do = torch.randn(call["v"].shape, generator=gen, device="cuda")
    dht = torch.randn(N, 8, D, D, generator=gen, device="cuda") * 0.1

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: kernels load, the plan is cached
            step(static, cu, do, dht, intra_cp)
            for leaf in static.values():
                leaf.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, ht_static = step(static, cu, do, dht, intra_cp)

    fresh = make_call(lengths, 2, 8, seed=1)  # new values into the captured buffers
    with torch.no_grad():
        for n in NAMES:
            static[n].copy_(fresh[n])
    graph.replay()
    torch.cuda.synchronize()

    eager = {n: fresh[n].detach().clone().requires_grad_(True) for n in NAMES}
    o_eager, ht_eager = step(eager, cu, do, dht, intra_cp)
    assert rel_err(o_static, o_eager) < 1e-6 and rel_err(ht_static, ht_eager) < 1e-6
    for n in NAMES:
        assert rel_err(static[n].grad, eager[n].grad) < 1e-6, n


def test_the_backward_walks_on_two_streams_equal_one_stream(monkeypatch):
    """Where one walk leaves SMs idle the backward runs its two walks side by side on two streams
    (kernels/hopper/backward.py); the gradients are the one-stream ones, bit for bit."""
    from flashqla.kernels.hopper import backward, launch

    call = make_call([3000], 2, 8, seed=2)
    assert not launch.walks_fill(call["q"].device, 1, 8)
    gen = torch.Generator(device="cuda").manual_seed(6)
    do = torch.randn(call["v"].shape, generator=gen, device="cuda")
    dht = torch.randn(1, 8, D, D, generator=gen, device="cuda") * 0.1

    def grads():
        leaves = {n: call[n].detach().clone().requires_grad_(True) for n in NAMES}
        step(leaves, call["cu_seqlens"], do, dht, "off")
        return [leaves[n].grad for n in NAMES]

    two_streams = grads()
    monkeypatch.setattr(backward, "side_by_side", lambda device, side, main: (side(), main()))
    one_stream = grads()
    assert all(torch.equal(a, b) for a, b in zip(two_streams, one_stream))


def test_the_state_recompute_beside_the_mirror_scan_equals_it_in_turn(monkeypatch):
    """A segmented backward recomputes the per-chunk states on a second stream while the mirror scan and the
    reverse walk run on the current one (kernels/hopper/backward.py, FLASHQLA_STATES_BESIDE_CHAIN); the
    gradients, through a given final-state gradient too, are those of the three run in turn, bit for bit."""
    call = make_call([3000, 1, 700], 2, 8, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(call["v"].shape, generator=gen, device="cuda")
    dht = torch.randn(3, 8, D, D, generator=gen, device="cuda") * 0.1

    def grads():
        leaves = {n: call[n].detach().clone().requires_grad_(True) for n in NAMES}
        step(leaves, call["cu_seqlens"], do, dht, 4)
        return [leaves[n].grad for n in NAMES]

    beside = grads()
    monkeypatch.setenv("FLASHQLA_STATES_BESIDE_CHAIN", "0")
    in_turn = grads()
    assert all(torch.equal(a, b) for a, b in zip(beside, in_turn))
