"""The paper's figures (PDF), from the result files only."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from kvshot.core.io import atomic_file  # noqa: E402

from .results import (PAPER, Variant, block_context, is_ablation, judged_protocol, protocol_names,  # noqa: E402
                      roles, with_protocol)

PAPER_STYLE = {"marker": "X", "s": 90, "color": "black", "zorder": 5}


def _style():
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1)


def _save(fig, path: str | Path) -> None:
    path = Path(path)
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or None, bbox_inches="tight", dpi=110)
    finally:
        plt.close(fig)


def _err(values, cis):
    """Error-bar lengths; a percentile interval may leave out the pooled point estimate, so a
    side past the point draws as zero length instead of failing."""
    lo = [max(0.0, v - c[0]) if None not in (v, c[0]) else 0 for v, c in zip(values, cis)]
    hi = [max(0.0, c[1] - v) if None not in (v, c[1]) else 0 for v, c in zip(values, cis)]
    return [lo, hi]


def _title(protocol: str, under: list[Variant]) -> str:
    rep = (under[0].stepwise.get("repetition") or {}).get("share") if under else None
    return f"{protocol} protocol" + ("" if rep is None else f" (reference 4-gram repetition {rep:.0%})")


def _line_style(v: Variant) -> str:
    """Solid for the paper's paradigms; block-wise drafters dashed, gate remedies (the blockwise target's) dotted."""
    return "--" if v.paradigm == "block" else ":" if v.train.get("remedy") else "-"


def decay(variants: list[Variant], path) -> None:
    """alpha_k with its interval per step, and below it the rounds each alpha_k rests on, one
    column per evaluation protocol. An insufficient point (below the minimum rounds or sequences,
    or without an interval: `results.apply_guards`) is drawn hollow, without line or interval."""
    _style()
    protocols = protocol_names(variants)
    fig, axes = plt.subplots(2, len(protocols), figsize=(6.4 * len(protocols), 6.2), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4]})
    min_rounds, min_seqs = variants[0].stepwise["min_rounds"], variants[0].stepwise.get("min_sequences")
    last = len(variants[0].stepwise["alpha"]) - 1
    for col, protocol in enumerate(protocols):
        ax, axn = axes[0][col], axes[1][col]
        under = with_protocol(variants, protocol)
        for v in under:
            sw = v.stepwise
            a, ok = sw["alpha_observed"], sw["alpha_sufficient"]
            good = [k for k in range(len(a)) if ok[k]]
            few = [k for k in range(len(a)) if not ok[k] and a[k] == a[k]]
            line = ax.errorbar(good, [a[k] for k in good],
                               yerr=_err([a[k] for k in good], [sw["alpha_ci"][k] for k in good]),
                               marker="o", capsize=3, label=v.label, linestyle=_line_style(v))
            color = line.lines[0].get_color()
            ax.scatter(few, [a[k] for k in few], facecolors="none", edgecolors=color, zorder=4)
            axn.plot(range(len(a)), sw["rounds"], marker="o", color=color)
        for who, value in PAPER["alpha_6"].items():
            ax.scatter([6], [value], **PAPER_STYLE)
            ax.annotate(f"paper {who}\n{value}", (6, value), textcoords="offset points", fontsize=7,
                        xytext=(8, 4 if who == "kv-d4" else -16))
        ax.set_ylabel(r"$\alpha_k$ (conditional acceptance)")
        ax.set_title(_title(protocol, under), fontsize=10)
        ax.set_xlim(-0.3, last + 1.2)
        ax.set_ylim(0, 1)
        if len(variants) <= 8:
            ax.legend(fontsize=8, loc="lower left")
        elif col == len(protocols) - 1:   # many lines (the block-wise target's redraw): one legend beside the plots
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        axn.axhline(min_rounds, color="black", linestyle="--", linewidth=1, label=f"minimum ({min_rounds})")
        axn.set_yscale("symlog", linthresh=1)          # log-like, and 0 rounds stays drawable
        axn.set_ylim(bottom=0)
        axn.set_ylabel("rounds reaching k")
        axn.set_xlabel("draft step k")
        axn.set_xticks(range(last + 1))
        axn.legend(fontsize=8, loc="upper right")
    fig.suptitle("Long-range decay of acceptance")
    # the key shared by every panel, once, under the figure (a per-panel subtitle ran into its neighbour's)
    fig.text(0.5, 0.0, f"X: the paper's Qwen3-8B values at k = 6. Hollow: insufficient, "
             f"< {min_rounds} anchors or < {min_seqs} sequences.", ha="center", va="top", fontsize=9)
    _save(fig, path)


def depth(variants: list[Variant], path) -> None:
    """MAT against KV-only depth, one line per protocol; EAGLE-3 and the hybrid as reference
    lines under the protocol the claims are judged on. Block-wise drafters with KV context (uniform
    position weights), when present, as a second line per protocol, and gate remedies as reference lines."""
    _style()
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    judged = judged_protocol(variants)["protocol"]
    for protocol in protocol_names(variants):
        r = roles(with_protocol(variants, protocol))
        ds = sorted(r["kv"])
        mats = [r["kv"][d].stepwise["mat"] for d in ds]
        ax.errorbar(ds, mats, yerr=_err(mats, [r["kv"][d].stepwise["mat_ci"] for d in ds]), marker="o", capsize=3,
                    label=f"KV-only, {protocol}")
        few = [d for d in ds if not r["kv"][d].stepwise["mat_sufficient"]]
        if few:
            ax.scatter(few, [r["kv"][d].stepwise["mat"] for d in few], s=120, facecolors="white", edgecolors="red",
                       zorder=4, label="fewer rounds than the minimum")
        under = with_protocol(variants, protocol)
        blocks = {v.layers: v for v in sorted(under, key=lambda v: v.layers)
                  if v.paradigm == "block" and block_context(v) == "kv" and not is_ablation(v)}
        if blocks:
            bs = sorted(blocks)
            bm = [blocks[d].stepwise["mat"] for d in bs]
            ax.errorbar(bs, bm, yerr=_err(bm, [blocks[d].stepwise["mat_ci"] for d in bs]), marker="s", capsize=3,
                        linestyle="--", label=f"block-wise KV, {protocol}")
        if protocol == judged:
            shown = [(r["eagle3"], "--"), (r["hybrid"], ":")] + [(v, "-.") for v in under if v.train.get("remedy")]
            for v, style in shown:
                if v:
                    ax.axhline(v.stepwise["mat"], linestyle=style, color="gray",
                               label=f"{v.label}, {protocol}: {v.stepwise['mat']:.2f}")
            ax.set_xticks(sorted(set(ds) | set(blocks)))
    ax.scatter([1, 2], [PAPER["mat"]["kv-d1"], PAPER["mat"]["kv-d2"]], label="paper KV-only (Qwen3-8B)", **PAPER_STYLE)
    ax.set_xlabel("KV drafter depth (layers)")
    ax.set_ylabel("MAT (step-wise, chain)")
    ax.set_title("Query-estimation bottleneck: MAT vs depth")
    ax.legend(fontsize=7)
    _save(fig, path)


def gate(variants: list[Variant], path) -> None:
    """The hybrid gate over training, pooled over the seeds: g (mean, band min-max) and the
    share the gated KV correction adds to the hidden state, |g delta| / |h|, per layer (log
    scale), each seed's layer mean in grey beside it."""
    from .diagnostic_rules import share_trajectory

    _style()
    fig, (ax, axs) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for v in variants:   # v.log: pooled over the seeds (each seed's share: thin grey)
        for log in v.seed_logs if len(v.seed_logs) > 1 else []:
            pts = share_trajectory(log)
            axs.plot([s for s, _ in pts], [x for _, x in pts], linewidth=0.8, alpha=0.5, color="grey")
        recs = [x for x in v.log if "gate" in x]
        if recs:
            steps = [x["step"] for x in recs]
            ax.plot(steps, [x["gate"]["mean"] for x in recs], label=f"{v.name}: mean g")
            ax.fill_between(steps, [x["gate"]["min"] for x in recs], [x["gate"]["max"] for x in recs], alpha=0.2)
        shares = [x for x in v.log if x.get("gate_share")]
        for layer in range(len(shares[0]["gate_share"]) if shares else 0):
            ys = [float("nan") if x["gate_share"][layer] is None else x["gate_share"][layer] for x in shares]
            axs.plot([x["step"] for x in shares], ys, marker=".", label=f"{v.name}: layer {layer}")
    ax.set_xlabel("training step")
    ax.set_ylabel("gate g = sigmoid(gate logit)")
    ax.set_ylim(0, 1)
    ax.set_title("Hybrid gate g (band: min-max)")
    axs.set_xlabel("training step")
    axs.set_ylabel(r"$|g\,\delta| / |h|$")
    axs.set_yscale("log")
    axs.set_title("KV branch's share of the hidden state")
    for a in (ax, axs):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def gradients(variants: list[Variant], path) -> None:
    """Per KV-path variant, over training: positions sending gradient into W_K,W_V per those into
    W_Q,W_O (`diagnostics.GradientPositions`; bold: pooled over the seeds, thin: each seed; the
    dotted line is the sparse-gradient line of the claim), and below it the parameter groups'
    gradient norms (pooled)."""
    from .diagnostic_rules import KV_POSITION_RATIO, KV_SPARSE_RATIO, log_values

    _style()
    kv_variants = [v for v in variants if any(x.get("kv_key_share") is not None or x.get(KV_POSITION_RATIO) is not None
                                              for x in v.log)]
    n = max(1, len(kv_variants))
    fig, axes = plt.subplots(2, n, figsize=(3.6 * n, 6.4), sharey="row", squeeze=False)
    for col, v in enumerate(kv_variants):
        ax = axes[0][col]
        for log in v.seed_logs if len(v.seed_logs) > 1 else []:
            pts = log_values(log)
            ax.plot([s for s, _ in pts], [x for _, x in pts], linewidth=0.8, alpha=0.5, color="grey")
        pts = log_values(v.log)
        ax.plot([s for s, _ in pts], [x for _, x in pts], linewidth=2.5, label="pooled")
        ax.axhline(KV_SPARSE_RATIO, linestyle=":", color="black")
        ax.set_ylim(0, 1)
        ax.set_title(v.name)
        ax = axes[1][col]
        steps = [x["step"] for x in v.log]
        for group in sorted({g for x in v.log for g in x.get("grad_norm") or {}}):
            ax.plot(steps, [(x.get("grad_norm") or {}).get(group, float("nan")) for x in v.log], label=group,
                    linewidth=2.5 if group == "kv_wk_wv" else 1.0)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
    axes[0][0].set_ylabel("positions into W_K,W_V / W_Q,W_O")
    axes[1][0].set_ylabel("gradient norm")
    axes[1][-1].legend(fontsize=7)
    fig.suptitle("KV path: where its gradient comes from (top: pooled bold, seeds thin) and gradient norms")
    _save(fig, path)


def query_error(variants: list[Variant], path) -> None:
    _style()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for v in variants:   # every seed's held-out query cosine: their mean, their range shaded
        seeds = v.train.get("per_seed") or [v.train]
        curves = [c for c in ((s.get("eval") or {}).get("query_cosine") for s in seeds) if c]
        if curves:
            n = min(len(c) for c in curves)
            cols = [[c[k] for c in curves] for k in range(n)]
            line, = ax.plot(range(n), [sum(c) / len(c) for c in cols], marker="o",
                            label=f"{v.label}, {len(curves)} seed{'s' if len(curves) > 1 else ''}")
            ax.fill_between(range(n), [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("draft step k")
    ax.set_ylabel("cosine(drafter query, target query)")
    ax.set_title("Query estimation: KV-path query vs the target's own\n(mean over seeds, range shaded)")
    ax.legend(fontsize=8)
    _save(fig, path)


def e2e(variants: list[Variant], path) -> None:
    _style()
    rows = [(v.name, mode, m) for v in variants if v.e2e for mode, m in v.e2e["modes"].items()]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    if rows:
        import pandas as pd

        df = pd.DataFrame([{"variant": n, "mode": mo, "tau": m["tau"], "tokens/s": m["tokens_per_s"]} for n, mo, m in rows])
        sns.barplot(df, x="variant", y="tau", hue="mode", ax=a1)
        sns.barplot(df, x="variant", y="tokens/s", hue="mode", ax=a2)
        base = next(v.e2e["baseline"]["tokens_per_s"] for v in variants if v.e2e)
        a2.axhline(base, color="black", linestyle="--", label="plain decoding")
        a1.axhline(1.0, color="black", linestyle="--")
        a2.legend(fontsize=8)
        for ax in (a1, a2):
            ax.tick_params(axis="x", rotation=30)
    a1.set_title("tokens per verification round (tau)")
    a2.set_title("throughput")
    _save(fig, path)


def context(variants: list[Variant], path) -> None:
    """alpha_k by the anchor's context length (prefix-token buckets), one line per variant
    (paradigm in the label), at the first and the last draft step; one row per protocol.
    Points below the minimum rounds are hollow, intervals pooled Jeffreys."""
    _style()
    protocols = protocol_names(variants)
    steps = variants[0].stepwise["steps"]
    ks = sorted({0, steps - 1})
    fig, axes = plt.subplots(len(protocols), len(ks), figsize=(5.2 * len(ks), 3.6 * len(protocols)), squeeze=False,
                             sharey=True)
    min_rounds = variants[0].stepwise["min_rounds"]
    for row, protocol in enumerate(protocols):
        under = with_protocol(variants, protocol)
        for col, k in enumerate(ks):
            ax = axes[row][col]
            labels = []
            for v in under:
                ctx = v.stepwise.get("by_context")
                if not ctx:
                    continue
                labels = ctx["labels"]
                xs = list(range(len(labels)))
                a = [float("nan") if x[k] is None else x[k] for x in ctx["alpha"]]
                n = [x[k] for x in ctx["rounds"]]
                cis = [c[k] or (float("nan"), float("nan")) for c in ctx["alpha_jeffreys_ci"]]
                good = [i for i in xs if n[i] >= min_rounds and a[i] == a[i]]
                few = [i for i in xs if n[i] < min_rounds and a[i] == a[i]]
                line = ax.errorbar(good, [a[i] for i in good], yerr=_err([a[i] for i in good], [cis[i] for i in good]),
                                   marker="o", capsize=3, label=v.label)
                ax.scatter(few, [a[i] for i in few], facecolors="none", edgecolors=line.lines[0].get_color(), zorder=4)
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels)
            ax.set_ylim(0, 1)
            ax.set_title(f"{_title(protocol, under)}: $\\alpha_{k}$", fontsize=9)
            ax.set_xlabel("context length at the anchor (prefix tokens)")
            if col == 0:
                ax.set_ylabel(r"$\alpha_k$")
    handles, names = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, fontsize=8, loc="lower center", ncol=3, bbox_to_anchor=(0.5, -0.08))
    fig.suptitle(f"Acceptance by context length (hollow: fewer than {min_rounds} rounds)")
    fig.tight_layout()
    _save(fig, path)


def scaling(rows: list[dict], path) -> None:
    """MAT against the number of drafter training samples, one line per variant."""
    _style()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for name in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r for r in rows if r["variant"] == name), key=lambda r: r["train_samples"])
        xs, ys = [r["train_samples"] for r in pts], [r["MAT"] for r in pts]
        ax.errorbar(xs, ys, yerr=_err(ys, [(r["MAT_lo"], r["MAT_hi"]) for r in pts]), marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("drafter training samples")
    ax.set_ylabel("MAT (step-wise, chain)")
    ax.set_title("Data scaling per paradigm")
    ax.legend(fontsize=8)
    _save(fig, path)


FIGURES = {"decay": decay, "depth": depth, "gate": gate, "gradients": gradients, "query_error": query_error, "e2e": e2e,
           "context": context}
