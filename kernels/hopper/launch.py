"""Host side of the SM90 forward: compile cache, V-tile choice, chunk bookkeeping, the two launches."""
from __future__ import annotations

import functools

import torch

from ..cache import compile_kernel

HEAD_DIM = 128
CHUNK = 64
TARGET = {"kind": "cuda", "arch": "sm_90a"}
BLOCK_V_CHOICES = (128, 64, 32)
# A CTA per (sequence, v-head, V tile) walks its sequence serially, so a call with few sequences x
# heads leaves SMs idle; narrower V tiles give more CTAs at the cost of re-reading Q, K and Ab.
MIN_CTAS_PER_SM = 0.7

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
KERNEL_DTYPES = tuple(_TORCH_TO_TL.values())


def _pass_configs():
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


@functools.lru_cache(maxsize=None)
def compiled_wy_inverse(dtype: str):
    """The compiled wy_inverse kernel for `dtype`: prebuilt, from TileLang's disk cache, or JIT (kernels/cache.py)."""
    from .wy_inverse import build_wy_inverse

    return compile_kernel(build_wy_inverse(dtype), f"wy_inverse({dtype})", target=TARGET,
                          pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def compiled_fused_fwd(dtype: str, block_v: int):
    """The compiled fused forward kernel for `dtype` and V tile width `block_v`."""
    from .fused_fwd import build_fused_fwd

    return compile_kernel(build_fused_fwd(dtype, block_v), f"fused_fwd({dtype}, block_v={block_v})", target=TARGET,
                          pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def compiled_chunk_states(dtype: str, block_v: int):
    """The compiled state walk (chunk_states.py) for `dtype` and V tile width `block_v`."""
    from .chunk_states import build_chunk_states

    return compile_kernel(build_chunk_states(dtype, block_v), f"chunk_states({dtype}, block_v={block_v})",
                          target=TARGET, pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def compiled_chunk_output(dtype: str):
    """The compiled chunk-parallel output kernel (chunk_output.py) for `dtype`."""
    from .chunk_output import build_chunk_output

    return compile_kernel(build_chunk_output(dtype), f"chunk_output({dtype})", target=TARGET,
                          pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def compiled_chunk_dstates(dtype: str, block_v: int):
    """The compiled reverse state-gradient walk (chunk_dstates.py) for `dtype` and `block_v`."""
    from .chunk_dstates import build_chunk_dstates

    return compile_kernel(build_chunk_dstates(dtype, block_v), f"chunk_dstates({dtype}, block_v={block_v})",
                          target=TARGET, pass_configs=_pass_configs())


def kernel_configs(dtypes=KERNEL_DTYPES):
    """Every (kernel, args) pair dispatch can choose for TileLang dtypes `dtypes`: what a build machine compiles.

    Sizes (tokens, heads, sequences) and the scale are runtime arguments, so no kernel depends on the head
    configuration; `flashqla precompile` relies on this list alone.
    """
    for dtype in dtypes:
        yield compiled_wy_inverse, (dtype,)
        yield compiled_chunk_output, (dtype,)
        for block_v in BLOCK_V_CHOICES:
            yield compiled_fused_fwd, (dtype, block_v)
            yield compiled_chunk_states, (dtype, block_v)
            yield compiled_chunk_dstates, (dtype, block_v)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def block_v_for(num_seqs: int, num_v_heads: int, sm_count: int) -> int:
    """Widest V tile that still gives at least MIN_CTAS_PER_SM CTAs per SM (else the narrowest)."""
    for block_v in BLOCK_V_CHOICES:
        if num_seqs * num_v_heads * (HEAD_DIM // block_v) >= MIN_CTAS_PER_SM * sm_count:
            return block_v
    return BLOCK_V_CHOICES[-1]


def chunk_offsets_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum of the number of 64-token chunks per sequence, int32 [N + 1] (no host sync)."""
    chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK
    offsets = torch.zeros_like(cu_seqlens)
    torch.cumsum(chunks, 0, out=offsets[1:])
    return offsets


def chunk_gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, fused=False):
    """Forward of GDN chunked prefill on SM90. Inputs validated and contiguous by the caller.

    q, k [B, T, Hqk, 128]; v [B, T, Hv, 128]; g fp32 [B, T, Hv] (natural log); beta [B, T, Hv];
    initial_state fp32 [N, Hv, 128, 128] or None; cu_seqlens [N + 1] (B == 1) or None.
    Returns o [B, T, Hv, 128] in q's dtype and the fp32 final state [N, Hv, 128, 128] or None.

    Three launches: wy_inverse (W, U, gcum per chunk), chunk_states (the serial walk), chunk_output
    (every chunk at once); `fused=True` runs the single-walk fused_fwd kernel instead.
    """
    B, T, Hqk, _ = q.shape
    Hv = v.shape[2]
    device = q.device
    dtype = _TORCH_TO_TL[q.dtype]
    if cu_seqlens is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
    else:
        cu = cu_seqlens.to(torch.int32)
    N = cu.numel() - 1
    offsets = chunk_offsets_of(cu)
    # every sequence adds at most one partial chunk: an upper bound on the chunk count without a sync
    chunk_slots = (B * T + CHUNK - 1) // CHUNK + N
    search_steps = N.bit_length()

    q3, k3 = q.view(B * T, Hqk, HEAD_DIM), k.view(B * T, Hqk, HEAD_DIM)
    v3 = v.view(B * T, Hv, HEAD_DIM)
    g2 = g.view(B * T, Hv)
    beta2 = beta.view(B * T, Hv).float()

    Ab = torch.empty(B * T, Hv, CHUNK, dtype=q.dtype, device=device)
    gcum = torch.empty(Hv, B * T, dtype=torch.float32, device=device)
    w = torch.empty(B * T, Hv, HEAD_DIM, dtype=q.dtype, device=device)
    u = torch.empty_like(w)
    compiled_wy_inverse(dtype)(k3, beta2, g2, cu, offsets, v3, Ab, gcum, w, u, chunk_slots, search_steps)

    o = torch.empty(B * T, Hv, HEAD_DIM, dtype=q.dtype, device=device)
    placeholder = torch.empty(1, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device)
    h0 = placeholder if initial_state is None else initial_state.view(N * Hv, HEAD_DIM, HEAD_DIM)
    ht = torch.empty(N, Hv, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=device) if output_final_state else None
    ht_arg = placeholder if ht is None else ht.view(N * Hv, HEAD_DIM, HEAD_DIM)
    block_v = block_v_for(N, Hv, _sm_count(device.index if device.index is not None else torch.cuda.current_device()))
    flags = (int(initial_state is not None), int(ht is not None))
    if fused:
        compiled_fused_fwd(dtype, block_v)(q3, k3, v3, Ab, gcum, cu, h0, o, ht_arg, float(scale), *flags)
        return o.view(B, T, Hv, HEAD_DIM), ht
    h = torch.empty(chunk_slots, Hv, HEAD_DIM, HEAD_DIM, dtype=q.dtype, device=device)
    vnew = torch.empty_like(w)
    compiled_chunk_states(dtype, block_v)(k3, w, u, gcum, cu, offsets, h0, h, vnew, ht_arg, *flags)
    compiled_chunk_output(dtype)(q3, k3, vnew, gcum, h, cu, offsets, o, float(scale), search_steps)
    return o.view(B, T, Hv, HEAD_DIM), ht
