"""Bridge to HF transformers' Qwen3-Next: flashqla's GatedDeltaNet in place of `Qwen3NextGatedDeltaNet`.

`use_flashqla_gdn(model)` swaps every HF GDN mixer for `HFGatedDeltaNet` (same parameter names, shapes
and row layout, so weights carry over) and hooks the base model so each GDN layer learns where the
packed documents start.

How HF describes packed sequences, and what the GDN layers receive (transformers 5.x):
- `position_ids` that restart inside a row (HF's `DataCollatorWithFlattening`; a new document starts
  wherever position_ids[t] != position_ids[t-1] + 1, HF's `find_packed_sequence_indices` rule). HF's
  decoder layer does not hand position_ids to the GDN mixer, so a forward pre-hook on the base model
  turns them into `cu_seqlens` (a kwarg every decoder layer forwards to its mixer).
- `cu_seq_lens_q` (the collator's `return_flash_attn_kwargs=True`): used as given.
- a 2-D `attention_mask` of 0/1 (padding): HF passes it to the GDN layers, which skip padded tokens.
- sequence parallelism (`sequence_parallel_group=`): every rank holds one contiguous shard of one
  packed row; the hook gathers the shards' position_ids, builds the global cu_seqlens and a
  `flashqla.cp` context over the group, and passes it as `cp_context`, so each GDN layer runs the exact
  state-passing CP (conv halo + S0 chain) instead of treating its shard as a whole sequence.
The extra kwargs also reach the softmax-attention functions, which ignore unknown kwargs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .cp import build_cp_context
from .layers import GatedDeltaNet


class HFGatedDeltaNet(GatedDeltaNet):
    """flashqla's GatedDeltaNet behind the call HF's `Qwen3NextDecoderLayer` makes of its mixer."""

    layer_idx: int = 0

    def forward(self, hidden_states, cache_params=None, attention_mask=None, cp_context=None, cu_seqlens=None,
                cu_seq_lens_q=None, **_attention_kwargs):
        if cache_params is not None:
            raise ValueError("cache_params: flashqla's GDN layers keep no HF cache (training and cache-free "
                             "prefill); call the model with use_cache=False, or generate with HF's own layers")
        if cp_context is not None:
            return super().forward(hidden_states, cp_context=cp_context)
        cu_seqlens = cu_seqlens if cu_seqlens is not None else cu_seq_lens_q
        if cu_seqlens is not None:  # offsets over the flattened rows (the FlashAttention varlen convention)
            B, T, H = hidden_states.shape
            return super().forward(hidden_states.reshape(1, B * T, H), cu_seqlens=cu_seqlens).reshape(B, T, H)
        return super().forward(hidden_states, attention_mask=attention_mask)


def _hf_gdn_class():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    return Qwen3NextGatedDeltaNet


def replace_gated_deltanet(model: torch.nn.Module) -> int:
    """Replaces every HF `Qwen3NextGatedDeltaNet` in `model` by an `HFGatedDeltaNet` holding the same
    weights (same device and dtype). Returns how many were replaced. Call it before ZeRO-3 partitions
    the parameters (before `deepspeed.initialize`, outside `zero.Init`)."""
    hf_class = _hf_gdn_class()
    targets = [(name, module) for name, module in model.named_modules() if type(module) is hf_class]
    for name, old in targets:
        if any(hasattr(p, "ds_id") for p in old.parameters()):
            raise ValueError(f"model: {name} is partitioned by ZeRO-3; replace the GDN layers before "
                             "deepspeed.initialize and outside deepspeed.zero.Init")
        new = HFGatedDeltaNet(hidden_size=old.hidden_size, num_k_heads=old.num_k_heads, num_v_heads=old.num_v_heads,
                              head_k_dim=old.head_k_dim, head_v_dim=old.head_v_dim,
                              conv_kernel_size=old.conv_kernel_size, eps=old.layer_norm_epsilon)
        if old.activation not in ("silu", "swish"):
            raise ValueError(f"model: {name} uses activation {old.activation!r}; the GDN conv needs silu")
        weight = next(old.parameters())
        new.to(device=weight.device, dtype=weight.dtype)
        new.load_state_dict(old.state_dict())
        new.layer_idx = old.layer_idx
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return len(targets)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids -> bool [B * T]: True where a document starts (every row start, and wherever
    the position does not continue the previous token's)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.reshape(-1)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Offsets (int32) of the documents of the flattened rows, from 0 to B * T."""
    starts = document_starts(position_ids).nonzero().reshape(-1)
    end = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


def _global_position_ids(position_ids: torch.Tensor, group) -> torch.Tensor:
    """Concatenates the ranks' [1, T_local] shards in rank order (shards may differ in length)."""
    local = position_ids.reshape(-1)
    lengths = [torch.zeros(1, dtype=torch.int64, device=local.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([local.numel()], device=local.device), group=group)
    longest = max(int(n) for n in lengths)
    padded = torch.cat([local.long(), local.new_zeros(longest - local.numel(), dtype=torch.long)])
    shards = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(shards, padded, group=group)
    return torch.cat([shard[: int(n)] for shard, n in zip(shards, lengths)])[None]


class _PackingHook:
    """Forward pre-hook of the base model: turns position_ids into cu_seqlens or a CP context."""

    def __init__(self, conv_kernel_size: int, group):
        self.conv_kernel_size, self.group = conv_kernel_size, group

    def __call__(self, module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        mask = kwargs.get("attention_mask")
        padded = isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all())
        if self.group is not None:
            if position_ids is None or position_ids.shape[0] != 1 or padded:
                raise ValueError("sequence parallelism needs one packed row per rank: pass position_ids of shape "
                                 "[1, T_local] (restarting at each document) and no padding attention_mask")
            cu_global = cu_seqlens_from_position_ids(_global_position_ids(position_ids, self.group))
            kwargs["cp_context"] = build_cp_context(cu_global, group=self.group, layout="contiguous",
                                                    conv1d_kernel_size=self.conv_kernel_size)
        elif position_ids is not None and not padded and kwargs.get("cu_seq_lens_q") is None:
            if kwargs.get("past_key_values") is None and bool(document_starts(position_ids).sum() > position_ids.shape[0]):
                kwargs["cu_seqlens"] = cu_seqlens_from_position_ids(position_ids)
        return args, kwargs


def use_flashqla_gdn(model: torch.nn.Module, sequence_parallel_group=None) -> int:
    """Replaces the HF GDN layers of a Qwen3-Next model (`...ForCausalLM` or the base model) by flashqla's
    and routes packing (and, with `sequence_parallel_group`, the CP context) to them. Returns the number of
    layers replaced. Sets model.config.use_cache = False (the flashqla layers keep no HF cache).
    Idempotent: a second call only updates the group."""
    replaced = replace_gated_deltanet(model)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    base = getattr(model, "base_model", model)
    if not hasattr(base, "layers"):
        raise TypeError(f"model: {type(model).__name__} has no decoder `layers` (expected an HF Qwen3-Next model)")
    layers = [m for m in model.modules() if isinstance(m, HFGatedDeltaNet)]
    if not layers:
        return replaced
    hook = getattr(base, "_flashqla_packing_hook", None)
    if hook is None:
        hook = _PackingHook(layers[0].conv_kernel_size, sequence_parallel_group)
        base.register_forward_pre_hook(hook, with_kwargs=True)
        base._flashqla_packing_hook = hook
    hook.group = sequence_parallel_group
    return replaced
