"""Tables as CSV, Markdown and LaTeX, from the result files only."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from ..io import atomic_dir, write_text
from .results import PAPER, Variant, roles


def _num(x, digits=3):
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def stepwise_rows(variants: list[Variant]) -> list[dict]:
    rows = []
    for v in variants:
        sw = v.stepwise
        row = {"variant": v.name, "paradigm": v.paradigm, "layers": v.layers}
        row |= {f"alpha_{k}": a for k, a in enumerate(sw["alpha"])}
        row |= {"MAT": sw["mat"], "MAT 95% CI": f"[{_num(sw['mat_ci'][0])}, {_num(sw['mat_ci'][1])}]",
                "retention": sw["retention"], "rounds": sw["rounds"][0]}
        rows.append(row)
    return rows


def depth_rows(variants: list[Variant]) -> list[dict]:
    r = roles(variants)
    rows = [{"drafter": v.name, "paradigm": "KV-only", "layers": d, "MAT": v.stepwise["mat"],
             f"alpha_{v.stepwise['steps'] - 1}": v.stepwise["alpha"][-1]} for d, v in sorted(r["kv"].items())]
    for v in (r["eagle3"], r["hybrid"]):
        if v:
            rows.append({"drafter": v.name, "paradigm": v.paradigm, "layers": v.layers, "MAT": v.stepwise["mat"],
                         f"alpha_{v.stepwise['steps'] - 1}": v.stepwise["alpha"][-1]})
    return rows


def e2e_rows(variants: list[Variant]) -> list[dict]:
    ref = roles(variants)["eagle3"]
    rows = []
    for v in variants:
        if not v.e2e:
            continue
        for mode, m in v.e2e["modes"].items():
            base = ref.e2e["modes"][mode]["draft_seconds_per_round"] if ref and ref.e2e else None
            rows.append({"variant": v.name, "mode": mode, "tau": m["tau"], "tokens/s": m["tokens_per_s"],
                         "speedup": m["speedup"], "draft ms/round": 1e3 * m["draft_seconds_per_round"],
                         "verify ms/round": 1e3 * m["verify_seconds_per_round"],
                         "draft overhead vs EAGLE-3": (m["draft_seconds_per_round"] / base - 1) if base else None,
                         "lossless": m["lossless"]})
    return rows


def paper_rows(variants: list[Variant]) -> list[dict]:
    """This run beside every number the paper reports."""
    by_name = {v.name: v for v in variants}
    r = roles(variants)
    role_of = {"eagle3": r["eagle3"], "hybrid": r["hybrid"]} | {f"kv-d{d}": v for d, v in r["kv"].items()}
    rows = []
    for metric, values in PAPER.items():
        if metric == "draft_overhead":
            continue
        for who, paper in values.items():
            v = role_of.get(who) or by_name.get(who)
            ours = None
            if v is not None:
                ours = {"alpha_6": v.stepwise["alpha"][-1], "mat": v.stepwise["mat"],
                        "retention": v.stepwise["retention"],
                        "tau": v.e2e["modes"]["chain"]["tau"] if v.e2e else None}[metric]
            rows.append({"metric": metric, "drafter": who, "paper (Qwen3-8B)": paper, "this run": ours})
    return rows


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [])
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def _markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_num(r.get(h)) for h in head) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _latex(rows: list[dict]) -> str:
    if not rows:
        return ""
    head = list(rows[0])
    esc = lambda s: str(s).replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")
    lines = [r"\begin{tabular}{" + "l" * len(head) + "}", r"\toprule", " & ".join(map(esc, head)) + r" \\", r"\midrule"]
    lines += [" & ".join(esc(_num(r.get(h))) for h in head) + r" \\" for r in rows]
    return "\n".join(lines + [r"\bottomrule", r"\end{tabular}"]) + "\n"


TABLES = {"stepwise": stepwise_rows, "depth": depth_rows, "e2e": e2e_rows, "paper": paper_rows}


def write_tables(variants: list[Variant], out_dir: str | Path) -> dict[str, list[dict]]:
    """Every table in three formats, written into out_dir as one atomic folder."""
    tables = {name: fn(variants) for name, fn in TABLES.items()}
    with atomic_dir(out_dir) as tmp:
        for name, rows in tables.items():
            (tmp / f"{name}.csv").write_text(_csv(rows))
            (tmp / f"{name}.md").write_text(_markdown(rows))
            (tmp / f"{name}.tex").write_text(_latex(rows))
    return tables


def write_rows(rows: list[dict], path: str | Path) -> None:
    """One CSV file, atomically."""
    write_text(path, _csv(rows))
