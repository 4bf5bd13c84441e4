"""Shared-memory bank conflicts of a TileLang kernel, read off its generated CUDA source (no GPU needed).

    .venv/bin/python scripts/kernel_resources.py --source wy.cu wy_inverse build_wy_inverse bfloat16 True True
    .venv/bin/python scripts/bank_conflicts.py wy.cu [--top 20] [--all]

Every per-thread shared-memory access in the source (element reads and writes, vector casts such as
`*(float2*)(((float*)X_sh) + i)`, the address operand of ldmatrix / stmatrix and of cp.async) is evaluated for
each warp of the CTA and each value of its enclosing loop variables (a loop of more than 64 steps is sampled;
one whose bounds are runtime values takes 4 steps), under the `if` guards that depend only on the thread and
loop indices (a guard on a runtime value is taken as true). A request's shared-memory wavefronts are counted as
the hardware serves it: a warp's 32-bit (or narrower) accesses in one phase, 64-bit accesses in two half-warp
phases, 128-bit accesses (ldmatrix rows included) in four quarter-warp phases; in each phase the wavefronts are
the most distinct 4-byte words any one of the 32 banks holds (one word read by many threads is a broadcast).
The ideal is one wavefront per phase that has an active thread. Runtime values inside an index (a stage, a
head) are taken as 0: a uniform offset moves every thread's bank alike.

TMA, wgmma operands and library templates read shared memory outside the per-thread code and are not seen. It
reads the source, not the SASS: where nvcc merges neighbouring scalar loads into a wider one (wy_inverse's SASS has
70 LDS.128 and 144 LDS) its totals overcount; the conflicts it names stay.
Prints, per access, the source line, the buffer, load or store, the width, the wavefronts per request against
the ideal, and the excess weighted by the loop trip counts; a request at 8 against 1 is an 8-way conflict.
The Nsight Compute counterpart is l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st} (docs/kernels.md).
"""
from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass

import numpy as np

WIDTHS = {
    "char": 1, "uchar": 1, "signed char": 1, "int8_t": 1, "uint8_t": 1, "fp8_e4_t": 1, "fp8_e5_t": 1,
    "half_t": 2, "bfloat16_t": 2, "half": 2, "short": 2, "ushort": 2, "int16_t": 2, "uint16_t": 2,
    "float": 4, "int": 4, "uint": 4, "unsigned": 4, "int32_t": 4, "uint32_t": 4, "uint1": 4, "int1": 4,
    "half2": 4, "bfloat162": 4, "__nv_bfloat162": 4, "float1": 4, "char4": 4, "uchar4": 4,
    "float2": 8, "uint2": 8, "int2": 8, "int64_t": 8, "uint64_t": 8, "double": 8, "longlong": 8,
    "float4": 16, "uint4": 16, "int4": 16, "longlong2": 16, "double2": 16,
}
BANKS = 32
MAX_STEPS = 64  # a loop longer than this is sampled at evenly spaced steps
DYNAMIC_STEPS = 4  # steps taken of a loop whose bounds are runtime values
MAX_COMBOS = 512  # loop-variable combinations evaluated per access


class Unknown(Exception):
    """A name with no value here (a runtime argument, a register): the guard that reads it is taken as true."""


FUNCTIONS = {"min": np.minimum, "max": np.maximum, "_not": np.logical_not}


class IndexNames(dict):
    """Names for an index expression: unknown ones are 0 (a uniform offset)."""

    def __missing__(self, key):
        return FUNCTIONS.get(key, 0)  # eval looks a name up here before the globals


class GuardNames(dict):
    def __missing__(self, key):
        if key in FUNCTIONS:
            return FUNCTIONS[key]
        raise Unknown(key)


def to_python(expr: str) -> str:
    """A C integer expression as Python over numpy arrays: casts dropped, logical operators elementwise,
    threadIdx.x as `tx`."""
    expr = expr.replace("((int)threadIdx.x)", "tx").replace("threadIdx.x", "tx")
    expr = re.sub(r"\(\s*(?:const\s+)?(?:unsigned\s+)?(?:int64_t|int|uint|uint32_t|int32_t|long|bool)\s*\)", "", expr)
    expr = re.sub(r"(\d+)[uU]?[lL]*\b", r"\1", expr)
    expr = expr.replace("&&", " & ").replace("||", " | ")  # TileLang parenthesises every operand
    expr = re.sub(r"!(?!=)", "_not", expr)
    expr = re.sub(r"\b(\w+)\.(\w+)\b", r"\1_\2", expr)  # blockIdx.x -> blockIdx_x: an unknown name
    expr = expr.replace("/", "//")  # C integer division; indices are non-negative
    return expr


def balanced(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index of the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_ch!r} at {start}")


@dataclass
class Frame:
    loop: tuple | None = None  # (variable, values, trip count)
    guard: str | None = None  # a Python condition


@dataclass
class Access:
    line: int
    buffer: str
    store: bool
    width: int
    index: str  # Python expression of the element index
    element: int  # bytes per element of the index
    base: int  # the buffer's byte offset in dynamic shared memory
    frames: list  # the enclosing frames
    text: str
    guard: str | None = None  # a one-line `if (...) stmt;` guard


@dataclass
class Result:
    access: Access
    requests: int = 0
    wavefronts: int = 0
    ideal: int = 0
    weight: float = 0.0  # requests per CTA this sample stands for, over the sampled requests

    @property
    def ways(self) -> float:
        return self.wavefronts / self.ideal if self.ideal else 0.0

    @property
    def excess(self) -> float:
        return (self.wavefronts - self.ideal) * self.weight


def loop_values(start: str, end: str, step: int) -> tuple[list[int], float]:
    """The sampled values of a loop variable and the loop's trip count (bounds on runtime values: DYNAMIC_STEPS)."""
    try:
        lo = eval(to_python(start), {}, GuardNames())
        hi = eval(to_python(end), {}, GuardNames())
    except (Unknown, SyntaxError, NameError, TypeError, ZeroDivisionError):
        return list(range(DYNAMIC_STEPS)), float(DYNAMIC_STEPS)
    values = list(range(lo, hi, step))
    if len(values) > MAX_STEPS:
        stride = len(values) / MAX_STEPS
        return [values[int(i * stride)] for i in range(MAX_STEPS)], float(len(values))
    return values, float(len(values))


FOR = re.compile(r"^for \((?:int|int64_t|unsigned) (\w+) = (.+?); \1 < (.+?); (?:\+\+\1|\1 \+= (\d+)|\1 = \(\1 \+ (\d+)\))\) \{$")


def shared_buffers(source: str) -> dict[str, int]:
    buffers = {"buf_dyn_shmem": 0}
    for name, offset in re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source):
        buffers[name] = int(offset)
    for name in re.findall(r"__shared__ [\w:]+ (?:__align__\(\d+\) )?(\w+)\[", source):
        buffers.setdefault(name, 0)
    return buffers


def launch_threads(source: str) -> int:
    found = re.findall(r"__launch_bounds__\((\d+)", source)
    return int(found[0]) if found else 128


def accesses_in_line(number: int, line: str, buffers: dict, frames: list, guard: str | None) -> list[Access]:
    found = []
    names = "|".join(re.escape(b) for b in buffers)

    def add(buffer, store, width, index, element):
        found.append(Access(number, buffer, store, width, to_python(index), element, buffers[buffer], list(frames),
                            line.strip(), guard))

    for match in re.finditer(r"\(\(([\w:]+)\*\)(" + names + r")\)", line):
        element_type, buffer = match.group(1), match.group(2)
        element = WIDTHS.get(element_type.split("::")[-1])
        if element is None:
            continue
        after = match.end()
        before = line[:match.start()]
        if line[after:after + 1] == "[":  # ((T*)buf)[index]
            close = balanced(line, after, "[", "]")
            index = line[after + 1:close]
            width = element
            end = close + 1
            if before.endswith("(&("):  # an address handed to a function
                callee = re.search(r"([\w:]+)(?:<([^>]*)>)?\($", before[:-3])
                if callee is None:
                    continue
                name = callee.group(1)
                if "ldmatrix" in name or "stmatrix" in name:
                    width, store = 16, "stmatrix" in name
                elif "cp_async" in name:
                    size = re.match(r"\d+", callee.group(2) or "16")
                    width, store = int(size.group(0)), True
                else:
                    continue  # TMA, mbarriers, library templates: not per-thread LSU traffic
                add(buffer, store, width, index, element)
                continue
        elif line[after:after + 3] == " + " and before.endswith("("):  # *(V*)(((T*)buf) + index)
            close = balanced(line, len(before) - 1, "(", ")")
            index = line[after + 3:close]
            cast = re.search(r"\*\(([\w:]+)\*\)$", before[:-1])
            if cast is None:
                continue
            width = WIDTHS.get(cast.group(1).split("::")[-1])
            if width is None:
                continue
            end = close + 1
        else:
            continue
        add(buffer, re.match(r"\s*=(?!=)", line[end:]) is not None, width, index, element)
    return found


def collect(source: str) -> list[Access]:
    buffers = shared_buffers(source)
    frames: list[Frame] = []
    accesses = []
    for number, raw in enumerate(source.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith("//"):
            continue
        guard = None
        opens = 0
        if line.startswith("} else"):
            closed = frames.pop() if frames else Frame()
            previous = closed.guard if closed.guard is not None else "True"
            rest = line[len("} else"):].strip()
            if rest == "{":
                frames.append(Frame(guard=f"_not({previous})"))
                continue
            if rest.startswith("if ("):
                close = balanced(rest, 3, "(", ")")
                frames.append(Frame(guard=f"(_not({previous})) & ({to_python(rest[4:close])})"))
                continue
        loop = FOR.match(line)
        if loop:
            values, trips = loop_values(loop.group(2), loop.group(3), int(loop.group(4) or loop.group(5) or 1))
            frames.append(Frame(loop=(loop.group(1), values, trips)))
            continue
        if line.startswith("if ("):
            close = balanced(line, 3, "(", ")")
            condition = to_python(line[4:close])
            rest = line[close + 1:].strip()
            if rest == "{":
                frames.append(Frame(guard=condition))
                continue
            guard, line = condition, rest  # `if (c) statement;`
        if line.endswith("{") and not line.startswith("}"):
            opens = 1
        accesses.extend(accesses_in_line(number, line, buffers, frames, guard))
        if opens:
            frames.append(Frame())
        closes = line.count("}") - line.count("{") + opens
        for _ in range(max(closes, 0)):
            if frames:
                frames.pop()
    return accesses


def request_wavefronts(addresses: list, width: int) -> tuple[int, int]:
    """Wavefronts and ideal wavefronts of one warp-wide request: `addresses` holds the 32 lanes' byte addresses
    (None for an inactive lane)."""
    active = np.array([a is not None for a in addresses])
    flat = np.array([a if a is not None else 0 for a in addresses], dtype=np.int64)
    wavefronts, ideal, _ = warp_wavefronts(flat[None, :], active[None, :], width)
    return int(wavefronts), int(ideal)


def warp_wavefronts(addresses: np.ndarray, active: np.ndarray, width: int) -> tuple[int, int, int]:
    """Wavefronts, ideal wavefronts and requests of the warp-wide requests in `addresses` / `active`, both
    [samples, threads] (threads a multiple of 32)."""
    samples, threads = addresses.shape
    words_per_lane = max(1, width // 4)
    lanes_per_phase = 32 if width <= 4 else 128 // width
    words = addresses[..., None] // 4 + np.arange(words_per_lane)  # [samples, threads, words per lane]
    words = np.where(active[..., None], words, -1)
    groups = words.reshape(samples * threads // lanes_per_phase, lanes_per_phase * words_per_lane)
    groups = np.sort(groups, axis=1)
    distinct = groups >= 0
    distinct[:, 1:] &= groups[:, 1:] != groups[:, :-1]  # one word read by many lanes is one access (a broadcast)
    per_bank = ((groups[..., None] % BANKS == np.arange(BANKS)) & distinct[..., None]).sum(axis=1)
    wavefronts = per_bank.max(axis=1)
    ideal = -(-distinct.sum(axis=1) * 4 // 128)
    requests = active.reshape(samples, threads // 32, 32).any(axis=2).sum()
    return int(wavefronts.sum()), int(ideal.sum()), int(requests)


def evaluate(expr: str, names: dict, guard: bool):
    try:
        return eval(expr, {}, GuardNames(names) if guard else IndexNames(names))
    except Unknown:
        return True
    except (TypeError, SyntaxError, ZeroDivisionError, NameError, ValueError):
        if guard:
            return True  # a guard this reader cannot evaluate is taken as true
        raise


def analyse(access: Access, threads: int) -> Result:
    """Every sampled loop step of `access` at once: loop variables are [samples, 1] arrays, the thread index a
    [1, threads] array."""
    result = Result(access)
    loops = [f.loop for f in access.frames if f.loop is not None]
    guards = [f.guard for f in access.frames if f.guard is not None] + ([access.guard] if access.guard else [])
    trips = 1.0
    for _, _, count in loops:
        trips *= count
    combos = list(itertools.product(*[values for _, values, _ in loops]))
    if len(combos) > MAX_COMBOS:
        step = len(combos) / MAX_COMBOS
        combos = [combos[int(i * step)] for i in range(MAX_COMBOS)]
    table = np.array(combos, dtype=np.int64).reshape(len(combos), len(loops))
    names = {var: table[:, i:i + 1] for i, (var, _, _) in enumerate(loops)}
    names["tx"] = np.arange(threads, dtype=np.int64)[None, :]
    shape = (len(combos), threads)
    active = np.ones(shape, dtype=bool)
    for guard in guards:
        active &= np.broadcast_to(np.asarray(evaluate(guard, names, True), dtype=bool), shape)
    try:
        index = evaluate(access.index, names, False)
    except (TypeError, SyntaxError, ZeroDivisionError, NameError, ValueError):
        return result  # an index this reader cannot evaluate: reported as not analysed
    addresses = access.base + np.broadcast_to(np.asarray(index, dtype=np.int64), shape) * access.element
    result.wavefronts, result.ideal, result.requests = warp_wavefronts(addresses, active, access.width)
    result.weight = trips / len(combos)
    return result


def shared_accesses(source: str) -> list[Result]:
    """Every per-thread shared-memory access of a generated CUDA source that some warp makes, analysed."""
    threads = launch_threads(source)
    return [r for r in (analyse(a, threads) for a in collect(source)) if r.requests]


def excess_fraction(results: list[Result]) -> float:
    """Excess wavefronts over all wavefronts of a CTA (loops as sampled)."""
    total = sum(r.wavefronts * r.weight for r in results)
    return sum(r.excess for r in results) / total if total else 0.0


def report(path: str, top: int, show_all: bool) -> list[Result]:
    source = open(path).read()
    results = shared_accesses(source)
    total = sum(r.wavefronts * r.weight for r in results)
    excess = sum(r.excess for r in results)
    print(f"{path}: {launch_threads(source)} threads, {len(results)} shared accesses; wavefronts per CTA (loops as "
          f"sampled) {total:.0f}, of which excess {excess:.0f} ({100 * excess_fraction(results):.1f}%)")
    ranked = sorted(results, key=lambda r: -r.excess)
    shown = ranked if show_all else [r for r in ranked if r.wavefronts > r.ideal][:top]
    for r in shown:
        print(describe(r))
    return results


def describe(r: Result) -> str:
    a = r.access
    return (f"  line {a.line:5d} {a.buffer:>10s} {'st' if a.store else 'ld'} {a.width:2d}B "
            f"{r.wavefronts / r.requests:5.2f} / {r.ideal / r.requests:4.2f} wavefronts a request "
            f"({r.ways:4.1f}-way), excess {r.excess:9.0f}  {a.text[:110]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", help="CUDA sources written by kernel_resources.py --source")
    ap.add_argument("--top", type=int, default=20, help="how many conflicting accesses to print")
    ap.add_argument("--all", action="store_true", help="print every access, conflicting or not")
    args = ap.parse_args(argv)
    for path in args.sources:
        report(path, args.top, args.all)


if __name__ == "__main__":
    main()
