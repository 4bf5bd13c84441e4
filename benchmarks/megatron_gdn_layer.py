"""Megatron-Core's own GDN layer (FLA kernels) vs flashqla's drop-in GDN layer on one GPU: same weights,
same packed (THD) input; relative L2 of the output, the input gradient and every parameter gradient,
and the fwd / fwd+bwd time of each layer (eager medians, CUDA events).

    torchrun --nproc-per-node 1 benchmarks/megatron_gdn_layer.py [--tokens 8192] [--docs 3]
        [--hidden 2048 --key-heads 16 --value-heads 32] [--reps 20]

Defaults: a Qwen3-Next-80B GDN layer at TP 1 (hidden 2048, 16 k-heads / 32 v-heads of 128), bf16. FLA's
Triton `chunk_bwd_dqkwg` needs its backend dispatch on Triton 3.6 (fla#640), so it stays on here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_gdn import eager_median_ms  # noqa: E402


def build_layers(args):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet as MegatronGatedDeltaNet
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from flashqla.megatron import get_local_gdn_module_spec

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=max(args.key_heads, 1),
        ffn_hidden_size=4 * args.hidden, experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=args.key_heads, linear_num_value_heads=args.value_heads, normalization="RMSNorm",
        layernorm_epsilon=1e-6, activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        params_dtype=torch.bfloat16, bf16=True, transformer_impl="local")
    groups = ProcessGroupCollection.use_mpu_process_groups()
    spec = get_local_gdn_module_spec(config)
    ours = build_module(spec, config=config, layer_number=1, pg_collection=groups).cuda()
    theirs = build_module(dataclasses.replace(spec, module=MegatronGatedDeltaNet, params={}), config=config,
                          layer_number=1, pg_collection=groups).cuda()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def run(layer, x, grad_out, packed):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x, None, packed_seq_params=packed)
    out.backward(grad_out)
    return out.detach(), x.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core.packed_seq_params import PackedSeqParams

    import flashqla

    flashqla.preload_kernels("bf16")
    ours, theirs = build_layers(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cuts = torch.randperm(args.tokens - 1, generator=torch.Generator().manual_seed(0))[:args.docs - 1].add(1)
    cu = torch.tensor([0, *sorted(cuts.tolist()), args.tokens], dtype=torch.int32, device="cuda")
    longest = int((cu[1:] - cu[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    x = torch.randn(args.tokens, 1, args.hidden, generator=gen, device="cuda").bfloat16()
    grad_out = torch.randn(args.tokens, 1, args.hidden, generator=gen, device="cuda").bfloat16()

    out, dx, grads = run(ours, x, grad_out, packed)
    out_ref, dx_ref, grads_ref = run(theirs, x, grad_out, packed)
    print(f"flashqla vs Megatron's FLA GDN layer, {args.tokens} tokens in {args.docs} documents, hidden "
          f"{args.hidden}, heads {args.key_heads}/{args.value_heads}, bf16 (relative L2):")
    print(f"  output {rel_err(out, out_ref):.2e}  d input {rel_err(dx, dx_ref):.2e}")
    for name in grads_ref:
        print(f"  d {name:<24} {rel_err(grads[name], grads_ref[name]):.2e}")

    def forward(layer):
        with torch.no_grad():
            layer(x, None, packed_seq_params=packed)

    def forward_backward(layer):
        xx = x.detach().requires_grad_(True)
        layer(xx, None, packed_seq_params=packed)[0].backward(grad_out)

    times = {}
    for name, layer in (("flashqla", ours), ("megatron+fla", theirs)):
        forward_backward(layer)
        times[name] = (eager_median_ms(lambda: forward(layer), args.reps),
                       eager_median_ms(lambda: forward_backward(layer), args.reps))
    for name, (f, fb) in times.items():
        print(f"  {name:<13} fwd {f:7.3f} ms   fwd+bwd {fb:7.3f} ms")
    f_ratio = times["megatron+fla"][0] / times["flashqla"][0]
    fb_ratio = times["megatron+fla"][1] / times["flashqla"][1]
    print(f"  speed-up of flashqla: fwd {f_ratio:.2f}x, fwd+bwd {fb_ratio:.2f}x (the layer, projections included)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
