"""results/tables/benchmarks.{md,csv,tex} and figures/benchmarks.pdf from results/eval/<variant>/benchmarks.json.

The layout speculative-decoding papers use: benchmarks as columns (tau with its prompt x seed
bootstrap interval, and the speedup over plain decoding), temperatures as row groups (T = 0,
T = 1), one row per variant and draft mode inside a group. The CSV is long (one row per
temperature, variant, mode and benchmark) and adds the acceptance per draft position."""
from __future__ import annotations

from pathlib import Path

from kvshot.core.io import read_json

from .tables import csv_text


def load_benchmarks(results: str | Path, variants: list[str]) -> list[dict]:
    """The variants' benchmarks.json records that exist, in the config's variant order."""
    paths = [Path(results) / "eval" / v / "benchmarks.json" for v in variants]
    return [read_json(p) for p in paths if p.exists()]


def long_rows(records: list[dict]) -> list[dict]:
    rows = []
    for rec in records:
        for bench, b in rec["benchmarks"].items():
            for tkey, t in b["temperatures"].items():
                for mode, m in t["modes"].items():
                    tau = m["intervals"]["tau"]
                    rows.append({"temperature": t["temperature"], "variant": rec["variant"], "mode": mode,
                                 "benchmark": bench, "prompts": b["prompts"], "tau": tau["value"],
                                 "tau_lo": tau["ci"][0], "tau_hi": tau["ci"][1], "speedup": m["speedup"],
                                 "rounds": m["rounds"],
                                 "acceptance_by_position": ";".join(f"{a:.3f}" for a in m["acceptance_by_position"])})
    return rows


def _benchmarks(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["benchmark"] for r in rows))


def wide_groups(rows: list[dict]) -> dict[float, list[dict]]:
    """{temperature: [{variant, mode, <bench> tau, <bench> speedup, ...}]}: the readers' layout."""
    benches, groups = _benchmarks(rows), {}
    for r in rows:
        group = groups.setdefault(r["temperature"], {})
        row = group.setdefault((r["variant"], r["mode"]), {"variant": r["variant"], "mode": r["mode"]}
                               | {f"{b} {k}": "" for b in benches for k in ("tau", "speedup")})
        row[f"{r['benchmark']} tau"] = f"{r['tau']:.2f} [{r['tau_lo']:.2f}, {r['tau_hi']:.2f}]"
        row[f"{r['benchmark']} speedup"] = f"{r['speedup']:.2f}x"
    return {t: list(g.values()) for t, g in sorted(groups.items())}


def markdown(rows: list[dict]) -> str:
    groups = wide_groups(rows)
    if not groups:
        return "(no benchmark records)\n"
    head = list(next(iter(groups.values()))[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t, group in groups.items():
        lines.append(f"| **T = {t:g}** |" + " |" * (len(head) - 1))
        lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in group]
    note = ("tau: mean accepted length per round incl. the bonus token, [95% prompt x seed bootstrap interval]; "
            "speedup: median over prompts and seeds of tokens/s over plain decoding at the same temperature.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def latex(rows: list[dict]) -> str:
    groups = wide_groups(rows)
    if not groups:
        return ""
    benches = _benchmarks(rows)
    esc = lambda s: str(s).replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")
    lines = [r"\begin{tabular}{ll" + "cc" * len(benches) + "}", r"\toprule",
             " & & " + " & ".join(rf"\multicolumn{{2}}{{c}}{{{esc(b)}}}" for b in benches) + r" \\",
             r"variant & mode & " + " & ".join(r"$\tau$ & speedup" for _ in benches) + r" \\"]
    for t, group in groups.items():
        lines += [r"\midrule", rf"\multicolumn{{{2 + 2 * len(benches)}}}{{l}}{{$T = {t:g}$}} \\"]
        lines += [" & ".join(esc(r[h]) for h in r) + r" \\" for r in group]
    return "\n".join(lines + [r"\bottomrule", r"\end{tabular}"]) + "\n"


def table_files(records: list[dict]) -> dict[str, str]:
    """{"benchmarks.md": ..., "benchmarks.csv": ..., "benchmarks.tex": ...}."""
    rows = long_rows(records)
    return {"benchmarks.md": markdown(rows), "benchmarks.csv": csv_text(rows), "benchmarks.tex": latex(rows)}


def figure(records: list[dict], path: str | Path) -> None:
    """tau per variant (bars, with intervals) per benchmark, one panel per temperature; chain mode
    (the mode every variant decodes)."""
    from .figures import _save, _style, plt

    _style()
    rows = [r for r in long_rows(records) if r["mode"] == "chain"]
    temps, benches = sorted({r["temperature"] for r in rows}), _benchmarks(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(temps)), figsize=(4.8 * max(1, len(temps)), 3.6), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(variants))
    for ax, t in zip(axes[0], temps):
        for i, v in enumerate(variants):
            cells = {r["benchmark"]: r for r in rows if r["temperature"] == t and r["variant"] == v}
            xs = [j + (i - (len(variants) - 1) / 2) * width for j, b in enumerate(benches) if b in cells]
            got = [cells[b] for b in benches if b in cells]
            ax.bar(xs, [r["tau"] for r in got], width, label=v,
                   yerr=[[max(0.0, r["tau"] - r["tau_lo"]) for r in got], [max(0.0, r["tau_hi"] - r["tau"]) for r in got]], capsize=2)
        ax.set_xticks(range(len(benches)), benches)
        ax.set_title(f"T = {t:g} (chain)")
    axes[0][0].set_ylabel("tau (accepted length per round)")
    axes[0][-1].legend(fontsize=7, frameon=False)
    _save(fig, path)
