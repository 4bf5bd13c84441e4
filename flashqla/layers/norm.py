"""Gated RMSNorm of the GDN output: weight * rmsnorm(o) * silu(z), per value head.

Precision follows Qwen3-Next (HF `Qwen3NextRMSNormGated`): the RMS is taken in fp32, the normalised
value is cast back to the input dtype before the weight, the gate is applied in fp32.
`gated_rms_norm` runs the fused TileLang kernels (flashqla/layers/fused.py) on an SM90 GPU where the call
fits them (FLASHQLA_FUSED_LAYER_OPS=0 turns them off) and `gated_rms_norm_reference` otherwise.
"""
import torch
import torch.nn.functional as F
from torch import nn


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gated_rms_norm_reference's contract; the fused kernels serve it where they can (module docstring)."""
    if o.is_cuda:
        from . import fused

        reason = fused.norm_unsupported_reason(o, z, weight)
        if reason is None:
            return fused.gated_rms_norm(o, z, weight, eps)
        fused.note_fallback_once("gated_rms_norm", reason)
    return gated_rms_norm_reference(o, z, weight, eps)


def gated_rms_norm_reference(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z: [..., D]; weight: [D]. Returns weight * o / rms(o) * silu(z) in o's dtype."""
    o32 = o.float()
    normed = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(o.dtype)


class GatedRMSNorm(nn.Module):
    """Holds `weight` [head_dim] (initialised to ones: not zero-centred, as in Qwen3-Next)."""

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, z, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"
