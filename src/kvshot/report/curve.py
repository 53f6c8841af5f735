"""The learning curve (`snakemake results/curve/curve.md`): each curve drafter's held-out acc_k
against the training tokens it had seen (metrics.json `heldout_curve`, points at log-spaced
steps), as a table, figures/curve.pdf, and per drafter where acc_0 flattens, or, where it
does not, the fit that extrapolates the tokens to `curve.target_acc`.

The fit: least squares of acc_0 on log2(tokens) over the last FIT_POINTS points, so its slope
is the gain per doubling of training tokens; flat where that slope is below `curve.flat_gain`."""
from __future__ import annotations

import json
import math
from pathlib import Path

from kvshot.core.io import write_json, write_text

from .figures import _save, _style, plt
from .tables import _markdown, csv_text

FIT_POINTS = 3


def curve_rows(results: str | Path, variants: list[str], seeds: list[int]) -> list[dict]:
    """One row per held-out point: variant, seed, step, training tokens and seconds so far,
    the held-out loss and acc_0..acc_K-1; plus the run's trainer tokens/s and how it stopped."""
    rows = []
    for name in variants:
        for seed in seeds:
            path = Path(results) / "drafters" / name / f"seed{seed}" / "metrics.json"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no metrics (train the curve drafter first)")
            m = json.loads(path.read_text())
            for p in m["heldout_curve"]:
                if "train_tokens" not in p:
                    raise ValueError(f"{path}: heldout_curve step {p['step']}: no train_tokens (trained before the "
                                     f"curve target existed: retrain it)")
                rows.append({"variant": name, "seed": seed, "step": p["step"], "train_tokens": p["train_tokens"],
                             "train_seconds": p["train_seconds"], "heldout_loss": p["heldout_loss"],
                             **{f"acc_{k}": a for k, a in enumerate(p["heldout_acc_k"])},
                             "tokens_per_s": m["train_tokens_per_s"], "stopped_by": m["stopped_by"]})
    return rows


def fit_log2(tokens: list[float], acc: list[float]) -> tuple[float, float]:
    """(intercept, slope) of acc = a + b * log2(tokens), least squares."""
    xs = [math.log2(t) for t in tokens]
    mx, my = sum(xs) / len(xs), sum(acc) / len(acc)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, acc)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def flattening(points: list[dict], flat_gain: float, target_acc: float) -> dict:
    """Where one drafter's acc_0 curve stands: the gain per doubling over its last FIT_POINTS
    points; flat (and from which point) when below flat_gain; else the tokens at which the fit
    reaches target_acc."""
    pts = sorted(points, key=lambda p: p["train_tokens"])
    out = {"points": len(pts), "last_tokens": pts[-1]["train_tokens"], "last_acc_0": pts[-1]["acc_0"]}
    if len(pts) < FIT_POINTS:
        return {**out, "state": "too few points", "gain_per_doubling": None}
    a, b = fit_log2([p["train_tokens"] for p in pts[-FIT_POINTS:]], [p["acc_0"] for p in pts[-FIT_POINTS:]])
    out.update(fit=f"acc_0 = {a:+.4f} {b:+.4f} log2(tokens), last {FIT_POINTS} points", gain_per_doubling=b)
    if b < flat_gain:
        # the first window of FIT_POINTS points whose slope is already below flat_gain
        for i in range(len(pts) - FIT_POINTS + 1):
            w = pts[i: i + FIT_POINTS]
            if fit_log2([p["train_tokens"] for p in w], [p["acc_0"] for p in w])[1] < flat_gain:
                return {**out, "state": "flat", "flat_from_tokens": w[0]["train_tokens"]}
    if out["last_acc_0"] >= target_acc:
        return {**out, "state": "rising", "reaches_target_at": None, "target_reached": True}
    need = 2 ** ((target_acc - a) / b) if b > 0 else None
    return {**out, "state": "rising", "reaches_target_at": need, "target_reached": False}


def curve_figure(rows: list[dict], path: str | Path) -> None:
    """acc_k against training tokens, log axis: one panel per variant, one line per step k."""
    _style()
    names = list(dict.fromkeys(r["variant"] for r in rows))
    ks = sorted(int(c[4:]) for c in rows[0] if c.startswith("acc_"))
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 3.6), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        pts = sorted((r for r in rows if r["variant"] == name and r["seed"] == rows[0]["seed"]),
                     key=lambda r: r["train_tokens"])
        for k in ks:
            ax.plot([r["train_tokens"] for r in pts], [r[f"acc_{k}"] for r in pts], marker="o", ms=3, label=f"acc_{k}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("training tokens")
        ax.set_title(name)
    axes[0][0].set_ylabel("held-out acc_k (teacher-forced)")
    axes[0][-1].legend(fontsize=7)
    _save(fig, path)


def run_curve_report(results: str, variants: list[str], seeds: list[int], flat_gain: float, target_acc: float,
                     figure: str, table: str) -> dict:
    rows = curve_rows(results, variants, seeds)
    if not rows:
        raise ValueError(f"{results}: the curve drafters hold no held-out point (curve.points)")
    states = {f"{v}/seed{s}": flattening([r for r in rows if r["variant"] == v and r["seed"] == s], flat_gain, target_acc)
              for v in variants for s in seeds}
    curve_figure(rows, figure)
    table_rows = [{k: r[k] for k in r if k not in ("tokens_per_s", "stopped_by")} for r in rows]
    lines = ["# Learning curve", "", "Held-out (validation split) teacher-forced acc_k against the training tokens "
             "each drafter had seen (padding left out).", "", _markdown(table_rows), "## Where each curve stands", "",
             f"Flat: acc_0 gains less than {flat_gain} per doubling of training tokens (least squares over the last "
             f"{FIT_POINTS} points). Rising: the fit's tokens to held-out acc_0 = {target_acc}.", ""]
    for key, st in states.items():
        runs = [r for r in rows if f"{r['variant']}/seed{r['seed']}" == key]
        run, last = runs[0], max(runs, key=lambda r: r["train_tokens"])
        where = (f"flat from {st['flat_from_tokens']:,} tokens" if st["state"] == "flat" else
                 "too few points to fit" if st["state"] == "too few points" else
                 f"rising, past {target_acc} already" if st.get("target_reached") else
                 f"rising: reaches {target_acc} at ~{st['reaches_target_at']:,.0f} tokens by the fit"
                 if st.get("reaches_target_at") else "not rising: the fit never reaches the target")
        gain = f", {st['gain_per_doubling']:+.4f} per doubling ({st['fit']})" if st.get("fit") else ""
        lines.append(f"- {key}: acc_0 {st['last_acc_0']:.3f} at {st['last_tokens']:,} tokens; {where}{gain}; "
                     f"trainer {last['train_tokens'] / max(last['train_seconds'], 1e-9):.0f} tokens/s in its steps "
                     f"({run['tokens_per_s']:.0f} with the held-out points), stopped by {run['stopped_by']}")
    write_text(table, "\n".join(lines) + "\n")
    write_text(Path(table).with_suffix(".csv"), csv_text(rows))
    write_json(Path(table).with_suffix(".json"), {"rows": rows, "states": states})
    return {k: {"state": v["state"], "last_acc_0": round(v["last_acc_0"], 3)} for k, v in states.items()}
