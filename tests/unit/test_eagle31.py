"""EAGLE-3.1's two switches on the hidden (EAGLE-3) drafter (issue 31), against the independent
reference of test_eagle3_reference (extended with them as speculators' Eagle3DraftModel computes
them): `fc_norm` norms each aux hidden state separately before fc, `norm_output` feeds the
post-final-norm state to the next TTT step and to the head. Both change the computation; the
per-state norms are not one norm over the concatenation (`norm_before_fc`), and a config with
both is refused in one line."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from kvshot.drafters import DrafterConfig, build_drafter
from kvshot.drafters.unroll import TTTUnroll, context, unroll
from kvshot.train.objective import step_losses, target_labels, weighted_loss

from .test_eagle3_reference import STEPS, DECAY, drafter, inputs, reference_logits, reference_loss, reference_parameters

SWITCHES = {"eagle3.1": {"fc_norm": True, "norm_output": True}, "eagle3-fcnorm": {"fc_norm": True},
            "eagle3-postnorm": {"norm_output": True}}


@pytest.mark.parametrize("name", list(SWITCHES))
@pytest.mark.parametrize("packed", [False, True], ids=["every-anchor", "packed"])
def test_switches_match_the_reference_logits_loss_and_gradients(name, packed):
    batch, last_hidden, head = inputs()
    model = drafter(**SWITCHES[name])
    params = reference_parameters(model)
    theirs = reference_logits(params, batch["aux_hidden"], batch["input_ids"], batch["attention_mask"],
                              **SWITCHES[name])
    assistant = (batch["loss_mask"] & batch["attention_mask"]).bool()
    ref_loss = reference_loss(theirs, last_hidden @ head.T, model.t2d, assistant)
    ref_grads = torch.autograd.grad(ref_loss, [t for t in params.values() if t.requires_grad])
    un = TTTUnroll(model)(batch, STEPS) if packed else unroll(model, batch, STEPS)
    losses, *_ = step_losses(model, un, batch, target_labels(last_hidden, head, model.d2t))
    loss = weighted_loss(losses, DECAY)
    loss.backward()
    if not packed:
        real = batch["attention_mask"].bool()
        for k in range(STEPS):
            # 7 chained fp32 steps: BLAS kernels differ between VMs in the last bits (1.8e-5 seen on one);
            # a wrong wiring differs by ~1e-1
            torch.testing.assert_close(un.logits[k][real], theirs[k][real], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for (n, _), ref in zip([(n, t) for n, t in params.items() if t.requires_grad], ref_grads):
        got = dict(model.named_parameters())[n].grad
        assert ref.abs().max() > 0, f"{n}: the reference gives it no gradient"
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_norm_output_feeds_the_post_norm_state_to_the_next_step():
    """Step 0 is the same with and without norm_output (same weights: the head reads norm(h)
    either way); what step 1 reads differs, and it is exactly norm(h) of step 0."""
    batch, _, _ = inputs()
    plain, post = drafter(), drafter(norm_output=True)
    post.load_state_dict(plain.state_dict())
    with torch.no_grad():
        a, b = unroll(plain, batch, 2).logits, unroll(post, batch, 2).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(a[0][real], b[0][real], atol=1e-6, rtol=1e-6)
    assert (a[1][real] - b[1][real]).abs().max() > 1e-3
    # what the second step reads: the carried state after step 0
    seen = []
    with torch.no_grad():
        for model in (plain, post):
            ctx = context(batch)
            anchors = torch.arange(batch["input_ids"].shape[1])[None].expand(batch["input_ids"].shape[0], -1)
            state = model.begin(ctx, anchors)
            ids, pos = batch["input_ids"], anchors + 1
            out = model.step(state, ids, pos, 0)
            seen.append((out, state.hidden))
    (raw, carried_raw), (normed, carried_post) = seen
    torch.testing.assert_close(carried_raw, raw)
    torch.testing.assert_close(carried_post, post.norm(raw), atol=1e-6, rtol=1e-6)
    assert not torch.allclose(carried_post, raw)


def test_fc_norm_normalizes_each_aux_state_separately():
    """Scaling one aux state by 100 leaves fc_norm's fusion unchanged (its own norm undoes it),
    while one norm over the concatenation (norm_before_fc) lets the other states shrink."""
    aux = torch.randn(2, 5, 3, 32)
    scaled = aux.clone()
    scaled[..., 1, :] *= 100.0
    per_state, joint = drafter(fc_norm=True), drafter(norm_before_fc=True)
    with torch.no_grad():
        torch.testing.assert_close(per_state.fuse(scaled), per_state.fuse(aux), atol=1e-4, rtol=1e-4)
        assert (joint.fuse(scaled) - joint.fuse(aux)).abs().max() > 1e-2
        x = torch.stack([n(aux[..., i, :]) for i, n in enumerate(per_state.fc_norm)], -2).flatten(-2)
        torch.testing.assert_close(per_state.fuse(aux), per_state.fc(x))
    assert [n for n, _ in per_state.named_parameters() if n.startswith("fc_norm")] == \
        ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]


def test_fc_norm_with_norm_before_fc_is_refused_in_one_line(tmp_path):
    cfg = asdict(drafter().cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg, "fc_norm": True, "norm_before_fc": True}))
    with pytest.raises(ValueError) as err:
        DrafterConfig.load(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "'fc_norm'" in text and "norm_before_fc" in text
    with pytest.raises(ValueError, match="'fc_norm'"):
        build_drafter(DrafterConfig(**{**cfg, "paradigm": "kv", "kv_layers": [0], "fc_norm": True}))


# ---------------------------------------------------------------- export, import, an independent library

from kvshot.__main__ import main  # noqa: E402
from kvshot.config import stage_config  # noqa: E402
from kvshot.drafters import load_drafter  # noqa: E402
from kvshot.interop.export import EAGLE3_TENSORS, FormatError, export_eagle3  # noqa: E402
from kvshot.train.variants import build_variant  # noqa: E402

from .test_export import K, documented_names, exported_folder, round_trip, saved_drafter, speculators_and_ours, world  # noqa: E402,F401  (world: a fixture)
from ..conftest import typed, section
from kvshot.settings import VariantSettings

EAGLE31 = {"name": "eagle3.1", "paradigm": "hidden", "layers": 1, "qk_norm": False, "fc_norm": True,
           "norm_output": True}


@pytest.fixture(scope="module")
def eagle31_dir(world, tmp_path_factory):
    return saved_drafter(world, EAGLE31, tmp_path_factory.mktemp("eagle31") / "drafter")


@pytest.fixture(scope="module")
def exported31(eagle31_dir, tiny):
    return exported_folder(eagle31_dir, tiny)


def test_the_documented_folder_has_the_switches_tensors(eagle31_dir):
    from safetensors import safe_open

    assert load_drafter(eagle31_dir, need_embedding=False).cfg.fc_norm
    with safe_open(str(eagle31_dir / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
    one_layer = {n for n in documented_names("hidden") if not n.startswith("layers.1.")}
    assert keys == one_layer - {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} \
        | documented_names("hidden fc_norm")


def test_export_writes_the_switches_and_the_fc_norm_names(exported31):
    from safetensors.torch import load_file

    raw = json.loads((exported31 / "config.json").read_text())
    assert raw["fc_norm"] is True and raw["norm_output"] is True and "norm_before_fc" not in raw
    tensors = load_file(str(exported31 / "model.safetensors"))
    assert sorted(tensors) == sorted(EAGLE3_TENSORS + [f"fc_norm.{i}.weight" for i in range(3)])


def test_export_refuses_norm_before_fc(world, tmp_path):
    t = world["target"]
    v = {**EAGLE31, "fc_norm": False, "norm_before_fc": True}
    build_variant(section(VariantSettings, v), t.config, t.model.embed_tokens.weight.detach(), world["d2t"]).save(tmp_path / "d")
    with pytest.raises(FormatError, match="norm_before_fc") as err:
        export_eagle3(tmp_path / "d", tmp_path / "out")
    assert "\n" not in str(err.value)


def test_round_trip_keeps_the_switches_and_gives_identical_logits(exported31, eagle31_dir, world, tiny, tmp_path):
    out = tmp_path / "imported"
    before, after = round_trip(exported31, eagle31_dir, world, tiny, out)
    assert after.cfg.fc_norm and after.cfg.norm_output
    meta = json.loads((out / "import.json").read_text())
    assert meta["fc_norm"] is True and meta["norm_output"] is True
    batch = world["src"].batch([0, 1])
    with torch.no_grad():
        a, b = unroll(before, batch, K), unroll(after, batch, K)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_speculators_converts_loads_and_matches_eagle31_logits(exported31, eagle31_dir, world, tiny, tmp_path):
    """speculators 0.9.0 (tests/speculators_env.py; the newest on PyPI) knows fc_norm and
    norm_output: its converter reads them from our config, its Eagle3DraftModel applies them;
    K TTT steps within 1e-4. Its converter drops the fc_norm tensors (its legacy model has none),
    so the script loads them from our checkpoint by the names vLLM reads (recorded, asserted)."""
    from safetensors import safe_open

    theirs, ours = speculators_and_ours(exported31, eagle31_dir, world, tiny, tmp_path)
    converted = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert converted["fc_norm"] is True and converted["norm_output"] is True
    with safe_open(str(tmp_path / "theirs.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert json.loads(meta["config"]) == {"fc_norm": True, "norm_output": True}
    in_converted = {f"fc_norm.{i}.weight" for i in range(3)} <= set(json.loads(meta["converted_names"]))
    assert meta["fc_norm_from"] == ("converted" if in_converted else "checkpoint")
    delta = (theirs["logits"] - ours).abs().max().item()
    print(f"speculators vs kvshot (eagle3.1), {K} TTT steps: max |dlogit| {delta:.2e}")
    assert delta <= 1e-4, f"max |dlogit| {delta}"


# ---------------------------------------------------------------- the smoke path: train, step-wise, decode

def test_drift_variants_train_evaluate_and_decode_losslessly(tiny, tiny_features, tmp_path):
    """The three drift variants of config/config.yaml (drift.variants) through the stages the DAG
    runs for them (drift.smk: train-drafter, eval-stepwise, eval-e2e), at the smoke scale: this
    test stands in for adding them to the smoke DAG (cheaper: one job each, no Snakemake)."""
    from kvshot.evaluate.e2e import run_e2e_stage
    from kvshot.evaluate.references import run_continuations_stage
    from kvshot.evaluate.stepwise import run_stepwise_stage

    entries = {v["name"]: v for v in tiny["cfg"]["drift"]["variants"]}
    assert set(entries) == set(SWITCHES)
    index = str(tiny_features["eval"] / "index.json")
    cont = tmp_path / "continuations.json"
    run_continuations_stage(typed(tiny["cfg"]), tiny["rt"], str(tiny["eval"]), str(tiny["model"]), str(cont))
    for name, entry in entries.items():
        cfg = json.loads(json.dumps(tiny["cfg"]))
        cfg["drafters"]["variants"] = [entry]   # as drift.smk's variant_params passes it
        out = tmp_path / name
        assert main(["train-drafter", "--config", json.dumps(stage_config(cfg, "drafters")), "--variant", name,
                     "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
                     "--target", str(tiny["model"]), "--out", str(out / "drafter")]) == 0
        trained = load_drafter(out / "drafter", need_embedding=False).cfg
        assert {k: getattr(trained, k) for k in ("fc_norm", "norm_output")} == \
            {k: SWITCHES[name].get(k, False) for k in ("fc_norm", "norm_output")}
        step = run_stepwise_stage(typed(cfg), tiny["rt"], str(out / "drafter"), str(tiny["model"]), str(cont), index,
                                  str(out / "stepwise.json"))
        sw = json.loads((out / "stepwise.json").read_text())
        assert len(sw["acc"]) == cfg["drafters"]["ttt_steps"] and step["alpha"] is not None
        assert "retention_observed" in sw or "retention" in json.dumps(sw)
        run_e2e_stage(typed(cfg), tiny["rt"], str(out / "drafter"), str(tiny["model"]), str(cont), index,
                      str(out / "e2e.json"))
        e2e = json.loads((out / "e2e.json").read_text())
        assert e2e["lossless"] and all(m["real_errors"] == 0 for m in e2e["modes"].values()), name
