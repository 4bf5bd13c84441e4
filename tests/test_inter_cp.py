"""Inter-card CP on gloo (CPU, torch backend): every rank's outputs and gradients equal the
single-process run on the whole stream."""
import pytest
import torch
import torch.distributed as dist

import flashqla
from flashqla.cp import build_cp_context
from gdn_inputs import make_inputs, random_cu_seqlens, rel_err
from multiprocess import run_on_ranks

NAMES = ("q", "k", "v", "g", "beta")


def rank_tokens(layout, world, rank, lengths):
    """Global token indices this rank holds, in local order (written independently of flashqla.cp)."""
    total = sum(lengths)
    if layout == "contiguous":
        part = total // world
        return torch.arange(rank * part, (rank + 1) * part)
    if layout == "zigzag":
        part = total // (2 * world)
        return torch.cat([torch.arange(rank * part, (rank + 1) * part),
                          torch.arange((2 * world - 1 - rank) * part, (2 * world - rank) * part)])
    pieces, start = [], 0
    for n in lengths:  # zigzag_per_sequence: chunks r and 2W-1-r of every sequence
        part = n // (2 * world)
        for i in (rank, 2 * world - 1 - rank):
            pieces.append(torch.arange(start + i * part, start + (i + 1) * part))
        start += n
    return torch.cat(pieces)


def _cp_equals_single_process(rank, world, lengths, layout, intra_cp, heads, dtype, limit):
    Hqk, Hv = heads
    total = sum(lengths)
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, total, Hqk, Hv, 16, 16, dtype=dtype, zero_heads=(0,), strong_heads=(Hv - 1,), seed=17)
    do = torch.randn(1, total, Hv, 16, generator=torch.Generator().manual_seed(5), dtype=dtype)
    o_ref, _ = flashqla.chunk_gated_delta_rule(**args, cu_seqlens=cu, backend="torch")
    ref_grads = torch.autograd.grad((o_ref * do).sum(), [args[n] for n in NAMES])

    mine = rank_tokens(layout, world, rank, lengths)
    local = {n: args[n].detach()[:, mine].clone().requires_grad_(True) for n in NAMES}
    ctx = build_cp_context(cu, group=dist.group.WORLD, layout=layout)
    o, ht = flashqla.chunk_gated_delta_rule(**local, cp_context=ctx, backend="torch", intra_cp=intra_cp, cp_warmup=None)
    assert ht is None
    grads = torch.autograd.grad((o * do[:, mine]).sum(), [local[n] for n in NAMES])
    errors = {"o": rel_err(o, o_ref[:, mine])}
    errors.update({"d" + n: rel_err(gr, ref[:, mine]) for n, gr, ref in zip(NAMES, grads, ref_grads)})
    bad = {n: e for n, e in errors.items() if e > limit}
    assert not bad, f"rank {rank}/{world} ({layout}): {bad}"


CASES = {
    # one sequence over every rank; packs crossing 0, 1 and several boundaries; a 1-token sequence
    # at a boundary and one shorter than a chunk
    "one_sequence_spans_all_ranks": [384],
    "pack_crossing_boundaries": [100, 1, 150, 3, 130],
    "boundary_exact_and_tiny": [96, 96, 1, 47, 144],
}
# (world sizes, lengths, layout, intra_cp, (Hqk, Hv), dtype, limit); one process group per world size
# runs all of its cases, since starting ranks costs far more than the cases themselves
RUNS = [((2, 3, 4), CASES[c], "contiguous", "off", (2, 4), torch.float32, 1e-5) for c in sorted(CASES)] + [
    ((2, 3), [100, 1, 150, 3, 130], "zigzag", "off", (1, 2), torch.float32, 1e-5),  # true token order
    ((2,), [384, 200, 184], "contiguous", 1, (2, 4), torch.float32, 1e-5),  # with intra-card segments
    ((4,), [50, 300, 34], "zigzag", 2, (1, 2), torch.float64, 1e-12),  # fp64: exact to rounding
    ((2,), [4, 260, 140], "zigzag_per_sequence", "off", (2, 4), torch.float32, 1e-5),  # Megatron's THD order
    ((3,), [6, 390, 72], "zigzag_per_sequence", 1, (1, 2), torch.float32, 1e-5),
]


def _all_cases(rank, world):
    for worlds, *case in RUNS:
        if world in worlds:
            _cp_equals_single_process(rank, world, *case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_equals_single_process_for_spanning_crossing_and_tiny_sequences(world):
    run_on_ranks(world, _all_cases)


def _errors_raise_on_every_rank(rank, world):
    # contexts built from different global offsets
    lengths = [64, 64] if rank == 0 else [32, 96]
    with pytest.raises(ValueError, match="disagree"):
        build_cp_context(random_cu_seqlens(lengths), group=dist.group.WORLD)
    # a stream that does not split evenly
    with pytest.raises(ValueError, match="equal parts"):
        build_cp_context(random_cu_seqlens([63]), group=dist.group.WORLD)
    with pytest.raises(ValueError, match="divisible by 4"):
        build_cp_context(random_cu_seqlens([64, 6]), group=dist.group.WORLD, layout="zigzag_per_sequence")
    # a wrong local length on rank 1 only: both ranks raise instead of rank 0 waiting in a collective
    ctx = build_cp_context(random_cu_seqlens([128]), group=dist.group.WORLD)
    # FLA 0.6.0's positional order (cu_seqlens, group, conv1d_kernel_size, cu_seqlens_cpu) builds the same
    fla_style = build_cp_context(random_cu_seqlens([128]), dist.group.WORLD, 4, random_cu_seqlens([128]))
    assert fla_style.local_bounds == ctx.local_bounds and fla_style.conv1d_kernel_size == 4
    args = make_inputs(1, 64 if rank == 0 else 63, 1, 1, 16, 16, requires_grad=False)
    with pytest.raises(ValueError, match="rank 1|another rank"):
        flashqla.chunk_gated_delta_rule(**args, cp_context=ctx)
    # initial_state is not supported with cp_context, on any rank
    args = make_inputs(1, 64, 1, 1, 16, 16, requires_grad=False, with_h0=True)
    with pytest.raises(ValueError, match="initial_state"):
        flashqla.chunk_gated_delta_rule(**args, cp_context=ctx)
    # an FLA option flashqla refuses, on rank 0 only
    args = make_inputs(1, 64, 1, 1, 16, 16, requires_grad=False)
    with pytest.raises(ValueError, match="chunk_size|another rank"):
        flashqla.chunk_gated_delta_rule(**args, cp_context=ctx, chunk_size=32 if rank == 0 else 64)


@pytest.mark.multiprocess
def test_mismatched_contexts_and_bad_calls_raise_on_every_rank_instead_of_hanging():
    run_on_ranks(2, _errors_raise_on_every_rank)


def _kernel_like_local_forward(rank, world):
    """The TileLang kernels know only cu_seqlens and initial_state (no segmentation plan): run the
    local forward through such a stand-in and check CP still equals the single-process run."""
    from flashqla.ops import backends, torch_backend

    def whole_sequence_forward(name, call, scale, output_final_state, plan, cp_warmup, for_backward=False,
                               keep_inverse=False, keep_states=False):
        c = call
        bounds = None if c.cu_seqlens is None else c.cu_seqlens.tolist()
        own_plan = torch_backend.make_plan(c.q.shape[0], c.q.shape[1], bounds, 0)
        out = torch_backend.forward(c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, output_final_state, own_plan)
        return (*out, None) if for_backward else out

    backends.forward = whole_sequence_forward
    _cp_equals_single_process(rank, world, [100, 1, 150, 3, 130], "contiguous", "off", (1, 2), torch.float32, 1e-5)


@pytest.mark.multiprocess
def test_local_forward_gets_the_local_offsets_like_a_kernel_needs():
    run_on_ranks(2, _kernel_like_local_forward)
