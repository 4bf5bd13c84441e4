"""The GDN layer's memory-bound ops on one GPU: fused TileLang kernels vs the torch references.

    python benchmarks/bench_layer_ops.py [--tokens 32768] [--channels 8192] [--v-heads 32] [--seqs 8] [--dtype bf16]

Short conv + SiLU over a pack of `--seqs` equal sequences with prefixes (x [T, C], W = 4), and gated RMSNorm
over T x Hv rows of 128. Each op runs through its autograd entry point; fwd is timed alone, bwd is the
autograd.grad call on a retained graph. CUDA events, median of 50 after 5 warm-ups. GB/s counts the bytes
the op must move at least (conv fwd: read x, write y; bwd: read x and dy, write dx; norm fwd: read o, z,
write y; bwd: read o, z, dy, write do, dz), and "floor" is that traffic at the H200's 4.8 TB/s. The
"kernel" rows time the launches of kernels/hopper/layer_ops.py alone (no autograd, weight/prefix
padding or conv-state gather).
"""
from __future__ import annotations

import argparse

import torch

from bench_gdn import eager_median_ms
from flashqla.kernels.hopper import layer_ops
from flashqla.layers import fused
from flashqla.layers.conv import causal_conv1d_reference
from flashqla.layers.norm import gated_rms_norm_reference

PEAK_BYTES_PER_S = 4.8e12
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def median_ms(fn, reps=50, warmup=5):
    for _ in range(warmup):
        fn()
    return eager_median_ms(fn, reps)


def fwd_bwd_ms(forward, leaves, cotangent):
    """(fwd ms, bwd ms) of forward() -> tensor through autograd."""
    fwd = median_ms(lambda: forward())
    out = forward()
    bwd = median_ms(lambda: torch.autograd.grad(out, leaves, cotangent, retain_graph=True))
    return fwd, bwd


def report(name, impl, ms, nbytes):
    floor = nbytes / PEAK_BYTES_PER_S * 1e3
    print(f"{name:<10} {impl:<6} {ms:8.3f} ms {nbytes / ms / 1e6:8.0f} GB/s   "
          f"floor {floor:6.3f} ms   ({floor / ms:4.0%} of it)")


def bench_conv(T, C, seqs, dtype):
    x = torch.randn(T, C, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(C, 4, device="cuda", requires_grad=True)
    prefix = torch.randn(seqs, 3, C, device="cuda", dtype=dtype, requires_grad=True)
    cu = torch.linspace(0, T, seqs + 1, device="cuda").round().to(torch.int32)
    dy = torch.randn_like(x)
    assert fused.conv_unsupported_reason(x, w, prefix) is None
    elem = x.element_size()
    for impl, fn in (("fused", fused.causal_conv1d), ("torch", causal_conv1d_reference)):
        fwd, bwd = fwd_bwd_ms(lambda: fn(x, w, cu, prefix)[0], (x, w, prefix), dy)
        report("conv fwd", impl, fwd, 2 * T * C * elem)
        report("conv bwd", impl, bwd, 3 * T * C * elem)
    # the launches alone (no autograd, padding or conv state; the bwd includes its dw partial sum)
    xd, w4, p3 = x.detach(), w.detach(), prefix.detach()
    report("conv fwd", "kernel", median_ms(lambda: layer_ops.short_conv_fwd(xd, w4, p3, cu)), 2 * T * C * elem)
    report("conv bwd", "kernel", median_ms(lambda: layer_ops.short_conv_bwd(xd, w4, p3, cu, dy)), 3 * T * C * elem)


def bench_norm(T, Hv, dtype, D=128):
    o = torch.randn(T, Hv, D, device="cuda", dtype=dtype, requires_grad=True)
    z = torch.randn_like(o, requires_grad=True)
    w = torch.ones(D, device="cuda", requires_grad=True)
    dy = torch.randn_like(o)
    assert fused.norm_unsupported_reason(o, z, w) is None
    nbytes = o.numel() * o.element_size()
    for impl, fn in (("fused", fused.gated_rms_norm), ("torch", gated_rms_norm_reference)):
        fwd, bwd = fwd_bwd_ms(lambda: fn(o, z, w, 1e-6), (o, z, w), dy)
        report("norm fwd", impl, fwd, 3 * nbytes)
        report("norm bwd", impl, bwd, 5 * nbytes)
    o2, z2, dy2 = o.detach().view(-1, D), z.detach().view(-1, D), dy.view(-1, D)
    w32 = w.detach()
    report("norm fwd", "kernel", median_ms(lambda: layer_ops.gated_norm_fwd(o2, z2, w32, 1e-6, False)), 3 * nbytes)
    report("norm bwd", "kernel", median_ms(lambda: layer_ops.gated_norm_bwd(o2, z2, w32, dy2, 1e-6, False)), 5 * nbytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}: conv T={args.tokens} C={args.channels} W=4 "
          f"({args.seqs} sequences, prefixes); norm {args.tokens}x{args.v_heads} rows x 128")
    bench_conv(args.tokens, args.channels, args.seqs, dtype)
    bench_norm(args.tokens, args.v_heads, dtype)


if __name__ == "__main__":
    main()
