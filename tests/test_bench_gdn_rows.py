"""benchmarks/bench_gdn.py without a GPU: rows from earlier runs (a device call cut short keeps the rows it
measured, --rows-json, and the report of the remaining configs is made with them, --merge), the loading of the
implementations, the floors, the chart and the interleaved timing rounds."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gdn  # noqa: E402
import floors  # noqa: E402


def row(index, fused, flash_qla):
    name, Hqk, Hv, seqs = bench_gdn.CONFIGS[index]
    return dict(index=index, name=name, Hqk=Hqk, Hv=Hv, seqs=f"{seqs[0]}x{len(seqs)}", mem_us=1.0, mma_us=1.0, L=0,
                flashqla=2.0, flashqla_fused=fused, flashqla_cp=fused, fla=4.0, flash_qla=flash_qla, flash_qla_cp=None,
                sweep={})


def test_rows_of_two_runs_come_back_in_config_order_and_the_later_run_wins(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps([row(0, 1.0, 1.0), row(7, 1.0, 1.0)]))
    second.write_text(json.dumps([row(9, 1.0, 2.0), row(7, 0.5, 1.0)]))
    rows = bench_gdn.merged_rows([first, second])
    assert [r["index"] for r in rows] == [0, 7, 9]
    assert rows[1]["flashqla_fused"] == 0.5
    report = bench_gdn.write_report(tmp_path / "fwd.md", rows, {"torch": "x"}, [], floors.H200_PEAKS)
    assert "at 4.30 TB/s; chunked-form tensor-core FLOPs at 790 TFLOP/s (H200, design doc §6)" in report
    # FlashQLA over the three rows: 1.0 / 1.0, 1.0 / 0.5, 2.0 / 1.0
    assert f"over FlashQLA: {(1.0 * 2.0 * 2.0) ** (1 / 3):.2f}x over 3 configs" in report
    names = [line.split(" | ")[0] for line in report.splitlines() if line.startswith(("| 397B", "| Sym"))]
    assert names == ["| " + bench_gdn.CONFIGS[i][0] for i in (0, 7, 9)]


def test_skipped_and_missing_implementations_are_noted_and_not_loaded():
    def missing():
        raise ImportError("no module named peer")

    made = []
    impls = {"ours": lambda: made.append("ours") or "run", "fla": lambda: made.append("fla") or "run",
             "peer": missing}
    loaded, notes = bench_gdn.load_impls(impls, "fla")
    assert loaded == {"ours": "run"} and made == ["ours"]
    assert notes == ["- fla left out (--skip)", "- peer unavailable: ImportError: no module named peer"]


def test_floors_hold_the_design_docs_tp8_figures_and_the_backward_counts():
    """TP8 1 x 32768 (Hqk 2, Hv 8) at the H200's peaks: inputs + output ~169 MB, ~39 us (design doc §6: ~160 MB,
    ~37 us); the forward's products 42.9 GFLOP. The backward reads and writes more (dO in, five gradients out)
    and has twice the forward's products less one K K^T; both floors scale with the copy / matmul peaks."""
    mem, mma = floors.forward_floors_us(2, 8, 32768)
    assert 38 < mem < 40 and abs(mma * 790e6 - 2 * 64 * 128 * 640 * 512 * 8) < 1
    bwd_mem, bwd_mma = floors.backward_floors_us(2, 8, 32768)
    per_token = (2 * 2 * 128 * 2 + 2 * 8 * 128 * 2 + 8 * 6) + (2 * 2 * 128 * 2 + 8 * 128 * 2 + 8 * 6)
    assert abs(bwd_mem - 32768 * per_token / 4.3e12 * 1e6) < 1e-9
    assert abs(bwd_mma - (2 * mma - 512 * 8 * 2 * 64 * 64 * 128 / 790e6)) < 1e-9
    half = floors.Peaks(2.15e12, 395e12, "half an H200")
    assert [2 * x for x in floors.backward_floors_us(2, 8, 32768)] == pytest.approx(
        floors.backward_floors_us(2, 8, 32768, half))


def test_forward_chart_leaves_out_series_nobody_timed(tmp_path, monkeypatch):
    """The chart's bars: flashqla CP off and AutoCP beside the peers; a peer left out (--skip fla) gets no legend
    entry, and the title names the device it ran on."""
    drawn = {}
    monkeypatch.setattr(bench_gdn, "grouped_bars", lambda path, labels, series, ylabel, title: drawn.update(
        labels=labels, series=[label for label, _ in series], title=title))
    rows = [dict(name="397B TP8", seqs="32768x1", flashqla_fused=0.95, flashqla_cp=0.28, fla=None, flash_qla=1.0,
                 flash_qla_cp=0.4)]
    bench_gdn.plot(tmp_path / "fwd.png", rows, "NVIDIA H100 80GB HBM3")
    assert drawn["series"] == ["flashqla, CP off", "flashqla, AutoCP", "FlashQLA 0.1.3, CP off", "FlashQLA 0.1.3, AutoCP"]
    assert "H100" in drawn["title"] and drawn["labels"] == ["397B TP8\n32768x1"]


def test_sequences_label_names_equal_runs():
    assert bench_gdn.sequences_label([32768]) == "32768x1"
    assert bench_gdn.sequences_label([4096] * 8) == "4096x8"
    assert bench_gdn.sequences_label([24576, 8192]) == "24576+8192"
    assert bench_gdn.sequences_label([20480] + [512] * 24) == "20480+512x24"
    assert bench_gdn.sequences_label([8192] * 2 + [1024] * 16 + [8192]) == "8192x2+1024x16+8192"


def test_implementations_are_timed_in_interleaved_rounds_and_one_that_cannot_be_captured_eagerly(monkeypatch):
    """interleaved_medians_ms (no GPU: the graph capture and the CUDA events faked): each round times every
    implementation's share of the replays in turn, an implementation whose capture fails runs eagerly and is
    named with the reason, and each median is over that implementation's own times only."""
    ran = []  # the implementation each call ran

    class Graph:
        def replay(self):
            ran.append("ours")

    def captured(fn):
        if fn() == "syncs":
            raise RuntimeError("operation not permitted when stream is capturing")
        return Graph()

    clock = {"ours": iter([1.0, 3.0, 2.0, 9.0]), "peer": iter([5.0, 4.0, 6.0, 7.0])}
    timed = []  # the implementation each timed call ran

    def event_ms(run):
        ran.clear()
        run()
        timed.append(ran[-1])
        return next(clock[ran[-1]])

    monkeypatch.setattr(bench_gdn, "captured_graph", captured)
    monkeypatch.setattr(bench_gdn, "event_ms", event_ms)
    monkeypatch.setattr(bench_gdn.torch.cuda, "synchronize", lambda: None)
    fns = {"ours": lambda: "ours", "peer": lambda: ran.append("peer") or "syncs"}
    medians, eager = bench_gdn.interleaved_medians_ms(fns, reps=4, rounds=2)
    assert timed == ["ours", "ours", "peer", "peer", "ours", "ours", "peer", "peer"]
    assert medians == {"ours": 2.5, "peer": 5.5}
    assert list(eager) == ["peer"] and "stream is capturing" in eager["peer"]
