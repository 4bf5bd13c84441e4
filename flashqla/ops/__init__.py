from .chunk import chunk_gated_delta_rule, l2norm

__all__ = ["chunk_gated_delta_rule", "l2norm"]
