"""Run flash-qla 0.1.3's host-side code on a CPU-only machine, pretending to be one H200 (sm_90a, 132 SMs).

Used by precompile.py. Nothing here runs a GPU kernel: every TileLang kernel flash-qla builds is either
recorded (dry run) or compiled / loaded from the TileLang cache and then *not* launched.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types

H200_SMS = 132
TARGET_JSON = '{"kind": "cuda", "arch": "sm_90a"}'

# The GPU run resolves target "auto" to Target({"kind": "cuda", "arch": "sm_90a"}) (tilelang/cuda/target.py
# _detect_cuda_target); a dict target given through the env var resolves to the same Target string.
os.environ.setdefault("TILELANG_DEFAULT_TARGET", TARGET_JSON)

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402


class CudaToCpu(TorchFunctionMode):
    """Rewrite device="cuda..." arguments to the CPU (flash-qla creates a few index tensors on cuda:N)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs["device"] = "cpu"
        args = tuple("cpu" if isinstance(a, (str, torch.device)) and "cuda" in str(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda():
    """torch.cuda pretends one H200 is present (for flash-qla's host code only)."""
    saved = {n: getattr(torch.cuda, n) for n in ("is_available", "is_current_stream_capturing", "get_device_properties", "device")}
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=H200_SMS, name="NVIDIA H200 (faked on CPU)", major=9, minor=0)
    # The torch-function mode is not active inside autograd backward; patch the factories flash-qla uses too.
    factories = {n: getattr(torch, n) for n in ("zeros", "ones", "empty", "arange", "tensor", "full")}

    def cpu_factory(f):
        def g(*a, **k):
            if "cuda" in str(k.get("device", "")):
                k["device"] = "cpu"
            return f(*a, **k)
        return g

    for n, f in factories.items():
        setattr(torch, n, cpu_factory(f))
    try:
        with CudaToCpu():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        for n, f in factories.items():
            setattr(torch, n, f)


def import_flash_qla():
    """Import flash_qla as on an H200: compute version 9.0 (hopper kernels), 132 SMs."""
    import tilelang.contrib.nvcc as nvcc
    from tvm.target import Target

    orig = nvcc.get_target_compute_version

    def get_target_compute_version(target=None):
        if target is None and Target.current(allow_none=True) is None:
            return "9.0"
        return orig(target)

    nvcc.get_target_compute_version = get_target_compute_version
    with fake_cuda():
        import flash_qla  # noqa: F401
        from flash_qla.ops.gated_delta_rule.chunk.cp import context as cpctx
        from flash_qla.ops.gated_delta_rule.chunk.hopper import fused_fwd
    assert cpctx.ARCH == "sm90" and cpctx.MULTI_PROCESSOR_COUNT == H200_SMS, (cpctx.ARCH, cpctx.MULTI_PROCESSOR_COUNT)
    assert fused_fwd.TARGET_NUM_CTAS == int(H200_SMS * 0.7)
    assert cpctx.AUTOCP_MODEL, "sm90 autocp coefficients expected"
    return flash_qla


def jit_registry():
    """id(JITImpl) -> 'module:attr' for every tilelang.jit kernel factory in flash_qla's hopper/utility modules."""
    from tilelang.jit import JITImpl

    names = {}
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("flash_qla.") and m is not None]:
        if ".blackwell" in mod.__name__:
            continue
        for attr, val in vars(mod).items():
            if isinstance(val, JITImpl):
                orig = getattr(val.func, "orig_func", None)
                home = getattr(orig, "__module__", mod.__name__)
                names[id(val)] = f"{home}:{getattr(orig, '__name__', attr)}"
    return names


def resolve_jit(name):
    import importlib
    mod, attr = name.split(":")
    return getattr(importlib.import_module(mod), attr)


# --------------------------------------------------------------------------------------------------
# hooks: what TileLang looks up, what it compiles
# --------------------------------------------------------------------------------------------------
class Hooks:
    """Record every TileLang cache key computed and every real compile (JITKernel lowering)."""

    def __init__(self):
        self.keys = []       # dicts: kernel, key, target, pass_configs, func_sha
        self.compiles = []   # kernel names compiled (cache misses)
        self.installed = False

    def install(self):
        if self.installed:
            return self
        import hashlib
        from tilelang.cache.kernel_cache import KernelCache
        from tilelang.jit.kernel import JITKernel
        from tilelang.utils.language import get_prim_func_name

        orig_key = KernelCache._generate_key
        orig_compile = JITKernel._compile_and_create_adapter
        hooks = self

        def _generate_key(self_, func, out_idx, execution_backend="tvm_ffi", args=None, target="auto",
                          target_host=None, pass_configs=None, compile_flags=None):
            key = orig_key(self_, func, out_idx, execution_backend, args, target, target_host, pass_configs, compile_flags)
            hooks.keys.append(dict(
                kernel=get_prim_func_name(func, "<unknown>"), key=key, target=str(target),
                target_host=str(target_host) if target_host else None, backend=execution_backend,
                pass_configs={str(k): v for k, v in (pass_configs or {}).items()},
                func_sha=hashlib.sha256(func.script(show_meta=True).encode()).hexdigest(),
                base=KernelCache._get_base_key()))
            return key

        def _compile_and_create_adapter(self_, tilelang_func, out_idx):
            hooks.compiles.append(str(tilelang_func.attrs.get("global_symbol", "<unknown>")))
            return orig_compile(self_, tilelang_func, out_idx)

        KernelCache._generate_key = _generate_key
        JITKernel._compile_and_create_adapter = _compile_and_create_adapter
        self.installed = True
        return self


# --------------------------------------------------------------------------------------------------
# dry run: intercept kernel factories
# --------------------------------------------------------------------------------------------------
class Recorder:
    """Patch tilelang.jit.JITImpl.__call__.

    mode "record": do not compile; remember (factory, args, kwargs) and return a kernel stub that does nothing.
    mode "load":   call the real factory (compile or disk-cache load), then return a stub instead of the kernel
                   (no GPU to launch on).
    """

    def __init__(self, mode="record"):
        from tilelang.jit import JITImpl
        self.mode = mode
        self.names = jit_registry()
        self.calls = {}      # sig -> dict(name, args, kwargs, scenarios)
        self.scenario = None
        self._orig = JITImpl.__call__
        rec = self

        def __call__(self_, *args, **kwargs):
            name = rec.names.get(id(self_), "<unknown>")
            sig = signature(name, args, kwargs)
            entry = rec.calls.setdefault(sig, dict(name=name, args=args, kwargs=kwargs, scenarios=[]))
            if rec.scenario and rec.scenario not in entry["scenarios"]:
                entry["scenarios"].append(rec.scenario)
            if rec.mode == "load":
                rec._orig(self_, *args, **kwargs)
            return lambda *a, **k: None

        JITImpl.__call__ = __call__

    def restore(self):
        from tilelang.jit import JITImpl
        JITImpl.__call__ = self._orig


def _canon(v):
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, float):
        return repr(v)
    return repr(v) if not isinstance(v, str) else v


def signature(name, args, kwargs):
    return name.split(":")[1] + "(" + ", ".join(
        [_canon(a) for a in args] + [f"{k}={_canon(v)}" for k, v in sorted(kwargs.items())]) + ")"
