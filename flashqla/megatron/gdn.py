"""Megatron-Core's GatedDeltaNet with flashqla's chunk kernel.

The subclass keeps everything Megatron owns: parameter names and shapes, `in_proj`'s
[q|k|v|z|beta|alpha] sectioning per TP rank, initialisation, `sharded_state_dict` (so dist
checkpoints written by Megatron's FLA-based GDN load here and back), the output norm module and the
CP all-to-all helpers. It changes four things:

* the kernel: `self.gated_delta_rule` is rebound (in Megatron's `_setup_variant_attrs` hook) to
  `flashqla.chunk_gated_delta_rule`;
* q/k preparation: no `repeat_interleave` to the v-head count (flashqla reads k-head h // (Hv/Hk)
  natively, the same mapping Megatron's repeat produces); q and k are L2-normalised by the op
  (`use_qk_l2norm_in_kernel`, eps 1e-6, FLA's convention; `flashqla.ops.qk_norm`: one fused SM90 kernel
  each way on Hopper, the fp32 torch chain elsewhere or with FLASHQLA_FUSED_L2NORM=0);
* the causal conv: flashqla's per-sequence conv (`flashqla.layers.conv`) instead of FLA's Triton
  conv, so the module builds and runs without FLA installed and handles packed sequences on any
  device (Megatron's deterministic-mode `F.conv1d` cannot see `cu_seqlens`); with SiLU and no conv
  bias (Megatron's default) the SiLU runs inside it, i.e. inside the fused SM90 conv kernel;
* the gated output norm: with an RMSNorm `out_norm` (not zero-centred) and SiLU, flashqla's gated RMSNorm
  (`flashqla.layers.norm`, the fused SM90 kernel where it fits) on `out_norm.weight`, same values as
  Megatron's `out_norm(x) * silu(gate)`; any other norm or activation keeps Megatron's.

Context parallelism (`cp_mode`):

* "head_a2a": Megatron's scheme. An all-to-all turns the [s/cp] sequence shards into [s] sequences of
  1/cp of the heads around the kernel (and back after the gated norm); CP size must divide the head
  counts.
* "state_passing": flashqla's inter-card CP. Every rank keeps its tokens and all of its TP rank's heads;
  the kernel chains the recurrent state S0 across the CP group (`flashqla.cp`, design doc section 3)
  and the short conv reads the W - 1 rows before each part from the rank that holds them
  (`flashqla.layers.halo`). Megatron's load-balanced order (every sequence cut into 2*cp chunks, rank r
  holding chunks r and 2cp-1-r) is the context's "zigzag_per_sequence" layout, for padded rows and
  packed sequences alike. CP size is not bound by the head count (see `StatePassingTransformerConfig`).
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
from flashqla.layers.norm import gated_rms_norm
from flashqla.layers.halo import halo_prefix
from flashqla.megatron.cp_contexts import host_offsets, int32_offsets, state_passing_context

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


def _thd_offsets(packed_seq_params, side: str) -> torch.Tensor:
    """The THD offsets of `side` ("q" or "kv") the layer uses: the padded ones where given (as Megatron's
    own GDN)."""
    padded = getattr(packed_seq_params, f"cu_seqlens_{side}_padded")
    return padded if padded is not None else getattr(packed_seq_params, f"cu_seqlens_{side}")


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
        self.cp_mode = cp_mode  # read by _setup_variant_attrs, which Megatron's constructor calls
        with _without_fla_check():
            super().__init__(*args, **kwargs)
        self.kernel_backend = kernel_backend
        self._check_head_split()

    @property
    def state_passing(self) -> bool:
        """CP by state passing is in effect (a CP group of more than one rank)."""
        return self.cp_mode == "state_passing" and self.cp_size > 1

    def _check_head_split(self):
        ways = self.tp_size * self.cp_heads_split
        for name, heads in (("linear_num_key_heads", self.num_key_heads), ("linear_num_value_heads", self.num_value_heads)):
            if heads % ways:
                raise ValueError(
                    f"config.{name}={heads} does not split over TP {self.tp_size} x CP {self.cp_heads_split} "
                    f"(cp_mode={self.cp_mode!r}); head all-to-all CP splits heads over CP, state passing does not"
                )

    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        self.gated_delta_rule = self._flashqla_gated_delta_rule
        # how many ways the CP group splits this rank's heads: all of them stay local with state passing
        self.cp_heads_split = 1 if self.cp_mode == "state_passing" else self.cp_size
        self.feat_dim_split = (
            (self.qk_dim_local_tp * 2 + self.v_dim_local_tp) // self.cp_heads_split,  # qkv
            self.v_dim_local_tp // self.cp_heads_split,  # gate (z)
            self.num_v_heads_local_tp // self.cp_heads_split,  # beta
            self.num_v_heads_local_tp // self.cp_heads_split,  # alpha
        )

    def _flashqla_gated_delta_rule(self, q, k, v, g, beta, cu_seqlens=None, cp_context=None):
        """Megatron's kernel contract (bshd q/k/v, fp32 g, no initial or final state), with q/k at
        their own head count and L2-normalised by the op when `use_qk_l2norm` is set. With a
        `cp_context` the sequence layout is the context's (cu_seqlens must be None)."""
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
        qk_width = self.qk_dim_local_tp // self.cp_heads_split
        v_width = self.v_dim_local_tp // self.cp_heads_split
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
        qkvzba, _ = self.in_proj(hidden_states)  # [s_local * sp, b, in_proj_dim / tp]
        if self.state_passing:
            tokens = s_local * self.sp_size  # this rank's tokens per row
            cp_context = self._state_passing_cp_context(packed_seq_params, batch, tokens, qkvzba.device)
            cu_seqlens = None
            # rows one after another = the context's local stream (Megatron's order, sequence after sequence)
            qkvzba = qkvzba.transpose(0, 1).reshape(1, batch * tokens, -1)
            norm = partial(self._gated_norm_local, batch=batch, tokens=tokens)
        else:
            seq_len = s_local * self.sp_size * self.cp_size  # tokens per sequence over the whole CP group
            cp_context = None
            cu_seqlens = self._packed_cu_seqlens(packed_seq_params, seq_len, batch)
            qkvzba, thd_cp_inverse = self._cp_sequence_to_heads(qkvzba, cu_seqlens, seq_len)
            qkvzba = qkvzba.transpose(0, 1)  # sbhd -> bshd
            norm = partial(
                self._gated_norm_and_a2a,
                thd_cp_a2a_inv=thd_cp_inverse,
                batch=batch,
                seq_len=seq_len,
                packed_seq_params=packed_seq_params,
            )
        kernel_batch, kernel_len = qkvzba.shape[:2]
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        gate = gate.reshape(kernel_batch, kernel_len, -1, self.value_head_dim)

        qkv = self._causal_conv(qkv, cu_seqlens, cp_context)
        query, key, value, gate, beta, alpha = self._prepare_input_for_gated_delta_rule(
            qkv, gate, kernel_batch, kernel_len, beta, alpha
        )
        g, beta = self._compute_g_and_beta(self._cp_local(self.A_log), self._cp_local(self.dt_bias), alpha, beta)

        core_out, _ = self.gated_delta_rule(query, key, value, g, beta, cu_seqlens=cu_seqlens, cp_context=cp_context)

        if self.recompute_norm_out:
            # Pass config.fp8 explicitly: the default fp8=False counts as fp8 in Megatron 0.19
            # (`fp8 is not None`) and then needs Transformer Engine.
            self.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            norm_out = self.norm_out_checkpoint.checkpoint(norm, core_out, gate)
        else:
            norm_out = norm(core_out, gate)
        out, out_bias = self.out_proj(norm_out)
        if self.recompute_norm_out:
            self.norm_out_checkpoint.discard_output_and_register_recompute(out)
        return out, out_bias

    def _apply_gated_norm(self, x, gate):
        """out_norm(x) * act(gate) per value head [tokens * heads, V]: flashqla's gated RMSNorm (the fused
        SM90 kernel where the call fits it) when the output norm is a plain RMSNorm with a [V] weight and the
        activation SiLU (Qwen3-Next's), Megatron's own otherwise (zero-centred gamma, another norm or
        activation)."""
        weight = getattr(self.out_norm, "weight", None)
        plain_rms = (self.config.normalization == "RMSNorm" and not self.config.layernorm_zero_centered_gamma
                     and getattr(self.out_norm, "bias", None) is None)
        if self.activation != "silu" or not plain_rms or weight is None or weight.shape != (x.shape[-1],):
            return super()._apply_gated_norm(x, gate)
        D = x.shape[-1]
        return gated_rms_norm(x.reshape(-1, D), gate.reshape(-1, D), weight, self.config.layernorm_epsilon)

    def _gated_norm_local(self, core_out, gate, batch, tokens):
        """Gated norm, back to Megatron's [s_local, b, v_dim / tp] with no all-to-all (state passing)."""
        norm_out = self._apply_gated_norm(core_out, gate)
        return norm_out.reshape(batch, tokens, -1).transpose(0, 1).contiguous()

    def _packed_cu_seqlens(self, packed_seq_params, seq_len, batch) -> Optional[torch.Tensor]:
        """int32 cu_seqlens over the CP group's whole stream for THD input, else None. Checked on the host
        copy of the offsets, which is cached per tensor (one copy per step); Megatron's own resolution
        (`_resolve_cu_seqlens` and a `torch.equal`) synchronises the host five times in every layer."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return None
        if batch != 1:
            raise ValueError(f"packed (thd) input needs batch size 1, got {batch}")
        offsets = self._packed_offsets(packed_seq_params, seq_len)
        lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
        if any(n % self.cp_size for n in lengths):
            raise ValueError(f"packed_seq_params: every sequence length must be divisible by cp_size={self.cp_size} "
                             f"(Megatron's CP layout), got {lengths}")
        return int32_offsets(_thd_offsets(packed_seq_params, "q"))

    def _state_passing_cp_context(self, packed_seq_params, batch, tokens, device):
        """The shared (cached) CP context of this batch's layout: packed sequences as the THD offsets
        say (the padded ones, as Megatron's own GDN), padded rows as sequences of tokens * cp."""
        total = tokens * self.cp_size
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            offsets = tuple(range(0, (batch + 1) * total, total))
        else:
            if batch != 1:
                raise ValueError(f"packed (thd) input needs batch size 1, got {batch}")
            offsets = self._packed_offsets(packed_seq_params, total)
        return state_passing_context(offsets, self.pg_collection.cp, self.conv_kernel_dim, device)

    @staticmethod
    def _packed_offsets(packed_seq_params, total) -> tuple[int, ...]:
        """Host copy of the THD offsets over the whole CP group (cached per tensor: no sync per layer)."""
        offsets = {side: host_offsets(_thd_offsets(packed_seq_params, side)) for side in ("q", "kv")}
        if offsets["q"] != offsets["kv"]:
            raise ValueError(f"GDN needs cu_seqlens_q == cu_seqlens_kv, got {offsets['q']} and {offsets['kv']}")
        if offsets["q"][-1] != total:
            raise ValueError(f"packed_seq_params: cu_seqlens_q[-1]={offsets['q'][-1]} is not the {total} tokens "
                             "of the CP group's stream")
        return offsets["q"]

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

    def _cp_local(self, param, split_sections=None):
        """This CP rank's heads of a per-head parameter: all of them with state passing, 1/cp with
        head all-to-all."""
        if self.cp_heads_split == 1:
            return param
        return get_parameter_local_cp(param, dim=0, cp_group=self.pg_collection.cp, split_sections=split_sections)

    def _causal_conv(self, qkv, cu_seqlens, cp_context):
        """Depthwise causal conv + activation over [B, T, q|k|v channels of this rank's heads]; with a
        CP context, each part's first sequence continues from the W - 1 rows before the part."""
        sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        weight = self._cp_local(self.conv1d.weight, sections)
        B, T, C = qkv.shape
        rows = qkv.reshape(B * T, C)
        prefix = None
        if cp_context is not None:
            cu_seqlens = cp_context.cu_seqlens
            prefix = halo_prefix(rows, cp_context, self.conv_kernel_dim - 1)
        elif cu_seqlens is None:  # padded batch: every row is its own sequence of T tokens
            cu_seqlens = torch.arange(0, (B + 1) * T, T, device=qkv.device, dtype=torch.int32)
        # SiLU straight after the conv (Megatron's GDN default, no conv bias) runs inside the fused SM90
        # conv kernel, as Megatron hands it to FLA's conv; a bias or another activation comes after the conv
        fused_silu = self.activation == "silu" and not self.conv_bias
        out, _ = causal_conv1d(rows, weight.squeeze(1), cu_seqlens, prefix=prefix, silu=fused_silu)
        if fused_silu:
            return out.reshape(B, T, C)
        if self.conv_bias:
            out = out + self._cp_local(self.conv1d.bias, sections)
        return self.act_fn(out.reshape(B, T, C))
