"""Run a test body on several ranks under a deadline, so a hung collective fails the test: gloo on the CPU,
or NCCL with one GPU per rank."""
import faulthandler
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 180


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, backend, fn, args):
    faulthandler.enable(all_threads=True)  # a rank killed by a signal (SIGABRT from C++) prints its Python stacks
    torch.set_num_threads(1)  # ranks share a 2-core machine: no thread oversubscription
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size, fn, *args, backend="gloo"):
    """Runs fn(rank, world_size, *args) on `world_size` processes (gloo; or NCCL, rank r on GPU r); fails on
    error or past the deadline."""
    context = mp.start_processes(_entry, args=(world_size, _free_port(), backend, fn, args), nprocs=world_size,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # raises if a rank raised
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{world_size} ranks did not finish within {DEADLINE_S} s (a collective hung?)")
