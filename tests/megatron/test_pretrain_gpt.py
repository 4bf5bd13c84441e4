"""The launcher's pieces on a tiny hybrid GPT (3 GDN layers, softmax attention every 4th):
`--linear-attention-impl flashqla` puts flashqla's GDN in every GDN layer, the model trains on the
launcher's data and loss and its loss falls, and at CP 2 with state passing it trains exactly as at
CP 1 (CPU, local spec).

Megatron's `pretrain()` itself allocates CUDA tensors, so on CPU the tests drive the launcher's
forward_step / loss / dataset provider with a plain Adam loop (gpt_harness.train)."""
import pytest
import torch

import gpt_harness
import mcore_harness as h
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.training.global_vars import destroy_global_vars

from flashqla.megatron import GatedDeltaNet
from flashqla.megatron.config import StatePassingTransformerConfig
from flashqla.megatron.pretrain_gpt import model_config_from_args


@pytest.fixture
def launcher_args():
    h.init_parallel(tp=1, cp=1, seed=7)
    yield gpt_harness.parse_args
    destroy_global_vars()
    destroy_num_microbatches_calculator()


def gdn_modules(model):
    return [m for m in model.modules() if isinstance(m, MegatronGatedDeltaNet)]


def test_flag_puts_flashqla_gdn_in_every_gdn_layer(launcher_args):
    args = launcher_args(*gpt_harness.FLASHQLA)
    model = gpt_harness.build_model(args)
    gdns = gdn_modules(model)
    assert len(gdns) == 3  # linear-attention-freq 4: layers 1-3 are GDN, layer 4 softmax attention
    assert all(type(m) is GatedDeltaNet and m.kernel_backend == "torch" and m.cp_mode == "head_a2a" for m in gdns)


def test_state_passing_flag_reaches_every_gdn_layer_and_relaxes_the_head_check(launcher_args):
    args = launcher_args(*gpt_harness.FLASHQLA, "--flashqla-cp-mode", "state_passing")
    model_config = model_config_from_args(args)
    assert type(model_config.transformer) is StatePassingTransformerConfig
    model = gpt_harness.build_model(args)
    assert [m.cp_mode for m in gdn_modules(model)] == ["state_passing"] * 3


def test_fla_impl_without_transformer_engine_gets_megatrons_gdn_in_the_same_local_block(launcher_args, monkeypatch):
    """`--linear-attention-impl fla` with the local spec (no TE on these machines, nor on the H200 image):
    Megatron's own GDN in every GDN layer, and the parameters and checkpoint keys of the flashqla model."""
    from megatron.core.ssm.gated_delta_net import common as mcore_gdn_common
    from megatron.core.ssm.gated_delta_net import gdn as mcore_gdn

    # FLA is not installed in this venv: stand in Megatron's torch kernel for FLA's
    monkeypatch.setattr(mcore_gdn_common, "HAVE_FLA", True)
    monkeypatch.setattr(mcore_gdn, "chunk_gated_delta_rule", mcore_gdn_common.torch_chunk_gated_delta_rule)
    fla_model = gpt_harness.build_model(launcher_args())
    gdns = gdn_modules(fla_model)
    assert len(gdns) == 3 and all(type(m) is MegatronGatedDeltaNet for m in gdns)
    flashqla_model = gpt_harness.build_model(launcher_args(*gpt_harness.FLASHQLA))
    shapes = lambda model: {n: p.shape for n, p in model.named_parameters()}  # noqa: E731
    assert shapes(fla_model) == shapes(flashqla_model)
    assert set(fla_model.sharded_state_dict()) == set(flashqla_model.sharded_state_dict())


def test_spec_and_flashqla_impl_together_are_rejected(launcher_args):
    args = launcher_args("--linear-attention-impl", "flashqla", "--spec", "some.module", "spec_fn")
    with pytest.raises(ValueError, match="--spec"):
        model_config_from_args(args)


def test_tiny_gdn_gpt_trains_with_flashqla_and_its_loss_falls(launcher_args):
    args = launcher_args(*gpt_harness.FLASHQLA)
    model = gpt_harness.build_model(args)
    losses = gpt_harness.train(model, args, args.train_iters)
    assert torch.isfinite(torch.tensor(losses)).all()
    for gdn in gdn_modules(model):  # the GDN layers take part in training
        assert gdn.A_log.grad.abs().sum() > 0 and gdn.in_proj.weight.grad.abs().sum() > 0
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.7 * first, losses


@pytest.mark.multiprocess
def test_tiny_hybrid_gpt_at_cp_2_with_state_passing_gives_the_cp_1_losses(two_rank_results):
    """6 Adam steps from the same weights on gloo: the CP 2 loss equals the CP 1 loss at every step
    (relative 1e-5)."""
    assert not two_rank_results["hybrid_gpt_cp2"], "\n".join(two_rank_results["hybrid_gpt_cp2"])
