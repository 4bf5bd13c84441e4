"""benchmarks/bench_gdn.py's rows from earlier runs (no GPU): a device call cut short keeps the rows it
measured (--rows-json), and the report of the remaining configs is made with them (--merge)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gdn  # noqa: E402


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
    report = bench_gdn.write_report(tmp_path / "fwd.md", rows, {"torch": "x"}, [])
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
