"""Training rows packed with documents: the rows the planner's `--sweep packs` (bench_autocp.py), bench_packs.py and
FlashQLA's prebuilt kernels for them (peer_cache/scenarios.py) share. No torch import: the CPU-side kernel builds
read it too."""
from __future__ import annotations

import random

PACK_TOKENS = 32768
# (log of the median document length in tokens, seed) of each packed row
PACK_DRAWS = ((5.5, 11), (6.0, 1), (6.5, 7), (7.0, 2), (7.0, 5), (8.0, 3))


def document_pack(tokens: int, median_log: float, seed: int, sigma: float = 1.5) -> list[int]:
    """A training row of `tokens` packed with documents of lognormal length (median e^median_log tokens, log
    standard deviation sigma) in the order drawn; the last document is cut at the row's end."""
    draw = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(tokens - sum(lengths), max(1, int(draw.lognormvariate(median_log, sigma)))))
    return lengths


def pack_draws(tokens: int = PACK_TOKENS) -> list[list[int]]:
    """Every PACK_DRAWS row."""
    return [document_pack(tokens, median_log, seed) for median_log, seed in PACK_DRAWS]
