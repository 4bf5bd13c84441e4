"""FLA 0.6.0's optional inputs of chunk_gated_delta_rule, so a call written for FLA runs unchanged.

FLA fuses these into its kernels; here they are torch ops on the inputs before the op (autograd carries
their gradients back to the raw tensors), and the state layout is a transpose at the op's edges:

- `use_qk_l2norm_in_kernel`: q and k divided by their L2 norm over the head dim (eps 1e-6, in fp32).
- `use_beta_sigmoid_in_kernel`: `beta` holds logits; beta = sigmoid(beta) in fp32, or 2 sigmoid(beta)
  with `allow_neg_eigval` (I - beta k k^T may then have a negative eigenvalue, down to -1), which needs
  the sigmoid flag.
- `use_gate_in_kernel` (keyword) with `A_log` [Hv] and optional `dt_bias` [Hv]: `g` holds the raw gate
  input a; g = -exp(A_log) softplus(a + dt_bias) in fp32 (Qwen3-Next's gate).
- `state_v_first` (or FLA's deprecated `transpose_state_layout`): initial and final states as
  [N, Hv, V, K] (sglang's state pool layout) instead of [N, Hv, K, V].
- `chunk_size`: FLA accepts 16, 32 and 64; flashqla's kernels and reference use 64 only.
- `cu_seqlens_cpu`, `chunk_indices`: handled by the op (checks.check_cu_seqlens; chunk indices are
  derived from cu_seqlens by the kernels themselves).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .qk_norm import l2norm

_KEYWORDS = ("chunk_size", "use_gate_in_kernel", "A_log", "dt_bias", "transpose_state_layout", "head_first")
CHUNK_SIZE = 64


def qwen3_next_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """g = -exp(A_log) softplus(a + dt_bias), in fp32 at least (fp64 inputs stay fp64)."""
    work = torch.promote_types(a.dtype, torch.float32)
    bias = 0.0 if dt_bias is None else dt_bias.to(work)
    return -A_log.to(work).exp() * F.softplus(a.to(work) + bias)


@dataclass(frozen=True)
class InputOptions:
    """How the raw inputs of a call become the op's q, k, g, beta (and how its states are laid out)."""

    use_qk_l2norm_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None


def input_options(use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                  kwargs: dict) -> InputOptions:
    """The options of a call from its flags and FLA's extra keywords; raises on unknown or unsupported ones."""
    unknown = sorted(set(kwargs) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"chunk_gated_delta_rule got unexpected keyword arguments: {', '.join(unknown)}")
    if "head_first" in kwargs:
        raise ValueError("head_first has been removed (as in FLA): inputs must be [B, T, H, ...]")
    chunk_size = kwargs.get("chunk_size", CHUNK_SIZE)
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_size must be {CHUNK_SIZE} (flashqla's chunk), got {chunk_size!r}")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
        warnings.warn("transpose_state_layout is deprecated: use state_v_first", DeprecationWarning, stacklevel=3)
        state_v_first = kwargs["transpose_state_layout"]
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    use_gate = bool(kwargs.get("use_gate_in_kernel", False))
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    if use_gate and A_log is None:
        raise ValueError("A_log must be given with use_gate_in_kernel=True")
    if not use_gate and (A_log is not None or dt_bias is not None):
        raise ValueError("A_log / dt_bias are read only with use_gate_in_kernel=True (g is then the raw gate input)")
    return InputOptions(bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
                        bool(state_v_first), use_gate, A_log, dt_bias)


def check_gate_parameters(options: InputOptions, g: torch.Tensor) -> None:
    """A_log and dt_bias: float tensors [Hv] on g's device."""
    for name, x in (("A_log", options.A_log), ("dt_bias", options.dt_bias)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(x).__name__}")
        if x.shape != g.shape[-1:]:
            raise ValueError(f"{name} must be [Hv] = [{g.shape[-1]}], got {tuple(x.shape)}")
        if x.device != g.device:
            raise ValueError(f"{name} is on {x.device} but g is on {g.device}")


def state_to_op_layout(options: InputOptions, initial_state):
    """The initial state in the op's [N, Hv, K, V] layout."""
    if options.state_v_first and isinstance(initial_state, torch.Tensor) and initial_state.dim() == 4:
        return initial_state.transpose(-1, -2)
    return initial_state


def state_to_caller_layout(options: InputOptions, final_state):
    """The final state in the caller's layout."""
    if options.state_v_first and final_state is not None:
        return final_state.transpose(-1, -2).contiguous()
    return final_state


def apply_input_options(options: InputOptions, q, k, g, beta):
    """q, k, g, beta as the op takes them (differentiable torch ops on the raw inputs)."""
    if options.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if options.use_gate_in_kernel:
        g = qwen3_next_gate(g, options.A_log, options.dt_bias)
    if options.use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
        if options.allow_neg_eigval:
            beta = 2 * beta
    return q, k, g, beta
