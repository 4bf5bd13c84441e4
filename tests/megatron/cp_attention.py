"""Causal softmax attention that works under context parallelism on CPU (test support).

Megatron's local `DotProductAttention` refuses CP > 1 (only Transformer Engine's attention does CP),
so the CPU tests of hybrid GDN + attention models at CP 2 put this core attention in the softmax
layers: every rank all-gathers K and V of the whole sequence, puts them in token order, and attends
its local queries (Megatron's load-balanced order: chunks r and 2cp-1-r of each row) with a causal
mask on global positions. Padded (sbhd) input only, no dropout, no attention mask beyond causal.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule


class _GatherSequence(torch.autograd.Function):
    """[s, ...] on each rank -> [cp * s, ...] (rank after rank); backward sums every rank's gradient
    of this rank's slot."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group = group
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


def load_balanced_positions(local_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of a rank's local tokens: chunks r and 2cp-1-r of 2*cp equal chunks."""
    chunk = local_len // 2
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (cp_rank, 2 * cp_size - 1 - cp_rank)])


class GatheredKVAttention(MegatronModule):
    """Same constructor and forward as Megatron's DotProductAttention."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.cp_group = parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, heads, d], key/value [sq, b, groups, d] (local tokens) -> [sq, b, heads * d]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("GatheredKVAttention: padded input without attention bias only")
        cp_size, cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        sq = query.shape[0]
        positions = [load_balanced_positions(sq, cp_size, r) for r in range(cp_size)]
        order = torch.argsort(torch.cat(positions))  # gathered rows -> token order
        key = _GatherSequence.apply(key, self.cp_group)[order]
        value = _GatherSequence.apply(value, self.cp_group)[order]
        repeat = self.heads // self.groups
        q = query.permute(1, 2, 0, 3)  # [b, heads, sq, d]
        k = key.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)
        v = value.repeat_interleave(repeat, dim=2).permute(1, 2, 0, 3)
        causal = positions[cp_rank][:, None] >= torch.arange(key.shape[0])[None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, query.shape[1], -1)
