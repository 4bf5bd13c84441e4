"""Inter-card CP over NCCL: every rank's output and gradients against the single-GPU run on the whole
stream (same bf16 inputs), plus fwd and fwd+bwd wall time. Launch with torchrun (one process per GPU).

    torchrun --nproc-per-node 2 benchmarks/cp_nccl_parity.py --tokens 65536 --layout contiguous
        [--cp-warmup -10] [--no-zero-head]

The CP run is exact by default (`cp_warmup=None`); `--cp-warmup X` lets the ranks start from warmed-up
states where every head decays below X (head 0 has g = 0 unless `--no-zero-head`, which keeps the
exact path on). The single-GPU reference is always exact.

Two bf16 runs each carry their own rounding (~4e-3 of o against the truth at these lengths), so their
difference measures that noise twice. `--float64` also runs the float64 token-by-token recurrence
(tests/recurrence.py; seconds per 64K tokens) and checks o of the CP run AND of the single-GPU run
against it with the kernels' bound, printing both errors; the gradients stay compared with the
single-GPU run.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashqla
from flashqla.cp import build_cp_context

NAMES = ("q", "k", "v", "g", "beta")


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", default="2,4")
    ap.add_argument("--layout", default="contiguous")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--cp-warmup", type=float, default=None, help="cp_warmup of the CP run (default: exact)")
    ap.add_argument("--no-zero-head", action="store_true", help="every head decays (no g = 0 head)")
    ap.add_argument("--reference-intra-cp", default="auto",
                    help="intra_cp of the single-GPU reference ('off': one walk per sequence, no M folds)")
    ap.add_argument("--float64", action="store_true", help="check o against the float64 recurrence too")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo on CPU: a dry run of this script
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    Hqk, Hv = (int(x) for x in args.heads.split(","))
    T = args.tokens
    gen = torch.Generator(device=device).manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    lengths = [T // 2 + 100, 1, T // 4 - 37, T - (T // 2 + 100) - 1 - (T // 4 - 37)]  # cross the cuts
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    x = dict(q=F.normalize(randn(1, T, Hqk, 128), dim=-1).bfloat16(),
             k=F.normalize(randn(1, T, Hqk, 128), dim=-1).bfloat16(),
             v=randn(1, T, Hv, 128).bfloat16(), beta=torch.sigmoid(randn(1, T, Hv)).bfloat16())
    A = torch.empty(Hv, device=device).uniform_(0.01, 16, generator=gen)
    x["g"] = -A * F.softplus(randn(1, T, Hv) + 1.0)
    if not args.no_zero_head:
        x["g"][..., 0] = 0.0
    do = randn(1, T, Hv, 128).bfloat16()

    ref_in = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    o_ref, _ = flashqla.chunk_gated_delta_rule(**ref_in, cu_seqlens=cu, backend=args.backend, cp_warmup=None,
                                               intra_cp=args.reference_intra_cp)
    (o_ref.float() * do.float()).sum().backward()

    ctx = build_cp_context(cu, group=dist.group.WORLD, layout=args.layout)
    part = T // world if args.layout == "contiguous" else T // (2 * world)
    if args.layout == "contiguous":
        mine = torch.arange(rank * part, (rank + 1) * part, device=device)
    else:
        mine = torch.cat([torch.arange(rank * part, (rank + 1) * part, device=device),
                          torch.arange((2 * world - 1 - rank) * part, (2 * world - rank) * part, device=device)])
    local = {n: t[:, mine].clone().requires_grad_(True) for n, t in x.items()}

    def step(backward):
        o, _ = flashqla.chunk_gated_delta_rule(**local, cp_context=ctx, backend=args.backend, cp_warmup=args.cp_warmup)
        if backward:
            (o.float() * do[:, mine].float()).sum().backward()
        return o

    o = step(True)
    errs = {"o": rel(o, o_ref[:, mine])}
    errs.update({"d" + n: rel(local[n].grad, ref_in[n].grad[:, mine]) for n in NAMES})
    truth = {}
    if args.float64:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from recurrence import gdn_recurrence

        with torch.no_grad():
            o64 = gdn_recurrence(*(x[n] for n in NAMES), cu_seqlens=cu.tolist())[0][:, mine]
        truth = {"o (CP) vs float64": rel(o, o64), "o (one GPU) vs float64": rel(o_ref[:, mine], o64)}
    timings = {}
    for backward in (False, True):
        for _ in range(2):
            step(backward)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            step(backward)
        if cuda:
            torch.cuda.synchronize()
        timings["fwd+bwd" if backward else "fwd"] = (time.perf_counter() - start) / 5 * 1e3
    print(f"rank {rank}/{world} {args.layout} T={T} heads={Hqk},{Hv} backend={args.backend} "
          f"cp_warmup={args.cp_warmup} zero head={not args.no_zero_head}: "
          + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
          + "".join(f" | {k} {v:.1e}" for k, v in truth.items())
          + " | " + " ".join(f"{k} {v:.1f} ms" for k, v in timings.items()), flush=True)
    # o: against the truth where it was computed, else against the single-GPU run
    o_ok = truth["o (CP) vs float64"] <= 5e-3 if truth else errs["o"] <= 5e-3
    assert o_ok and max(errs[k] for k in ("dq", "dk", "dv")) <= 1e-2 and max(errs["dg"], errs["dbeta"]) <= 2e-2, (errs, truth)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
