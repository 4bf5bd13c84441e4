"""Pretrain the Qwen3-Next-style hybrid with DeepSpeed and flashqla's GDN layers.

    python examples/pretrain_qwen_next/train_deepspeed.py --size tiny --steps 120        # CPU, one process
    deepspeed --num_gpus 1 examples/pretrain_qwen_next/train_deepspeed.py --size small \
        --config examples/pretrain_qwen_next/ds_config_gpu.json
    deepspeed --num_gpus 2 examples/pretrain_qwen_next/train_deepspeed.py --size long256k \
        --config examples/pretrain_qwen_next/ds_config_long256k.json --checkpoint-activations

The model is HF's Qwen3NextForCausalLM (model_config.py) with its GDN layers swapped for flashqla's.
With sequence parallelism (the size's `sequence_parallel`, or --sp) each row is split over SP ranks:
Ulysses runs the softmax attention, flashqla's state-passing CP the GDN layers (exact). Without a
launcher the script initialises a one-process group itself. Checkpoints go to --save-dir (resume with
--resume); the loss curve is written there as loss_curve.png.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import VOCAB_SIZE, load_rows  # noqa: E402
from reporting import Throughput, memory_now, plot_losses, write_summary  # noqa: E402
from model_config import SIZES, hf_config, train_flops_per_token  # noqa: E402

HERE = Path(__file__).resolve().parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps to reach (a resumed run continues)")
    p.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed JSON config")
    p.add_argument("--seq-len", type=int, help="tokens per row (default: the size's)")
    p.add_argument("--sp", type=int, help="sequence-parallel size (default: the size's)")
    p.add_argument("--data", help="your own .jsonl / .txt file or folder (default: the stdlib corpus)")
    p.add_argument("--attn", default="varlen_sdpa", help="HF attn_implementation (flash_attention_2 on GPUs)")
    p.add_argument("--impl", choices=("flashqla", "fla"), default="flashqla",
                   help="GDN layers: flashqla's, or transformers' own Qwen3NextGatedDeltaNet (FLA's kernels when "
                        "flash-linear-attention is installed, else its torch loop; SP 1 only)")
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--save-dir", default="runs/pretrain_qwen_next")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args()


def init_distributed():
    """The launcher's process group, or a one-process group when run as a plain script."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from flashqla.deepspeed import skip_cpu_shm_build

    skip_cpu_shm_build()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def available_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    import psutil

    return psutil.virtual_memory().available


def check_fits(model, seq_len: int, sp: int, config: dict, checkpointing: bool):
    """A rough upper estimate of the memory one rank needs; a clear error instead of an OOM later."""
    params = sum(p.numel() for p in model.parameters())
    half = config.get("bf16", {}).get("enabled", False)
    state = params * (4 + 4 + 8 + (4 if half else 0))  # fp32 weights, grads, Adam moments (+ bf16 copies)
    cfg = model.config
    act_bytes = 2 if half else 4
    tokens = seq_len // sp
    per_layer = 24 * cfg.hidden_size  # mixer projections, conv, norms, MLP inputs: ~24 hidden-sized rows
    layers = 1 if checkpointing else cfg.num_hidden_layers
    activations = tokens * act_bytes * (per_layer * layers + cfg.hidden_size * cfg.num_hidden_layers)
    activations += tokens * cfg.vocab_size * 4 * 3  # logits, their softmax and gradient in fp32
    need, have = state + activations, available_bytes()
    if need > 0.9 * have:
        gib = 2 ** 30
        raise SystemExit(f"size {cfg.hidden_size}x{cfg.num_hidden_layers} with {seq_len}-token rows needs about "
                         f"{need / gib:.1f} GiB per rank ({params / 1e6:.0f}M parameters, {tokens} tokens per rank) "
                         f"but {have / gib:.1f} GiB are free: use a smaller --size or --seq-len, more --sp ranks, "
                         "--checkpoint-activations or ZeRO-3")
    return params


def main():
    started = time.perf_counter()
    args = parse_args()
    init_distributed()
    import deepspeed
    import torch.distributed as dist
    from tqdm import tqdm
    from transformers import Qwen3NextForCausalLM

    import flashqla.deepspeed as fds

    size = SIZES[args.size]
    seq_len = args.seq_len or size.seq_len
    sp = args.sp or size.sequence_parallel
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp:
        raise SystemExit(f"--sp {sp} does not divide the {world} ranks")
    if seq_len % sp:
        raise SystemExit(f"--seq-len {seq_len} does not split over {sp} SP ranks")
    config = fds.load_config(args.config)
    attn = fds.register_varlen_sdpa() if args.attn == "varlen_sdpa" else args.attn

    torch.manual_seed(args.seed)
    model = Qwen3NextForCausalLM(hf_config(args.size, VOCAB_SIZE, attn))
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mpu = None
    if sp > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, attn, sp, micro_batch_size=1)
    if args.impl == "flashqla":
        fds.enable_gdn_sequence_parallel(model, mpu)  # flashqla's GDN layers in, before the optimizer sees parameters
        if torch.cuda.is_available():
            import flashqla

            flashqla.preload_kernels("bf16")  # TileLang's import and the kernel loads now, not in step 1
    elif sp > 1:
        raise SystemExit("--impl fla runs transformers' own GDN layers, which are not sequence parallel: use --sp 1")
    num_params = check_fits(model, seq_len, sp, config, args.checkpoint_activations)
    parameters = [p for p in model.parameters() if p.requires_grad]
    if args.impl == "flashqla":
        engine, *_ = fds.initialize(model=model, config=config, mpu=mpu, model_parameters=parameters)
    else:  # the baseline: plain DeepSpeed around transformers' own GDN layers (flashqla's initialize swaps them)
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=parameters)
    group = None if mpu is None else mpu.get_sequence_parallel_group()
    sp_rank, dp_rank, dp_size = rank % sp, rank // sp, world // sp
    accumulation = engine.gradient_accumulation_steps()

    rows = load_rows(seq_len, args.data, args.seed)
    if rank == 0:
        print(f"data ready ({time.perf_counter() - started:.0f} s after start)")
    save_dir = Path(args.save_dir)
    step, losses = 0, []
    if args.resume:
        path, client_state = engine.load_checkpoint(str(save_dir))
        if path is None:
            raise SystemExit(f"--resume: no checkpoint in {save_dir}")
        step, losses = client_state["step"], client_state["losses"]
    if rank == 0:
        print(f"{args.size}: {num_params / 1e6:.1f}M parameters, {seq_len} tokens per row, SP {sp} x DP {dp_size}, "
              f"{len(rows)} rows of data; steps {step} -> {args.steps}")

    shard = slice(sp_rank * seq_len // sp, (sp_rank + 1) * seq_len // sp)
    bar = tqdm(total=args.steps, initial=step, disable=rank != 0, dynamic_ncols=True)
    tokens_per_step = seq_len * dp_size * accumulation
    throughput = Throughput()
    while step < args.steps:
        start, step_loss = time.perf_counter(), 0.0
        for micro in range(accumulation):
            ids, position_ids, labels = (t[:, shard].to(engine.device)
                                         for t in rows.row((step * accumulation + micro) * dp_size + dp_rank))
            logits = engine(input_ids=ids, position_ids=position_ids).logits
            loss, mean = fds.causal_lm_loss(logits, labels, group)
            engine.backward(loss)
            engine.step()
            step_loss += mean.item() / accumulation
        step += 1
        mean_loss = torch.tensor(step_loss, device=engine.device)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        bar.update(1)
        rate = throughput.add(tokens_per_step, time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", mem=memory_now())
        if step % args.save_every == 0 or step == args.steps:
            engine.save_checkpoint(str(save_dir), tag=f"step{step}", client_state={"step": step, "losses": losses})
    bar.close()
    if rank == 0 and losses:
        first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
        print(f"loss: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
        (save_dir / "losses.json").write_text(json.dumps(losses))
        plot_losses(losses, save_dir / "loss_curve.png", f"pretrain_qwen_next {args.size} (DeepSpeed + {args.impl})")
        write_summary(save_dir / "summary.json", losses=losses, throughput=throughput,
                      flops_per_token=train_flops_per_token(size, VOCAB_SIZE, seq_len), world_size=world,
                      framework="deepspeed", size=args.size, impl=args.impl, seq_len=seq_len, sp=sp, dp=dp_size,
                      zero_stage=config.get("zero_optimization", {}).get("stage", 0))


if __name__ == "__main__":
    main()
