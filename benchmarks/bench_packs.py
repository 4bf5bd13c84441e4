"""Training rows packed with documents, on one GPU: flashqla vs FlashQLA vs FLA, forward and fwd+bwd.

A pretraining row holds documents of many lengths (Megatron's packed THD batches), not the equal sequences of
FlashQLA's published matrix. Each row here is 32768 tokens of lognormal documents in the order drawn
(doc_packs.py, the same draws as the planner's `--sweep packs`), at the (Hqk, Hv) of
bench_bwd's matrix; each implementation runs through its autograd entry point as in bench_bwd (flashqla with
AutoCP, FlashQLA with its AutoCP on, FLA's Triton path), CUDA-graph replays, median of 50; bwd = (fwd+bwd) - fwd.

    python benchmarks/bench_packs.py [--impls flashqla_cp,flash_qla,fla] [--heads 2:4,16:32] [--refuse-peer-jit]
        [--out packs.md] [--png packs.png]

FlashQLA's kernels for these rows are in benchmarks/peer_cache/ (scenarios.py's packed rows); FLA's Triton
kernels specialise on heads and varlen, not on the lengths, so bench_bwd's cover them.
"""
from __future__ import annotations

import argparse
import datetime
import math

# bench_bwd first: it sets FLA's environment defaults before anything imports FLA
from bench_bwd import HEADS, forward_fn, impl_environment, time_impl_noted

import torch  # noqa: E402

from doc_packs import PACK_TOKENS, pack_draws  # noqa: E402
from bench_gdn import grouped_bars, make_inputs, versions  # noqa: E402

NAMES = {"flashqla_cp": "flashqla", "flashqla": "flashqla (CP off)", "fla": "FLA 0.6", "flash_qla": "FlashQLA 0.1.3"}


def pack_rows(heads):
    """(Hqk, Hv, lengths) of every head pair x PACK_DRAWS."""
    return [(Hqk, Hv, seqs) for Hqk, Hv in heads for seqs in pack_draws()]


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def report(rows, impls, vers, notes) -> str:
    """Markdown: a row per pack (our planner's L, each implementation's fwd / bwd / fwd+bwd ms), then the peers'
    time over ours per row and as geomeans (forward, backward, fwd+bwd)."""
    ours, peers = impls[0], impls[1:]
    head = ["Hqk", "Hv", "docs", "longest", "L"] + [f"{NAMES.get(i, i)} fwd / bwd / fwd+bwd ms" for i in impls]
    head += [f"{NAMES.get(p, p)} / {NAMES.get(ours, ours)} (fwd, bwd, fwd+bwd)" for p in peers]
    lines = [f"# Packed training rows ({vers.get('gpu', 'GPU')})", "",
             f"Date: {datetime.date.today()}; {', '.join(f'{k} {v}' for k, v in vers.items())}.", "",
             f"Rows of {PACK_TOKENS} tokens packed with lognormal documents (benchmarks/bench_packs.py), bf16, "
             "K = V = 128, model-like gates, CUDA-graph replays, median of 50; bwd = (fwd+bwd) - fwd. L: the "
             "segment length flashqla's planner chose (0: off).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = {p: ([], [], []) for p in peers}
    for r in rows:
        cells = [r["Hqk"], r["Hv"], len(r["seqs"]), max(r["seqs"]), r["L"]]
        for i in impls:
            t = r.get(i)
            cells.append("n/a" if t is None else f"{t[0]:.3f} / {t[1] - t[0]:.3f} / {t[1]:.3f}")
        for p in peers:
            if r.get(p) and r.get(ours):
                three = [r[p][0] / r[ours][0], (r[p][1] - r[p][0]) / (r[ours][1] - r[ours][0]), r[p][1] / r[ours][1]]
                for acc, x in zip(ratios[p], three):
                    acc.append(x)
                cells.append(" / ".join(f"{x:.2f}x" for x in three))
            else:
                cells.append("n/a")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append("")
    for p, (f, b, fb) in ratios.items():
        if f:
            lines.append(f"Geomean, {NAMES.get(p, p)} time over {NAMES.get(ours, ours)}'s: forward {geomean(f):.2f}x, "
                         f"backward {geomean(b):.2f}x, fwd+bwd {geomean(fb):.2f}x ({len(f)} rows).")
    return "\n".join(lines + [""] + notes + [""])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="flashqla_cp,flash_qla,fla", help="ours first: the ratios are over it")
    ap.add_argument("--heads", default=",".join(f"{a}:{b}" for a, b in HEADS), help="Hqk:Hv pairs")
    ap.add_argument("--refuse-peer-jit", action="store_true",
                    help="FlashQLA's configurations whose TileLang kernels are not cached fail instead of compiling")
    ap.add_argument("--out", default="packs.md")
    ap.add_argument("--png", default=None, help="also a bar chart of the fwd+bwd times")
    args = ap.parse_args()
    from flashqla.cp.plan import resolve_segment_chunks

    impls = args.impls.split(",")
    fns = {impl: forward_fn(impl_environment(impl)[0]) for impl in impls}
    heads = [tuple(int(n) for n in pair.split(":")) for pair in args.heads.split(",")]
    vers, rows, notes = versions(), [], []
    for Hqk, Hv, seqs in pack_rows(heads):
        inputs = make_inputs(Hqk, Hv, seqs)
        do = torch.randn_like(inputs[2])
        L = resolve_segment_chunks("auto", tuple(seqs), Hv, inputs[0].device, "tilelang")
        row = dict(Hqk=Hqk, Hv=Hv, seqs=seqs, L=L)
        for impl, fn in fns.items():
            row[impl], _ = time_impl_noted(impl, fn, inputs, do, 10, True, args.refuse_peer_jit, notes,
                                           f"({Hqk},{Hv}) {len(seqs)} docs")
        rows.append(row)
        fmt = {i: None if row[i] is None else f"{row[i][0]:.3f}/{row[i][1]:.3f}" for i in impls}
        print(f"({Hqk},{Hv}) {len(seqs)} docs, longest {max(seqs)}, L {L}: fwd/fwd+bwd ms {fmt}", flush=True)
        del inputs, do
        torch.cuda.empty_cache()
    text = report(rows, impls, vers, notes)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    if args.png:
        series = [(NAMES.get(i, i), [r[i][1] if r.get(i) else 0 for r in rows]) for i in impls]
        grouped_bars(args.png, [f"({r['Hqk']},{r['Hv']})\n{len(r['seqs'])} docs" for r in rows], series,
                     "fwd+bwd ms (lower is better)", f"GDN on packed 32K rows, {vers.get('gpu', 'GPU')}, bf16",
                     width_per_group=0.7, label_fontsize=6)


if __name__ == "__main__":
    main()
