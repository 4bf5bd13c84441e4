"""Run FLA (fla-core 0.6.0)'s host-side GDN code on a CPU-only machine, pretending to be one H200.

Used by fla_precompile.py. On top of fqla_cpu.fake_cuda (torch.cuda answers as an H200: cc 9.0, 132 SMs):
- Triton's driver answers as a CUDA device of arch 90 (FLA reads it at import: IS_NVIDIA, IS_NVIDIA_HOPPER,
  check_shared_mem(), get_multiprocessor_count()), with the H200's properties (227 KiB opt-in shared memory);
- every Triton kernel launch is a no-op (FLA's forward and most of its backward are Triton kernels, which
  compile on the GPU in seconds and cannot be prebuilt here; their outputs are garbage on the CPU, which no
  host decision of the GDN path reads);
- torch.distributed answers for one pretend rank (fla_scenarios.FakeDist).
The only TileLang kernel factory on FLA's GDN paths is recorded (or compiled / loaded) through fqla_cpu.Recorder.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fqla_cpu  # noqa: E402  (sets TILELANG_DEFAULT_TARGET to sm_90a)

H200_SMS = fqla_cpu.H200_SMS
H200_SMEM_OPTIN = 232448      # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200 (Triton's 'max_shared_mem')

# as our benchmarks run FLA (bench_cp.py, bench_bwd.py): FlashQLA backend off, FLA's own backend dispatch on
os.environ["FLA_FLASH_QLA"] = "0"
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "0")

import torch  # noqa: E402


class _FakeUtils:
    @staticmethod
    def get_device_properties(idx=0):
        return dict(multiprocessor_count=H200_SMS, max_shared_mem=H200_SMEM_OPTIN, max_num_regs=65536,
                    warpSize=32, sm_clock_rate=1980000, mem_clock_rate=3201000, mem_bus_width=6144)


class FakeCudaDriver:
    """Stands in for triton.runtime.driver.active (no libcuda here)."""
    utils = _FakeUtils()

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


@contextlib.contextmanager
def fake_h200():
    """fqla_cpu.fake_cuda plus the torch.cuda queries FLA makes (name, capability, device count, current device)."""
    names = ("get_device_name", "get_device_capability", "device_count", "current_device", "set_device")
    saved = {n: getattr(torch.cuda, n) for n in names}
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda *a, **k: None
    try:
        with fqla_cpu.fake_cuda():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


def stub_triton_launches():
    """Every Triton kernel launch (plain, @heuristics, @autotune) returns at once without compiling."""
    from triton.runtime import autotuner, jit

    def run(self, *args, **kwargs):
        return None
    jit.JITFunction.run = run
    autotuner.Autotuner.run = run
    autotuner.Heuristics.run = run


TILELANG_MODULES = ["fla.ops.common.backends.tilelang.chunk_bwd"]


def import_fla():
    """Import FLA as on an H200 (Triton >= 3.4, so its TileLang chunk_bwd_dqkwg backend is on by default)."""
    import triton
    triton.runtime.driver.set_active(FakeCudaDriver())
    stub_triton_launches()
    with fake_h200():
        import fla  # noqa: F401
        import fla.utils as fu
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        import fla.ops.cp  # noqa: F401
        import fla.ops.common.backends  # noqa: F401  (registers CommonTileLangBackend)
        import importlib
        for m in TILELANG_MODULES:
            importlib.import_module(m)
    from fla.ops.common.backends.tilelang import CommonTileLangBackend
    # FLA's CP checks that its tensors are on an NVIDIA device of compute >= 8.0: ask it about cuda:0 (the H200)
    import fla.ops.cp.context as cpctx
    orig_check = cpctx._check_cp_device

    def _check_cp_device(device):
        # (a stand-in object: torch.device("cuda") itself would be rewritten to the CPU by fake_cuda)
        return orig_check(types.SimpleNamespace(type="cuda", index=0) if device.type == "cpu" else device)
    for mn, mod in list(sys.modules.items()):
        if mn.startswith("fla.") and getattr(mod, "_check_cp_device", None) is orig_check:
            mod._check_cp_device = _check_cp_device
    assert fu.IS_NVIDIA and fu.IS_NVIDIA_HOPPER and fu.TRITON_ABOVE_3_4_0, (fu.IS_NVIDIA, fu.IS_NVIDIA_HOPPER)
    assert fu.check_shared_mem() and fu.check_shared_mem("hopper"), "H200 shared memory expected"
    assert CommonTileLangBackend.can_use(), "FLA's TileLang backend should be enabled (Hopper, Triton >= 3.4, nvcc)"
    return fla


def jit_registry():
    """id(JITImpl) -> 'module:attr' for every tilelang.jit factory in FLA's loaded modules."""
    from tilelang.jit import JITImpl

    names = {}
    for mn, mod in list(sys.modules.items()):
        if not mn.startswith("fla.") or mod is None:
            continue
        for attr, val in vars(mod).items():
            if isinstance(val, JITImpl):
                names[id(val)] = f"{mn}:{attr}"
    return names


def make_recorder(mode):
    rec = fqla_cpu.Recorder(mode)
    rec.names = jit_registry()
    return rec


resolve_jit = fqla_cpu.resolve_jit
Hooks = fqla_cpu.Hooks
