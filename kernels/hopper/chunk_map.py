"""Which sequence and tokens a chunk slot holds, for the kernels with one CTA per chunk slot.

Chunks never straddle sequences: chunk slot c belongs to the last sequence n with chunk_offsets[n] <= c
(chunk_offsets = exclusive prefix sum of the chunks per sequence, launch.chunk_offsets_of), found by a
binary search of `search_steps` = bit length of the number of sequences. Slots past the last chunk get
the last sequence and no rows.
"""
import tilelang.language as T

CHUNK = 64


@T.macro
def sequence_of_chunk(chunk_offsets, num_seqs, chunk, search_steps):
    """The sequence of chunk slot `chunk`, an int32 local variable."""
    lo = T.alloc_var("int32")
    hi = T.alloc_var("int32")
    lo = 0
    hi = num_seqs - 1
    for _ in T.serial(search_steps):
        mid = (lo + hi + 1) // 2
        if chunk_offsets[mid] <= chunk:
            lo = mid
        else:
            hi = mid - 1
    return lo


@T.macro
def chunk_of_slot(cu_seqlens, chunk_offsets, num_seqs, chunk, search_steps):
    """(sequence, first token, rows) of chunk slot `chunk`: rows is the number of its tokens inside the
    sequence (CHUNK except in a sequence's last chunk; 0 for slots past the last chunk)."""
    seq = sequence_of_chunk(chunk_offsets, num_seqs, chunk, search_steps)
    start = cu_seqlens[seq] + (chunk - chunk_offsets[seq]) * CHUNK
    n_rows = T.if_then_else(chunk < chunk_offsets[num_seqs], T.min(CHUNK, cu_seqlens[seq + 1] - start), 0)
    return seq, start, n_rows
