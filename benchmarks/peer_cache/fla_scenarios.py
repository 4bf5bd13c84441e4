"""The FLA 0.6.0 (fla-core) GDN calls our benchmarks make (benchmarks/bench_cp.py make_fla, bench_bwd.py forward_fn).

Shared by fla_precompile.py (CPU dry run through fla_cpu.fake_h200) and fla_check_gpu.py (on the H200).
Inputs as in the benchmarks: q, k, v, beta bf16, g float32, K = V = 128, B = 1, default scale, no initial or final
state, env FLA_FLASH_QLA=0 and FLA's backend dispatch on. Tensors are torch.empty on the CPU.
"""
from __future__ import annotations

import itertools

import torch

import scenarios as fqla_scenarios
from scenarios import fill_model_like, make_inputs  # the same inputs as for FlashQLA

# bench_cp.py: one sequence of T tokens, contiguous shards over `world` ranks; Hqk = Hv // 2
CP_TOKENS = [262144, 1048576]
CP_HEADS = [8, 16, 32]
CP_WORLDS = [(2, 0), (2, 1), (1, 0)]    # (world, rank); world 1 = bench_cp's one-GPU baseline (dist.new_group([0]))
# bench_bwd.py: HEADS x TOKENS x SEQS equal packed sequences; cu_seqlens=cu.long() if more than one sequence else None
BWD_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]
BWD_TOKENS = [8192, 32768]
BWD_SEQS = [1, 2, 4, 8]


def scenarios():
    """(label, kind, params). kinds:
    cp:    bench_cp make_fla on rank `rank` of `world` (its shard of T // world tokens), fwd then fwd+bwd
    plain: the same whole sequence without CP: chunk_gated_delta_rule(cu_seqlens=[0, T] or None), fwd+bwd
    bwd:   bench_bwd's FLA call: fwd under no_grad, then fwd+bwd"""
    out = []
    for T, Hv in itertools.product(CP_TOKENS, CP_HEADS):
        for world, rank in CP_WORLDS:
            out.append((f"cp world={world} rank={rank} Hqk={Hv // 2} Hv={Hv} T={T}", "cp",
                        dict(Hqk=Hv // 2, Hv=Hv, T=T, world=world, rank=rank)))
        for cu in (True, False):
            out.append((f"plain Hqk={Hv // 2} Hv={Hv} T={T} cu_seqlens={'[0,T]' if cu else 'None'}", "plain",
                        dict(Hqk=Hv // 2, Hv=Hv, T=T, cu=cu)))
    for (Hqk, Hv), T, n in itertools.product(BWD_HEADS, BWD_TOKENS, BWD_SEQS):
        out.append((f"bwd Hqk={Hqk} Hv={Hv} T={T} seqs={T // n}x{n}", "bwd", dict(Hqk=Hqk, Hv=Hv, T=T, n=n)))
    return out


def _fwd_bwd(o, fill):
    # bench_cp: o.float().sum().backward(); bench_bwd: o.backward(randn_like(o)): the same kernels
    o.backward(torch.randn_like(o) if fill else torch.empty_like(o))


def cp_inputs(p, T, device, fill=False):
    """bench_cp's shard of rank `rank` (T // world tokens; the one-rank baseline: the whole sequence) as bench_cp
    inputs() + shard() make it: q, k, v, beta bf16, g float32, contiguous, requires_grad (values only with fill)."""
    x = make_inputs(T // p["world"], p["Hqk"], p["Hv"], device)
    if fill:
        fill_model_like(x)
    return x


def cp_step(p, T, x, device, exact_backward=True):
    """bench_cp make_fla + step on rank `rank` of `world`, one process playing it through FakeDist: the context
    from the global cu_seqlens [0, T], its "fwd" step (grad enabled, no backward), then its "fwd+bwd" step,
    o.float().sum().backward(). exact_backward=False: o.backward() with the gradient that one produces (bf16 ones,
    made contiguous by FLA's input_guard) without the fp32 copy of o (CPU memory at 1M tokens)."""
    from fla.ops.cp import build_cp_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    with FakeDist(p["world"], p["rank"]) as fd:
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        ctx = build_cp_context(cu.long(), group=fd.group, cu_seqlens_cpu=cu.long().cpu())
        chunk_gated_delta_rule(**x, cp_context=ctx)
        o = chunk_gated_delta_rule(**x, cp_context=ctx)[0]
        if exact_backward:
            o.float().sum().backward()
        else:
            o.backward(torch.ones((), dtype=o.dtype, device=o.device).expand(o.shape))


def run(kind, p, device, fill=False):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if kind == "cp":
        cp_step(p, p["T"], cp_inputs(p, p["T"], device, fill), device)
        return
    if kind == "plain":
        T = p["T"]
        x = make_inputs(T, p["Hqk"], p["Hv"], device)
        if fill:
            fill_model_like(x)
        cu = torch.tensor([0, T], device=device) if p["cu"] else None
        o, _ = chunk_gated_delta_rule(**x, cu_seqlens=cu)
        _fwd_bwd(o, fill)
        return
    if kind == "bwd":
        T, n = p["T"], p["n"]
        x = make_inputs(T, p["Hqk"], p["Hv"], device, requires_grad=False)
        if fill:
            fill_model_like(x)
        cu = torch.tensor([0] + list(itertools.accumulate([T // n] * n)), device=device).to(torch.int32)
        cu = cu.long() if cu.numel() > 2 else None
        leaves = {k: t.detach().requires_grad_(True) for k, t in x.items()}
        with torch.no_grad():
            chunk_gated_delta_rule(**leaves, cu_seqlens=cu)
        o, _ = chunk_gated_delta_rule(**leaves, cu_seqlens=cu)
        _fwd_bwd(o, fill)
        return
    raise ValueError(kind)


class FakeDist(fqla_scenarios.FakeDist):
    """FlashQLA's FakeDist, and FLA's CP also asks is_initialized and all-reduces (a no-op here)."""

    PATCHED = fqla_scenarios.FakeDist.PATCHED + ("all_reduce", "is_initialized")

    def patches(self):
        return dict(super().patches(), all_reduce=lambda t, op=None, group=None, async_op=False: None,
                    is_initialized=lambda: True)
