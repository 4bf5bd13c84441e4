"""`flashqla precompile` fills a TileLang cache that later processes load without compiling, also under races.

CPU only (nvcc, no GPU): "loads" means TileLang's cache hands back a kernel while its compile entry points
(`JITKernel._compile_and_create_adapter`, `nvcc.compile_cuda`) are replaced by functions that raise.
The bf16 kernels are precompiled into the repo's ignored `.tilelang_cache/` (the cache scripts/test.sh and
scripts/device_kernels.sh use), so a machine that already compiled them reuses them here.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tilelang")
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

from flashqla.cli import main as cli_main  # noqa: E402
from flashqla.kernels import cache  # noqa: E402
from flashqla.kernels.cache import MANIFEST  # noqa: E402
from flashqla.kernels.hopper import launch  # noqa: E402
from flashqla.precompile import kernel_configs, precompile  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_CACHE = REPO / ".tilelang_cache"
DTYPE = "bfloat16"
EXPECTED = {f"{builder.__name__}{args}" for builder, args in kernel_configs((DTYPE,))}
# the GDN kernels with tensor-core products (the segment chain runs fp32 on CUDA cores, like the layer ops;
# the GQA sums stream)
GDN_KERNELS = {f"{builder.__name__}{args}" for builder, args in launch.kernel_configs((DTYPE,))
               if builder not in (launch.compiled_segment_chain, launch.compiled_gqa_sum)}
RACERS = 8  # ranks of one node starting at once

REFUSE_COMPILING = """
import json, logging, sys, time
logging.basicConfig(level=logging.INFO)
from tilelang.contrib import nvcc
from tilelang.jit.kernel import JITKernel

def refuse(*args, **kwargs):
    raise AssertionError("compiled instead of loading from the cache")

JITKernel._compile_and_create_adapter = refuse
nvcc.compile_cuda = refuse
"""

# with the kernel builders replaced by functions that raise: a load must come from flashqla's cache index
REFUSE_BUILDING = """
import importlib
for name in ("wy_inverse", "chunk_output", "chunk_states", "fused_fwd", "chunk_dstates", "chunk_bwd_local"):
    module = importlib.import_module(f"flashqla.kernels.hopper.{name}")
    setattr(module, f"build_{name}", refuse)
"""

# loads every kernel configuration of dtype argv[1] (only the builders named in argv[2:], if any)
LOAD = REFUSE_COMPILING + """
from flashqla.kernels import cache
from flashqla.precompile import kernel_configs
loaded = {}
for builder, args in kernel_configs((sys.argv[1],)):
    if sys.argv[2:] and builder.__name__ not in sys.argv[2:]:
        continue
    start = time.perf_counter()
    entry = cache.entry_of(builder(*args))
    loaded[f"{builder.__name__}{args}"] = [str(cache.relative_entry(entry)), time.perf_counter() - start]
print(json.dumps(loaded))
"""

# a small kernel through flashqla's compile path (its race is TileLang's cache protocol, not the kernel's
# size; a flashqla kernel would take RACERS x ~20 s of CPU on the 2-core CI machine)
SMALL_KERNEL = """
import tilelang.language as T
from flashqla.kernels import cache
from flashqla.kernels.hopper.launch import TARGET

@T.prim_func
def add_one(A: T.Tensor((1024,), "float32"), B: T.Tensor((1024,), "float32")):
    with T.Kernel(8, threads=128) as bx:
        for i in T.Parallel(128):
            B[bx * 128 + i] = A[bx * 128 + i] + 1.0

def compile_small():
    return cache.entry_of(cache.compile_kernel(lambda: add_one, "add_one", target=TARGET))
"""

# waits for the test to say go (so every racer compiles at the same moment), then compiles
COMPILE_ON_GO = """
import json, logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO)
""" + SMALL_KERNEL + """
flags = Path(sys.argv[1])
(flags / f"ready-{sys.argv[2]}").touch()
while not (flags / "go").exists():
    time.sleep(0.05)
print(json.dumps(str(cache.relative_entry(compile_small()))))
"""

LOAD_SMALL = REFUSE_COMPILING + SMALL_KERNEL + """
print(json.dumps(str(cache.relative_entry(compile_small()))))
"""


def _start(code, *args, env, workdir):
    """A Python process running `code` from a file (TileLang reads a prim_func's source back)."""
    script = Path(workdir) / f"script_{abs(hash(code))}.py"
    if not script.exists():  # racers start from one file, written once
        script.write_text(code)
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def _finish(process, timeout=300):
    """stdout's last line as JSON, stderr; fails the test on a non-zero exit."""
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def _staged_leftovers(root: Path):
    return [p for p in root.glob("*/**/.staging/**/*") if p.name != "cuda-binaries"]


@pytest.fixture(scope="module")
def precompiled():
    before = set(cache.entries(SHARED_CACHE))
    start = time.perf_counter()
    results = precompile(cache_dir=SHARED_CACHE, dtypes="bf16", progress=False)
    print(f"\nprecompile bf16: {time.perf_counter() - start:.1f} s, "
          f"{sum(r.compiled for r in results)} of {len(results)} compiled")
    return before, results


def test_precompile_writes_one_complete_entry_per_kernel_configuration(precompiled):
    before, results = precompiled
    assert {r.kernel for r in results} == EXPECTED
    entries = [r.entry for r in results]
    assert len(set(entries)) == len(entries), "two configurations share a cache entry"
    for r in results:
        assert r.entry.parent.parent.parent.parent == SHARED_CACHE.resolve(), r.entry
        assert cache.is_complete(r.entry), f"{r.kernel}: incomplete entry {r.entry}"
        if r.kernel in GDN_KERNELS:  # the layer ops and the segment chain have no tensor-core products
            assert (r.entry / "device_kernel.cu").read_text().count("wgmma") > 0, "not lowered for Hopper WGMMA"
        assert r.compiled == (cache.relative_entry(r.entry) not in before), f"{r.kernel}: wrong hit/miss report"


def test_precompiled_kernels_load_in_a_fresh_process_without_compiling(precompiled, tmp_path):
    _, results = precompiled
    env = {"TILELANG_CACHE_DIR": str(SHARED_CACHE), cache.PREBUILT_ENV: "off"}
    loaded, stderr = _finish(_start(LOAD, DTYPE, env=env, workdir=tmp_path))
    assert {k: v[0] for k, v in loaded.items()} == {r.kernel: str(cache.relative_entry(r.entry)) for r in results}
    print("\nload from cache, s: " + ", ".join(f"{k} {v[1]:.2f}" for k, v in sorted(loaded.items())))
    assert "JIT-compiled" not in stderr


def test_the_cache_index_loads_every_kernel_without_building_its_prim_func(precompiled, tmp_path):
    """precompile wrote flashqla's index next to the entries; a fresh process then never runs a builder."""
    _, results = precompiled
    indexed = list(SHARED_CACHE.glob(f"*/*/{cache.INDEX_DIR}/*.json.gz"))
    assert len(indexed) >= len(results)
    env = {"TILELANG_CACHE_DIR": str(SHARED_CACHE), cache.PREBUILT_ENV: "off"}
    loaded, _ = _finish(_start(LOAD.replace("from flashqla.kernels import cache", REFUSE_BUILDING
                                            + "from flashqla.kernels import cache", 1), DTYPE, env=env,
                               workdir=tmp_path))
    assert {k: v[0] for k, v in loaded.items()} == {r.kernel: str(cache.relative_entry(r.entry)) for r in results}
    print("\nload through the index, s: " + ", ".join(f"{k} {v[1]:.3f}" for k, v in sorted(loaded.items())))


# the index path must not import tilelang (1-2 s of TVM start-up on the first call); a kernel module imports
# it, so a builder that ran would show too
WITHOUT_TILELANG = """
import json, sys
from flashqla.kernels.hopper import launch
kinds = sorted({type(builder(*args)).__name__ for builder, args in launch.kernel_configs((sys.argv[1],))})
print(json.dumps([kinds, "tilelang" in sys.modules]))
"""


def test_indexed_kernels_load_without_importing_tilelang(precompiled, tmp_path):
    env = {"TILELANG_CACHE_DIR": str(SHARED_CACHE), cache.PREBUILT_ENV: "off"}
    (kinds, imported), _ = _finish(_start(WITHOUT_TILELANG, DTYPE, env=env, workdir=tmp_path))
    assert kinds == ["LoadedKernel"] and not imported


PRELOAD = REFUSE_COMPILING + REFUSE_BUILDING + """
import flashqla
from flashqla.kernels.hopper import launch
reason = flashqla.preload_kernels("bf16")
print(json.dumps([reason, launch.compiled_chunk_bwd_local.cache_info().currsize,
                  launch.compiled_fused_fwd.cache_info().currsize]))
"""


def test_preload_kernels_loads_every_configuration_of_a_dtype_from_the_index(precompiled, tmp_path):
    env = {"TILELANG_CACHE_DIR": str(SHARED_CACHE), cache.PREBUILT_ENV: "off"}
    (reason, bwd_local, fused), _ = _finish(_start(PRELOAD, env=env, workdir=tmp_path))
    bwd_local_builds = sum(builder is launch.compiled_chunk_bwd_local for builder, _ in launch.kernel_configs((DTYPE,)))
    assert reason is None and bwd_local == bwd_local_builds == len(launch.PAIR_SUMS)
    # each V tile's plain and keep_states builds, and the scores build at V tile 32
    assert launch.SCORES_BLOCK_V in launch.BLOCK_V_CHOICES and fused == 2 * len(launch.BLOCK_V_CHOICES) + 1


STALE_INDEX = SMALL_KERNEL + """
import gzip, json
first = compile_small()
# this kernel's record (records of add_one from earlier kernel sources stay behind under other keys)
key = cache.index_key("add_one", {"target": TARGET})
[record_path] = cache.tilelang_cache_dir().glob(f"*/*/{cache.INDEX_DIR}/{key}.json.gz")
record = json.loads(gzip.decompress(record_path.read_bytes()))
record_path.write_bytes(gzip.compress(json.dumps({**record, "entry": "0" * 64}).encode()))
second = compile_small()
rewritten = json.loads(gzip.decompress(record_path.read_bytes()))["entry"]
print(json.dumps([first.name, second.name, rewritten]))
"""


def test_an_index_record_naming_a_missing_entry_falls_back_and_is_rewritten(tmp_path):
    env = {"TILELANG_CACHE_DIR": str(SHARED_CACHE), cache.PREBUILT_ENV: "off"}
    (first, second, rewritten), _ = _finish(_start(STALE_INDEX, env=env, workdir=tmp_path))
    assert first == second == rewritten


def test_racing_processes_seed_an_empty_cache_from_prebuilt_kernels_and_load_them(precompiled, tmp_path):
    """Ranks that start at once copy the prebuilt kernels into one fresh TileLang cache, then load them."""
    _, results = precompiled
    env = {"TILELANG_CACHE_DIR": str(tmp_path / "cache"), cache.PREBUILT_ENV: str(SHARED_CACHE)}
    racers = [_start(LOAD, DTYPE, env=env, workdir=tmp_path) for _ in range(RACERS)]
    outputs = [_finish(racer) for racer in racers]
    for loaded, stderr in outputs:
        assert "JIT-compiled" not in stderr
        assert {k: v[0] for k, v in loaded.items()} == {r.kernel: str(cache.relative_entry(r.entry)) for r in results}
    copied = set(cache.entries(tmp_path / "cache"))
    assert copied == set(cache.entries(SHARED_CACHE))
    index = f"*/*/{cache.INDEX_DIR}/*.json.gz"
    assert {p.name for p in (tmp_path / "cache").glob(index)} >= {p.name for p in SHARED_CACHE.glob(index)}
    assert sum("copied" in stderr for _, stderr in outputs) >= 1
    assert _staged_leftovers(tmp_path / "cache") == []


def test_racing_processes_compiling_one_kernel_into_an_empty_cache_publish_one_loadable_entry(tmp_path):
    """RACERS processes compile the same kernel at the same moment into one fresh cache (TileLang stages
    every entry and publishes it with one rename): one complete entry, nothing half-written, and it loads."""
    flags, fresh = tmp_path / "flags", tmp_path / "cache"
    flags.mkdir()
    env = {"TILELANG_CACHE_DIR": str(fresh), cache.PREBUILT_ENV: "off"}
    racers = [_start(COMPILE_ON_GO, flags, i, env=env, workdir=tmp_path) for i in range(RACERS)]
    deadline = time.monotonic() + 120
    while len(list(flags.glob("ready-*"))) < RACERS and time.monotonic() < deadline:
        if any(racer.poll() is not None for racer in racers):
            break
        time.sleep(0.1)
    (flags / "go").touch()
    start = time.perf_counter()
    outputs = [_finish(racer) for racer in racers]
    published = {entry for entry, _ in outputs}
    print(f"\n{RACERS} processes compiling one kernel at once: {time.perf_counter() - start:.1f} s, "
          f"{sum('JIT-compiled' in stderr for _, stderr in outputs)} compiled it")
    assert len(published) == 1
    assert [str(p) for p in cache.entries(fresh)] == list(published)
    assert [p.name for p in fresh.glob("*/*/kernels/*")] == [Path(next(iter(published))).name]
    assert len(list(fresh.glob("*/cuda-binaries/*"))) == 1
    assert _staged_leftovers(fresh) == []
    # a racer that compiled says so once, naming why no prebuilt kernel served it
    reason = "JIT-compiled add_one in"
    assert all(stderr.count(reason) <= 1 for _, stderr in outputs)
    compiled = [stderr for _, stderr in outputs if reason in stderr]
    assert len(compiled) >= 2, "the racers did not race: one compiled, the others loaded its entry"
    assert all(f"{cache.PREBUILT_ENV} turns the prebuilt kernels off" in stderr for stderr in compiled)
    assert _finish(_start(LOAD_SMALL, env=env, workdir=tmp_path))[0] == published.pop()


def test_cli_reports_every_kernel_of_an_already_filled_cache_as_cached(precompiled, capsys):
    assert cli_main(["precompile", "--cache-dir", str(SHARED_CACHE), "--dtypes", "bf16", "--jobs", "1",
                     "--heads", "16:32,8:16", "--no-progress"]) == 0
    lines = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
    assert {line[0] for line in lines} == EXPECTED
    assert {line[1] for line in lines} == {"cached"}


@pytest.mark.parametrize("argv,message", [
    (["--dtypes", "int8"], "dtypes"),
    (["--dtypes", ""], "dtypes"),
    (["--jobs", "0"], "jobs"),
    (["--heads", "16:30"], "heads"),
    (["--heads", "sixteen"], "heads"),
])
def test_cli_rejects_bad_arguments_naming_them(argv, message, capsys):
    assert cli_main(["precompile", "--cache-dir", "/nonexistent/never-written", *argv]) == 1
    assert message in capsys.readouterr().err
    assert not Path("/nonexistent/never-written").exists()


def test_a_cache_that_cannot_be_written_is_a_reason_not_an_error(tmp_path):
    prebuilt = tmp_path / "prebuilt" / "0.1.15" / "linux-x86_64" / "kernels" / "k"
    prebuilt.mkdir(parents=True)
    (prebuilt / "a.so").write_bytes(b"x")
    (prebuilt / "manifest.json").write_text(json.dumps({"files": {"a.so": {}}}))
    blocked = tmp_path / "file_not_dir"
    blocked.write_text("")
    reason = cache._seed_once(tmp_path / "prebuilt", blocked)
    assert "could not be copied" in reason and str(blocked) in reason
    assert "no prebuilt kernels" in cache._seed_once(tmp_path / "empty", tmp_path / "c")
    assert cache.PREBUILT_ENV in cache._seed_once(None, tmp_path / "c")


def test_prebuilt_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.PREBUILT_ENV, raising=False)
    assert cache.prebuilt_dir() == cache.PACKAGED_PREBUILT
    assert cache.PACKAGED_PREBUILT.parent == Path(launch.__file__).resolve().parents[1]
    monkeypatch.setenv(cache.PREBUILT_ENV, "off")
    assert cache.prebuilt_dir() is None
    monkeypatch.setenv(cache.PREBUILT_ENV, str(tmp_path))
    assert cache.prebuilt_dir() == tmp_path


def test_a_jit_compile_names_why_no_prebuilt_kernel_served_it(tmp_path):
    def entry(root, namespace, key):
        path = root / namespace / "kernels" / key
        path.mkdir(parents=True)
        (path / MANIFEST).write_text(json.dumps({"files": {}}))
        return path

    prebuilt = tmp_path / "prebuilt"
    entry(prebuilt, "0.1.14/linux-x86_64", "a")
    compiled = entry(tmp_path / "cache", "0.1.15/linux-x86_64", "b")
    assert "built for 0.1.14/linux-x86_64" in cache._why_compiled(prebuilt, None, compiled)
    entry(prebuilt, "0.1.15/linux-x86_64", "c")
    assert "do not include this configuration" in cache._why_compiled(prebuilt, None, compiled)
    assert "disabled" in cache._why_compiled(prebuilt, None, None)
    assert cache._why_compiled(None, "the reason", compiled) == "the reason"
