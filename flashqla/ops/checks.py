"""Input validation for chunk_gated_delta_rule: every error names the argument, before any compute."""
from __future__ import annotations

import torch

from .per_tensor import PerTensorCache

# head dims every backend handles (the torch backend); kernels may support fewer and fall back
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
BACKENDS = ("auto", "torch", "tilelang")


def _require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _require_float(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


# cu_seqlens already read back to the host, by tensor identity and version (a training step that reuses its
# offsets tensor pays the device->host copy once; CUDA-graph friendly)
_host_bounds = PerTensorCache(lambda cu_seqlens: cu_seqlens.tolist())


def _require_offsets(name: str, x) -> None:
    _require_tensor(name, x)
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() != 1 or x.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got shape {tuple(x.shape)}")


def check_cu_seqlens(cu_seqlens, batch: int, seq_len: int, cu_seqlens_cpu=None) -> list[int]:
    """Validates packed-sequence offsets and returns them as Python ints: read from `cu_seqlens_cpu` (FLA's
    host copy of the same offsets) when given, which spares a device-to-host copy, else from cu_seqlens."""
    _require_offsets("cu_seqlens", cu_seqlens)
    if batch != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (packed layout), got q with batch {batch}")
    if cu_seqlens_cpu is None:
        bounds = _host_bounds(cu_seqlens)
    else:
        _require_offsets("cu_seqlens_cpu", cu_seqlens_cpu)
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu must be on the CPU, got {cu_seqlens_cpu.device}")
        if cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {tuple(cu_seqlens.shape)}, "
                             f"got {tuple(cu_seqlens_cpu.shape)}")
        if cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens.long(), cu_seqlens_cpu.long()):
            raise ValueError("cu_seqlens_cpu must hold the same offsets as cu_seqlens")
        bounds = cu_seqlens_cpu.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens must end at the sequence length T={seq_len}, got {bounds[-1]}")
    if any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    return bounds


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, cu_seqlens_cpu=None) -> list[int] | None:
    """Validates a call; returns cu_seqlens as a list of ints (or None)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_tensor(name, x)
        _require_float(name, x)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, Hqk, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, Hv, V], got shape {tuple(v.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    if Hv % Hqk != 0:
        raise ValueError(f"the number of v heads ({Hv}) must be a multiple of the q/k heads ({Hqk})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = {(B, T, Hv)}, got {tuple(x.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, dim in (("K (q/k head dim)", K), ("V (v head dim)", V)):
        if dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{name} = {dim} is not supported; supported head dims: {SUPPORTED_HEAD_DIMS}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number or None, got {type(scale).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    tensors = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    bounds = None
    if cu_seqlens is not None:
        bounds = check_cu_seqlens(cu_seqlens, B, T, cu_seqlens_cpu)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens: pass cu_seqlens as well")
    N = B if bounds is None else len(bounds) - 1
    if initial_state is not None:
        _require_tensor("initial_state", initial_state)
        _require_float("initial_state", initial_state)
        if initial_state.shape != (N, Hv, K, V):
            raise ValueError(f"initial_state must be [N, Hv, K, V] = {(N, Hv, K, V)}, got {tuple(initial_state.shape)}")
        tensors.append(("initial_state", initial_state))
    device = q.device
    for name, x in tensors:
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}; all tensors must share a device")
    return bounds


def check_cp_arguments(intra_cp, cp_warmup) -> None:
    if isinstance(intra_cp, bool) or not (intra_cp in ("auto", "off") or isinstance(intra_cp, int)):
        raise ValueError(f"intra_cp must be 'auto', 'off' or a number of chunks per segment, got {intra_cp!r}")
    if isinstance(intra_cp, int) and intra_cp < 1:
        raise ValueError(f"intra_cp (chunks per segment) must be >= 1, got {intra_cp}")
    if cp_warmup is not None and (isinstance(cp_warmup, bool) or not isinstance(cp_warmup, (int, float))):
        raise TypeError(f"cp_warmup must be a negative number (log-decay threshold) or None, got {cp_warmup!r}")
    if cp_warmup is not None and not cp_warmup < 0:
        raise ValueError(f"cp_warmup must be < 0 (a log-decay threshold), got {cp_warmup}")


def check_keep_states(keep_states) -> None:
    if isinstance(keep_states, bool) or keep_states == "auto":
        return
    if isinstance(keep_states, str):
        raise ValueError(f"keep_states must be 'auto', True or False, got {keep_states!r}")
    raise TypeError(f"keep_states must be 'auto', True or False, got {type(keep_states).__name__} {keep_states!r}")
