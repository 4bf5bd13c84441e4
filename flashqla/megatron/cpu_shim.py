"""Let Megatron-Core build and train modules on a machine without a GPU.

Megatron allocates parameters on `torch.cuda.current_device()` and keeps its model-parallel RNG
streams in the CUDA generator. `install_cpu_shim()` points those calls at the CPU: the device
becomes "cpu", the CUDA RNG functions use the CPU generator and `torch.cuda.synchronize` does
nothing. Rotary embeddings under CP pick this rank's chunks through a pinned host tensor and
`.cuda()`; the shim gives them a CPU selection of the same chunks (r and 2cp-1-r). Megatron's
argument validation asks the GPU for its architecture under TP/CP; the shim answers "pre-Blackwell"
and sets the CUDA_DEVICE_MAX_CONNECTIONS=1 that Megatron then requires (meaningless on CPU). It patches process-wide state, so call it only in CPU-only runs (tests, the tiny CPU
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
    _select_rope_chunks_on_cpu()
    _answer_device_arch_on_cpu()
    _installed = True


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's load-balanced CP order: of 2*cp equal chunks along seq_dim, rank r keeps r and 2cp-1-r."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def _select_rope_chunks_on_cpu():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank


def _answer_device_arch_on_cpu():
    import os

    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
