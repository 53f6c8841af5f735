"""The diagnostic verdicts (gate collapse, sparse KV-path gradient, block-wise densification, gate
remedies) read every seed and test the paper's statements as docs/paper-vs-kvshot.md defines
them; the gradient positions they rest on are measured from a real backward."""
from __future__ import annotations

import math

import pytest
import torch

from kvshot.core.io import write_json
from kvshot.drafters.attention import reference_attention
from kvshot.drafters.skeleton import Diagonal
from kvshot.report.claims import INCONCLUSIVE, MISSING, NOT_REPRODUCED, REPRODUCED, evaluate_claims
from kvshot.report.diagnostic_rules import gate_collapse
from kvshot.report.results import load_variants
from kvshot.train.diagnostics import GradientPositions, attention_diagnostics, gradient_positions, own_keys_of_rows

from .test_claims import ALPHAS, NAMES, SPEC, e2e_record, stepwise_record, train_log
from .test_drafters import K, make
from ..conftest import typed


def write_seed_layout(root, seeds: list[dict]) -> list:
    """The real result tree: results/eval/<variant>/stepwise.json with `per_seed` (each with its
    seed), results/drafters/<variant>/seed<N>/{metrics.json, train_log.json}. seeds: per seed,
    the train_log keyword arguments (gate_final, grad_ratio, gate_share_final)."""
    for name in NAMES:
        paradigm, layers = SPEC[name]
        sw = stepwise_record(ALPHAS[name], paradigm, layers)
        sw["per_seed"] = [stepwise_record(ALPHAS[name], paradigm, layers, seed=i) | {"seed": i} for i in range(len(seeds))]
        write_json(root / "eval" / name / "stepwise.json", sw)
        write_json(root / "eval" / name / "e2e.json", e2e_record(3.0, 0.01, 400))
        for i, kw in enumerate(seeds):
            folder = root / "drafters" / name / f"seed{i}"
            kw = {"gate_final": 0.05, "grad_ratio": 0.05} | kw
            write_json(folder / "train_log.json", train_log(paradigm, kw["gate_final"], 0.05, kw["grad_ratio"],
                                                            kw.get("gate_share_final")))
            write_json(folder / "metrics.json", {"eval": {}, "seed": i})
    return load_variants(root, NAMES)


def by_claim(variants) -> dict:
    return {c["claim"]: c for c in evaluate_claims(variants)}


# ---------------------------------------------------------------- every seed, never seed 0 alone

def test_seed_zero_alone_decides_nothing_in_the_real_layout(tmp_path):
    """Seed 0's gate collapses and its KV path draws gradient from as many positions as the query
    path; seeds 1 and 2 stay open and sparse. The pooled log, numbers and verdicts are all three
    seeds', not seed 0's."""
    seeds = [{"gate_final": 0.05, "grad_ratio": 0.9}, {"gate_final": 0.5, "gate_share_final": 0.2},
             {"gate_final": 0.5, "gate_share_final": 0.2}]
    variants = write_seed_layout(tmp_path, seeds)
    hyb = next(v for v in variants if v.name == "hybrid")
    assert len(hyb.seed_logs) == 3 and hyb.log[-1]["seeds"] == 3
    last = [lg[-1]["gate_share"][0] for lg in hyb.seed_logs]
    assert last[0] == pytest.approx(0.2 * 0.01) and hyb.log[-1]["gate_share"][0] == pytest.approx(sum(last) / 3)
    got = by_claim(variants)
    gate = got["gate collapse"]
    assert gate["numbers"]["share first -> last"] == f"0.2000 -> {sum(last) / 3:.4f}"   # pooled, not seed 0's 0.0020
    assert gate["numbers"]["closed from step"] == "never"
    assert gate["verdict"] == INCONCLUSIVE and "per-seed verdicts differ" in gate["note"]   # seed 0 alone: reproduced
    assert gate["numbers"]["per seed: share first -> last, closed from"].startswith("0.2000 -> 0.0020, 10")
    grad = got["sparse KV-path gradient"]
    assert grad["numbers"]["per seed"] == "0.900, 0.050, 0.050" and grad["seeds"] == 3
    assert grad["numbers"]["KV / query positions"].startswith("0.333 [")   # mean over seeds, band beside
    assert grad["verdict"] == INCONCLUSIVE   # seed 0 alone: not reproduced; the seed band holds 1/2
    # every seed agreeing decides both ways
    assert by_claim(write_seed_layout(tmp_path / "all", [{}] * 3))["gate collapse"]["verdict"] == REPRODUCED
    open_ = write_seed_layout(tmp_path / "open", [{"gate_final": 0.5, "gate_share_final": 0.2, "grad_ratio": 0.9}] * 3)
    assert {c: by_claim(open_)[c]["verdict"] for c in ("gate collapse", "sparse KV-path gradient")} == \
        {"gate collapse": NOT_REPRODUCED, "sparse KV-path gradient": NOT_REPRODUCED}


def test_the_block_table_and_figures_read_the_pooled_log(tmp_path):
    from kvshot.report.blockwise import median_position_ratio

    variants = write_seed_layout(tmp_path, [{"grad_ratio": 0.9}, {"grad_ratio": 0.05}, {"grad_ratio": 0.1}])
    deep = next(v for v in variants if v.name == "kv-d4")
    assert median_position_ratio(deep) == pytest.approx((0.9 + 0.05 + 0.1) / 3)
    assert deep.log[0]["kv_grad_position_ratio"] == pytest.approx((0.9 + 0.05 + 0.1) / 3)


# ---------------------------------------------------------------- gate collapse: early, and stays closed

def trajectory(shares: list[float]) -> list[tuple[int, float]]:
    return [(5 * i, s) for i, s in enumerate(shares)]


def test_gate_collapse_rule_needs_early_and_closed_for_good():
    early = trajectory([0.2, 0.05, 0.01] + [0.005] * 17)       # below 0.02 from step 10, within the first quarter
    assert gate_collapse(early)["collapsed"] is True and gate_collapse(early)["closed_at"] == 10
    late = trajectory([0.2] * 12 + [0.005] * 8)                 # closes at step 60 of 95: late
    assert gate_collapse(late)["collapsed"] is False and gate_collapse(late)["closed_at"] == 60
    reopens = trajectory([0.2, 0.01, 0.01] + [0.01] * 10 + [0.1] * 7)   # closed early, open again at the end
    assert gate_collapse(reopens)["collapsed"] is False and gate_collapse(reopens)["closed_at"] is None
    halved = trajectory([0.2] + [0.08] * 19)                    # fell, but not toward 0
    assert gate_collapse(halved)["collapsed"] is False
    assert gate_collapse(trajectory([0.2, 0.001, 0.001]))["collapsed"] is None   # too few log points


def test_gate_claim_late_collapse_is_not_the_papers(tmp_path):
    from .test_claims import claims, write_results

    # the share falls geometrically to 0.001 by step 60 of 95: closed only from step ~40, after the first quarter
    root = write_results(tmp_path, gate_final=0.05)
    for name in ("hybrid",):
        write_json(root / "drafters" / name / "train_log.json", train_log("hybrid", 0.05, 0.05, 0.05, 0.001, closes_at=60))
    c = claims(root)["gate collapse"]
    assert c["verdict"] == NOT_REPRODUCED and int(c["numbers"]["closed from step"]) > 23.75


# ---------------------------------------------------------------- gate remedies: only where the hybrid collapsed

def test_a_remedy_is_not_credited_when_the_hybrid_never_collapsed(tmp_path):
    from kvshot.report.blockwise import evaluate_remedy_claims

    from .test_blockwise_report import write_remedies

    better = [0.90, 0.85, 0.80, 0.77, 0.75, 0.74, 0.73]
    root = write_remedies(tmp_path, {"hybrid-open": (better, 0.25)})
    write_json(root / "drafters/hybrid/train_log.json", train_log("hybrid", 0.5, 0.05, 0.05, 0.2))   # open throughout
    remedies = load_variants(root / "blockwise", ["hybrid-open"])
    (c,) = evaluate_remedy_claims(remedies, load_variants(root, ["hybrid"]))
    assert c["verdict"] == INCONCLUSIVE and "not applicable" in c["note"]
    assert c["numbers"]["gate collapse of hybrid"] == NOT_REPRODUCED
    write_json(root / "drafters/hybrid/train_log.json", train_log("hybrid", 0.3, 0.05, 0.05, 0.005))   # collapses
    (c,) = evaluate_remedy_claims(remedies, load_variants(root, ["hybrid"]))
    assert c["verdict"] == REPRODUCED


# ---------------------------------------------------------------- sparse gradient: a band from the seeds

def test_sparse_gradient_without_position_counts_is_not_measured(tmp_path):
    variants = write_seed_layout(tmp_path, [{}] * 2)
    for v in variants:
        for lg in v.seed_logs:
            for r in lg:
                r.pop("kv_grad_position_ratio", None)
    c = by_claim(variants)["sparse KV-path gradient"]
    assert c["verdict"] == MISSING and "ratio of norms" in c["note"]


@pytest.mark.parametrize("ratios,verdict", [((0.10, 0.12, 0.11), REPRODUCED), ((0.70, 0.80, 0.75), NOT_REPRODUCED),
                                            ((0.20, 0.80, 0.45), INCONCLUSIVE)])
def test_sparse_gradient_band(tmp_path, ratios, verdict):
    variants = write_seed_layout(tmp_path, [{"grad_ratio": r} for r in ratios])
    assert by_claim(variants)["sparse KV-path gradient"]["verdict"] == verdict


@pytest.mark.parametrize("block,chain,verdict", [((0.4, 0.45, 0.5), (0.05, 0.06, 0.04), REPRODUCED),
                                                 ((0.01, 0.02, 0.015), (0.05, 0.06, 0.04), NOT_REPRODUCED),
                                                 ((0.4, 0.01, 0.2), (0.05, 0.06, 0.04), INCONCLUSIVE)])
def test_block_densification_band(tmp_path, block, chain, verdict):
    """Block minus chain, paired by seed at equal depth: decided only when the seed band excludes 0."""
    from kvshot.report.blockwise import _gradient_verdict

    from .test_blockwise_report import BLOCK_SPEC, CHAIN_ALPHAS

    def write(root, name, ratios):
        paradigm = "kv"
        sw = stepwise_record(CHAIN_ALPHAS["kv-d2"], paradigm, 2)
        sw["per_seed"] = [sw | {"seed": i} for i in range(len(ratios))]
        write_json(root / "eval" / name / "stepwise.json", sw)
        for i, r in enumerate(ratios):
            write_json(root / "drafters" / name / f"seed{i}" / "train_log.json", train_log("kv", 0.5, 0.1, r))
            write_json(root / "drafters" / name / f"seed{i}" / "metrics.json", {"eval": {}})

    assert "block-kv-d2" in BLOCK_SPEC
    write(tmp_path, "block-kv-d2", block)
    write(tmp_path, "kv-d2", chain)
    b, c = load_variants(tmp_path, ["block-kv-d2", "kv-d2"])
    got, numbers = _gradient_verdict([(b, c)])
    assert got == verdict and "block-kv-d2 - kv-d2" in numbers


# ---------------------------------------------------------------- the measurement

def test_gradient_positions_follow_the_real_backward():
    """One query row: the key/value gradient autograd gives each attended position is the
    weight `gradient_positions` counts, so its own-key share and effective count agree."""
    torch.manual_seed(0)
    h, tp, s, d = 2, 9, 3, 8
    q = torch.randn(1, h, 1, d)
    pk, pv = torch.randn(1, h, tp, d, requires_grad=True), torch.randn(1, h, tp, d, requires_grad=True)
    dk, dv = torch.randn(1, h, s, 1, d, requires_grad=True), torch.randn(1, h, s, 1, d, requires_grad=True)
    visible = torch.ones(1, 1, tp, dtype=torch.bool)
    out = reference_attention(q, pk, pv, visible, dk, dv, 0, 1 / math.sqrt(d))
    d_out = torch.randn_like(out)
    (out * d_out).sum().backward()
    per_pos = (torch.cat([pk.grad, dk.grad[:, :, :, 0]], 2).norm(dim=-1) +
               torch.cat([pv.grad, dv.grad[:, :, :, 0]], 2).norm(dim=-1)).sum(1)[0]   # [Tp + S], over heads
    own_k, own_v, seen = own_keys_of_rows(Diagonal(dk.detach(), dv.detach()), torch.tensor([0]))
    got = gradient_positions(q, pk.detach(), pv.detach(), visible, own_k, own_v, seen, d_out, torch.ones(1, 1),
                             1 / math.sqrt(d))
    own = per_pos[tp:]
    assert float(got["on_own"]) == pytest.approx(float(own.sum() / per_pos.sum()), rel=1e-4)
    assert float(got["kv"]) == pytest.approx(float(own.sum() ** 2 / own.square().sum()), rel=1e-4)
    assert 1 <= float(got["kv"]) <= s and 1 <= float(got["query"]) <= tp + s


def test_probe_counts_where_the_real_backward_sends_gradient(drafter_world):
    """A KV drafter's real backward: at initialization its queries spread over the copied prefix,
    so its W_K/W_V draw gradient from few of the positions its W_Q/W_O do; own keys that take
    the attention (W_K = W_Q, k_norm scaled up) raise the ratio and the own-key gradient share.
    The probe leaves no patched method behind and measures nothing when disabled."""
    from kvshot.drafters.unroll import unroll

    batch = drafter_world[0].batch([0, 1])

    def measure(model, enabled=True):
        with GradientPositions(model, enabled=enabled) as probe:
            un = unroll(model, batch, K, skip_unlabelled=True)
            torch.stack([lg.float().logsumexp(-1).sum() for lg in un.logits]).sum().backward()
        assert all("attend" not in vars(a) for _, a in model.kv_attentions())
        return probe.summary()

    base = measure(make(drafter_world, "kv"))
    assert 0 < base["kv_grad_position_ratio"] < 0.5 and base["grad_position_rows"] > 0
    assert base["kv_grad_positions"] < base["query_grad_positions"]
    assert measure(make(drafter_world, "kv"), enabled=False) == {}
    model = make(drafter_world, "kv")
    with torch.no_grad():
        for _, attn in model.kv_attentions():
            group = attn.n_heads // attn.n_kv
            attn.k_proj.weight.copy_(attn.q_proj.weight.view(attn.n_heads, attn.head_dim, -1)[::group]
                                     .reshape_as(attn.k_proj.weight))
            attn.k_norm.weight.copy_(attn.q_norm.weight * 30)
    own = measure(model)
    assert own["kv_grad_on_own_keys"] > 0.6 > base["kv_grad_on_own_keys"]
    assert own["kv_grad_position_ratio"] > 0.6 and own["kv_grad_position_ratio"] > 3 * base["kv_grad_position_ratio"]


def test_diagnostics_pool_several_batches_row_weighted(drafter_world):
    src = drafter_world[0]
    model = make(drafter_world, "hybrid")
    one, two = src.batch([0, 1]), src.batch([2, 3])
    a, b = attention_diagnostics(model, one, K), attention_diagnostics(model, two, K)
    both = attention_diagnostics(model, [one, two], K)
    lo, hi = sorted((a["gate_share"][0], b["gate_share"][0]))
    assert lo <= both["gate_share"][0] <= hi and a["gate_share"] != b["gate_share"]


def test_figures_draw_the_pooled_and_per_seed_diagnostics(tmp_path):
    from kvshot.report.figures import gate, gradients

    variants = write_seed_layout(tmp_path, [{"grad_ratio": 0.9}, {"gate_final": 0.5, "gate_share_final": 0.2}, {}])
    for fig in (gate, gradients):
        fig(variants, tmp_path / f"{fig.__name__}.pdf")
        assert (tmp_path / f"{fig.__name__}.pdf").read_bytes()[:4] == b"%PDF"


def test_a_block_and_a_chain_drafter_log_gradient_positions_in_training(tiny, tiny_features, tmp_path):
    """The block-wise densification verdict reads the same field from both trainers."""
    import json

    from kvshot.train.loop import train_variant

    from .test_blockwise import block_cfg
    from .test_train import run, small_cfg

    cfg = block_cfg(tiny, max_steps=2, eval_every=0)
    train_variant(typed(cfg), tiny["rt"], "bk2", str(tiny_features["train"]), str(tiny_features["eval"]), str(tiny["model"]),
                  str(tmp_path / "bk2"))
    run(tiny, tiny_features, small_cfg(tiny, max_steps=2, log_every=1), tmp_path / "kv2", "kv2")
    for name in ("bk2", "kv2"):
        log = json.loads((tmp_path / name / "train_log.json").read_text())
        assert len(log) == 2 and all(0 < r["kv_grad_position_ratio"] <= 1 for r in log), name


def test_diagnostic_batches_hold_scored_rows_within_max_len(tiny_features):
    from kvshot.capture.features import open_features
    from kvshot.drafters.unroll import assistant_tokens, shift
    from kvshot.train.diagnostics import diagnostic_batches

    src = open_features(tiny_features["eval"])
    got = diagnostic_batches(src, 3, 24, "cpu")
    assert [len(b["input_ids"]) for b in got] == [2, 1] and all(b["input_ids"].shape[1] <= 24 for b in got)
    assert all(bool(shift(assistant_tokens(b), 2, False).any(1).all()) for b in got)   # every sequence scored
