"""Inter-card CP over NCCL on two GPUs (skipped with fewer): bad calls raise on every rank instead of hanging
and leave the group usable; a good call's outputs and gradients on every rank match the float64 recurrence
of the whole stream, with the thresholds of the kernel tests."""
import os
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import flashqla
from flashqla.cp import build_cp_context
from multiprocess import run_on_ranks
from test_tilelang_backward import TOL, recurrence64_with_grads
from test_tilelang_forward import make_call, recurrence64, rel_err

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or torch.cuda.get_device_capability() != (9, 0),
    reason="needs two SM90 (Hopper) GPUs")

LENGTHS = [1500, 7, 2589]  # the third sequence crosses the rank boundary at token 2048
NAMES = ("q", "k", "v", "g", "beta")


def _two_ranks(rank, world):
    total = sum(LENGTHS)
    call = make_call(LENGTHS, 2, 4, with_h0=False, seed=11)  # head 0 at g = 0, head 3 strongly decaying
    do = torch.randn(1, total, 4, 128, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    part = slice(rank * total // world, (rank + 1) * total // world)
    ctx = build_cp_context(call["cu_seqlens"], group=dist.group.WORLD)

    # contexts from different global offsets: every rank raises
    other = torch.tensor([0, 2048, total] if rank == 0 else [0, 1024, total], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="disagree"):
        build_cp_context(other, group=dist.group.WORLD)
    # a head count that differs on rank 1 only (its call is valid on its own): both raise
    local = {n: call[n][:, part] for n in NAMES}
    bad = dict(local)
    if rank == 1:
        bad.update(v=local["v"].repeat(1, 1, 2, 1), g=local["g"].repeat(1, 1, 2), beta=local["beta"].repeat(1, 1, 2))
    with pytest.raises(ValueError, match="disagree on head counts"):
        flashqla.chunk_gated_delta_rule(**bad, cp_context=ctx)
    # a wrong local length on rank 0 only: rank 0 names it, rank 1 hears of it
    short = {n: t[:, :-1] if rank == 0 else t for n, t in local.items()}
    with pytest.raises(ValueError, match="tokens on rank 0|another rank"):
        flashqla.chunk_gated_delta_rule(**short, cp_context=ctx)

    # then a good call, twice (the same group after the errors); segments of 8 chunks, so that the state and
    # the gradient handed across the boundary come from the calls' own segment summaries (segments.py)
    for _ in range(2):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in local.items()}
        o, _ = flashqla.chunk_gated_delta_rule(**leaves, cp_context=ctx, intra_cp=8)
        grads = torch.autograd.grad(o, list(leaves.values()), do[:, part].to(o.dtype))
    # one more step, watched: the only host syncs are the call's agreement (a side stream's tiny gather)
    issued = []

    def record(message, *args, **kwargs):
        if "called a synchronizing CUDA operation" not in str(message):  # not set_sync_debug_mode's own note
            return
        ours = [f for f in traceback.extract_stack() if "/flashqla/" in f.filename or "/kernels/hopper/" in f.filename]
        issued.append(f"{ours[-1].name} ({os.path.basename(ours[-1].filename)}:{ours[-1].lineno})" if ours else "?")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            leaves = {n: t.detach().clone().requires_grad_(True) for n, t in local.items()}
            o, _ = flashqla.chunk_gated_delta_rule(**leaves, cp_context=ctx, intra_cp=8)
            grads = torch.autograd.grad(o, list(leaves.values()), do[:, part].to(o.dtype))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert all(name.startswith("gather_host_values") for name in issued), issued
    o_ref, _ = recurrence64(*(call[n] for n in NAMES), 128 ** -0.5, None, call["cu_seqlens"].tolist())
    ref = recurrence64_with_grads(call, do, torch.zeros(len(LENGTHS), 4, 128, 128, device="cuda"))
    errors = {"o": rel_err(o, o_ref[:, part])}
    errors.update({f"d{n}": rel_err(grad, ref[n][:, part]) for n, grad in zip(NAMES, grads)})
    print(f"\nrank {rank}: " + " ".join(f"{n} {e:.2e}" for n, e in errors.items()), flush=True)
    limits = {"o": 5e-3, **{f"d{n}": TOL[n] for n in NAMES}}
    for n, e in errors.items():
        assert e <= limits[n], (rank, n, e)


def test_nccl_cp_errors_raise_on_both_ranks_and_gradients_match_recurrence():
    run_on_ranks(2, _two_ranks, backend="nccl")
