"""benchmarks/bench_recompute.py without a GPU: the configs it parses and the table it writes (that "auto" keeps the
states in a reentrant recompute only is tests/test_kernel_host_glue.py's)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_recompute  # noqa: E402


def test_configs_parse_and_a_malformed_one_names_itself():
    assert bench_recompute.parse_configs("2:8:32768x1,16:32:4096x8") == [(2, 8, [32768]), (16, 32, [4096] * 8)]
    assert len(bench_recompute.parse_configs(bench_recompute.CONFIGS)) == 8
    with pytest.raises(ValueError, match="'2:8:4096'"):
        bench_recompute.parse_configs("2:8:4096")


def test_table_gives_the_store_cost_and_the_step_gain():
    text = bench_recompute.table([("(2, 8) 32768 x 1", (0.25, 0.275, 1.3, 1.25))])
    assert "| (2, 8) 32768 x 1 | 0.250 | 0.275 (+10.0%) | 1.300 | 1.250 | 1.040x |" in text


def test_memory_table_gives_what_a_call_holds_under_each_kind_of_checkpointing():
    text = bench_recompute.memory_table([("(16, 32) 32768 x 1", (168.0, 0.0, 0.0))])
    assert "| (16, 32) 32768 x 1 | 168.0 | 0.0 | 0.0 |" in text
