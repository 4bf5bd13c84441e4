"""One model config for the DeepSpeed and Megatron pretraining examples: a Qwen3-Next-style hybrid
(three GDN layers, then one gated softmax-attention layer, repeated; optional MoE MLPs).

`SIZES[name]` holds the shape; `hf_config(name)` turns it into a transformers `Qwen3NextConfig`
(what train_deepspeed.py builds), and the fields map one to one onto Megatron's --linear-* flags.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_layers: int  # every 4th layer is softmax attention, the others GDN
    attention_heads: int
    kv_heads: int
    attention_head_dim: int
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_head_dim: int  # K = V
    ffn_size: int
    seq_len: int  # tokens per packed training row
    num_experts: int = 0  # 0: dense MLPs; else MoE (top-2, one shared expert) in every other layer
    expert_ffn_size: int = 0
    sequence_parallel: int = 1  # GPUs one row is split over (flashqla CP for GDN, Ulysses for attention)


SIZES = {
    # a few minutes on a 2-core CPU
    "tiny": ModelSize(hidden_size=128, num_layers=4, attention_heads=4, kv_heads=2, attention_head_dim=32,
                      gdn_key_heads=2, gdn_value_heads=4, gdn_head_dim=32, ffn_size=256, seq_len=512,
                      num_experts=4, expert_ffn_size=128),
    # ~190M parameters, one GPU
    "small": ModelSize(hidden_size=1024, num_layers=16, attention_heads=8, kv_heads=2, attention_head_dim=128,
                       gdn_key_heads=8, gdn_value_heads=16, gdn_head_dim=128, ffn_size=3072, seq_len=4096),
    # 256K-token rows split over 2 GPUs
    "long256k": ModelSize(hidden_size=1024, num_layers=8, attention_heads=8, kv_heads=2, attention_head_dim=128,
                          gdn_key_heads=8, gdn_value_heads=16, gdn_head_dim=128, ffn_size=3072,
                          seq_len=262144, sequence_parallel=2),
}


def hf_config(name: str, vocab_size: int, attn_implementation: str = "sdpa"):
    """The transformers Qwen3NextConfig of size `name`."""
    from transformers import Qwen3NextConfig

    if name not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {name!r}")
    s = SIZES[name]
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        full_attention_interval=4, num_attention_heads=s.attention_heads, num_key_value_heads=s.kv_heads,
        head_dim=s.attention_head_dim, partial_rotary_factor=0.25, linear_num_key_heads=s.gdn_key_heads,
        linear_num_value_heads=s.gdn_value_heads, linear_key_head_dim=s.gdn_head_dim,
        linear_value_head_dim=s.gdn_head_dim, linear_conv_kernel_dim=4, intermediate_size=s.ffn_size,
        num_experts=s.num_experts, num_experts_per_tok=2, moe_intermediate_size=s.expert_ffn_size or s.ffn_size,
        shared_expert_intermediate_size=s.expert_ffn_size or s.ffn_size, decoder_sparse_step=2,
        max_position_embeddings=max(s.seq_len, 4096), use_cache=False, tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


CHUNK = 64  # the chunk length of the GDN kernels


def train_flops_per_token(size: ModelSize, vocab_size: int, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward), the MFU numerator.

    Matmuls count 2 FLOPs per active weight; MoE layers (every other layer when num_experts > 0) count the
    top-2 routed experts, the shared expert, the router and the shared expert's gate; causal softmax attention adds 2 * heads * head_dim * seq_len
    (half of QK^T and PV); a GDN layer adds its chunked-form products per token and v-head,
    2 (2 C dk + 3 dk dv + 2 C dv) (QK^T, KK^T, KS, QS, K^T V', W Vd, P V'; design doc §6).
    """
    s = size
    d, dk = s.hidden_size, s.gdn_head_dim
    attn_layers = s.num_layers // 4
    gdn_layers = s.num_layers - attn_layers
    gdn_proj = d * (2 * s.gdn_key_heads * dk + 2 * s.gdn_value_heads * dk + 2 * s.gdn_value_heads) \
        + s.gdn_value_heads * dk * d
    gdn_chunk = s.gdn_value_heads * (2 * CHUNK * dk + 3 * dk * dk + 2 * CHUNK * dk)
    hd = s.attention_head_dim
    attn_proj = d * (2 * s.attention_heads * hd + 2 * s.kv_heads * hd) + s.attention_heads * hd * d
    attn_scores = s.attention_heads * hd * seq_len  # causal: half of the 2 x (QK^T + PV) terms, in MACs
    moe_layers = s.num_layers // 2 if s.num_experts else 0
    mlp_macs = (s.num_layers - moe_layers) * 3 * d * s.ffn_size \
        + moe_layers * (3 * 3 * d * s.expert_ffn_size + d * s.num_experts + d)  # experts, router, shared gate
    forward_macs = gdn_layers * (gdn_proj + gdn_chunk) + attn_layers * (attn_proj + attn_scores) + mlp_macs \
        + d * vocab_size
    return 3 * 2 * forward_macs


def describe(name: str) -> dict:
    return {"size": name, **asdict(SIZES[name])}
