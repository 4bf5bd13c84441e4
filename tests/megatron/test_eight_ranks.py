"""Megatron at 8 ranks on gloo (CPU): the tiny hybrid GPT with flashqla's state-passing CP at TP 1 x CP 8
and TP 2 x CP 4 trains exactly as at CP 1 (issue #11's parallel layouts, on the CPU; the 8-GPU runs
need a device kind that is not lent)."""
import pytest
import torch

import gpt_harness
import mcore_harness as h
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.training.global_vars import destroy_global_vars


@pytest.fixture(scope="module")
def eight_rank_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("eight_ranks")
    try:
        losses, state = gpt_harness.train_tiny_hybrid(cp=1, steps=4, save_to=workdir / "hybrid_gpt_checkpoint")
    finally:
        destroy_global_vars()
        destroy_num_microbatches_calculator()
    torch.save({"state": state, "losses": losses}, workdir / "hybrid_gpt.pt")
    return h.run_ranks(["hybrid_gpt_tp1_cp8", "hybrid_gpt_tp2_cp4"], 8, workdir, timeout=600.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["hybrid_gpt_tp1_cp8", "hybrid_gpt_tp2_cp4"])
def test_tiny_hybrid_gpt_at_8_ranks_gives_the_cp_1_losses(eight_rank_results, scenario):
    """4 Adam steps from the same weights (a TP 1 dist checkpoint, resharded on load): every step's loss
    equals the CP 1 loss (relative 1e-5); at CP 8 every rank holds 8 of each 64-token row."""
    assert not eight_rank_results[scenario], "\n".join(eight_rank_results[scenario])
