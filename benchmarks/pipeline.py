"""Whole-pipeline budget: wall time and peak memory per rule of the last default run, from
Snakemake's `benchmark:` files and its run log. Target: within 40 minutes on 2 cores (the
SmolLM2 study, config/smollm2.yaml: 120 minutes), peak memory under 6 GiB. Prints the ratios last; exits non-zero when a target is missed.

    python benchmarks/pipeline.py [--results results] [--log .snakemake/log/<run>.snakemake.log] [--wall-minutes 40]
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from datetime import datetime
from pathlib import Path

WALL_TARGET_S = 40 * 60
MEM_TARGET_MB = 6 * 1024


def rule_rows(folder: Path) -> list[dict]:
    rows = []
    for tsv in sorted(folder.glob("*.tsv")):
        with open(tsv) as fh:
            rec = next(csv.DictReader(fh, delimiter="\t"))
        rows.append({"job": tsv.stem, "seconds": float(rec["s"]),
                     "max_rss_mb": float(rec["max_rss"]) if rec["max_rss"] not in ("", "NA", "-") else 0.0})
    return rows


def run_wall_seconds(log: Path) -> float:
    """First to last timestamp Snakemake printed for the run."""
    stamps = [datetime.strptime(m, "%a %b %d %H:%M:%S %Y")
              for m in re.findall(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]", log.read_text(), re.M)]
    if len(stamps) < 2:
        raise SystemExit(f"{log}: no job timestamps: is it a finished run's log?")
    return (stamps[-1] - stamps[0]).total_seconds()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results")
    ap.add_argument("--log", default=None, help="Snakemake run log (default: the newest in .snakemake/log)")
    ap.add_argument("--wall-minutes", type=float, default=WALL_TARGET_S / 60,
                    help="the run's wall budget: 40 for the default, 120 for config/smollm2.yaml")
    args = ap.parse_args()
    wall_target = args.wall_minutes * 60
    rows = rule_rows(Path(args.results) / "benchmarks" / "rules")
    if not rows:
        print(f"no benchmark files under {args.results}/benchmarks/rules: run the pipeline first", file=sys.stderr)
        return 2
    logs = sorted(Path(".snakemake/log").glob("*.snakemake.log")) if args.log is None else [Path(args.log)]
    wall = run_wall_seconds(logs[-1])
    peak = max(r["max_rss_mb"] for r in rows)
    print(f"{'job':40s} {'seconds':>9s} {'max_rss_MB':>11s}")
    for r in sorted(rows, key=lambda r: -r["seconds"]):
        print(f"{r['job']:40s} {r['seconds']:9.1f} {r['max_rss_mb']:11.0f}")
    out = {"wall_seconds": wall, "sum_job_seconds": sum(r["seconds"] for r in rows), "peak_rss_mb": peak,
           "wall_target_seconds": wall_target, "mem_target_mb": MEM_TARGET_MB, "jobs": rows, "log": str(logs[-1])}
    Path(args.results, "benchmarks").mkdir(parents=True, exist_ok=True)
    Path(args.results, "benchmarks", "pipeline.json").write_text(json.dumps(out, indent=2))
    ok_wall, ok_mem = wall <= wall_target, peak <= MEM_TARGET_MB
    print(f"wall {wall / 60:.1f} min / target {wall_target / 60:.0f} min = {wall / wall_target:.2f}  "
          f"peak {peak / 1024:.2f} GiB / target {MEM_TARGET_MB / 1024:.0f} GiB = {peak / MEM_TARGET_MB:.2f}  "
          f"{'OK' if ok_wall and ok_mem else 'MISSED'}")
    return 0 if ok_wall and ok_mem else 1


if __name__ == "__main__":
    sys.exit(main())
