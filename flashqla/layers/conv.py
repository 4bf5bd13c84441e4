"""Causal depthwise short convolution over packed sequences (the torch reference path).

Every sequence n of a pack is convolved as if it were preceded by its own `W - 1` rows `prefix[n]`
(zeros for a fresh sequence, the conv state when continuing, the neighbour rank's halo under
sequence parallelism), so no window ever reads a token of another sequence.

Layout: tokens are rows, channels are columns ([T, C]); prefixes are [N, W - 1, C].
`causal_conv1d` runs the fused TileLang kernels (flashqla/layers/fused.py) when the tensors are on an
SM90 GPU and the call fits them (FLASHQLA_FUSED_LAYER_OPS=0 turns them off), and the torch reference
`causal_conv1d_reference` otherwise; both have the same contract.
"""
import torch
import torch.nn.functional as F


def _segment_index(cu_seqlens: torch.Tensor, width: int):
    """Where prefixes and tokens land in the "extended" pack [prefix_0, seq_0, prefix_1, seq_1, ...].

    Returns (order, token_row, tail_rows): `extended = cat([prefixes.flatten(0, 1), tokens])[order]`,
    token t sits at extended row `token_row[t]`, and `tail_rows[n]` are the last W - 1 rows of
    sequence n's segment (its prefix included).
    """
    halo = width - 1
    device = cu_seqlens.device
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    num_seqs, total = lengths.numel(), int(cu_seqlens[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths)
    token_row = torch.arange(total, device=device) + (seq_of_token + 1) * halo
    seg_start = starts + torch.arange(num_seqs, device=device) * halo
    offsets = torch.arange(halo, device=device)
    prefix_rows = (seg_start[:, None] + offsets).reshape(-1)
    tail_rows = (seg_start + lengths)[:, None] + offsets
    order = torch.empty(total + num_seqs * halo, dtype=torch.long, device=device)
    order[prefix_rows] = torch.arange(num_seqs * halo, device=device)
    order[token_row] = torch.arange(total, device=device) + num_seqs * halo
    return order, token_row, tail_rows


def causal_conv1d(x, weight, cu_seqlens, prefix=None, silu=True):
    """causal_conv1d_reference's contract; the fused kernels serve it where they can (module docstring)."""
    if x.is_cuda:
        from . import fused

        reason = fused.conv_unsupported_reason(x, weight, prefix, silu)
        if reason is None:
            return fused.causal_conv1d(x, weight, cu_seqlens, prefix)
        fused.note_fallback_once("causal_conv1d", reason)
    return causal_conv1d_reference(x, weight, cu_seqlens, prefix, silu)


def causal_conv1d_reference(x, weight, cu_seqlens, prefix=None, silu=True):
    """y[t] = act(sum_j weight[:, j] * ext[t - (W - 1) + j]), where ext is x's sequence after its prefix.

    x: [T, C] packed tokens; weight: [C, W] (the `nn.Conv1d` depthwise weight squeezed);
    cu_seqlens: int [N + 1] with cu_seqlens[-1] == T; prefix: [N, W - 1, C] or None (zeros).
    Returns (y [T, C] in x's dtype, new_prefix [N, W - 1, C]): new_prefix holds the last W - 1 rows
    of each sequence counting its prefix, i.e. the conv state after this call.
    """
    T, C = x.shape
    width = weight.shape[1]
    if prefix is None:
        prefix = x.new_zeros(cu_seqlens.numel() - 1, width - 1, C)
    order, token_row, tail_rows = _segment_index(cu_seqlens, width)
    extended = torch.cat([prefix.reshape(-1, C).to(x.dtype), x])[order]
    if T == 0:
        return x.new_zeros(0, C), extended[tail_rows]
    # one unpadded depthwise conv over the whole extended pack: output column i is the window that
    # ends at extended row i + W - 1; windows that straddle two segments are computed and dropped
    # (explicit contiguous copies both ways: gathering columns of the channel-first output instead is
    # ~4x slower fwd+bwd on H200)
    windows = F.conv1d(extended.T.contiguous()[None], weight[:, None, :].to(x.dtype), groups=C)[0].T.contiguous()
    y = windows[token_row - (width - 1)]
    return (F.silu(y) if silu else y), extended[tail_rows]
