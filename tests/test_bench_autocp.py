"""benchmarks/bench_autocp.py --sweep (no GPU, nothing timed): it writes the lines the planner's test reads back
(tests/test_intra_cp.py), for every config, every L of its sweep shorter than the longest sequence (off among them,
but in the long-sequence sweep), and the planned L."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_autocp  # noqa: E402
from test_intra_cp import read_sweep  # noqa: E402


@pytest.mark.parametrize("which,count", [("matrix", 42), ("packs", 24), ("long", 7)])
def test_sweep_writes_what_the_planner_test_reads(tmp_path, monkeypatch, which, count):
    timed = []

    def fake_inputs(Hqk, Hv, seqs):  # shapes do not matter: nothing runs
        return tuple(torch.zeros(1) for _ in range(5)) + (None,)

    def fake_time(fn, reps):  # a distinct time per call, so every cell is checked
        timed.append(fn)
        return len(timed) / 1000

    monkeypatch.setattr(bench_autocp, "make_inputs", fake_inputs)
    monkeypatch.setattr(bench_autocp, "graph_median_ms", fake_time)
    out = tmp_path / "sweep.txt"
    configs, sweep_lengths = bench_autocp.sweep_of(which)
    bench_autocp.sweep(30, str(out), configs, sweep_lengths)

    from flashqla.cp.plan import calibrated_segment_chunks

    rows = read_sweep(out)
    assert len(rows) == len(configs) == count
    for (label, heads, lengths, times), (name, _, Hv, seqs) in zip(rows, configs):
        assert label == name and heads == Hv and lengths == tuple(seqs)
        longest = max(seqs) // 64
        assert set(times) == {L for L in sweep_lengths if L < longest} | {calibrated_segment_chunks(lengths, heads)}
    assert len(timed) == 2 * sum(len(t) for *_, t in rows)  # forward and fwd+bwd of each


def test_document_pack_fills_the_row_with_documents_in_the_order_drawn():
    from doc_packs import PACK_DRAWS, document_pack

    lengths = document_pack(32768, 6.0, 1)
    assert sum(lengths) == 32768 and min(lengths) >= 1 and len(lengths) > 10
    assert lengths != sorted(lengths) and lengths != sorted(lengths, reverse=True)
    assert document_pack(32768, 6.0, 1) == lengths  # seeded: the sweep's rows are reproducible
    assert len({tuple(seqs) for *_, seqs in bench_autocp.pack_configs()}) == len(PACK_DRAWS)
