"""Tables as CSV, Markdown and LaTeX, from the result files only."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from kvshot.core.io import atomic_dir, write_text

from .results import PAPER, Variant, anchor_counts, judged_protocol, protocol_names, roles, with_protocol


INSUFFICIENT = "insufficient data"


def _num(x, digits=3):
    return "" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _ci(pair) -> str:
    return f"[{_num(pair[0])}, {_num(pair[1])}]"


def _rate(value: float, enough: bool):
    """A rate, or the minimum-rounds rule's verdict on it."""
    return value if enough else INSUFFICIENT


def _range(stats: dict | None, k: int | None = None) -> str:
    """A spread across seeds as "[min, max]" (step k of a per-step record)."""
    if not stats:
        return ""
    lo, hi = (stats["min"], stats["max"]) if k is None else (stats["min"][k], stats["max"][k])
    return "" if lo is None else _ci([lo, hi])


def _seed_mean(stats: dict | None, k: int | None = None):
    if not stats:
        return None
    return stats["mean"] if k is None else stats["mean"][k]


def by_protocol(variants: list[Variant]):
    """(protocol, its reference repetition share, the variants under it), every protocol."""
    for protocol in protocol_names(variants):
        under = with_protocol(variants, protocol)
        rep = (under[0].stepwise.get("repetition") or {}).get("share") if under else None
        yield protocol, rep, under


def stepwise_rows(variants: list[Variant]) -> list[dict]:
    """One row per protocol and variant: alpha_k with the distinct anchors n_k it rests on, for
    every step, and the share of the protocol's reference tokens that repeat an earlier 4-gram."""
    rows = []
    for protocol, rep, under in by_protocol(variants):
        rows += [{"protocol": protocol, "repetition": rep} | row for row in _stepwise_rows(under)]
    return rows


def _stepwise_rows(variants: list[Variant]) -> list[dict]:
    rows = []
    for v in variants:
        sw = v.stepwise
        row = {"variant": v.name, "paradigm": v.paradigm, "layers": v.layers}
        for k, (a, n) in enumerate(zip(sw["alpha_observed"], anchor_counts(sw))):
            row |= {f"alpha_{k}": _rate(a, sw["alpha_sufficient"][k]), f"n_{k}": n}
        seeds = sw.get("across_seeds") or {}
        row |= {"MAT": _rate(sw["mat"], sw["mat_sufficient"]), "MAT 95% CI": _ci(sw["mat_ci"]),
                "seeds": len(seeds.get("seeds") or []) or 1,
                "MAT seed mean": _seed_mean(seeds.get("mat")), "MAT seed range": _range(seeds.get("mat")),
                "retention": _rate(sw["retention_observed"], sw["retention_sufficient"]),
                "min rounds": sw["min_rounds"], "min sequences": sw["min_sequences"]}
        rows.append(row)
    return rows


def _e2e(v: Variant, field: str) -> str:
    chain = (v.e2e or {}).get("modes", {}).get("chain")
    return "-" if not chain else f"{chain[field]:.3f}" if field == "tau" else f"{chain[field]:.2f}x"


def compact_rows(variants: list[Variant]) -> list[dict]:
    """The README's table: per variant on the judged protocol, alpha_0 and the last step's alpha
    with the anchors behind them, MAT with its interval, retention; chain decoding's tau and
    speedup over plain decoding (E2E, "-" without an e2e.json)."""
    protocol = judged_protocol(variants)["protocol"]
    rows = []
    for v in with_protocol(variants, protocol):
        sw, n = v.stepwise, anchor_counts(v.stepwise)
        last = len(n) - 1
        rows.append({"variant": v.name, "paradigm": v.paradigm, "layers": v.layers,
                     "alpha_0": _rate(sw["alpha_observed"][0], sw["alpha_sufficient"][0]), "n_0": n[0],
                     f"alpha_{last}": _rate(sw["alpha_observed"][last], sw["alpha_sufficient"][last]), f"n_{last}": n[last],
                     "MAT": _rate(sw["mat"], sw["mat_sufficient"]), "MAT 95% CI": _ci(sw["mat_ci"]),
                     "retention": _rate(sw["retention_observed"], sw["retention_sufficient"]),
                     "chain tau": _e2e(v, "tau"), "chain speedup": _e2e(v, "speedup"), "protocol": protocol})
    return rows


def step_rows(variants: list[Variant]) -> list[dict]:
    """One row per protocol, variant and step: counts, alpha_k and the cumulative acceptance
    with their intervals, and the bootstrap resamples in which the step was undefined."""
    rows = []
    for protocol, _, v in ((p, r, v) for p, r, under in by_protocol(variants) for v in under):
        sw = v.stepwise
        for k, n in enumerate(sw["rounds"]):
            rows.append({"protocol": protocol, "variant": v.name, "k": k, "rounds": n,
                         "distinct anchors": anchor_counts(sw)[k], "accepted": sw["accepted"][k],
                         "alpha_k": _rate(sw["alpha_observed"][k], sw["alpha_sufficient"][k]),
                         "alpha_k 95% CI": _ci(sw["alpha_ci"][k]), "Jeffreys CI (pooled)": _ci(sw["alpha_jeffreys_ci"][k]),
                         "undefined resamples": sw["alpha_undefined_resamples"][k],
                         "cumulative": _rate(sw["cumulative"][k], sw["mat_sufficient"]),
                         "cumulative 95% CI": _ci(sw["cumulative_ci"][k]),
                         "alpha_k seed mean": _seed_mean((sw.get("across_seeds") or {}).get("alpha_observed"), k),
                         "alpha_k seed range": _range((sw.get("across_seeds") or {}).get("alpha_observed"), k)})
    return rows


def context_rows(variants: list[Variant]) -> list[dict]:
    """alpha_k by the anchor's context length (prefix-token buckets), per protocol and variant."""
    rows = []
    for protocol, _, under in by_protocol(variants):
        for v in under:
            ctx, min_rounds = v.stepwise.get("by_context"), v.stepwise["min_rounds"]
            for b, label in enumerate((ctx or {}).get("labels", [])):
                row = {"protocol": protocol, "variant": v.name, "paradigm": v.paradigm, "context": label,
                       "anchors": ctx["anchors"][b]}
                for k, (a, n) in enumerate(zip(ctx["alpha"][b], ctx["rounds"][b])):
                    row |= {f"alpha_{k}": _rate(a, a is not None and n >= min_rounds), f"n_{k}": n}
                rows.append(row)
    return rows


def depth_rows(variants: list[Variant]) -> list[dict]:
    """MAT and the last step's alpha by KV-only depth, on the protocol the claims are judged on."""
    protocol = judged_protocol(variants)["protocol"]
    variants = with_protocol(variants, protocol)
    r = roles(variants)
    def row(v: Variant, paradigm: str) -> dict:
        sw, last = v.stepwise, v.stepwise["steps"] - 1
        return {"drafter": v.name, "paradigm": paradigm, "layers": v.layers, "protocol": protocol,
                "MAT": _rate(sw["mat"], sw["mat_sufficient"]), "n_0": anchor_counts(sw)[0],
                f"alpha_{last}": _rate(sw["alpha_observed"][-1], sw["alpha_sufficient"][-1]),
                f"n_{last}": anchor_counts(sw)[-1]}

    rows = [row(v, "KV-only") for d, v in sorted(r["kv"].items())]
    rows += [row(v, v.paradigm) for v in (r["eagle3"], r["hybrid"]) if v]
    return rows


def e2e_rows(variants: list[Variant]) -> list[dict]:
    """Per variant and decoding mode; intervals: prompt x seed bootstrap (kvshot.stats.prompt_bootstrap).
    The drafting overhead here is between separate jobs; the E2E claim's comes from the e2e_timing job."""
    ref = roles(variants)["eagle3"]
    rows = []
    for v in variants:
        if not v.e2e:
            continue
        for mode, m in v.e2e["modes"].items():
            base = ref.e2e["modes"][mode]["draft_seconds_per_round"] if ref and ref.e2e else None
            tau_ci = (m.get("intervals") or {}).get("tau", {}).get("ci")
            stepwise_mat = v.protocols.get(v.e2e.get("protocol"), v.stepwise)["mat"]   # MAT on the prompts' protocol
            rows.append({"variant": v.name, "mode": mode, "tau": m["tau"], "tau 95% CI": _ci(tau_ci) if tau_ci else "",
                         "rounds": m.get("rounds"), "prompts": v.e2e.get("prompts"),
                         "step-wise MAT": stepwise_mat, "tau - MAT": m["tau"] - stepwise_mat,
                         "tokens/s": m["tokens_per_s"],
                         "speedup": m["speedup"], "draft ms/round": 1e3 * m["draft_seconds_per_round"],
                         "verify ms/round": 1e3 * m["verify_seconds_per_round"],
                         "draft overhead vs EAGLE-3": (m["draft_seconds_per_round"] / base - 1) if base else None,
                         "lossless": m["lossless"]})
    return rows


def paper_rows(variants: list[Variant]) -> list[dict]:
    """This run beside every number the paper reports (step-wise: the judged protocol's)."""
    protocol = judged_protocol(variants)["protocol"]
    stepwise_of = {v.name: v.stepwise for v in with_protocol(variants, protocol)}
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
                sw = stepwise_of[v.name]
                ours = {"alpha_6": _rate(sw["alpha_observed"][-1], sw["alpha_sufficient"][-1]),
                        "mat": _rate(sw["mat"], sw["mat_sufficient"]),
                        "retention": _rate(sw["retention_observed"], sw["retention_sufficient"]),
                        "tau": v.e2e["modes"]["chain"]["tau"] if v.e2e else None}[metric]
            rows.append({"metric": metric, "drafter": who, "paper (Qwen3-8B)": paper, "this run": ours,
                         "protocol": f"{((v and v.e2e) or {}).get('protocol', 'continuations')} (E2E)" if metric == "tau"
                         else protocol})
    return rows


def csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [])
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def training_rows(variants: list[Variant]) -> list[dict]:
    """One row per variant and training seed: the steps it trained, why it stopped (max_steps,
    plateau of the held-out loss, or the max_minutes time cap), and its held-out curve's ends."""
    rows = []
    for v in variants:
        for m in v.train.get("per_seed") or [v.train]:
            curve = m.get("heldout_curve") or []
            losses = [p["heldout_loss"] for p in curve]
            rows.append({"variant": v.name, "seed": m.get("seed"), "steps": m.get("steps"),
                         "stopped by": m.get("stopped_by"), "held-out points": len(curve),
                         "held-out loss first": losses[0] if losses else None,
                         "held-out loss best": min(losses) if losses else None,
                         "held-out loss last": losses[-1] if losses else None,
                         "seconds": m.get("train_seconds")})
    return rows


def training_summary_rows(variants: list[Variant]) -> list[dict]:
    """One row per variant over its seeds: steps, why training stopped, the last held-out loss
    and its relative change over the curve's last interval, and the same for held-out acc_0
    (absolute change): both near 0 is what the plateau rule calls flat."""
    rows = []
    for v in variants:
        seeds = v.train.get("per_seed") or [v.train]
        stops = sorted({m.get("stopped_by") for m in seeds}, key=str)
        curves = [[p["heldout_loss"] for p in m.get("heldout_curve") or []] for m in seeds]
        changes = [(c[-1] - c[-2]) / c[-2] for c in curves if len(c) >= 2]
        lasts = [c[-1] for c in curves if c]
        accs = [[p["heldout_acc_k"][0] for p in m.get("heldout_curve") or [] if p.get("heldout_acc_k")] for m in seeds]
        acc_last = [a[-1] for a in accs if a]
        acc_change = [a[-1] - a[-2] for a in accs if len(a) >= 2]   # absolute: the plateau rule's acc_0 measure
        rows.append({"variant": v.name, "seeds": len(seeds), "steps": "/".join(str(m.get("steps")) for m in seeds),
                     "stopped by": ", ".join(f"{s} x{sum(m.get('stopped_by') == s for m in seeds)}" for s in stops),
                     "held-out loss last (mean)": sum(lasts) / len(lasts) if lasts else None,
                     "last interval change (mean)": f"{100 * sum(changes) / len(changes):+.2f}%" if changes else "",
                     "held-out acc_0 last (mean)": _mean(acc_last),
                     "acc_0 last interval change (mean)": f"{_mean(acc_change):+.3f}" if acc_change else "",
                     "interval (steps)": (seeds[0].get("heldout_curve") or [{}, {}])[-1].get("step", 0)
                     - (seeds[0].get("heldout_curve") or [{}, {}])[-2].get("step", 0) if changes else None})
    return rows


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def time_capped(variants: list[Variant], target_metrics: dict | None = None) -> list[str]:
    """What stopped at its `max_minutes` safety cap instead of its step budget: such a result
    depends on the machine's speed and load, not only on the config and seed."""
    out = [f"target ({target_metrics.get('train_steps')} steps)"] if (target_metrics or {}).get("stopped_by") == "max_minutes" else []
    for r in training_rows(variants):
        if r["stopped by"] == "max_minutes":
            out.append(f"{r['variant']} seed {r['seed']} ({r['steps']} steps)")
    return out


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


TABLES = {"stepwise": stepwise_rows, "steps": step_rows, "context": context_rows, "depth": depth_rows, "e2e": e2e_rows,
          "paper": paper_rows, "training": training_rows}


def write_tables(variants: list[Variant], out_dir: str | Path,
                 extra: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Every table in three formats, written into out_dir as one atomic folder; `extra`: more
    files by name (report.benchmarks.table_files)."""
    tables = {name: fn(variants) for name, fn in TABLES.items()}
    with atomic_dir(out_dir) as tmp:
        for name, rows in tables.items():
            (tmp / f"{name}.csv").write_text(csv_text(rows))
            (tmp / f"{name}.md").write_text(_markdown(rows))
            (tmp / f"{name}.tex").write_text(_latex(rows))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
    return tables


def write_rows(rows: list[dict], path: str | Path) -> None:
    """One CSV file, atomically."""
    write_text(path, csv_text(rows))
