"""`python -m harness.report results/<study>.jsonl [--out PATH] [--no-png] [--wandb MODE]`
`python -m harness.report --index [results_dir]`

Writes <results_dir>/<study>.html and the PNG charts beside it; the last line printed is the HTML path.
With --wandb offline|online, also logs the study summary as one W&B run in the study's group.
--index writes <results_dir>/index.html over every study there (harness/report/index.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.report import png_paths, write_report
from harness.report.index import write_index
from harness.report.wandb_summary import log_summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, nargs="?", help="<results_dir>/<study>.jsonl")
    ap.add_argument("--index", type=Path, nargs="?", const=Path("results"), default=None, metavar="RESULTS_DIR",
                    help="write RESULTS_DIR/index.html across every study there (default results)")
    ap.add_argument("--out", type=Path, default=None, help="HTML path (default: the records path with .html)")
    ap.add_argument("--no-png", action="store_true", help="skip the PNG charts")
    ap.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                    help="also log the study summary to W&B in this mode (WANDB_MODE in the environment wins)")
    ap.add_argument("--project", default="brigade", help="W&B project for --wandb")
    args = ap.parse_args(argv)
    if args.index is not None:
        if not args.index.is_dir() or not any(args.index.glob("*.jsonl")):
            print(f"no records files (<study>.jsonl) in {args.index}", file=sys.stderr)
            return 2

        print(write_index(args.index))
        return 0
    if args.records is None:
        ap.error("a records file, or --index [RESULTS_DIR]")
    if not args.records.exists():
        print(f"no records at {args.records}", file=sys.stderr)
        return 2


    html = write_report(args.records, args.out, pngs=not args.no_png)
    for p in png_paths(html).values():
        if p.exists():
            print(f"chart: {p}")
    if args.wandb:
        where = log_summary(args.records, html, mode=args.wandb, project=args.project)
        if where:
            print(f"W&B summary run: {where}")
    print(html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
