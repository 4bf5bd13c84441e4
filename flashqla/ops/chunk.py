"""The public op: chunk_gated_delta_rule (FLA-compatible signature)."""
from __future__ import annotations

import os

import torch

from ..cp.plan import resolve_segment_chunks
from ..cp.segments import Kept
from . import backends
from .checks import check_cp_arguments, check_inputs, check_keep_states
from .options import (apply_input_options, check_gate_parameters, input_options, state_to_caller_layout,
                      state_to_op_layout)
from .torch_backend import make_plan


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Saves the inputs (and, on the kernels, the WY inverse when a backward will run, and for intra-card
    segments every segment's entering state and transition product); backward recomputes the per-chunk
    states (no o kept), unless the forward kept them (`keep_states`). Everything is saved through
    `save_for_backward` (`segments.Kept.to_saved`), so saved-tensor hooks (non-reentrant checkpointing, CPU
    offload) see all of it."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, plan, cp_warmup, backend,
                keep_inverse, keep_states):
        call = backends.Call(q, k, v, g, beta, initial_state, cu_seqlens)
        # kept: what this call's backward reuses (segments.Kept, or None)
        o, final_state, kept = backends.forward(backend, call, scale, output_final_state, plan, cp_warmup,
                                                for_backward=True, keep_inverse=keep_inverse, keep_states=keep_states)
        kept_tensors, ctx.kept_layout = ((), None) if kept is None else kept.to_saved()
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *kept_tensors)
        # the backward reuses this call's segmentation plan, so both directions cut the same way
        ctx.scale, ctx.plan, ctx.cp_warmup, ctx.backend = scale, plan, cp_warmup, backend
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, *kept_tensors = ctx.saved_tensors
        kept = None if ctx.kept_layout is None else Kept.from_saved(ctx.kept_layout, kept_tensors)
        call = backends.Call(q, k, v, g, beta, initial_state, cu_seqlens)
        dq, dk, dv, dg, dbeta, dh0 = backends.backward(ctx.backend, call, ctx.scale, ctx.plan, ctx.cp_warmup,
                                                       do.contiguous(), dht, kept)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None, None, None


# Opaque to torch.compile: Dynamo would otherwise trace the host-side checks, planning and caches (keyed by
# tensor identity and host values) and break its graph at each kernel launch and data-dependent read; a
# compiled model instead runs this call eagerly between its compiled regions (one graph break per call)
@torch.compiler.disable
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    *,
    backend: str = "auto",
    intra_cp: str | int = "auto",
    cp_warmup: float | None = -10.0,
    keep_states: bool | str = "auto",
    **kwargs,
):
    """Gated delta rule, chunked prefill (design doc §1-2). FLA 0.6.0's signature (same positions and
    keywords, so a call written for `fla.ops.gated_delta_rule.chunk_gated_delta_rule` runs unchanged),
    plus flashqla's keyword-only `backend`, `intra_cp`, `cp_warmup` and `keep_states`.

    Args:
        q, k: [B, T, Hqk, K]. v: [B, T, Hv, V] with Hv a multiple of Hqk (v-head h reads q/k head
            h // (Hv // Hqk)). g: natural-log decay [B, T, Hv] (fp32 recommended). beta: [B, T, Hv].
        scale: defaults to K ** -0.5.
        initial_state: [N, Hv, K, V], N = B, or the number of packed sequences with cu_seqlens.
        output_final_state: also return the state after the last token of every sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dim first (eps 1e-6).
        use_beta_sigmoid_in_kernel: beta holds logits (sigmoid applied in fp32); with allow_neg_eigval,
            2 sigmoid(beta).
        state_v_first: initial and final states laid out [N, Hv, V, K].
        cu_seqlens: int32/int64 offsets of packed sequences (B must be 1), from 0 to T.
        cu_seqlens_cpu: the same offsets on the host, which spares reading cu_seqlens back from the GPU
            (validated like cu_seqlens; it must hold cu_seqlens' values, which on a GPU are not re-read).
        chunk_indices: accepted for FLA callers and unused (the kernels index chunks from cu_seqlens).
        cp_context: inter-card context parallelism (flashqla.cp.build_cp_context, docs/cp.md).
        backend: "auto" (TileLang on SM90 when it can run the call, else torch), "torch", "tilelang".
        intra_cp, cp_warmup: intra-card CP (docs/cp.md). cp_warmup (natural-log decay threshold, None =
            exact everywhere) serves both levels: within a card, a (segment, head) whose gate decays past it
            over the chunks before the segment restarts from zero a few chunks early instead of taking the
            transition product M; across ranks, a sequence's span on a rank whose gates decay past it for
            EVERY head within fewer chunks than the span has is summarised over its last few chunks with
            M = 0 (its entering-state gradient over its first few), any other span exactly.
        keep_states: whether a forward on the kernels whose backward will run keeps the state entering every
            chunk (stored by its walk beside o: 512 bytes per token and v-head more activation memory, bf16),
            so that the backward does not walk the sequence again to recompute them. "auto" (the default):
            only when the forward itself runs inside a backward pass, as reentrant activation checkpointing
            recomputes it (Megatron's `--recompute-granularity full`, DeepSpeed's activation checkpointing,
            `torch.utils.checkpoint(use_reentrant=True)`), where this call's backward follows at once; never
            under saved-tensor hooks (non-reentrant checkpointing, CPU offload); the environment variable
            FLASHQLA_KEEP_STATES=1 (or 0) makes "auto" mean True (False) for code that calls the op itself.
            True: whenever a backward will run; False: never. Inter-card CP (`cp_context`) keeps them per
            local call alike; the torch backend recomputes its own.
        **kwargs: FLA's `chunk_size` (64 only), `use_gate_in_kernel` with `A_log` and `dt_bias` (g is
            then the raw gate input), the deprecated `transpose_state_layout` (see flashqla/ops/options.py).

    Returns:
        o [B, T, Hv, V] in q's dtype, and the final state [N, Hv, K, V] ([N, Hv, V, K] with state_v_first)
        in fp32 (or None).
    """
    del chunk_indices  # FLA's precomputed chunk index: the kernels derive theirs from cu_seqlens
    flags = (use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, kwargs)
    if cp_context is not None:
        return _with_cp_context(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, flags,
                                backend, intra_cp, cp_warmup, keep_states, cp_context)
    options = input_options(*flags)
    initial_state = state_to_op_layout(options, initial_state)
    bounds = check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, cu_seqlens_cpu)
    check_gate_parameters(options, g)
    check_cp_arguments(intra_cp, cp_warmup)
    check_keep_states(keep_states)
    keeps_states = _keeps_states(keep_states)
    scale, q, k, v, g, beta = _prepare(scale, options, q, k, v, g, beta)
    plan, name = _plan_and_backend(q, k, v, g, beta, initial_state, cu_seqlens, bounds, backend, intra_cp)
    keep_inverse = _keeps_inverse(q, k, v, g, beta, initial_state)
    o, final_state = ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, initial_state, float(scale), bool(output_final_state), cu_seqlens, plan, cp_warmup, name,
        keep_inverse, keep_inverse and keeps_states
    )
    return o, state_to_caller_layout(options, final_state)


chunk_gdn = chunk_gated_delta_rule  # FLA's alias


def _with_cp_context(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, flags, backend,
                     intra_cp, cp_warmup, keep_states, cp_context):
    """Inter-card CP: validate, make every rank of the group agree (or all raise), then run the chain."""
    from ..cp import inter

    error = None
    try:
        options = input_options(*flags)
        check_inputs(q, k, v, g, beta, scale, initial_state, None, backend)
        check_gate_parameters(options, g)
        check_cp_arguments(intra_cp, cp_warmup)
        check_keep_states(keep_states)
        keeps_states = _keeps_states(keep_states)  # (FLASHQLA_KEEP_STATES checked here, before the agreement)
        error = inter.local_error(cp_context, q, cu_seqlens, initial_state, output_final_state)
    except (TypeError, ValueError) as exc:
        error = str(exc)
    inter.agree_on_call(cp_context, error, q, v)
    scale, q, k, v, g, beta = _prepare(scale, options, q, k, v, g, beta)
    plan, name = _plan_and_backend(q, k, v, g, beta, None, cp_context.cu_seqlens, list(cp_context.local_bounds),
                                   backend, intra_cp)
    keep_inverse = _keeps_inverse(q, k, v, g, beta)
    o = inter.InterCardCPFunction.apply(q, k, v, g, beta, float(scale), cp_context, plan, cp_warmup, name,
                                        keep_inverse, keep_inverse and keeps_states)
    return o, None


def _keeps_inverse(*inputs) -> bool:
    """Whether the forward keeps its WY inverse for the backward (backends.keeps_inverse): only where a
    backward will run, which the autograd Function's forward cannot tell (grad mode is off inside it)."""
    return (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
            and backends.keeps_inverse())


KEEP_STATES_ENV = "FLASHQLA_KEEP_STATES"


def _keeps_states(keep_states: bool | str) -> bool:
    """keep_states resolved for a forward whose backward will run: "auto" is what FLASHQLA_KEEP_STATES says
    (1/on/true/yes or 0/off/false/no: for frameworks that call the op themselves) and, when it is unset or
    "auto", `recomputed_in_backward`."""
    if keep_states != "auto":
        return keep_states
    setting = os.environ.get(KEEP_STATES_ENV, "auto").strip().lower()
    if setting in ("1", "on", "true", "yes", "0", "off", "false", "no"):
        return setting in ("1", "on", "true", "yes")
    if setting != "auto":
        raise ValueError(f"{KEEP_STATES_ENV} must be auto, 1/on/true/yes or 0/off/false/no, got {setting!r}")
    return recomputed_in_backward()


def recomputed_in_backward() -> bool:
    """Whether this forward runs inside a backward pass with no saved-tensor hooks in force: reentrant
    activation checkpointing recomputing it, whose backward of this call runs next (kept states live from here
    to there). Non-reentrant checkpointing recomputes under saved-tensor hooks and requires the recompute to save
    what the first forward saved (which, outside any backward, kept no states), and hooks such as CPU offload
    mean memory matters more than time: False under any. False too where torch lacks either query."""
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if graph_task is None or top_hooks is None:
        return False
    return graph_task() != -1 and top_hooks(False) is None


def _prepare(scale, options, q, k, v, g, beta):
    """Default scale, the FLA input options (L2 norm of q and k, gate, beta sigmoid), contiguous inputs."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q, k, g, beta = apply_input_options(options, q, k, g, beta)
    return (float(scale),) + tuple(x.contiguous() for x in (q, k, v, g, beta))


def _plan_and_backend(q, k, v, g, beta, initial_state, cu_seqlens, bounds, backend, intra_cp):
    """The backend that runs the call and its intra-card segmentation plan (flashqla/cp/plan.py)."""
    batch, seq_len = q.shape[:2]
    name = backends.choose(backend, backends.Call(q, k, v, g, beta, initial_state, cu_seqlens))
    plan = make_plan(batch, seq_len, bounds, 0)
    segment_chunks = resolve_segment_chunks(intra_cp, plan.lengths, v.shape[2], q.device, name)
    if segment_chunks:
        plan = make_plan(batch, seq_len, bounds, segment_chunks)
    return plan, name
