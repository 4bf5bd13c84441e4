"""One rank of the 2-rank Megatron checks (started by mcore_harness.run_ranks).

    python mcore_worker.py WORKDIR SCENARIO [SCENARIO ...]

Starting ranks costs far more than the checks, so one process group runs every scenario in turn.
WORKDIR holds what the single-rank runs produced (see references.py). Each scenario rebuilds its
model under its parallel layout from those weights and compares its local share with the
reference; it issues every collective before comparing, and returns its failures instead of
raising, so one failed check neither hangs the other rank nor hides the next scenario. Each rank
writes WORKDIR/SCENARIO.rank<r>.json: the list of failures (empty = passed).
"""
import functools
import json
import re
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import mcore_harness as h
from layouts import load_balanced, tp_shard
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from flashqla.megatron import cp_contexts
from flashqla.megatron.config import StatePassingTransformerConfig

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}  # relative error, by the reference's dtype


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class Checks:
    """Collects failed comparisons of one scenario on this rank."""

    def __init__(self):
        self.failures = []

    def close(self, name, got, want):
        tolerance = TOLERANCE[want.dtype]  # an fp64 module keeps its norm weight in fp32 (Megatron's torch norm)
        err = rel_err(got, want)
        if not err < tolerance:
            self.failures.append(f"rank {dist.get_rank()}: {name} relative error {err:.3g} >= {tolerance}")

    def true(self, name, condition):
        if not condition:
            self.failures.append(f"rank {dist.get_rank()}: {name}")


def run(module, x, grad_out, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out, _ = module(x, None, **kwargs)
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def packed_params(cu_seqlens):
    if cu_seqlens is None:
        return None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=128, max_seqlen_kv=128)


def tp2(workdir):
    """TP 2 (heads sharded) equals TP 1: outputs, input grads, and each rank's slice of the grads."""
    checks = Checks()
    ref = torch.load(workdir / "reference.pt")
    h.init_parallel(tp=2)
    module = h.build_flashqla_gdn(h.gdn_config(tp=2))
    module.load_state_dict({n: tp_shard(module, n, p) for n, p in ref["state"].items()}, strict=False)
    out, dx, grads = run(module, ref["x"], ref["grad_out"])
    # replicated weight: each rank holds its heads' share of the grad
    dist.all_reduce(grads["out_norm.weight"], group=parallel_state.get_tensor_model_parallel_group())
    checks.close("output", out, ref["out"])
    checks.close("input grad", dx, ref["dx"])
    for name, grad in grads.items():
        checks.close(f"{name} grad", grad, tp_shard(module, name, ref["grads"][name]))
    return checks.failures


def _cp2_equals_cp1(checks, case, ref, config, **gdn_params):
    """Run the CP 2 module on this rank's share of `ref` and compare with the CP 1 reference;
    parameter grads after Megatron's reduction (a sum over the data-parallel x CP group)."""
    rank = parallel_state.get_context_parallel_rank()
    cu = ref.get("cu_seqlens")
    module = h.build_flashqla_gdn(config, **gdn_params)
    module.load_state_dict(ref["state"], strict=False)
    out, dx, grads = run(module, load_balanced(ref["x"], 2, rank, cu), load_balanced(ref["grad_out"], 2, rank, cu),
                         packed_seq_params=packed_params(cu))
    for grad in grads.values():
        dist.all_reduce(grad, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    checks.close(f"{case} output", out, load_balanced(ref["out"], 2, rank, cu))
    checks.close(f"{case} input grad", dx, load_balanced(ref["dx"], 2, rank, cu))
    for name, grad in grads.items():
        checks.close(f"{case} {name} grad", grad, ref["grads"][name])


def cp2_head_a2a(workdir):
    """CP 2 with Megatron's head all-to-all equals CP 1, padded (sbhd) and packed (thd)."""
    checks = Checks()
    h.init_parallel(cp=2)
    for case in ("reference", "reference_thd"):
        _cp2_equals_cp1(checks, case, torch.load(workdir / f"{case}.pt"), h.gdn_config(cp=2), cp_mode="head_a2a")
    return checks.failures


def cp2_state_passing(workdir):
    """CP 2 by state passing equals CP 1 (fp64), padded and packed (the packed run with the output norm
    recomputed); sequences cross the CP split, one is 4 tokens (1 per chunk: the conv halo reaches
    over three parts)."""
    checks = Checks()
    h.init_parallel(cp=2)
    fp64 = dict(cp=2, params_dtype=torch.float64)
    _cp2_equals_cp1(checks, "padded", torch.load(workdir / "reference_fp64_padded.pt"), h.gdn_config(**fp64),
                    cp_mode="state_passing")
    recompute = dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"])
    _cp2_equals_cp1(checks, "packed", torch.load(workdir / "reference_fp64_thd.pt"),
                    h.gdn_config(**fp64, **recompute), cp_mode="state_passing")
    return checks.failures


def cp2_state_passing_odd_heads(workdir):
    """3 value heads (1 key head) at CP 2: Megatron's config refuses it, StatePassingTransformerConfig
    builds it, head all-to-all refuses it, state passing equals CP 1 (fp64)."""
    checks = Checks()
    h.init_parallel(cp=2)
    heads = dict(linear_num_key_heads=1, linear_num_value_heads=3)
    try:
        h.gdn_config(cp=2, **heads)
        checks.true("Megatron's TransformerConfig accepted 1 key head at CP 2", False)
    except AssertionError:
        pass
    config = h.gdn_config(cp=2, config_class=StatePassingTransformerConfig, params_dtype=torch.float64, **heads)
    try:
        h.build_flashqla_gdn(config, cp_mode="head_a2a")
        checks.true("head all-to-all accepted 3 value heads at CP 2", False)
    except ValueError as err:
        checks.true(f"the head all-to-all error names the heads: {err}", "linear_num_key_heads" in str(err))
    _cp2_equals_cp1(checks, "odd heads", torch.load(workdir / "reference_fp64_odd_heads.pt"), config,
                    cp_mode="state_passing")
    return checks.failures


def contexts_shared(workdir):
    """A context is built once per batch layout and shared: 3 layers and a second batch with equal
    (but new) offset tensors build one; new offsets build one more."""
    checks = Checks()
    h.init_parallel(cp=2)
    built = []
    build = cp_contexts.build_cp_context

    def counting_build(*args, **kwargs):
        built.append(kwargs["cu_seqlens_cpu"].tolist())
        return build(*args, **kwargs)

    cp_contexts.build_cp_context = counting_build
    try:
        layers = [h.build_flashqla_gdn(h.gdn_config(cp=2), cp_mode="state_passing") for _ in range(3)]
        for lengths in ([8, 24], [8, 24], [16, 16]):
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            x = torch.randn(sum(lengths) // 2, 1, 32)
            for layer in layers:
                x, _ = layer(x, None, packed_seq_params=packed_params(cu))
    finally:
        cp_contexts.build_cp_context = build
    checks.true(f"contexts built for {built}, expected [[0, 8, 32], [0, 16, 32]]", built == [[0, 8, 32], [0, 16, 32]])
    return checks.failures


def load_tp2(workdir):
    """A dist checkpoint saved at TP 1 loads at TP 2 and gives the TP 1 output."""
    checks = Checks()
    ref = torch.load(workdir / "reference.pt")
    h.init_parallel(tp=2)
    module = h.build_flashqla_gdn(h.gdn_config(tp=2))
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    state = dist_checkpointing.load(module.sharded_state_dict(), str(workdir / "checkpoint"))
    module.load_state_dict(state, strict=False)
    out, _ = module(ref["x"], None)
    checks.close("output after TP1 -> TP2 load", out.detach(), ref["out"])
    return checks.failures


def hybrid_gpt_cp2(workdir):
    """The tiny hybrid GPT (3 GDN layers, softmax attention every 4th) trained at CP 2 with state
    passing gives the CP 1 losses, step by step."""
    import gpt_harness

    checks = Checks()
    ref = torch.load(workdir / "hybrid_gpt.pt")
    losses, _ = gpt_harness.train_tiny_hybrid(cp=2, state=ref["state"], steps=len(ref["losses"]))
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        checks.true(f"step {step}: loss {got:.7f} at CP 2 vs {want:.7f} at CP 1", abs(got - want) < 1e-5 * abs(want))
    return checks.failures


def _hybrid_gpt_at(workdir, tp: int, cp: int):
    """The tiny hybrid GPT from the CP 1 run's initial weights (a TP 1 dist checkpoint, resharded on load),
    trained at TP x CP with state passing, gives the CP 1 losses step by step."""
    import gpt_harness

    checks = Checks()
    ref = torch.load(workdir / "hybrid_gpt.pt")
    losses, _ = gpt_harness.train_tiny_hybrid(cp=cp, tp=tp, checkpoint=workdir / "hybrid_gpt_checkpoint",
                                              steps=len(ref["losses"]))
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        checks.true(f"step {step}: loss {got:.7f} at TP {tp} x CP {cp} vs {want:.7f} at CP 1",
                    abs(got - want) < 1e-5 * abs(want))
    return checks.failures


def batch_slicing(workdir):
    """The launcher's get_batch slices a row over the CP group only: whole at TP 2, Megatron's load-balanced
    halves at CP 2 (megatron-core 0.19 slices over the world group unless it is given the CP group)."""
    from flashqla.megatron.pretrain_gpt import get_batch

    checks = Checks()
    row = torch.arange(16).view(1, 16)
    batch = dict(tokens=row, labels=row + 1, loss_mask=torch.ones(1, 16), position_ids=row, attention_mask=None)
    for tp, cp in ((2, 1), (1, 2)):
        h.init_parallel(tp=tp, cp=cp)
        tokens = get_batch(iter([dict(batch)]))[0]
        want = load_balanced(row.view(16), cp, parallel_state.get_context_parallel_rank()).view(1, -1)
        checks.true(f"TP {tp} CP {cp}: tokens {tokens.tolist()} instead of {want.tolist()}",
                    tokens.shape == want.shape and torch.equal(tokens.cpu(), want))
    return checks.failures


SCENARIOS = {f.__name__: f for f in (tp2, cp2_head_a2a, cp2_state_passing, cp2_state_passing_odd_heads,
                                     contexts_shared, load_tp2, hybrid_gpt_cp2, batch_slicing)}

if __name__ == "__main__":
    torch.set_num_threads(1)
    workdir, names = Path(sys.argv[1]), sys.argv[2:]
    for name in names:
        try:
            # hybrid_gpt_tp<T>_cp<C>: the tiny hybrid GPT at that layout against its CP 1 losses
            layout = re.fullmatch(r"hybrid_gpt_tp(\d+)_cp(\d+)", name)
            scenario = SCENARIOS[name] if layout is None else functools.partial(
                _hybrid_gpt_at, tp=int(layout[1]), cp=int(layout[2]))
            failures = scenario(workdir)
        except Exception:  # recorded for the test that owns the scenario; the next scenario still runs
            failures = [f"rank {dist.get_rank()} raised:\n{traceback.format_exc()}"]
        (workdir / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(failures))
        dist.barrier()
    dist.destroy_process_group()
