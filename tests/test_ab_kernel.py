"""scripts/ab_kernel.py on the CPU, with the kernel emulators standing in for compiled kernels: it finds the
launch the public op makes, compares a variant's outputs with the committed kernel's, and flags a variant
that writes different values or leaves memory unwritten (timing needs the H200)."""
import os
import sys

import pytest
import torch

import kernel_emulator
from gdn_inputs import make_inputs, random_cu_seqlens

pytest.importorskip("tilelang")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import ab_kernel  # noqa: E402

CONFIGS = [(2, 4, [100, 29]), (1, 2, [64])]


def cpu_inputs(Hqk, Hv, lengths):
    args = make_inputs(1, sum(lengths), Hqk, Hv, 128, 128, dtype=torch.bfloat16, num_seqs=len(lengths),
                       strong_heads=(Hv - 1,), seed=3, requires_grad=False)
    return args["q"], args["k"], args["v"], args["g"], args["beta"], random_cu_seqlens(lengths)


@pytest.fixture
def emulated(monkeypatch):
    kernel_emulator.install(monkeypatch)
    from flashqla.ops import backends

    monkeypatch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)  # "tilelang" on the CPU


def test_parse_build_args_and_configs():
    assert ab_kernel.parse_build_args(["bfloat16", "False", "128", "True"]) == ("bfloat16", False, 128, True)
    assert ab_kernel.parse_config("16:64:8192x4") == (16, 64, [8192] * 4)


def test_the_committed_kernel_against_itself_agrees_exactly(emulated):
    same = kernel_emulator.emulate_wy_inverse
    rows = ab_kernel.ab("wy_inverse", ("bfloat16", False, True), {"same": same}, CONFIGS, cpu_inputs, log=lambda line: None)
    assert [row["variant"] for row in rows] == ["same"] * len(CONFIGS)
    for row in rows:
        # beta's fp32 copy (2), GA (6) and gcum (7) are what it writes
        assert sorted(row["outputs"]) == [2, 6, 7]
        assert all(err == 0 and unwritten == 0 for err, unwritten in row["outputs"].values()), row


def test_a_wrong_variant_shows_in_values_and_unwritten_rows(emulated):
    def off_by_a_percent(*args):
        kernel_emulator.emulate_wy_inverse(*args)
        args[6].mul_(1.01)  # GA

    def leaves_the_last_rows(*args):
        kernel_emulator.emulate_wy_inverse(*args)
        args[7][:, -5:] = float("nan")  # gcum's last tokens unwritten, as a kernel that skipped them

    # both variants on one recorded launch, each on its own NaN-filled copy of the arguments
    wrong, unwritten = (row["outputs"] for row in ab_kernel.ab(
        "wy_inverse", ("bfloat16", False, True), {"wrong": off_by_a_percent, "unwritten": leaves_the_last_rows},
        CONFIGS[:1], cpu_inputs, log=lambda line: None))
    assert 5e-3 < wrong[6][0] < 2e-2 and wrong[6][1] == 0 and wrong[7] == wrong[2] == (0.0, 0)
    assert unwritten[7][1] == 4 * 5 and unwritten[6] == unwritten[2] == (0.0, 0)


def test_a_launch_the_call_never_makes_is_an_error(emulated):
    with pytest.raises(RuntimeError, match="no launch"):
        ab_kernel.record_launch("chunk_states", ("bfloat16", 128), lambda: ab_kernel.public_op_step(
            cpu_inputs(2, 4, [64]), "off"))


def test_a_missing_launch_with_intra_cp_off_points_at_intra_cp(emulated):
    # the summary walks (chunk_states) run only under intra-card CP, which ab_kernel's default leaves off
    with pytest.raises(RuntimeError, match="try --intra-cp auto"):
        ab_kernel.ab("chunk_states", ("bfloat16", 128), {}, [(2, 4, [64])], cpu_inputs, log=lambda line: None)


def test_timed_runs_do_not_hide_the_outputs_from_the_comparison(emulated, monkeypatch):
    # on a GPU every kernel is timed on the recorded arguments themselves; the comparison must still see
    # what the committed kernel writes (a timer that runs each kernel once stands in for CUDA graphs)
    monkeypatch.setattr(ab_kernel.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab_kernel, "graph_time_us", lambda fn, reps=20: (fn(), 1.0)[1])
    same = kernel_emulator.emulate_wy_inverse
    rows = ab_kernel.ab("wy_inverse", ("bfloat16", False, True), {"first": same, "second": same}, CONFIGS[:1], cpu_inputs,
                        log=lambda line: None)
    for row in rows:
        assert sorted(row["outputs"]) == [2, 6, 7], row
        assert row["committed_us"] == row["variant_us"] == 1.0


def test_variants_build_with_their_module_pass_configs_plus_those_named_in_the_environment(monkeypatch):
    import tilelang

    built = {}
    monkeypatch.setattr(ab_kernel, "load_builder", lambda path, builder: lambda *args: (path, builder, args))
    monkeypatch.setattr(tilelang, "compile", lambda func, target, pass_configs: built.update(
        func=func, target=target, pass_configs=pass_configs) or "kernel")
    monkeypatch.delenv("AB_PASS_CONFIGS", raising=False)
    assert ab_kernel.compile_variant("variant.py", "build_x", ("bfloat16",)) == "kernel"
    assert built["func"] == ("variant.py", "build_x", ("bfloat16",))
    assert built["pass_configs"] == {"tl.enable_fast_math": True}
    monkeypatch.setenv("AB_PASS_CONFIGS", '{"tl.disable_thread_storage_sync": true}')
    ab_kernel.compile_variant("variant.py", "build_x", ("bfloat16",))
    assert built["pass_configs"] == {"tl.enable_fast_math": True, "tl.disable_thread_storage_sync": True}
    # a variant of a kernel module with its own pass configs is built with them, as the committed kernel is
    # (segment_chain places its barriers by hand: with the storage-sync pass on, an A/B compares other builds)
    monkeypatch.delenv("AB_PASS_CONFIGS")
    ab_kernel.compile_variant("sc_variant.py", "build_segment_chain", (8,))
    assert built["pass_configs"] == {"tl.enable_fast_math": True, "tl.disable_thread_storage_sync": True}


def test_variant_args_build_the_variant_differently_from_the_recorded_launch(monkeypatch):
    # a previous kernel whose builder lacks a later build argument: the launch is still recorded with the
    # committed builder's arguments, only the variant is built with --variant-args
    built, recorded = [], {}
    monkeypatch.setattr(ab_kernel, "compile_variant", lambda path, builder, args: built.append(args) or path)
    monkeypatch.setattr(ab_kernel, "ab", lambda kernel, build_args, variants, *rest, **kw: recorded.update(
        kernel=kernel, build_args=build_args, variants=sorted(variants)))
    ab_kernel.main(["run", "chunk_bwd_local", "old.py,older.py", "build_chunk_bwd_local", "bfloat16", "132",
                    "--variant-args", "bfloat16", "--configs", "2:4:64x1"])
    assert built == [("bfloat16",), ("bfloat16",)]
    assert recorded == {"kernel": "chunk_bwd_local", "build_args": ("bfloat16", 132),
                        "variants": ["old.py", "older.py"]}
    built.clear()
    ab_kernel.main(["run", "wy_inverse", "old.py", "build_wy_inverse", "bfloat16", "--variant-args", "bfloat16,False"])
    assert built == [("bfloat16", False)]
    built.clear()
    ab_kernel.main(["run", "chunk_bwd_local", "same.py", "build_chunk_bwd_local", "bfloat16", "--configs", "2:4:64x1"])
    assert built == [("bfloat16",)]


def test_variant_takes_passes_the_first_runtime_arguments(monkeypatch):
    calls = []
    monkeypatch.setattr(ab_kernel, "compile_variant", lambda path, builder, args: lambda *a: calls.append(a))
    monkeypatch.setattr(ab_kernel, "ab", lambda kernel, build_args, variants, *rest, **kw: variants["old.py"](1, 2, 3))
    ab_kernel.main(["run", "chunk_bwd_local", "old.py", "build_chunk_bwd_local", "bfloat16", "--variant-takes", "2"])
    ab_kernel.main(["run", "chunk_bwd_local", "old.py", "build_chunk_bwd_local", "bfloat16"])
    assert calls == [(1, 2), (1, 2, 3)]


def test_a_variant_lacking_the_last_runtime_argument_compares_on_the_others(emulated, monkeypatch):
    # the committed wy_inverse against "a previous version" that lacks its last runtime argument and takes the
    # rest: first_arguments gives it the recorded launch's others, and it agrees exactly
    seen = {}
    real_record = ab_kernel.record_launch

    def previous(*args):
        seen["count"] = len(args)
        kernel_emulator.emulate_wy_inverse(*args, seen["last"])

    def record(kernel, build_args, run, index=0):
        committed, args = real_record(kernel, build_args, run, index)
        seen.update(last=args[-1], total=len(args))
        return committed, args

    monkeypatch.setattr(ab_kernel, "record_launch", record)
    rows = ab_kernel.ab("wy_inverse", ("bfloat16", False, True), {"previous": ab_kernel.first_arguments(previous, -1)},
                        CONFIGS[:1], cpu_inputs, log=lambda line: None)
    assert seen["count"] == seen["total"] - 1
    assert all(err == 0 and unwritten == 0 for err, unwritten in rows[0]["outputs"].values()), rows


def test_variant_last_arg_replaces_the_last_runtime_argument(monkeypatch):
    calls = []
    monkeypatch.setattr(ab_kernel, "compile_variant", lambda path, builder, args: lambda *a: calls.append(a))
    monkeypatch.setattr(ab_kernel, "ab", lambda kernel, build_args, variants, *rest, **kw: variants["same.py"](1, 2, 3))
    ab_kernel.main(["run", "wy_inverse", "same.py", "build_wy_inverse", "bfloat16", "--variant-last-arg", "4"])
    assert calls == [(1, 2, 4)]


def test_a_hung_variant_ends_the_process_with_its_traceback(tmp_path):
    # a kernel spinning on an mbarrier never returns; the watchdog must end the run and name where it waited,
    # instead of leaving the device call to time out with nothing written (a sleep stands in for the kernel)
    script = tmp_path / "hang.py"
    script.write_text(f"""
import sys, time
sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.join(os.path.dirname(__file__), "..", "scripts")!r}]
import pytest, kernel_emulator, ab_kernel
from test_ab_kernel import cpu_inputs
patch = pytest.MonkeyPatch()
kernel_emulator.install(patch)
from flashqla.ops import backends
patch.setattr(backends, "tilelang_unsupported_reason", lambda call: None)
def variant_that_never_returns(*args):
    time.sleep(300)
ab_kernel.ab("wy_inverse", ("bfloat16", False, True), {{"hung": variant_that_never_returns}}, [(1, 2, [64])], cpu_inputs,
             log=lambda line: print(line, flush=True), hang_seconds=10)
print("returned")
""")
    import subprocess
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60
    assert done.returncode != 0 and "returned" not in done.stdout
    assert "(1, 2) 64 x 1: starting" in done.stdout
    assert "Timeout" in done.stderr and "variant_that_never_returns" in done.stderr, done.stderr[-2000:]


def test_a_later_launch_is_recorded_by_its_index(emulated, monkeypatch):
    # fused_fwd's plain build runs twice in one fwd+bwd: the forward (store_states 0), then the backward's state
    # recompute (1); the forward of one sequence of (2, 4) at V tile 32 would take the scores build
    from flashqla.kernels.hopper import launch

    monkeypatch.setenv(launch.SCORES_ENV, "0")
    block_v = launch.block_v_on(torch.device("cpu"), 1, 4)
    step = lambda: ab_kernel.public_op_step(cpu_inputs(2, 4, [100]), "off")  # noqa: E731
    store_states = [ab_kernel.record_launch("fused_fwd", ("bfloat16", block_v), step, index)[1][-1]
                    for index in (0, 1)]
    assert store_states == [0, 1]
    with pytest.raises(RuntimeError, match="number 2 in this call \\(2 launches\\)"):
        ab_kernel.record_launch("fused_fwd", ("bfloat16", block_v), step, 2)
