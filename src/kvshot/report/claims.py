"""A verdict on each of the paper's claims, computed from the result files only.

Step-wise comparisons are paired: every variant and seed is scored on the same anchors, and
stepwise.json keeps each anchor's accepted run per seed (`anchors_panel`). A comparison is the
interval of the difference (or contrast) on those shared anchors (`resample.interval`: one
sequence bootstrap, the training seeds' variance as its own component, 95% two-sided):
`reproduced` when it excludes zero in the paper's direction, `not reproduced` when it excludes
zero the other way, `inconclusive` otherwise, with the smallest difference this run would decide
at 80% power (`mde`) beside it. A number that rests on fewer distinct anchors or sequences than
the minimums (stepwise.json `min_rounds`, `min_sequences`), or whose resamples do not vary, is
insufficient and makes its comparison inconclusive, and the comparison says why (`insufficient`).
Each comparison is recorded in its claim's `comparisons` (claims.json). The E2E claim pairs tau on shared prompts
(`e2e_claim`); the diagnostics (gate, gradient positions) state their rules with each test
(`diagnostic_rules`). The paper's numbers come from
results.PAPER. Step-wise claims are judged on the evaluation protocol whose reference tokens
repeat themselves at most eval.max_repetition (`results.judged_protocol`), recorded in each
claim as `protocol`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from kvshot.stats.resample import AnchorPanel, Interval, count_why, interval, read_panel, reason_why, same_anchors

from .diagnostic_rules import (GATE_CLOSED_FRACTION, GATE_EARLY_FRACTION, GATE_MIN_POINTS, GATE_SHARE,
                               KV_POSITION_RATIO, KV_SPARSE_RATIO, band, gate_collapse, gate_trajectory, log_values,
                               replicates, share_trajectory, side)
from .e2e_claim import e2e_claim   # the E2E claim: an equivalence test on paired tau (its own module)
from .verdicts import INCONCLUSIVE, MISSING, NOT_REPRODUCED, REPRODUCED, agree, claim, combine  # noqa: F401
from .results import (PAPER, Variant, anchor_counts, judged_protocol, roles, seed_runs, sequence_counts,
                      with_protocol)


# the diagnostic rules and their thresholds: report/diagnostic_rules.py, docs/paper-vs-kvshot.md (Diagnostics)
GATE_SHARE_NEGLIGIBLE = 0.01   # a KV branch that adds under 1% of |h| is effectively unused (noted)


@dataclass(frozen=True)
class Estimate:
    """One step-wise number of one variant: its statistic (`resample.statistic` name), value,
    interval, the distinct anchors and sequences it rests on, and why it is insufficient
    (`reason`, from the guards `results.apply_guards` applied; None: it stands)."""
    what: str
    value: float
    ci: tuple[float, float]
    rounds: int
    min_rounds: int
    stat: str = ""
    sequences: int | None = None
    min_sequences: int = 0
    reason: str | None = None

    @property
    def enough(self) -> bool:
        return self.reason is None and self.rounds >= self.min_rounds and not math.isnan(self.value)

    def text(self) -> str:
        if not self.enough:
            why = reason_why(self.reason) or count_why(self.rounds, self.sequences, self.min_rounds, self.min_sequences)
            return f"insufficient data ({why or 'no estimate'})"
        return f"{self.value:.3f} [{self.ci[0]:.3f}, {self.ci[1]:.3f}] (n={self.rounds})"


def _estimate(sw: dict, what: str, value: float, ci, k: int, stat: str, reason: str | None) -> Estimate:
    """An Estimate resting on the anchors and sequences that reach step k."""
    return Estimate(what, value, tuple(ci), anchor_counts(sw)[k], sw["min_rounds"], stat,
                    sequence_counts(sw)[k], sw.get("min_sequences", 0), reason)


def alpha_at(k: int) -> Callable[[Variant], Estimate]:
    def get(v: Variant) -> Estimate:
        sw = v.stepwise
        return _estimate(sw, f"alpha_{k}", sw["alpha_observed"][k], sw["alpha_ci"][k], k, f"alpha_{k}",
                         (sw.get("alpha_reason") or [None] * (k + 1))[k])
    return get


def mat_of(v: Variant) -> Estimate:
    """MAT = 1 + sum_k accepted_k / rounds_0: it rests on the anchors of step 0."""
    sw = v.stepwise
    return _estimate(sw, "MAT", sw["mat"], sw["mat_ci"], 0, "mat", sw.get("mat_reason"))


def retention_of(v: Variant) -> Estimate:
    """alpha_{K-1} / alpha_0: it rests on the fewer anchors, those of the last step."""
    sw = v.stepwise
    return _estimate(sw, "retention", sw["retention_observed"], sw["retention_ci"], len(sw["rounds"]) - 1,
                     "retention", sw.get("retention_reason"))


def decide(diff: Interval) -> str:
    """The verdict on "contrast > 0" from its paired interval."""
    if any(math.isnan(x) for x in (diff.low, diff.high)):
        return INCONCLUSIVE
    return REPRODUCED if diff.low > 0 else NOT_REPRODUCED if diff.high < 0 else INCONCLUSIVE


class Judge:
    """Paired comparisons between variants on their shared anchors, with the notes on numbers
    that rest on too few anchors and the record of every comparison (`take_comparisons`).
    per_seed: each seed's variants, for the per-seed differences shown beside the pooled one."""

    def __init__(self, per_seed: list[list[Variant]], samples: int = 1000, seed: int = 0):
        self.seeds = [{v.name: v for v in run} for run in per_seed]
        self.samples, self.seed = samples, seed
        self.notes: list[str] = []
        self.comparisons: list[dict] = []
        self._panels: dict[int, AnchorPanel | None] = {}

    def greater(self, x: Variant, y: Variant, get: Callable[[Variant], Estimate]) -> str:
        """Is get(x) > get(y)? The paired difference x - y."""
        return self.contrast([x, y], (1.0, -1.0), get, f"{x.name} - {y.name}")

    def contrast(self, variants: list[Variant], coefs: tuple[float, ...], get: Callable[[Variant], Estimate],
                 label: str) -> str:
        """Is sum_i coefs[i] * get(variants[i]) > 0? Paired on the shared anchors."""
        estimates = [get(v) for v in variants]
        for e, v in zip(estimates, variants):
            note = f"{e.what} of {v.name}: {e.text()}"
            if not e.enough and note not in self.notes:
                self.notes.append(note)
        record = {"statistic": estimates[0].what, "contrast": label,
                  "variants": [v.name for v in variants], "coefficients": list(coefs)}
        panels = [self.panel(v) for v in variants]
        if any(p is None for p in panels) or not all(same_anchors(panels[0], p) for p in panels[1:]):
            self.comparisons.append(record | {"verdict": INCONCLUSIVE,
                                              "note": "no per-anchor counts on shared anchors: cannot pair"})
            return INCONCLUSIVE
        diff = interval(panels, estimates[0].stat, self.samples, self.seed, coefs=coefs)
        short = [f"{e.what} of {v.name}: {e.text()}" for e, v in zip(estimates, variants) if not e.enough]
        verdict = decide(diff) if not short else INCONCLUSIVE
        record |= {"difference": diff.estimate, "ci": [diff.low, diff.high], "se": diff.se, "mde": diff.mde,
                   "level": diff.level, "verdict": verdict,
                   "anchors": min(e.rounds for e in estimates), "min_rounds": estimates[0].min_rounds,
                   "sequences": min((e.sequences for e in estimates if e.sequences is not None), default=None),
                   "min_sequences": estimates[0].min_sequences}
        if short or diff.reason:   # the verdict says why it cannot decide
            record["insufficient"] = "; ".join(short + ([f"the difference: {diff.reason}"] if diff.reason else []))
        if self.seeds:
            record["per_seed_difference"] = [sum(c * get(s[v.name]).value for c, v in zip(coefs, variants))
                                             for s in self.seeds]
        self.comparisons.append(record)
        return verdict

    def panel(self, v: Variant) -> AnchorPanel | None:
        key = id(v.stepwise)
        if key not in self._panels:
            self._panels[key] = variant_panel(v)
        return self._panels[key]

    def take_notes(self) -> str:
        notes, self.notes = self.notes, []
        return "; ".join(notes)

    def take_comparisons(self) -> list[dict]:
        out, self.comparisons = self.comparisons, []
        return out


def variant_panel(v: Variant) -> AnchorPanel | None:
    """The variant's per-anchor chain lengths under its current protocol (None in files written
    before stepwise.json kept them)."""
    record = v.stepwise.get("anchors_panel")
    return read_panel(record, v.stepwise["steps"]) if record else None


def comparison_text(c: dict) -> str:
    """One comparison for claims.md: difference, interval, and the smallest detectable one."""
    if "difference" not in c:
        return f"{c['contrast']} ({c['statistic']}): {c.get('note', 'not compared')}"
    if c.get("insufficient"):   # no interval, or one resting on insufficient numbers: not decided
        d = c["difference"]
        shown = f"{d:+.3f}" if d is not None and math.isfinite(d) else "no estimate"
        return f"{c['contrast']} ({c['statistic']}): {shown}, not decided: {c['insufficient']}"
    text = f"{c['contrast']} ({c['statistic']}): {c['difference']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}]"
    if c["verdict"] == INCONCLUSIVE:
        text += f", detectable at 80% power: |difference| >= {c['mde']:.3f}"
    return text


def evaluate_claims(variants: list[Variant], per_seed: list[list[Variant]] | None = None) -> list[dict]:
    """Every claim's verdict. Step-wise claims are judged on one evaluation protocol
    (`results.judged_protocol`: a reference that repeats itself at most eval.max_repetition),
    named in each of them. per_seed: one list of variants per training seed (default: the
    variants' own per-seed records under that protocol, `results.seed_runs`); empty for a single run."""
    judged = judged_protocol(variants)
    variants = with_protocol(variants, judged["protocol"])
    per_seed = seed_runs(variants) if per_seed is None else per_seed
    judge, n_seeds = Judge(per_seed), len(per_seed)
    r = roles(variants)
    ref, kv, hyb = r["eagle3"], r["kv"], r["hybrid"]
    out = []
    last = (ref.stepwise["steps"] - 1) if ref else 6
    P = PAPER

    def add(name, paper, test, numbers, verdict):
        c = claim(name, paper, test, numbers, verdict, judge.take_notes(), n_seeds)
        c["comparisons"] = judge.take_comparisons()
        c["protocol"] = judged["protocol"]
        c["reference_repetition"] = judged["repetition"]
        if judged["note"]:
            c["note"] = "; ".join(filter(None, [c.get("note"), judged["note"]]))
        out.append(c)

    paired = "paired difference on the shared anchors, 95% interval excludes 0"
    if ref and kv:
        deep = kv[max(kv)]
        v = judge.greater(deep, ref, alpha_at(last))
        add("P1 long-range advantage",
            f"alpha_6: 4-layer KV-only {P['alpha_6']['kv-d4']} > EAGLE-3 {P['alpha_6']['eagle3']}",
            f"alpha_{last}({deep.name}) > alpha_{last}({ref.name}); {paired}",
            {deep.name: alpha_at(last)(deep).text(), ref.name: alpha_at(last)(ref).text()}, v)
    m = P["mat"]
    depths = sorted(kv)
    if len(depths) >= 2:
        lo, hi = kv[depths[0]], kv[depths[1]]
        add("P2 KV-only depends on depth", f"MAT {m['kv-d1']} (1 layer) < {m['kv-d2']} (2 layers)",
            f"MAT({hi.name}) > MAT({lo.name}); {paired}",
            {v.name: mat_of(v).text() for v in (lo, hi)}, judge.greater(hi, lo, mat_of))
    if len(depths) >= 3:
        d1, d2, d4 = (kv[d] for d in depths[:3])
        add("P2 diminishing returns with depth", f"from {depths[1]} to {depths[2]} layers the gain diminishes",
            f"MAT({d4.name}) - MAT({d2.name}) < MAT({d2.name}) - MAT({d1.name}), i.e. the contrast "
            f"2 MAT({d2.name}) - MAT({d1.name}) - MAT({d4.name}) > 0; {paired}",
            {v.name: mat_of(v).text() for v in (d1, d2, d4)},
            judge.contrast([d2, d1, d4], (2.0, -1.0, -1.0), mat_of, f"2 {d2.name} - {d1.name} - {d4.name}"))
    if ref and kv:
        add("P2 EAGLE-3 above every KV-only depth", f"every KV-only depth below EAGLE-3's MAT {m['eagle3']}",
            f"MAT({ref.name}) > MAT of every KV-only depth; {paired}",
            {v.name: mat_of(v).text() for v in [*kv.values(), ref]},
            combine([judge.greater(ref, kv[d], mat_of) for d in depths]))
        verdicts, nums = [], {}
        for k in (0, 1):
            nums[f"alpha_{k} {ref.name}"] = alpha_at(k)(ref).text()
            for v in kv.values():
                verdicts.append(judge.greater(ref, v, alpha_at(k)))
                nums[f"alpha_{k} {v.name}"] = alpha_at(k)(v).text()
        add("P3 short-range disadvantage", "hidden-only wins at k = 0, 1",
            f"alpha_0 and alpha_1 of {ref.name} > every KV-only variant; {paired}", nums, combine(verdicts))
    if hyb:
        others = [v for v in r["paper"] if v is not hyb]
        add("hybrid best step-wise", f"MAT {P['mat']['hybrid']} vs EAGLE-3 {P['mat']['eagle3']}",
            f"MAT({hyb.name}) > MAT of every other variant; {paired}", {v.name: mat_of(v).text() for v in r["paper"]},
            combine([judge.greater(hyb, v, mat_of) for v in others]))
    if hyb and ref:
        ret = P["retention"]
        add("long-range retention gain", f"alpha_6/alpha_0: {ret['eagle3']:.1%} (EAGLE-3) -> {ret['hybrid']:.1%} (hybrid)",
            f"retention({hyb.name}) > retention({ref.name}); {paired}",
            {hyb.name: retention_of(hyb).text(), ref.name: retention_of(ref).text()},
            judge.greater(hyb, ref, retention_of))
    seed_roles = [roles(run) for run in per_seed]
    out.append(e2e_claim(ref, hyb))   # pools the seeds itself (prompt x seed bootstrap)
    out.append(_per_seed(_gate_claim, (hyb,), [(s["hybrid"],) for s in seed_roles]))
    # the gradient band is drawn from the seeds themselves (`diagnostic_rules.replicates`)
    out.append(_gradient_claim(r["kv"][max(r["kv"])] if r["kv"] else None) | ({"seeds": n_seeds} if n_seeds else {}))
    return out


def _per_seed(test: Callable[..., dict], pooled_args: tuple, seed_args: list[tuple]) -> dict:
    """A diagnostic judged on the pooled result and on every seed; seeds must agree."""
    result = test(*pooled_args)
    seeds = [test(*args)["verdict"] for args in seed_args]
    if seeds:
        verdict = agree(result["verdict"], seeds)
        if verdict != result["verdict"]:
            result["note"] = "; ".join(filter(None, [result.get("note"), f"per-seed verdicts differ: {seeds}"]))
        result["verdict"], result["seeds"] = verdict, len(seeds)
    return result


def _gate_claim(hyb: Variant | None) -> dict:
    """The paper's gate collapse on the trajectory of |g delta| / |h| (`diagnostic_rules.gate_collapse`):
    on the log given (pooled over the seeds for a variant of several), with each seed's beside."""
    name, paper = "gate collapse", "the hybrid gate falls toward 0 early and stays closed, starving the KV branch"
    test = (f"KV branch share |g delta| / |h| (mean over layers, each log point averaged over the held-out "
            f"diagnostic sequences and the seeds): closed below {GATE_CLOSED_FRACTION:g} x its first value within the "
            f"first {GATE_EARLY_FRACTION:.0%} of training and at every later log point; fewer than {GATE_MIN_POINTS} "
            f"log points: inconclusive")
    log = hyb.log if hyb else []
    gates, shares = gate_trajectory(log), share_trajectory(log)
    g_numbers = {"g first -> last": f"{gates[0][1]:.3f} -> {gates[-1][1]:.3f}"} if gates else {}
    if len(shares) < 2:
        if len(gates) < 2:
            return claim(name, paper, test, {}, MISSING)
        return claim(name, paper, test, g_numbers, INCONCLUSIVE,
                     f"only g is logged: g can stay open while g delta is negligible against h; the measured share "
                     f"(train_log `{GATE_SHARE}`) is needed")
    rule = gate_collapse(shares)
    numbers = {"share first -> last": f"{rule['initial']:.4f} -> {rule['final']:.4f}",
               "closed from step": "never" if rule["closed_at"] is None else str(rule["closed_at"]),
               "early: up to step": "n/a" if rule["early_until"] is None else f"{rule['early_until']:g}"} | g_numbers
    seed_logs = [lg for lg in hyb.seed_logs if share_trajectory(lg)] if len(hyb.seed_logs) > 1 else []
    if seed_logs:   # each seed's trajectory beside the pooled one
        rules = [gate_collapse(share_trajectory(lg)) for lg in seed_logs]
        numbers["per seed: share first -> last, closed from"] = "; ".join(
            f"{x['initial']:.4f} -> {x['final']:.4f}, {'never' if x['closed_at'] is None else x['closed_at']}"
            for x in rules)
    note = (f"the KV branch adds under {GATE_SHARE_NEGLIGIBLE:.0%} of |h| at the end: effectively unused"
            if rule["final"] < GATE_SHARE_NEGLIGIBLE else "")
    if rule["collapsed"] is None:
        return claim(name, paper, test, numbers, INCONCLUSIVE, "; ".join(filter(None, [
            note, f"{len(shares)} log points: too few to tell early from late, or none inside the early window"])))
    return claim(name, paper, test, numbers, REPRODUCED if rule["collapsed"] else NOT_REPRODUCED, note)


def _gradient_claim(deep: Variant | None) -> dict:
    """The paper's sparse KV-path gradient, counted where it acts: per scored KV-path query, the
    effective positions whose gradient reaches W_K/W_V against those reaching W_Q/W_O, measured in
    the real backward (`diagnostics.GradientPositions`); the band over the seeds decides."""
    name, paper = "sparse KV-path gradient", ("drafter-side W_K/W_V see only the drafted tokens while the prefix KV "
                                              "is copied: sparse, unbalanced gradient")
    test = (f"{deep.name if deep else 'deepest KV-only'}: positions sending gradient into W_K,W_V / into W_Q,W_O "
            f"(per scored query, median over training per seed): the 95% seed band below {KV_SPARSE_RATIO:g} "
            f"(reproduced), above it (not reproduced), holding it (inconclusive); one seed: the band over its log points")
    logs = deep.seed_logs if deep else []
    values = replicates(logs)
    if not values:
        norms = any("kv_wk_wv" in (r.get("grad_norm") or {}) for lg in logs for r in lg)
        return claim(name, paper, test, {}, MISSING, "only gradient norms are logged: a ratio of norms is not how many "
                     f"positions send gradient; the position counts (train_log `{KV_POSITION_RATIO}`) are needed"
                     if norms else "")
    b = band(values)
    per_seed = [statistics.median(x for _, x in log_values(lg)) for lg in logs if log_values(lg)]
    pooled = b[0] if b else per_seed[0]
    numbers = {"KV / query positions": f"{pooled:.3f}" + (f" [{b[1]:.3f}, {b[2]:.3f}]" if b else ""),
               "per seed": ", ".join(f"{x:.3f}" for x in per_seed)}
    for field, what in (("kv_grad_positions", "positions into W_K,W_V"), ("query_grad_positions", "into W_Q,W_O"),
                        ("kv_grad_on_own_keys", "key/value gradient on own keys"),
                        ("kv_own_key_mass", "own-key attention mass")):
        xs = [x for lg in logs for _, x in log_values(lg, field)]
        if xs:
            numbers[what] = f"{statistics.median(xs):.3f}"
    where = side(b, KV_SPARSE_RATIO)
    if where is None:
        return claim(name, paper, test, numbers, INCONCLUSIVE, "a single value: no spread to judge against")
    return claim(name, paper, test, numbers, REPRODUCED if where < 0 else NOT_REPRODUCED if where > 0 else INCONCLUSIVE)


def claims_markdown(claims: list[dict], time_capped: list[str] = ()) -> str:
    """claims.md; time_capped: what stopped at its max_minutes cap (`tables.time_capped`), warned about."""
    lines = ["# Claims verdict", "", "Computed by `kvshot report` from the result files; paper numbers are "
             "Qwen3-8B's (the paper's tables), this run's are the embedded or configured scale. A number that rests "
             "on fewer distinct anchors (`eval.min_rounds`) or sequences (`eval.min_sequences`) than the minimum, or "
             "has no interval because its resamples do not vary, reads \"insufficient data\" and its comparison is "
             "inconclusive, saying why. "
             "Comparisons are paired on the anchors every variant and seed is scored on: the difference, its 95% "
             "interval (sequences resampled, the training seeds' variance included), and beside an inconclusive one "
             "the smallest difference this run decides with 80% power (docs/statistics.md).", ""]
    if time_capped:
        lines += [f"**Warning:** stopped at the `max_minutes` time cap, not the step budget: {', '.join(time_capped)}. "
                  "These results depend on the machine's speed and load; raise the cap or free the machine and rerun.", ""]
    judged = next((c for c in claims if c.get("protocol")), None)
    if judged:
        rep = judged.get("reference_repetition")
        lines += [f"Step-wise claims are judged on the `{judged['protocol']}` protocol (reference tokens that repeat an "
                  f"earlier 4-gram: {'not measured' if rep is None else f'{rep:.1%}'}).", ""]
    lines += ["| claim | paper | test | this run | verdict |", "|---|---|---|---|---|"]
    cell = lambda text: str(text).replace("|", "\\|")   # noqa: E731  (|x| in a test is not a column)
    for c in claims:
        nums = "; ".join(f"{k}: {v}" for k, v in c["numbers"].items()) or "n/a"
        extra = [f"{c['seeds']} seeds"] if c.get("seeds") else []
        extra += [c["note"]] if c.get("note") else []
        extra += [comparison_text(x) for x in c.get("comparisons") or []]
        verdict = f"**{c['verdict']}**" + (f" ({'; '.join(extra)})" if extra else "")
        lines.append("| " + " | ".join(cell(x) for x in (c["claim"], c["paper"], c["test"], nums, verdict)) + " |")
    return "\n".join(lines) + "\n"
