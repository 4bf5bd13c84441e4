"""scripts/split_forward_probe.py on the CPU, with the kernel emulators standing in for compiled kernels: it finds
every launch of the split forward under the builds it lists, and times each piece (timing itself needs a GPU)."""
import os
import sys

import pytest
import torch

import kernel_emulator
from gdn_inputs import make_inputs, random_cu_seqlens

pytest.importorskip("tilelang")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import split_forward_probe as probe  # noqa: E402


def cpu_inputs(Hqk, Hv, lengths):
    args = make_inputs(1, sum(lengths), Hqk, Hv, 128, 128, dtype=torch.bfloat16, num_seqs=len(lengths),
                       strong_heads=(Hv - 1,), seed=3, requires_grad=False)
    return args["q"], args["k"], args["v"], args["g"], args["beta"], random_cu_seqlens(lengths)


@pytest.mark.parametrize("hqk,hv,tokens", [(2, 4, 200), (1, 2, 64)])
def test_the_probe_finds_and_times_every_launch_of_the_split_forward(monkeypatch, hqk, hv, tokens):
    kernel_emulator.install(monkeypatch)
    timed = []

    def time_once(fn):
        fn()
        timed.append(fn)
        return 1.0

    monkeypatch.setattr(probe, "graph_time_us", time_once)
    monkeypatch.setattr(probe, "make_inputs", lambda hqk, hv, lengths: cpu_inputs(hqk, hv, lengths))
    monkeypatch.setattr(probe, "side_by_side", lambda device, side, main: (side(), main()))  # no streams here
    line = probe.probe(hqk, hv, tokens)
    for piece in ("fused", "split", "wy_inverse", "chunk_states", "chunk_output", "walk then output", "side by side"):
        assert piece in line
    assert len(timed) == 7
