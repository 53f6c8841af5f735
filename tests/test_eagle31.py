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
from kvshot.ttt import TTTUnroll, context, step_losses, target_labels, unroll, weighted_loss

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
            torch.testing.assert_close(un.logits[k][real], theirs[k][real], atol=1e-5, rtol=1e-5)
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
