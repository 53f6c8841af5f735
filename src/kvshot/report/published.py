"""results/published/table.md: published EAGLE-3 heads' tau through kvshot's harness beside the
publishers' own figures (the heads are imported by `kvshot.interop.published`)."""
from __future__ import annotations

import json
from pathlib import Path

from kvshot.core.io import temperature_key, write_text
from kvshot.settings import PublishedSettings


def bench_key(name: str) -> str:
    """A benchmark's name as the publishers' figures spell it: `mt-bench` is `mtbench`."""
    return "".join(c for c in name.lower() if c.isalnum())


def our_tau(runs: dict | None, e2e: dict, mode: str, temp: str, bench: str) -> tuple[float, list | None] | None:
    """A head's tau on one benchmark at one temperature (T0, T1): eval-benchmarks' cell (`runs`,
    keyed by `bench_key`) with its prompt bootstrap interval; without them, MT-Bench at T = 0 from eval-e2e."""
    if runs is not None:
        cell = runs.get(bench, {}).get("temperatures", {}).get(temperature_key(float(temp[1:])), {}).get("modes", {}).get(mode)
        return (cell["tau"], cell["intervals"]["tau"]["ci"]) if cell else None
    if temp == "T0" and bench == "mtbench":
        return e2e["modes"][mode]["tau"], None
    return None


def published_table(published: PublishedSettings, results: str | Path, out: str | Path) -> dict:
    """results/published/table.md: each head's tau (eval-benchmarks per prompt set and
    temperature, its publisher's chain or tree) beside the publisher's figures, with the relative
    difference and a verdict against `tolerance` for every cell both sides measured."""
    tol, results = float(published.tolerance), Path(results)
    lines = [f"# Published EAGLE-3 heads through kvshot's harness (tolerance {tol:.0%}, docs/published-heads.md)", "",
             "| head | decoding | T | benchmark | published tau | our tau | 95% CI | rel. diff | verdict | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for head in published.heads:
        e2e = json.loads((results / head.name / "e2e.json").read_text())
        bench_file = results / head.name / "benchmarks.json"   # each file read once per head
        runs = {bench_key(k): v for k, v in json.loads(bench_file.read_text())["benchmarks"].items()} \
            if bench_file.is_file() else None
        lossless = bool(e2e.get("lossless"))
        dec = head.decoding
        shape = f"chain {dec.depth}" if dec.mode == "chain" else f"tree {dec.depth}/{dec.topk}/{dec.total_tokens}"
        for temp, figures in head.published.items():
            for bench, theirs in figures.items():
                got = our_tau(runs, e2e, dec.mode, temp, bench)
                ours, ci = got if got else (None, None)
                diff = (ours - theirs) / theirs if got else None
                verdict = ("within" if abs(diff) <= tol else "outside") if got else "not run (set or T not configured)"
                rows.append({"head": head.name, "mode": dec.mode, "T": temp, "benchmark": bench,
                             "published": theirs, "ours": ours, "ci": ci, "rel_diff": diff, "verdict": verdict,
                             "lossless": lossless})
                lines.append(f"| {head.name} | {shape} | {temp[1:]} | {bench} | {theirs:.2f} | "
                             f"{f'{ours:.2f}' if got else '-'} | {f'[{ci[0]:.2f}, {ci[1]:.2f}]' if ci else '-'} | "
                             f"{f'{diff:+.1%}' if got else '-'} | {verdict} | {'yes' if lossless else 'NO'} |")
    lines += ["", "Our tau: eval-benchmarks on `eval.e2e.benchmarks.sets` at the publisher's temperatures and chain or "
              "tree (eval-e2e's MT-Bench prompts at T = 0 where that stage is off), accepted + 1 per round; "
              "lossless: eval-e2e's greedy check; sources: config `published.heads[].source`."]
    write_text(out, "\n".join(lines) + "\n")
    return {"out": str(out), "rows": rows}
