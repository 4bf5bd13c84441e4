"""Let Megatron-Core build and train modules on a machine without a GPU.

Megatron allocates parameters on `torch.cuda.current_device()` and keeps its model-parallel RNG
streams in the CUDA generator. `install_cpu_shim()` points those calls at the CPU: the device
becomes "cpu", the CUDA RNG functions use the CPU generator and `torch.cuda.synchronize` does
nothing. It patches process-wide state, so call it only in CPU-only runs (tests, the tiny CPU
launcher run); it refuses to run where CUDA is available.
"""
import torch

_installed = False


def install_cpu_shim() -> None:
    """Route Megatron's CUDA device and RNG calls to the CPU (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_shim() is for CPU-only runs, but CUDA is available")
    from megatron.core.tensor_parallel import random as mcore_random

    def get_rng_state(device=None, clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_rng_state(new_state, device=None, graph_safe=False):
        torch.set_rng_state(new_state)

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls back into cuda

    torch.cuda.manual_seed = manual_seed
    torch.cuda.manual_seed_all = manual_seed
    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.random.get_rng_state = get_rng_state
    mcore_random._get_cuda_rng_state = get_rng_state
    mcore_random._set_cuda_rng_state = set_rng_state
    _installed = True
