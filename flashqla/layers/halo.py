"""Conv halo exchange for sequence parallelism.

The token stream is cut into parts held by the ranks: part r on rank r (contiguous layout), or parts r
and 2W-1-r on rank r (zigzag); parts are chained in global token order whatever rank holds them. The
short conv of a part's first token reads the W - 1 pre-conv rows before it. When that sequence
started in an earlier part, those rows are the tail of part p - 1, or reach further back when part
p - 1 holds fewer than W - 1 of them; rows of another sequence read as zero. Each rank publishes the
last W - 1 rows of each of its parts with three numbers per part; every rank derives from them where
every part's halo comes from, and the backward pass sends each halo gradient to the rows it was read
from.

Every rank joins one all_gather of the metadata and one of the tails in forward, and one all_gather
of the halo gradients in backward, whether or not its own halos are empty, so no rank can skip a
collective. Works with gloo (CPU) and NCCL.

The context is duck-typed: `group`, `rank`, `world_size`, `cu_seqlens` (local offsets), and either
`pieces` (objects with `index`, `local_start`, `length`, `first_seq_continues`: the parts this rank
holds, as flashqla.cp's context has them) or, for the contiguous layout, `first_seq_continues`.
"""
import torch
import torch.distributed as dist


def _pieces(cp_context, bounds):
    """(part index, local start, length, first_seq_continues) of every part this rank holds."""
    pieces = getattr(cp_context, "pieces", None)
    if pieces is None:
        return [(cp_context.rank, 0, bounds[-1], bool(cp_context.first_seq_continues))]
    return [(p.index, p.local_start, p.length, bool(p.first_seq_continues)) for p in pieces]


def _part_meta(bounds, start, length, continues, halo):
    """(own, passes, continues) of one part: `own` = how many of its last `halo` rows belong to its last
    sequence; `passes` = its last sequence started in an earlier part (it is also its first)."""
    last_start = max([b - start for b in bounds if start <= b < start + length], default=0)
    return min(halo, length - last_start), int(continues and last_start == 0), int(continues)


def halo_sources(meta, part: int, halo: int):
    """Where part `part`'s halo rows come from: a list of (src_part, src_rows slice, halo_rows slice),
    src_rows indexing src_part's published tail [halo, C]. meta[p] = (own, passes, continues) of part p."""
    sources = []
    if not meta[part][2]:
        return sources
    need, src = halo, part - 1
    while need > 0 and src >= 0:
        own, passes, _ = meta[src]
        take = min(own, need)
        if take:
            sources.append((src, slice(halo - take, halo), slice(need - take, need)))
        need -= take
        if not passes:
            break
        src -= 1
    return sources


class _HaloExchange(torch.autograd.Function):
    """tails [k, halo, C] (this rank's k parts) -> received halos [k, halo, C]."""

    @staticmethod
    def forward(ctx, tails, meta, holder, my_parts, group, world_size):
        halo = tails.shape[1]
        gathered = [torch.empty_like(tails) for _ in range(world_size)]
        dist.all_gather(gathered, tails.contiguous(), group=group)
        received = tails.new_zeros(tails.shape)
        for slot, part in enumerate(my_parts):
            for src, src_rows, dst_rows in halo_sources(meta, part, halo):
                src_rank, src_slot = holder[src]
                received[slot, dst_rows] = gathered[src_rank][src_slot, src_rows]
        ctx.meta, ctx.holder, ctx.my_parts, ctx.group, ctx.world_size = meta, holder, my_parts, group, world_size
        return received

    @staticmethod
    def backward(ctx, grad_received):
        halo = grad_received.shape[1]
        gathered = [torch.empty_like(grad_received) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, grad_received.contiguous(), group=ctx.group)
        grad_tails = grad_received.new_zeros(grad_received.shape)
        for part, (dst_rank, dst_slot) in enumerate(ctx.holder):
            for src, src_rows, dst_rows in halo_sources(ctx.meta, part, halo):
                if src in ctx.my_parts:
                    grad_tails[ctx.my_parts.index(src), src_rows] += gathered[dst_rank][dst_slot, dst_rows]
        return grad_tails, None, None, None, None, None


def halo_prefix(x: torch.Tensor, cp_context, halo: int) -> torch.Tensor:
    """x: this rank's pre-conv rows [T_local, C]. Returns the conv prefix of every local sequence,
    [N_local, halo, C]: the halo received for the first sequence of each part, zeros elsewhere;
    differentiable w.r.t. x on every rank."""
    bounds = getattr(cp_context, "local_bounds", None)  # flashqla.cp's context keeps a host copy: no sync
    if bounds is None:
        bounds = cp_context.cu_seqlens
    bounds = bounds.tolist() if torch.is_tensor(bounds) else [int(b) for b in bounds]
    pieces = _pieces(cp_context, bounds)
    my_parts = [index for index, *_ in pieces]
    meta = torch.tensor([[index, *_part_meta(bounds, start, length, continues, halo)]
                         for index, start, length, continues in pieces], device=x.device)
    gathered = [torch.empty_like(meta) for _ in range(cp_context.world_size)]
    dist.all_gather(gathered, meta, group=cp_context.group)
    table = {}  # part index -> (own, passes, continues, holder rank, slot)
    for rank, rows in enumerate(torch.stack(gathered).tolist()):
        for slot, (index, own, passes, continues) in enumerate(rows):
            table[index] = (own, passes, continues, rank, slot)
    if sorted(table) != list(range(len(table))):
        raise ValueError(f"cp_context: the ranks' parts {sorted(table)} do not cover 0..{len(table) - 1}")
    if table[0][2]:
        raise ValueError("cp_context: the first part is marked first_seq_continues, but nothing precedes it")
    meta_by_part = [table[p][:3] for p in range(len(table))]
    holder = [table[p][3:] for p in range(len(table))]

    tails = []
    for _, start, length, _ in pieces:
        rows = x[max(start + length - halo, start): start + length]
        tails.append(torch.cat([rows.new_zeros(halo - rows.shape[0], x.shape[1]), rows]))
    received = _HaloExchange.apply(torch.stack(tails), meta_by_part, holder, my_parts, cp_context.group,
                                   cp_context.world_size)
    num_seqs = len(bounds) - 1
    # the sequence a part's halo belongs to: the last local sequence starting at the part's start
    first_seq = []
    for _, start, _, _ in pieces:
        starting = [j for j in range(num_seqs) if bounds[j] == start]
        if not starting:
            raise ValueError(f"cp_context.cu_seqlens {bounds} must have a sequence start at every part start ({start})")
        first_seq.append(starting[-1])
    prefix = x.new_zeros(num_seqs, halo, x.shape[1])
    return prefix.index_put((torch.tensor(first_seq, device=x.device),), received)
