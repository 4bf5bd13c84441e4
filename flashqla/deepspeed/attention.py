"""Softmax attention over packed documents that needs no mask: "varlen_sdpa".

DeepSpeed's Ulysses wrapper drops every 4-D mask (it was built for the local shard) and hands the core
attention the gathered, global position_ids. HF's "sdpa" then attends causally across document
boundaries, so a packed batch under SP > 1 computes something else than at SP = 1. This function reads
the documents from position_ids (a document starts wherever the position does not continue the
previous one, HF's rule) and runs causal SDPA on each document, at any SP size. HF builds no mask for
it (its name is not in HF's mask interface). Padding masks are not supported: pack instead. On GPUs
"flash_attention_2" reads packing from position_ids as well and is the faster choice.
"""
import torch
import torch.nn.functional as F

NAME = "varlen_sdpa"


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          position_ids=None, **_kwargs):
    """query [B, H, T, D], key/value [B, Hkv, T, D] -> ([B, T, H, D], None), causal within each document."""
    if attention_mask is not None:
        raise ValueError(f"attention_mask: {NAME} takes packing from position_ids and supports no mask")
    B, _, T, _ = query.shape
    if position_ids is None:
        position_ids = torch.arange(T, device=query.device)[None]
    position_ids = position_ids.expand(B, T)
    dropout = dropout if module.training else 0.0
    rows = []
    for b in range(B):
        starts = torch.ones(T, dtype=torch.bool, device=query.device)
        starts[1:] = position_ids[b, 1:] != position_ids[b, :-1] + 1
        bounds = starts.nonzero().reshape(-1).tolist() + [T]
        rows.append(torch.cat([
            F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                           dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True)
            for s, e in zip(bounds[:-1], bounds[1:])], dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def register_varlen_sdpa() -> str:
    """Registers the function with HF's AttentionInterface; returns its attn_implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_sdpa_attention)
    return NAME
