"""Backward and forward+backward of GDN chunked prefill on one GPU: flashqla vs FLA (Triton) vs FlashQLA.

FlashQLA's published backward matrix: (Hqk, Hv) in {(16,32), (8,16), (4,8), (2,4)} x {8K, 32K} total
tokens x {1, 2, 4, 8} equal sequences, bf16, K = V = 128, model-like gates (bench_gdn.make_inputs).
Each implementation runs through its autograd entry point; "bwd" is (fwd+bwd) - fwd, both medians
timed with CUDA events, the same way for every implementation: eager runs by default (host launch
overheads included, as a training step without CUDA graphs sees them), or with --graphs the forward and
the forward+backward each captured once in a CUDA graph and replayed (the GPU time, as FlashQLA's
published matrix was timed); an implementation that cannot be captured (a host sync) falls back to eager
and the report says so. Also reported: the peak memory the backward adds on top of the forward's saved
tensors.

    python benchmarks/bench_bwd.py [--impls flashqla,flashqla_cp,flashqla_L16,fla,flash_qla] [--heads 4:8,2:4] [--reps 10]
        [--graphs] [--out docs/benchmarks_bwd.md] [--rows-json rows.json] [--merge earlier_rows.json]

A matrix too long for one device call runs in parts (--heads) on the same machine, each part writing
--rows-json; the last part passes the earlier parts' files to --merge and reports (and charts) them all.

flashqla runs with intra-card CP off ("flashqla"), as the planner chooses ("flashqla_cp"), or with segments of n
chunks forced ("flashqla_L<n>", e.g. flashqla_L8,flashqla_L16,flashqla_L32 to sweep what the planner picks from).
An implementation may name environment variables it runs under, after an @ (several joined by +): e.g.
`--impls flashqla_cp,flashqla_cp@FLASHQLA_GQA_PAIR_SUM=0,flash_qla` times flashqla's default backward and the
one without the GQA pair sums side by side in one process (the variables are set around its forward and
backward only, so the other implementations do not see them).

FlashQLA 0.1.3 JIT-compiles its backward for minutes on first use per configuration: on a short device
session carry its kernels prebuilt on a CPU machine (benchmarks/peer_cache/, which covers this matrix), and pass
--refuse-peer-jit: a configuration whose FlashQLA kernel the cache lacks then fails at once (a note in the
report) instead of compiling for up to two minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")
# FLA's Triton chunk_bwd_dqkwg raises on Hopper with Triton 3.4-3.7 (fla#640) unless FLA's TileLang
# backend takes it: keep FLA's backend dispatch on here (bench_gdn turns it off for the forward)
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "0")

import torch  # noqa: E402

from bench_gdn import (as_int64, eager_median_ms, graph_median_ms, grouped_bars, impl_fla, make_inputs,  # noqa: E402
                       versions)
from floors import backward_floors_us, measure_peaks  # noqa: E402

HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]
TOKENS = [8192, 32768]
SEQS = [1, 2, 4, 8]


def flashqla_intra_cp(impl: str):
    """The `intra_cp` of a flashqla implementation name: "flashqla" off, "flashqla_cp" "auto" (as the planner
    chooses), "flashqla_L<n>" segments of n chunks forced (a sweep of the planner's choice); None for a peer."""
    if impl in ("flashqla", "flashqla_cp"):
        return "auto" if impl == "flashqla_cp" else "off"
    if impl.startswith("flashqla_L"):
        chunks = impl[len("flashqla_L"):]
        if not chunks.isdigit() or int(chunks) < 1:
            raise ValueError(f"{impl!r}: flashqla_L takes a segment length in chunks, e.g. flashqla_L16")
        return int(chunks)
    return None


def forward_fn(impl):
    """impl -> f(q, k, v, g, beta, cu) -> o, through the implementation's autograd entry point."""
    intra_cp = flashqla_intra_cp(impl)
    if intra_cp is not None:
        import flashqla

        return lambda q, k, v, g, beta, cu: flashqla.chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, backend="tilelang", intra_cp=intra_cp)[0]
    if impl == "fla":
        run = impl_fla()  # FLA's public op, with the host copy of cu_seqlens its varlen path reads
        return lambda q, k, v, g, beta, cu: run(q, k, v, g, beta, cu)[0]
    if impl == "flash_qla":
        import flash_qla

        return lambda q, k, v, g, beta, cu: flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=as_int64(cu))[0]
    raise ValueError(impl)


def impl_environment(impl: str) -> tuple[str, dict]:
    """'name@VAR=value+VAR2=value2' -> ('name', {VAR: value, VAR2: value2}); a plain name has none."""
    name, _, settings = impl.partition("@")
    env = {}
    for setting in filter(None, settings.split("+")):
        var, sep, value = setting.partition("=")
        if not sep or not var:
            raise ValueError(f"{impl!r}: environment settings are VAR=value, joined by +")
        env[var] = value
    return name, env


@contextlib.contextmanager
def environment(env: dict):
    """os.environ with `env` set inside, restored on the way out."""
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


class JITRefused(RuntimeError):
    """A TileLang kernel was about to be compiled where only cached kernels are allowed."""


@contextlib.contextmanager
def tilelang_compiles_refused(who: str):
    """Inside, a TileLang kernel that is not in the disk cache raises JITRefused instead of compiling (loads from
    the cache are unaffected): a peer whose carried kernels miss a configuration fails in a second."""
    from tilelang.jit.kernel import JITKernel

    compile_kernel = JITKernel._compile_and_create_adapter

    def refuse(self, *args, **kwargs):
        raise JITRefused(f"{who}: a TileLang kernel is not in the cache (it would JIT-compile)")

    JITKernel._compile_and_create_adapter = refuse
    try:
        yield
    finally:
        JITKernel._compile_and_create_adapter = compile_kernel


def time_impl_noted(impl, fn, inputs, do, reps, graphs, refuse_peer_jit, notes, config):
    """time_impl of one implementation under its environment (FlashQLA's TileLang compiles refused with
    refuse_peer_jit) -> (its times or None, seconds taken); a failure and a first call over 30 s become notes."""
    start = time.perf_counter()
    guard = tilelang_compiles_refused(impl) if refuse_peer_jit and impl == "flash_qla" else contextlib.nullcontext()
    try:
        with guard, environment(impl_environment(impl)[1]):
            times = time_impl(fn, inputs, do, reps, graphs, notes, f"{impl} {config}")
    except Exception as exc:
        notes.append(f"- {impl} failed on {config}: {exc.__class__.__name__}: {str(exc)[:160]}")
        print(notes[-1], flush=True)
        return None, round(time.perf_counter() - start, 1)
    seconds = round(time.perf_counter() - start, 1)
    if seconds > 30:
        notes.append(f"- {impl} {config}: {seconds:.0f} s incl. JIT")
    return times, seconds


def time_impl(fwd, inputs, do, reps, graphs=False, notes=None, label=""):
    """(fwd ms, fwd+bwd ms, peak MiB). graphs: CUDA-graph replay, eager where capture fails (noted)."""
    q, k, v, g, beta, cu = inputs
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]

    def fwd_only():
        with torch.no_grad():
            fwd(*leaves, cu)

    def fwd_bwd():
        torch.autograd.grad(fwd(*leaves, cu), leaves, do)

    fwd_bwd()  # compile / warm up
    torch.cuda.synchronize()
    times = []
    for fn in (fwd_only, fwd_bwd):
        if graphs:
            try:
                times.append(graph_median_ms(fn, max(reps, 50)))
                continue
            except Exception as exc:  # a host sync inside: capture is rejected
                torch.cuda.synchronize()
                if notes is not None:
                    notes.append(f"- {label} {fn.__name__}: eager (capture failed: {exc.__class__.__name__}: "
                                 f"{str(exc)[:100]})")
                    print(notes[-1], flush=True)
        times.append(eager_median_ms(fn, reps))
    t_fwd, t_all = times
    # peak memory of one fwd+bwd above what is allocated before it (inputs, leaves' grads)
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return t_fwd, t_all, (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="flashqla,fla")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="docs/benchmarks_bwd.md")
    ap.add_argument("--png", default=None, help="also a bar chart of the backward times")
    ap.add_argument("--quick", action="store_true", help="(16,32) and (2,4) at 8K and 32K, one sequence")
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (GPU time) instead of eager runs")
    ap.add_argument("--heads", default=None, help="Hqk:Hv pairs of the matrix to run, e.g. 4:8,2:4 (default: all)")
    ap.add_argument("--refuse-peer-jit", action="store_true",
                    help="FlashQLA's configurations whose TileLang kernels are not cached fail instead of compiling")
    ap.add_argument("--rows-json", default="", help="write the finished rows and notes here after every config (a "
                    "run cut short keeps what it measured)")
    ap.add_argument("--merge", action="append", default=[], help="--rows-json of an earlier run of other configs "
                    "(same machine, versions and --impls) to report with this run's; its configs are not run again; "
                    "repeatable")
    args = ap.parse_args()
    impls = args.impls.split(",")
    fns, notes = {}, []
    for impl in impls:
        try:
            fns[impl] = forward_fn(impl_environment(impl)[0])
        except Exception as exc:
            notes.append(f"- {impl} unavailable: {exc.__class__.__name__}: {exc}")
    vers, peaks = versions(), measure_peaks(eager_median_ms)
    print(f"peaks: {peaks.describe()}", flush=True)
    notes.append(f"- floors (benchmarks/floors.py) at the peaks: {peaks.describe()}")
    rows, earlier_notes = merged_run(args.merge)
    notes += earlier_notes
    timing = "CUDA-graph replays, median of 50" if args.graphs else f"eager, median of {args.reps}"
    heads, seqs = ([(16, 32), (2, 4)], [1]) if args.quick else (HEADS, SEQS)
    if args.heads:
        heads = [tuple(int(n) for n in pair.split(":")) for pair in args.heads.split(",")]
    for Hqk, Hv in heads:
        for T in TOKENS:
            for n in seqs:
                if any(config_key(r) == (Hqk, Hv, T, n) for r in rows):
                    continue
                inputs = make_inputs(Hqk, Hv, [T // n] * n)
                do = torch.randn_like(inputs[2])
                row = dict(Hqk=Hqk, Hv=Hv, T=T, n=n, floors=backward_floors_us(Hqk, Hv, T, peaks))
                seconds = {}
                for impl, fn in fns.items():
                    row[impl], seconds[impl] = time_impl_noted(impl, fn, inputs, do, args.reps, args.graphs,
                                                               args.refuse_peer_jit, notes, f"({Hqk},{Hv}) {T}x{n}")
                rows.append(row)
                rows.sort(key=matrix_order)
                if args.rows_json:
                    with open(args.rows_json, "w") as f:
                        json.dump(dict(rows=rows, notes=notes), f)
                fmt = {k: (None if v is None else tuple(round(x, 3) for x in v)) for k, v in row.items() if k in fns}
                print(f"({Hqk:2d},{Hv:2d}) {T:6d} x{n}: (fwd ms, fwd+bwd ms, peak MiB) {fmt} (s: {seconds})", flush=True)
                del inputs, do
                torch.cuda.empty_cache()
                write_report(args.out, rows, list(fns), vers, notes, timing)  # a cut-off run keeps its rows
    report = write_report(args.out, rows, list(fns), vers, notes, timing)
    if args.png:
        plot(args.png, rows, list(fns), "CUDA graphs" if args.graphs else "eager", vers["gpu"])
    print(report)


def config_key(row) -> tuple[int, int, int, int]:
    return row["Hqk"], row["Hv"], row["T"], row["n"]


def matrix_order(row) -> tuple:
    """Rows in the matrix's order (HEADS, then tokens, then sequences); heads outside HEADS after them."""
    Hqk, Hv, T, n = config_key(row)
    return (HEADS.index((Hqk, Hv)) if (Hqk, Hv) in HEADS else len(HEADS), Hqk, Hv, T, n)


def merged_run(paths) -> tuple[list[dict], list[str]]:
    """The rows and notes of earlier runs' --rows-json files; a config in two of them keeps the later file's
    row."""
    by_config, notes = {}, []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        by_config.update((config_key(r), r) for r in run["rows"])
        notes += [note for note in run["notes"] if note not in notes]
    return sorted(by_config.values(), key=matrix_order), notes


def write_report(path, rows, impls, vers, notes, timing="eager"):
    """Markdown table of every row, then the backward and fwd+bwd speed-ups of each flashqla variant over
    each peer (FLA, FlashQLA) per row and as geomeans. A row's `floors` (memory us, tensor-core us: floors.py)
    give the backward's floor and how far the first flashqla variant's backward is above the higher one."""
    ours = [i for i in impls if i.startswith("flashqla")]
    peers = [i for i in impls if i in ("fla", "flash_qla")]
    pairs = [(a, b) for a in ours for b in peers]
    lines = [f"# Backward benchmark ({vers.get('gpu', 'GPU')})", "",
             f"Date: {datetime.date.today()}; {', '.join(f'{k} {v}' for k, v in vers.items())}.", "",
             f"bf16, K = V = 128, model-like gates; {timing} (benchmarks/bench_bwd.py). bwd = (fwd+bwd) - fwd. "
             "peak = memory one fwd+bwd allocates above the inputs. Ratios: peer time / flashqla time, backward "
             "(fwd+bwd). Floor: the backward's memory / tensor-core floors in us, and the first flashqla "
             "column's backward over the higher of them.", "",
             "| Hqk | Hv | tokens | seqs | " + " | ".join(f"{i} bwd ms | {i} fwd+bwd ms | {i} peak MiB" for i in impls)
             + "".join(f" | {b} / {a}" for a, b in pairs) + " | bwd floor us (mem / MMA) | x floor |",
             "|" + "---|" * (6 + 3 * len(impls) + len(pairs))]
    ratios = {pair: ([], []) for pair in pairs}
    for r in rows:
        cells = []
        for i in impls:
            t = r.get(i)
            cells += ["n/a"] * 3 if t is None else [f"{t[1] - t[0]:.3f}", f"{t[1]:.3f}", f"{t[2]:.0f}"]
        for a, b in pairs:
            if r.get(a) and r.get(b):
                bwd, both = (r[b][1] - r[b][0]) / (r[a][1] - r[a][0]), r[b][1] / r[a][1]
                ratios[(a, b)][0].append(bwd)
                ratios[(a, b)][1].append(both)
                cells.append(f"{bwd:.2f}x ({both:.2f}x)")
            else:
                cells.append("n/a")
        floors = r.get("floors")
        cells.append("n/a" if floors is None else f"{floors[0]:.0f} / {floors[1]:.0f}")
        t = r.get(ours[0]) if ours else None
        cells.append("n/a" if floors is None or t is None else f"{(t[1] - t[0]) * 1e3 / max(floors):.1f}x")
        lines.append(f"| {r['Hqk']} | {r['Hv']} | {r['T']} | {r['n']} | " + " | ".join(cells) + " |")
    lines.append("")
    for (a, b), (bwd, both) in ratios.items():
        if bwd:
            geo = [math.exp(sum(math.log(x) for x in xs) / len(xs)) for xs in (bwd, both)]
            lines.append(f"Geomean speed-up of {a} over {b}: backward {geo[0]:.2f}x, fwd+bwd {geo[1]:.2f}x "
                         f"({len(bwd)} configs).")
    lines += ["", *notes, ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return "\n".join(lines)


def plot(path, rows, impls, timing="eager", device="GPU"):
    """Bar chart of every row's backward ms (fwd+bwd - fwd) per implementation; `timing` names how they
    were timed, `device` where (the title)."""
    names = {"flashqla": "flashqla (CP off)", "flashqla_cp": "flashqla", "fla": "FLA 0.6",
             "flash_qla": "FlashQLA 0.1.3"}
    series = [(names.get(impl, impl), [r[impl][1] - r[impl][0] if r.get(impl) else 0 for r in rows]) for impl in impls]
    grouped_bars(path, [f"({r['Hqk']},{r['Hv']})\n{r['T'] // 1024}K x{r['n']}" for r in rows], series,
                 "backward ms (lower is better)", f"GDN backward, {device}, bf16, K = V = 128, {timing}",
                 width_per_group=0.55, label_fontsize=6)


if __name__ == "__main__":
    main()
