"""GatedDeltaNet: the GDN token mixer of Qwen3-Next / Qwen3.5, checkpoint-compatible with HF transformers.

Parameters have the names, shapes and row layout of HF's `Qwen3NextGatedDeltaNet` (field_notes §5):
`in_proj_qkvz` rows come per key-head group as [q (dk), k (dk), v (r*dv), z (r*dv)], `in_proj_ba`
rows per group as [b (r), a (r)], with r = Hv / Hk value heads per key head. The conv channels are
[all q | all k | all v]. Value head h reads key head h // r, which is the chunk op's native GQA mapping.

Forward (`causal_conv1d` and `gated_rms_norm` run fused TileLang kernels on SM90 GPUs and torch
elsewhere, flashqla/layers/fused.py; the gates, [T, Hv] only, stay in torch): projections -> causal depthwise conv + SiLU (restarting at every sequence) ->
g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) -> chunk_gated_delta_rule with
in-kernel L2 norm of q and k (eps 1e-6) -> gated RMSNorm with z -> out_proj.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import chunk_gated_delta_rule
from ..ops.checks import check_cu_seqlens
from ..ops.options import qwen3_next_gate
from .conv import causal_conv1d
from .halo import halo_prefix
from .norm import GatedRMSNorm


@dataclass
class GatedDeltaNetState:
    """What a layer carries from one call to the next (prefill, then continuation or decode).

    One row per sequence: N = batch size, or the number of packed sequences with cu_seqlens.
    conv_state: [N, conv_dim, W - 1], the pre-conv q|k|v rows of the last W - 1 tokens.
    recurrent_state: [N, Hv, K, V] fp32, the delta-rule state after the last token.
    Both None (the default) means "nothing seen yet"; `GatedDeltaNet.forward` fills them in.
    """

    conv_state: torch.Tensor | None = None
    recurrent_state: torch.Tensor | None = None


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int = 4,
        eps: float = 1e-6,
    ):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_k_heads", num_k_heads),
                            ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
                            ("head_v_dim", head_v_dim), ("conv_kernel_size", conv_kernel_size)):
            _positive_int(name, value)
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.hidden_size, self.eps = hidden_size, eps
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_kernel_size = conv_kernel_size
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        # holds the depthwise weight [conv_dim, 1, W] under HF's name; applied by causal_conv1d
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())  # HF's init, A in [0.01, 16]
        self.norm = GatedRMSNorm(head_v_dim, eps=eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @classmethod
    def from_config(cls, config) -> "GatedDeltaNet":
        """From a `Qwen3NextConfig`-like object (linear_* fields, rms_norm_eps, hidden_act)."""
        activation = getattr(config, "hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act must be 'silu' (the GDN conv activation), got {activation!r}")
        return cls(
            hidden_size=config.hidden_size,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel_size=config.linear_conv_kernel_dim,
            eps=config.rms_norm_eps,
        )

    # Run eagerly under torch.compile, like the op (flashqla/ops/chunk.py): the layer's host side (sequences
    # from attention_mask or cu_seqlens, the conv's per-sequence prefixes, state hand-over) reads tensor values
    @torch.compiler.disable
    def forward(self, hidden_states, attention_mask=None, cu_seqlens=None, state=None, cp_context=None):
        """hidden_states: [B, T, hidden_size]. Returns a tensor of the same shape.

        attention_mask: [B, T] of 0/1 (bool or int); each row's kept tokens, in order, form one
            sequence (left or right padding both work); padded positions read nothing, affect
            nothing and come out as zeros.
        cu_seqlens: int offsets of sequences packed in a [1, T, hidden] input (not with attention_mask).
        state: a GatedDeltaNetState to continue from; it is updated in place to the state after
            this call (so prefill(x1) then forward(x2) equals one pass over x1 ++ x2).
        cp_context: sequence parallelism: this rank holds the parts of a [1, T, hidden] pack that the
            context names (flashqla.cp.build_cp_context; contiguous or zigzag layout), as [1, T_local, hidden].
        """
        B, T = self._check_call(hidden_states, attention_mask, cu_seqlens, state, cp_context)
        if attention_mask is None:
            if cp_context is not None:
                cu_seqlens = cp_context.cu_seqlens
            return self._mix(hidden_states, cu_seqlens, state, cp_context)
        keep = attention_mask.bool()
        lengths = keep.sum(1)
        packed_cu = F.pad(lengths.cumsum(0), (1, 0))
        rows, cols = keep.nonzero(as_tuple=True)
        out = self._mix(hidden_states[rows, cols][None], packed_cu, state, None)
        return hidden_states.new_zeros(B, T, self.hidden_size).index_put((rows, cols), out[0])

    def _mix(self, x, cu_seqlens, state, cp_context):
        B, T, _ = x.shape
        if B * T == 0 and cp_context is None:  # nothing to mix (e.g. an all-padding batch): state unchanged
            return x.new_zeros(B, T, self.hidden_size)
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        q, k, v, z, b, a = self._split_projections(qkvz, ba)
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).reshape(B * T, self.conv_dim)

        conv_cu = cu_seqlens
        if conv_cu is None:  # every batch row is one sequence
            conv_cu = torch.arange(B + 1, device=x.device) * T
        prefix = self._conv_prefix(qkv, state, cp_context)
        qkv, conv_tail = causal_conv1d(qkv, self.conv1d.weight[:, 0, :], conv_cu, prefix)
        q, k, v = qkv.reshape(B, T, self.conv_dim).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

        g = qwen3_next_gate(a, self.A_log, self.dt_bias)
        beta = b.sigmoid()
        o, final_state = chunk_gated_delta_rule(
            q, k, v, g, beta,
            initial_state=None if state is None else state.recurrent_state,
            output_final_state=state is not None,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            cp_context=cp_context,
        )
        if state is not None:
            state.conv_state = conv_tail.transpose(1, 2)
            state.recurrent_state = final_state
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, T, self.value_dim))

    def _split_projections(self, qkvz, ba):
        """Undo HF's per-key-head-group row layout: q, k [B, T, Hk, dk]; v, z [B, T, Hv, dv]; b, a [B, T, Hv]."""
        B, T, _ = qkvz.shape
        r = self.num_v_heads // self.num_k_heads
        groups = qkvz.reshape(B, T, self.num_k_heads, 2 * self.head_k_dim + 2 * r * self.head_v_dim)
        q, k, v, z = groups.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim], dim=-1)
        b, a = ba.reshape(B, T, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        z = z.reshape(B, T, self.num_v_heads, self.head_v_dim)
        return q, k, v, z, b.reshape(B, T, self.num_v_heads), a.reshape(B, T, self.num_v_heads)

    def _conv_prefix(self, qkv, state, cp_context):
        """The W - 1 rows each sequence's conv reads before its first token, [N, W - 1, conv_dim] or None."""
        if state is not None and state.conv_state is not None:
            return state.conv_state.transpose(1, 2)
        if cp_context is not None:  # the neighbour parts' tails where a sequence continues, zeros elsewhere
            return halo_prefix(qkv, cp_context, self.conv_kernel_size - 1)
        return None

    def _check_call(self, hidden_states, attention_mask, cu_seqlens, state, cp_context):
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise ValueError("hidden_states must be a [B, T, hidden_size] tensor, got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        B, T, hidden = hidden_states.shape
        if hidden != self.hidden_size:
            raise ValueError(f"hidden_states has hidden size {hidden}, the layer expects {self.hidden_size}")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must be a [B, T] = {(B, T)} tensor, got "
                                 f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
            if attention_mask.is_floating_point() or attention_mask.is_complex():
                raise TypeError(f"attention_mask must be bool or integer, got {attention_mask.dtype}")
            if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
                raise ValueError("attention_mask must hold only 0 and 1")
            if cu_seqlens is not None:
                raise ValueError("pass either attention_mask (padded batch) or cu_seqlens (packed), not both")
        num_seqs = B
        if cu_seqlens is not None:
            num_seqs = len(check_cu_seqlens(cu_seqlens, B, T)) - 1
        if cp_context is not None:
            if attention_mask is not None or cu_seqlens is not None or state is not None:
                raise ValueError("cp_context takes the sequence layout from the context: "
                                 "attention_mask, cu_seqlens and state must be None")
            if B != 1:
                raise ValueError(f"cp_context needs a packed [1, T_local, hidden] input, got batch {B}")
            check_cu_seqlens(torch.as_tensor(cp_context.cu_seqlens), B, T)
        if state is not None:
            self._check_state(state, num_seqs)
        return B, T

    def _check_state(self, state, num_seqs):
        if not isinstance(state, GatedDeltaNetState):
            raise TypeError(f"state must be a GatedDeltaNetState, got {type(state).__name__}")
        expected = {
            "conv_state": (num_seqs, self.conv_dim, self.conv_kernel_size - 1),
            "recurrent_state": (num_seqs, self.num_v_heads, self.head_k_dim, self.head_v_dim),
        }
        for name, shape in expected.items():
            value = getattr(state, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"state.{name} must be {shape}, got {tuple(value.shape)}")
