"""nn.Module layers built on the flashqla ops."""
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetState

__all__ = ["GatedDeltaNet", "GatedDeltaNetState"]
