"""Exact sequence parallelism for GDN layers under DeepSpeed.

DeepSpeed's Ulysses / ALST swaps only the softmax attention (head all-to-all); a GDN layer on a shard
would run the shard as if it were a whole sequence (wrong outputs and gradients, no error). Here every
GDN layer runs flashqla's state-passing CP over the SP group instead: the conv halo and the S0 chain
cross the shard boundaries, so SP = W computes what SP = 1 computes.
"""
from __future__ import annotations

import torch

from ..layers import GatedDeltaNet
from .groups import resolve_sequence_parallel_group


def gdn_layers_off_path(model: torch.nn.Module) -> list[str]:
    """Names of the modules that look like a GDN mixer (class name ending in "GatedDeltaNet") but are not
    flashqla's: under SP they would treat each shard as a whole sequence."""
    return [name for name, module in model.named_modules()
            if type(module).__name__.endswith("GatedDeltaNet") and not isinstance(module, GatedDeltaNet)]


class _RequireCPContext:
    """Forward pre-hook of a flashqla GDN layer: under SP a call without cp_context is an error."""

    def __init__(self, name: str, sp_size: int):
        self.name, self.sp_size = name, sp_size

    def __call__(self, module, args, kwargs):
        if self.sp_size > 1 and kwargs.get("cp_context") is None:
            raise ValueError(f"{self.name}: sequence parallelism is on (SP = {self.sp_size}) but this GDN layer was "
                             "called without cp_context; it would run its shard as a whole sequence")


def enable_gdn_sequence_parallel(model: torch.nn.Module, sequence_parallel=None):
    """Puts every GDN layer of `model` on flashqla's exact SP path; returns the SP group (None if SP = 1).

    sequence_parallel: None (DeepSpeed's SP group, e.g. from Ulysses' `register_with_transformers`), an mpu,
    or a torch.distributed group. HF Qwen3-Next models get their GDN layers swapped for flashqla's
    (`flashqla.hf.use_flashqla_gdn`), fed a CP context built from each step's position_ids. Other models
    must pass `cp_context` to their flashqla GatedDeltaNet layers themselves. Raises ValueError if SP > 1
    and any GDN layer is not flashqla's, and makes flashqla's layers raise when called without a context.
    """
    import torch.distributed as dist

    group = resolve_sequence_parallel_group(sequence_parallel)
    sp_size = 1 if group is None else dist.get_world_size(group)
    if _is_hf_qwen3_next(model):
        from ..hf import use_flashqla_gdn

        use_flashqla_gdn(model, sequence_parallel_group=group)
    if sp_size > 1:
        off_path = gdn_layers_off_path(model)
        if off_path:
            raise ValueError(f"model: sequence parallelism (SP = {sp_size}) with GDN layers that are not flashqla's "
                             f"would silently give wrong results: {off_path}")
    for name, module in model.named_modules():
        if isinstance(module, GatedDeltaNet):
            guard = getattr(module, "_flashqla_sp_guard", None)
            if guard is None:
                guard = _RequireCPContext(name, sp_size)
                module.register_forward_pre_hook(guard, with_kwargs=True)
                module._flashqla_sp_guard = guard
            guard.sp_size = sp_size
    return group


def _is_hf_qwen3_next(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "qwen3_next"
