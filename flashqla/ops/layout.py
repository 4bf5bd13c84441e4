"""Token stream <-> chunk grid.

The kernels walk each sequence chunk by chunk (C = 64 tokens). The reference does the same on a dense
grid: row n of the grid is one run of consecutive chunks that starts from its own state (a sequence, or
an intra-card CP segment), column c is its c-th chunk, and position r in [0, C) is a token. Slots past
the end of a run hold zeros for q, k, v, g and beta, which makes them exact identity steps of the
recurrence (gamma = 1, nothing written to the state), so every row can be advanced in lock-step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 64


@dataclass(frozen=True)
class ChunkGrid:
    """Where each grid slot reads from in the flat token stream (length B*T)."""

    token_index: torch.Tensor  # [rows, chunks, C] int64 into the flat stream, -1 for an empty slot
    num_tokens: int  # B*T

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B*T, *F] -> [rows, chunks, C, *F], zeros in empty slots."""
        padded = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])
        index = self.token_index.to(x.device).reshape(-1)
        return padded[index].reshape(self.token_index.shape + x.shape[1:])

    def scatter(self, xc: torch.Tensor) -> torch.Tensor:
        """[rows, chunks, C, *F] -> [B*T, *F]; tokens in no slot come back as zeros."""
        feature_shape = xc.shape[3:]
        index = self.token_index.to(xc.device).reshape(-1)
        valid = index >= 0
        out = xc.new_zeros((self.num_tokens,) + feature_shape)
        out[index[valid]] = xc.reshape((-1,) + feature_shape)[valid]
        return out


def runs_from_lengths(starts: list[int], lengths: list[int], num_tokens: int) -> ChunkGrid:
    """A grid whose rows are the token runs [start, start + length)."""
    max_chunks = max([(n + CHUNK - 1) // CHUNK for n in lengths] + [1])
    index = torch.full((len(lengths), max_chunks * CHUNK), -1, dtype=torch.int64)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        index[row, :length] = torch.arange(start, start + length)
    return ChunkGrid(index.reshape(len(lengths), max_chunks, CHUNK), num_tokens)


def sequence_bounds(batch: int, seq_len: int, cu_seqlens: list[int] | None) -> tuple[list[int], list[int]]:
    """(starts, lengths) of the sequences in the flat stream: the B rows, or the packed cu_seqlens."""
    if cu_seqlens is None:
        return [b * seq_len for b in range(batch)], [seq_len] * batch
    return cu_seqlens[:-1], [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
