"""examples/pretrain_qwen_next/train_megatron.py on CPU (tiny size, short rows, a small corpus): it
trains, writes dist checkpoints and a loss curve, and a run stopped and resumed from its checkpoint
gives the losses of the uninterrupted run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pretrain_qwen_next" / "train_megatron.py"


def train(save_dir, corpus, *extra):
    command = [sys.executable, str(SCRIPT), "--size", "tiny", "--seq-len", "64", "--steps", "8", "--lr", "3e-3",
               "--warmup", "1", "--save-every", "4", "--data", str(corpus), "--save-dir", str(save_dir), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")
    env.pop("RANK", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((Path(save_dir) / "losses.json").read_text())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 short documents (the default stdlib corpus takes longer to tokenize than this test runs)."""
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (folder / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 5))
    return folder


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    return save_dir, train(save_dir, corpus)


def test_tiny_run_writes_checkpoints_and_loss_curve_and_its_loss_falls(uninterrupted):
    save_dir, losses = uninterrupted
    assert len(losses) == 8
    assert (save_dir / "step4").is_dir() and (save_dir / "step8").is_dir()
    assert (save_dir / "latest").read_text() == "step8"
    assert (save_dir / "loss_curve.png").stat().st_size > 0
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.5, losses
    summary = json.loads((save_dir / "summary.json").read_text())
    assert summary["framework"] == "megatron" and summary["impl"] == "flashqla" and summary["steps"] == 8
    assert summary["tokens_per_s"] > 0 and summary["steps_measured"] == 3 and summary["mfu"] is None


def test_stopped_and_resumed_run_gives_the_uninterrupted_losses(uninterrupted, corpus, tmp_path):
    _, expected = uninterrupted
    first = train(tmp_path, corpus, "--exit-after", "5")  # checkpoint at 4 and at the exit (5)
    assert len(first) == 5 and (tmp_path / "latest").read_text() == "step5"
    resumed = train(tmp_path, corpus, "--resume")
    assert resumed[:5] == first
    assert resumed == pytest.approx(expected, rel=1e-6, abs=0)


def test_one_hardware_queue_only_where_megatron_asserts_it():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's requirement under TP or CP) is set for those runs only."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_megatron

    def needs(*argv):
        return train_megatron.needs_one_hardware_queue(train_megatron.parse_args(list(argv))[0])

    assert not needs("--size", "small")
    assert needs("--size", "small", "--tp", "2")
    assert needs("--size", "small", "--cp", "2")
    assert needs("--size", "long256k")  # its rows are split over 2 GPUs by default
    assert not needs("--size", "long256k", "--cp", "1")
