"""The sequence-parallel (SP) group, from DeepSpeed or from a plain torch.distributed group.

DeepSpeed learns its SP layout from an `mpu` object (`deepspeed.initialize(mpu=...)`): ZeRO shards
and reduces gradients over `get_sequence_data_parallel_group()` (every SP x DP rank) and divides by
the DP size only, so gradients are summed over the SP ranks of one sample and averaged over samples.
DeepSpeed's own mpu (`parallel_state_sp`, which Ulysses' `register_with_transformers` sets up) puts
contiguous rank blocks in one SP group; SP rank r holds shard r of the sequence.
"""
from __future__ import annotations

import torch.distributed as dist


def deepspeed_sequence_parallel_group():
    """DeepSpeed's SP group, or None when DeepSpeed has none (or only a trivial one)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    group = parallel_state_sp._SEQUENCE_PARALLEL_GROUP
    if group is None:
        try:
            group = groups._get_sequence_parallel_group()
        except (KeyError, AssertionError):  # no mpu and no device mesh with an SP dimension
            return None
    return group if dist.get_world_size(group) > 1 else None


def resolve_sequence_parallel_group(source=None):
    """-> the SP process group, or None for no SP (size 1).

    source: None (DeepSpeed's registered SP group, if any), an mpu object with
    `get_sequence_parallel_group()`, or a torch.distributed ProcessGroup.
    """
    if source is None:
        return deepspeed_sequence_parallel_group()
    if hasattr(source, "get_sequence_parallel_group"):
        group = source.get_sequence_parallel_group()
    elif isinstance(source, dist.ProcessGroup):
        group = source
    else:
        raise TypeError(f"sequence_parallel: expected None, an mpu or a torch.distributed ProcessGroup, "
                        f"got {type(source).__name__}")
    return group if dist.get_world_size(group) > 1 else None


class GroupMPU:
    """DeepSpeed's SP-only mpu interface (`parallel_state_sp`'s functions) over a given torch SP group.

    DeepSpeed recognises an SP-only mpu by its `initialize_sequence_parallel` attribute and then takes
    the DP size as world / SP (no model parallelism), exactly as for its own. The SP groups of the ranks
    must split the world into equal groups. Collective: every rank constructs it together.
    """

    def __init__(self, sp_group):
        if not dist.is_initialized():
            raise ValueError("sp_group: torch.distributed is not initialised")
        mine = sorted(dist.get_process_group_ranks(sp_group))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        layout = sorted({tuple(ranks) for ranks in everyone})
        covered = sorted(r for ranks in layout for r in ranks)
        if covered != list(range(dist.get_world_size())) or len({len(ranks) for ranks in layout}) != 1:
            raise ValueError(f"sp_group: the ranks' SP groups {layout} must split the world into equal groups")
        self._sp_group = sp_group

    @staticmethod
    def initialize_sequence_parallel(sequence_parallel_size):
        raise RuntimeError("GroupMPU wraps an existing SP group; it cannot build new ones")

    def get_sequence_parallel_group(self):
        return self._sp_group

    def get_sequence_parallel_world_size(self):
        return dist.get_world_size(self._sp_group)

    def get_sequence_parallel_rank(self):
        return dist.get_rank(self._sp_group)

    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD

    def get_sequence_data_parallel_world_size(self):
        return dist.get_world_size()

    def get_sequence_data_parallel_rank(self):
        return dist.get_rank()

    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank
