"""One long sequence on one GPU: fwd+bwd time and peak memory of flashqla's public op (AutoCP) at backward state
budgets (`FLASHQLA_BWD_STATES_GIB`, kernels/hopper/backward.py), beside FlashQLA 0.1.3 (its dual CP on a one-rank
group, bench_cp.py's one-GPU baseline).

    python benchmarks/bench_long.py [--configs 262144:32,1048576:8,1048576:16,1048576:32] [--budgets unbounded,default]
                                    [--flash-qla] [--reps 5]

A config is tokens:Hv (Hqk = Hv / 2, bench_cp.py's inputs: every head decaying). Eager steps (the forward, then
o.backward(do) with one bf16 do for every implementation), median of --reps after two warm-up steps; the peak is
torch.cuda.max_memory_allocated above what the inputs and do hold. Every budget's gradients are compared with
the first budget's (the slices must give the same bits). An implementation that runs out of memory is reported
as such and the run goes on.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

BUDGETS = {"unbounded": "1e9", "default": ""}  # named budgets; a number is GiB
CONFIGS = "262144:32,1048576:8,1048576:16,1048576:32"


def parse_configs(text: str) -> list[tuple[int, int]]:
    """"262144:32,1048576:8" -> [(262144, 32), (1048576, 8)]; a malformed item raises ValueError naming it."""
    configs = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) % 2:
            raise ValueError(f"config {item!r} is not tokens:Hv with an even Hv")
        configs.append((int(parts[0]), int(parts[1])))
    return configs


def budget_env(name: str) -> str:
    """The FLASHQLA_BWD_STATES_GIB value of a budget: a named one, or a positive number of GiB."""
    if name in BUDGETS:
        return BUDGETS[name]
    try:
        if float(name) > 0:
            return name
    except ValueError:
        pass
    raise ValueError(f"budget {name!r} is not one of {sorted(BUDGETS)} or a positive number of GiB")


def table(rows: list[dict]) -> str:
    """Markdown rows: config, implementation, time, peak, same bits as the first budget, FlashQLA's time over it."""
    lines = ["| tokens x Hv | implementation | fwd+bwd ms | peak GiB above inputs | same bits | FlashQLA / this |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        peer = next((o for o in rows if (o["T"], o["Hv"]) == (r["T"], r["Hv"]) and o["impl"] == "FlashQLA 0.1.3"), None)
        ratio = ""
        if peer is not None and r is not peer and "ms" in r and "ms" in peer:
            ratio = f"{peer['ms'] / r['ms']:.2f}x"
        elif peer is not None and r is not peer and "ms" in r:
            ratio = peer.get("error", "")
        time = f"{r['ms']:.2f}" if "ms" in r else r.get("error", "n/a")
        peak = f"{r['peak']:.1f}" if "peak" in r else "n/a"
        same = {True: "yes", False: "NO", None: ""}[r.get("same")]
        lines.append(f"| {r['T'] // 1024}K x {r['Hv']} | {r['impl']} | {time} | {peak} | {same} | {ratio} |")
    return "\n".join(lines)


def _signed(constant: int) -> int:
    """A 64-bit constant as the int64 torch multiplies by (wrapping, as unsigned arithmetic would)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


MIX = [_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]  # splitmix64's


def fingerprint(t: torch.Tensor) -> int:
    """A 64-bit hash of t's bits where it lies (a 1M-token gradient is not copied to the host): every element's bits
    and position mixed by splitmix64's steps (int64 wrapping), summed. Equal bits give equal fingerprints; a change of
    any bits, or values swapped between places, changes it but with a chance of 2^-64. Slices of 2^24 elements
    keep the temporaries small."""
    bits = t.detach().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    total, step = 0, 1 << 24
    for start in range(0, bits.numel(), step):
        z = bits[start:start + step].long() + torch.arange(start, start + min(step, bits.numel() - start),
                                                            device=bits.device) * MIX[0]
        z = (z ^ (z >> 30)) * MIX[1]
        z = (z ^ (z >> 27)) * MIX[2]
        z = z ^ (z >> 31)
        total = (total + int(z.sum())) % (1 << 64)
    return total


def _timed(step, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _measure(row: dict, x: dict, step, reps: int) -> dict | None:
    """Times `step` into row (ms, peak); returns the gradients of x, or None when it ran out of memory."""
    def one():
        for t in x.values():
            t.grad = None
        step()

    for t in x.values():  # the last run's gradients are not part of this one's base
        t.grad = None
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        row["ms"] = _timed(one, reps)
        row["peak"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        return {n: t.grad for n, t in x.items()}
    except torch.OutOfMemoryError:
        row.pop("ms", None)
        row["error"] = "out of memory"
        return None
    finally:
        print(row, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--budgets", default="unbounded,default")
    parser.add_argument("--flash-qla", action="store_true", help="FlashQLA 0.1.3 beside (flash_qla installed)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    budgets = [(name, budget_env(name)) for name in args.budgets.split(",")]

    import flashqla
    from bench_cp import inputs
    from flashqla.kernels.hopper.backward import STATES_BUDGET_ENV, STATES_BUDGET_SHARE

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if args.flash_qla:
        import torch.distributed as dist
        from flash_qla import chunk_gated_delta_rule as flash_qla_op
        from flash_qla.ops.gated_delta_rule.chunk.cp import build_cp_context

        rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
        dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    rows = []
    for T, Hv in configs:
        x = {n: t.detach().requires_grad_(True) for n, t in inputs(T, Hv // 2, Hv, device).items()}
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        do = torch.randn_like(x["v"])
        first = None
        for name, env in budgets:
            os.environ[STATES_BUDGET_ENV] = env

            def step():
                o, _ = flashqla.chunk_gated_delta_rule(**x, cu_seqlens=cu, intra_cp="auto")
                o.backward(do)
            row = {"T": T, "Hv": Hv, "impl": f"flashqla, budget {name}"}
            grads = _measure(row, x, step, args.reps)
            if grads is not None:  # fingerprints, not copies: a second set of 1M-token gradients may not fit
                prints = {n: fingerprint(g) for n, g in grads.items()}
                if first is None:
                    first = prints
                else:
                    row["same"] = prints == first
            rows.append(row)
            del grads
        os.environ.pop(STATES_BUDGET_ENV, None)
        first = None
        if args.flash_qla:
            ctx = build_cp_context(cu.long(), enable_inter=True, enable_intra=True, group=dist.group.WORLD,
                                   num_v_heads=Hv, chunk_size=64, cu_seqlens_cpu=cu.long().cpu(), is_train=True)

            def peer_step():
                flash_qla_op(**x, cp_context=ctx)[0].backward(do)
            row = {"T": T, "Hv": Hv, "impl": "FlashQLA 0.1.3"}
            _measure(row, x, peer_step, args.reps)
            rows.append(row)
        for t in x.values():
            t.grad = None
        del x, do
        torch.cuda.empty_cache()
    memory = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    print(f"\n{torch.cuda.get_device_name()} ({memory:.1f} GiB), torch {torch.__version__}; eager fwd+bwd, "
          f"median of {args.reps}; default budget {memory / STATES_BUDGET_SHARE:.1f} GiB")
    print(table(rows))
    if args.flash_qla:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
