"""Megatron's parallel layouts of a full (TP 1, CP 1) GDN layer's weights and tokens, for comparing a
parallel run with a single-rank one: the CPU tests (mcore_worker.py) and the GPU check
(benchmarks/megatron_gdn_layer.py) use them. No CPU shim here, so the GPU script can import it."""
import torch
from megatron.core import parallel_state


def tp_shard(module, name, full):
    """This TP rank's slice of a full (TP1) parameter, in Megatron's per-rank sectioned layout:
    in_proj rows [q|k|v|z|beta|alpha] and conv channels [q|k|v] are split section by section."""
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if name == "in_proj.weight":
        sections = [s * tp for s in module.in_proj_split_sections]
    elif name.startswith("conv1d."):
        sections = [module.qk_dim, module.qk_dim, module.v_dim]
    elif name in ("A_log", "dt_bias"):
        sections = [full.shape[0]]
    elif name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    else:  # out_norm.weight: one per-head-dim norm, replicated on every TP rank
        return full
    return torch.cat([piece.chunk(tp, dim=0)[rank] for piece in full.split(sections, dim=0)])


def load_balanced(x, cp, rank, cu_seqlens=None):
    """Megatron's CP order along dim 0: each sequence (each row for padded [s, b, h] input) cut into
    2*cp chunks, rank r holds chunks r and 2cp-1-r."""
    starts_ends = [(0, x.shape[0])] if cu_seqlens is None else zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    pieces = []
    for start, end in starts_ends:
        chunks = x[start:end].chunk(2 * cp)
        pieces += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(pieces)
