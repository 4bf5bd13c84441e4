"""Backward of GDN chunked prefill on SM90: four kernels over the forward's flat token layout.

    (wy_inverse)          GA = Gamma o A and the chunk-local cumulative gates: the forward's, kept
                          (`KeptInverse`), or recomputed (the forward's build) when it kept none
    fused_fwd (states)    the state entering every chunk (input dtype): the forward's walk again, without O
                          (none when the forward kept its states, `keep_states`)
    chunk_dstates         the reverse walk: the gradient of the state leaving every chunk, and dS0
                          (beside the state walk on a second stream when one walk leaves SMs idle, and
                          with intra-card CP's mirror scan before it while the states are recomputed)
    chunk_bwd_local       every chunk at once: dq, dk (per v-head or v-head pair: `dqk_sum_build`), dv, dg,
                          dbeta from those two
    gqa_sum               dq and dk summed over each GQA group (fp32 accumulation), both in one launch; with the
                          pairs summed, over the rest of the group (none at 2 v-heads per k-head)

Of the forward the backward reads its inputs and, when kept, GA, the cumulative gates and the fp32 beta (the
forward's own tensors: 132-136 bytes per token and v-head held until the backward). The kernels read dO as
given and apply the output scale themselves; the host casts dg and dbeta. Sequences of any length, GQA,
initial state and dht as in the forward. Intra-card CP (flashqla/cp/segments.py) runs the same steps with its
segments as the sequences.
"""
from __future__ import annotations

import functools
import itertools
import os

import torch

from .. import switched_on
from .launch import (CHUNK, HEAD_DIM, ChunkedCall, block_v_on, compiled_chunk_bwd_local, compiled_chunk_dstates,
                     compiled_gqa_sum, fused_states, prepare, prepare_from_kept, sm_count_on, states_buffer,
                     walks_fill)


@functools.lru_cache(maxsize=None)
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


def side_by_side(device: torch.device, side, main):
    """(side(), main()): `side` on a second stream of CUDA device `device` while `main` runs on its current
    stream, joined before returning (CUDA-graph capturable: a fork and a join). The tensors `side` returns
    are marked as used on the current stream, so the allocator does not hand their memory back to the
    side stream while the current one still reads them."""
    current = torch.cuda.current_stream(device)
    stream = _side_stream(current.device.index)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        side_out = side()
    main_out = main()
    current.wait_stream(stream)
    for tensor in side_out:
        if isinstance(tensor, torch.Tensor):
            tensor.record_stream(current)
    return side_out, main_out


PAIR_SUM_ENV = "FLASHQLA_GQA_PAIR_SUM"


def dqk_sum_build(group: int) -> str:
    """How chunk_bwd_local sums the dq and dk of the v-heads that share a k-head (its `pair_sum` build), at a GQA
    group of `group` v-heads per k-head: "ordered" at an even group (v-heads 2m and 2m + 1 summed into one row:
    one CTA takes both v-heads of a chunk, the second adding its tiles to what the first stored), "none" at an
    odd one. No GQA sum runs then at 2 v-heads per k-head, and it sums half the rows at 4 or 8; the G = 2 outputs
    equal the GQA sum's (a sum of two 16-bit values rounded once, in either order). 4-6% off the backward at (16,
    32) (docs/kernels.md, "Fortieth session"); FLASHQLA_GQA_PAIR_SUM=0 (or off/false/no) turns it off, for A/B
    runs and bisecting."""
    return "ordered" if group % 2 == 0 and switched_on(PAIR_SUM_ENV) else "none"


def output_gradient(x: ChunkedCall, do: torch.Tensor) -> torch.Tensor:
    """dO as the kernels read it: [T, Hv, 128] in the input dtype (a view when it already is; the output
    scale is applied inside the kernels)."""
    return do.reshape(x.v.shape).to(x.v.dtype).contiguous()


def state_gradients(x: ChunkedCall, do: torch.Tensor, scale: float, dht, store_dh: bool = True, last_chunks=None):
    """chunk_dstates over every sequence of `x` from dO (`output_gradient`) with the output scale and dht
    (fp32 [N, Hv, 128, 128], or None for zero): (dh [chunk_slots, Hv, 128, 128] in the input dtype, or None
    without store_dh, dS0 fp32 [N, Hv, 128, 128]).
    last_chunks: int32 [Hv, N] or None: the walk of (n, h) covers only chunks last_chunks[h, n] .. 0 of its
    sequence (a warmed-up walk from zero: store_dh False, no dht)."""
    if last_chunks is not None and (store_dh or dht is not None):
        raise ValueError("last_chunks truncate a walk from zero that stores dS0 alone")
    N, Hv, device, D = x.num_seqs, x.num_v_heads, x.q.device, HEAD_DIM
    block_v = block_v_on(device, N, Hv)
    dh = torch.empty(x.chunk_slots if store_dh else 1, Hv, D, D, dtype=x.v.dtype, device=device)
    placeholder = torch.empty(1, D, D, dtype=torch.float32, device=device)
    dht_arg = placeholder if dht is None else dht.float().reshape(N * Hv, D, D).contiguous()
    dS0 = torch.empty(N, Hv, D, D, dtype=torch.float32, device=device)
    last_arg = x.cu if last_chunks is None else last_chunks.reshape(-1)  # int32 either way; unread when None
    compiled_chunk_dstates(x.dtype, block_v)(
        x.q, x.k, x.GA, x.beta, do, x.gcum, x.cu, x.offsets, dht_arg, dh, dS0.view(N * Hv, D, D), last_arg,
        scale, int(dht is not None), 1, int(store_dh), int(last_chunks is not None))
    return (dh if store_dh else None), dS0


# A backward whose final-state gradients come from a chain still to run (intra-card CP's mirror scan, `dht`
# callable in `backward_of`) recomputes the states on a second stream beside that chain and the reverse walk:
# the chain keeps few SMs busy (one (sequence, head) chain per V tile), and the recompute needs none of it.
# FLASHQLA_STATES_BESIDE_CHAIN=0 (or off/false/no) runs them one after the other, for A/B runs and bisecting.
STATES_BESIDE_CHAIN_ENV = "FLASHQLA_STATES_BESIDE_CHAIN"


# The backward holds the state entering every chunk and its gradient (h and dh, 2 x 32 KiB per chunk and v-head
# in bf16: 1 KB per token and v-head, 32 GiB at 1M tokens x 32 v-heads) while chunk_bwd_local runs. Above a budget
# the rows (sequences, or intra-card CP's segments) are taken in slices of consecutive rows, each slice's h and dh
# allocated, used and freed before the next; every output is the same bits (no kernel's item spans two rows).
# FLASHQLA_BWD_STATES_GIB sets the budget (default: a sixteenth of the device's memory, 4.9 GiB on an H100).
STATES_BUDGET_ENV = "FLASHQLA_BWD_STATES_GIB"
STATES_BUDGET_SHARE = 16  # the default budget: the device's memory over this


def states_budget(device: torch.device) -> float:
    """Bytes of h and dh one slice of the backward may hold on `device` (`STATES_BUDGET_ENV`); unbounded on the
    CPU unless the variable is set (the emulated kernels' tests set it)."""
    given = os.environ.get(STATES_BUDGET_ENV, "").strip()
    if given:
        budget = float(given) * 2 ** 30
        if not budget > 0:
            raise ValueError(f"{STATES_BUDGET_ENV} must be a positive number of GiB, got {given!r}")
        return budget
    if device.type != "cuda":
        return float("inf")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory / STATES_BUDGET_SHARE


def row_slices(chunks: list[int], state_bytes_per_chunk: int, budget: float, wave_rows: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [r0, r1) covering rows of `chunks` chunks each: one range when the rows' h and dh
    (`state_bytes_per_chunk` per chunk) fit in `budget`; else ranges of whole groups of `wave_rows` consecutive rows
    (the rows whose walks fill the SMs once), each taking the next groups while they fit, one group at least: a
    slice of whole waves keeps the walks' time what one pass's was (a slice of 1.2 waves would take two). Groups
    without a chunk (empty sequences) join a neighbour: every range holds a chunk (the kernels' TMA descriptors
    take no tensor of zero tokens)."""
    limit = budget / state_bytes_per_chunk  # chunks a slice may hold
    if sum(chunks) <= limit:
        return [(0, len(chunks))]
    cuts, held = [0], 0
    for start in range(0, len(chunks), wave_rows):
        group = sum(chunks[start:start + wave_rows])
        if held and group and held + group > limit:
            cuts.append(start)
            held = 0
        held += group
    cuts.append(len(chunks))
    return list(zip(cuts, cuts[1:]))


def _rows_of(x: ChunkedCall, r0: int, r1: int, bounds, chunk_starts) -> ChunkedCall:
    """Rows r0 .. r1 - 1 of `x` as a call of their own: token views [t0, t1) of its tensors (contiguous along the
    tokens), the gates copied ([Hv, T] is not), cu_seqlens and chunk offsets rebased on the device (no sync)."""
    t0, t1, c0, c1 = bounds[r0], bounds[r1], chunk_starts[r0], chunk_starts[r1]
    return ChunkedCall(x.q[t0:t1], x.k[t0:t1], x.v[t0:t1], x.beta[t0:t1], x.GA[t0:t1], x.gcum[:, t0:t1].contiguous(),
                       x.cu[r0:r1 + 1] - t0, x.offsets[r0:r1 + 1] - c0, c1 - c0, x.dtype)


def backward_of(x: ChunkedCall, q, k, v, g, beta, do, scale, h0, dht, states=None, row_bounds=None):
    """Gradients of the sequences of `x` (`prepare`d, or from a kept inverse) from dO
    (`output_gradient`) with the output scale, their initial states h0 and the gradients dht of their
    final states (fp32 [N, Hv, 128, 128] or None, or a function of no arguments that returns them, run beside the
    state recompute where that runs on a second stream): (dq, dk, dv, dg, dbeta) shaped and typed like q, k, v, g,
    beta, and dS0 fp32 [N, Hv, 128, 128].
    states: the state entering every chunk when the forward kept it (`KeptInverse.states`): no recompute.
    row_bounds: the sequences' token bounds on the host (x.cu's values, N + 1 of them), which let the backward run
    in slices of sequences when their h and dh exceed `states_budget` (else one launch of each kernel for all).
    Releases the per-chunk states before the sums: T x Hv x 1 KB (h and dh) less held there (dh alone when
    the forward kept h: the autograd context holds it until the backward returns)."""
    B, T, Hqk, D = q.shape
    Hv = v.shape[2]
    device = q.device
    # per v-head (or pair) in the input dtype: half the bytes of fp32 written here and read by the GQA sums (and
    # T x Hv x 512 bytes less memory at the peak); the sums accumulate in fp32 and round once more
    pair_sum = dqk_sum_build(Hv // Hqk)
    dqk_heads = Hv // 2 if pair_sum == "ordered" else Hv  # rows of dq and dk per token
    grads = _gradient_buffers(B * T, dqk_heads, Hv, do.dtype, device)
    if row_bounds is None:
        dS0 = _local_gradients(x, do, scale, h0, dht, states, pair_sum, grads)
    else:
        if len(row_bounds) != x.num_seqs + 1 or row_bounds[0] != 0 or row_bounds[-1] != B * T:
            raise ValueError(f"row_bounds must be the {x.num_seqs + 1} token bounds of the call's sequences, from 0 to "
                             f"{B * T}; got {len(row_bounds)} from {row_bounds[0]} to {row_bounds[-1]}")
        dS0 = _gradients_in_slices(x, do, scale, h0, dht, states, pair_sum, grads, row_bounds)
    dq, dk, dv, dg, dbeta = grads

    rest = dqk_heads // Hqk  # rows per k-head left to sum
    if rest > 1:  # v-head h read k-head h // group: sum each group, accumulating in fp32
        dq_sum, dk_sum = (torch.empty(B * T * Hqk, D, dtype=dq.dtype, device=device) for _ in range(2))
        compiled_gqa_sum(x.dtype)(dq.view(-1, rest, D), dk.view(-1, rest, D), dq_sum, dk_sum)
        dq, dk = dq_sum, dk_sum
    return (dq.view(q.shape).to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype),
            dg.t().reshape(g.shape).to(g.dtype), dbeta.view(beta.shape).to(beta.dtype), dS0)


def _gradients_in_slices(x: ChunkedCall, do, scale, h0, dht, states, pair_sum: str, grads, row_bounds) -> torch.Tensor:
    """`_local_gradients` over the slices of rows that `row_slices` cuts for the device's budget (one when the rows'
    h and dh fit), each on token views of `x`, dO and `grads`; returns dS0 of every row."""
    Hv, device, D = x.num_v_heads, x.q.device, HEAD_DIM
    chunks = [-(-(end - start) // CHUNK) for start, end in zip(row_bounds, row_bounds[1:])]
    # a wave: one walk per SM at V tile 128 (one CTA per walk; a slice of fewer walks takes a narrower tile)
    wave_rows = max(sm_count_on(device) // Hv, 1) if device.type == "cuda" else 1
    slices = row_slices(chunks, 2 * Hv * D * D * x.v.element_size(), states_budget(device), wave_rows)
    if len(slices) == 1:
        return _local_gradients(x, do, scale, h0, dht, states, pair_sum, grads)
    chunk_starts = list(itertools.accumulate(chunks, initial=0))
    all_dht = functools.cache(dht) if callable(dht) else lambda: dht  # a deferred dht runs once, in the first slice
    dq, dk, dv, dg, dbeta = grads
    dS0 = torch.empty(x.num_seqs, Hv, D, D, dtype=torch.float32, device=device)
    for r0, r1 in slices:
        t0, t1 = row_bounds[r0], row_bounds[r1]
        if callable(dht) and r0 == 0:  # beside the first slice's state recompute, as in one pass
            rows_dht = functools.partial(lambda r1: all_dht()[:r1], r1)
        else:
            rows_dht = None if dht is None else all_dht()[r0:r1]
        rows_states = None if states is None else states[chunk_starts[r0]:chunk_starts[r1]]
        rows_dg = torch.empty(Hv, t1 - t0, dtype=torch.float32, device=device)  # dg[:, t0:t1] is not contiguous
        dS0[r0:r1] = _local_gradients(_rows_of(x, r0, r1, row_bounds, chunk_starts), do[t0:t1], scale,
                                      None if h0 is None else h0[r0:r1], rows_dht, rows_states, pair_sum,
                                      [dq[t0:t1], dk[t0:t1], dv[t0:t1], rows_dg, dbeta[t0:t1]])
        dg[:, t0:t1] = rows_dg
        if callable(dht) and r0 == 0 and device.type == "cuda":
            # the first slice may have run it on its side stream (its walks beside each other): later slices read it
            # here, so its memory is not handed back to the side stream while they do
            all_dht().record_stream(torch.cuda.current_stream(device))
    return dS0


def _gradient_buffers(num_tokens: int, dqk_heads: int, Hv: int, dtype, device) -> list:
    """[dq, dk, dv, dg, dbeta] as chunk_bwd_local writes them: dq and dk [T, dqk_heads, 128] and dv [T, Hv, 128] in
    the input dtype, dg [Hv, T] and dbeta [T, Hv] in fp32."""
    dq, dk = (torch.empty(num_tokens, dqk_heads, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    dv = torch.empty(num_tokens, Hv, HEAD_DIM, dtype=dtype, device=device)
    dg = torch.empty(Hv, num_tokens, dtype=torch.float32, device=device)
    dbeta = torch.empty(num_tokens, Hv, dtype=torch.float32, device=device)
    return [dq, dk, dv, dg, dbeta]


def _local_gradients(x: ChunkedCall, do, scale, h0, dht, states, pair_sum: str, grads) -> torch.Tensor:
    """The two walks (the states, unless kept, and their gradients) and chunk_bwd_local over every sequence of `x`,
    into `grads` ([dq, dk, dv, dg, dbeta] of its tokens, `_gradient_buffers`); returns dS0. h and dh are freed on
    return."""
    device = x.q.device
    deferred = callable(dht)

    def reverse_walk():
        return state_gradients(x, do, scale, dht() if deferred else dht)

    if states is not None:
        (dh, dS0), h = reverse_walk(), states
    elif device.type == "cuda" and deferred and switched_on(STATES_BESIDE_CHAIN_ENV):
        # the states into memory of the current stream's pool (from the side stream's, they would stay reserved
        # for it between calls), recomputed on the side stream while the chain and the reverse walk run here
        h = states_buffer(x)
        _, (dh, dS0) = side_by_side(device, lambda: (fused_states(x, h0, out=h),), reverse_walk)
    elif device.type == "cuda" and not walks_fill(device, x.num_seqs, x.num_v_heads):
        # the two walks are independent (the reverse walk needs no state): side by side on two streams when one
        # walk alone leaves SMs idle (H200, 2026-12-01: whole backward 3.50 -> 2.38 ms at (2, 8) x 32K x 1,
        # 3.10 -> 2.03 at (2, 4); 1-4% slower where one walk already fills the GPU, so not there)
        (dh, dS0), h = side_by_side(device, reverse_walk, lambda: fused_states(x, h0))
    else:
        (dh, dS0), h = reverse_walk(), fused_states(x, h0)
    dq, dk, dv, dg, dbeta = grads
    compiled_chunk_bwd_local(x.dtype, pair_sum)(
        x.q, x.k, x.v, do, x.GA, x.gcum, x.beta, h, dh, x.cu, x.offsets, dq, dk, dv, dg, dbeta, scale,
        x.num_seqs.bit_length(), sm_count_on(device))
    return dS0


def chunk_gdn_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, kept=None, chunk_offsets=None,
                  row_bounds=None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of `chunk_gdn_fwd`'s o (upstream `do`) and final state (`dht`).

    Shapes and dtypes as chunk_gdn_fwd's inputs (validated, contiguous); do [B, T, Hv, 128]; dht fp32
    [N, Hv, 128, 128] or None; kept: the forward's `KeptInverse` (keep_inverse=True), or None to
    recompute it; chunk_offsets as in chunk_gdn_fwd; row_bounds: the sequences' token bounds on the host
    (`backward_of`), or None. dh0 is None without an initial state.
    """
    if kept is None:
        x = prepare(q, k, v, g, beta, cu_seqlens, chunk_offsets)
    else:
        x = prepare_from_kept(q, k, v, kept, cu_seqlens, chunk_offsets)
    *grads, dS0 = backward_of(x, q, k, v, g, beta, output_gradient(x, do), scale, initial_state, dht,
                              states=None if kept is None else kept.states, row_bounds=row_bounds)
    return (*grads, None if initial_state is None else dS0.to(initial_state.dtype))


def entering_state_gradients(q, k, v, g, beta, scale, cu_seqlens, do):
    """dS0 of every sequence when the gradients of their final states are zero: the reverse walk alone
    (no state recompute, no chunk-local gradients); fp32 [N, Hv, 128, 128]. Inter-card CP's D_p."""
    x = prepare(q, k, v, g, beta, cu_seqlens)
    return state_gradients(x, output_gradient(x, do), scale, None, store_dh=False)[1]
