"""Module specs that put flashqla's GatedDeltaNet into Megatron-Core models.

Swapping an implementation in Megatron is a spec change: every spec node whose module is Megatron's
GatedDeltaNet gets flashqla's subclass instead, everything else (TE layers around the core, norms,
MLPs, MoE, attention layers) stays as Megatron built it.

* `to_flashqla_spec(spec)`: the generic swap, for any spec tree (GPT block, hybrid stack, layer).
* `get_flashqla_gpt_block_spec(config, vp_stage, pp_rank)`: the GPT decoder block with GDN layers
  (`--experimental-attention-variant gated_delta_net`, `--linear-attention-freq`). With
  `transformer_impl="transformer_engine"` it is Megatron's own spec, swapped; with "local" it is
  built from Megatron-Core's non-TE modules (CPU tests, machines without TE).
* `get_flashqla_hybrid_stack_spec()`: Megatron's hybrid stack (pattern symbol `G`), swapped. Needs
  Transformer Engine to build (its final norm is always TENorm).
"""
import dataclasses
from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from flashqla.megatron.gdn import GatedDeltaNet


def to_flashqla_spec(spec, **gdn_params):
    """Copy of `spec` with Megatron's GatedDeltaNet replaced by flashqla's everywhere in the tree.

    `gdn_params` (`kernel_backend`, `cp_mode`) are added to the swapped nodes' params. The input is
    not modified (Megatron's stock specs are module-level objects shared by every caller).
    """
    if isinstance(spec, ModuleSpec):
        module = GatedDeltaNet if spec.module is MegatronGatedDeltaNet else spec.module
        params = {**spec.params, **gdn_params} if module is GatedDeltaNet else spec.params
        return dataclasses.replace(
            spec, module=module, params=params, submodules=to_flashqla_spec(spec.submodules, **gdn_params)
        )
    if isinstance(spec, list):
        return [to_flashqla_spec(item, **gdn_params) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {
            field.name: to_flashqla_spec(getattr(spec, field.name), **gdn_params)
            for field in dataclasses.fields(spec)
            if field.init
        }
        return dataclasses.replace(spec, **changes)
    return spec


def get_local_gdn_module_spec(config, **gdn_params) -> ModuleSpec:
    """flashqla GDN built from Megatron-Core's own (non-TE) linear and norm modules."""
    backend = LocalSpecProvider()
    return ModuleSpec(
        module=GatedDeltaNet,
        params=dict(gdn_params),
        submodules=GatedDeltaNetSubmodules(
            in_proj=backend.column_parallel_linear(),
            out_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"),
            out_proj=backend.row_parallel_linear(),
        ),
        metainfo={"fuse_input_layernorm": False},
    )


def get_flashqla_gpt_block_spec(
    config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None, **gdn_params
) -> TransformerBlockSubmodules:
    """GPT decoder block with flashqla GDN layers where `config.linear_attention_freq` puts them."""
    if config.experimental_attention_variant != "gated_delta_net":
        raise ValueError(
            "config.experimental_attention_variant must be 'gated_delta_net' for a GDN block spec, "
            f"got {config.experimental_attention_variant!r}"
        )
    if config.transformer_impl == "transformer_engine":
        _require_transformer_engine("Megatron's GPT block spec for GDN layers")
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        stock = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage, pp_rank)
        return to_flashqla_spec(stock, **gdn_params)
    if config.transformer_impl != "local":
        raise ValueError(
            f"config.transformer_impl must be 'transformer_engine' or 'local', got {config.transformer_impl!r}"
        )
    return _local_block_spec(config, vp_stage, pp_rank, get_local_gdn_module_spec(config, **gdn_params))


def get_megatron_gdn_local_block_spec(
    config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> TransformerBlockSubmodules:
    """The same local (non-TE) GPT block with Megatron's own GatedDeltaNet (its FLA kernels) in the GDN
    layers: the `--linear-attention-impl fla` baseline where Transformer Engine is not installed (Megatron's
    stock GDN block spec asserts TE). Same parameters and checkpoint keys as the flashqla block."""
    gdn = dataclasses.replace(get_local_gdn_module_spec(config), module=MegatronGatedDeltaNet, params={})
    return _local_block_spec(config, vp_stage, pp_rank, gdn)


def _local_block_spec(config, vp_stage, pp_rank, gdn: ModuleSpec) -> TransformerBlockSubmodules:
    layer_specs = _local_layer_specs(config, gdn)
    backend = LocalSpecProvider()
    return TransformerBlockSubmodules(
        layer_specs=[layer_specs[i] for i in _layers_of_this_stage(config, vp_stage, pp_rank)],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"),
    )


def get_flashqla_hybrid_stack_spec(**gdn_params) -> ModuleSpec:
    """Megatron's hybrid stack spec (GDN layers = pattern symbol `G`) with flashqla's GDN."""
    _require_transformer_engine("Megatron's hybrid stack spec (its final norm is always TENorm)")
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    return to_flashqla_spec(hybrid_stack_spec, **gdn_params)


def _require_transformer_engine(what: str) -> None:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        raise ImportError(
            f"{what} is built from Transformer Engine layers, and transformer-engine is not installed; "
            "install it, or use get_flashqla_gpt_block_spec with transformer_impl='local' "
            "(--transformer-impl local)"
        )


def _local_layer_specs(config, gdn: ModuleSpec) -> list:
    """One local TransformerLayer spec per layer: `gdn` or softmax attention per the linear-attention
    pattern, dense or MoE MLP per the MoE pattern."""
    attention_pattern = get_linear_attention_pattern(config)
    moe_pattern = get_moe_layer_pattern(config) if config.num_moe_experts else [0] * config.num_layers
    specs = []
    for is_gdn, is_moe in zip(attention_pattern, moe_pattern):
        layer = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts if is_moe else None,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
        if is_gdn:
            # Keep checkpoints interchangeable with the TE spec, where a GDN layer's input norm
            # lives in in_proj (TELayerNormColumnParallelLinear).
            layer = ModuleSpec(
                module=TransformerLayer,
                submodules=dataclasses.replace(
                    layer.submodules,
                    self_attention=gdn,
                    sharded_state_dict_keys_map={
                        **layer.submodules.sharded_state_dict_keys_map,
                        "input_layernorm.": "self_attention.in_proj.layer_norm_",
                    },
                ),
            )
        specs.append(layer)
    return specs


def _layers_of_this_stage(config, vp_stage, pp_rank) -> range:
    """Global indices of the layers this pipeline (and virtual pipeline) stage builds."""
    if config.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.enums import LayerType

        return config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
