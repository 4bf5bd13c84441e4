"""Pretrain the Qwen3-Next-style hybrid with Megatron-Core and flashqla's GDN layers.

    python examples/pretrain_qwen_next/train_megatron.py --size tiny --steps 120           # CPU, one process
    torchrun --nproc-per-node 1 examples/pretrain_qwen_next/train_megatron.py --size small
    torchrun --nproc-per-node 2 examples/pretrain_qwen_next/train_megatron.py --size long256k \\
        --cp 2 --recompute                                         # flashqla state-passing CP for GDN
    ... --impl fla                                                 # the same run on Megatron's FLA GDN

The model (model_config.py) is built by Megatron-Core from a Megatron command line that this script
composes from the size (GDN every layer but every 4th, gated softmax attention with partial RoPE
there, MoE where the size has experts): flashqla's launcher parses it
(`flashqla.megatron.pretrain_gpt`), so `--tp`, `--cp`, `--sequence-parallel` and any extra Megatron
flags after `--` mean what they mean to Megatron. With Transformer Engine installed the layers are
TE's (needed for CP > 1: Megatron's local attention has no CP); without it, Megatron-Core's local
layers (the CPU path, under flashqla's CPU shim).

The loop is Megatron's per-step work written out, so it also runs on CPU, where Megatron's
`pretrain()` cannot: the launcher's forward step (CP slicing of the batch, masked token loss), a
token-mean loss over the data-parallel x CP group, gradients summed over that group, gradient
clipping over TP shards, AdamW with warmup + cosine decay. Rows are data.py's packed documents; a
row is one sequence to the model, and no token's loss crosses a document boundary (labels).
Checkpoints are Megatron dist checkpoints (megatron_checkpoint.py): --save-dir/step<N>, resumed with
--resume; the losses go to --save-dir/losses.json and
loss_curve.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from data import IGNORE_INDEX, VOCAB_SIZE, load_rows  # noqa: E402
from reporting import Throughput, memory_now, plot_losses, write_summary  # noqa: E402
from model_config import SIZES, train_flops_per_token  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps to reach (a resumed run continues)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default: the size's)")
    p.add_argument("--micro-batch", type=int, default=1, help="rows per data-parallel rank and step")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, help="context-parallel size (default: the size's sequence_parallel)")
    p.add_argument("--cp-mode", choices=("state_passing", "head_a2a"), default="state_passing",
                   help="GDN context parallelism with --impl flashqla")
    p.add_argument("--impl", choices=("flashqla", "fla"), default="flashqla", help="GDN implementation")
    p.add_argument("--kernel-backend", choices=("auto", "torch", "tilelang"), default="auto")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps before the cosine decay")
    p.add_argument("--recompute", action="store_true", help="recompute whole layers in backward")
    p.add_argument("--data", help="your own .jsonl / .txt file or folder (default: the stdlib corpus)")
    p.add_argument("--save-dir", default="runs/pretrain_qwen_next_megatron")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--exit-after", type=int, help="stop after this many steps of this run, with a checkpoint "
                   "(a job's time limit); --resume continues")
    p.add_argument("--seed", type=int, default=0)
    args, megatron_extra = p.parse_known_args(argv)
    if megatron_extra and megatron_extra[0] == "--":
        megatron_extra = megatron_extra[1:]
    return args, megatron_extra


def needs_one_hardware_queue(args) -> bool:
    """Whether the run needs CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron asserts it under TP or CP on GPUs (its
    overlapped TP communication relies on one hardware queue). Runs without TP or CP leave it unset."""
    return args.tp > 1 or (args.cp or SIZES[args.size].sequence_parallel) > 1


def init_distributed():
    """torchrun's process group, or a one-process group when run as a plain script."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        init = f"file://{tempfile.mktemp(prefix='train_megatron_')}"
    else:
        init = "env://"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", init_method=init)
    else:
        from flashqla.megatron.cpu_shim import install_cpu_shim

        install_cpu_shim()
        dist.init_process_group("gloo", init_method=init, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))


def have_transformer_engine() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE and torch.cuda.is_available()


def megatron_argv(args, seq_len: int, cp: int, world: int) -> list[str]:
    """The Megatron command line of the size (flags as in Megatron's Qwen3-Next recipe, scaled down)."""
    s = SIZES[args.size]
    te = have_transformer_engine()
    argv = [
        "--num-layers", s.num_layers, "--hidden-size", s.hidden_size, "--ffn-hidden-size", s.ffn_size,
        "--num-attention-heads", s.attention_heads, "--group-query-attention", "--num-query-groups", s.kv_heads,
        "--kv-channels", s.attention_head_dim, "--attention-output-gate", "--qk-layernorm",
        "--position-embedding-type", "rope", "--rotary-percent", 0.25,
        "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", 4,
        "--linear-conv-kernel-dim", 4, "--linear-key-head-dim", s.gdn_head_dim, "--linear-value-head-dim", s.gdn_head_dim,
        "--linear-num-key-heads", s.gdn_key_heads, "--linear-num-value-heads", s.gdn_value_heads,
        "--normalization", "RMSNorm", "--norm-epsilon", 1e-6, "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--attention-dropout", 0, "--hidden-dropout", 0,
        "--seq-length", seq_len, "--max-position-embeddings", seq_len,
        "--micro-batch-size", args.micro_batch, "--global-batch-size", args.micro_batch * world // (args.tp * cp),
        "--tensor-model-parallel-size", args.tp, "--context-parallel-size", cp,
        "--tokenizer-type", "NullTokenizer", "--vocab-size", VOCAB_SIZE, "--make-vocab-size-divisible-by", 2,
        "--lr", args.lr, "--train-iters", args.steps, "--seed", args.seed, "--mock-data",
        "--transformer-impl", "transformer_engine" if te else "local",
        "--linear-attention-impl", args.impl, "--flashqla-kernel-backend", args.kernel_backend,
        "--flashqla-cp-mode", args.cp_mode,
    ]
    if s.num_experts:  # MoE in every other layer (HF's decoder_sparse_step 2: layers 2, 4, ...)
        pattern = f"([0,1]*{s.num_layers // 2})"
        argv += ["--num-experts", s.num_experts, "--moe-router-topk", 2, "--moe-ffn-hidden-size", s.expert_ffn_size,
                 "--moe-shared-expert-intermediate-size", s.expert_ffn_size, "--moe-layer-freq", pattern,
                 "--moe-token-dispatcher-type", "alltoall" if torch.cuda.is_available() else "allgather"]
    if not te:
        argv += ["--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]
    if torch.cuda.is_available():
        argv += ["--bf16"]
    if args.recompute:
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    return [str(a) for a in argv]


def build(args, megatron_extra, seq_len, cp):
    """Megatron's parsed args and the GPT model of the size, on this rank's device."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import GPTModelBuilder

    from flashqla.megatron.pretrain_gpt import add_flashqla_args, model_config_from_args

    argv = megatron_argv(args, seq_len, cp, dist.get_world_size()) + megatron_extra
    saved, sys.argv = sys.argv, ["train_megatron", *argv]
    try:
        margs = parse_and_validate_args(extra_args_provider=add_flashqla_args)
    finally:
        sys.argv = saved
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=margs.tensor_model_parallel_size,
                                             context_parallel_size=margs.context_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    model = GPTModelBuilder(model_config_from_args(margs)).build_model(ProcessGroupCollection.use_mpu_process_groups())
    if torch.cuda.is_available():
        model = model.cuda()
    return margs, model


def batch_of(rows, first_row: int, count: int, causal_mask: bool) -> dict:
    """The launcher's batch dict for rows first_row .. first_row + count - 1 (labels -100 -> loss mask 0)."""
    ids, _, labels = (torch.cat(t) for t in zip(*(rows.row(first_row + i) for i in range(count))))
    loss_mask = (labels != IGNORE_INDEX).float()
    seq_len = ids.shape[1]
    batch = {"tokens": ids, "labels": labels.clamp_min(0), "loss_mask": loss_mask,
             "position_ids": torch.arange(seq_len).expand_as(ids).contiguous()}
    # Megatron's local attention takes an explicit mask (True = masked); TE's uses its causal mask type
    batch["attention_mask"] = torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool).triu(1) if causal_mask else None
    return batch


def learning_rate(args, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def reduce_and_clip_grads(model, max_norm: float = 1.0):
    """Sum gradients over the data-parallel x CP group (one flat all-reduce), then clip by the global
    norm counted once per TP shard."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()
    square = sum((p.grad.float().square().sum() for p in params if param_is_not_tensor_parallel_duplicate(p)),
                 torch.zeros((), device=flat.device))
    dist.all_reduce(square, group=parallel_state.get_tensor_model_parallel_group())
    norm = square.sqrt()
    torch._foreach_mul_([p.grad for p in params], torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm.item()


def main(argv=None):
    args, megatron_extra = parse_args(argv)
    if needs_one_hardware_queue(args):  # before CUDA starts (init_distributed), or it has no effect
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    init_distributed()
    from megatron.core import parallel_state
    from tqdm import tqdm

    import megatron_checkpoint
    from flashqla.megatron.pretrain_gpt import forward_step

    size = SIZES[args.size]
    seq_len = args.seq_len or size.seq_len
    cp = args.cp or size.sequence_parallel
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (args.tp * cp):
        raise SystemExit(f"--tp {args.tp} x --cp {cp} does not divide the {world} ranks")
    if seq_len % (2 * cp):
        raise SystemExit(f"--seq-len {seq_len} must split into 2 x {cp} equal chunks (Megatron's CP layout)")
    torch.manual_seed(args.seed)
    margs, model = build(args, megatron_extra, seq_len, cp)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rows = load_rows(seq_len, args.data, args.seed)
    save_dir = Path(args.save_dir)
    step, losses = 0, []
    if args.resume:
        progress = megatron_checkpoint.load_latest(save_dir, model, optimizer)
        step, losses = progress["step"], list(progress["losses"])
    num_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"{args.size}: {num_params / 1e6:.1f}M parameters on rank 0 ({args.impl} GDN), {seq_len} tokens per row, "
              f"TP {args.tp} x CP {cp} x DP {dp_size}, {len(rows)} rows of data; steps {step} -> {args.steps}")

    if args.impl == "flashqla" and args.kernel_backend != "torch" and torch.cuda.is_available():
        import flashqla

        flashqla.preload_kernels("bf16")  # TileLang's import and the kernel loads now, not in step 1
    loss_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.cuda.is_available())
    causal_mask = margs.transformer_impl == "local"
    tokens_per_step = seq_len * args.micro_batch * dp_size
    throughput = Throughput()
    bar = tqdm(total=args.steps, initial=step, disable=rank != 0, dynamic_ncols=True)
    last_step = args.steps if args.exit_after is None else min(args.steps, step + args.exit_after)
    model.train()
    while step < last_step:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        batch = batch_of(rows, (step * dp_size + dp_rank) * args.micro_batch, args.micro_batch, causal_mask)
        with autocast:
            output, loss_fn = forward_step(iter([batch]), model)
            loss_sum, num_tokens, _ = loss_fn(output)
        totals = torch.stack([loss_sum.detach().float(), num_tokens.float()]).to(device)
        dist.all_reduce(totals, group=loss_group)
        optimizer.zero_grad(set_to_none=True)
        (loss_sum / totals[1]).backward()
        grad_norm = reduce_and_clip_grads(model)
        optimizer.step()
        step += 1
        losses.append((totals[0] / totals[1]).item())
        bar.update(1)
        rate = throughput.add(tokens_per_step, time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", mem=memory_now(), gnorm=f"{grad_norm:.2f}")
        if step % args.save_every == 0 or step == last_step:
            megatron_checkpoint.save(save_dir, model, optimizer, {"step": step, "losses": losses})
    bar.close()
    if rank == 0 and losses:
        (save_dir / "losses.json").write_text(json.dumps(losses))
        first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
        print(f"loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
        plot_losses(losses, save_dir / "loss_curve.png", f"pretrain_qwen_next {args.size} (Megatron + {args.impl})")
        write_summary(save_dir / "summary.json", losses=losses, throughput=throughput,
                      flops_per_token=train_flops_per_token(size, VOCAB_SIZE, seq_len), world_size=world,
                      framework="megatron", size=args.size, impl=args.impl, seq_len=seq_len, tp=args.tp, cp=cp,
                      cp_mode=args.cp_mode, dp=dp_size, kernel_backend=args.kernel_backend)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
