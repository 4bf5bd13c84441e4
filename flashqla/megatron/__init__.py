"""Megatron-Core adapter: flashqla's GDN kernel inside Megatron's GatedDeltaNet.

Only this subpackage imports Megatron; `import flashqla` never does. Supported: megatron-core
0.19.x (Python >= 3.12). See docs/megatron.md.
"""
try:
    import megatron.core  # noqa: F401
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as _MegatronGatedDeltaNet  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in the 3.11 venv test
    raise ImportError(
        "flashqla.megatron needs megatron-core 0.19.x (Python >= 3.12), which could not be "
        f"imported ({err}). Install it with `pip install 'flashqla[megatron]'` or run "
        "scripts/megatron_venv.sh."
    ) from err

from flashqla.megatron.config import StatePassingTransformerConfig
from flashqla.megatron.gdn import CP_MODES, GatedDeltaNet
from flashqla.megatron.specs import (
    get_flashqla_gpt_block_spec,
    get_flashqla_hybrid_stack_spec,
    get_local_gdn_module_spec,
    to_flashqla_spec,
)

__all__ = [
    "CP_MODES",
    "GatedDeltaNet",
    "StatePassingTransformerConfig",
    "get_flashqla_gpt_block_spec",
    "get_flashqla_hybrid_stack_spec",
    "get_local_gdn_module_spec",
    "to_flashqla_spec",
]
