"""Context parallelism: intra-card segments (AutoCP) and inter-card state passing."""
from .context import CPContext, build_cp_context
from .plan import SegmentPlan, auto_segment_chunks, plan_segments

__all__ = ["CPContext", "SegmentPlan", "auto_segment_chunks", "build_cp_context", "plan_segments"]
