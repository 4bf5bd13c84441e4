"""Host side of the SM90 forward: compile cache, V-tile choice, chunk bookkeeping, the two launches."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from .. import switched_on
from ..cache import compile_kernel

HEAD_DIM = 128
CHUNK = 64
TARGET = {"kind": "cuda", "arch": "sm_90a"}
BLOCK_V_CHOICES = (128, 64, 32)
# A CTA per (sequence, v-head, V tile) walks its sequence serially, so a call with few sequences x
# heads leaves SMs idle; narrower V tiles give more CTAs at the cost of re-reading Q, K and Ab.
# benchmarks/bench_walks.py on the H200 (2026-11-30, docs/benchmarks.md): this threshold picks the
# fastest width for the two walks together at 1 x 8, 1 x 32, 8 x 8, 4 x 32, 4 x 64 and 64 x 8 walks.
MIN_CTAS_PER_SM = 0.7
# The summary walks (intra-card CP, `summaries`) are mostly skipped or short (a warmed-up head walks its
# segment's last chunks), so the few long ones, the exact heads', set the launch's time, and a narrower V
# tile shortens each of their steps; past about 8 CTAs per SM the short ones' scheduling and the re-read K
# and W tiles cost more. H200, public op forward, 2026-12-01 (docs/kernels.md, "Fourteenth session"):
# summary tiles of 32 at TP8 32K 0.465 -> 0.431 ms, h32 1.361 -> 1.229; at 512 walks 64 beats 32.
SUMMARY_MAX_CTAS_PER_SM = 8

# The segment chain's V tiles (one CTA each, one CTA per SM by shared memory): 4 within one wave, else 8 up to
# CHAIN_MAX_WAVES_AT_8 waves, else 16. H200, 2026-12-01 (docs/kernels.md, "Fifteenth session"): 16 steps x 8
# heads, all exact, 69 -> 44 us at 8 (16 CTAs per head). 4 columns (one sequence of 4 v-heads, 128 CTAs), H100,
# 2026-12-05 ("Forty-second session"): public op fwd+bwd 1-2% faster than at 8 ((2, 4) x 8K 277.7 -> 272.3 us).
# The product's k loop is unrolled at 8 and not at 16 (segment_chain.py), so a step at 16 costs 2-3x one at 8
# and two or three waves at 8 beat one at 16; at four they tie. H100, 2026-12-06 ("Forty-ninth session"), 16
# chains: public op forward with AutoCP, TP4 1 x 32K 448.9 -> 419.8 us, 2B (16, 16) 486.3 -> 460.6, (2, 8)
# 24K + 8K 278.3 -> 258.1; 24 chains (27B, (8, 24)) 670.8 -> 659.1; the mirror scan at 8 as well, fwd+bwd
# 0.3-1.8% faster on eight configs (it runs beside the backward's state recompute); h32 (32 chains) level.
CHAIN_BLOCK_V_CHOICES = (4, 8, 16)
CHAIN_MAX_WAVES_AT_8 = 3

# At V tile 32 the four CTAs of a (sequence, v-head) each formed the same masked scores P in their output
# warpgroup; the walk's `scores` build reads P from one chunk-parallel `chunk_scores` launch instead. That saves
# the walk 3-4 ns per token of its sequence and costs the launch its memory traffic, `scores_bytes` per token
# of every sequence (Q and K read, P written and read again; 1.15 ns per token at 3 KiB, 1.9 at 6 KiB, 2.8 at 10
# KiB). So the build runs where the call's traffic per token of a walk stays within SCORES_MAX_BYTES. H100, public
# op forward, CP off, O bitwise equal, 2026-12-06 (docs/kernels.md, "Fifty-third session"): (2, 8) x 32K 0.935 ->
# 0.843 ms (1.11x), x 16K 1.08x, 24K + 8K 1.06x, (4, 16) x 32K 1.04x, x 16K 1.03x; slower past it: (8, 24) 0.985x,
# (16, 16) 0.97x, (32, 32) 0.86x at 32K, and at V tile 64 ((2, 8) 4K x 8, 0.87x).
# FLASHQLA_CHUNK_SCORES=0 turns it off, for A/B runs and bisecting.
SCORES_BLOCK_V = 32
SCORES_MAX_BYTES = 6144
SCORES_ENV = "FLASHQLA_CHUNK_SCORES"


def scores_bytes(num_qk_heads: int, num_v_heads: int) -> int:
    """Bytes per token that the scores path moves (16-bit inputs): Q and K read, P written and read by the walk."""
    return num_qk_heads * 2 * HEAD_DIM * 2 + num_v_heads * CHUNK * 2 * 2


def reads_chunk_scores(num_seqs: int, num_qk_heads: int, num_v_heads: int, block_v: int) -> bool:
    """Whether a fused forward walk at `block_v` reads P from `chunk_scores` (see SCORES_MAX_BYTES)."""
    return (block_v == SCORES_BLOCK_V and num_seqs * scores_bytes(num_qk_heads, num_v_heads) <= SCORES_MAX_BYTES
            and switched_on(SCORES_ENV))


# Pass configs of single kernel modules, beside every kernel's (`_pass_configs`): segment_chain places its own
# barriers (two a step, segment_chain.py), so it is built without TileLang's thread storage sync pass, which
# put six in every step
MODULE_PASS_CONFIGS = {"segment_chain": {"tl.disable_thread_storage_sync": True}}

# The flag bits of a segment row for the summary walks' gate statistics (chunk_states.py `gate_statistics`;
# set by flashqla/cp/segments.py `_gate_flags`)
HAS_NEXT = 1  # the row's sequence continues in the next row
INTO_EXACT = 2  # M_j is read when the next row is on the exact path
ALWAYS_M = 4  # M_j is read whatever the warmup (the backward's scan into a given final-state gradient)
FORCE_S = 8  # S*_j over the whole row (the state leaving the call)
FORCE_M = 16  # M_j likewise
# chunk_states' `use_active` that has the summary walks compute these statistics themselves (chunk_states.py)
FROM_GATES = 2

# chunk_bwd_local's builds (its `pair_sum`): whether the dq and dk of a v-head pair meet in the kernel
PAIR_SUMS = ("none", "ordered")

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
KERNEL_DTYPES = tuple(_TORCH_TO_TL.values())


def _pass_configs(module: str | None = None):
    """The pass configs of the kernels of kernel module `module` (tilelang.PassConfigKey values, written out
    so as not to import tilelang): every kernel's, with the module's own (MODULE_PASS_CONFIGS)."""
    return {"tl.enable_fast_math": True, **MODULE_PASS_CONFIGS.get(module, {})}


def compile_from(module: str, builder: str, label: str, *args):
    """compile_kernel for `<builder>(*args)` of kernel module `<module>` of this package on TARGET. The
    module (which imports tilelang) is imported only when the cache index does not know the kernel and it
    must be built."""

    def build():
        return getattr(importlib.import_module(f".{module}", __package__), builder)(*args)

    return compile_kernel(build, label, target=TARGET, pass_configs=_pass_configs(module))


@functools.lru_cache(maxsize=None)
def compiled_wy_inverse(dtype: str, shared_k: bool, copy_beta: bool):
    """The compiled wy_inverse kernel for `dtype` (GA and gcum), with `shared_k` the build that takes several
    v-heads of a GQA group per CTA, with `copy_beta` the one that reads beta in `dtype` and writes its fp32
    copy: prebuilt, from TileLang's disk cache, or JIT (kernels/cache.py)."""
    label = f"wy_inverse({dtype}, shared_k={shared_k}" + (", copy_beta=True)" if copy_beta else ")")
    return compile_from("wy_inverse", "build_wy_inverse", label, dtype, shared_k, copy_beta)


@functools.lru_cache(maxsize=None)
def compiled_fused_fwd(dtype: str, block_v: int, keep_states: bool = False, scores: bool = False):
    """The compiled fused forward kernel for `dtype` and V tile width `block_v`; `keep_states`: the build that
    also stores the state entering every chunk; `scores`: the build that reads P from `chunk_scores`."""
    label = f"fused_fwd({dtype}, block_v={block_v}" + (", keep_states=True" if keep_states else "") + (
        ", scores=True" if scores else "") + ")"
    return compile_from("fused_fwd", "build_fused_fwd", label, dtype, block_v, keep_states, scores)


@functools.lru_cache(maxsize=None)
def compiled_chunk_scores(dtype: str):
    """The compiled masked, scaled chunk scores (chunk_scores.py) for `dtype`."""
    return compile_from("chunk_scores", "build_chunk_scores", f"chunk_scores({dtype})", dtype)


@functools.lru_cache(maxsize=None)
def compiled_chunk_states(dtype: str, block_v: int):
    """The compiled state walk (chunk_states.py) for `dtype` and V tile width `block_v`."""
    return compile_from("chunk_states", "build_chunk_states", f"chunk_states({dtype}, block_v={block_v})", dtype,
                        block_v)


@functools.lru_cache(maxsize=None)
def compiled_chunk_output(dtype: str):
    """The compiled chunk-parallel output kernel (chunk_output.py) for `dtype`."""
    return compile_from("chunk_output", "build_chunk_output", f"chunk_output({dtype})", dtype)


@functools.lru_cache(maxsize=None)
def compiled_chunk_dstates(dtype: str, block_v: int):
    """The compiled reverse state-gradient walk (chunk_dstates.py) for `dtype` and `block_v`."""
    return compile_from("chunk_dstates", "build_chunk_dstates", f"chunk_dstates({dtype}, block_v={block_v})", dtype,
                        block_v)


@functools.lru_cache(maxsize=None)
def compiled_chunk_bwd_local(dtype: str, pair_sum: str):
    """The compiled chunk-local backward (chunk_bwd_local.py) for `dtype` (persistent: launched with the SM count
    of the device as its last argument); `pair_sum` ("none", "ordered"): whether dq and dk are summed over
    v-head pairs in the kernel, if they are."""
    label = f"chunk_bwd_local({dtype})" if pair_sum == "none" else f"chunk_bwd_local({dtype}, {pair_sum})"
    return compile_from("chunk_bwd_local", "build_chunk_bwd_local", label, dtype, pair_sum)


@functools.lru_cache(maxsize=None)
def compiled_gqa_sum(dtype: str):
    """The compiled GQA sums of dq and dk (gqa_sum.py) for `dtype`."""
    return compile_from("gqa_sum", "build_gqa_sum", f"gqa_sum({dtype})", dtype)


@functools.lru_cache(maxsize=None)
def compiled_segment_chain(block_v: int):
    """The compiled fp32 chain over intra-card CP segments (segment_chain.py) on V tiles of `block_v`."""
    return compile_from("segment_chain", "build_segment_chain", f"segment_chain(block_v={block_v})", block_v)


def kernel_configs(dtypes=KERNEL_DTYPES):
    """Every (kernel, args) pair dispatch can choose for TileLang dtypes `dtypes`: what a build machine compiles.

    Sizes (tokens, heads, sequences) and the scale are runtime arguments, so no kernel depends on the head
    configuration; `flashqla precompile` relies on this list alone.
    """
    for dtype in dtypes:
        for shared_k in (False, True):
            for copy_beta in (False, True):
                yield compiled_wy_inverse, (dtype, shared_k, copy_beta)
        yield compiled_chunk_output, (dtype,)
        for pair_sum in PAIR_SUMS:
            yield compiled_chunk_bwd_local, (dtype, pair_sum)
        yield compiled_gqa_sum, (dtype,)
        yield compiled_chunk_scores, (dtype,)
        for block_v in BLOCK_V_CHOICES:
            yield compiled_fused_fwd, (dtype, block_v)
            yield compiled_fused_fwd, (dtype, block_v, True)
            if block_v == SCORES_BLOCK_V:
                yield compiled_fused_fwd, (dtype, block_v, False, True)
            yield compiled_chunk_states, (dtype, block_v)
            yield compiled_chunk_dstates, (dtype, block_v)
    for block_v in CHAIN_BLOCK_V_CHOICES:
        yield compiled_segment_chain, (block_v,)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count_on(device: torch.device) -> int:
    """SMs of `device` (the current CUDA device when it has no index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def block_v_for(num_seqs: int, num_v_heads: int, sm_count: int) -> int:
    """Widest V tile that still gives at least MIN_CTAS_PER_SM CTAs per SM (else the narrowest)."""
    for block_v in BLOCK_V_CHOICES:
        if num_seqs * num_v_heads * (HEAD_DIM // block_v) >= MIN_CTAS_PER_SM * sm_count:
            return block_v
    return BLOCK_V_CHOICES[-1]


def summary_block_v(num_walks: int, sm_count: int) -> int:
    """Narrowest V tile that keeps `num_walks` summary walks within SUMMARY_MAX_CTAS_PER_SM CTAs per SM (else
    the widest)."""
    for block_v in reversed(BLOCK_V_CHOICES):
        if num_walks * (HEAD_DIM // block_v) <= SUMMARY_MAX_CTAS_PER_SM * sm_count:
            return block_v
    return BLOCK_V_CHOICES[0]


WY_INVERSE_CTAS_PER_SM = 6  # wy_inverse.py's occupancy (registers and shared memory), both builds
WY_INVERSE_MIN_WAVES = 1.5  # waves of CTAs a split of a GQA group into more than two v-heads per CTA must leave
WY_PAIR_MIN_WAVES = 1.0  # and a split into pairs
WY_MAX_HEADS_PER_CTA = 8  # v-heads per CTA of wy_inverse's shared-K build: the rows of its gate buffers


def wy_heads_per_cta(chunk_slots: int, num_qk_heads: int, num_v_heads: int, sm_count: int) -> int:
    """v-heads per wy_inverse CTA: the most of one GQA group (a divisor of Hv / Hqk) that still leaves
    WY_INVERSE_MIN_WAVES waves of CTAs, else a pair where it leaves WY_PAIR_MIN_WAVES; the CTA loads K and forms K
    K^T once for them (1 = the one-v-head build). H200, 2026-12-04 (docs/kernels.md, "Thirty-third session"): a
    whole group per CTA against one v-head was 1.06-1.16x at 1.5 to 12 waves ((2, 8) x 4K x 8 59.7 -> 54.8 us,
    (16, 64) x 8K x 4 442 -> 389) and 0.68x at a sixth of a wave ((2, 8) x 1000 x 3). H100, 2026-12-07, the kernel
    at 6 CTAs per SM ("Fifty-ninth session"): pairs at 2.6 waves against fours at 1.3, 1.02x at (2, 8) x 32K and
    4K x 8; fours at 10 waves against pairs 1.07x at (16, 64) x 8K x 4; pairs at 1.3 waves against one v-head at
    2.6, 1.12x at (2, 8) x 16K."""
    group = num_v_heads // num_qk_heads
    for heads in range(min(group, WY_MAX_HEADS_PER_CTA), 1, -1):
        waves = chunk_slots * num_v_heads // heads / (WY_INVERSE_CTAS_PER_SM * sm_count)
        if group % heads == 0 and waves >= (WY_INVERSE_MIN_WAVES if heads > 2 else WY_PAIR_MIN_WAVES):
            return heads
    return 1


def walks_fill(device: torch.device, num_seqs: int, num_v_heads: int) -> bool:
    """Whether one walk over `num_seqs` x `num_v_heads` gives MIN_CTAS_PER_SM CTAs per SM even at the
    narrowest V tile; when it does not, two independent walks run side by side on two streams (the
    backward's, backward.py)."""
    return num_seqs * num_v_heads * (HEAD_DIM // BLOCK_V_CHOICES[-1]) >= MIN_CTAS_PER_SM * sm_count_on(device)


def walks_exceed_a_wave(device: torch.device, num_seqs: int, num_v_heads: int) -> bool:
    """Whether a walk over `num_seqs` x `num_v_heads` at dispatch's V tile has more CTAs than `device` has SMs
    (the walks at V tile 128 hold one CTA per SM): then a walk that ends early frees its SM for another."""
    block_v = block_v_on(device, num_seqs, num_v_heads)
    return num_seqs * num_v_heads * (HEAD_DIM // block_v) > sm_count_on(device)


def chunk_offsets_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum of the number of 64-token chunks per sequence, int32 [N + 1] (no host sync)."""
    chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK
    offsets = torch.zeros_like(cu_seqlens)
    torch.cumsum(chunks, 0, out=offsets[1:])
    return offsets


@dataclass
class KeptInverse:
    """What a forward keeps for its backward, so that the backward computes no second `wy_inverse`: its own
    operand GA, the cumulative gates and the fp32 beta the walks read, 132 bytes per token and v-head (bf16;
    136 when beta is not fp32 already) and nothing extra to write (FlashQLA 0.1.3 keeps its A likewise).
    With `keep_states` also the state entering every chunk, which its fused walk stored beside O (512 bytes
    more per token and v-head), so that the backward runs no state recompute."""

    GA: torch.Tensor  # [T, Hv, 64]  Gamma o A
    gcum: torch.Tensor  # [Hv, T] fp32 chunk-local cumulative gate (natural log)
    beta: torch.Tensor  # [T, Hv] fp32: beta itself when it is fp32, else the copy the forward's wy_inverse wrote
    states: torch.Tensor | None = None  # [chunk_slots, Hv, 128, 128] in the input dtype, as `fused_states` makes


@dataclass
class ChunkedCall:
    """One forward call's kernel operands after `wy_inverse` (flat token layout, no host sync)."""

    q: torch.Tensor  # [T, Hqk, 128]
    k: torch.Tensor
    v: torch.Tensor  # [T, Hv, 128]
    beta: torch.Tensor  # [T, Hv] fp32
    GA: torch.Tensor  # [T, Hv, 64]  Gamma o A = (I + StrictLower(diag(beta) K K^T))^{-1} with its gate mask
    gcum: torch.Tensor  # [Hv, T] fp32 chunk-local cumulative gate (natural log)
    cu: torch.Tensor  # int32 [N + 1]
    offsets: torch.Tensor  # int32 [N + 1] first chunk slot of every sequence
    chunk_slots: int  # upper bound on the number of chunks
    dtype: str

    @property
    def num_seqs(self) -> int:
        return self.cu.numel() - 1

    @property
    def num_v_heads(self) -> int:
        return self.gcum.shape[0]

    def kept(self, states: torch.Tensor | None = None) -> KeptInverse:
        """The inverse this call's backward can start from (`prepare_from_kept`), and the per-chunk states when
        the forward stored them (`fused_forward` with `states`)."""
        return KeptInverse(self.GA, self.gcum, self.beta, states)


def _layout(q, cu_seqlens, chunk_offsets):
    """(cu int32 [N + 1], chunk offsets, chunk slots) of q [B, T, Hqk, 128]'s tokens, no host sync."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    else:
        cu = cu_seqlens.to(torch.int32)
    offsets = chunk_offsets_of(cu) if chunk_offsets is None else chunk_offsets
    # every sequence adds at most one partial chunk: an upper bound on the chunk count without a sync
    return cu, offsets, (B * T + CHUNK - 1) // CHUNK + cu.numel() - 1


def _flat(q, k, v):
    """q, k [T, Hqk, 128] and v [T, Hv, 128] views of [B, T, ...] inputs."""
    B, T, Hqk, _ = q.shape
    return q.view(B * T, Hqk, HEAD_DIM), k.view(B * T, Hqk, HEAD_DIM), v.view(B * T, v.shape[2], HEAD_DIM)


def prepare(q, k, v, g, beta, cu_seqlens, chunk_offsets=None) -> ChunkedCall:
    """wy_inverse over every chunk of q, k [B, T, Hqk, 128], v [B, T, Hv, 128], g, beta [B, T, Hv]: GA and
    gcum, all that the walks read besides the inputs.

    chunk_offsets: `chunk_offsets_of(cu_seqlens)` when the caller keeps it (a fixed layout), else computed
    here."""
    B, T, _, _ = q.shape
    Hv = v.shape[2]
    device = q.device
    cu, offsets, chunk_slots = _layout(q, cu_seqlens, chunk_offsets)
    q3, k3, v3 = _flat(q, k, v)
    # the kernels read fp32 beta (kept for the backward): beta itself, or the copy wy_inverse writes of beta in
    # q's dtype, or (another dtype still) a conversion here
    beta_in = beta.reshape(B * T, Hv).contiguous()  # (a no-op for the public op's dense beta)
    copy_beta = beta.dtype == q.dtype
    if copy_beta:
        beta2 = torch.empty(B * T, Hv, dtype=torch.float32, device=device)
    else:
        beta_in = beta2 = beta_in.float()
    GA = torch.empty(B * T, Hv, CHUNK, dtype=q.dtype, device=device)
    gcum = torch.empty(Hv, B * T, dtype=torch.float32, device=device)
    heads_per_cta = wy_heads_per_cta(chunk_slots, k.shape[2], Hv, sm_count_on(device))
    inverse = compiled_wy_inverse(_TORCH_TO_TL[q.dtype], heads_per_cta > 1, copy_beta)
    inverse(k3, beta_in, beta2, g.view(B * T, Hv), cu, offsets, GA, gcum, chunk_slots,
            (cu.numel() - 1).bit_length(), heads_per_cta)
    return ChunkedCall(q3, k3, v3, beta2, GA, gcum, cu, offsets, chunk_slots, _TORCH_TO_TL[q.dtype])


def prepare_from_kept(q, k, v, kept: KeptInverse, cu_seqlens, chunk_offsets=None) -> ChunkedCall:
    """What `prepare` returns, from the forward's kept inverse and beta: no kernel runs."""
    cu, offsets, chunk_slots = _layout(q, cu_seqlens, chunk_offsets)
    return ChunkedCall(*_flat(q, k, v), kept.beta, kept.GA, kept.gcum, cu, offsets, chunk_slots,
                       _TORCH_TO_TL[q.dtype])


def block_v_on(device: torch.device, num_seqs: int, num_v_heads: int) -> int:
    """block_v_for with the SM count of `device` (the current CUDA device when it has no index)."""
    return block_v_for(num_seqs, num_v_heads, sm_count_on(device))


def _state_buffers(x: ChunkedCall, h0, store_final: bool):
    """(h0 argument, final-state tensor or None, its argument) of a walk over `x`: flattened to
    [N * Hv, 128, 128] fp32, with a [1, 128, 128] placeholder where a flag says unused."""
    N, Hv, device = x.num_seqs, x.num_v_heads, x.q.device
    placeholder = torch.empty(1, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    h0_arg = placeholder if h0 is None else h0.float().reshape(N * Hv, HEAD_DIM, HEAD_DIM).contiguous()
    ht = torch.empty(N, Hv, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device) if store_final else None
    return h0_arg, ht, placeholder if ht is None else ht.view(N * Hv, HEAD_DIM, HEAD_DIM)


def _launch_walk(x: ChunkedCall, h0, store_chunks: bool, store_final: bool, with_transition: bool = False,
                 active=None, gates=None):
    """chunk_states over every sequence of `x` from h0 (fp32 [N, Hv, 128, 128] or None = zeros): (h | None,
    V' | None, final states | None, transition products | None); the flags are the kernel's. gates: (flags,
    threshold, exact, active) of `summaries_from_gates`, whose exact and active the launch fills."""
    N, Hv, device = x.num_seqs, x.num_v_heads, x.q.device
    h0_arg, ht, ht_arg = _state_buffers(x, h0, store_final)
    mt = torch.empty(N, Hv, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device) if with_transition else None
    slots = x.chunk_slots if store_chunks else 1
    h = torch.empty(slots, Hv, HEAD_DIM, HEAD_DIM, dtype=x.v.dtype, device=device)
    vnew = torch.empty_like(x.v)  # allocator-cached; untouched when store_chunks is False
    if gates is not None:
        flags, threshold, exact, active_arg = gates
        use_active = FROM_GATES
    else:  # placeholders the kernel does not read (use_active 0 or 1; active's too where use_active is 0): no fill
        placeholder = lambda dtype: torch.empty(1, dtype=dtype, device=device)  # noqa: E731
        flags, exact, threshold = placeholder(torch.int32), placeholder(torch.float32), 0.0
        use_active = int(active is not None)
        active_arg = placeholder(torch.int32) if active is None else active.to(torch.int32).reshape(-1)
    num_walks = N * (1 + with_transition)
    if store_chunks:
        block_v = block_v_on(device, num_walks, Hv)
    else:
        block_v = summary_block_v(num_walks * Hv, sm_count_on(device))
    mt_arg = ht_arg if mt is None else mt.view(N * Hv, HEAD_DIM, HEAD_DIM)
    compiled_chunk_states(x.dtype, block_v)(
        x.k, x.v, x.GA, x.beta, x.gcum, x.cu, x.offsets, h0_arg, h, vnew, ht_arg, mt_arg, active_arg, flags,
        exact.view(-1), int(h0 is not None), int(store_final), int(store_chunks), int(with_transition), use_active,
        float(threshold))
    return (h if store_chunks else None, vnew if store_chunks else None, ht, mt)


def walk(x: ChunkedCall, h0=None, *, store_final=True):
    """The state walk over every sequence of `x` from h0 (fp32 [N, Hv, 128, 128] or None = zeros).

    Returns (h [chunk_slots, Hv, 128, 128], V' [T, Hv, 128], final fp32 [N, Hv, 128, 128] | None).
    """
    return _launch_walk(x, h0, store_chunks=True, store_final=store_final)[:3]


def summaries(x: ChunkedCall, with_transition: bool, active=None):
    """(S*, M or None) of every sequence of `x`, fp32 [N, Hv, 128, 128], from one state-only walk: S* from
    the zero state and, with_transition, the transition product M (the walk of V = 0 from S0 = I; S_end =
    M S_start + S*, design doc §3) in the same launch. active: int or bool [2, N, Hv] or None (all): which
    S* (0) and M (1) to compute (0: none, zeros come back) and from which chunk: a walk with active = a
    starts at chunk a - 1 of its sequence (1 or True: the whole sequence; more: a warmup restart)."""
    _, _, S_star, M = _launch_walk(x, None, store_chunks=False, store_final=True, with_transition=with_transition,
                                   active=active)
    return S_star, M


def summaries_from_gates(x: ChunkedCall, flags, threshold: float):
    """(S*, M, exact fp32 [N, Hv], active int32 [2, N, Hv]) of intra-card CP's segments `x` in one launch whose
    walks compute their own gate statistics (chunk_states.py `gate_statistics`: which rows start from the exact
    chain and which walks run from which chunk, from the rows' `flags` and the warmup threshold, -inf: exact
    everywhere) and run the S* and M walks those ask for, from where they say."""
    N, Hv, device = x.num_seqs, x.num_v_heads, x.q.device
    exact = torch.empty(N, Hv, dtype=torch.float32, device=device)
    active = torch.empty(2, N, Hv, dtype=torch.int32, device=device)
    _, _, S_star, M = _launch_walk(x, None, store_chunks=False, store_final=True, with_transition=True,
                                   gates=(flags, threshold, exact, active.view(-1)))
    return S_star, M, exact, active


def chain_block_v(num_chains: int, sm_count: int) -> int:
    """The segment chain's V tile for `num_chains` (sequence, v-head) chains (see CHAIN_BLOCK_V_CHOICES): the
    narrowest whose CTAs fit in one wave, else 8 while its CTAs make at most CHAIN_MAX_WAVES_AT_8 waves, else
    the widest."""
    waves = lambda block_v: num_chains * (HEAD_DIM // block_v) / sm_count  # noqa: E731
    if waves(CHAIN_BLOCK_V_CHOICES[0]) <= 1:
        return CHAIN_BLOCK_V_CHOICES[0]
    return 8 if waves(8) <= CHAIN_MAX_WAVES_AT_8 else CHAIN_BLOCK_V_CHOICES[-1]


def fold_segments(out, bias, mats, exact, first_rows, last_rows, reverse: bool, zero_start: bool = False,
                  block_v: int | None = None, num_chains: int | None = None):
    """The chain over segments in one `segment_chain` launch, in place on `out` (fp32 [rows, Hv, 128, 128]):
    forward out[r] = bias[r-1] + exact[r] mats[r-1] out[r-1]; reverse out[r] = bias[r+1] + f_r mats[r+1]^T
    out[r+1], f_r = 1 out of a sequence's last row (r + 1 = last), else exact[r + 2]. bias, mats fp32 like out;
    exact fp32 [rows, Hv] (which rows start from the exact chain: `summaries_from_gates`); first_rows, last_rows int32
    [sequences], in any order (the CTAs are issued in it, a sequence's v-heads together: longest first lets
    the chains that take steps start before the one-row sequences'). The chain starts from the first rows
    (forward) or last rows (reverse) of `out` as given, or with zero_start from zero, which it writes there.
    block_v: the V tile (one of CHAIN_BLOCK_V_CHOICES; None: `chain_block_v`'s choice for num_chains x Hv
    chains). num_chains: the sequences of more than one row, the only ones whose chains take steps (None: every
    sequence given)."""
    rows, Hv = exact.shape
    flat = lambda t: t.view(rows * Hv, HEAD_DIM, HEAD_DIM)  # noqa: E731
    if block_v is None:
        chains = first_rows.numel() if num_chains is None else max(num_chains, 1)
        block_v = chain_block_v(chains * Hv, sm_count_on(out.device))
    compiled_segment_chain(block_v)(flat(out), flat(bias), flat(mats), exact.reshape(-1), first_rows, last_rows, Hv,
                                    int(reverse), int(zero_start))
    return out


def output(x: ChunkedCall, h, vnew, scale: float) -> torch.Tensor:
    """chunk_output: O [T, Hv, 128] for every chunk at once."""
    o = torch.empty_like(vnew)
    compiled_chunk_output(x.dtype)(x.q, x.k, vnew, x.gcum, h, x.cu, x.offsets, o, float(scale),
                                   x.num_seqs.bit_length())
    return o


def chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, fused=True,
                  keep_inverse=False, chunk_offsets=None, keep_states=False):
    """Forward of GDN chunked prefill on SM90. Inputs validated and contiguous by the caller.

    q, k [B, T, Hqk, 128]; v [B, T, Hv, 128]; g fp32 [B, T, Hv] (natural log); beta [B, T, Hv];
    initial_state fp32 [N, Hv, 128, 128] or None; cu_seqlens [N + 1] (B == 1) or None; chunk_offsets:
    `chunk_offsets_of(cu_seqlens)` when the caller keeps it for the layout (else computed on the device).
    Returns o [B, T, Hv, 128] in q's dtype and the fp32 final state [N, Hv, 128, 128] or None, and with
    keep_inverse a third item, the `KeptInverse` for `chunk_gdn_bwd` (references to the forward's own GA, gates
    and fp32 beta: nothing more is computed or stored); with keep_states as well (fused only) it carries the
    state entering every chunk, stored by the fused walk beside O.

    Fused (the default): wy_inverse, then fused_fwd (one walk computing the outputs too). fused=False runs
    the split decomposition instead, wy_inverse, chunk_states (the serial walk storing every chunk's state
    and V'), chunk_output (every chunk at once): the reference decomposition the tests and the benchmark
    compare.
    Since fused_fwd is warp-specialised (H200, 2026-12-01) it is the faster one at every number of walks:
    split / fused at 16K tokens per sequence 1.03x with 1 walk (sequences x v-heads), 1.11x at 2, 1.16x at
    4, 1.27x at 8, 1.45x at 16; more walks favoured it already (docs/benchmarks.md, sixteenth session).
    """
    if not isinstance(fused, bool):  # None once meant "by shape"; it must not quietly mean the split path
        raise TypeError(f"fused must be True or False, got {fused!r}")
    if keep_states and not (fused and keep_inverse):
        raise ValueError("keep_states needs the fused walk and keep_inverse (the states ride on the KeptInverse)")
    x = prepare(q, k, v, g, beta, cu_seqlens, chunk_offsets)
    states = states_buffer(x) if keep_states else None
    if fused:
        o, ht = fused_forward(x, v, initial_state, scale, output_final_state, states)
    else:
        h, vnew, ht = walk(x, initial_state, store_final=output_final_state)
        o = output(x, h, vnew, scale)
    return (o.view(v.shape), ht, x.kept(states)) if keep_inverse else (o.view(v.shape), ht)


@functools.lru_cache(maxsize=16)
def _no_states(num_v_heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fused_fwd's per-chunk state output when it stores none (the forward): one chunk slot, never written,
    made once per head count, dtype and device instead of per call."""
    return torch.empty(1, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=dtype, device=device)


def fused_forward(x: ChunkedCall, v, h0, scale: float, store_final: bool, states: torch.Tensor | None = None):
    """fused_fwd over every sequence of `x` from h0 (fp32 [N, Hv, 128, 128] or None): (O [T, Hv, 128],
    final fp32 states or None). states: `states_buffer(x)`, into which the walk also stores the state entering
    every chunk (what `fused_states` recomputes), or None."""
    h0_arg, ht, ht_arg = _state_buffers(x, h0, store_final)
    v3 = v.reshape(-1, x.num_v_heads, HEAD_DIM)
    o = torch.empty_like(v3)
    block_v = block_v_on(x.q.device, x.num_seqs, x.num_v_heads)
    keep = states is not None  # the keep_states build: O and the states whatever store_states says (2 names that)
    h_out = states if keep else _no_states(x.num_v_heads, v3.dtype, v3.device)
    args = (x.q, x.k, v3, x.GA, x.beta, x.gcum, x.cu, x.offsets, h0_arg, o, ht_arg, h_out)
    flags = (float(scale), int(h0 is not None), int(store_final), 2 if keep else 0)
    if not keep and reads_chunk_scores(x.num_seqs, x.q.shape[1], x.num_v_heads, block_v):
        P = chunk_scores(x, scale)
        compiled_fused_fwd(x.dtype, block_v, False, True)(*args, P, *flags)
    else:
        kernel = compiled_fused_fwd(x.dtype, block_v, True) if keep else compiled_fused_fwd(x.dtype, block_v)
        kernel(*args, *flags)
    return o, ht


def chunk_scores(x: ChunkedCall, scale: float) -> torch.Tensor:
    """Every chunk's P = scale (Lower(Gamma) o Q K^T), [T, Hv, 64] in the input dtype (chunk_scores.py), for
    the fused walk's `scores` build."""
    P = torch.empty(x.q.shape[0], x.num_v_heads, CHUNK, dtype=x.v.dtype, device=x.v.device)
    compiled_chunk_scores(x.dtype)(x.q, x.k, x.gcum, x.cu, x.offsets, P, float(scale), x.chunk_slots,
                                   x.num_seqs.bit_length())
    return P


def states_buffer(x: ChunkedCall) -> torch.Tensor:
    """Room for `fused_states`' output: h [chunk_slots, Hv, 128, 128] in the input dtype."""
    return torch.empty(x.chunk_slots, x.num_v_heads, HEAD_DIM, HEAD_DIM, dtype=x.v.dtype, device=x.v.device)


def fused_states(x: ChunkedCall, h0, out: torch.Tensor | None = None):
    """The state entering every chunk of `x` from h0 (fp32 [N, Hv, 128, 128] or None), h [chunk_slots, Hv,
    128, 128] in the input dtype: fused_fwd's state walk from GA, beta and the gates (no O, no V').
    The backward's recompute. out: `states_buffer(x)` to write h into (allocated on another stream than the
    one this runs on, for instance), else allocated here."""
    h0_arg, _, placeholder = _state_buffers(x, h0, False)
    h = states_buffer(x) if out is None else out
    compiled_fused_fwd(x.dtype, block_v_on(x.q.device, x.num_seqs, x.num_v_heads))(
        x.q, x.k, x.v, x.GA, x.beta, x.gcum, x.cu, x.offsets, h0_arg, x.v, placeholder, h, 1.0,
        int(h0 is not None), 0, 1)
    return h
