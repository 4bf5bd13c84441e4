"""The next-token loss of a sequence split over SP ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, group=None):
    """This rank's share of the mean next-token loss over all tokens of the SP group.

    logits: [B, T_local, vocab]; labels: [B, T_local], already shifted (labels[t] is the token after t,
    -100 where there is none, e.g. at the end of each document). Returns (loss, mean): loss = local sum /
    global target count, so the SP ranks' losses add up to the mean; DeepSpeed sums gradients over the SP
    ranks, which makes them the gradients of the mean. `mean` (detached, equal on every rank) is for logging.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} does not match logits {tuple(logits.shape)}")
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    stats = torch.stack([total.detach(), (labels != IGNORE_INDEX).sum().to(total.dtype)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    count = stats[1].clamp(min=1)
    return total / count, stats[0] / count
