"""examples/pretrain_qwen_next/train_deepspeed.py: a few steps of the tiny size on CPU in one process,
then a resume from its checkpoint; the loss falls and the resumed run picks up the step count."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
# a plain process: no launcher variables, so the script makes its own one-process group
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
ENV["OMP_NUM_THREADS"] = "2"
SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain_qwen_next" / "train_deepspeed.py"


def run(*args):
    done = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--seq-len", "128", *args],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_tiny_pretraining_loss_falls_and_resumes_from_its_checkpoint(tmp_path):
    out = run("--steps", "20", "--save-every", "10", "--save-dir", str(tmp_path))
    first, last = map(float, re.search(r"loss: first 10 steps ([\d.]+) -> last 10 steps ([\d.]+)", out).groups())
    assert last < first - 0.5, out
    assert (tmp_path / "step20").is_dir() and (tmp_path / "loss_curve.png").stat().st_size > 0
    resumed = run("--steps", "21", "--resume", "--save-dir", str(tmp_path))
    assert "steps 20 -> 21" in resumed
