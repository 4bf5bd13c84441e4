"""The inter-card CP scripts that GPU sessions run (benchmarks/cp_nccl_parity.py, benchmarks/bench_cp.py),
dry-run on two gloo ranks with the torch backend: device time is too scarce to find a broken script there."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
REPO = Path(__file__).resolve().parents[1]


def run_two_ranks(script, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "benchmarks" / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


@pytest.mark.parametrize("extra", [[], ["--layout", "zigzag", "--cp-warmup", "-10", "--no-zero-head"], ["--float64"]])
def test_cp_nccl_parity_dry_run_agrees_on_every_rank(extra):
    log = run_two_ranks("cp_nccl_parity.py", "--tokens", "1024", "--heads", "1,2", *extra)
    # every rank's result, wherever it starts: two ranks share one stdout pipe, and unbuffered (e.g.
    # PYTHONUNBUFFERED) a print's text and its newline are two writes, so one rank's line can run into
    # the other's (one CI run had rank 0's inside rank 1's line)
    lines = [part for part in re.split(r"(?=rank \d+/\d+ )", log) if part.startswith("rank ")]
    assert sorted(line.split()[1] for line in lines) == ["0/2", "1/2"], log[-4000:]
    if "--float64" in extra:  # both runs' o against the truth, printed on every rank
        assert all("o (CP) vs float64" in line and "o (one GPU) vs float64" in line for line in lines), lines


def test_bench_cp_dry_run_times_both_flashqla_modes(tmp_path):
    out = tmp_path / "cp.md"
    run_two_ranks("bench_cp.py", "--tokens", "1024", "--heads", "2", "--reps", "1", "--layers", "2",
                  "--impls", "flashqla exact,flashqla warmup", "--out", str(out))
    table = out.read_text()
    assert "| flashqla exact | 1024 | 2 |" in table and "| flashqla warmup | 1024 | 2 |" in table
    assert "2 GDN call(s) per step" in table
