"""Intra-card CP (segments) on the torch backend: exact mode, warmup mode, planning."""
import itertools
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import flashqla
from flashqla.cp import auto_segment_chunks, plan_segments
from gdn_inputs import make_inputs, random_cu_seqlens, rel_err

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def outputs_and_grads(args, cu, **kw):
    o, ht = flashqla.chunk_gated_delta_rule(**args, output_final_state=True, cu_seqlens=cu, backend="torch", **kw)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(args.values()))
    return dict(zip(NAMES, [o, ht, *grads]))


@pytest.mark.parametrize("segment_chunks", [1, 2, 3])
def test_forced_segments_in_exact_mode_equal_unsegmented_with_straddling_varlen(segment_chunks):
    lengths = [300, 1, 200, 64, 129, 65]  # sequences cross segment boundaries, L need not divide them
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, sum(lengths), 2, 4, 16, 32, num_seqs=len(lengths), with_h0=True, zero_heads=(0,),
                       strong_heads=(3,), seed=segment_chunks)
    base = outputs_and_grads(args, cu, intra_cp="off")
    seg = outputs_and_grads(args, cu, intra_cp=segment_chunks, cp_warmup=None)
    errors = {n: rel_err(seg[n], base[n]) for n in NAMES}
    assert max(errors.values()) <= 1e-5, errors


def test_batched_rows_are_segmented_too():
    args = make_inputs(2, 200, 1, 2, 16, 16, with_h0=True, seed=4)
    base = outputs_and_grads(args, None, intra_cp="off")
    seg = outputs_and_grads(args, None, intra_cp=1, cp_warmup=None)
    assert max(rel_err(seg[n], base[n]) for n in NAMES) <= 1e-5


def moderate_decay_inputs(seed):
    """Head 0: g = 0 (never warms up); head 1: g = -0.05 per token (-3.2 per chunk: a 4-chunk warmup)."""
    args = make_inputs(1, 64 * 24, 1, 2, 16, 16, dtype=torch.float64, with_h0=True, zero_heads=(0,), seed=seed,
                       requires_grad=False)
    args["g"][..., 1] = -0.05
    for x in args.values():
        x.requires_grad_(True)
    return args


def head(name, x, h):
    """The slice of output / gradient `name` that belongs to v-head h."""
    if name in ("o", "dv"):
        return x[:, :, h]
    if name in ("dg", "dbeta"):
        return x[..., h]
    return x[:, h]  # final_state, dh0: [N, Hv, K, V]


def test_warmup_is_used_on_decaying_heads_within_1e4_and_exact_on_no_decay_heads():
    args = moderate_decay_inputs(seed=8)
    base = outputs_and_grads(args, None, intra_cp="off")
    warm = outputs_and_grads(args, None, intra_cp=8, cp_warmup=-10.0)
    per_head = {n: [rel_err(head(n, warm[n], h), head(n, base[n], h)) for h in (0, 1)]
                for n in ("o", "final_state", "dv", "dg", "dbeta", "dh0")}
    for name, (no_decay, decaying) in per_head.items():
        assert no_decay <= 1e-12, (name, per_head)  # g = 0: the exact M chain, float64 rounding only
        assert decaying <= 1e-4, (name, per_head)
    # the warmup really replaced the chain on the decaying head: it leaves a (tiny) approximation error
    assert per_head["o"][1] > 1e-12, per_head


def test_warmup_none_means_exact_everywhere():
    args = moderate_decay_inputs(seed=9)
    base = outputs_and_grads(args, None, intra_cp="off")
    exact = outputs_and_grads(args, None, intra_cp=8, cp_warmup=None)
    assert max(rel_err(exact[n], base[n]) for n in NAMES) <= 1e-12


def test_plan_cuts_only_long_sequences_into_consecutive_rows():
    plan = plan_segments((0, 130, 131), (130, 1, 400), 2)
    assert plan.lengths == (128, 2, 1, 128, 128, 128, 16)
    assert plan.sequence == (0, 0, 1, 2, 2, 2, 2)
    assert plan.position == (0, 1, 0, 0, 1, 2, 3)
    assert plan.first_rows == (0, 2, 3) and plan.last_rows == (1, 2, 6)


@pytest.mark.parametrize("heads,expected", [(8, 16), (32, 32), (64, 0)])
def test_auto_rule_for_one_32k_sequence_on_132_sms(heads, expected):
    # published H200 figures: H 8 -> L 16, H 32 -> L 32; H 64 fills the GPU without CP
    assert auto_segment_chunks((32768,), heads, 132) == expected


def test_auto_rule_stays_off_when_batch_fills_the_gpu():
    assert auto_segment_chunks((8192,) * 4, 16, 132) == 0
    assert auto_segment_chunks((200,), 2, 132) == 0  # 4 chunks: not longer than the minimum segment


SWEEPS = Path(__file__).parent / "data"


def read_sweep(path):
    """`benchmarks/bench_autocp.py --sweep`'s lines (tests/data/autocp_sweep_*.txt): (label, v-heads, sequence
    lengths, {L: (fwd ms, fwd+bwd ms)})."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("#"):
            continue
        label = line.split(":")[0]
        heads, shape = re.search(r"(\d+,\d+) (\S+)$", label).groups()
        lengths = []  # "4096x8", "24576+8192", "20480+512x24"
        for part in shape.split("+"):
            length, _, count = part.partition("x")
            lengths += [int(length)] * int(count or 1)
        times = {int(L): (float(f), float(b)) for L, f, b in re.findall(r"L(\d+)=([\d.]+)/([\d.]+)", line)}
        rows.append((label, int(heads.split(",")[1]), tuple(lengths), times))
    return rows


@pytest.mark.parametrize("name,configs,fwd_limit,fwd_bwd_limit,mean_limit", [
    # the calibration: FlashQLA's backward matrix, bench_gdn's ten and eight more (H200, thirty-first session)
    ("autocp_sweep_h200.txt", 50, 1.035, 1.09, 1.005),
    # the same but the eight, on an H100 with the fiftieth session's kernels
    ("autocp_sweep_h100.txt", 42, 1.02, 1.015, 1.002),
    # rows of 32K tokens packed with 3 to 60 documents at 4 to 32 v-heads (H100, fiftieth session): the rule that
    # counted every row as long as the longest was 1.63x / 1.26x off at worst, 17% / 8% on the geometric mean
    ("autocp_sweep_packs_h100.txt", 24, 1.17, 1.15, 1.012),
    # one sequence of 256K to 1M tokens at 8 to 32 v-heads, L of 64 to 512 (H100, fifty-seventh session): with the
    # longest choice 128 the rule was 1.12x / 1.044x off at 1M tokens
    ("autocp_sweep_long_h100.txt", 7, 1.02, 1.025, 1.01),
])
def test_tilelang_auto_rule_is_near_the_best_of_each_sweep(name, configs, fwd_limit, fwd_bwd_limit, mean_limit):
    """On every config of a sweep, the planner's L is within fwd_limit of the fastest forward and fwd_bwd_limit of
    the fastest fwd+bwd of all L measured, and within mean_limit of them on the geometric mean."""
    from flashqla.cp.plan import calibrated_segment_chunks, resolve_segment_chunks

    rows = read_sweep(SWEEPS / name)
    assert len(rows) == configs
    slow = {0: [], 1: []}
    for label, heads, lengths, times in rows:
        L = calibrated_segment_chunks(lengths, heads)
        assert resolve_segment_chunks("auto", lengths, heads, torch.device("cpu"), "tilelang") == L
        assert L in times, (label, L)
        for i, limit in ((0, fwd_limit), (1, fwd_bwd_limit)):
            ratio = times[L][i] / min(t[i] for t in times.values())
            assert ratio <= limit, (label, L, "fwd" if i == 0 else "fwd+bwd", ratio)
            slow[i].append(math.log(ratio))
    assert math.exp(sum(slow[0]) / len(rows)) <= mean_limit and math.exp(sum(slow[1]) / len(rows)) <= mean_limit


def test_walks_time_on_rows_of_one_length_is_the_fitted_wave_form():
    """`_walks_time` on n rows of c chunks is c x max(1, ceil(heads n / SMs) / WALK_OVERLAP), the form fitted on the
    H200 sweep; on a pack it counts the short rows' walks by their own length."""
    from flashqla.cp.plan import WALK_OVERLAP, _walks_time

    for rows, heads in (([64] * 8, 16), ([32] * 16, 8), ([8] * 64, 32), ([100] * 133, 1), ([7], 3)):
        want = rows[0] * max(1.0, math.ceil(heads * len(rows) / 132) / WALK_OVERLAP)
        assert _walks_time(rows, heads, 132) == pytest.approx(want)
    draw = random.Random(5)  # against the definition, walk by walk (the function takes rows of one length in bulk)
    for _ in range(300):
        rows, heads, sms = [draw.randint(1, 300) for _ in range(draw.randint(1, 40))], draw.choice([1, 3, 16, 64]), \
            draw.choice([132, 66, 7])
        walks = sorted((r for r in rows for _ in range(heads)), reverse=True)
        waves = [walks[i:i + sms] for i in range(0, len(walks), sms)]
        want = max(walks[0], sum(sum(w) / len(w) for w in waves) / WALK_OVERLAP)
        assert _walks_time(rows, heads, sms) == pytest.approx(want)
    # 24 one-chunk documents beside a 64-chunk one at 16 v-heads: 400 walks, but the short ones add little
    assert _walks_time([64] + [1] * 24, 16, 132) == 64
    assert _walks_time([64] * 25, 16, 132) == pytest.approx(64 * 4 / WALK_OVERLAP)


@pytest.mark.parametrize("lengths,heads,expected", [
    ((4096,) * 2, 4, 8),  # 8 walks of 64 chunks unsegmented: 1.42x slower fwd+bwd than at L = 8 (sweep)
    ((8192,), 32, 16), ((32768,), 16, 32), ((32768,), 32, 64), ((32768,), 24, 32), ((131072,), 8, 64),
    ((4096,), 8, 8),  # the sweep's best
    ((4096,) * 8, 8, 0), ((8192,) * 4, 64, 0), ((2048,) * 4, 32, 0),  # batches that fill the GPU unsegmented
    ((1048576,), 8, 512), ((262144,), 32, 512), ((262144,), 8, 128),  # long sequences (the long sweep)
    ((200,), 2, 0), ((64,), 8, 0),  # too short to cut
])
def test_tilelang_auto_rule_picks(lengths, heads, expected):
    from flashqla.cp.plan import calibrated_segment_chunks, resolve_segment_chunks

    assert calibrated_segment_chunks(lengths, heads) == expected
    assert resolve_segment_chunks("off", lengths, heads, torch.device("cpu"), "tilelang") == 0


def test_auto_is_off_on_cpu():
    args = make_inputs(1, 64 * 40, 1, 1, 16, 16, requires_grad=False)
    o_auto, _ = flashqla.chunk_gated_delta_rule(**args)
    o_off, _ = flashqla.chunk_gated_delta_rule(**args, intra_cp="off")
    assert torch.equal(o_auto, o_off)


@pytest.mark.parametrize("value,error", [("on", ValueError), (0, ValueError), (True, ValueError)])
def test_bad_intra_cp(value, error):
    args = make_inputs(1, 8, 1, 1, 16, 16, requires_grad=False)
    with pytest.raises(error, match="intra_cp"):
        flashqla.chunk_gated_delta_rule(**args, intra_cp=value)


@pytest.mark.parametrize("value,error", [(5.0, ValueError), ("x", TypeError)])
def test_bad_cp_warmup(value, error):
    args = make_inputs(1, 8, 1, 1, 16, 16, requires_grad=False)
    with pytest.raises(error, match="cp_warmup"):
        flashqla.chunk_gated_delta_rule(**args, cp_warmup=value)


class TorchKernels:
    """Stands in for flashqla.kernels.hopper (prepare / walk / summaries / output) with the torch backend, so the
    kernel-path CP composition runs on the CPU: a walk from h0 is a whole-sequence forward, and the "per-chunk
    states" it hands to `output` are just h0."""

    @staticmethod
    def _forward(x, v, scale, h0, output_final_state):
        from flashqla.ops import torch_backend

        plan = torch_backend.make_plan(1, x.q.shape[1], x.cu.tolist(), 0)
        return torch_backend.forward(x.q, x.k, v, x.g, x.beta, scale, h0, output_final_state, plan)

    @staticmethod
    def prepare(q, k, v, g, beta, cu, chunk_offsets=None):
        bounds = cu.tolist()
        gcum = g[0].t().clone()  # [Hv, T]: the chunk-local cumulative gate, as wy_inverse stores it
        for bos, eos in zip(bounds[:-1], bounds[1:]):
            for t0 in range(bos, eos, 64):
                gcum[:, t0:min(t0 + 64, eos)] = gcum[:, t0:min(t0 + 64, eos)].cumsum(-1)
        return SimpleNamespace(q=q, k=k, v=v, g=g, beta=beta, cu=cu, gcum=gcum, num_seqs=len(bounds) - 1,
                               num_v_heads=v.shape[2])

    def walk(self, x, h0=None, *, store_final=True, use_v=True):
        # V = 0: a K x K "state" from h0 = I walks to M (the kernels have K = V)
        v = x.v if use_v else x.v.new_zeros(x.v.shape[:-1] + (x.k.shape[-1],))
        _, ht = self._forward(x, v, 1.0, h0, True)
        return h0, None, ht if store_final else None

    def summaries(self, x, with_transition, active=None):
        self.active = active
        _, _, S_star = self.walk(x, None)
        K = x.k.shape[-1]
        eye = torch.eye(K, dtype=S_star.dtype).expand(x.num_seqs, x.num_v_heads, K, K)
        M = self.walk(x, eye, use_v=False)[2] if with_transition else None
        if active is not None and (active[0] > 1).any():  # S* walks from a restart chunk: V = 0 before it
            v = x.v.clone()
            for row, head in (active[0] > 1).nonzero().tolist():
                v[0, x.cu[row]:x.cu[row] + 64 * (int(active[0, row, head]) - 1), head] = 0
            _, _, S_star = self.walk(SimpleNamespace(**{**vars(x), "v": v}), None)
        if active is not None:  # the kernel stores zeros for the walks it skips
            S_star = S_star * (active[0] > 0)[:, :, None, None]
            M = M * (active[1] > 0)[:, :, None, None]
        return S_star, M

    def output(self, x, h, vnew, scale):
        return self._forward(x, x.v, scale, h, False)[0]

    def summaries_from_gates(self, x, flags, threshold):
        from kernel_emulator import gate_statistics

        exact, active = gate_statistics(x.gcum, x.cu, flags, threshold)
        S_star, M = self.summaries(x, True, active)
        return S_star, M, exact, active

    @staticmethod
    def fold_segments(out, bias, mats, exact, first_rows, last_rows, reverse, zero_start=False, num_chains=None):
        from kernel_emulator import emulate_segment_chain

        rows, heads = exact.shape
        flat = lambda t: t.view((rows * heads,) + t.shape[2:])  # noqa: E731
        emulate_segment_chain(flat(out), flat(bias), flat(mats), exact.reshape(-1), first_rows, last_rows, heads,
                              reverse, zero_start)
        return out

    def fused_forward(self, x, v, h0, scale, store_final, states=None):
        assert states is None, "this stand-in keeps no per-chunk states"
        return self._forward(x, v, scale, h0, store_final)


def composed(args, cu, segment_chunks, cp_warmup, fused=True, kernels=None):
    from flashqla.cp.segments import segmented_forward
    from flashqla.ops import torch_backend

    q = args["q"]
    plan = torch_backend.make_plan(q.shape[0], q.shape[1], None if cu is None else cu.tolist(), segment_chunks)
    assert plan.is_segmented
    return segmented_forward(kernels or TorchKernels(), args["q"], args["k"], args["v"], args["g"], args["beta"],
                             0.25, args.get("initial_state"), True, plan, cp_warmup, fused=fused)


@pytest.mark.parametrize("fused", [False, True])
def test_segments_as_packed_sequences_equal_unsegmented_in_exact_mode(fused):
    lengths = [300, 1, 200, 64, 129]
    cu = random_cu_seqlens(lengths)
    args = make_inputs(1, sum(lengths), 2, 4, 16, 32, num_seqs=len(lengths), with_h0=True, zero_heads=(0,),
                       strong_heads=(3,), seed=21, requires_grad=False)
    o_ref, ht_ref = flashqla.chunk_gated_delta_rule(**args, scale=0.25, cu_seqlens=cu, output_final_state=True)
    o, ht = composed(args, cu, 1, None, fused=fused)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


def test_summary_walks_run_only_where_the_chain_reads_them():
    """One sequence of 3 segments and one of 1, no initial state: S* for rows with a successor, M only for
    the middle segment (the first starts from zero) and only on the g = 0 head (the decaying head warms up)."""
    args = make_inputs(1, 64 * 10, 1, 2, 16, 16, dtype=torch.float64, num_seqs=2, zero_heads=(0,), seed=23,
                       requires_grad=False)
    args["g"][..., 1] = -0.05  # -12.8 over a 4-chunk segment
    cu = torch.tensor([0, 64 * 9, 64 * 10])
    kernels = TorchKernels()
    o_ref, _ = flashqla.chunk_gated_delta_rule(**args, scale=0.25, cu_seqlens=cu, output_final_state=True)
    o, _ = composed(args, cu, 4, -10.0, kernels=kernels)  # rows: 4 + 4 + 1 chunks, then 1
    assert kernels.active[0].tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert kernels.active[1].tolist() == [[False, False], [True, False], [False, False], [False, False]]
    assert rel_err(o[..., 0, :], o_ref[..., 0, :]) <= 1e-12 and rel_err(o, o_ref) <= 1e-4


def test_tilelang_auto_rule_takes_longer_segments_on_a_gpu_with_fewer_sms():
    """The cost model counts the walks each SM holds: with half an H200's SMs, 16 v-heads x 512 chunks take
    64-chunk segments instead of 32."""
    from flashqla.cp.plan import calibrated_segment_chunks

    assert calibrated_segment_chunks((32768,), 16) == 32
    assert calibrated_segment_chunks((32768,), 16, sm_count=66) == 64


def test_warmup_restarts_at_the_last_chunk_from_which_the_gates_sum_below_the_threshold():
    """The gate statistics (chunk_states.py `gate_statistics`, emulated): with every row flagged
    HAS_NEXT | INTO_EXACT, active[0] is the row's walk_from and active[1] whether it is not warm, the exact mask of
    the next row."""
    from flashqla.kernels.hopper.launch import HAS_NEXT, INTO_EXACT
    from kernel_emulator import gate_statistics

    lengths = (300, 1, 200, 64, 129)
    plan = plan_segments(tuple(random_cu_seqlens(lengths)[:-1].tolist()), lengths, 2)
    g = -3 * torch.rand(sum(lengths), 3, dtype=torch.float64)
    g[:, 0] = 0.0  # never decays: not warm anywhere
    cu = torch.tensor(plan.starts + (sum(lengths),), dtype=torch.int32)
    x = TorchKernels.prepare(None, None, torch.zeros(1, sum(lengths), 3, 1), g[None], None, cu)
    flags = torch.full((len(plan.starts),), HAS_NEXT | INTO_EXACT, dtype=torch.int32)
    exact, active = gate_statistics(x.gcum.float(), cu, flags, -40.0)
    walk_from, warm = active[0], active[1] == 0
    for row, (start, length) in enumerate(zip(plan.starts, plan.lengths)):
        chunk_sums = [g[t:min(t + 64, start + length)].sum(0) for t in range(start, start + length, 64)]
        for head in range(3):
            below = [c for c in range(len(chunk_sums)) if sum(s[head] for s in chunk_sums[c:]) < -40.0]
            assert bool(warm[row, head]) == bool(below), (row, head)
            assert walk_from[row, head] == (below[-1] + 1 if below else 1), (row, head)
            assert exact[row + 1, head] == (not below) if row + 1 < len(plan.starts) else exact[0, head] == 0
    assert not warm[:, 0].any() and (walk_from[:, 1:] > 1).any()


def test_kernel_path_warmup_restarts_where_the_torch_backend_does():
    """The summary walk of a warmed-up head starts at the restart chunk (not at the segment start): the
    composition then computes what the torch backend's warmup computes, to float64 rounding."""
    args = make_inputs(1, 64 * 24, 1, 3, 16, 16, dtype=torch.float64, zero_heads=(0,), seed=24, requires_grad=False)
    args["g"][..., 1] = -0.05  # -3.2 per chunk: restart 4 chunks before the end of each 8-chunk segment
    args["g"][..., 2] = -1.0  # -64 per chunk: restart at the last chunk
    kernels = TorchKernels()
    o, ht = composed(args, None, 8, -10.0, kernels=kernels)
    assert kernels.active[0, :2, 1:].tolist() == [[5, 8], [5, 8]]  # 1 + restart chunk
    o_ref, ht_ref = flashqla.chunk_gated_delta_rule(**args, scale=0.25, output_final_state=True, intra_cp=8,
                                                    cp_warmup=-10.0)
    assert rel_err(o, o_ref) <= 1e-12 and rel_err(ht, ht_ref) <= 1e-12


def test_segments_as_packed_sequences_warm_up_over_the_previous_segment():
    # head 1 decays by -0.02 per token: -10.24 over an 8-chunk segment, just past the -10 threshold
    args = make_inputs(2, 64 * 24, 1, 2, 16, 16, dtype=torch.float64, with_h0=True, zero_heads=(0,), seed=22,
                       requires_grad=False)
    args["g"][..., 1] = -0.02
    o_ref, ht_ref = flashqla.chunk_gated_delta_rule(**args, scale=0.25, output_final_state=True)
    o, ht = composed(args, None, 8, -10.0)
    assert rel_err(o[:, :, 0], o_ref[:, :, 0]) <= 1e-12  # g = 0: the exact chain
    err = rel_err(o[:, :, 1], o_ref[:, :, 1])
    assert 1e-12 < err <= 1e-4, err  # the warmup replaced the chain, within the bound
    assert rel_err(ht, ht_ref) <= 1e-4


def test_fold_steps_are_views_for_one_sequence_and_index_tensors_for_a_pack():
    """The scan's steps are slices where the rows at a position are consecutive (one GEMM written in place)."""
    from flashqla.cp.intra import rows_at_positions

    one = plan_segments((0,), (5 * 64,), 1)  # one sequence in 5 segments: positions 1..4, one row each
    assert rows_at_positions(one, "cpu") == (slice(1, 2), slice(2, 3), slice(3, 4), slice(4, 5))
    pack = plan_segments((0, 5 * 64), (5 * 64, 2 * 64), 1)  # rows 0-4 and 5-6
    steps = rows_at_positions(pack, "cpu")
    assert torch.equal(steps[0], torch.tensor([1, 6])) and steps[1:] == (slice(2, 3), slice(3, 4), slice(4, 5))


def test_the_chain_takes_sequences_longest_first_and_counts_those_with_steps():
    """segment_chain issues its CTAs in the order of the rows it is given, a sequence's v-heads together: the
    plan hands it the sequences longest first (a one-row sequence's CTAs only write its start row) and the
    number of sequences whose chains take steps, from which fold_segments picks the V tile."""
    from flashqla.cp.segments import _plan_tensors
    from flashqla.kernels.hopper import launch

    lengths = (64, 5 * 64, 1, 3 * 64)  # rows 0 | 1-5 | 6 | 7-9 at one chunk per segment
    starts = tuple(itertools.accumulate(lengths, initial=0))[:-1]
    idx = _plan_tensors(plan_segments(starts, lengths, 1), sum(lengths), torch.device("cpu"))
    assert idx.chain_first.tolist() == [1, 7, 0, 6] and idx.chain_last.tolist() == [5, 9, 0, 6]
    assert idx.chains == 2 and idx.first.tolist() == [0, 1, 6, 7]  # the plan's order stays for everything else

    seen = []
    launch_chain = lambda block_v: lambda *args: seen.append(block_v)  # noqa: E731
    rows, heads, sequences = 20, 8, 20
    out = torch.zeros(rows, heads, 128, 128)
    as_rows = torch.arange(sequences, dtype=torch.int32)
    with mock.patch.object(launch, "compiled_segment_chain", launch_chain), \
            mock.patch.object(launch, "sm_count_on", lambda device: 132):
        launch.fold_segments(out, out, out, torch.zeros(rows, heads), as_rows, as_rows, False, num_chains=2)
        launch.fold_segments(out, out, out, torch.zeros(rows, heads), as_rows, as_rows, False)
    # 2 x 8 chains: 8 (two waves of 16 x 8 CTAs); counting all 20 sequences' 160 pairs it would be 16
    assert seen == [launch.chain_block_v(16, 132), launch.chain_block_v(160, 132)] == [8, 16]
