"""Causal depthwise conv1d over q/k/v channels that restarts at every packed-sequence boundary.

Megatron's GDN uses FLA's `causal_conv1d` (Triton) for this, and `F.conv1d` in deterministic
mode, which cannot see `cu_seqlens`. This torch version serves both layouts: a sum of W shifted
copies of the input, each tap masked where it would reach into the previous sequence.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def positions_in_sequence(T: int, cu_seqlens: Optional[torch.Tensor], device) -> torch.Tensor:
    """Index of each of the T tokens inside its own sequence ([T], int64)."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    seq_of_token = torch.searchsorted(starts[1:], t, right=True)
    return t - starts[seq_of_token]


def causal_depthwise_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y[b, t, d] = bias[d] + sum_j weight[d, W-1-j] * x[b, t-j, d] over taps inside t's sequence.

    x: [B, T, D]; weight: [D, W] or nn.Conv1d's [D, 1, W]; cu_seqlens (packed, B == 1) restarts
    the window at every sequence start, as if each sequence were zero-padded on the left.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [{D}, W] or [{D}, 1, W], got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"bias must be [{D}], got shape {tuple(bias.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1, got x with batch {B}")
    W = weight.shape[1]
    pos = positions_in_sequence(T, cu_seqlens, x.device).view(1, T, 1)
    y = x * weight[:, W - 1]
    for shift in range(1, W):
        x_shifted = F.pad(x, (0, 0, shift, 0))[:, :T]
        y = y + (x_shifted * weight[:, W - 1 - shift]).masked_fill(pos < shift, 0.0)
    if bias is not None:
        y = y + bias
    return y
