"""Block-wise drafting beyond the model: the stages run a saved block drafter (train-drafter,
eval-stepwise, eval-e2e), the hybrid-warm gate remedy's trainer setting, the block-wise
report's verdicts (and the gate remedies') follow the numbers, and `figures/blockwise.pdf`
is its own Snakemake target (dry run)."""
from __future__ import annotations

import pytest
import torch

from .test_blockwise import block_cfg
from ..conftest import typed


def test_stages_run_a_saved_block_drafter(tiny, tiny_features, tmp_path):
    """train-drafter's folder loads back (config block_size/context), and the eval-stepwise and
    eval-e2e stages run it: K steps per protocol, chain decoding only, lossless."""
    import json

    from kvshot.drafters import load_drafter
    from kvshot.evaluate.e2e import run_e2e_stage
    from kvshot.evaluate.references import run_continuations_stage
    from kvshot.evaluate.stepwise import run_stepwise_stage
    from kvshot.train.loop import train_variant

    cfg = block_cfg(tiny, max_steps=4, eval_every=0)
    K = cfg["drafters"]["ttt_steps"]
    out = tmp_path / "drafters/bh1/seed0"
    train_variant(typed(cfg), tiny["rt"], "bh1", str(tiny_features["train"]), str(tiny_features["eval"]), str(tiny["model"]),
                  str(out))
    model = load_drafter(out, need_embedding=False)
    assert model.paradigm == "block" and model.reads_aux_hidden and model.positions == K
    cont, natural = tmp_path / "continuations.json", tmp_path / "natural.json"
    run_continuations_stage(typed(cfg), tiny["rt"], str(tiny["eval"]), str(tiny["model"]), str(cont), str(natural))
    index = str(tiny_features["eval"] / "index.json")
    sw_out, nat_out, e2e_out = tmp_path / "stepwise.json", tmp_path / "stepwise_natural.json", tmp_path / "e2e.json"
    run_stepwise_stage(typed(cfg), tiny["rt"], [str(out)], str(tiny["model"]), str(cont), index, str(sw_out), str(natural),
                       str(nat_out))
    for path in (sw_out, nat_out):
        sw = json.loads(path.read_text())
        assert sw["paradigm"] == "block" and len(sw["alpha"]) == K and sw["rounds"][0] > 0
    run_e2e_stage(typed(cfg), tiny["rt"], [str(out)], str(tiny["model"]), str(cont), index, str(e2e_out))
    e2e = json.loads(e2e_out.read_text())
    assert list(e2e["modes"]) == ["chain"] and e2e["lossless"] and e2e["modes"]["chain"]["rounds"] > 0


# ---------------------------------------------------------------- the report and its own Snakemake target

CHAIN_ALPHAS = {"kv-d1": [0.50, 0.45, 0.42, 0.40, 0.38, 0.36, 0.35], "kv-d2": [0.60, 0.55, 0.52, 0.50, 0.49, 0.48, 0.47],
                "kv-d4": [0.62, 0.58, 0.56, 0.54, 0.53, 0.52, 0.51]}
BLOCK_SPEC = {"block-kv-d1": ("kv", 1), "block-kv-d2": ("kv", 2), "block-kv-d4": ("kv", 4), "block-hidden": ("hidden", 1)}


def write_block_results(root, block_alphas: dict, block_grad: float = 0.4, chain_grad: float = 0.05):
    """The default run's KV-only chains under root/ and the block variants under root/blockwise/,
    in the real file schemas (tests/unit/test_claims.py's writers)."""
    from kvshot.core.io import write_json

    from .test_claims import e2e_record, stepwise_record, train_log

    for name, alphas in CHAIN_ALPHAS.items():
        write_json(root / "eval" / name / "stepwise.json", stepwise_record(alphas, "kv", int(name[-1])))
        write_json(root / "eval" / name / "e2e.json", e2e_record(2.0, 0.01, 400))
        write_json(root / "drafters" / name / "train_log.json", train_log("kv", 0.5, 0.05, chain_grad))
        write_json(root / "drafters" / name / "metrics.json", {"eval": {}})
    for name, (ctx, layers) in BLOCK_SPEC.items():
        base = root / "blockwise"
        write_json(base / "eval" / name / "stepwise.json", stepwise_record(block_alphas[name], "block", layers))
        write_json(base / "eval" / name / "e2e.json", {"modes": {"chain": e2e_record(2.5, 0.008, 400)["modes"]["chain"]}})
        write_json(base / "drafters" / name / "train_log.json", train_log("kv", 0.5, 0.1, block_grad))
        write_json(base / "drafters" / name / "metrics.json", {"eval": {}})
        write_json(base / "drafters" / name / "config.json", {"paradigm": "block", "block_context": ctx})
    return root


def block_report(root):
    from kvshot.report.blockwise import run_blockwise_report

    return run_blockwise_report(str(root), list(BLOCK_SPEC), list(CHAIN_ALPHAS), str(root / "figures/blockwise.pdf"),
                                str(root / "blockwise/blockwise.csv"), str(root / "blockwise/claims.md"),
                                str(root / "blockwise/claims.json"), decay_figure=str(root / "figures/decay.pdf"),
                                depth_figure=str(root / "figures/depth.pdf"))


def test_block_verdicts_follow_the_numbers(tmp_path):
    """Blocks above their chains at every depth and KV context above hidden: all three verdicts
    reproduced, with the figure and table written; blocks below: not reproduced."""
    from kvshot.report.claims import NOT_REPRODUCED, REPRODUCED

    up = {f"block-kv-d{d}": [min(a + 0.15, 0.99) for a in CHAIN_ALPHAS[f"kv-d{d}"]] for d in (1, 2, 4)}
    up["block-hidden"] = [0.70, 0.60, 0.50, 0.40, 0.35, 0.30, 0.25]
    verdicts = block_report(write_block_results(tmp_path / "up", up))
    assert set(verdicts.values()) == {REPRODUCED}, verdicts
    for fig in ("blockwise", "decay", "depth"):   # decay and depth: the default run's, block variants added
        assert (tmp_path / f"up/figures/{fig}.pdf").read_bytes()[:4] == b"%PDF"
    table = (tmp_path / "up/blockwise/blockwise.csv").read_text().splitlines()
    assert len(table) == 1 + 7 and "alpha_6" in table[0] and "tau_chain" in table[0]
    assert "block-wise training rescues" in (tmp_path / "up/blockwise/claims.md").read_text()

    down = {f"block-kv-d{d}": [a - 0.2 for a in CHAIN_ALPHAS[f"kv-d{d}"]] for d in (1, 2, 4)}
    down["block-hidden"] = [0.9] * 7
    verdicts = block_report(write_block_results(tmp_path / "down", down, block_grad=0.01))
    assert set(verdicts.values()) == {NOT_REPRODUCED}, verdicts


@pytest.mark.parametrize("entry,claim", [({"position_decay": 0.8}, "block position weights 0.8^k"),
                                         ({"refine_passes": 1}, "block refinement pays (1 refinement pass)")])
def test_ablation_is_judged_against_its_plain_twin(tmp_path, entry, claim):
    """A block variant with its own position_decay or refinement passes (variant.json) is an
    ablation: judged against the plain variant of the same context and depth in either direction,
    a row of kind `ablation` in the table, and kept out of the block-vs-chain verdicts
    (block-kv-d2 stays the d2 block)."""
    import csv

    from kvshot.core.io import write_json
    from kvshot.report.blockwise import run_blockwise_report
    from kvshot.report.claims import NOT_REPRODUCED, REPRODUCED

    from .test_claims import e2e_record, stepwise_record, train_log

    up = {f"block-kv-d{d}": [min(a + 0.15, 0.99) for a in CHAIN_ALPHAS[f"kv-d{d}"]] for d in (1, 2, 4)}
    up["block-hidden"] = [0.70, 0.60, 0.50, 0.40, 0.35, 0.30, 0.25]
    for shift, expect in ((0.1, REPRODUCED), (-0.3, NOT_REPRODUCED)):
        root = write_block_results(tmp_path / f"abl{shift}", up)
        base = root / "blockwise"
        alphas = [min(max(a + shift, 0.01), 0.99) for a in up["block-kv-d2"]]
        write_json(base / "eval/block-kv-d2-decay/stepwise.json", stepwise_record(alphas, "block", 2))
        write_json(base / "eval/block-kv-d2-decay/e2e.json", {"modes": {"chain": e2e_record(2.5, 0.008, 400)["modes"]["chain"]}})
        write_json(base / "drafters/block-kv-d2-decay/train_log.json", train_log("kv", 0.5, 0.1, 0.4))
        write_json(base / "drafters/block-kv-d2-decay/metrics.json", {"eval": {}})
        write_json(base / "drafters/block-kv-d2-decay/config.json", {"paradigm": "block", "block_context": "kv"})
        write_json(base / "drafters/block-kv-d2-decay/variant.json", {"name": "block-kv-d2-decay", **entry})
        verdicts = run_blockwise_report(str(root), [*BLOCK_SPEC, "block-kv-d2-decay"], list(CHAIN_ALPHAS),
                                        str(root / "figures/blockwise.pdf"), str(base / "blockwise.csv"),
                                        str(base / "claims.md"), str(base / "claims.json"))
        ablation = [v for c, v in verdicts.items() if c.startswith(claim)]
        assert ablation == [expect], verdicts
        assert verdicts["block-wise training rescues long-range KV drafting"] == REPRODUCED   # the uniform d2 block
        rows = {r["variant"]: r for r in csv.DictReader(open(base / "blockwise.csv"))}
        assert rows["block-kv-d2-decay"]["kind"] == "ablation"
        assert float(rows["block-kv-d2-decay"]["position_decay"]) == entry.get("position_decay", 1.0)
        assert int(rows["block-kv-d2-decay"]["refine_passes"]) == entry.get("refine_passes", 0)
        assert rows["block-kv-d2"]["kind"] == "block" and float(rows["block-kv-d2"]["position_decay"]) == 1.0


def write_remedies(root, remedies: dict, hybrid_mat_alphas=(0.85, 0.78, 0.72, 0.68, 0.66, 0.65, 0.64)):
    """The default hybrid (its gate share collapsing early, 0.2 -> 0.005) under root/ and the remedies
    {name: (alphas, final gate share)} under root/blockwise/."""
    from kvshot.core.io import write_json

    from .test_claims import e2e_record, stepwise_record, train_log

    write_json(root / "eval/hybrid/stepwise.json", stepwise_record(list(hybrid_mat_alphas), "hybrid", 1))
    write_json(root / "eval/hybrid/e2e.json", e2e_record(3.0, 0.01, 400))
    write_json(root / "drafters/hybrid/train_log.json", train_log("hybrid", 0.3, 0.05, 0.05, 0.005))
    write_json(root / "drafters/hybrid/metrics.json", {"eval": {}})
    for name, (alphas, share) in remedies.items():
        base = root / "blockwise"
        write_json(base / "eval" / name / "stepwise.json", stepwise_record(alphas, "hybrid", 1))
        write_json(base / "eval" / name / "e2e.json", e2e_record(3.0, 0.01, 400))
        write_json(base / "drafters" / name / "train_log.json", train_log("hybrid", 0.5, 0.05, 0.05, share))
        write_json(base / "drafters" / name / "metrics.json", {"eval": {}})
    return root


def test_gate_remedy_verdicts_follow_the_share_and_the_acceptance(tmp_path):
    """A remedy whose KV-branch share holds and whose MAT beats the hybrid's: reproduced; one
    whose share collapses: not reproduced; both tabulated in remedies.csv."""
    from kvshot.report.blockwise import run_blockwise_report
    from kvshot.report.claims import NOT_REPRODUCED, REPRODUCED

    up = {f"block-kv-d{d}": [min(a + 0.15, 0.99) for a in CHAIN_ALPHAS[f"kv-d{d}"]] for d in (1, 2, 4)}
    up["block-hidden"] = [0.70, 0.60, 0.50, 0.40, 0.35, 0.30, 0.25]
    better = [0.90, 0.85, 0.80, 0.77, 0.75, 0.74, 0.73]
    root = write_remedies(write_block_results(tmp_path, up),
                          {"hybrid-open": (better, 0.25), "hybrid-warm": (better, 0.01)})
    verdicts = run_blockwise_report(str(root), list(BLOCK_SPEC), list(CHAIN_ALPHAS), str(root / "figures/blockwise.pdf"),
                                    str(root / "blockwise/blockwise.csv"), str(root / "blockwise/claims.md"),
                                    str(root / "blockwise/claims.json"), ["hybrid-open", "hybrid-warm"], ["hybrid"])
    assert verdicts["gate remedy hybrid-open"] == REPRODUCED
    assert verdicts["gate remedy hybrid-warm"] == NOT_REPRODUCED   # the branch still closes
    rows = (root / "blockwise/remedies.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 and rows[0].startswith("variant,kind") and "gate_share_final" in rows[0]


def test_kv_warmup_trains_the_hybrids_kv_branch_alone_first(tiny, tiny_features, tmp_path):
    """The hybrid-warm gate remedy: for kv_warmup_steps steps only the KV branch (its attentions,
    norms and gate) moves; afterwards every parameter does. Other paradigms refuse the setting."""
    from safetensors.torch import load_file

    from kvshot.config import ConfigError
    from kvshot.train.loop import train_variant
    from kvshot.train.variants import KV_BRANCH

    cfg = block_cfg(tiny, eval_every=0)
    cfg["blockwise"]["remedies"] = [{"name": "warm", "paradigm": "hybrid", "layers": 1, "kv_warmup_steps": 2}]

    def weights(steps: int) -> dict:
        cfg["drafters"]["train"]["max_steps"] = steps
        out = tmp_path / f"warm{steps}"
        train_variant(typed(cfg), tiny["rt"], "warm", str(tiny_features["train"]), str(tiny_features["eval"]),
                      str(tiny["model"]), str(out))
        return load_file(str(out / "model.safetensors"))

    start, warm, joint = weights(0), weights(2), weights(4)
    trained = [n for n in start if not n.startswith(("embed_tokens", "d2t", "t2d"))]
    branch = [n for n in trained if n.startswith(KV_BRANCH)]
    assert branch and len(branch) < len(trained)
    for n in trained:
        moved = not torch.equal(start[n], warm[n])
        assert moved == (n in branch), f"{n}: moved {moved} during the warm-up"
        assert not torch.equal(start[n], joint[n]), f"{n} never trained"
    cfg["blockwise"]["remedies"] = [{"name": "warm", "paradigm": "kv", "layers": 1, "kv_warmup_steps": 2}]
    with pytest.raises(ConfigError, match="kv_warmup_steps"):
        weights(1)


def test_readme_carries_the_blockwise_block(tmp_path):
    """`kvshot readme` also regenerates the block-wise verdicts between their markers when
    results/blockwise/claims.json exists, from the target's own files."""
    from kvshot.report import update_readme

    up = {f"block-kv-d{d}": [min(a + 0.15, 0.99) for a in CHAIN_ALPHAS[f"kv-d{d}"]] for d in (1, 2, 4)}
    up["block-hidden"] = [0.70, 0.60, 0.50, 0.40, 0.35, 0.30, 0.25]
    root = write_block_results(tmp_path, up)
    from kvshot.core.io import write_json

    from .test_claims import stepwise_record
    few = stepwise_record(up["block-hidden"], "block", 1, rounds=40)   # 40 rounds: too few reach step 6
    write_json(root / "blockwise/eval/block-hidden/stepwise.json", few)
    block_report(root)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:start -->\nold\n<!-- results:end -->\nmid\n"
                      "<!-- blockwise:start -->\nstale\n<!-- blockwise:end -->\nafter\n")
    update_readme(str(root), list(CHAIN_ALPHAS), str(readme), str(tmp_path / "docs/decay.png"))
    text = readme.read_text()
    block = text.split("<!-- blockwise:start -->")[1].split("<!-- blockwise:end -->")[0]
    assert "stale" not in block and text.endswith("after\n") and "\nmid\n" in text
    # the table stays in results/blockwise/blockwise.csv; the README keeps one line per verdict
    assert not any(line.startswith("| block-kv-d2 |") for line in block.splitlines())
    assert "results/blockwise/claims.md" in block
    assert "- block-wise training rescues long-range KV drafting: **reproduced**\n" in block
    assert "- block-wise training densifies the KV-path gradient: **reproduced**\n" in block
