"""Which sequence a chunk slot belongs to, for the kernels with one CTA per chunk slot.

Chunks never straddle sequences: chunk slot c belongs to the last sequence n with chunk_offsets[n] <= c
(chunk_offsets = exclusive prefix sum of the chunks per sequence, launch.chunk_offsets_of), found by a
binary search of `search_steps` = bit length of the number of sequences. Slots past the last chunk get
the last sequence; the callers give them no rows.
"""
import tilelang.language as T


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
