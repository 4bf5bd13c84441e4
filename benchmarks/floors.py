"""Memory and tensor-core floors of GDN chunked prefill, forward and backward, on the GPU that runs the benchmark.

A floor is a lower bound on any implementation's time: its bytes are the inputs read once and the outputs
written once; its products are the chunked form's (design doc §2) at the device's bf16 matmul throughput.
The peaks are measured on the device itself (`measure_peaks`: a device-to-device copy and a large bf16 matmul,
medians of CUDA-event timings), so an H100 run is held to the H100's floors; `H200_PEAKS` are the design
doc's §6 figures (4.3 TB/s, 790 TFLOP/s), which the measurement reproduces on the H200.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

D, C = 128, 64  # head dim (K = V), chunk size


class Peaks(NamedTuple):
    copy_bytes_per_s: float  # bytes read + written per second by a device-to-device copy
    bf16_flop_per_s: float  # dense bf16 matmul on random data
    source: str

    def describe(self) -> str:
        return (f"copy {self.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {self.bf16_flop_per_s / 1e12:.0f} TFLOP/s "
                f"({self.source})")


H200_PEAKS = Peaks(4.3e12, 790e12, "H200, design doc §6")


@functools.lru_cache(maxsize=None)
def measure_peaks(median_ms: Callable, reps: int = 20) -> Peaks:
    """The current CUDA device's copy bandwidth (1 GiB copied, read + write counted) and bf16 matmul throughput
    (8192^3 on random data, so the tensor cores see real operand toggling), each timed by the benchmarks' own
    `median_ms(fn, reps)` (bench_gdn.eager_median_ms) after one warm-up run."""
    import torch

    def median_s(fn):
        fn()
        return median_ms(fn, reps) / 1e3

    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * src.element_size() / median_s(lambda: dst.copy_(src))
    del src, dst
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    flops = 2 * n ** 3 / median_s(lambda: a @ b)
    return Peaks(copy, flops, f"{torch.cuda.get_device_name()}, measured")


def _forward_products(Hv: int, T: int) -> float:
    """Per chunk and v-head: Q K^T, K K^T (64 x 64 x 128), K S, Q S (64 x 128 x 128), A Vd, P V' (64 x 64 x
    128), K^T V' (128 x 64 x 128): multiply-adds x 2."""
    return (T / C) * Hv * 2 * C * D * (C + C + D + D + C + C + D)


def forward_floors_us(Hqk: int, Hv: int, T: int, peaks: Peaks = H200_PEAKS) -> tuple[float, float]:
    """(memory, tensor-core) floors of the forward over T tokens, in us: q, k, v, beta (16-bit), g (fp32) read
    and o written once; the chunked form's products."""
    bytes_moved = T * (2 * Hqk * D * 2 + Hv * D * 2 * 2 + Hv * (4 + 2))
    return bytes_moved / peaks.copy_bytes_per_s * 1e6, _forward_products(Hv, T) / peaks.bf16_flop_per_s * 1e6


def backward_floors_us(Hqk: int, Hv: int, T: int, peaks: Peaks = H200_PEAKS) -> tuple[float, float]:
    """(memory, tensor-core) floors of the backward alone, in us. Bytes: q, k, v, dO, beta (16-bit) and g (fp32)
    read once, dq, dk, dv, dbeta (16-bit) and dg (fp32) written once. Products: each of the forward's gives two of
    its size (the gradients of both operands), but K K^T one (symmetric: dK = (dX + dX^T) K); the states the
    backward needs are not counted (an implementation could keep them), so this is a floor, not an estimate."""
    read = 2 * Hqk * D * 2 + 2 * Hv * D * 2 + Hv * (4 + 2)
    written = 2 * Hqk * D * 2 + Hv * D * 2 + Hv * (4 + 2)
    kk = (T / C) * Hv * 2 * C * C * D
    products = 2 * _forward_products(Hv, T) - kk
    return T * (read + written) / peaks.copy_bytes_per_s * 1e6, products / peaks.bf16_flop_per_s * 1e6
