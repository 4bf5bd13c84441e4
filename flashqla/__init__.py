"""flashqla: Gated DeltaNet chunked prefill for Hopper, with exact context parallelism."""
from .layers import GatedDeltaNet, GatedDeltaNetState
from .ops import chunk_gated_delta_rule
from .precompile import preload_kernels

__version__ = "0.1.0"
__all__ = ["GatedDeltaNet", "GatedDeltaNetState", "chunk_gated_delta_rule", "preload_kernels", "__version__"]
