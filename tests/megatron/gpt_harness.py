"""A tiny hybrid GPT (3 GDN layers, softmax attention every 4th layer) built by the launcher from
its command line, and a training loop that does what Megatron's `pretrain()` does per step on CPU.

Megatron's `pretrain()` allocates CUDA tensors, so the loop drives the launcher's own
`forward_step` (its data, CP slicing and loss) with a plain Adam step: the loss is the token-mean over
the whole CP group, and parameter gradients are summed over the data-parallel x CP group, as
Megatron's DDP reduces them. Under CP the softmax layers use GatheredKVAttention (Megatron's local
attention refuses CP > 1).
"""
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

import mcore_harness as h
from cp_attention import GatheredKVAttention
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.training.arguments import parse_and_validate_args
from megatron.training.global_vars import destroy_global_vars
from megatron.training.models.gpt import GPTModelBuilder

from flashqla.megatron.pretrain_gpt import add_flashqla_args, forward_step, model_config_from_args, train_valid_test_datasets_provider

TINY_HYBRID = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 "
    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 "
    "--experimental-attention-variant gated_delta_net --linear-attention-freq 4 "
    "--linear-conv-kernel-dim 4 --linear-key-head-dim 16 --linear-value-head-dim 16 "
    "--linear-num-key-heads 2 --linear-num-value-heads 4 "
    "--normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope "
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm "
    "--attention-dropout 0 --hidden-dropout 0 "  # deterministic: CP 1 and CP 2 runs compare step by step
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --lr 3e-3 --train-iters 30 --seed 7 "
    "--make-vocab-size-divisible-by 64"  # the padded vocabulary stays 128 at TP 2 (128 x TP by default)
).split()
FLASHQLA = ["--linear-attention-impl", "flashqla", "--flashqla-kernel-backend", "torch"]


def parse_args(*extra):
    """The launcher's arguments for TINY_HYBRID + extra (Megatron's global args are reset first)."""
    saved = sys.argv
    sys.argv = ["pretrain_gpt", *TINY_HYBRID, *extra]
    try:
        destroy_global_vars()
        destroy_num_microbatches_calculator()
        return parse_and_validate_args(extra_args_provider=add_flashqla_args)
    finally:
        sys.argv = saved


def _swap_core_attention(spec):
    """Copy of a spec tree with DotProductAttention replaced by GatheredKVAttention."""
    if spec is DotProductAttention:  # local specs name the core attention class directly
        return GatheredKVAttention
    if isinstance(spec, ModuleSpec):
        module = GatheredKVAttention if spec.module is DotProductAttention else spec.module
        return dataclasses.replace(spec, module=module, submodules=_swap_core_attention(spec.submodules))
    if isinstance(spec, list):
        return [_swap_core_attention(item) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _swap_core_attention(getattr(spec, f.name))
                                           for f in dataclasses.fields(spec) if f.init})
    return spec


def build_model(args):
    """The launcher's model for `args`; with CP > 1 its softmax layers attend over gathered K/V."""
    model_config = model_config_from_args(args)
    if args.context_parallel_size > 1:
        spec_fn = model_config.transformer_layer_spec
        model_config.transformer_layer_spec = lambda config, vp_stage=None: _swap_core_attention(spec_fn(config, vp_stage))
    return GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())


def batches(count: int = 2):
    """`count` micro-batches of 2 mock-data samples each (the launcher's dataset provider)."""
    train_set, _, _ = train_valid_test_datasets_provider([2 * count, 0, 0])
    names = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    return [{n: torch.stack([train_set[2 * i][n], train_set[2 * i + 1][n]]) for n in names} for i in range(count)]


def train(model, args, steps: int) -> list[float]:
    """Adam on the launcher's forward_step; returns the global token-mean loss of every step."""
    cp_group = parallel_state.get_context_parallel_group()
    grad_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    data = batches()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(steps):
        output, loss_fn = forward_step(iter([data[step % len(data)]]), model)
        loss_sum, num_tokens, _ = loss_fn(output)
        totals = torch.stack([loss_sum.detach(), num_tokens.to(loss_sum.dtype)])
        dist.all_reduce(totals, group=cp_group)
        optimizer.zero_grad()
        (loss_sum / totals[1]).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=grad_group)
        optimizer.step()
        losses.append((totals[0] / totals[1]).item())
    return losses


def train_tiny_hybrid(cp: int, state=None, steps: int = 6, tp: int = 1, checkpoint=None, save_to=None):
    """Train TINY_HYBRID with flashqla GDN (state-passing CP) from the parameters `state`, or the dist
    checkpoint `checkpoint` (any TP), or its own init; `save_to`: also save the initial parameters there as
    a dist checkpoint. Returns (losses, initial parameters)."""
    h.init_parallel(tp=tp, cp=cp, seed=7)
    args = parse_args(*FLASHQLA, "--flashqla-cp-mode", "state_passing", "--context-parallel-size", str(cp),
                      "--tensor-model-parallel-size", str(tp))
    model = build_model(args)
    if state is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(state[name])
    if checkpoint is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint)), strict=False)
    if save_to is not None:
        os.makedirs(save_to, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), str(save_to))
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    return train(model, args, steps), initial
