"""Megatron dist checkpoints of the model, its AdamW state and the training progress.

Model and optimizer moments are saved as Megatron sharded tensors (`model.sharded_state_dict()`, and
the same sharding for `exp_avg` / `exp_avg_sq`, as Megatron's own optimizers do), so every rank writes
only its shard, in Megatron's resharding format (resuming under the same layout is what is tested). The AdamW step count (the same for
every parameter) and the progress (step, losses, data position) are common state.

    <save_dir>/step<N>/     one checkpoint (Megatron's dist-checkpoint format)
    <save_dir>/latest       the name of the newest complete checkpoint
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)


def _optimizer_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sharded_state(model, optimizer, progress: dict) -> dict:
    """{"model", "optimizer", "progress"} with AdamW's moments sharded like their parameters."""
    model_state = model.sharded_state_dict()
    optim_state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: copy, do not edit
    steps = {float(s["step"]) for s in optim_state["state"].values()}
    optim_state["state"] = {i: {k: v for k, v in s.items() if k != "step"} for i, s in optim_state["state"].items()}
    if len(steps) > 1:
        raise ValueError(f"optimizer: parameters are at different steps {sorted(steps)}")
    id_to_param = get_param_id_to_sharded_param_map(model_state, _optimizer_params(optimizer))
    optim_state_to_sharding_state(optim_state, id_to_param)
    return {"model": model_state, "optimizer": optim_state,
            "progress": {**progress, "adam_step": steps.pop() if steps else 0.0}}


def save(save_dir: str | Path, model, optimizer, progress: dict) -> Path:
    """Write checkpoint step<progress['step']> on every rank of the job; returns its path."""
    path = Path(save_dir) / f"step{progress['step']}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, progress), str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(save_dir) / "latest").write_text(path.name)
    return path


def load_latest(save_dir: str | Path, model, optimizer) -> dict:
    """Restore the newest checkpoint in `save_dir` into model and optimizer; returns its progress."""
    latest = Path(save_dir) / "latest"
    if not latest.exists():
        raise FileNotFoundError(f"--resume: no checkpoint in {save_dir} (no 'latest' file)")
    for p in _optimizer_params(optimizer):  # AdamW builds its state lazily; the template needs it
        state = optimizer.state[p]
        state.setdefault("exp_avg", torch.zeros_like(p))
        state.setdefault("exp_avg_sq", torch.zeros_like(p))
        state.setdefault("step", torch.tensor(0.0))
    template = _sharded_state(model, optimizer, {})
    loaded = dist_checkpointing.load(template, str(Path(save_dir) / latest.read_text().strip()))
    model.load_state_dict(loaded["model"])
    progress = dict(loaded["progress"])
    adam_step = torch.tensor(progress.pop("adam_step"))
    optim_state = loaded["optimizer"]
    for param_state in optim_state["state"].values():
        param_state["step"] = adam_step.clone()
    for group, saved in zip(optim_state["param_groups"], optimizer.state_dict()["param_groups"]):
        group["params"] = saved["params"]
    optimizer.load_state_dict(optim_state)
    return progress
