"""Torch stand-ins for the compiled TileLang kernels, with their exact argument lists (test support).

Each `emulate_<kernel>` takes what the compiled kernel takes (flat token-layout tensors, `cu_seqlens`,
chunk offsets, runtime flags) and writes the same outputs, computed in fp64 chunk by chunk from the
kernel's docstring equations. Installed over `flashqla.kernels.hopper.launch.compiled_*` (see
`install`), they let the CPU suite run every line of the kernels' host code — layouts, offsets, flags,
the split / fused / segmented forward, the backward, inter-card summaries — against the
torch backend. What they cannot test is the kernels themselves (tests/gpu does that on an H200).
"""
from __future__ import annotations

import functools
import sys

import torch

C = 64


def called_from_an_emulator(depth: int = 2) -> bool:
    """Whether the caller (`depth` frames up) runs inside one of the emulators below: for dispatch modes that
    count what the host code does, to which the emulators' own fp64 work does not belong."""
    frame = sys._getframe(depth)
    while frame is not None:
        if frame.f_code.co_filename == __file__:
            return True
        frame = frame.f_back
    return False


def _chunks(cu):
    """(sequence, chunk index within it, first token, rows) of every chunk of the pack."""
    bounds = cu.tolist()
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        for c, t0 in enumerate(range(bos, eos, C)):
            yield n, c, t0, min(C, eos - t0)


def _rows(x, t0, n_rows, heads=None):
    """Rows [t0, t0 + n_rows) of a [T, H, ...] tensor as fp64 [H, C, ...], zero rows past n_rows."""
    part = x[t0:t0 + n_rows].double().movedim(0, 1)
    if heads is not None:
        part = part[heads]
    pad = part.new_zeros(part.shape[:1] + (C - n_rows,) + part.shape[2:])
    return torch.cat([part, pad], 1)


def _gates(gcum, t0, n_rows):
    """[Hv, C] cumulative gates (natural log), rows past the end repeating the last row, and factors."""
    gc = gcum[:, t0:t0 + n_rows].double()
    gc = torch.cat([gc, gc[:, -1:].expand(-1, C - n_rows)], 1)
    gamma = gc.exp()
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    Gamma = (gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, -torch.inf).exp()
    return gc, gamma, Gamma, gc[:, -1:].exp(), (gc[:, -1:] - gc).exp()


def _qk_heads(num_qk, num_v):
    return torch.arange(num_v) // (num_v // num_qk)


def _store(out, t0, rows, X):
    """[H, C, ...] fp64 chunk result -> rows [t0, t0 + rows) of a [T, H, ...] output, in its dtype."""
    out[t0:t0 + rows] = X[:, :rows].movedim(0, 1).to(out.dtype)


def _start_state(states, n, use, Hv, D):
    """The state (or state gradient) a walk starts sequence n from: rows n*Hv.. of `states`, or zeros."""
    return states[n * Hv:(n + 1) * Hv].double() if use else torch.zeros(Hv, D, D, dtype=torch.float64)


def _v_new(GA, beta, V, gamma, K, S):
    """V' = GA diag(beta) (V - diag(gamma) K S) of one chunk (GA = Gamma o A): the fused walk's and the state
    walk's."""
    return GA @ (beta[:, :, None] * (V - gamma[:, :, None] * (K @ S)))


def _scores(Q, K, Gamma, scale):
    """P = scale (Gamma o Q K^T) of one chunk, [H, C, C] (Gamma: zero above the diagonal)."""
    return scale * (Gamma * (Q @ K.transpose(-1, -2)))


def _output(Q, K, S, Vn, gamma, Gamma, scale, P=None):
    """O = scale diag(gamma) Q S + P V' of one chunk, [H, C, D], with P = `_scores` unless given."""
    P = _scores(Q, K, Gamma, scale) if P is None else P
    return scale * gamma[:, :, None] * (Q @ S) + P @ Vn


def emulate_wy_inverse(k, beta, beta32, g, cu, offsets, GA, gcum, chunk_slots, search_steps, heads_per_cta, shared_k=True,
                       copy_beta=None):
    """shared_k, copy_beta: the build launched (one v-head per CTA without shared_k; beta in k's dtype, its fp32
    copy written to beta32, with copy_beta; None: the build beta's dtype calls for)."""
    if copy_beta is None:
        copy_beta = beta.dtype != torch.float32
    if beta.dtype != (k.dtype if copy_beta else torch.float32):  # the build's signature types beta
        raise TypeError(f"wy_inverse (copy_beta={copy_beta}) launched with {beta.dtype} beta and {k.dtype} k")
    Hv = GA.shape[1]
    if (Hv // k.shape[1]) % heads_per_cta or (heads_per_cta > 1 and not shared_k):  # one k-head per CTA
        raise ValueError(f"wy_inverse (shared_k={shared_k}) launched with {heads_per_cta} v-heads per CTA for GQA "
                         f"groups of {Hv // k.shape[1]}")
    hk = _qk_heads(k.shape[1], Hv)
    for _, _, t0, n in _chunks(cu):
        K = _rows(k, t0, n, hk)  # [Hv, C, D]
        b = _rows(beta, t0, n)  # [Hv, C]
        gc = _rows(g, t0, n).cumsum(-1)
        L = torch.tril(b[:, :, None] * (K @ K.transpose(-1, -2)), -1)
        eye = torch.eye(C, dtype=torch.float64).expand_as(L)
        A = torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True)
        lower = torch.ones(C, C, dtype=torch.bool).tril()
        Gamma = (gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, -torch.inf).exp()
        gcum[:, t0:t0 + n] = gc[:, :n].to(gcum.dtype)
        if copy_beta:
            beta32[t0:t0 + n] = beta[t0:t0 + n].float()
        _store(GA, t0, n, Gamma * A)  # the walks' operand carries its gate mask, not beta


def emulate_chunk_states(k, v, GA, beta, gcum, cu, offsets, h0, h_out, vnew, ht, mt, active, flags, exact, use_h0,
                         store_ht, store_chunks, with_transition, use_active, threshold):
    """The state walk: V' = GA diag(beta) (V - diag(gamma) K S) from GA, v and beta (V = 0 for the transition
    walks). use_active = FROM_GATES: the walks' gate statistics first, into active and exact
    (`emulate_gate_statistics`: the kernel's `gate_statistics` adds the chunk sums in the same order)."""
    from flashqla.kernels.hopper.launch import FROM_GATES

    Hv, D = v.shape[1], v.shape[2]
    N = cu.numel() - 1
    hk = _qk_heads(k.shape[1], Hv)
    if use_active == FROM_GATES:
        emulate_gate_statistics(gcum, cu, flags, exact.view(N, Hv), active.view(2, N, Hv), threshold)
    # walk 0: V from h0 (the states, or S*); walk 1 (with_transition): V = 0 from I, into mt (M)
    for kind in range(1 + with_transition):
        # active a: 0 skips the walk (zeros stored), a >= 1 starts it from S0 at chunk a - 1
        first = (active.view(2, N, Hv)[kind].long() - 1) if use_active else torch.zeros(N, Hv, dtype=torch.long)
        runs = first >= 0
        S = None
        for n, c, t0, rows in _chunks(cu):
            if c == 0:
                if kind == 0:
                    S0 = _start_state(h0, n, use_h0, Hv, D)
                else:
                    S0 = torch.eye(D, dtype=torch.float64).expand(Hv, D, D).clone()
                S0 = S0 * runs[n, :, None, None]  # a skipped walk stores zeros
                S = S0
            restart = (first[n] == c)[:, None, None]  # the walks that start at this chunk
            S = torch.where(restart, S0, S)
            _, gamma, _, gamma_last, to_end = _gates(gcum, t0, rows)
            if store_chunks:
                h_out[offsets[n] + c] = S.to(h_out.dtype)
            K = _rows(k, t0, rows, hk)
            # a walk reads nothing before its start chunk
            reads = (runs[n] & (first[n] <= c))[:, None, None]
            V = _rows(v, t0, rows) if kind == 0 else 0.0
            Vn = torch.where(reads, _v_new(_rows(GA, t0, rows), _rows(beta, t0, rows), V, gamma, K, S), 0.0)
            if store_chunks:
                _store(vnew, t0, rows, Vn)
            S = gamma_last[:, :, None] * S + K.transpose(-1, -2) @ (to_end[:, :, None] * Vn)
            S = S * runs[n, :, None, None]
            if store_ht and t0 + rows == cu[n + 1]:
                (ht if kind == 0 else mt)[n * Hv:(n + 1) * Hv] = S.to(ht.dtype)


def emulate_chunk_output(q, k, vnew, gcum, h_in, cu, offsets, o, scale, search_steps):
    Hv = vnew.shape[1]
    hk = _qk_heads(q.shape[1], Hv)
    for n, c, t0, rows in _chunks(cu):
        _, gamma, Gamma, _, _ = _gates(gcum, t0, rows)
        Q, K = _rows(q, t0, rows, hk), _rows(k, t0, rows, hk)
        _store(o, t0, rows, _output(Q, K, h_in[offsets[n] + c].double(), _rows(vnew, t0, rows), gamma, Gamma, scale))


def emulate_chunk_scores(q, k, gcum, cu, offsets, P, scale, chunk_slots, search_steps):
    Hv = P.shape[1]
    hk = _qk_heads(q.shape[1], Hv)
    for _, _, t0, rows in _chunks(cu):
        _, _, Gamma, _, _ = _gates(gcum, t0, rows)
        _store(P, t0, rows, _scores(_rows(q, t0, rows, hk), _rows(k, t0, rows, hk), Gamma, scale))


def emulate_fused_fwd_scores(q, k, v, GA, beta, gcum, cu, offsets, h0, o, ht, h_out, P, scale, use_h0, store_ht,
                             store_states):
    """The fused walk's scores build: O from chunk_scores' P (rows past a sequence's end read as zero)."""
    emulate_fused_fwd(q, k, v, GA, beta, gcum, cu, offsets, h0, o, ht, h_out, scale, use_h0, store_ht, store_states,
                      P=P)


def emulate_fused_fwd(q, k, v, GA, beta, gcum, cu, offsets, h0, o, ht, h_out, scale, use_h0, store_ht, store_states,
                      P=None):
    """The fused walk: O (store_states 0), the state entering every chunk at its slot and no O (1), or both (2).
    P: chunk_scores' output, which the scores build reads (None: O's scores formed here)."""
    Hv, D = v.shape[1], v.shape[2]
    hk = _qk_heads(q.shape[1], Hv)
    S = None
    for n, c, t0, rows in _chunks(cu):
        if c == 0:
            S = _start_state(h0, n, use_h0, Hv, D)
        _, gamma, Gamma, gamma_last, to_end = _gates(gcum, t0, rows)
        Q, K = _rows(q, t0, rows, hk), _rows(k, t0, rows, hk)
        Vn = _v_new(_rows(GA, t0, rows), _rows(beta, t0, rows), _rows(v, t0, rows), gamma, K, S)
        if store_states:
            h_out[offsets[n] + c] = S.to(h_out.dtype)
        if store_states != 1:
            # P rounded to the input dtype before P V', as the kernel's P_sh (or chunk_scores' output) holds it
            P_chunk = _scores(Q, K, Gamma, scale).to(o.dtype).double() if P is None else _rows(P, t0, rows)
            _store(o, t0, rows, _output(Q, K, S, Vn, gamma, Gamma, scale, P_chunk))
        S = gamma_last[:, :, None] * S + K.transpose(-1, -2) @ (to_end[:, :, None] * Vn)
        if store_ht and t0 + rows == cu[n + 1]:
            ht[n * Hv:(n + 1) * Hv] = S.to(ht.dtype)


def emulate_chunk_dstates(q, k, GA, beta, do, gcum, cu, offsets, dht, dh_out, dh0, last_chunks, scale, use_dht,
                          store_dh0, store_dh, use_last):
    """W = GA diag(beta gamma) K per chunk (the kernel takes W^T dV' as K^T diag(beta gamma) (GA^T dV'), never
    forming W). use_last: the walk of (n, h) covers chunks last_chunks[h * N + n] .. 0 of its sequence only."""
    Hv, D = do.shape[1], do.shape[2]
    hk = _qk_heads(q.shape[1], Hv)
    chunks = list(_chunks(cu))
    for n in range(cu.numel() - 1):
        dS = _start_state(dht, n, use_dht, Hv, D)
        for _, c, t0, rows in reversed([ch for ch in chunks if ch[0] == n]):
            walks = (last_chunks.view(Hv, -1)[:, n].long() >= c) if use_last else torch.ones(Hv, dtype=torch.bool)
            _, gamma, Gamma, gamma_last, to_end = _gates(gcum, t0, rows)
            Q, K, dOs = _rows(q, t0, rows, hk), _rows(k, t0, rows, hk), scale * _rows(do, t0, rows)
            if store_dh:
                dh_out[offsets[n] + c] = dS.to(dh_out.dtype)
            P = Gamma * (Q @ K.transpose(-1, -2))
            X = P.transpose(-1, -2) @ dOs + to_end[:, :, None] * (K @ dS)
            W = _rows(GA, t0, rows) @ ((gamma * _rows(beta, t0, rows))[:, :, None] * K)
            dS = torch.where(walks[:, None, None], gamma_last[:, :, None] * dS
                             + Q.transpose(-1, -2) @ (gamma[:, :, None] * dOs) - W.transpose(-1, -2) @ X, dS)
        if store_dh0:
            dh0[n * Hv:(n + 1) * Hv] = dS.to(dh0.dtype)


def emulate_chunk_bwd_local(q, k, v, do, GA, gcum, beta, h, dh, cu, offsets, dq, dk, dv, dg, dbeta, scale,
                            search_steps, num_ctas, pair_sum="none"):
    """reference.chunk_backward per chunk on its zero-padded rows (the kernel's masking), dg summed; its A is
    GA / Gamma (0 where Gamma underflows: those entries of GA are 0 and reach no gradient term beyond it).
    pair_sum "ordered": dq and dk [T, Hv / 2, 128] hold each v-head pair's sum of its rows, each rounded to the
    dtype, in place of what is there (the pair's first v-head stores, the second adds by TMA reduce)."""
    from flashqla.kernels.hopper import launch
    from flashqla.ops import reference

    # persistent: one CTA per SM takes every num_ctas-th chunk; the host passes the device's SM count
    if num_ctas != launch._sm_count(0):
        raise ValueError(f"chunk_bwd_local launched with {num_ctas} CTAs on a device of {launch._sm_count(0)} SMs")
    hk = _qk_heads(q.shape[1], v.shape[1])
    for n, c, t0, rows in _chunks(cu):
        one = lambda t, heads=None: _rows(t, t0, rows, heads)[None, None]  # noqa: E731  [1, 1, Hv, C, ...]
        gc, _, Gamma, _, _ = _gates(gcum, t0, rows)
        A = torch.where(Gamma > 0, _rows(GA, t0, rows) / Gamma, 0.0)[None, None]
        gc = gc[None, None]
        x = reference.ChunkInputs(one(q, hk), one(k, hk), one(v), gc, one(beta), A, reference.decay_factors(gc))
        b = reference.backward_terms(x, one(do), scale)
        slot = offsets[n] + c
        gq, gk, gv, ggc, gbeta = reference.chunk_backward(x, b, h[slot].double()[None, None], dh[slot].double()[None, None])
        summed = pair_sum == "ordered"
        for out, grad in ((dv, gv), (dbeta, gbeta)) if summed else ((dq, gq), (dk, gk), (dv, gv), (dbeta, gbeta)):
            _store(out, t0, rows, grad[0, 0])
        if summed:
            if dq.shape[1] * 2 != v.shape[1]:
                raise ValueError(f"pair_sum {pair_sum}: dq has {dq.shape[1]} heads for {v.shape[1]} v-heads")
            for out, grad in ((dq, gq), (dk, gk)):
                each = grad[0, 0, :, :rows].to(out.dtype).float()  # [Hv, rows, D], rounded per v-head
                out[t0:t0 + rows] = (each[0::2] + each[1::2]).movedim(0, 1).to(out.dtype)
        dg[:, t0:t0 + rows] = reference.gate_gradient(ggc)[0, 0, :, :rows].to(dg.dtype)


def emulate_gqa_sum(dq, dk, dq_out, dk_out):
    """Each k-head's group of v-head rows summed in fp32, rounded once."""
    for src, dst in ((dq, dq_out), (dk, dk_out)):
        dst.copy_(src.float().sum(1).to(dst.dtype))


def emulate_segment_chain(out, bias, mats, mask, first_rows, last_rows, num_heads, reverse, zero_start):
    for first, last in zip(first_rows.tolist(), last_rows.tolist()):
        start = last if reverse else first
        if zero_start:
            out[start * num_heads:(start + 1) * num_heads] = 0.0
        rows = range(last - 1, first - 1, -1) if reverse else range(first + 1, last + 1)
        for r in rows:
            src = r + 1 if reverse else r - 1
            for h in range(num_heads):
                M = mats[src * num_heads + h].double()
                prev = out[src * num_heads + h].double()
                step = (M.t() if reverse else M) @ prev
                if not reverse:
                    factor = mask[r * num_heads + h].double()
                else:  # out of the last row into the final state, else the exact flag of the row after next
                    factor = 1.0 if r + 1 == last else mask[(r + 2) * num_heads + h].double()
                out[r * num_heads + h] = (bias[src * num_heads + h].double() + factor * step).to(out.dtype)


def emulate_gate_statistics(gcum, cu, flags, exact, active, threshold):
    """Per (row, head): the chunk sums from the row's last chunk back, added in fp32 in that order, until one
    is below the threshold (chunk_states.py `gate_statistics`)."""
    from flashqla.kernels.hopper.launch import ALWAYS_M, FORCE_M, FORCE_S, HAS_NEXT, INTO_EXACT

    bounds, row_flags = cu.tolist(), flags.tolist()
    exact[0] = 0.0
    for j, (start, end, f) in enumerate(zip(bounds[:-1], bounds[1:], row_flags)):
        ends = list(range(start + 64, end, 64)) + [end]  # the token after every chunk
        for h in range(gcum.shape[0]):
            total = torch.zeros((), dtype=torch.float32)
            warm, walk_from = False, 1
            for c in range(len(ends) - 1, -1, -1):
                total = total + gcum[h, ends[c] - 1].float()
                if total < threshold:
                    warm, walk_from = True, c + 1
                    break
            has_next = bool(f & HAS_NEXT)
            active[0, j, h] = 1 if f & FORCE_S else has_next * walk_from
            active[1, j, h] = int(bool(f & (FORCE_M | ALWAYS_M)) or (bool(f & INTO_EXACT) and not warm))
            if j + 1 < len(row_flags):
                exact[j + 1, h] = float(has_next and not warm)


def gate_statistics(gcum, cu, flags, threshold):
    """(exact fp32 [rows, Hv], active int32 [2, rows, Hv]) of `emulate_gate_statistics`, on new CPU tensors."""
    rows, heads = flags.numel(), gcum.shape[0]
    exact, active = torch.empty(rows, heads), torch.empty(2, rows, heads, dtype=torch.int32)
    emulate_gate_statistics(gcum.cpu(), cu.cpu(), flags.cpu(), exact, active, threshold)
    return exact, active


def install(monkeypatch):
    """Replace every compiled kernel (and the SM count query) of flashqla.kernels.hopper by the emulators."""
    from flashqla.kernels.hopper import backward, launch

    kernels = {
        "compiled_wy_inverse": lambda dtype, shared_k, copy_beta: functools.partial(emulate_wy_inverse, shared_k=shared_k,
                                                                                     copy_beta=copy_beta),
        "compiled_chunk_states": lambda dtype, block_v: emulate_chunk_states,
        "compiled_chunk_output": lambda dtype: emulate_chunk_output,
        "compiled_fused_fwd": lambda dtype, block_v, keep_states=False, scores=False: (
            emulate_fused_fwd_scores if scores else emulate_fused_fwd),
        "compiled_chunk_scores": lambda dtype: emulate_chunk_scores,
        "compiled_chunk_dstates": lambda dtype, block_v: emulate_chunk_dstates,
        "compiled_chunk_bwd_local": lambda dtype, pair_sum: functools.partial(emulate_chunk_bwd_local,
                                                                              pair_sum=pair_sum),
        "compiled_gqa_sum": lambda dtype: emulate_gqa_sum,
        "compiled_segment_chain": lambda block_v: emulate_segment_chain,
    }
    for module in (launch, backward):
        for name, fake in kernels.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fake)
    monkeypatch.setattr(launch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
