"""Whole-pipeline budget: wall time and peak memory per rule of the last default run, from
Snakemake's `benchmark:` files and its run log. Target: within 40 minutes on 2 cores (the
SmolLM2 study, config/smollm2.yaml: 120 minutes), peak memory under 6 GiB; with --train-share,
at least that share of the run's CPU-seconds in the drafters' training jobs (the SmolLM2 study:
0.6, issue 51). Prints the ratios last; exits non-zero when a target is missed.

    python benchmarks/pipeline.py [--results results] [--log .snakemake/log/<run>.snakemake.log] [--wall-minutes 40] [--train-share 0.6]
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
TRAINING_JOBS = ("train_drafter",)   # benchmark file stems of the drafters' training (train_drafter[_group]_*)


def number(text: str) -> float:
    return float(text) if text not in ("", "NA", "-") else 0.0


def rule_rows(folder: Path) -> list[dict]:
    rows = []
    for tsv in sorted(folder.glob("*.tsv")):
        with open(tsv) as fh:
            rec = next(csv.DictReader(fh, delimiter="\t"))
        rows.append({"job": tsv.stem, "seconds": float(rec["s"]), "cpu_seconds": number(rec.get("cpu_time", "")),
                     "max_rss_mb": number(rec["max_rss"])})
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
    ap.add_argument("--train-share", type=float, default=None,
                    help="least share of CPU-seconds in training jobs (config/smollm2.yaml: 0.6); default: reported only")
    args = ap.parse_args()
    wall_target = args.wall_minutes * 60
    rows = rule_rows(Path(args.results) / "benchmarks" / "rules")
    if not rows:
        print(f"no benchmark files under {args.results}/benchmarks/rules: run the pipeline first", file=sys.stderr)
        return 2
    logs = sorted(Path(".snakemake/log").glob("*.snakemake.log")) if args.log is None else [Path(args.log)]
    wall = run_wall_seconds(logs[-1])
    peak = max(r["max_rss_mb"] for r in rows)
    cpu = sum(r["cpu_seconds"] for r in rows)
    train_cpu = sum(r["cpu_seconds"] for r in rows if r["job"].startswith(TRAINING_JOBS))
    share = train_cpu / cpu if cpu else 0.0
    print(f"{'job':40s} {'seconds':>9s} {'cpu_s':>9s} {'max_rss_MB':>11s}")
    for r in sorted(rows, key=lambda r: -r["seconds"]):
        print(f"{r['job']:40s} {r['seconds']:9.1f} {r['cpu_seconds']:9.1f} {r['max_rss_mb']:11.0f}")
    out = {"wall_seconds": wall, "sum_job_seconds": sum(r["seconds"] for r in rows), "peak_rss_mb": peak,
           "cpu_seconds": cpu, "training_cpu_seconds": train_cpu, "training_share": share,
           "training_share_target": args.train_share,
           "wall_target_seconds": wall_target, "mem_target_mb": MEM_TARGET_MB, "jobs": rows, "log": str(logs[-1])}
    Path(args.results, "benchmarks").mkdir(parents=True, exist_ok=True)
    Path(args.results, "benchmarks", "pipeline.json").write_text(json.dumps(out, indent=2))
    ok_wall, ok_mem = wall <= wall_target, peak <= MEM_TARGET_MB
    ok_share = args.train_share is None or share >= args.train_share
    share_text = f"training {train_cpu:.0f} of {cpu:.0f} CPU-s = {share:.1%}" + (
        f" / target {args.train_share:.0%}" if args.train_share is not None else "")
    print(f"wall {wall / 60:.1f} min / target {wall_target / 60:.0f} min = {wall / wall_target:.2f}  "
          f"peak {peak / 1024:.2f} GiB / target {MEM_TARGET_MB / 1024:.0f} GiB = {peak / MEM_TARGET_MB:.2f}  "
          f"{share_text}  {'OK' if ok_wall and ok_mem and ok_share else 'MISSED'}")
    return 0 if ok_wall and ok_mem and ok_share else 1


if __name__ == "__main__":
    sys.exit(main())
