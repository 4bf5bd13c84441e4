"""Shared set-up for the Megatron tests: CPU + gloo process groups, a tiny GDN config, module builders,
and a launcher for multi-rank jobs (each rank a subprocess running mcore_worker.py)."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # Megatron's jit_fuser is torch.compile (~46 s cold)

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashqla.megatron.cpu_shim import install_cpu_shim

install_cpu_shim()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from flashqla.megatron import get_local_gdn_module_spec  # noqa: E402

HERE = Path(__file__).resolve().parent


def init_parallel(tp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """Join (or start, for a single process) the gloo world and set Megatron's TP/CP groups.

    Ranks meet through a file (no fixed or pre-picked TCP port another job on the machine could take)."""
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
        rendezvous = os.environ.get("MCORE_TEST_RENDEZVOUS") or tempfile.mktemp(prefix="mcore_rendezvous_")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed)


def gdn_config(tp: int = 1, cp: int = 1, config_class=TransformerConfig, **overrides) -> TransformerConfig:
    """Two k-heads, four v-heads (GQA 2:4) of dim 16: the smallest shape that still splits over TP 2
    or CP 2 and exercises the grouped-head mapping."""
    fields = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=1,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        transformer_impl="local",
    )
    fields.update(overrides)
    return config_class(**fields)


def build_flashqla_gdn(config: TransformerConfig, **gdn_params):
    spec = get_local_gdn_module_spec(config, **{"kernel_backend": "torch", **gdn_params})
    return build_module(spec, config=config, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def run_ranks(scenarios: list[str], world_size: int, workdir: Path, timeout: float = 300.0) -> dict[str, list[str]]:
    """Run `mcore_worker.py workdir scenarios...` on `world_size` gloo ranks (one process group for all
    scenarios). Returns each scenario's failures over all ranks; a scenario that left no result on a
    rank (a crash, or a hang past `timeout`) fails with that rank's log tail."""
    for stale in [workdir / "rendezvous", *workdir.glob("*.rank*.json")]:  # a file rendezvous is single-use
        stale.unlink(missing_ok=True)
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
            MCORE_TEST_RENDEZVOUS=str(workdir / "rendezvous"),
        )
        log = open(workdir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "mcore_worker.py"), str(workdir), *scenarios],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE,
        ))
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
    results = {}
    for scenario in scenarios:
        results[scenario] = []
        for rank in range(world_size):
            result = workdir / f"{scenario}.rank{rank}.json"
            if result.exists():
                results[scenario] += json.loads(result.read_text())
            else:
                log = (workdir / f"rank{rank}.log").read_text()[-3000:]
                results[scenario].append(f"rank {rank} left no result (crashed or hung past {timeout} s):\n{log}")
    return results
