"""benchmarks/bench_packs.py without a GPU: the rows it runs and the report it writes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_packs  # noqa: E402
from doc_packs import pack_draws  # noqa: E402


def test_pack_rows_are_the_planner_sweeps_draws_at_each_head_pair():
    rows = bench_packs.pack_rows([(2, 4), (16, 32)])
    assert len(rows) == 2 * len(pack_draws())
    assert all(sum(seqs) == bench_packs.PACK_TOKENS for *_, seqs in rows)
    assert rows[0][2] == rows[len(pack_draws())][2]  # the same documents at every head pair


def test_report_gives_each_peer_over_ours_per_row_and_as_geomeans():
    rows = [dict(Hqk=2, Hv=4, seqs=[100, 200], L=0, flashqla_cp=(1.0, 3.0, 10.0), flash_qla=(2.0, 5.0, 12.0),
                 fla=None),
            dict(Hqk=2, Hv=4, seqs=[300], L=8, flashqla_cp=(1.0, 2.0, 10.0), flash_qla=(0.5, 3.0, 12.0),
                 fla=(4.0, 8.0, 20.0))]
    text = bench_packs.report(rows, ["flashqla_cp", "flash_qla", "fla"], {"gpu": "H100"}, ["- a note"])
    assert ("| 2 | 4 | 2 | 200 | 0 | 1.000 / 2.000 / 3.000 | 2.000 / 3.000 / 5.000 | n/a | 2.00x / 1.50x / 1.67x "
            "| n/a |") in text
    # FlashQLA: forward 2 and 0.5 -> 1.00x, backward 1.5 and 2.5 -> sqrt(3.75), fwd+bwd 5/3 and 1.5
    assert "FlashQLA 0.1.3 time over flashqla's: forward 1.00x, backward 1.94x, fwd+bwd 1.58x (2 rows)" in text
    assert "FLA 0.6 time over flashqla's: forward 4.00x, backward 4.00x, fwd+bwd 4.00x (1 rows)" in text
    assert text.rstrip().endswith("- a note")
