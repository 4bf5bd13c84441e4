"""benchmarks/bench_long.py without a GPU: the configs and budgets it parses and the table it writes."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_long  # noqa: E402


def test_configs_parse_and_a_malformed_one_names_itself():
    assert bench_long.parse_configs("262144:32,1048576:8") == [(262144, 32), (1048576, 8)]
    assert len(bench_long.parse_configs(bench_long.CONFIGS)) == 4
    for bad in ("262144", "262144:7", "1M:8"):
        with pytest.raises(ValueError, match=repr(bad)):
            bench_long.parse_configs(bad)


def test_budgets_are_named_or_positive_gib():
    assert bench_long.budget_env("unbounded") == "1e9" and bench_long.budget_env("default") == ""
    assert bench_long.budget_env("2.5") == "2.5"
    for bad in ("0", "-1", "lots"):
        with pytest.raises(ValueError, match=repr(bad)):
            bench_long.budget_env(bad)


def test_table_gives_same_bits_and_the_peer_ratio_or_its_failure():
    rows = [{"T": 1048576, "Hv": 32, "impl": "flashqla, budget unbounded", "error": "out of memory"},
            {"T": 1048576, "Hv": 32, "impl": "flashqla, budget default", "ms": 120.0, "peak": 40.25},
            {"T": 1048576, "Hv": 32, "impl": "FlashQLA 0.1.3", "error": "out of memory"},
            {"T": 262144, "Hv": 8, "impl": "flashqla, budget unbounded", "ms": 8.0, "peak": 5.0},
            {"T": 262144, "Hv": 8, "impl": "flashqla, budget default", "ms": 8.1, "peak": 3.0, "same": True},
            {"T": 262144, "Hv": 8, "impl": "FlashQLA 0.1.3", "ms": 9.6, "peak": 4.0}]
    text = bench_long.table(rows)
    assert "| 1024K x 32 | flashqla, budget unbounded | out of memory | n/a |  |  |" in text
    assert "| 1024K x 32 | flashqla, budget default | 120.00 | 40.2 |  | out of memory |" in text
    assert "| 256K x 8 | flashqla, budget default | 8.10 | 3.0 | yes | 1.19x |" in text
    assert "| 256K x 8 | FlashQLA 0.1.3 | 9.60 | 4.0 |  |  |" in text


def test_fingerprint_tells_bits_apart():
    import torch

    t = torch.randn(1000, 7).bfloat16()
    assert bench_long.fingerprint(t) == bench_long.fingerprint(t.clone())
    u = t.clone()
    u.view(torch.int16)[500, 3] ^= 1  # the last bit of one element
    assert bench_long.fingerprint(u) != bench_long.fingerprint(t)
    swapped = t.clone()
    swapped[[1, 2]] = t[[2, 1]]  # same values, other places
    assert bench_long.fingerprint(swapped) != bench_long.fingerprint(t)
    assert bench_long.fingerprint(torch.randn(3, 5)) != bench_long.fingerprint(torch.zeros(3, 5))
    long = torch.randn(70000)
    far = long.clone()
    far[[0, 65521]] = long[[65521, 0]]  # a swap a position-weighted sum with weights mod 65521 would not see
    assert bench_long.fingerprint(far) != bench_long.fingerprint(long)
