"""Every TileLang kernel configuration dispatch can choose lowers and compiles for sm_90a with nvcc.

No GPU needed: a kernel that fails to lower or assemble fails here, on the CPU CI machine. Skips when
tilelang or nvcc is not installed. Set TILELANG_CACHE_DIR to reuse the compiled kernels on a GPU.
"""
import importlib
import os
import shutil
import sys

import pytest

tilelang = pytest.importorskip("tilelang")
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")

from flashqla.kernels.hopper import launch  # noqa: E402
from parallel_compile import compile_all, spawned_pool  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
from bank_conflicts import describe, excess_fraction, shared_accesses  # noqa: E402
from kernel_resources import (barrier_hazards, barriers_in_unrolled_loops, dynamic_divisions_in_loops,  # noqa: E402
                              occupancy, wgmma_serialisation)

CONFIGS = list(launch.kernel_configs())

# Shared-memory bank conflicts a kernel is allowed (excess wavefronts over all, per CTA, scripts/bank_conflicts.py):
# none, except wy_inverse's 2-way accesses of its fp32 tiles in the layouts its TF32 products impose (the K K^T
# accumulator stored once per CTA, X's quadrants stored from and read as the products' operands: 9.4% in the shared-K
# build, 11.7% with one v-head; 17.4% before K K^T was kept whole and GA read conflict-free, 2026-12-07) and
# segment_chain's partial tiles at V tile 16 (a thread's 16 columns as four 16-byte stores, rows 64 bytes apart:
# 4-way, 11.5%; 2-way at V tile 8).
BANK_CONFLICTS_ALLOWED = {launch.compiled_wy_inverse: 0.12, launch.compiled_segment_chain: 0.12}

# The warp-specialised kernels, whose roles meet at named (partial) barriers. In any other kernel a partial barrier
# is one TileLang inserted where it could not bound an index: chunk_states' S* walks had two (a gate row index that
# could be -1), and racecheck found 4000 RAW hazards there (forty-sixth session).
NAMED_BARRIERS = {launch.compiled_fused_fwd, launch.compiled_chunk_dstates, launch.compiled_chunk_bwd_local}



def is_lean_walk(builder, args) -> bool:
    """The serial walks whose one loader warp sets the pace at narrow V tiles: no integer division by a dynamic
    size may be left in their loops (chunk_dstates keeps its k-head expression at V tile 128, where the variable
    measured 3.5% slower; docs/kernels.md, "Fifty-fourth session")."""
    return builder in (launch.compiled_fused_fwd, launch.compiled_chunk_states) or (
        builder is launch.compiled_chunk_dstates and args[1] < 128)


@pytest.fixture(scope="module")
def compiled_in_parallel():
    """Every configuration lowered and compiled once, one process per CPU; the tests below load them."""
    compile_all(CONFIGS)


@pytest.mark.parametrize("builder,args", CONFIGS, ids=[f"{b.__name__}{a}" for b, a in CONFIGS])
def test_kernel_compiles_for_sm90a(compiled_in_parallel, builder, args):
    kernel = builder(*args)
    source = kernel.get_kernel_source()
    if builder is launch.compiled_segment_chain:  # fp32 products: on tensor cores they would be TF32
        assert "mma" not in source, "the segment chain must stay in fp32 on CUDA cores"
        # its own barriers only: the mbarrier initialisation's, two before the chain, two a step (with the
        # storage-sync pass on, ten)
        assert source.count("__syncthreads()") == 5, "segment_chain must be built without the storage-sync pass"
    elif builder is launch.compiled_gqa_sum:  # a streaming sum: vectorised 16-byte loads of each row segment
        assert "uint4" in source or "float4" in source, "the GQA sums must load rows as 16-byte vectors"
    else:
        assert "wgmma" in source, "the tensor-core products must lower to Hopper WGMMA"
    if builder is launch.compiled_fused_fwd:
        assert_warp_specialised(source)
    if builder not in NAMED_BARRIERS:
        assert "__sync_thread_partial" not in source, "a partial barrier TileLang inserted: an index it cannot bound?"
    # a barrier some of the threads it waits for never reach hangs the kernel (or completes with another's arrivals)
    hazards = barrier_hazards(source)
    assert not hazards, hazards
    # no barrier in every step of an elementwise pass (TileLang's storage-sync pass puts one there when the pass
    # reads a per-row scale from shared memory: read it into registers first)
    in_loops = barriers_in_unrolled_loops(source)
    assert not in_loops, in_loops
    if is_lean_walk(builder, args):  # the k-head and the like from variables set once, not in every TMA box
        divisions = dynamic_divisions_in_loops(source)
        assert not divisions, divisions
    # a shared-memory access with more wavefronts than its bytes need (the forty-fourth session's 8-way V and O
    # tiles cost fused_fwd 15%)
    accesses = shared_accesses(source)
    conflicting = "\n".join(describe(r) for r in accesses if r.wavefronts > r.ideal)
    assert excess_fraction(accesses) <= BANK_CONFLICTS_ALLOWED.get(builder, 0.0), conflicting


def assert_warp_specialised(source):
    """fused_fwd's roles meet only at mbarriers and their own named barriers: a CTA-wide barrier inside a
    role's branch would wait for threads that never reach it, and an explicit named barrier sharing an id
    with one TileLang allocates for another role's branch (ids from 3 upwards) would join two roles."""
    import re

    from flashqla.kernels.hopper import fused_fwd

    assert source.count("__syncthreads()") == 1, "only the barrier after the mbarrier initialisation"
    assert "warpgroup_reg_alloc" in source and "tma_load" in source
    explicit = set(fused_fwd.CHAIN_BARRIERS) | {fused_fwd.OUTPUT_BARRIER}
    used = {int(i) for i in re.findall(r"__sync_thread_partial\((\d+),", source)}
    assert used & explicit, "the kernel's own named barriers are missing"
    assert max(used - explicit) < min(explicit), f"TileLang's named barriers {sorted(used - explicit)} reach ours"


# the kernels whose products stay in flight past other work (asynchronous WGMMA with wait_group n > 0 or
# across a loop's back edge), at the tiles dispatch takes
PIPELINED = [("fused_fwd", "build_fused_fwd", ("bfloat16", 32)), ("fused_fwd", "build_fused_fwd", ("bfloat16", 128)),
             ("fused_fwd", "build_fused_fwd", ("bfloat16", 128, True)),
             ("chunk_dstates", "build_chunk_dstates", ("bfloat16", 32)),
             ("chunk_dstates", "build_chunk_dstates", ("bfloat16", 128)),
             ("chunk_states", "build_chunk_states", ("bfloat16", 128)),
             ("chunk_bwd_local", "build_chunk_bwd_local", ("bfloat16", "none")),
             ("chunk_bwd_local", "build_chunk_bwd_local", ("bfloat16", "ordered"))]


def _serialisation_of(module, builder, args):
    """A spawned process: ptxas's wgmma-serialisation messages for one kernel, compiled afresh."""
    import tilelang

    tilelang.set_log_level("WARNING")
    return wgmma_serialisation(getattr(importlib.import_module(f"flashqla.kernels.hopper.{module}"), builder)(*args))


def _wy_inverse_occupancy(shared_k: bool):
    from flashqla.kernels.hopper.wy_inverse import build_wy_inverse

    return occupancy(build_wy_inverse("bfloat16", shared_k, True), "wy_inverse")


def test_wy_inverse_fits_the_ctas_per_sm_its_heads_rule_counts():
    """launch.wy_heads_per_cta sizes its waves at WY_INVERSE_CTAS_PER_SM: both builds must fit that many CTAs per SM
    by registers and shared memory, without spills (80 registers and 32.5-36 KiB: 6; the shared-K build held its
    K K^T accumulator across the v-head loop at 96 registers, 5, until 2026-12-07)."""
    with spawned_pool(2) as pool:
        found = dict(zip((False, True), pool.map(_wy_inverse_occupancy, (False, True))))
    for shared_k, usage in found.items():
        assert usage["ctas_per_sm"] >= launch.WY_INVERSE_CTAS_PER_SM and usage["spill_stores"] == 0, (shared_k, usage)


def test_ptxas_keeps_every_walk_pipelined():
    """ptxas serialises every wgmma of a kernel when it cannot prove that no other instruction touches an
    in-flight product's registers: a slower kernel and no error (docs/kernels.md, "Thirty-sixth session")."""
    with spawned_pool(len(PIPELINED)) as pool:
        messages = list(pool.map(_serialisation_of, *zip(*PIPELINED)))
    serialised = {f"{module}{args}": found for (module, _, args), found in zip(PIPELINED, messages) if found}
    assert not serialised, serialised


def _pipeline_across_the_back_edge(cross: bool):
    """Two products a step, the first one's accumulator read after wait_group 1 while the second runs; with
    `cross` the first product of the next step is issued at the end of this one, in flight across the loop's
    back edge (what ptxas cannot follow)."""
    import tilelang.language as T

    @T.prim_func
    def pipeline(A: T.Tensor((64, 64), "bfloat16"), B: T.Tensor((64, 64), "bfloat16"),
                 C: T.Tensor((64, 64), "float32"), steps: T.int32):
        with T.Kernel(1, threads=128):
            A_s = T.alloc_shared((64, 64), "bfloat16")
            B_s = T.alloc_shared((64, 64), "bfloat16")
            first = T.alloc_fragment((64, 64), "float32")
            second = T.alloc_fragment((64, 64), "float32")
            first_a = T.alloc_fragment((64, 64), "bfloat16")
            T.copy(A, A_s)
            T.copy(B, B_s)
            T.clear(second)
            if cross:
                T.wgmma_gemm(A_s, B_s, first, transpose_B=True, clear_accum=True)
            for i in T.serial(steps):
                if not cross:
                    T.wgmma_gemm(A_s, B_s, first, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(A_s, B_s, second, transpose_B=True)
                T.wait_wgmma(1)
                T.warpgroup_fence_operand(first, num_regs=32)
                T.copy(first, first_a)
                T.wgmma_gemm(first_a, B_s, second, transpose_B=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(second, num_regs=32)
                if cross:
                    if i + 1 < steps:
                        T.wgmma_gemm(A_s, B_s, first, transpose_B=True, clear_accum=True)
            T.copy(second, C)

    return pipeline


def test_serialisation_check_sees_a_product_in_flight_across_the_back_edge():
    """The check above can fail: the pattern found in a reverse-walk variant (the thirty-sixth session's
    `dstates_wu`) serialises, the same products issued within the step do not."""
    assert any("C7514" in line for line in wgmma_serialisation(_pipeline_across_the_back_edge(cross=True)))
    assert wgmma_serialisation(_pipeline_across_the_back_edge(cross=False)) == []


def test_segment_chain_tiles_fill_one_wave_then_widen():
    chosen = {launch.chain_block_v(chains, sm_count=132) for chains in (1, 8, 16, 24, 32, 64, 512)}
    assert chosen <= set(launch.CHAIN_BLOCK_V_CHOICES)
    assert launch.chain_block_v(4, sm_count=132) == 4  # one sequence of 4 v-heads: 4 x 32 tiles, one wave
    assert launch.chain_block_v(8, sm_count=132) == 8  # TP8, one sequence: 8 heads x 16 tiles, one wave
    # 8 up to three waves (a step at 16 costs 2-3x one at 8), then 16
    assert launch.chain_block_v(16, sm_count=132) == 8  # TP4, one sequence: 16 x 16 tiles, two waves
    assert launch.chain_block_v(24, sm_count=132) == 8  # 27B: 24 x 16 tiles, three waves
    assert launch.chain_block_v(32, sm_count=132) == 16  # h32: four waves at 8
    assert launch.chain_block_v(512, sm_count=132) == 16


@pytest.mark.parametrize("module,builder", [("fused_fwd", "build_fused_fwd"), ("chunk_dstates", "build_chunk_dstates")])
def test_walks_refuse_tiles_their_two_chain_warpgroups_cannot_split(module, builder):
    build = getattr(importlib.import_module(f"flashqla.kernels.hopper.{module}"), builder)
    for block_v in (16, 48):
        with pytest.raises(ValueError, match="block_v"):
            build("bfloat16", block_v)


def test_segment_chain_refuses_tilings_that_do_not_fit_one_cta():
    """16 columns with 8 k groups need more shared memory than an SM90 CTA gets (the kernel would build, then
    fail at launch); tilings that leave threads without whole output items are refused too."""
    from flashqla.kernels.hopper.segment_chain import build_segment_chain

    with pytest.raises(ValueError, match="shared memory"):
        build_segment_chain(16, rows_per_thread=8, k_groups=8)
    with pytest.raises(ValueError, match="tiling"):
        build_segment_chain(12)
    with pytest.raises(ValueError, match="output items"):
        build_segment_chain(8, rows_per_thread=1, k_groups=8)


def test_dispatch_only_chooses_compiled_tile_widths():
    chosen = {launch.block_v_for(n, hv, sm_count=132) for n in (1, 2, 4, 8, 64) for hv in (1, 8, 16, 24, 32, 64)}
    assert chosen <= set(launch.BLOCK_V_CHOICES)
    assert launch.block_v_for(1, 8, sm_count=132) == 32  # TP8 single sequence: as many CTAs as possible
    assert launch.block_v_for(8, 64, sm_count=132) == 128


def test_scale_and_sizes_are_runtime_arguments():
    from flashqla.kernels.hopper.fused_fwd import build_fused_fwd

    func = build_fused_fwd("bfloat16", 64)
    scalars = {p.name: str(p.dtype) for p in func.params if p not in func.buffer_map}
    assert scalars.get("scale") == "float32"
    buffers = {b.name: b for b in func.buffer_map.values()}
    tokens, heads, head_dim = buffers["q"].shape
    assert not isinstance(tokens, tilelang.tvm.tirx.IntImm) and not isinstance(heads, tilelang.tvm.tirx.IntImm)
    assert int(head_dim) == 128


def test_importing_the_kernels_package_does_not_import_tilelang_kernels():
    import subprocess
    import sys

    code = ("import sys, flashqla.kernels.hopper as h; "
            "assert 'flashqla.kernels.hopper.fused_fwd' not in sys.modules; "
            "assert 'tilelang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernel_submodules_do_not_shadow_the_host_api():
    """Importing a kernel module sets it as an attribute of the package: a host function of the same name
    (e.g. one named after its kernel) would turn into a module once the kernel is built in this process."""
    import importlib
    import pkgutil

    from flashqla.kernels import hopper

    before = {name: getattr(hopper, name) for name in hopper.__all__}
    for module in pkgutil.iter_modules(hopper.__path__):
        importlib.import_module(f"{hopper.__name__}.{module.name}")
    assert {name: getattr(hopper, name) for name in hopper.__all__} == before
