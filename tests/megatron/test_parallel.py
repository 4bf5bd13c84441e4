"""Tensor and context parallel layouts and resharded checkpoints equal the single-rank module.

The single-rank references run in this process (conftest.py); every layout runs in one 2-rank gloo
group (mcore_worker.py), whose ranks compare their share of outputs and gradients with the reference
(relative error < 1e-5, fp32) and report per scenario."""
import pytest

pytestmark = pytest.mark.multiprocess


def assert_passed(results, scenario):
    failures = results[scenario]
    assert not failures, "\n".join(failures)


def test_tensor_parallel_2_equals_tp_1_outputs_and_grads(two_rank_results):
    assert_passed(two_rank_results, "tp2")


def test_head_all_to_all_context_parallel_2_equals_cp_1_padded_and_packed(two_rank_results):
    assert_passed(two_rank_results, "cp2_head_a2a")


def test_state_passing_context_parallel_2_equals_cp_1_padded_and_packed_outputs_and_all_grads(two_rank_results):
    assert_passed(two_rank_results, "cp2_state_passing")


def test_state_passing_runs_3_value_heads_at_cp_2_which_head_all_to_all_refuses(two_rank_results):
    assert_passed(two_rank_results, "cp2_state_passing_odd_heads")


def test_state_passing_builds_one_cp_context_per_batch_layout_shared_by_all_layers(two_rank_results):
    assert_passed(two_rank_results, "contexts_shared")


def test_checkpoint_saved_at_tp_1_loads_at_tp_2(two_rank_results):
    assert_passed(two_rank_results, "load_tp2")


def test_launcher_slices_a_row_over_the_cp_group_only(two_rank_results):
    assert_passed(two_rank_results, "batch_slicing")
