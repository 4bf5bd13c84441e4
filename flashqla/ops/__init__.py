from .chunk import chunk_gated_delta_rule, chunk_gdn
from .qk_norm import l2norm

__all__ = ["chunk_gated_delta_rule", "chunk_gdn", "l2norm"]
