"""benchmarks/floors.py's peaks measured on the GPU: a Hopper part's copy bandwidth and bf16 matmul throughput
fall where its datasheet puts them (H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16; H200: 4.8 TB/s, the
same tensor cores), so every floor the benchmarks print rests on a sane measurement."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import floors  # noqa: E402
from bench_gdn import eager_median_ms  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an SM90 (Hopper) GPU")


def test_measured_peaks_are_a_hopper_parts():
    peaks = floors.measure_peaks(eager_median_ms, reps=5)
    assert 2.0e12 < peaks.copy_bytes_per_s < 5.0e12, peaks  # a copy reaches 60-95% of the HBM's peak
    assert 4.0e14 < peaks.bf16_flop_per_s < 1.0e15, peaks
    assert torch.cuda.get_device_name() in peaks.source
    # the floors scale inversely with the peaks they are given
    at_h200 = floors.backward_floors_us(16, 32, 32768)
    here = floors.backward_floors_us(16, 32, 32768, peaks)
    assert here[0] == pytest.approx(at_h200[0] * floors.H200_PEAKS.copy_bytes_per_s / peaks.copy_bytes_per_s)
