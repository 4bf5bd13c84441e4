"""Side by side: the runs of scripts/device_training.sh (their summary.json and losses.json in OUT_DIR).

    python scripts/compare_runs.py OUT_DIR NAME [NAME ...]

Prints steps, tokens/s, MFU, peak memory and the last-10-step loss of each run, then every run's loss
curve against the first run's over their common steps: mean and max |difference| (bf16 runs of the same
data and seed should agree to a few hundredths of a nat early on and drift slowly).
"""
import json
import sys
from pathlib import Path


def load(out: Path, name: str):
    summary = out / f"{name}.summary.json"
    losses = out / f"{name}.losses.json"
    return (json.loads(summary.read_text()) if summary.exists() else None,
            json.loads(losses.read_text()) if losses.exists() else None)


def main(out: str, *names: str) -> None:
    out = Path(out)
    runs = {name: load(out, name) for name in names}
    print(f"{'run':22s} {'steps':>5s} {'tokens/s':>10s} {'MFU':>6s} {'peak mem':>9s} {'loss last10':>11s}")
    for name, (summary, _) in runs.items():
        if summary is None:
            print(f"{name:22s} (no summary: the run failed or timed out, see {name}.log)")
            continue
        mfu = f"{100 * summary['mfu']:.1f}%" if summary.get("mfu") else "n/a"
        print(f"{name:22s} {summary['steps']:5d} {summary['tokens_per_s'] or 0:10,.0f} {mfu:>6s} "
              f"{summary['peak_memory']:>9s} {summary['loss_last10']:11.4f}")
    base_name, (_, base) = names[0], runs[names[0]]
    for name in names[1:]:
        losses = runs[name][1]
        if base is None or losses is None:
            continue
        n = min(len(base), len(losses))
        diffs = [abs(a - b) for a, b in zip(base[:n], losses[:n])]
        if n:
            print(f"{name} vs {base_name}: {n} common steps, mean |dloss| {sum(diffs) / n:.4f}, "
                  f"max {max(diffs):.4f} (step {diffs.index(max(diffs)) + 1})")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
