"""A TransformerConfig whose GDN head counts are checked against TP only, for state-passing CP.

Megatron's `TransformerConfig.__post_init__` asserts that the GDN key and value head counts are
multiples of TP x CP, because its head all-to-all hands every CP rank a share of the heads. With
flashqla's state passing every CP rank keeps all of its TP rank's heads and only the tokens are
split, so the heads need to divide over TP alone: CP 2 works with 3 value heads, CP 8 with 4.

`StatePassingTransformerConfig` runs Megatron's own checks with both head counts scaled by CP for the
duration of the check (nk*cp % (tp*cp) == 0 exactly when nk % tp == 0, and nv/nk is unchanged), so
every other check, CP ones included, runs as Megatron wrote it. A model built from it must use
`cp_mode="state_passing"` in every GDN layer; flashqla's GatedDeltaNet refuses head all-to-all CP when
the heads do not split over TP x CP.
"""
import dataclasses

from megatron.core.transformer import TransformerConfig


@dataclasses.dataclass
class StatePassingTransformerConfig(TransformerConfig):
    def __post_init__(self):
        cp = self.context_parallel_size
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        if self.experimental_attention_variant != "gated_delta_net" or cp == 1 or nk is None or nv is None:
            super().__post_init__()
            return
        self.linear_num_key_heads, self.linear_num_value_heads = nk * cp, nv * cp
        try:
            super().__post_init__()
        finally:
            self.linear_num_key_heads, self.linear_num_value_heads = nk, nv
