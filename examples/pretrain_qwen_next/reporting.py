"""What both training scripts show a person: memory in use, throughput and MFU, the loss curve."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch


def memory_now() -> str:
    """Peak GPU memory, or the process's resident memory on CPU."""
    if torch.cuda.is_available():
        return f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f}G"
    import psutil

    return f"{psutil.Process().memory_info().rss / 2 ** 30:.1f}G"


def plot_losses(losses: list[float], path: Path, title: str) -> None:
    """Raw per-step losses and a 20-step moving average, saved as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install matplotlib)")
        return
    steps = range(1, len(losses) + 1)
    window = min(20, len(losses))
    smooth = [sum(losses[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, losses, alpha=0.35, label="per step")
    ax.plot(steps, smooth, label=f"{window}-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curve: {path}")


# dense bf16 tensor-core peak used for MFU (H200 / H100 SXM spec sheet); None on other devices
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


class Throughput:
    """Tokens per second of every step; the summary skips the first `warmup` steps (compiles, allocator)."""

    def __init__(self, warmup: int = 5):
        self.warmup = warmup
        self.rates: list[float] = []

    def add(self, tokens: int, seconds: float) -> float:
        self.rates.append(tokens / seconds)
        return self.rates[-1]

    def median(self) -> float | None:
        steady = self.rates[self.warmup:] or self.rates
        return statistics.median(steady) if steady else None


def write_summary(path: Path, *, losses: list[float], throughput: Throughput, flops_per_token: float,
                  world_size: int, **fields) -> dict:
    """summary.json of a run (what the closing notes and docs/benchmarks.md quote) and one printed line.

    MFU = tokens/s x model FLOPs per token / (GPUs x peak bf16 FLOP/s), tokens/s over the whole job.
    """
    tokens_s = throughput.median()
    peak = peak_flops()
    mfu = tokens_s * flops_per_token / (world_size * peak) if tokens_s and peak else None
    summary = {
        **fields,
        "steps": len(losses),
        "loss_first10": sum(losses[:10]) / max(1, len(losses[:10])),
        "loss_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "tokens_per_s": tokens_s,
        "steps_measured": max(0, len(throughput.rates) - throughput.warmup),
        "model_flops_per_token": flops_per_token,
        "mfu": mfu,
        "peak_memory": memory_now(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "world_size": world_size,
        "torch": torch.__version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    mfu_text = f", MFU {100 * mfu:.1f}% of {peak / 1e12:.0f} TFLOP/s x {world_size}" if mfu else ""
    print(f"throughput: {tokens_s:,.0f} tokens/s (median of steady steps){mfu_text}; summary: {path}")
    return summary
