"""Context parallelism: intra-card segments (AutoCP) and inter-card state passing."""
from .plan import SegmentPlan, auto_segment_chunks, plan_segments

__all__ = ["SegmentPlan", "auto_segment_chunks", "plan_segments"]
