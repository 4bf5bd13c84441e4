"""Backend dispatch: each backend answers "can you run this call?" with None or a reason string."""
from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import itertools
import logging
from dataclasses import dataclass

import torch

from ..cp import segments
from ..kernels import switched_on  # noqa: F401  (the switches' one reading; qk_norm and layers.fused import it here)
from . import torch_backend
from .layout import CHUNK

log = logging.getLogger("flashqla")


@dataclass(frozen=True)
class Call:
    """What dispatch needs to know about one validated call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None


@functools.lru_cache(maxsize=None)
def tilelang_missing() -> str | None:
    """Why TileLang kernels cannot load in this process, or None. tilelang is looked up, not imported:
    prebuilt kernels load without it (kernels/cache.py), and a JIT compile that needs it says so if it
    does not import."""
    if importlib.util.find_spec("tilelang") is None:
        return "tilelang is not installed; pip install 'flashqla[tilelang]'"
    return None


def hopper_device_reason(t: torch.Tensor, what: str) -> str | None:
    """None when `t` is on an SM90 GPU and TileLang kernels can load, else why `what` cannot run there."""
    if not t.is_cuda:
        return f"tensors are on {t.device}, {what} need a CUDA device"
    major, minor = torch.cuda.get_device_capability(t.device)
    if (major, minor) != (9, 0):
        return f"{what} target SM90 (Hopper); this GPU is SM{major}{minor}"
    return tilelang_missing()


@functools.lru_cache(maxsize=None)
def _hopper_kernels():
    """The TileLang SM90 kernels module, or the reason it cannot be used in this process."""
    reason = tilelang_missing()
    if reason:
        return None, reason
    try:
        from flashqla.kernels import hopper
    except Exception as exc:
        return None, f"flashqla.kernels.hopper failed to import ({exc.__class__.__name__}: {exc})"
    if not hasattr(hopper, "chunk_gdn_fwd"):
        return None, "flashqla.kernels.hopper has no forward kernel in this build"
    return hopper, None


def tilelang_unsupported_reason(call: Call) -> str | None:
    reason = hopper_device_reason(call.q, "the TileLang kernels")
    if reason:
        return reason
    hopper, reason = _hopper_kernels()
    if reason:
        return reason
    return hopper.unsupported_reason(call.q, call.k, call.v, call.g, call.beta, call.initial_state, call.cu_seqlens)


@functools.lru_cache(maxsize=None)
def _warn_fallback_once(reason: str) -> None:
    log.warning("flashqla: falling back to the torch backend: %s", reason)


def choose(backend: str, call: Call) -> str:
    """Resolves backend="auto" | "torch" | "tilelang" to a backend that can run this call."""
    if backend == "torch":
        return "torch"
    reason = tilelang_unsupported_reason(call)
    if backend == "tilelang":
        if reason:
            raise RuntimeError(f"backend='tilelang' cannot run this call: {reason}")
        return "tilelang"
    if reason is None:
        return "tilelang"
    if call.q.is_cuda:  # on a GPU the torch path is slow: say so once per reason
        _warn_fallback_once(reason)
    return "torch"


def keeps_inverse() -> bool:
    """Whether a TileLang forward whose backward will run keeps its WY inverse (its own GA, cumulative gates
    and fp32 beta, 132-136 bytes per token and v-head held until the backward; nothing more computed) so
    that the backward does not compute it again; on unless FLASHQLA_KEEP_INVERSE=0 (less activation memory,
    a second wy_inverse in every backward)."""
    return switched_on("FLASHQLA_KEEP_INVERSE")


def forward(name: str, call: Call, scale: float, output_final_state: bool, plan, cp_warmup, for_backward=False,
            keep_inverse=False, keep_states=False):
    """(o, final state); for_backward: (o, final state, what `backward` can reuse (a `segments.Kept`), or
    None). keep_inverse: on the TileLang path, keep the WY inverse for the backward (`keeps_inverse`);
    keep_states (only with keep_inverse): and the per-chunk states (the torch backend recomputes its own)."""
    c = call
    kept = None
    if name == "tilelang":
        hopper, _ = _hopper_kernels()
        if plan.is_segmented:  # segments run as packed sequences (flashqla/cp/segments.py)
            *out, kept = segments.segmented_forward(hopper, c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state,
                                                    output_final_state, plan, cp_warmup, with_starts=True,
                                                    keep_inverse=keep_inverse, keep_states=keep_states)
        else:
            cu, chunk_offsets = kernel_layout(c, plan)
            out = hopper.chunk_gdn_fwd(c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, output_final_state, cu,
                                       keep_inverse=keep_inverse, chunk_offsets=chunk_offsets,
                                       keep_states=keep_states)
            if keep_inverse:
                *out, inverse = out
                kept = segments.Kept(inverse=inverse)
    else:
        out = torch_backend.forward(c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, output_final_state, plan,
                                    cp_warmup)
    return (*out, kept) if for_backward else tuple(out)


def forward_in_two(name: str, call: Call, scale: float, output_final_state: bool, plan, cp_warmup,
                   keep_inverse=False, keep_states=False):
    """The forward of a call whose initial states come later (inter-card CP): runs now what does not read
    them and returns `finish(initial_state)`, which returns what `forward(..., for_backward=True,
    keep_inverse=keep_inverse, keep_states=keep_states)` does. On the segmented TileLang path the WY inverse
    and the summary launch run now; elsewhere everything runs in `finish`."""
    if name == "tilelang" and plan.is_segmented:
        hopper, _ = _hopper_kernels()
        c = call
        summ = segments.forward_summaries(hopper, c.q, c.k, c.v, c.g, c.beta, plan, cp_warmup, has_h0=True,
                                          dht_given=output_final_state, keep_inverse=keep_inverse,
                                          keep_states=keep_states)
        return lambda initial_state: segments.forward_from_summaries(hopper, summ, scale, initial_state,
                                                                     output_final_state, with_starts=True)
    return lambda initial_state: forward(name, dataclasses.replace(call, initial_state=initial_state), scale,
                                         output_final_state, plan, cp_warmup, for_backward=True,
                                         keep_inverse=keep_inverse, keep_states=keep_states)


def forward_passing_state(name: str, call: Call, scale: float, plan, cp_warmup, keep_inverse=False,
                          keep_states=False):
    """The forward of a call whose last sequence goes on into another rank's part (inter-card CP), with that
    sequence's final state computed before the walk: (S_end [Hv, K, V] fp32, `finish()`, which returns
    what `forward(..., output_final_state=True, for_backward=True)` does), or None where the state only
    comes out of the whole forward (not the segmented TileLang path). S_end comes from the call's own
    segment summaries and chain (`segments.leaving_state`): no approximation beyond the chain's own, and
    the WY inverse and summary launch it needs are the forward's own. (Behind the fused walk the summaries
    form V' from GA, v and beta as the fused walk does, but in another order of products and roundings, so
    S_end and the walk's final state agree to bf16 precision, not bitwise.)"""
    if name != "tilelang" or not plan.is_segmented:
        return None
    hopper, _ = _hopper_kernels()
    c = call
    summ = segments.forward_summaries(hopper, c.q, c.k, c.v, c.g, c.beta, plan, cp_warmup,
                                      has_h0=c.initial_state is not None, dht_given=True, leaving=True,
                                      keep_inverse=keep_inverse, keep_states=keep_states)
    S0 = segments.forward_chain(hopper, summ, c.initial_state)
    return segments.leaving_state(summ, S0), lambda: segments.forward_walk(hopper, summ, S0, scale, True,
                                                                           with_starts=True)


def summary(name: str, q, k, v, g, beta, with_transition: bool, segments: tuple[int, ...] | None = None):
    """(S*, M or None) of every run of [1, T] started from zero: S_end = M S_start + S* (design §3). The runs
    are the whole sequence, or the segments at offsets `segments` (0, ..., T) as one varlen batch.

    On "tilelang" both come from the state-only summary walk (S* from zero, M as the walk of U = 0 from
    S0 = I, chunk_states.py); on "torch" from the reference (a state walk and the pairwise transition
    product). Shapes [runs, Hv, K, V] and [runs, Hv, K, K], fp32 (fp64 for fp64 inputs)."""
    if name == "tilelang":
        hopper, _ = _hopper_kernels()
        return hopper.summaries(hopper.prepare(q, k, v, g, beta, device_offsets(segments, q.device)), with_transition)
    return torch_backend.summary(q, k, v, g, beta, with_transition, segments)


def entering_state_gradient(name: str, q, k, v, g, beta, scale, do, segments: tuple[int, ...] | None = None):
    """dS0 of every run of [1, T] (as in `summary`) when the gradient of its final state is zero: the reverse
    walk alone. Inter-card CP's D (flashqla/cp/span.py); [runs, Hv, K, V], fp32 (fp64 for fp64 inputs)."""
    if name == "tilelang":
        hopper, _ = _hopper_kernels()
        return hopper.entering_state_gradients(q, k, v, g, beta, scale, device_offsets(segments, q.device), do)
    return torch_backend.entering_state_gradient(q, k, v, g, beta, scale, do, segments)


_SEQUENCE_LAYOUTS: collections.OrderedDict = collections.OrderedDict()
MAX_SEQUENCE_LAYOUTS = 64


def sequence_layout(starts: tuple[int, ...], lengths: tuple[int, ...], device: torch.device, build: bool = True):
    """(cu_seqlens, chunk offsets), int32 on `device`, of the sequences of an unsegmented plan (rows at
    `starts` of `lengths` tokens in the flat stream), built on the host once per layout (the last
    MAX_SEQUENCE_LAYOUTS are kept): what the kernels' host code would otherwise compute on the device in
    every forward and backward (a dtype conversion of int64 offsets and five small launches for the chunk
    offsets). None for a layout not built yet when `build` is False."""
    key = (starts, lengths, device)
    if key in _SEQUENCE_LAYOUTS:
        _SEQUENCE_LAYOUTS.move_to_end(key)
        return _SEQUENCE_LAYOUTS[key]
    if not build:
        return None
    bounds = starts + (starts[-1] + lengths[-1],)
    offsets = itertools.accumulate((-(-n // CHUNK) for n in lengths), initial=0)
    layout = (torch.tensor(bounds, dtype=torch.int32, device=device),
              torch.tensor(list(offsets), dtype=torch.int32, device=device))
    _SEQUENCE_LAYOUTS[key] = layout
    if len(_SEQUENCE_LAYOUTS) > MAX_SEQUENCE_LAYOUTS:
        _SEQUENCE_LAYOUTS.popitem(last=False)
    return layout


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def kernel_layout(call: Call, plan):
    """(cu_seqlens, chunk offsets or None) for the kernels of an unsegmented call: the plan's `sequence_layout`,
    except while a CUDA graph is being captured with a layout not built yet (a host-to-device copy is not
    allowed then): the call's own cu_seqlens, whose chunk offsets the kernels' host code computes on the
    device, as before the layout was kept."""
    layout = sequence_layout(plan.starts, plan.lengths, call.q.device, build=not _capturing(call.q))
    return layout if layout is not None else (call.cu_seqlens, None)


@functools.lru_cache(maxsize=64)
def device_offsets(segments: tuple[int, ...] | None, device: torch.device) -> torch.Tensor | None:
    """Host offsets `segments` as the kernels' int32 cu_seqlens on `device`, built once per layout (no
    host-to-device copy per step)."""
    return None if segments is None else torch.tensor(segments, dtype=torch.int32, device=device)


def backward(name: str, call: Call, scale: float, plan, cp_warmup, do, dht, kept=None):
    # "tilelang": the kernel backward on the token layout (states recomputed from the inputs), with
    # intra-card CP segments run as sequences; "torch": the reference chunked backward on the chunk grid.
    c = call
    if name == "tilelang":
        hopper, _ = _hopper_kernels()
        if plan.is_segmented:
            return segments.segmented_backward(hopper, c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, plan,
                                               cp_warmup, do, dht, kept=kept)
        cu, chunk_offsets = kernel_layout(c, plan)
        return hopper.chunk_gdn_bwd(c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, cu, do, dht,
                                    kept=None if kept is None else kept.inverse, chunk_offsets=chunk_offsets,
                                    row_bounds=plan.bounds)
    return torch_backend.backward(c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, plan, do, dht, cp_warmup)


def backward_in_two(name: str, call: Call, scale: float, plan, cp_warmup, do, kept=None):
    """The backward of a call whose final-state gradient comes later (inter-card CP): runs now what does
    not read it and returns `finish(dht) -> (dq, dk, dv, dg, dbeta, dh0)`, as `backward`. On the segmented
    TileLang path the WY inverse and the reverse walks from zero run now; elsewhere everything runs in
    `finish`."""
    c = call
    if name == "tilelang" and plan.is_segmented:
        hopper, _ = _hopper_kernels()
        pro = segments.backward_prologue(hopper, c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, plan,
                                         cp_warmup, do, dht_given=True, kept=kept)
        return _backward_finisher(hopper, pro, c.initial_state)
    return lambda dht: backward(name, call, scale, plan, cp_warmup, do, dht, kept)


def _backward_finisher(hopper, pro, initial_state):
    """finish(dht) -> (dq, dk, dv, dg, dbeta, dh0) of a segmented backward from its prologue."""
    def finish(dht):
        *grads, dh0 = segments.backward_finish(hopper, pro, dht)
        return (*grads, None if dh0 is None else dh0.to(initial_state.dtype))
    return finish


def backward_passing_gradient(name: str, call: Call, scale: float, plan, cp_warmup, do, kept, dht_given: bool):
    """The backward of a call whose first sequence entered from another rank's part (inter-card CP), with the
    gradient of that sequence's initial state from this call's outputs alone (a zero gradient leaving the
    call) computed before the kernel backward: (D [Hv, K, V] fp32, `finish(dht)` as in `backward_in_two`),
    or None off the segmented TileLang path. D comes from the backward's own prologue (reverse walks and a
    mirror scan, `segments.entering_gradient`)."""
    if name != "tilelang" or not plan.is_segmented:
        return None
    hopper, _ = _hopper_kernels()
    c = call
    pro = segments.backward_prologue(hopper, c.q, c.k, c.v, c.g, c.beta, scale, c.initial_state, plan, cp_warmup,
                                     do, dht_given=dht_given, kept=kept)
    return segments.entering_gradient(hopper, pro), _backward_finisher(hopper, pro, c.initial_state)
