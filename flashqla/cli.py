"""The `flashqla` command (console script `flashqla = flashqla.cli:main`, or `python -m flashqla`)."""
from __future__ import annotations

import argparse
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashqla")
    commands = parser.add_subparsers(dest="command", required=True)
    pre = commands.add_parser(
        "precompile", help="compile every kernel configuration into a TileLang cache (no GPU needed)",
        description="Compiles every TileLang kernel configuration dispatch can choose for sm_90a into a "
                    "TileLang cache directory, in parallel processes. See docs/prebuilt_kernels.md.")
    pre.add_argument("--cache-dir", default=None,
                     help="cache to fill (default: TileLang's, TILELANG_CACHE_DIR or ~/.tilelang/cache); "
                          "kernels/prebuilt ships it inside the package")
    pre.add_argument("--jobs", "-j", type=int, default=None, help="compile processes (default: one per kernel, "
                                                                    "at most one per CPU)")
    pre.add_argument("--dtypes", default="bf16,fp16", help="comma-separated among bf16, fp16 (default: both)")
    pre.add_argument("--heads", default=None,
                     help="Hqk:Hv pairs, e.g. 16:32,8:16. No kernel is specialised by head count today, so this "
                          "only validates and notes them")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar (each kernel is logged anyway)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from .precompile import precompile

    try:
        results = precompile(cache_dir=args.cache_dir, jobs=args.jobs, dtypes=args.dtypes, heads=args.heads,
                             progress=not args.no_progress)
    except (ValueError, RuntimeError) as exc:
        print(f"flashqla precompile: {exc}", file=sys.stderr)
        return 1
    for result in results:
        print(f"{result.kernel}\t{'compiled' if result.compiled else 'cached'}\t{result.seconds:.1f} s\t{result.entry}")
    return 0
