"""Read the result files every table, figure and verdict is computed from."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..io import read_json

# The paper's Qwen3-8B numbers (shared/PAPER.md), for side-by-side tables and figure marks.
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
    log: list = field(default_factory=list)   # train_log.json records
    e2e: dict | None = None

    @property
    def label(self) -> str:
        kind = {"hidden": "hidden-only", "kv": "KV-only", "hybrid": "hybrid", "standalone": "standalone LM"}[self.paradigm]
        return f"{self.name} ({kind}, {self.layers} layer{'s' if self.layers > 1 else ''})"


def _nan(obj):
    """JSON null (an undefined metric) back to NaN, so arithmetic and plots stay simple."""
    if obj is None:
        return float("nan")
    if isinstance(obj, list):
        return [_nan(x) for x in obj]
    return obj


def load_variants(results: str | Path, names: list[str], with_e2e: bool = True,
                  with_train: bool = True) -> list[Variant]:
    results = Path(results)
    out = []
    for name in names:
        sw = read_json(results / "eval" / name / "stepwise.json")
        for key in ("alpha", "acc", "alpha_ci", "mat", "mat_ci", "retention", "retention_ci"):
            sw[key] = _nan(sw[key])
        folder = results / "drafters" / name
        e2e_path = results / "eval" / name / "e2e.json"
        out.append(Variant(name=name, paradigm=sw["paradigm"], layers=sw["layers"], stepwise=sw,
                           train=read_json(folder / "metrics.json") if with_train else {},
                           log=read_json(folder / "train_log.json") if with_train else [],
                           e2e=read_json(e2e_path) if with_e2e and e2e_path.exists() else None))
    return out


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
