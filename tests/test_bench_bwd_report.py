"""benchmarks/bench_bwd.py's report and chart from given rows (no GPU): the ratios and geomeans it prints are
what a device session records, so they are checked here where a mistake costs nothing."""
import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_bwd  # noqa: E402

# (fwd ms, fwd+bwd ms, peak MiB) per implementation
# and a row's backward floors (memory us, tensor-core us), absent from rows of older runs
ROWS = [dict(Hqk=16, Hv=32, T=8192, n=1, flashqla_cp=(1.0, 3.0, 700.0), fla=(1.0, 5.0, 900.0), flash_qla=(1.0, 2.0, 400.0),
             floors=(100.0, 250.0)),
        dict(Hqk=2, Hv=4, T=32768, n=2, flashqla_cp=(1.0, 2.0, 100.0), fla=None, flash_qla=(0.5, 4.5, 90.0))]


def test_report_gives_each_peer_ratio_per_row_and_geomeans(tmp_path):
    out = tmp_path / "bwd.md"
    report = bench_bwd.write_report(out, ROWS, ["flashqla_cp", "fla", "flash_qla"], {"torch": "x"}, ["- a note"])
    assert out.read_text() == report
    # row 1: backward 2.0 ms ours, 4.0 FLA, 1.0 FlashQLA; fwd+bwd 3.0, 5.0, 2.0
    # floors 100 / 250 us: ours 2000 us is 8x the higher
    assert "| 2.00x (1.67x) | 0.50x (0.67x) | 100 / 250 | 8.0x |" in report
    # row 2: FLA missing; FlashQLA backward 4.0 vs ours 1.0, fwd+bwd 4.5 vs 2.0; no floors
    assert "| n/a | 4.00x (2.25x) | n/a | n/a |" in report
    assert "over fla: backward 2.00x, fwd+bwd 1.67x (1 configs)" in report
    geo_bwd, geo_all = math.sqrt(0.5 * 4.0), math.sqrt(2.0 / 3.0 * 2.25)
    assert f"over flash_qla: backward {geo_bwd:.2f}x, fwd+bwd {geo_all:.2f}x (2 configs)" in report
    assert report.rstrip().endswith("- a note")


def test_parts_of_a_matrix_merge_in_matrix_order_the_later_row_kept(tmp_path):
    """A matrix run in parts: each part's --rows-json (JSON turns the tuples into lists, as the report reads
    them), merged in the matrix's order, a config measured twice taking the later part's row, notes once."""
    import json

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    json.dump(dict(rows=[ROWS[1], dict(ROWS[0], flash_qla=(1.0, 9.0, 1.0))], notes=["- a", "- b"]), first.open("w"))
    json.dump(dict(rows=[ROWS[0]], notes=["- b", "- c"]), second.open("w"))
    rows, notes = bench_bwd.merged_run([first, second])
    assert [bench_bwd.config_key(r) for r in rows] == [(16, 32, 8192, 1), (2, 4, 32768, 2)]
    assert rows[0]["flash_qla"] == [1.0, 2.0, 400.0] and notes == ["- a", "- b", "- c"]
    report = bench_bwd.write_report(tmp_path / "m.md", rows, ["flashqla_cp", "fla", "flash_qla"], {}, notes)
    assert "| 2.00x (1.67x) | 0.50x (0.67x) | 100 / 250 | 8.0x |" in report
    # heads outside the published matrix sort after it
    assert bench_bwd.matrix_order(dict(Hqk=2, Hv=8, T=8192, n=1)) > bench_bwd.matrix_order(ROWS[1])


def test_flashqla_implementations_name_their_intra_card_cp():
    assert bench_bwd.flashqla_intra_cp("flashqla") == "off"
    assert bench_bwd.flashqla_intra_cp("flashqla_cp") == "auto"
    assert bench_bwd.flashqla_intra_cp("flashqla_L16") == 16
    assert bench_bwd.flashqla_intra_cp("flash_qla") is None and bench_bwd.flashqla_intra_cp("fla") is None
    for bad in ("flashqla_L", "flashqla_L0", "flashqla_Lx"):
        with pytest.raises(ValueError, match="segment length in chunks"):
            bench_bwd.flashqla_intra_cp(bad)


def test_chart_is_written(tmp_path):
    bench_bwd.plot(tmp_path / "bwd.png", ROWS, ["flashqla_cp", "fla", "flash_qla"])
    assert (tmp_path / "bwd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refused_jit_loads_cached_kernels_and_refuses_new_ones(tmp_path, monkeypatch):
    """--refuse-peer-jit on a real TileLang compile (sm_90a, no GPU needed): a kernel already in the disk cache
    loads inside the guard, one that is not raises at once, and compiling works again after it."""
    import shutil
    import time

    tilelang = pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    import tilelang.language as T

    from flashqla.kernels.hopper import launch

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))

    def scaled(factor):
        n = T.dynamic("n")

        @T.prim_func
        def scale(x: T.Tensor((n,), "float32")):
            with T.Kernel(T.ceildiv(n, 128), threads=128) as (b,):
                for i in T.Parallel(128):
                    if b * 128 + i < n:
                        x[b * 128 + i] = x[b * 128 + i] * factor
        return scale

    def build(factor):
        return tilelang.compile(scaled(factor), target=launch.TARGET)

    build(2.0)  # into the cache
    never_built = 3.0 + time.time_ns() % 10**6 / 10**7  # a kernel no earlier run (or shared cache) holds
    with bench_bwd.tilelang_compiles_refused("peer"):
        assert build(2.0) is not None  # a cache hit: loaded, not compiled
        with pytest.raises(bench_bwd.JITRefused, match="peer: a TileLang kernel is not in the cache"):
            build(never_built)
    assert build(never_built) is not None


def test_an_implementation_runs_under_the_environment_it_names(monkeypatch):
    monkeypatch.setenv("FLASHQLA_GQA_PAIR_SUM", "0")
    monkeypatch.delenv("FLASHQLA_UNSET_HERE", raising=False)
    assert bench_bwd.impl_environment("flashqla_cp") == ("flashqla_cp", {})
    name, env = bench_bwd.impl_environment("flashqla_cp@FLASHQLA_GQA_PAIR_SUM=1+FLASHQLA_UNSET_HERE=x")
    assert name == "flashqla_cp" and env == {"FLASHQLA_GQA_PAIR_SUM": "1", "FLASHQLA_UNSET_HERE": "x"}
    with bench_bwd.environment(env):
        assert os.environ["FLASHQLA_GQA_PAIR_SUM"] == "1" and os.environ["FLASHQLA_UNSET_HERE"] == "x"
    assert os.environ["FLASHQLA_GQA_PAIR_SUM"] == "0" and "FLASHQLA_UNSET_HERE" not in os.environ
    with pytest.raises(ValueError, match="VAR=value"):
        bench_bwd.impl_environment("flashqla_cp@FLASHQLA_GQA_PAIR_SUM")


def test_a_failing_implementation_becomes_a_note_under_its_own_environment(monkeypatch):
    """time_impl_noted (bench_bwd and bench_packs): the implementation runs under the variables its name sets, and
    an exception gives no times and one note naming the implementation and the config, not a crash."""
    monkeypatch.delenv("FLASHQLA_UNSET_HERE", raising=False)
    seen = []

    def fails(*args):
        seen.append(os.environ.get("FLASHQLA_UNSET_HERE"))
        raise RuntimeError("no kernel")

    inputs = [torch.zeros(1, 2, 1, 4) for _ in range(5)] + [None]
    notes = []
    times, seconds = bench_bwd.time_impl_noted("flashqla_cp@FLASHQLA_UNSET_HERE=x", fails, inputs, None, 10, True,
                                               False, notes, "(2,4) 8192x1")
    assert times is None and seconds >= 0 and seen == ["x"] and "FLASHQLA_UNSET_HERE" not in os.environ
    assert notes == ["- flashqla_cp@FLASHQLA_UNSET_HERE=x failed on (2,4) 8192x1: RuntimeError: no kernel"]
