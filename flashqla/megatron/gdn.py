"""Megatron-Core's GatedDeltaNet with flashqla's chunk kernel.

The subclass keeps everything Megatron owns: parameter names and shapes, `in_proj`'s
[q|k|v|z|beta|alpha] sectioning per TP rank, initialisation, `sharded_state_dict` (so dist
checkpoints written by Megatron's FLA-based GDN load here and back), the gated output norm and the
CP all-to-all helpers. It changes three things:

* the kernel: `self.gated_delta_rule` is rebound (in Megatron's `_setup_variant_attrs` hook) to
  `flashqla.chunk_gated_delta_rule`;
* q/k preparation: no `repeat_interleave` to the v-head count (flashqla reads k-head h // (Hv/Hk)
  natively, the same mapping Megatron's repeat produces) and no separate L2 norm pass: the kernel
  normalises q and k itself (`use_qk_l2norm_in_kernel`, eps 1e-6, FLA's convention), which on GPU
  saves two memory passes over q and k and keeps only the inverse norms for backward;
* the causal conv: flashqla's per-sequence conv (`flashqla.layers.conv`) instead of FLA's Triton
  conv, so the module builds and runs without FLA installed and handles packed sequences on any
  device (Megatron's deterministic-mode `F.conv1d` cannot see `cu_seqlens`).

Context parallelism: `cp_mode="head_a2a"` is Megatron's scheme (all-to-all from sequence shards to
head shards around the kernel, CP size bound by the head count). `cp_mode="state_passing"` is where
flashqla's inter-card CP (`flashqla.cp.build_cp_context`, S0 state passing, no head split) plugs in:
see `_state_passing_cp_context`.
"""
import contextlib
from functools import partial
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import common as mcore_gdn_common
from megatron.core.ssm.gated_delta_net.common import (
    _build_head_perm_for_split_sections,
    _build_thd_cp_a2a_perm,
    get_parameter_local_cp,
    tensor_a2a_cp2hp,
)
from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet as MegatronGatedDeltaNet

import flashqla
from flashqla.layers.conv import causal_conv1d

CP_MODES = ("head_a2a", "state_passing")


@contextlib.contextmanager
def _without_fla_check():
    """Megatron's GDN constructor raises ImportError when FLA is missing, even though this subclass
    never calls FLA; lift that check for the duration of the constructor only."""
    saved = mcore_gdn_common.HAVE_FLA
    mcore_gdn_common.HAVE_FLA = True
    try:
        yield
    finally:
        mcore_gdn_common.HAVE_FLA = saved


class GatedDeltaNet(MegatronGatedDeltaNet):
    """Drop-in for `megatron.core.ssm.gated_delta_net.GatedDeltaNet` (same constructor arguments).

    Extra keyword arguments (pass them through `ModuleSpec.params`):
        kernel_backend: flashqla backend, "auto" (TileLang on SM90, else torch), "torch", "tilelang".
        cp_mode: "head_a2a" (Megatron's all-to-all CP) or "state_passing" (flashqla's CP).
    """

    def __init__(self, *args, kernel_backend: str = "auto", cp_mode: str = "head_a2a", **kwargs):
        if kernel_backend not in ("auto", "torch", "tilelang"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'tilelang', got {kernel_backend!r}")
        if cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be one of {CP_MODES}, got {cp_mode!r}")
        with _without_fla_check():
            super().__init__(*args, **kwargs)
        self.kernel_backend = kernel_backend
        self.cp_mode = cp_mode

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self.gated_delta_rule = self._flashqla_gated_delta_rule

    def _flashqla_gated_delta_rule(self, q, k, v, g, beta, cu_seqlens=None, cp_context=None):
        """Megatron's kernel contract (bshd q/k/v, fp32 g, no initial or final state), with q/k at
        their own head count and L2-normalised in the kernel when `use_qk_l2norm` is set."""
        return flashqla.chunk_gated_delta_rule(
            q, k, v, g, beta,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm,
            backend=self.kernel_backend,
            cp_context=cp_context,
        )

    def _prepare_input_for_gated_delta_rule(self, qkv, gate, batch, seq_len, *gate_feats):
        """Split the conv output into q, k [B, T, Hk, K] and v [B, T, Hv, V]; unlike Megatron's
        version, q/k keep Hk heads and are not normalised here (the kernel does both)."""
        qk_width = self.qk_dim_local_tp // self.cp_size
        v_width = self.v_dim_local_tp // self.cp_size
        query, key, value = torch.split(qkv, [qk_width, qk_width, v_width], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        return (query, key, value, gate.contiguous(), *(t.contiguous() for t in gate_feats))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        inference_context=None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
        **kwargs,
    ):
        """hidden_states [s_local, b, hidden] -> (out [s_local, b, hidden], out_bias)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("flashqla.megatron.GatedDeltaNet: inference (decode) is not supported yet")
        s_local, batch, _ = hidden_states.shape
        seq_len = s_local * self.sp_size * self.cp_size  # tokens per sequence over the whole CP group
        cu_seqlens = self._packed_cu_seqlens(packed_seq_params, seq_len, batch)

        qkvzba, _ = self.in_proj(hidden_states)  # [s_local * sp, b, in_proj_dim / tp]
        cp_context = None
        if self.cp_mode == "state_passing" and self.cp_size > 1:
            cp_context = self._state_passing_cp_context(cu_seqlens, seq_len)
        qkvzba, thd_cp_inverse = self._cp_sequence_to_heads(qkvzba, cu_seqlens, seq_len)
        qkvzba = qkvzba.transpose(0, 1)  # sbhd -> bshd
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)

        qkv = self._causal_conv(qkv, cu_seqlens)
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv, gate, batch, seq_len, beta, alpha
        )
        A_log = get_parameter_local_cp(self.A_log, dim=0, cp_group=self.pg_collection.cp)
        dt_bias = get_parameter_local_cp(self.dt_bias, dim=0, cp_group=self.pg_collection.cp)
        g, beta = self._compute_g_and_beta(A_log, dt_bias, alpha, beta)

        core_out, _ = self.gated_delta_rule(query, key, value, g, beta, cu_seqlens=cu_seqlens, cp_context=cp_context)

        norm_and_a2a = partial(
            self._gated_norm_and_a2a,
            thd_cp_a2a_inv=thd_cp_inverse,
            batch=batch,
            seq_len=seq_len,
            packed_seq_params=packed_seq_params,
        )
        if self.recompute_norm_out:
            # Pass config.fp8 explicitly: the default fp8=False counts as fp8 in Megatron 0.19
            # (`fp8 is not None`) and then needs Transformer Engine.
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            norm_out = self.norm_out_checkpoint.checkpoint(norm_and_a2a, core_out, gate)
        else:
            norm_out = norm_and_a2a(core_out, gate)
        out, out_bias = self.out_proj(norm_out)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def _packed_cu_seqlens(self, packed_seq_params, seq_len, batch) -> Optional[torch.Tensor]:
        """int32 cu_seqlens over the CP group's whole stream for THD input, else None."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return None
        if batch != 1:
            raise ValueError(f"packed (thd) input needs batch size 1, got {batch}")
        cu_q = self._resolve_cu_seqlens(
            packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q, seq_len,
            "cu_seqlens_q", cp_size=self.cp_size,
        )
        cu_kv = self._resolve_cu_seqlens(
            packed_seq_params.cu_seqlens_kv_padded, packed_seq_params.cu_seqlens_kv, seq_len,
            "cu_seqlens_kv", cp_size=self.cp_size,
        )
        if not torch.equal(cu_q, cu_kv):
            raise ValueError(f"GDN needs cu_seqlens_q == cu_seqlens_kv, got {cu_q} and {cu_kv}")
        return cu_q.to(torch.int32)

    def _cp_sequence_to_heads(self, qkvzba, cu_seqlens, seq_len):
        """Head all-to-all CP: [s/cp, b, proj] sequence shards -> [s, b, proj/cp] head shards in
        natural token order (Megatron's scheme, including its THD reordering). Identity for
        CP 1. Returns the tensor and the THD inverse permutation (None unless packed, CP > 1)."""
        if self.cp_size == 1:
            return qkvzba, None
        head_perm = _build_head_perm_for_split_sections(
            self.in_proj_split_sections, self.cp_size, qkvzba.device
        )
        qkvzba = qkvzba.index_select(-1, head_perm)
        if cu_seqlens is None:
            return tensor_a2a_cp2hp(qkvzba, seq_dim=0, head_dim=-1, cp_group=self.pg_collection.cp), None
        qkvzba = tensor_a2a_cp2hp(
            qkvzba, seq_dim=0, head_dim=-1, cp_group=self.pg_collection.cp,
            undo_attention_load_balancing=False,
        )
        order, inverse = _build_thd_cp_a2a_perm(cu_seqlens, self.cp_size, seq_len)
        return qkvzba.index_select(0, order), inverse

    def _causal_conv(self, qkv, cu_seqlens):
        """Depthwise causal conv + activation over [B, T, q|k|v channels of this rank's heads]."""
        sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        weight = get_parameter_local_cp(self.conv1d.weight, dim=0, cp_group=self.pg_collection.cp, split_sections=sections)
        bias = None
        if self.conv_bias:
            bias = get_parameter_local_cp(self.conv1d.bias, dim=0, cp_group=self.pg_collection.cp, split_sections=sections)
        B, T, C = qkv.shape
        if cu_seqlens is None:  # padded batch: every row is its own sequence of T tokens
            cu_seqlens = torch.arange(0, (B + 1) * T, T, device=qkv.device, dtype=torch.int32)
        out, _ = causal_conv1d(qkv.reshape(B * T, C), weight.squeeze(1), cu_seqlens, silu=False)
        if bias is not None:
            out = out + bias
        return self.act_fn(out.reshape(B, T, C))

    def _state_passing_cp_context(self, cu_seqlens, seq_len):
        """Plug point for flashqla's inter-card CP (S0 state passing instead of head all-to-all).

        To wire it: build `flashqla.cp.build_cp_context(cu_seqlens_global, group=self.pg_collection.cp,
        layout=..., conv1d_kernel_size=self.conv_kernel_dim)`, give `_causal_conv` the previous
        piece's W-1 rows as `prefix` (`flashqla.layers.halo`), pass the context to the kernel, skip
        the output all-to-all in `_gated_norm_and_a2a`, and stop slicing conv1d / A_log / dt_bias by
        CP rank. Layout: Megatron load-balances each sequence on its own (rank r holds chunks r and
        2cp-1-r of every sequence, sbhd batch rows and THD sequences alike); that equals a
        stream-level zigzag only for one sequence (sbhd with batch 1, or THD with one sequence).
        """
        raise NotImplementedError(
            "cp_mode='state_passing' needs flashqla's inter-card CP (flashqla.cp.build_cp_context), "
            "which is not wired into the Megatron adapter yet; use cp_mode='head_a2a'"
        )
