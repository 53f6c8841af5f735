"""Read the result files every table, figure and verdict is computed from."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvshot.core.io import read_json
from kvshot.stats.metrics import DEFAULT_MIN_ROUNDS, DEFAULT_MIN_SEQUENCES
from kvshot.stats.resample import count_why, guard_bounds, insufficient, read_panel, statistic_range

# The paper's Qwen3-8B numbers (its tables; docs/paper-vs-kvshot.md), for side-by-side tables and figure marks.
PAPER = {
    "alpha_6": {"kv-d4": 0.495, "eagle3": 0.469},
    "mat": {"kv-d1": 1.84, "kv-d2": 2.23, "eagle3": 2.37, "hybrid": 2.54},
    "retention": {"eagle3": 0.735, "hybrid": 0.773},
    "tau": {"eagle3": 5.01, "hybrid": 5.04},
    "draft_overhead": (0.05, 0.10),
}


@dataclass
class Variant:
    name: str
    paradigm: str
    layers: int
    stepwise: dict
    train: dict                       # the drafter's metrics.json
    log: list = field(default_factory=list)   # train_log.json records, pooled over the seeds (`pool_logs`)
    e2e: dict | None = None
    protocols: dict = field(default_factory=dict)   # protocol name -> its stepwise view (`stepwise` is one of them)

    @property
    def seed_logs(self) -> list[list]:
        """Each seed's own train log (metrics.json `per_seed`), or the one log of a single run."""
        logs = [s.get("train_log") or [] for s in self.train.get("per_seed") or []]
        return logs if logs else [self.log]

    @property
    def label(self) -> str:
        kind = {"hidden": "hidden-only", "kv": "KV-only", "hybrid": "hybrid", "standalone": "standalone LM",
                "block": "block-wise"}.get(self.paradigm, self.paradigm)
        return f"{self.name} ({kind}, {self.layers} layer{'s' if self.layers > 1 else ''})"


# ---------------------------------------------------------------- a block variant's settings

def block_context(v: Variant) -> str:
    """What a block variant reads of the target: its drafter config's block_context, which
    `report.blockwise.read_contexts` puts beside its metrics."""
    return v.train.get("block_context", "kv")


def position_decay(v: Variant) -> float | None:
    """A block variant's own position_decay (variant.json): set only on the position-weight ablations."""
    return v.train.get("position_decay")


def refine_passes(v: Variant) -> int:
    """A block variant's refinement passes (variant.json): > 0 only on the refinement ablations."""
    return int(v.train.get("refine_passes") or 0)


def is_ablation(v: Variant) -> bool:
    """A block variant that differs from the plain block only by its position weights or refinement."""
    return position_decay(v) is not None or refine_passes(v) > 0


NUMERIC_STEPWISE = ("alpha", "alpha_observed", "acc", "alpha_ci", "alpha_jeffreys_ci", "cumulative", "cumulative_ci",
                    "mat", "mat_ci", "retention", "retention_observed", "retention_ci")


def _nan(obj):
    """JSON null (an undefined metric) back to NaN, so arithmetic and plots stay simple."""
    if obj is None:
        return float("nan")
    if isinstance(obj, list):
        return [_nan(x) for x in obj]
    return obj


def stepwise_view(sw: dict, path: str = "stepwise.json") -> dict:
    """A stepwise.json record with undefined numbers as NaN and the guards for thin evidence
    applied from its own counts and intervals (`apply_guards`: `min_rounds` and `min_sequences`,
    default DEFAULT_MIN_ROUNDS and DEFAULT_MIN_SEQUENCES)."""
    sw = dict(sw)
    for key in ("alpha", "alpha_ci", "rounds", "mat", "mat_ci", "retention", "retention_ci"):
        if key not in sw:
            raise ValueError(f"{path}: {key}: missing")
    for key in NUMERIC_STEPWISE:
        if key in sw:
            sw[key] = _nan(sw[key])
    # files written before the per-step counts and the minimum-rounds rule: what they lack reads undefined
    steps, unknown = len(sw["rounds"]), float("nan")
    sw.setdefault("min_rounds", DEFAULT_MIN_ROUNDS)
    sw.setdefault("min_sequences", DEFAULT_MIN_SEQUENCES)
    sw.setdefault("steps", steps)
    sw.setdefault("alpha_observed", sw["alpha"])
    sw.setdefault("retention_observed", sw["retention"])
    sw.setdefault("accepted", [None] * steps)
    sw.setdefault("alpha_undefined_resamples", [None] * steps)
    for key in ("alpha_jeffreys_ci", "cumulative_ci"):
        sw.setdefault(key, [[unknown, unknown]] * steps)
    sw.setdefault("cumulative", [unknown] * steps)
    return apply_guards(sw)


def apply_guards(sw: dict) -> dict:
    """The guards of `resample` on a viewed record, so that every table, figure and claim reads
    the same verdicts as stepwise.json (files written before the guards get them here): each
    interval clipped to its statistic's range, a zero-width or undefined one null; a number
    insufficient (`*_sufficient` false, `*_reason` why, `alpha`/`retention` NaN) when it rests
    on fewer than min_rounds distinct anchors or min_sequences distinct sequences, or has no
    interval. A reason the file records itself is kept (its text is the more precise)."""
    steps, n, seqs = sw["steps"], anchor_counts(sw), sequence_counts(sw)

    def guarded(name: str, value: float, ci: list, k: int) -> tuple[list, str | None]:
        lo, hi, why = guard_bounds(value, ci[0], ci[1], statistic_range(name, steps))
        recorded = sw.get(f"{name.rpartition('_')[0] if name[-1].isdigit() else name}_reason")
        if isinstance(recorded, list):
            recorded = recorded[int(name.rpartition("_")[2])]
        return [lo, hi], recorded or insufficient(count_why(n[k], seqs[k], sw["min_rounds"], sw["min_sequences"]), why)

    rates = [guarded(f"alpha_{k}", sw["alpha_observed"][k], sw["alpha_ci"][k], k) for k in range(steps)]
    cum = [guarded(f"cumulative_{k}", sw["cumulative"][k], sw["cumulative_ci"][k], 0) for k in range(steps)]
    mat_ci, mat_reason = guarded("mat", sw["mat"], sw["mat_ci"], 0)
    ret_ci, ret_reason = guarded("retention", sw["retention_observed"], sw["retention_ci"], steps - 1)
    sw["alpha_ci"], sw["alpha_reason"] = [c for c, _ in rates], [r for _, r in rates]
    sw["cumulative_ci"], sw["cumulative_reason"] = [c for c, _ in cum], [r for _, r in cum]
    sw["alpha_sufficient"] = [r is None for r in sw["alpha_reason"]]
    sw["alpha"] = [a if ok else float("nan") for a, ok in zip(sw["alpha_observed"], sw["alpha_sufficient"])]
    sw["mat_ci"], sw["mat_reason"], sw["mat_sufficient"] = mat_ci, mat_reason, mat_reason is None
    ret_reason = ret_reason or next((f"{r} (alpha_{k})" for k in (0, steps - 1) if (r := sw["alpha_reason"][k])), None)
    sw["retention_ci"], sw["retention_reason"], sw["retention_sufficient"] = ret_ci, ret_reason, ret_reason is None
    sw["retention"] = sw["retention_observed"] if ret_reason is None else float("nan")
    sw["distinct_sequences"] = seqs
    return sw


def anchor_counts(sw: dict) -> list[int]:
    """Per step, the distinct anchors the rates rest on (seed copies of an anchor count once);
    files written before they were recorded: the pooled rounds."""
    return sw.get("distinct_anchors") or sw["rounds"]


def sequence_counts(sw: dict) -> list[int | None]:
    """Per step, the distinct sequences reaching step k (`resample.AnchorPanel.distinct_sequences`);
    files written before they were recorded: from the anchor panel, else the sequences evaluated
    (an upper bound at every step), else unknown (None: the rule cannot apply)."""
    steps = len(sw["rounds"])
    if sw.get("distinct_sequences"):
        return sw["distinct_sequences"]
    if sw.get("anchors_panel"):
        return read_panel(sw["anchors_panel"], steps).distinct_sequences()
    return [sw.get("sequences")] * steps


def seed_folders(variant_dir: Path, sw: dict) -> list[Path]:
    """A variant's drafter folders, in the order stepwise.json evaluated them (its `per_seed`
    seeds); a folder holding the drafter itself (a single-seed layout) is its own."""
    if (variant_dir / "metrics.json").exists():
        return [variant_dir]
    seeds = [s.get("seed") for s in sw.get("per_seed") or []]
    if seeds and all(x is not None for x in seeds):
        return [variant_dir / f"seed{x}" for x in seeds]
    return sorted(variant_dir.glob("seed*/"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else -1)


def _mean_of(values: list):
    """The mean of the seeds' values of one train_log field: numbers averaged over the seeds that
    measured them (None where none did), lists element-wise, dicts key-wise."""
    given = [x for x in values if x is not None]
    if not given:
        return None
    if all(isinstance(x, dict) for x in given):
        return {k: _mean_of([x.get(k) for x in given]) for k in given[0]}
    if all(isinstance(x, list) for x in given):
        width = max(len(x) for x in given)
        return [_mean_of([x[i] if i < len(x) else None for x in given]) for i in range(width)]
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in given):
        return sum(given) / len(given)
    return given[0]


def pool_logs(logs: list[list[dict]]) -> list[dict]:
    """The seeds' train logs as one: at each step every seed logged, every diagnostic averaged
    over the seeds (`_mean_of`), with `seeds` the number of logs pooled. One log: itself."""
    if len(logs) == 1:
        return logs[0]
    by_step = [{r["step"]: r for r in log if "step" in r} for log in logs]
    common = sorted(set.intersection(*(set(s) for s in by_step))) if by_step else []
    return [{"step": step, "seeds": len(logs)} | {k: _mean_of([s[step].get(k) for s in by_step])
                                                  for k in by_step[0][step] if k != "step"} for step in common]


def train_records(variant_dir: Path, sw: dict) -> tuple[dict, list]:
    """The first seed's metrics.json with every seed's in `per_seed` (each with its `train_log`,
    for the per-seed diagnostics of the claims), and the train log pooled over the seeds
    (`pool_logs`): every diagnostic a table, figure or claim labels "(N seeds)" reads all N."""
    folders = seed_folders(variant_dir, sw)
    if folders == [variant_dir]:   # one folder: its metrics.json may carry the seeds' records itself
        return read_json(variant_dir / "metrics.json"), read_json(variant_dir / "train_log.json")
    if not folders:
        raise FileNotFoundError(f"{variant_dir}: no trained drafter (seed<N>/metrics.json)")
    per_seed = [read_json(f / "metrics.json") | {"train_log": read_json(f / "train_log.json")} for f in folders]
    first = {k: v for k, v in per_seed[0].items() if k != "train_log"}
    return first | {"per_seed": per_seed}, pool_logs([s["train_log"] for s in per_seed])


def load_variants(results: str | Path, names: list[str], with_e2e: bool = True,
                  with_train: bool = True) -> list[Variant]:
    results = Path(results)
    timing_path = results / "eval" / "e2e_timing.json"   # EAGLE-3 and the hybrid timed in one job (E2E claim)
    timing = read_json(timing_path) if with_e2e and timing_path.exists() else None
    out = []
    for name in names:
        path = results / "eval" / name / "stepwise.json"
        sw = stepwise_view(read_json(path), str(path))
        protocols = {sw.get("protocol") or "continuations": sw}
        for protocol, file in PROTOCOL_FILES.items():
            if protocol not in protocols and (results / "eval" / name / file).exists():
                other = results / "eval" / name / file
                protocols[protocol] = stepwise_view(read_json(other), str(other))
        e2e_path = results / "eval" / name / "e2e.json"
        train, log = train_records(results / "drafters" / name, sw) if with_train else ({}, [])
        e2e = read_json(e2e_path) if with_e2e and e2e_path.exists() else None
        if e2e is not None and timing and name in timing.get("variants", {}):
            e2e["timing"] = timing
        out.append(Variant(name=name, paradigm=sw["paradigm"], layers=sw["layers"], stepwise=sw,
                           train=train, log=log, e2e=e2e, protocols=protocols))
    return out


# ---------------------------------------------------------------- evaluation protocols

PROTOCOL_FILES = {"continuations": "stepwise.json", "natural": "stepwise_natural.json"}
PREFERENCE = ("continuations", "natural")   # the paper's protocol first, when its reference is not degenerate


def protocol_names(variants: list[Variant]) -> list[str]:
    """The protocols every variant was evaluated under, in PREFERENCE order."""
    common = set.intersection(*(set(v.protocols or {"continuations": v.stepwise}) for v in variants)) if variants else set()
    return [p for p in PREFERENCE if p in common] + sorted(common - set(PREFERENCE))


def repetition_of(variants: list[Variant], protocol: str) -> float:
    """The share of the protocol's reference tokens that repeat an earlier 4-gram (the same
    reference for every variant; the largest if they differ); NaN when not measured."""
    shares = [((v.protocols.get(protocol) or {}).get("repetition") or {}).get("share") for v in variants]
    shares = [float("nan") if x is None else x for x in shares]
    return max(shares) if shares and not any(math.isnan(x) for x in shares) else float("nan")


def judged_protocol(variants: list[Variant]) -> dict:
    """The protocol the claims are judged on: the first (PREFERENCE) whose reference repetition
    is at most `max_repetition` (stepwise.json, eval.max_repetition); none qualifying, the least
    repetitive, with a note. Returns {protocol, repetition, max_repetition, candidates, note}."""
    names = protocol_names(variants)
    limit = next((v.protocols[n]["max_repetition"] for v in variants for n in names if n in v.protocols), None)
    reps = {n: repetition_of(variants, n) for n in names}
    ok = [n for n in names if reps[n] <= limit]
    out = {"max_repetition": limit, "candidates": {n: (None if math.isnan(r) else r) for n, r in reps.items()}}
    if ok:
        return out | {"protocol": ok[0], "repetition": reps[ok[0]], "note": ""}
    measured = [n for n in names if not math.isnan(reps[n])]
    if measured:
        best = min(measured, key=reps.get)
        return out | {"protocol": best, "repetition": reps[best],
                      "note": f"no protocol's reference repeats at most {limit:.0%} (4-grams): judged on the least "
                              f"repetitive, {best} ({reps[best]:.1%})"}
    first = names[0] if names else "continuations"
    return out | {"protocol": first, "repetition": None, "note": "reference repetition not measured"}


def with_protocol(variants: list[Variant], protocol: str) -> list[Variant]:
    """The variants with `stepwise` taken from one protocol."""
    return [dataclasses.replace(v, stepwise=v.protocols.get(protocol, v.stepwise)) for v in variants]


PAPER_PARADIGMS = ("hidden", "kv", "hybrid")   # a standalone draft LM is a baseline row, in no claim


def roles(variants: list[Variant]) -> dict:
    """Which variant plays which part in the paper's comparisons (by paradigm and depth,
    not by name): the 1-layer hidden-only reference, KV-only by depth, the hybrid, and
    every variant of the paper's paradigms."""
    paper = [v for v in variants if v.paradigm in PAPER_PARADIGMS]
    hidden = [v for v in paper if v.paradigm == "hidden"]
    ref = min(hidden, key=lambda v: v.layers) if hidden else None
    kv = {v.layers: v for v in sorted(paper, key=lambda v: v.layers) if v.paradigm == "kv"}
    hybrid = next((v for v in paper if v.paradigm == "hybrid"), None)
    return {"eagle3": ref, "kv": kv, "hybrid": hybrid, "paper": paper}


def seed_runs(variants: list[Variant]) -> list[list[Variant]]:
    """One list of variants per training seed, from the optional `per_seed` lists of
    stepwise.json / e2e.json / metrics.json (each entry a record in that file's own schema,
    plus `train_log` in metrics.json's). Empty when any variant carries no per-seed results."""
    counts = {len(v.stepwise.get("per_seed") or []) for v in variants}
    if not variants or len(counts) != 1 or 0 in counts:
        return []

    def nth(record: dict | None, i: int) -> dict | None:
        seeds = (record or {}).get("per_seed") or []
        return seeds[i] if i < len(seeds) else None

    runs = []
    for i in range(counts.pop()):
        run = []
        for v in variants:
            train = nth(v.train, i) or {}
            e2e = nth(v.e2e, i)
            minimums = {k: v.stepwise[k] for k in ("min_rounds", "min_sequences")}
            sw = stepwise_view(minimums | v.stepwise["per_seed"][i])
            run.append(Variant(name=v.name, paradigm=v.paradigm, layers=v.layers, stepwise=sw, train=train,
                               log=train.get("train_log", []), e2e=e2e))
        runs.append(run)
    return runs
