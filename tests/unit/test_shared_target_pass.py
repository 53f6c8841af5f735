"""eval.shared_target_pass: several variants scored in one eval-stepwise job, one target forward
per batch for all their drafters, give each variant the record it gets alone."""
from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
from ..conftest import typed

VARIANTS = {"eagle3": [0, 1], "kv-d1": [0], "hybrid": [0]}   # the hidden, KV and hybrid readers; two seeds


@pytest.fixture(scope="module")
def trained(tiny, tiny_features, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from kvshot.core.integrity import write_manifest
    from kvshot.evaluate.references import run_continuations_stage
    from kvshot.train.loop import train_variant

    root = tmp_path_factory.mktemp("shared_pass")
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["drafters"]["train"] |= {"max_steps": 3, "eval_every": 0}
    dirs = {}
    for name, seeds in VARIANTS.items():
        for seed in seeds:
            out = root / "drafters" / name / f"seed{seed}"
            cfg["seed"] = seed
            train_variant(typed(cfg), tiny["rt"], name, str(tiny_features["train"]), str(tiny_features["eval"]),
                          str(tiny["model"]), str(out))
            dirs.setdefault(name, []).append(str(out))
    cfg["seed"] = tiny["cfg"]["seed"]
    cont, natural = root / "continuations.json", root / "natural.json"
    run_continuations_stage(typed(cfg), tiny["rt"], str(tiny["eval"]), str(tiny["model"]), str(cont), str(natural))
    # A few steps on the tiny target accept nothing, so no record would tell the variants apart. Its
    # greedy text is nearly one token: map all (kv-d1) or every other (hybrid) draft id onto it.
    common = Counter(t for it in json.loads(cont.read_text())["items"] for t in it["continuation"]).most_common(1)[0][0]
    for name, every in (("kv-d1", 1), ("hybrid", 2)):
        path = root / "drafters" / name / "seed0" / "model.safetensors"
        state = load_file(path)
        state["d2t"][::every] = common
        save_file(state, path)
        write_manifest(path.parent)
    return {"cfg": cfg, "root": root, "dirs": dirs, "cont": str(cont), "natural": str(natural),
            "index": str(tiny_features["eval"] / "index.json")}


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("seconds", "shared_target_pass")}


def test_one_pass_equals_each_variant_alone(tiny, trained):
    from kvshot.evaluate.stepwise import run_stepwise_stage

    t, root = trained, trained["root"]
    outs = {name: (root / "alone" / name / "stepwise.json", root / "alone" / name / "stepwise_natural.json")
            for name in VARIANTS}
    for name, (out, nat) in outs.items():
        run_stepwise_stage(typed(t["cfg"]), tiny["rt"], t["dirs"][name], str(tiny["model"]), t["cont"], t["index"], str(out),
                           t["natural"], str(nat))
    shared = {name: (root / "shared" / name / "stepwise.json", root / "shared" / name / "stepwise_natural.json")
              for name in VARIANTS}
    summary = run_stepwise_stage(typed(t["cfg"]), tiny["rt"], [d for name in VARIANTS for d in t["dirs"][name]],
                                 str(tiny["model"]), t["cont"], t["index"], [str(o) for o, _ in shared.values()],
                                 t["natural"], [str(n) for _, n in shared.values()])
    assert set(summary) == set(VARIANTS)
    # the drafters disagree, so a record given to the wrong variant would show
    chains = {name: json.loads(shared[name][0].read_text())["anchors_panel"] for name in VARIANTS}
    assert len({json.dumps(c["accepted_len"]) for c in chains.values()}) == len(VARIANTS)
    for name in VARIANTS:
        for alone_path, shared_path in zip(outs[name], shared[name]):
            alone, together = json.loads(alone_path.read_text()), json.loads(shared_path.read_text())
            assert together["shared_target_pass"] == list(VARIANTS)
            assert together["variant"] == name and len(together["per_seed"]) == len(VARIANTS[name])
            assert together["rounds"][0] > 0
            assert without_timing(together) == without_timing(alone), (name, shared_path.name)


def test_outputs_must_match_the_variants(tiny, trained, tmp_path):
    from kvshot.core.io import DataError
    from kvshot.evaluate.stepwise import run_stepwise_stage

    t = trained
    with pytest.raises(DataError, match="2 outputs .* 3 variants"):
        run_stepwise_stage(typed(t["cfg"]), tiny["rt"], [d for name in VARIANTS for d in t["dirs"][name]],
                           str(tiny["model"]), t["cont"], t["index"], [str(tmp_path / "a"), str(tmp_path / "b")])


def test_the_cli_takes_one_output_per_variant(tiny, trained, tmp_path):
    """`python -m kvshot eval-stepwise --out A B --natural-out C D`: the rule's command line."""
    import subprocess
    import sys

    import yaml

    t = trained
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(t["cfg"]))
    names = ["eagle3", "kv-d1"]
    outs = [str(tmp_path / n / "stepwise.json") for n in names]
    nats = [str(tmp_path / n / "stepwise_natural.json") for n in names]
    cmd = [sys.executable, "-m", "kvshot", "eval-stepwise", "--config", str(cfg), "--threads", "1",
           "--drafter", *[d for n in names for d in t["dirs"][n]], "--target", str(tiny["model"]),
           "--continuations", t["cont"], "--features-index", t["index"], "--out", *outs,
           "--natural", t["natural"], "--natural-out", *nats]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, out, nat in zip(names, outs, nats):
        for path in (out, nat):
            record = json.loads(open(path).read())
            assert record["variant"] == name and record["shared_target_pass"] == names


