"""Megatron-Core GPT / hybrid pretraining with a switch for the GDN implementation.

    torchrun --nproc-per-node 8 -m flashqla.megatron.pretrain_gpt <Megatron's GPT arguments> \
        --linear-attention-impl flashqla

An existing Qwen3-Next command line (`--experimental-attention-variant gated_delta_net
--linear-attention-freq 4 ...`, or `--hybrid-layer-pattern` with `G` layers) runs unchanged with
`--linear-attention-impl fla` (Megatron's own GDN on FLA, the default) and switches every GDN layer
to flashqla with `--linear-attention-impl flashqla`. The megatron-core wheel ships no
pretrain_gpt.py, so this module also supplies the data and loss side of a GPT run: Megatron's
GPT datasets (`--data-path`, or `--mock-data`), next-token loss with the loss mask, CP slicing.
"""
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_batch_on_this_cp_rank

from flashqla.megatron.config import StatePassingTransformerConfig
from flashqla.megatron.gdn import CP_MODES
from flashqla.megatron.specs import (
    get_flashqla_gpt_block_spec,
    get_flashqla_hybrid_stack_spec,
    get_megatron_gdn_local_block_spec,
)

LINEAR_ATTENTION_IMPLS = ("fla", "flashqla")


def add_flashqla_args(parser):
    """`extra_args_provider` for Megatron's `parse_and_validate_args`."""
    group = parser.add_argument_group("flashqla")
    group.add_argument(
        "--linear-attention-impl", choices=LINEAR_ATTENTION_IMPLS, default="fla",
        help="GDN layers: Megatron's own module on FLA kernels ('fla'), or flashqla's subclass ('flashqla').",
    )
    group.add_argument(
        "--flashqla-kernel-backend", choices=("auto", "torch", "tilelang"), default="auto",
        help="flashqla kernel backend: TileLang on SM90 when available ('auto'), or forced.",
    )
    group.add_argument(
        "--flashqla-cp-mode", choices=CP_MODES, default="head_a2a",
        help="GDN context parallelism: Megatron's head all-to-all, or flashqla's state passing.",
    )
    return parser


def model_config_from_args(args):
    """Megatron's GPT (or, with --hybrid-layer-pattern, hybrid) model config; with
    --linear-attention-impl flashqla its layer spec puts flashqla's GDN in every GDN layer, and with
    --flashqla-cp-mode state_passing its TransformerConfig checks the GDN head counts against TP
    only (StatePassingTransformerConfig: CP no longer splits heads)."""
    from megatron.training.argument_utils import (
        core_transformer_config_from_args,
        gpt_config_from_args,
        hybrid_config_from_args,
    )

    hybrid = args.hybrid_layer_pattern is not None
    flashqla_impl = args.linear_attention_impl == "flashqla"
    if flashqla_impl and args.spec is not None:
        raise ValueError("--spec and --linear-attention-impl flashqla both choose the layer spec; pass one")
    transformer = None
    if flashqla_impl and args.flashqla_cp_mode == "state_passing":  # GDN heads need to split over TP only
        transformer = core_transformer_config_from_args(args, config_class=StatePassingTransformerConfig)
    model_config = (hybrid_config_from_args if hybrid else gpt_config_from_args)(args, config=transformer)
    if not flashqla_impl:
        if not hybrid and args.spec is None and args.transformer_impl == "local" \
                and args.experimental_attention_variant == "gated_delta_net":
            # Megatron's stock GDN block spec needs Transformer Engine; without it, the same local
            # block as flashqla's with Megatron's own GDN module
            model_config.transformer_layer_spec = megatron_gdn_local_layer_spec
        return model_config
    gdn_params = {"kernel_backend": args.flashqla_kernel_backend, "cp_mode": args.flashqla_cp_mode}
    if hybrid:
        model_config.hybrid_stack_spec = get_flashqla_hybrid_stack_spec(**gdn_params)
    else:
        model_config.transformer_layer_spec = flashqla_gpt_layer_spec(gdn_params)
    return model_config


def megatron_gdn_local_layer_spec(model_config, vp_stage=None):
    return get_megatron_gdn_local_block_spec(model_config.transformer, vp_stage=vp_stage)


def flashqla_gpt_layer_spec(gdn_params):
    """The spec callable GPTModelBuilder calls as fn(model_config, vp_stage=...)."""

    def spec(model_config, vp_stage=None):
        return get_flashqla_gpt_block_spec(model_config.transformer, vp_stage=vp_stage, **gdn_params)

    return spec


def get_batch(data_iterator):
    """Next micro-batch (tokens, labels, loss_mask, attention_mask, position_ids), this CP rank's part."""
    batch = next(data_iterator)
    batch = {name: value.to(torch.cuda.current_device()) if torch.is_tensor(value) else value for name, value in batch.items()}
    # the CP group explicitly: megatron-core 0.19 falls back to the default (world) group, which slices
    # the sequence over every rank as soon as TP or DP > 1
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def loss_func(loss_mask, output_tensor):
    """Masked token loss summed over this rank's tokens, with the token count (Megatron's 3-tuple)."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: run the model with labels (per-token losses come back)."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def gpt_dataset_config(args, tokenizer) -> GPTDatasetConfig:
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (mock with --mock-data), built on every rank."""
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, lambda: True, gpt_dataset_config(args, get_tokenizer())
    ).build()


train_valid_test_datasets_provider.is_distributed = True  # every rank builds its own loaders


def main():
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_flashqla_args)
    config_container = pretrain_cfg_container_from_args(args, model_config_from_args(args))
    pretrain(config_container, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
