"""DeepSpeed glue: exact GDN sequence parallelism next to Ulysses, ZeRO-3 leaves, SP loss.

Only framework glue lives here; flashqla's core never imports DeepSpeed. See docs/deepspeed.md.
"""
from .attention import register_varlen_sdpa, varlen_sdpa_attention
from .engine import initialize, load_config, skip_cpu_shm_build, zero3_leaf_classes
from .groups import GroupMPU, resolve_sequence_parallel_group
from .loss import causal_lm_loss
from .sequence_parallel import enable_gdn_sequence_parallel, gdn_layers_off_path

__all__ = ["GroupMPU", "causal_lm_loss", "enable_gdn_sequence_parallel", "gdn_layers_off_path", "initialize",
           "load_config", "register_varlen_sdpa", "resolve_sequence_parallel_group", "skip_cpu_shm_build",
           "varlen_sdpa_attention", "zero3_leaf_classes"]
