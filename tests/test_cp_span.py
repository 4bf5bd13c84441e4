"""Inter-card CP span summaries (flashqla/cp/span.py): segmented summaries and entering-state gradients equal
one walk over the span, and the warmup across ranks stays within its bound and is really taken."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashqla
from flashqla.cp import build_cp_context, span
from flashqla.ops import backends
from gdn_inputs import make_inputs, rel_err, random_cu_seqlens
from multiprocess import run_on_ranks

NAMES = ("q", "k", "v", "g", "beta")


def span_inputs(T, dtype, seed=0, Hqk=2, Hv=4, D=16):
    args = make_inputs(1, T, Hqk, Hv, D, D, dtype=dtype, zero_heads=(0,), strong_heads=(Hv - 1,), seed=seed,
                       requires_grad=False)
    do = torch.randn(1, T, Hv, D, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return [args[n] for n in NAMES], do


@pytest.mark.parametrize("dtype,limit", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("T,segment_chunks", [(337, 2), (256, 1), (130, 1), (100, 4)],
                         ids=["3_segments_partial_chunk", "4_whole_segments", "2_token_last_segment", "one_segment"])
def test_segmented_span_summary_and_gradient_equal_one_walk(T, segment_chunks, dtype, limit):
    inputs, do = span_inputs(T, dtype, seed=T)
    S_ref, M_ref = (x[0] for x in backends.summary("torch", *inputs, True))
    D_ref = backends.entering_state_gradient("torch", *inputs, 0.25, do)[0]
    S, M = span.span_summary("torch", *inputs, True, segment_chunks, None)
    D = span.span_entering_gradient("torch", *inputs, 0.25, do, segment_chunks, None)
    assert S.dtype == M.dtype == D.dtype == dtype
    errors = {"S*": rel_err(S, S_ref), "M": rel_err(M, M_ref), "D": rel_err(D, D_ref)}
    assert all(e <= limit for e in errors.values()), errors
    S_only, M_none = span.span_summary("torch", *inputs, False, segment_chunks, None)  # not spanning: no M
    assert M_none is None and rel_err(S_only, S_ref) <= limit


def test_fold_composes_pieces_in_order():
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(5, 2, 3, 4, generator=gen, dtype=torch.float64)
    mats = torch.randn(5, 2, 3, 3, generator=gen, dtype=torch.float64)
    S, M = states[0], mats[0]  # 5 pieces: an odd one is carried over in the first two rounds
    for j in range(1, 5):
        S, M = mats[j] @ S + states[j], mats[j] @ M
    S_fold, M_fold = span.fold(states, mats)
    assert rel_err(S_fold, S) <= 1e-14 and rel_err(M_fold, M) <= 1e-14


def test_warm_chunks_counts_the_fewest_chunks_that_decay_past_the_threshold():
    per_chunk = torch.tensor([[-1.0, -8.0], [-4.0, -1.0], [-6.0, -1.5], [-5.0, -9.0]])  # [chunks, heads]
    g = per_chunk.repeat_interleave(64, 0)[:-30] / 64  # the last chunk is partial: 34 tokens
    g[-34:] = per_chunk[-1] / 34
    cumulative = span.cumulative_chunk_decay(g[None])
    assert cumulative.shape == (5, 2) and torch.allclose(cumulative[1:], per_chunk.double().cumsum(0))
    assert span.warm_chunks(cumulative, -10.0, from_end=True) == 2  # last two: -11, -10.5
    assert span.warm_chunks(cumulative, -10.0, from_end=False) == 3  # first three: -11, -10.5
    assert span.warm_chunks(cumulative, -20.0, from_end=True) is None  # head 0 sums to -16 only
    assert span.warm_chunks(cumulative, -15.5, from_end=True) is None  # only all 4 chunks decay that much
    assert span.warm_chunks(cumulative, None, from_end=True) is None
    no_decay = cumulative.clone()
    no_decay[:, 1] = 0.0  # a g = 0 head: the whole span takes the exact path
    assert span.warm_chunks(no_decay, -10.0, from_end=False) is None


def test_span_summaries_on_the_kernel_path_match_the_torch_path(monkeypatch):
    """backend "tilelang" on the emulated kernels (tests/kernel_emulator.py): the segments go to the kernels
    as one varlen batch, as cu_seqlens."""
    pytest.importorskip("tilelang")
    import kernel_emulator

    kernel_emulator.install(monkeypatch)
    args = make_inputs(1, 300, 1, 2, 128, 128, dtype=torch.bfloat16, strong_heads=(1,), seed=4, requires_grad=False)
    inputs = [args[n] for n in NAMES]
    do = torch.randn(1, 300, 2, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    S_ref, M_ref = span.span_summary("torch", *inputs, True, 2, None)
    S, M = span.span_summary("tilelang", *inputs, True, 2, None)
    D_ref = span.span_entering_gradient("torch", *inputs, 0.25, do, 2, None)
    D = span.span_entering_gradient("tilelang", *inputs, 0.25, do, 2, None)
    errors = {"S*": rel_err(S, S_ref), "M": rel_err(M, M_ref), "D": rel_err(D, D_ref)}
    assert all(e <= 5e-3 for e in errors.values()), errors


def decaying_gates(T, Hv, seed, zero_heads=()):
    """g = -exp(A_log) softplus(x + dt_bias), A_log = log U(1, 16): every head decays, by about -2 (A = 1) to
    -30 (A = 16) per chunk with dt_bias = -4, so a warmup of a few chunks reaches e^-10."""
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.empty(Hv).uniform_(1, 16, generator=gen).log()
    g = -A_log.exp() * F.softplus(torch.randn(1, T, Hv, generator=gen) - 4.0)
    g[..., list(zero_heads)] = 0.0
    return g


def _cp_case(rank, world, lengths, intra_cp, cp_warmup, zero_heads, limit):
    """One CP call against the single-process run; returns what span.warm_chunks answered on this rank
    ((W, span chunks) per call) and the number of segments of every span.fold."""
    total, Hv = sum(lengths), 4
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, total, 2, Hv, 16, 16, seed=31)
    args["g"] = decaying_gates(total, Hv, seed=32, zero_heads=zero_heads).requires_grad_(True)
    do = torch.randn(1, total, Hv, 16, generator=torch.Generator().manual_seed(33))
    o_ref, _ = flashqla.chunk_gated_delta_rule(**args, cu_seqlens=cu, backend="torch")
    ref_grads = torch.autograd.grad((o_ref * do).sum(), [args[n] for n in NAMES])

    part = total // world
    mine = slice(rank * part, (rank + 1) * part)
    local = {n: args[n].detach()[:, mine].clone().requires_grad_(True) for n in NAMES}
    ctx = build_cp_context(cu, group=dist.group.WORLD)
    answers, folds = [], []
    real_warm_chunks, real_fold = span.warm_chunks, span.fold

    def warm_chunks_spy(cumulative, threshold, from_end):
        answers.append((real_warm_chunks(cumulative, threshold, from_end), cumulative.shape[0] - 1))
        return answers[-1][0]

    def fold_spy(states, mats):
        folds.append(states.shape[0])
        return real_fold(states, mats)

    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(span, "warm_chunks", warm_chunks_spy)
        patches.setattr(span, "fold", fold_spy)
        o, _ = flashqla.chunk_gated_delta_rule(**local, cp_context=ctx, backend="torch", intra_cp=intra_cp,
                                               cp_warmup=cp_warmup)
        grads = torch.autograd.grad((o * do[:, mine]).sum(), [local[n] for n in NAMES])
    errors = {"o": rel_err(o, o_ref[:, mine])}
    errors.update({"d" + n: rel_err(gr, ref[:, mine]) for n, gr, ref in zip(NAMES, grads, ref_grads)})
    bad = {n: e for n, e in errors.items() if not e <= limit}
    assert not bad, f"rank {rank}/{world}, intra_cp={intra_cp}, cp_warmup={cp_warmup}: {bad}"
    return answers, folds


def _warmup_and_exact_fallback(rank, world):
    # a 100-token sequence, one crossing every boundary (9 or 10 chunks per rank), a 100-token one
    lengths = [100, 640 * world - 200, 100]
    # every head decays: every span takes the warmup, over fewer chunks than it has, forward and backward
    answers, _ = _cp_case(rank, world, lengths, "off", -10.0, (), 1e-4)
    assert answers and all(w is not None and w < chunks for w, chunks in answers), answers
    # one g = 0 head: every span falls back to the exact path
    answers, _ = _cp_case(rank, world, lengths, "off", -10.0, (0,), 1e-5)
    assert answers and all(w is None for w, _ in answers), answers
    # exact, spans cut into 2-chunk segments (the call's intra-card segment length): 540 and 640-token
    # spans (9 and 10 chunks) fold 5 segments each
    _, folds = _cp_case(rank, world, lengths, 2, None, (0,), 1e-5)
    assert folds and all(n == 5 for n in folds), folds


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_cp_warmup_across_ranks_is_within_its_bound_and_falls_back_to_exact_for_a_g0_head(world):
    run_on_ranks(world, _warmup_and_exact_fallback)
