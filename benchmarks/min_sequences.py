"""Why a rate needs `eval.min_sequences` distinct sequences as well as `eval.min_rounds` anchors:
the coverage of the sequence-bootstrap interval of alpha_k by the number of sequences (clusters)
that reach step k, measured on clustered synthetic chains with a known truth (kvshot.stats.power,
the same `intervals` the evaluation calls). docs/statistics.md ("Minimum sequences") quotes the
table this prints.

    python benchmarks/min_sequences.py [--reps 400] [--anchors-per-conversation 6]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvshot.stats.power import coverage_by_sequences

EAGLE = [0.62, 0.78, 0.80, 0.80, 0.80, 0.80, 0.80]   # tests/unit/test_coverage.py's shape
BINS = [(1, 1), (2, 2), (3, 4), (5, 9), (10, 19), (20, 10**9)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--anchors-per-conversation", type=int, default=6)
    ap.add_argument("--conversations", type=int, nargs="+", default=[2, 3, 4, 5, 7, 10, 15, 20, 30])
    ap.add_argument("--out", default="results/benchmarks/min_sequences.json")
    args = ap.parse_args()
    got = coverage_by_sequences(args.conversations, EAGLE, args.anchors_per_conversation, args.reps)
    print("| sequences reaching step k | intervals | coverage (withheld = miss) | withheld | mean width | at 0 or 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for lo, hi in BINS:
        bs = [b for s, b in got.items() if lo <= s <= hi]
        n = sum(b["intervals"] for b in bs)
        if not n:
            continue
        given = max(n - sum(b["withheld"] for b in bs), 1)
        row = {"sequences": f"{lo}" if lo == hi else f"{lo}-{hi}" if hi < 10**9 else f">={lo}", "intervals": n,
               "coverage": sum(b["covered"] for b in bs) / n, "withheld": sum(b["withheld"] for b in bs) / n,
               "mean_width": sum(b["width"] for b in bs) / given, "at_bound": sum(b["at_bound"] for b in bs) / given}
        rows.append(row)
        print(f"| {row['sequences']} | {n} | {row['coverage']:.1%} | {row['withheld']:.1%} | {row['mean_width']:.3f} "
              f"| {row['at_bound']:.1%} |", flush=True)
    print("\nalpha_0, which every conversation reaches, by conversations in the evaluation:")
    print("| conversations holding anchors | intervals | coverage | withheld | mean width | at 0 or 1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    step0 = coverage_by_sequences([3, 5, 10, 20], EAGLE, args.anchors_per_conversation, args.reps, steps=[0])
    for c, b in step0.items():
        print(f"| {c} | {b['intervals']} | {b['coverage']:.1%} | {b['withheld_share']:.1%} | {b['mean_width']:.3f} "
              f"| {b['at_bound_share']:.1%} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "by_sequences": got, "alpha_0": step0},
                                         indent=1))


if __name__ == "__main__":
    main()
