"""`initialize`: deepspeed.initialize with the GDN SP path, the right SP groups and ZeRO-3 leaf modules."""
from __future__ import annotations

import json
import os

import torch

from .groups import GroupMPU
from .sequence_parallel import enable_gdn_sequence_parallel, gdn_layers_off_path


def load_config(config) -> dict:
    """A DeepSpeed config given as a dict or as the path of a JSON file."""
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a JSON path, got {type(config).__name__}")
    return config


def zero3_leaf_classes() -> list[type]:
    """Modules ZeRO-3 must gather as a whole: HF's Qwen3-Next MoE block runs a data-dependent subset of
    its experts (otherwise ranks wait on different parameter gathers). flashqla's GDN layer is not one:
    marked as a leaf, ZeRO-3 frees its out_proj weight before that weight's gradient arrives."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    except ImportError:
        return []
    return [Qwen3NextSparseMoeBlock]


def skip_cpu_shm_build() -> None:
    """On the CPU accelerator, deepspeed.init_distributed JIT-builds a shared-memory all-reduce op
    (about a minute of g++); training collectives go through torch.distributed, so mark it unavailable."""
    from deepspeed.accelerator import get_accelerator
    import deepspeed.ops

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def initialize(model: torch.nn.Module, config, mpu=None, sequence_parallel_group=None, **kwargs):
    """deepspeed.initialize for models with GDN layers; returns what it returns (engine, optimizer, ...).

    SP comes from `mpu` (e.g. Ulysses' `register_with_transformers`, or
    `deepspeed.runtime.sequence_parallel.parallel_state_sp` after `initialize_sequence_parallel(n)`)
    or from a plain torch.distributed `sequence_parallel_group` (wrapped in a GroupMPU). Both make
    DeepSpeed sum gradients over the SP ranks of a sample and average them over samples. The config-mesh
    route (`"sequence_parallel_size"` in the config) is refused: with ZeRO-1/2 it reduces gradients over
    the DP dimension only, so the SP replicas drift apart (DeepSpeed issue #6868).
    """
    import deepspeed

    config = load_config(config)
    if int(config.get("sequence_parallel_size", 1)) > 1:
        raise ValueError("config: \"sequence_parallel_size\" (DeepSpeed's device-mesh SP route) leaves ZeRO-1/2 "
                         "replicas diverging; remove it and pass an mpu (Ulysses' register_with_transformers or "
                         "parallel_state_sp.initialize_sequence_parallel) or sequence_parallel_group instead")
    if mpu is not None and sequence_parallel_group is not None:
        raise ValueError("pass either mpu or sequence_parallel_group, not both")
    if sequence_parallel_group is not None:
        mpu = GroupMPU(sequence_parallel_group)
    holds_parameters = isinstance(kwargs.get("optimizer"), torch.optim.Optimizer) or "model_parameters" in kwargs
    if holds_parameters and gdn_layers_off_path(model):
        raise ValueError("optimizer / model_parameters hold parameters of GDN layers that are about to be replaced; "
                         "call flashqla.deepspeed.enable_gdn_sequence_parallel(model, mpu) before collecting them")
    if mpu is None:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
            mpu = parallel_state_sp
    group = enable_gdn_sequence_parallel(model, mpu)
    zero = dict(config.get("zero_optimization", {}))
    if int(zero.get("stage", 0)) == 3 and group is not None:
        # DeepSpeed 0.19.8's ZeRO-3 reduce-scatter path averages gradients over SP x DP ranks instead of
        # summing over SP, so they come out 1/SP too small (hidden by clipping); its all-reduce path is right
        if zero.get("reduce_scatter") is True:
            raise ValueError("config: ZeRO-3 with sequence parallelism needs zero_optimization.reduce_scatter = "
                             "false (DeepSpeed's reduce-scatter path divides the gradients by the SP size)")
        config = {**config, "zero_optimization": {**zero, "reduce_scatter": False}}
    leaves = [cls for cls in zero3_leaf_classes() if any(isinstance(m, cls) for m in model.modules())]
    if int(zero.get("stage", 0)) == 3 and leaves:  # DeepSpeed refuses classes the model lacks (dense models)
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, leaves)
    skip_cpu_shm_build()
    return deepspeed.initialize(model=model, config=config, mpu=mpu, **kwargs)
