"""Inter-card CP, one sequence sharded over the ranks: flashqla vs FLA 0.6.0 CP vs FlashQLA 0.1.3 dual CP,
same process group, same inputs. Reports fwd and fwd+bwd time per step (median of --reps, CUDA events
around a barrier-aligned step), scaling efficiency against the same implementation on one GPU
(t_1 / (W t_W)), and flashqla's exposed exchange (its CP step minus its local step on the same shard
with no CP). flashqla runs twice: "flashqla exact" (cp_warmup=None: every span summary is the exact
segmented one) and "flashqla warmup" (the default cp_warmup: a span whose heads all decay past it is
summarised over its last few chunks, flashqla/cp/span.py).

Gates are model-like, g = -exp(A_log) softplus(x + dt_bias) with A_log = log U(1, 16) and dt_bias = 1
(Qwen3-Next's initialisation): every head decays. --zero-heads sets a quarter of the heads to g = 0,
which sends every span down the exact path.

    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --tokens 262144,1048576 --heads 8,16,32 --out cp.md
        [--impls "flashqla exact,flashqla warmup,FLA CP"] [--zero-heads] [--layers 4]

Each peer is optional: one that is not installed or fails is reported, not fatal. On CPU (gloo) only
flashqla runs, which makes a quick dry run of the script.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")  # keep FLA on its own Triton kernels

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashqla  # noqa: E402
from flashqla.cp import build_cp_context  # noqa: E402

D = 128


def inputs(T, Hqk, Hv, device, zero_heads=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    A = torch.empty(Hv, device=device).uniform_(1, 16, generator=gen)
    g = -A * F.softplus(randn(1, T, Hv) + 1.0)
    if zero_heads:
        g[..., : Hv // 4] = 0.0
    return dict(q=F.normalize(randn(1, T, Hqk, D), dim=-1).to(dtype), k=F.normalize(randn(1, T, Hqk, D), dim=-1).to(dtype),
                v=randn(1, T, Hv, D).to(dtype), g=g, beta=torch.sigmoid(randn(1, T, Hv)).to(dtype))


LAYERS = 1  # --layers: GDN calls per step, each on the previous call's output


def stacked(call, x):
    """LAYERS calls of `call(**inputs) -> o` in sequence, each taking the previous output as its v (a stack
    of GDN layers as a model runs them: the host issues layer i+1 while the GPU works on layer i)."""
    v = x["v"]
    for _ in range(LAYERS):
        v = call(**dict(x, v=v))
    return v


class Impl:
    """One implementation: `make(cu_global, group, Hv)` returns `step(x, with_backward)` for the local shard."""

    def __init__(self, name, make):
        self.name, self.make = name, make


def make_flashqla(**options):
    """flashqla's CP with `options` of chunk_gated_delta_rule (cp_warmup=None for the exact summaries)."""
    def make(cu, group, Hv):
        ctx = build_cp_context(cu, group=group)

        def step(x, backward):
            o = stacked(lambda **y: flashqla.chunk_gated_delta_rule(**y, cp_context=ctx, **options)[0], x)
            if backward:
                o.float().sum().backward()
        return step
    return make


def make_flashqla_local(cu, group, Hv):
    """The same shard as one independent sequence: flashqla's local work without the chain."""
    def step(x, backward):
        o = stacked(lambda **y: flashqla.chunk_gated_delta_rule(**y)[0], x)
        if backward:
            o.float().sum().backward()
    return step


def make_fla(cu, group, Hv):
    from fla.ops.cp import build_cp_context as fla_context
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ctx = fla_context(cu.long(), group=group, cu_seqlens_cpu=cu.long().cpu())

    def step(x, backward):
        o = stacked(lambda **y: chunk_gated_delta_rule(**y, cp_context=ctx)[0], x)
        if backward:
            o.float().sum().backward()
    return step


def make_flash_qla(cu, group, Hv):
    from flash_qla import chunk_gated_delta_rule
    from flash_qla.ops.gated_delta_rule.chunk.cp import build_cp_context as qla_context

    ctx = qla_context(cu.long(), enable_inter=True, enable_intra=True, group=group, num_v_heads=Hv, chunk_size=64,
                      cu_seqlens_cpu=cu.long().cpu(), is_train=True)

    def step(x, backward):
        o = stacked(lambda **y: chunk_gated_delta_rule(**y, cp_context=ctx)[0], x)
        if backward:
            o.float().sum().backward()
    return step


IMPLS = [Impl("flashqla exact", make_flashqla(cp_warmup=None)), Impl("flashqla warmup", make_flashqla()),
         Impl("FLA CP", make_fla), Impl("FlashQLA dual CP", make_flash_qla)]


def step_ms(step, x, backward, device):
    """One step: CUDA events around it on a GPU (the stream idle before it), host time on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(x, backward)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)
    t0 = time.perf_counter()
    step(x, backward)
    return (time.perf_counter() - t0) * 1e3


def median_ms(step, x, backward, reps, device, group=None):
    """Median of `reps` barrier-aligned steps after 3 warm-up steps (compiles, caches), the slowest rank
    of `group`; group=False: this rank alone (the one-GPU baselines)."""
    times = []
    for i in range(reps + 3):
        if group is not False:
            dist.barrier()
        elapsed = step_ms(step, x, backward, device)
        if i >= 3:
            times.append(elapsed)
    mine = torch.tensor([statistics.median(times)], device=device)
    if group is not False:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return mine.item()


def shard(x, rank, world, requires_grad=True):
    T = x["q"].shape[1] // world
    return {n: t[:, rank * T:(rank + 1) * T].detach().clone().requires_grad_(requires_grad) for n, t in x.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="262144,1048576")
    ap.add_argument("--heads", default="8,16,32", help="v heads (q/k heads = Hv / 2)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="cp_benchmark.md")
    ap.add_argument("--zero-heads", action="store_true", help="a quarter of the heads at g = 0 (no decay)")
    ap.add_argument("--layers", type=int, default=1,
                    help="GDN calls per step, each on the previous one's output (per-call costs such as a host "
                         "sync show between calls, not at a step's start)")
    ap.add_argument("--impls", default=",".join(i.name for i in IMPLS),
                    help="comma-separated subset of: " + ", ".join(i.name for i in IMPLS))
    args = ap.parse_args()
    global LAYERS
    LAYERS = args.layers
    chosen = args.impls.split(",")
    unknown = set(chosen) - {i.name for i in IMPLS}
    if unknown:
        ap.error(f"--impls: unknown {sorted(unknown)}")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    single = dist.new_group([0])  # one-GPU baselines run on rank 0 alone
    rows, notes = [], []
    for T in (int(t) for t in args.tokens.split(",")):
        for Hv in (int(h) for h in args.heads.split(",")):
            x = inputs(T, max(1, Hv // 2), Hv, device, args.zero_heads)
            cu = torch.tensor([0, T], dtype=torch.int32, device=device)
            local = shard(x, rank, world)
            local_ms = {b: median_ms(make_flashqla_local(None, None, Hv), local, b, args.reps, device)
                        for b in (False, True)}
            for impl in (i for i in IMPLS if i.name in chosen):
                row = dict(impl=impl.name, T=T, Hv=Hv)
                try:
                    step = impl.make(cu, dist.group.WORLD, Hv)
                    for b, key in ((False, "fwd"), (True, "fwd+bwd")):
                        row[key] = median_ms(step, local, b, args.reps, device)
                    if rank == 0:
                        one = impl.make(cu, single, Hv)
                        full = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
                        for b, key in ((False, "fwd1"), (True, "fwd+bwd1")):
                            row[key] = median_ms(one, full, b, args.reps, device, group=False)
                    if impl.name.startswith("flashqla"):
                        row["exposed_fwd"] = row["fwd"] - local_ms[False]
                        row["exposed_fwd+bwd"] = row["fwd+bwd"] - local_ms[True]
                except Exception as exc:  # a peer that is missing or fails here is reported
                    notes.append(f"- {impl.name} T={T} Hv={Hv}: {exc.__class__.__name__}: {str(exc)[:160]}")
                rows.append(row)
                if rank == 0:
                    print(row, flush=True)
    if rank == 0:
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        gates = "a quarter of the heads at g = 0" if args.zero_heads else "every head decaying"
        lines = [f"# Inter-card CP, {world} ranks ({torch.cuda.get_device_name() if cuda else 'cpu'}), "
                 f"{datetime.date.today()}, gates: {gates}, {LAYERS} GDN call(s) per step", "",
                 "| impl | tokens | Hv | fwd ms | fwd+bwd ms | 1-GPU fwd+bwd ms | scaling eff. | exposed exchange fwd / fwd+bwd ms |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            eff = (r["fwd+bwd1"] / (world * r["fwd+bwd"])) if r.get("fwd+bwd1") and r.get("fwd+bwd") else None
            exposed = (f"{fmt(r.get('exposed_fwd'))} / {fmt(r.get('exposed_fwd+bwd'))}"
                       if "exposed_fwd" in r else "")
            lines.append(f"| {r['impl']} | {r['T']} | {r['Hv']} | {fmt(r.get('fwd'))} | {fmt(r.get('fwd+bwd'))} | "
                         f"{fmt(r.get('fwd+bwd1'))} | {fmt(eff)} | {exposed} |")
        lines += ["", *notes]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
