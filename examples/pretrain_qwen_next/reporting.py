"""What both training scripts show a person: memory in use and the loss curve."""
from __future__ import annotations

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
