"""The launcher's pieces on a tiny GPT with GDN layers: `--linear-attention-impl flashqla` puts
flashqla's GDN in every GDN layer, and the model trains on the launcher's data and loss (CPU, local spec).

Megatron's `pretrain()` itself allocates CUDA tensors, so on CPU the test drives the same
forward_step / loss / dataset provider with a plain Adam loop."""
import sys

import pytest
import torch

import mcore_harness as h
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.training.arguments import parse_and_validate_args
from megatron.training.global_vars import destroy_global_vars
from megatron.training.models.gpt import GPTModelBuilder

from flashqla.megatron import GatedDeltaNet
from flashqla.megatron.pretrain_gpt import add_flashqla_args, forward_step, model_config_from_args, train_valid_test_datasets_provider

TINY_QWEN3_NEXT = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 "
    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 "
    "--experimental-attention-variant gated_delta_net --linear-attention-freq 2 "
    "--linear-conv-kernel-dim 4 --linear-key-head-dim 16 --linear-value-head-dim 16 "
    "--linear-num-key-heads 2 --linear-num-value-heads 4 "
    "--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope "
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 3e-3 --train-iters 30 --seed 7"
).split()


@pytest.fixture
def launcher_args(monkeypatch):
    def parse(*extra):
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt", *TINY_QWEN3_NEXT, *extra])
        destroy_global_vars()
        destroy_num_microbatches_calculator()
        return parse_and_validate_args(extra_args_provider=add_flashqla_args)

    h.init_parallel(tp=1, cp=1, seed=7)
    yield parse
    destroy_global_vars()
    destroy_num_microbatches_calculator()


def build_model(args):
    model = GPTModelBuilder(model_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    return model


def gdn_modules(model):
    return [m for m in model.modules() if isinstance(m, MegatronGatedDeltaNet)]


def test_flag_puts_flashqla_gdn_in_every_gdn_layer(launcher_args):
    args = launcher_args("--linear-attention-impl", "flashqla", "--flashqla-kernel-backend", "torch")
    model = build_model(args)
    gdns = gdn_modules(model)
    assert len(gdns) == 2  # linear-attention-freq 2: layers 1 and 3 are GDN, 2 and 4 softmax attention
    assert all(type(m) is GatedDeltaNet and m.kernel_backend == "torch" for m in gdns)


def test_spec_and_flashqla_impl_together_are_rejected(launcher_args):
    args = launcher_args("--linear-attention-impl", "flashqla", "--spec", "some.module", "spec_fn")
    with pytest.raises(ValueError, match="--spec"):
        model_config_from_args(args)


def test_tiny_gdn_gpt_trains_with_flashqla_and_its_loss_falls(launcher_args):
    args = launcher_args("--linear-attention-impl", "flashqla", "--flashqla-kernel-backend", "torch")
    model = build_model(args)
    train_set, _, _ = train_valid_test_datasets_provider([4, 0, 0])
    batches = [
        {name: torch.stack([train_set[i][name], train_set[i + 1][name]]) for name in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")}
        for i in (0, 2)
    ]
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.train_iters):
        output, loss_fn = forward_step(iter([batches[step % 2]]), model)
        loss_sum, num_tokens, report = loss_fn(output)
        loss = loss_sum / num_tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert torch.isfinite(torch.tensor(losses)).all()
    for gdn in gdn_modules(model):  # the GDN layers take part in training
        assert gdn.A_log.grad.abs().sum() > 0 and gdn.in_proj.weight.grad.abs().sum() > 0
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.7 * first, losses
