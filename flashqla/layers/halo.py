"""Conv halo exchange for sequence parallelism (contiguous layout: rank r holds the r-th slice of the pack).

The short conv of rank r's first token reads the W - 1 pre-conv rows before it. When that sequence
started on an earlier rank, those rows live on rank r - 1, or further back if rank r - 1 holds fewer
than W - 1 of them; rows that belong to another sequence read as zero. Each rank publishes its last
W - 1 rows and three numbers, every rank derives from them where each rank's halo comes from, and
the backward pass sends each halo gradient back to the rows it was read from.

Every rank joins one all_gather of the metadata and one of the tails in forward, and one all_gather
of the halo gradients in backward, whether or not its own halo is empty, so no rank can skip a
collective. Works with gloo (CPU) and NCCL.

The context is duck-typed: `group`, `rank`, `world_size`, `cu_seqlens` (this rank's local
cu_seqlens), `first_seq_continues` (this rank's first token continues a sequence of an earlier rank).
"""
import torch
import torch.distributed as dist


def _local_meta(cu_seqlens, first_seq_continues: bool, halo: int):
    """(own, passes, continues): `own` = how many of my last `halo` rows belong to my last sequence;
    `passes` = my last sequence started on an earlier rank (I hold one sequence that continues);
    `continues` = my first token continues an earlier rank's sequence."""
    bounds = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else [int(b) for b in cu_seqlens]
    num_tokens, last_start = bounds[-1], bounds[-2] if len(bounds) > 1 else 0
    passes = first_seq_continues and last_start == 0
    return min(halo, num_tokens - last_start), int(passes), int(first_seq_continues)


def halo_sources(meta, rank: int, halo: int):
    """Where rank `rank`'s halo rows come from: a list of (src_rank, src_rows slice, halo_rows slice),
    with src_rows indexing src_rank's published tail [halo, C]. meta: [world, 3] ints from _local_meta."""
    own, passes, continues = (list(col) for col in zip(*meta))
    sources = []
    if not continues[rank]:
        return sources
    need, src = halo, rank - 1
    while need > 0 and src >= 0:
        take = min(own[src], need)
        if take:
            sources.append((src, slice(halo - take, halo), slice(need - take, need)))
        need -= take
        if not passes[src]:
            break
        src -= 1
    return sources


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tail, meta, group, rank, world_size):
        halo = tail.shape[0]
        tails = [torch.empty_like(tail) for _ in range(world_size)]
        dist.all_gather(tails, tail.contiguous(), group=group)
        received = tail.new_zeros(tail.shape)
        for src, src_rows, dst_rows in halo_sources(meta, rank, halo):
            received[dst_rows] = tails[src][src_rows]
        ctx.meta, ctx.group, ctx.rank, ctx.world_size = meta, group, rank, world_size
        return received

    @staticmethod
    def backward(ctx, grad_received):
        halo = grad_received.shape[0]
        grads = [torch.empty_like(grad_received) for _ in range(ctx.world_size)]
        dist.all_gather(grads, grad_received.contiguous(), group=ctx.group)
        grad_tail = grad_received.new_zeros(grad_received.shape)
        for dst in range(ctx.world_size):
            for src, src_rows, dst_rows in halo_sources(ctx.meta, dst, halo):
                if src == ctx.rank:
                    grad_tail[src_rows] += grads[dst][dst_rows]
        return grad_tail, None, None, None, None


def exchange_conv_halo(x: torch.Tensor, cp_context, halo: int) -> torch.Tensor:
    """x: this rank's pre-conv rows [T_local, C]. Returns the rows [halo, C] that precede this rank's
    first token within its sequence (zeros where there are none), differentiable w.r.t. x on every rank."""
    group, rank, world_size = cp_context.group, cp_context.rank, cp_context.world_size
    meta = torch.tensor(_local_meta(cp_context.cu_seqlens, bool(cp_context.first_seq_continues), halo),
                        device=x.device)
    metas = [torch.empty_like(meta) for _ in range(world_size)]
    dist.all_gather(metas, meta, group=group)
    meta_table = torch.stack(metas).tolist()
    if meta_table[0][2]:
        raise ValueError("cp_context.first_seq_continues is True on rank 0: nothing precedes rank 0")
    tail = x[max(x.shape[0] - halo, 0):]
    tail = torch.cat([tail.new_zeros(halo - tail.shape[0], x.shape[1]), tail])
    return _HaloExchange.apply(tail, meta_table, group, rank, world_size)
