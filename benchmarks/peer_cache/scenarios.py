"""The flash-qla 0.1.3 calls our benchmarks make (benchmarks/bench_gdn.py, bench_bwd.py, bench_packs.py, bench_cp.py).

Shared by precompile.py (run on the CPU through fqla_cpu.fake_cuda) and check_gpu.py (run on the H200).
Inputs as in the benchmarks: q, k, v, beta bf16, g float32 (log-space decay), K = V = 128, B = 1, scale default
(= 128 ** -0.5, baked into the fwd/bwd kernels), no initial state, no final state.
Tensors are torch.empty (contents are irrelevant to which kernels get built).
"""
from __future__ import annotations

import itertools
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from doc_packs import pack_draws  # noqa: E402

D = 128
HEADS = [(2, 8), (16, 32)]                 # (Hqk, Hv) for the single-GPU calls
LENGTHS = [8192, 32768, 262144]            # tokens in the one sequence
DUAL_HEADS = [8, 16, 32]                   # Hv for dual CP; Hqk = Hv // 2 (bench_cp.py)
DUAL_TOKENS = [262144, 1048576]            # global tokens of the one sequence (bench_cp.py --tokens)
DUAL_WORLDS = [(2, 0), (2, 1), (1, 0)]     # (world, rank); world 1 = bench_cp's one-GPU baseline on rank 0
# bench_bwd.py's matrix (HEADS x TOKENS x SEQS equal sequences): flash_qla.chunk_gated_delta_rule(q, k, v, g, beta,
# cu_seqlens=cu.long()) with its defaults (auto_cp=True), fwd+bwd and fwd under no_grad
BWD_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]
BWD_TOKENS = [8192, 32768]
BWD_SEQS = [1, 2, 4, 8]
# bench_gdn.py's CONFIGS (Hqk, Hv, sequence lengths): chunk_gated_delta_rule_fwd(scale=D ** -0.5,
# cu_seqlens=cu.long(), output_final_state=False, auto_cp=False / True)
GDN_CONFIGS = [
    (2, 8, [32768]), (2, 8, [16384]), (2, 8, [24576, 8192]), (4, 16, [32768]), (4, 16, [16384]),
    (8, 24, [32768]), (16, 16, [32768]), (32, 32, [32768]), (2, 8, [4096] * 8), (16, 64, [8192] * 4),
]


def make_inputs(T, Hqk, Hv, device, g_dtype=torch.float32, requires_grad=True, dtype=torch.bfloat16):
    def e(*s, dt=dtype):
        return torch.empty(*s, dtype=dt, device=device).requires_grad_(requires_grad)
    return dict(q=e(1, T, Hqk, D), k=e(1, T, Hqk, D), v=e(1, T, Hv, D), g=e(1, T, Hv, dt=g_dtype),
                beta=e(1, T, Hv))


def fill_model_like(x):
    """On the GPU: values like the benchmarks' (finite, decaying gates), so kernels run on sane data."""
    with torch.no_grad():
        for n in ("q", "k"):
            x[n].copy_(torch.nn.functional.normalize(torch.randn_like(x[n], dtype=torch.float32), dim=-1))
        x["v"].normal_()
        x["beta"].copy_(torch.sigmoid(torch.randn_like(x["beta"], dtype=torch.float32)))
        x["g"].copy_(-torch.nn.functional.softplus(torch.randn_like(x["g"], dtype=torch.float32) + 1.0))


def _seq_label(seqs):
    if seqs is None or len(seqs) == 1:
        return ""
    return f" seqs={seqs[0]}x{len(seqs)}" if len(set(seqs)) == 1 else " seqs=" + "+".join(map(str, seqs))


def single_gpu_scenarios():
    """(label, kind, Hqk, Hv, T, cu_dtype or None, auto_cp, seqs or None); seqs None = one sequence of T tokens."""
    out, seen = [], set()

    def add(kind, Hqk, Hv, T, cu, auto_cp, seqs=None):
        seqs = None if seqs is None or len(seqs) == 1 else list(seqs)
        key = (kind, Hqk, Hv, T, cu, auto_cp, None if seqs is None else tuple(seqs))
        if key in seen:
            return
        seen.add(key)
        c = "dense" if cu is None else f"cu_{str(cu).replace('torch.', '')}"
        out.append((f"{kind} Hqk={Hqk} Hv={Hv} T={T} {c} auto_cp={auto_cp}{_seq_label(seqs)}",
                    kind, Hqk, Hv, T, cu, auto_cp, seqs))

    for (Hqk, Hv), T, cu, auto_cp in itertools.product(HEADS, LENGTHS, [None, torch.int64, torch.int32], [True, False]):
        for kind in ("train", "infer", "fwd_api"):
            if kind == "fwd_api" and cu is None:
                continue   # bench_gdn passes cu_seqlens
            add(kind, Hqk, Hv, T, cu, auto_cp)
    for (Hqk, Hv), T, n in itertools.product(BWD_HEADS, BWD_TOKENS, BWD_SEQS):
        for kind in ("train", "infer"):
            add(kind, Hqk, Hv, T, torch.int64, True, [T // n] * n)
    for (Hqk, Hv, seqs), auto_cp in itertools.product(GDN_CONFIGS, [False, True]):
        add("fwd_api", Hqk, Hv, sum(seqs), torch.int64, auto_cp, seqs)
    # bench_packs.py: training rows packed with documents at the matrix's heads, called as bench_bwd calls it
    for (Hqk, Hv), seqs in itertools.product(BWD_HEADS, pack_draws()):
        for kind in ("train", "infer"):
            add(kind, Hqk, Hv, sum(seqs), torch.int64, True, seqs)
    return out


def run_single(kind, Hqk, Hv, T, cu_dtype, auto_cp, seqs=None, device=None, fill=False, g_dtype=torch.float32):
    """kind: train = autograd fwd+bwd (bench_bwd fwd_bwd); infer = autograd op under no_grad (bench_bwd fwd_only;
    flash_qla's is_train is False under no_grad whether or not the inputs require grad);
    fwd_api = chunk_gated_delta_rule_fwd(scale, cu_seqlens, output_final_state=False) (bench_gdn).
    seqs: the packed sequence lengths (sum T) behind cu_seqlens; None = one sequence."""
    import flash_qla

    x = make_inputs(T, Hqk, Hv, device, g_dtype=g_dtype, requires_grad=(kind == "train"))
    if fill:
        fill_model_like(x)
    assert seqs is None or sum(seqs) == T, (seqs, T)
    cu = None if cu_dtype is None else torch.tensor([0] + list(itertools.accumulate(seqs or [T])), dtype=cu_dtype,
                                                    device=device)
    if kind == "fwd_api":
        with torch.no_grad():
            flash_qla.chunk_gated_delta_rule_fwd(**x, scale=D ** -0.5, cu_seqlens=cu, output_final_state=False,
                                                 auto_cp=auto_cp)
        return
    if kind == "infer":
        with torch.no_grad():
            flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu, auto_cp=auto_cp)
        return
    o, _ = flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu, auto_cp=auto_cp)
    o.backward(torch.empty_like(o) if not fill else torch.randn_like(o))


def dual_scenarios():
    out = []
    for T, Hv, (world, rank) in itertools.product(DUAL_TOKENS, DUAL_HEADS, DUAL_WORLDS):
        out.append((f"dual world={world} rank={rank} Hqk={Hv // 2} Hv={Hv} T={T}", "dual", Hv // 2, Hv, T, world, rank))
    return out


def run_dual(Hqk, Hv, T, world, rank, device, group, fill=False, g_dtype=torch.float32):
    """bench_cp.py make_flash_qla: inter+intra ("dual") CP over `world` ranks, fwd (grad enabled) + bwd."""
    import flash_qla
    from flash_qla.ops.gated_delta_rule.chunk.cp import build_cp_context

    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    ctx = build_cp_context(cu.long(), enable_inter=True, enable_intra=True, group=group, num_v_heads=Hv,
                           chunk_size=64, cu_seqlens_cpu=cu.long().cpu(), is_train=True)
    x = make_inputs(T // world, Hqk, Hv, device, g_dtype=g_dtype, requires_grad=True)
    if fill:
        fill_model_like(x)
    o, _ = flash_qla.chunk_gated_delta_rule(**x, cp_context=ctx)
    o.backward(torch.empty_like(o) if not fill else torch.randn_like(o))
    return ctx


class FakeDist:
    """torch.distributed for one pretend rank of `world` (CPU dry run, or one GPU standing in for each rank):
    rank/size queries and an all_gather_into_tensor that fills every slot with this rank's input."""

    PATCHED = ("get_world_size", "get_rank", "all_gather_into_tensor")

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.group = types.SimpleNamespace(name=f"fake-{world}-{rank}")

    def patches(self):
        """name -> stand-in for every torch.distributed function in PATCHED."""
        def all_gather_into_tensor(out, inp, group=None, async_op=False):
            if out.numel() < (1 << 26):
                out.view(self.world, -1).copy_(inp.reshape(1, -1).expand(self.world, -1))
            return None
        return dict(get_world_size=lambda group=None: self.world, get_rank=lambda group=None: self.rank,
                    all_gather_into_tensor=all_gather_into_tensor)

    def __enter__(self):
        import torch.distributed as dist
        self.saved = {n: getattr(dist, n) for n in self.PATCHED}
        for name, stand_in in self.patches().items():
            setattr(dist, name, stand_in)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for n, f in self.saved.items():
            setattr(dist, n, f)
