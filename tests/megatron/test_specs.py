"""Spec helpers: the swap to flashqla's GDN keeps everything around it, the local block follows the
linear-attention pattern, TE-only specs fail clearly without Transformer Engine, and the core package
never imports Megatron."""
import subprocess
import sys

import pytest

import mcore_harness as h
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet

from flashqla.megatron import GatedDeltaNet, get_flashqla_gpt_block_spec, get_flashqla_hybrid_stack_spec, to_flashqla_spec


def test_swap_replaces_only_the_gdn_core_of_the_hybrid_te_spec_and_leaves_the_stock_spec_alone():
    swapped = to_flashqla_spec(hybrid_stack_spec, kernel_backend="tilelang", cp_mode="head_a2a")
    gdn = swapped.submodules.gdn_layer.submodules.self_attention
    stock_gdn = hybrid_stack_spec.submodules.gdn_layer.submodules.self_attention
    assert gdn.module is GatedDeltaNet
    assert gdn.params == {"kernel_backend": "tilelang", "cp_mode": "head_a2a"}
    assert gdn.submodules == stock_gdn.submodules  # TE in_proj / norm / out_proj kept around the core
    assert stock_gdn.module is MegatronGatedDeltaNet and stock_gdn.params == {}
    assert swapped.submodules.attention_layer == hybrid_stack_spec.submodules.attention_layer
    assert swapped.submodules.moe_layer == hybrid_stack_spec.submodules.moe_layer


def test_local_gpt_block_puts_gdn_where_linear_attention_freq_says():
    h.init_parallel()
    block = get_flashqla_gpt_block_spec(h.gdn_config(num_layers=6, linear_attention_freq=3), kernel_backend="torch")
    kinds = [layer.submodules.self_attention.module for layer in block.layer_specs]
    assert [k is GatedDeltaNet for k in kinds] == [True, True, False, True, True, False]
    gdn_layer = block.layer_specs[0].submodules
    assert gdn_layer.self_attention.params["kernel_backend"] == "torch"
    # checkpoint keys of the input norm line up with the TE spec, where it lives inside in_proj
    assert gdn_layer.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.in_proj.layer_norm_"


def test_gpt_block_without_gdn_variant_is_a_value_error():
    h.init_parallel()
    with pytest.raises(ValueError, match="experimental_attention_variant"):
        get_flashqla_gpt_block_spec(h.gdn_config(experimental_attention_variant=None, linear_attention_freq=None))


def test_te_specs_without_transformer_engine_raise_a_clear_import_error():
    h.init_parallel()
    with pytest.raises(ImportError, match="transformer-engine is not installed"):
        get_flashqla_hybrid_stack_spec()
    with pytest.raises(ImportError, match="transformer-engine is not installed"):
        get_flashqla_gpt_block_spec(h.gdn_config(transformer_impl="transformer_engine"))


def test_core_package_never_imports_megatron():
    code = "import sys, flashqla, flashqla.layers, flashqla.ops; assert 'megatron' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adapter_without_megatron_says_how_to_install_it():
    code = "import sys; sys.modules['megatron'] = None; import flashqla.megatron"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "flashqla.megatron needs megatron-core 0.19.x" in result.stderr
