"""EAGLE-3.1's attention-drift switches against the other paradigms, from the result
files only: figures/drift.pdf (alpha_k against k, and the retention alpha_{K-1}/alpha_0, side by
side), results/drift/drift.csv, and verdicts in the claims machinery (`claims.Judge`: paired 95%
intervals on the shared anchors, enough anchors, the smallest detectable difference beside an
inconclusive verdict).

Drawn side by side: EAGLE-3, EAGLE-3.1 and its two single-switch ablations (results/drift/, the
`drift.variants`), the KV-only chains and the hybrid (results/, `drift.compare`), and the best
block-wise variant, the one of `drift.blocks` with the highest retention (results/blockwise/).
Roles come from the variants' own settings (drafter config.json), not from their names:
EAGLE-3.1 is the drift variant with both fc_norm and norm_output on.
"""
from __future__ import annotations

from pathlib import Path

from kvshot.core.io import read_json, write_json, write_text

from .claims import INCONCLUSIVE, MISSING, Judge, alpha_at, claim, claims_markdown, retention_of
from .figures import _err, _save, _style, plt
from .results import Variant, judged_protocol, load_variants, roles, seed_folders, seed_runs, with_protocol
from .tables import write_rows

SWITCHES = ("fc_norm", "norm_output")


def read_switches(results: Path, variants: list[Variant]) -> None:
    """Each drift variant's fc_norm / norm_output from its first seed's drafter config."""
    for v in variants:
        folders = seed_folders(results / "drafters" / v.name, v.stepwise)
        config = read_json(folders[0] / "config.json") if folders else {}
        for key in SWITCHES:
            v.train[key] = bool(config.get(key, False))


def split_roles(drift: list[Variant], main: list[Variant], blocks: list[Variant]) -> dict:
    """EAGLE-3 (the 1-layer hidden reference), EAGLE-3.1 (both switches), the ablations (one
    switch each), the KV-only chains by depth, the hybrid, the best block-wise variant."""
    r = roles(main)
    both = [v for v in drift if all(v.train.get(k) for k in SWITCHES)]
    ablations = [v for v in drift if v not in both]
    best = max(blocks, key=lambda v: _value(retention_of(v).value), default=None)
    return {"eagle3": r["eagle3"], "eagle3.1": both[0] if both else None, "ablations": ablations, "kv": r["kv"],
            "hybrid": r["hybrid"], "block": best}


def _value(x: float) -> float:
    return float("-inf") if x != x else x   # NaN (too few anchors) ranks last


def shown(r: dict) -> list[tuple[Variant, str]]:
    """The variants in drawing order, each with its role."""
    out = [(r["eagle3"], "EAGLE-3"), (r["eagle3.1"], "EAGLE-3.1")]
    out += [(v, "ablation: " + " + ".join(k for k in SWITCHES if v.train.get(k))) for v in r["ablations"]]
    out += [(v, f"KV-only, depth {d}") for d, v in sorted(r["kv"].items())]
    out += [(r["hybrid"], "hybrid"), (r["block"], "best block-wise")]
    return [(v, role) for v, role in out if v is not None]


def evaluate_drift_claims(r: dict, everyone: list[Variant], judged: dict) -> list[dict]:
    judge = Judge(seed_runs(everyone))
    n_seeds = len(seed_runs(everyone))
    steps = min(v.stepwise["steps"] for v in everyone) if everyone else 7
    last = steps - 1
    deep = r["kv"].get(max(r["kv"])) if r["kv"] else None
    out = []

    def add(name, paper, x, y):
        test = (f"retention alpha_{last}/alpha_0 of {x.name if x else '?'} > of {y.name if y else '?'}; paired 95% "
                f"interval over shared anchors ({judged['protocol']} protocol)")
        if x is None or y is None:
            out.append(claim(name, paper, test, {}, MISSING))
            return
        verdict = judge.greater(x, y, retention_of)
        nums = {f"retention {v.name}": retention_of(v).text() for v in (x, y)}
        nums |= {f"alpha_{last} {v.name}": alpha_at(last)(v).text() for v in (x, y)}
        c = claim(name, paper, test, nums, verdict, judge.take_notes(), n_seeds)
        c["comparisons"] = judge.take_comparisons()
        c["protocol"], c["reference_repetition"] = judged["protocol"], judged["repetition"]
        if judged["note"]:
            c["note"] = "; ".join(filter(None, [c.get("note"), judged["note"]]))
        out.append(c)

    add("EAGLE-3.1 retains more than EAGLE-3 at long range",
        "EAGLE-3.1 (arXiv 2605.09992): per-state fc norms and a post-norm carried state curb the drift of the "
        "carried hidden state, so acceptance holds up at later draft steps", r["eagle3.1"], r["eagle3"])
    add(f"KV-only at depth {max(r['kv']) if r['kv'] else 4} retains more than EAGLE-3.1",
        "the paper's thesis against the drift remedy: re-reading the target's KV cache keeps long-range "
        "acceptance that a better-normed hidden state alone does not", deep, r["eagle3.1"])
    for v in r["ablations"]:   # which switch carries it (reported beside, judged the same way)
        switch = " + ".join(k for k in SWITCHES if v.train.get(k)) or "neither switch"
        add(f"{switch} alone ({v.name}) retains more than EAGLE-3", "the paper's ablation of one switch", v, r["eagle3"])
    return out


def drift_rows(order: list[tuple[Variant, str]]) -> list[dict]:
    rows = []
    for v, role in order:
        sw = v.stepwise
        ret = retention_of(v)
        row = {"variant": v.name, "role": role, "paradigm": v.paradigm, "layers": v.layers,
               **{f"alpha_{k}": a for k, a in enumerate(sw["alpha_observed"])},
               "retention": ret.value, "retention_low": ret.ci[0], "retention_high": ret.ci[1],
               "mat": sw["mat"], "anchors": ret.rounds}
        rows.append(row)
    return rows


def drift_figure(order: list[tuple[Variant, str]], protocol: str, path) -> None:
    """Left: alpha_k against k per variant; right: retention alpha_{K-1}/alpha_0 with its interval."""
    _style()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    for v, role in order:
        sw = v.stepwise
        ok = [k for k in range(len(sw["alpha_observed"])) if sw["alpha_sufficient"][k]]
        a = [sw["alpha_observed"][k] for k in ok]
        style = "-" if v.paradigm == "hidden" else "--" if v.paradigm == "kv" else ":"
        left.errorbar(ok, a, yerr=_err(a, [sw["alpha_ci"][k] for k in ok]), linestyle=style, marker="o",
                      capsize=3, label=f"{v.name} ({role})")
    left.set_xlabel("draft step k")
    left.set_ylabel(r"$\alpha_k$ (conditional acceptance)")
    left.set_ylim(0, 1)
    left.legend(fontsize=6, loc="lower left", ncol=2)
    names = [v.name for v, _ in order]
    rets = [retention_of(v) for v, _ in order]
    values = [e.value if e.enough else 0.0 for e in rets]
    right.barh(range(len(order)), values, xerr=_err(values, [e.ci if e.enough else (0.0, 0.0) for e in rets]),
               capsize=3, color=[f"C{i}" for i in range(len(order))])
    for i, e in enumerate(rets):   # no bar: say why, not a zero
        if not e.enough:
            right.text(0.02, i, e.text(), va="center", fontsize=7,
                       transform=right.get_yaxis_transform())
    right.set_yticks(range(len(order)), names, fontsize=8)
    right.invert_yaxis()
    last = min(len(v.stepwise["alpha_observed"]) for v, _ in order) - 1 if order else 6
    right.set_xlabel(rf"retention $\alpha_{{{last}}}/\alpha_0$ (95% interval)")
    fig.suptitle(f"Hidden-state drift: EAGLE-3 vs EAGLE-3.1 vs KV re-attention ({protocol} protocol)")
    _save(fig, path)


def run_drift_report(results: str, drift_names: list[str], compare_names: list[str], block_names: list[str],
                     figure: str, table: str, claims_md: str, claims_json: str) -> dict:
    root = Path(results)
    drift = load_variants(root / "drift", drift_names)
    read_switches(root / "drift", drift)
    main = load_variants(root, compare_names)
    blocks = load_variants(root / "blockwise", block_names, with_e2e=False) if block_names else []
    everyone = drift + main + blocks
    judged = judged_protocol(everyone)
    everyone = with_protocol(everyone, judged["protocol"])   # (each keeps its train record, switches included)
    n1, n2 = len(drift), len(drift) + len(main)
    r = split_roles(everyone[:n1], everyone[n1:n2], everyone[n2:])
    order = shown(r)
    drawn = [v for v, _ in order]
    claims = evaluate_drift_claims(r, drawn, judged)
    write_rows(drift_rows(order), table)
    drift_figure(order, judged["protocol"], figure)
    write_json(claims_json, claims)
    text = claims_markdown(claims).replace("# Claims verdict", "# Hidden-state drift (EAGLE-3.1): verdicts")
    write_text(claims_md, text.replace("by `kvshot report`", "by `kvshot drift-report`"))
    return {c["claim"]: c["verdict"] for c in claims}


__all__ = ["run_drift_report", "evaluate_drift_claims", "split_roles", "INCONCLUSIVE"]
