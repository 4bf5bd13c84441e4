"""Forward GDN chunked prefill on one GPU: flashqla (TileLang) vs FLA (Triton) vs FlashQLA, one process.

Each implementation is warmed up (compiles), captured once in a CUDA graph and replayed; the time is the
median over --reps replays measured with CUDA events (eager when a peer syncs with the host), taken in rounds
that visit every implementation of a config in turn (`interleaved_medians_ms`, since 2026-12-07). Columns:
flashqla split and fused kernels (CP off), the public op with AutoCP, a forced segment-length sweep
(--cp-sweep), FLA's Triton path (no intra-card CP), FlashQLA with auto_cp off and on. Inputs are model-like (q, k L2-normalised, beta = sigmoid(randn),
g = -A softplus(x + 1) with A ~ U(0.01, 16), a quarter of the heads at g = 0), bf16, K = V = 128.

    python benchmarks/bench_gdn.py [--flashqla-configs all|none|0,3] [--out docs/benchmarks.md]

FlashQLA JIT-compiles for ~30 s (forward) per head/varlen configuration on first use, so by default it is
timed on the first configuration only; FLA_FLASH_QLA=0 and FLA_DISABLE_BACKEND_DISPATCH=1 keep FLA on Triton.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import os
import statistics
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from floors import D, forward_floors_us, measure_peaks  # noqa: E402

# (name, Hqk, Hv, sequence lengths): design doc §6 plus two equal-length batches
CONFIGS = [
    ("397B TP8", 2, 8, [32768]),
    ("397B TP8", 2, 8, [16384]),
    ("397B TP8", 2, 8, [24576, 8192]),
    ("397B TP4", 4, 16, [32768]),
    ("397B TP4", 4, 16, [16384]),
    ("27B TP2", 8, 24, [32768]),
    ("2B TP1", 16, 16, [32768]),
    ("Sym h32", 32, 32, [32768]),
    ("397B TP8", 2, 8, [4096] * 8),
    ("397B TP1", 16, 64, [8192] * 4),
]


def make_inputs(Hqk, Hv, lengths, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    randn = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q = F.normalize(randn(1, T, Hqk, D), dim=-1).bfloat16()
    k = F.normalize(randn(1, T, Hqk, D), dim=-1).bfloat16()
    v = randn(1, T, Hv, D).bfloat16()
    beta = torch.sigmoid(randn(1, T, Hv)).bfloat16()
    A = torch.empty(Hv, device="cuda").uniform_(0.01, 16, generator=gen)
    g = -A * F.softplus(randn(1, T, Hv) + 1.0)
    g[..., : Hv // 4] = 0.0
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, g, beta, cu


def sequences_label(seqs):
    """"4096x8" for 8 sequences of 4096 tokens, "24576+8192" for unequal ones, "20480+512x24" for a run of equal
    ones among others."""
    if len(set(seqs)) == 1:
        return f"{seqs[0]}x{len(seqs)}"
    runs = [(length, len(list(run))) for length, run in itertools.groupby(seqs)]
    return "+".join(str(length) if count == 1 else f"{length}x{count}" for length, count in runs)


@functools.lru_cache(maxsize=8)
def as_int64(cu):
    """The same int64 copy of `cu` on every call. FLA and FlashQLA plan on the host and cache the plan per
    cu_seqlens tensor (FLA's tensor_cache, which asserts on a miss inside a graph capture): with one tensor
    the warm-up fills that cache and the capture finds it (a fresh cu.long() per call kept FlashQLA out of
    every capture until the tenth session, so it was timed eagerly)."""
    return cu.long()


def event_ms(run) -> float:
    """One call of `run` between two CUDA events, waited for."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def eager_median_ms(fn, reps):
    return statistics.median(event_ms(fn) for _ in range(reps))


def captured_graph(fn) -> torch.cuda.CUDAGraph:
    """fn() warmed up (kernels loaded, plans cached) and captured in a CUDA graph on a side stream."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    return graph


ROUNDS = 5  # interleaved timing rounds per config (interleaved_medians_ms)


def interleaved_medians_ms(fns: dict, reps: int, rounds: int = ROUNDS):
    """(medians, eager): the median ms of each of `fns` (name -> zero-argument call) over `reps` timed calls, CUDA-graph
    replays (eager calls where the capture fails: `eager` maps those names to the reason), taken in `rounds` rounds
    that visit every implementation in turn, so that none is always timed right after another's heavier replays.
    Timed one after the other, the AutoCP forward at TP8 1 x 32K took 0.253 ms after the config's 0.75-1.3 ms CP-off
    graphs and 0.244 ms timed alone on the same H100 (docs/kernels.md, "Sixty-first session")."""
    runners, eager = {}, {}
    for name, fn in fns.items():
        try:
            runners[name] = captured_graph(fn).replay
        except Exception as exc:  # an implementation that syncs with the host cannot be captured
            torch.cuda.synchronize()
            runners[name], eager[name] = fn, f"{exc.__class__.__name__}: {str(exc)[:80]}"
        for _ in range(10):
            runners[name]()
    times = {name: [] for name in runners}
    per_round = -(-reps // rounds)
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].extend(event_ms(run) for _ in range(per_round))
    return {name: statistics.median(t) for name, t in times.items()}, eager


def graph_median_ms(fn, reps):
    graph = captured_graph(fn)
    for _ in range(10):
        graph.replay()
    return statistics.median(event_ms(graph.replay) for _ in range(reps))


def impl_flashqla(fused=False):
    # the kernels' entry point: the public op validates cu_seqlens on the host (a sync that a CUDA graph
    # capture rejects); FlashQLA is likewise timed through its internal forward. fused=False: the three
    # split kernels (kept for comparison); True: the single-walk fused_fwd, the forward's own path
    from flashqla.kernels.hopper import chunk_gdn_fwd

    def run(q, k, v, g, beta, cu):
        return chunk_gdn_fwd(q, k, v, g, beta, D ** -0.5, None, False, cu, fused=fused)
    return run


def impl_flashqla_fused():
    return impl_flashqla(fused=True)


def impl_flashqla_segments(segment_chunks):
    import flashqla

    def run(q, k, v, g, beta, cu):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="tilelang",
                                               intra_cp=segment_chunks)
    return run


def impl_flashqla_autocp():
    # the public op (tilelang backend) with intra-card CP planned by flashqla.cp.plan; cu_seqlens is
    # validated on the host once per tensor (cached), so the warmed-up call can be graph-captured
    import flashqla

    def run(q, k, v, g, beta, cu):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="tilelang", intra_cp="auto")
    return run


def planned_segment_chunks(Hv, seqs):
    from flashqla.cp.plan import resolve_segment_chunks

    return resolve_segment_chunks("auto", tuple(seqs), Hv, torch.device("cuda"), "tilelang")


def impl_fla():
    import inspect

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    has_cpu_cu = "cu_seqlens_cpu" in inspect.signature(chunk_gated_delta_rule).parameters
    host_copy = functools.lru_cache(maxsize=4)(lambda cu: cu.long().cpu())  # outside any graph capture

    def run(q, k, v, g, beta, cu):
        if cu.numel() == 2:  # one sequence: the dense path, which needs no host copy of cu_seqlens
            return chunk_gated_delta_rule(q, k, v, g, beta)
        extra = {"cu_seqlens_cpu": host_copy(cu)} if has_cpu_cu else {}
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=as_int64(cu), **extra)
    return run


def impl_flash_qla(auto_cp=False):
    import inspect

    from flash_qla import chunk_gated_delta_rule_fwd

    params = inspect.signature(chunk_gated_delta_rule_fwd).parameters
    cp = {"auto_cp": auto_cp} if "auto_cp" in params else {}

    def run(q, k, v, g, beta, cu):
        return chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=D ** -0.5, cu_seqlens=as_int64(cu),
                                          output_final_state=False, **cp)
    return run


def impl_flash_qla_cp():
    return impl_flash_qla(auto_cp=True)


def load_impls(impls, skip=""):
    """({key: run function} of the implementations that load, report notes): those named in `skip`
    (comma-separated) are left out, one missing from this machine is noted, not fatal."""
    loaded, notes = {}, []
    skipped = {x for x in skip.split(",") if x}
    for key, make in impls.items():
        if key in skipped:
            notes.append(f"- {key} left out (--skip)")
            continue
        try:
            loaded[key] = make()
        except Exception as exc:  # a peer missing from this machine is reported, not fatal
            notes.append(f"- {key} unavailable: {exc.__class__.__name__}: {exc}")
    return loaded, notes


def versions():
    import importlib.metadata as md

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
    for dist in ("tilelang", "flash-linear-attention", "fla-core", "flash-qla", "triton"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def write_report(path, rows, vers, notes, peaks):
    """Markdown table of every row (floors at `peaks`, floors.Peaks) with the speed-ups, then the notes."""
    lines = [
        f"# Forward benchmark ({vers.get('gpu', 'GPU')})", "",
        f"Date: {datetime.date.today()}; {', '.join(f'{k} {v}' for k, v in vers.items())}.", "",
        "bf16, K = V = 128, forward only, CUDA graph replay where the implementation can be captured, median of "
        f"the replays, taken in {ROUNDS} rounds over a config's implementations in turn (benchmarks/bench_gdn.py). "
        "Floors (benchmarks/floors.py): inputs + output once at "
        f"{peaks.copy_bytes_per_s / 1e12:.2f} TB/s; chunked-form tensor-core FLOPs at "
        f"{peaks.bf16_flop_per_s / 1e12:.0f} TFLOP/s ({peaks.source}).", "",
        "flashqla = the split decomposition (wy_inverse, chunk_states, chunk_output; kept for comparison); "
        "fused = the single-walk kernel, the forward's own path with CP off; "
        "+CP = the public op with intra_cp='auto' (L = chunks per segment the planner chose, 0 = off); "
        "sweep = the fastest forced segment length (the AutoCP calibration); best = the fastest flashqla column.", "",
        "FlashQLA: CP off / its AutoCP on (timed on the --flashqla-configs only).", "",
        "| config | Hqk | Hv | seqlens | flashqla ms | fused ms | +CP ms (L) | sweep ms (L) | FLA ms | FlashQLA ms | FlashQLA+CP ms | best vs FLA | best vs FlashQLA | best vs FlashQLA+CP | mem floor us | MMA floor us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    ratio = lambda a, b: "n/a" if a is None or b is None else f"{b / a:.2f}x"  # noqa: E731
    for r in rows:
        sweep = r.get("sweep") or {}
        best_L = min(sweep, key=sweep.get) if sweep else None
        r["sweep_best"] = sweep.get(best_L)
        r["best"] = min([t for t in (r["flashqla"], r.get("flashqla_fused"), r["flashqla_cp"], r["sweep_best"]) if t],
                        default=None)
        lines.append(f"| {r['name']} | {r['Hqk']} | {r['Hv']} | {r['seqs']} | {fmt(r['flashqla'])} | "
                     f"{fmt(r.get('flashqla_fused'))} | {fmt(r['flashqla_cp'])} ({r['L']}) | "
                     f"{fmt(r['sweep_best'])} ({best_L}) | {fmt(r['fla'])} | {fmt(r['flash_qla'])} | "
                     f"{fmt(r.get('flash_qla_cp'))} | {ratio(r['best'], r['fla'])} | {ratio(r['best'], r['flash_qla'])} | "
                     f"{ratio(r['best'], r.get('flash_qla_cp'))} | "
                     f"{r['mem_us']:.0f} | {r['mma_us']:.0f} |")
    if any(r.get("sweep") for r in rows):
        lines += ["", "Segment-length sweep (ms, forced intra_cp=L):", ""]
        for r in rows:
            if r.get("sweep"):
                lines.append(f"- {r['name']} {r['seqs']} (Hv {r['Hv']}): "
                             + ", ".join(f"L={L}: {t:.3f}" for L, t in sorted(r["sweep"].items())))
    for key, label in (("fla", "FLA"), ("flash_qla", "FlashQLA"), ("flash_qla_cp", "FlashQLA with AutoCP")):
        for col, what in (("flashqla_cp", "the public op, AutoCP"), ("best", "the best flashqla column")):
            pairs = [(r[col], r.get(key)) for r in rows if r[col] and r.get(key)]
            if pairs:
                geo = math.exp(sum(math.log(b / a) for a, b in pairs) / len(pairs))
                lines.append(f"\nGeomean speedup of flashqla ({what}) over {label}: {geo:.2f}x over {len(pairs)} configs.")
    lines += ["", *notes, ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return "\n".join(lines)


def merged_rows(paths) -> list[dict]:
    """The rows of earlier runs' --rows-json files, in config order; a config measured in two of them keeps
    the later file's row."""
    by_index = {}
    for path in paths:
        with open(path) as f:
            by_index.update((row["index"], row) for row in json.load(f))
    return [by_index[i] for i in sorted(by_index)]


def grouped_bars(path, labels, series, ylabel, title, width_per_group=1.2, label_fontsize=7):
    """A bar chart with one group per label and one bar per (name, values) of `series` in each, saved as PNG
    (bench_bwd.py draws its chart with it too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, width_per_group * len(labels)), 4.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=label_fontsize)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(path, rows, device):
    """Bars per config: flashqla with CP off and with AutoCP beside the peers (series nobody timed left out)."""
    series = [(label, [r.get(key) or 0 for r in rows]) for key, label in (
        ("flashqla_fused", "flashqla, CP off"), ("flashqla_cp", "flashqla, AutoCP"), ("fla", "FLA 0.6 Triton"),
        ("flash_qla", "FlashQLA 0.1.3, CP off"), ("flash_qla_cp", "FlashQLA 0.1.3, AutoCP"))
        if any(r.get(key) for r in rows)]
    grouped_bars(path, [f"{r['name']}\n{r['seqs']}" for r in rows], series, "forward ms (lower is better)",
                 f"GDN forward, {device}, bf16, K = V = 128")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--flashqla-configs", default="0", help="FlashQLA config indices ('all', 'none', '0,3')")
    ap.add_argument("--configs", default="all", help="config indices to run ('all' or '0,3')")
    ap.add_argument("--skip", default="", help="implementations to leave out, e.g. 'fla' (its Triton forward compiles "
                    "for about 40 s per shape)")
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--png", default="docs/benchmarks_fwd.png")
    ap.add_argument("--rows-json", default="", help="write the finished rows here after every config (a run cut "
                    "short keeps what it measured)")
    ap.add_argument("--merge", action="append", default=[], help="rows JSON of an earlier run of other configs "
                    "(same machine and versions) to report with this run's; repeatable")
    ap.add_argument("--cp-sweep", default="", help="segment lengths in chunks to time on configs with <= 4 "
                    "sequences, e.g. 8,16,32,64 (the AutoCP calibration sweep)")
    args = ap.parse_args()
    pick = lambda spec, n: set(range(n)) if spec == "all" else set() if spec == "none" else {int(x) for x in spec.split(",")}  # noqa: E731
    run_idx = pick(args.configs, len(CONFIGS))
    fq_idx = pick(args.flashqla_configs, len(CONFIGS))

    impls = {"flashqla": impl_flashqla, "flashqla_fused": impl_flashqla_fused, "flashqla_cp": impl_flashqla_autocp,
             "fla": impl_fla, "flash_qla": impl_flash_qla, "flash_qla_cp": impl_flash_qla_cp}
    sweep = [int(x) for x in args.cp_sweep.split(",") if x]
    loaded, notes = load_impls(impls, args.skip)

    rows = merged_rows(args.merge)
    peaks = measure_peaks(eager_median_ms)
    print(f"peaks: {peaks.describe()}", flush=True)
    for i, (name, Hqk, Hv, seqs) in enumerate(CONFIGS):
        if i not in run_idx or any(r.get("index") == i for r in rows):
            continue
        inputs = make_inputs(Hqk, Hv, seqs)
        mem_us, mma_us = forward_floors_us(Hqk, Hv, sum(seqs), peaks)
        seq_label = sequences_label(seqs)
        row = dict(index=i, name=name, Hqk=Hqk, Hv=Hv, seqs=seq_label, mem_us=mem_us, mma_us=mma_us,
                   L=planned_segment_chunks(Hv, seqs))
        fns = {}
        for key in impls:
            row[key] = None
            if key not in loaded or (key.startswith("flash_qla") and i not in fq_idx):
                continue
            try:
                start = time.perf_counter()
                loaded[key](*inputs)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                fns[key] = functools.partial(loaded[key], *inputs)
                if first > 5:
                    notes.append(f"- {key} first call on {name} {seq_label}: {first:.1f} s (JIT compile)")
            except Exception as exc:
                notes.append(f"- {key} failed on {name} {seq_label}: {exc.__class__.__name__}: {str(exc)[:200]}")
        medians, eager = interleaved_medians_ms(fns, args.reps)
        row.update(medians)
        notes.extend(f"- {key} on {name} {seq_label}: timed without CUDA graph ({why})" for key, why in eager.items())
        row["sweep"] = {}
        for L in sweep if len(seqs) <= 4 else ():
            try:
                row["sweep"][L] = graph_median_ms(lambda: impl_flashqla_segments(L)(*inputs), args.reps)
            except Exception as exc:
                notes.append(f"- segments L={L} failed on {name} {seq_label}: {exc.__class__.__name__}: {str(exc)[:160]}")
        rows.append(row)
        if args.rows_json:
            with open(args.rows_json, "w") as f:
                json.dump(rows, f)
        print(f"{name:9s} ({Hqk:2d},{Hv:2d}) {seq_label:12s} flashqla {row['flashqla']} fused {row['flashqla_fused']} "
              f"sweep {row['sweep']} +CP(L={row['L']}) "
              f"{row['flashqla_cp']} FLA {row['fla']} "
              f"FlashQLA {row['flash_qla']} FlashQLA+CP {row['flash_qla_cp']}  floors mem {mem_us:.0f} us mma {mma_us:.0f} us", flush=True)
        del inputs
        torch.cuda.empty_cache()

    rows.sort(key=lambda r: r["index"])
    report = write_report(args.out, rows, versions(), notes, peaks)
    print(report)
    try:
        plot(args.png, rows, torch.cuda.get_device_name())
    except Exception as exc:
        print(f"no plot: {exc}")


if __name__ == "__main__":
    main()
