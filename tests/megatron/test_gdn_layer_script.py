"""benchmarks/megatron_gdn_layer.py, the GPU check of flashqla's Megatron GDN layer at TP 2 and CP 2
against TP 1 (issue 8), dry-run on two CPU ranks (gloo, fp64, torch backend): the script's layouts,
reductions and comparisons are right before a GPU session spends time on them."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gdn_layer_script_finds_tp2_and_both_cp2_modes_equal_to_tp1():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "benchmarks" / "megatron_gdn_layer.py"), "--cpu", "--tokens", "256", "--docs", "3",
               "--hidden", "64", "--key-heads", "2", "--value-heads", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    reports = re.findall(r"^flashqla (TP 2|CP 2 state passing|CP 2 head all-to-all) vs TP 1.*$", log, re.M)
    assert reports == ["TP 2", "CP 2 state passing", "CP 2 head all-to-all"], log[-4000:]
