"""examples/pretrain_qwen_next/train_deepspeed.py: a few steps of the tiny size on CPU in one process,
then a resume from its checkpoint; the loss falls and the resumed run picks up the step count."""
import json
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
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["framework"] == "deepspeed" and summary["impl"] == "flashqla" and summary["steps"] == 20
    assert summary["tokens_per_s"] > 0 and summary["steps_measured"] == 15  # 5 warm-up steps left out
    assert summary["mfu"] is None  # no peak FLOP/s on a CPU
    resumed = run("--steps", "21", "--resume", "--save-dir", str(tmp_path))
    assert "steps 20 -> 21" in resumed


@pytest.mark.parametrize("name", ["small", "tiny"])
def test_model_flops_match_the_transformers_model_weights(name):
    """6 x (every matmul weight a token goes through) + the sequence-length terms, with the weights counted
    from transformers' Qwen3-Next built on the meta device: `small` (dense MLPs) and `tiny` (MoE: routed
    experts count top-2 of E, plus the router)."""
    import torch
    from transformers import Qwen3NextForCausalLM

    sys.path.insert(0, str(SCRIPT.parent))
    from data import VOCAB_SIZE
    from model_config import CHUNK, SIZES, hf_config, train_flops_per_token

    size = SIZES[name]
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(hf_config(name, VOCAB_SIZE))
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    for pname, p in model.named_parameters():
        if ".experts." in pname:  # routed experts (fused tensors, not nn.Linear): top-2 of E per token
            matmul_weights += p.numel() * 2 // size.num_experts
        elif pname.endswith("mlp.gate.weight"):  # the router
            matmul_weights += p.numel()
    attn_layers, gdn_layers = size.num_layers // 4, size.num_layers - size.num_layers // 4
    dk = size.gdn_head_dim
    per_token_gdn = size.gdn_value_heads * (4 * CHUNK * dk + 3 * dk * dk)
    for seq_len in (size.seq_len, 2 * size.seq_len):
        per_token_attn = size.attention_heads * size.attention_head_dim * seq_len
        expected = 6 * (matmul_weights + gdn_layers * per_token_gdn + attn_layers * per_token_attn)
        assert train_flops_per_token(size, VOCAB_SIZE, seq_len) == expected
