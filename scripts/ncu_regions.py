"""Where a kernel's time goes, region by region: the SASS of one Nsight Compute launch (`scripts/device_ncu.sh`'s
<name>_sass.csv.xz) cut at its CTA barriers and exits, each region's share of the warp-stall samples and of the
shared-memory wavefronts (with how close those are to ideal), its instructions per CTA and its commonest opcodes.

    python3 scripts/ncu_regions.py out/wy_sass.csv.xz [--ctas 8256] [--min-share 0.5]

A region between two barriers is one stage of the kernel (a barrier ends every stage its threads share data
across), so this is the per-stage reading docs/kernels.md's "Fifty-ninth session" took of `wy_inverse` (the per-v-head
L store 23% of the samples at 61% of ideal wavefronts). `--ctas` (the launch's grid size, from <name>_details.csv)
turns instruction counts into counts per CTA; regions below `--min-share` percent of the samples are left out.
"""
from __future__ import annotations

import argparse
import csv
import io
import lzma
import re
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
WAVEFRONTS = "L1 Wavefronts Shared"
IDEAL = "L1 Wavefronts Shared Ideal"
ENDS_REGION = re.compile(r"^(BAR\.SYNC|BAR\.RED|EXIT)\b")


@dataclass
class Region:
    first: int  # index of its first instruction in the listing
    last: int = -1
    closing: str = ""  # the barrier or exit that ends it
    samples: int = 0
    executed: int = 0
    wavefronts: int = 0
    ideal: int = 0
    opcodes: dict = field(default_factory=dict)


def _number(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except ValueError:
        return 0


def without_predicate(instruction: str) -> str:
    """A SASS line without its guard: `@!P0 LDS.128 R4, [R2]` -> `LDS.128 R4, [R2]`."""
    words = instruction.split(None, 1)
    return words[1] if len(words) == 2 and words[0].startswith("@") else instruction


def opcode(instruction: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers: `@!P0 LDS.128 R4, [R2]` -> `LDS`."""
    words = without_predicate(instruction).split()
    return words[0].split(".")[0] if words else ""


def read_listing(text: str) -> list[dict]:
    """The instruction rows of `ncu --page source --csv --print-source sass`: a first line naming the kernel, then a
    header, then one row per instruction."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def regions_of(rows: list[dict]) -> list[Region]:
    """The listing cut after every CTA barrier and exit."""
    regions, current = [], Region(0)
    for n, row in enumerate(rows):
        instruction = row["Source"].strip()
        current.samples += _number(row.get(SAMPLES, "0"))
        executed = _number(row.get(EXECUTED, "0"))
        current.executed += executed
        current.wavefronts += _number(row.get(WAVEFRONTS, "0"))
        current.ideal += _number(row.get(IDEAL, "0"))
        if executed:
            name = opcode(instruction)
            current.opcodes[name] = current.opcodes.get(name, 0) + executed
        bare = without_predicate(instruction)
        if ENDS_REGION.match(bare) or n == len(rows) - 1:
            current.last, current.closing = n, bare
            regions.append(current)
            current = Region(n + 1)
    return regions


def report(regions: list[Region], ctas: int = 1, min_share: float = 0.5) -> list[str]:
    samples = sum(r.samples for r in regions) or 1
    wavefronts = sum(r.wavefronts for r in regions) or 1
    out = [f"{'instructions':>13} {'samples':>8} {'wavefronts':>10} {'of ideal':>8} {'per CTA':>9}  ends with / opcodes"]
    for r in regions:
        share = 100 * r.samples / samples
        if r.executed == 0 or share < min_share:
            continue
        ideal = f"{100 * r.ideal / r.wavefronts:.0f}%" if r.wavefronts else "-"
        common = ", ".join(f"{name} {count / ctas:.0f}" for name, count in
                           sorted(r.opcodes.items(), key=lambda item: -item[1])[:5])
        out.append(f"{r.first:>6}-{r.last:<6} {share:7.1f}% {100 * r.wavefronts / wavefronts:9.1f}% {ideal:>8} "
                   f"{r.executed / ctas:9.0f}  {r.closing[:28]} | {common}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("listing", help="<name>_sass.csv.xz (or an uncompressed .csv)")
    parser.add_argument("--ctas", type=int, default=1, help="the launch's grid size: counts become per CTA")
    parser.add_argument("--min-share", type=float, default=0.5, help="percent of the samples a region needs")
    args = parser.parse_args(argv)
    opener = lzma.open if args.listing.endswith(".xz") else open
    with opener(args.listing, "rt") as f:
        rows = read_listing(f.read())
    print("\n".join(report(regions_of(rows), args.ctas, args.min_share)))


if __name__ == "__main__":
    main()
