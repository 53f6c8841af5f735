"""Drafter paradigms under the one TTT unroll: no future leakage, the batched unroll equals
step-by-step drafting, and gradient reaches every branch."""
from __future__ import annotations

import copy

import pytest
import torch

from kvshot.drafters.unroll import context, label_positions, shift, unroll
from kvshot.train.diagnostics import kv_key_share
from kvshot.train.objective import step_losses, target_labels, weighted_loss
from kvshot.train.variants import param_groups, variant_config

from ..conftest import assert_gradient_reaches_every_parameter, build_test_drafter
from ..conftest import typed

K = 4
VARIANTS = {
    "hidden": {"name": "h", "paradigm": "hidden", "layers": 2},
    "kv": {"name": "k", "paradigm": "kv", "layers": 2},
    "hybrid": {"name": "y", "paradigm": "hybrid", "layers": 2, "gate_shape": "channel", "gate_init": 0.3},
}


def make(world, paradigm: str, seed: int = 0):
    """The test drafter of `paradigm` (`VARIANTS`), from `drafter_world`."""
    return build_test_drafter(world, VARIANTS[paradigm], seed)


def one_sample_batch(src, i=0):
    return src.batch([i])


@pytest.mark.parametrize("paradigm", list(VARIANTS))
def test_no_future_leakage(drafter_world, paradigm):
    """The step-k prediction at anchor t may see target context <= t and tokens <= t+k+1 only."""
    src = drafter_world[0]
    model = make(drafter_world, paradigm)
    batch = one_sample_batch(src, 1)
    base = unroll(model, batch, K).logits
    length = batch["input_ids"].shape[1]
    for t in (2, length // 2):
        for k in range(K):
            seen_tok = t + k + 1
            b2 = copy.deepcopy(batch)
            b2["input_ids"][:, seen_tok + 1:] = (b2["input_ids"][:, seen_tok + 1:] + 7) % 100
            for key, v in b2.items():
                if key.startswith(("aux_hidden", "key_", "value_", "last_hidden")):
                    v[:, t + 1:] = torch.randn_like(v[:, t + 1:])
            after = unroll(model, b2, K).logits
            torch.testing.assert_close(after[k][:, t], base[k][:, t], atol=1e-5, rtol=1e-5)
        # and the prediction does depend on what it may see (the test can fail)
        b3 = copy.deepcopy(batch)
        b3["input_ids"][:, t + 1] = (b3["input_ids"][:, t + 1] + 7) % 100
        assert not torch.allclose(unroll(model, b3, K).logits[0][:, t], base[0][:, t])


def simulate_drafting(model, sample, t: int, split: int, steps: int) -> list[torch.Tensor]:
    """Draft from anchor t the way a decoder does: the target's context up to t arrives in two
    rounds (anchors < split, then split..t); step 0 runs over the new anchors, then only the
    last anchor drafts on."""
    ids = sample["input_ids"].long()
    ctx_all = {k: v for k, v in sample.items() if k == "aux_hidden" or k.startswith(("key_", "value_"))}

    def ctx_upto(lo, hi):
        c = {k: (v[:, lo:hi + 1] if k == "aux_hidden" else v[:, : hi + 1]) for k, v in ctx_all.items()}
        return c

    state = None
    for lo, hi in ((0, split - 1), (split, t)):
        anchors = torch.arange(lo, hi + 1).unsqueeze(0)
        state = model.begin(ctx_upto(lo, hi), anchors, previous=state)
        h = model.step(state, ids[:, lo + 1: hi + 2], anchors + 1, 0)
    out = [model.logits(h[:, -1:])]
    state.select_rows(slice(-1, None))
    for k in range(1, steps):
        h = model.step(state, ids[:, t + k + 1: t + k + 2], torch.tensor([[t + k + 1]]), k)
        out.append(model.logits(h))
    return out


@pytest.mark.parametrize("paradigm", list(VARIANTS))
def test_batched_unroll_equals_step_by_step_drafting(drafter_world, paradigm):
    src = drafter_world[0]
    model = make(drafter_world, paradigm)
    batch = one_sample_batch(src, 2)
    un = unroll(model, batch, K)
    length = batch["input_ids"].shape[1]
    for t in (3, length // 2, length - K - 2):
        sim = simulate_drafting(model, batch, t, split=2, steps=K)
        for k in range(K):
            torch.testing.assert_close(sim[k][0, 0], un.logits[k][0, t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("paradigm", list(VARIANTS))
def test_gradient_reaches_every_branch(drafter_world, paradigm):
    src, target, _ = drafter_world
    model = make(drafter_world, paradigm).train()
    assert_gradient_reaches_every_parameter(model, src.batch([0, 1, 2]), target, K, f"{paradigm}: ")
    groups = param_groups(model)
    if paradigm != "hidden":
        assert {"kv_wk_wv", "kv_query_out"} <= set(groups)
    if paradigm == "hybrid":
        assert "gate" in groups and model.gate().shape == (2, model.cfg.hidden_size)
        torch.testing.assert_close(model.gate(), torch.full_like(model.gate(), 0.3), atol=0.35, rtol=0)


def test_draft_vocab_is_most_frequent_assistant_tokens(drafter_world):
    src, target, d2t = drafter_world
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    for i in range(len(src)):
        s = src.tokens(i)
        counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()].long(), minlength=len(counts))
    assert len(d2t) == 150 and torch.equal(d2t, d2t.sort().values)
    assert counts[d2t].min() >= counts[~torch.isin(torch.arange(len(counts)), d2t)].max()


def test_labels_are_the_target_distribution(drafter_world, tiny):
    src, target, d2t = drafter_world
    batch = src.batch([0])
    labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), d2t, chunk=7)
    logits = target(input_ids=batch["input_ids"].long()).logits
    torch.testing.assert_close(labels.probs, torch.softmax(logits[..., d2t], -1), atol=1e-5, rtol=1e-4)
    assert torch.equal(labels.argmax, logits.argmax(-1))
    # step k's label for anchor t is the target's view at position t+k+1
    assert torch.equal(shift(labels.argmax, 3)[0, :-3], labels.argmax[0, 3:])
    # only the positions a loss reads: the same there, nothing elsewhere
    where = label_positions(batch)
    assert 0 < int(where.sum()) < where.numel()
    some = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), d2t, chunk=7, positions=where)
    torch.testing.assert_close(some.probs[where], labels.probs[where])
    assert torch.equal(some.argmax[where], labels.argmax[where])
    assert not some.probs[~where].any() and not some.argmax[~where].any()


def test_context_excludes_labels(drafter_world):
    batch = drafter_world[0].batch([0])
    assert "last_hidden" not in context(batch) and "input_ids" not in context(batch)


def test_variant_config_merges_train_overrides(tiny):
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["drafters"]["variants"][0]["train"] = {"max_steps": 9}
    v = variant_config(typed(cfg), cfg["drafters"]["variants"][0]["name"])
    assert v.train.max_steps == 9 and v.train.lr == cfg["drafters"]["train"]["lr"]


@pytest.mark.parametrize("block_rows", [None, 8])
@pytest.mark.parametrize("paradigm", list(VARIANTS))
def test_skipping_unlabelled_anchors_keeps_loss_and_gradients(drafter_world, paradigm, block_rows, monkeypatch):
    """Training drops anchors with no label at any step (after step 0 for the paradigms whose
    step-0 keys are a shared prefix) and packs the batch: same loss, counts and gradients."""
    from kvshot.drafters import skeleton

    monkeypatch.setattr(skeleton, "BLOCK_ROWS", block_rows)   # 8: sequences split further into row blocks
    src, target, _ = drafter_world
    model = make(drafter_world, paradigm).train()
    batch = src.batch([0, 1, 2, 3])          # different lengths: padding, user turns unlabelled
    assert (batch["loss_mask"] == 0).float().mean() > 0.2
    every = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t)
    results = []
    for skip in (False, True):
        # the trainer's labels: only the positions a loss reads
        labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t,
                               positions=label_positions(batch)) if skip else every
        model.zero_grad(set_to_none=True)
        un = unroll(model, batch, K, skip_unlabelled=skip)
        losses, counts, correct, acc_n = step_losses(model, un, batch, labels)
        weighted_loss(losses, 0.8).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((un, torch.stack(losses), counts, correct, acc_n, grads))
    (full, l0, c0, r0, a0, g0), (skipped, l1, c1, r1, a1, g1) = results
    assert skipped.rows[-1] is not None and skipped.logits[-1][..., 0].numel() < full.logits[-1][..., 0].numel()
    assert all(int(v.sum()) == v.numel() for v in skipped.valid)      # the head ran only on scored rows
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    assert [int(x) for x in c1] == [int(x) for x in c0] and [int(x) for x in a1] == [int(x) for x in a0]
    assert [int(x) for x in r1] == [int(x) for x in r0]
    assert g1.keys() == g0.keys()
    assert kv_key_share(skipped.valid, skipped.anchors) == pytest.approx(kv_key_share(full.valid, full.anchors))
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_row_blocks_skip_only_keys_they_cannot_see():
    """Attention in row blocks (each block reads only the keys up to its last visible one)
    equals one block over every key, for causal rows with padding and diagonal keys."""
    from kvshot.drafters.skeleton import Attention, DrafterConfig, Keys, prefix_mask

    torch.manual_seed(0)
    cfg = DrafterConfig(paradigm="kv", hidden_size=32, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=50)
    attn = Attention(32, cfg)
    b, t = 2, 300
    q = torch.randn(b, 4, t, 8)
    prefix = Keys(torch.randn(b, 2, t, 8), torch.randn(b, 2, t, 8))
    diag = [Keys(torch.randn(b, 2, t, 8), torch.randn(b, 2, t, 8)) for _ in range(3)]
    anchors = torch.arange(t).expand(b, -1)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 250:] = False                                  # a shorter second sequence
    visible = (anchors[:, None, :] <= anchors[:, :, None]) & valid[:, None, :]
    blocked, whole = prefix_mask(visible, torch.float32, block_rows=64), prefix_mask(visible, torch.float32)
    assert len(blocked.blocks) == 5 and blocked.blocks[0] == (0, 64, 0, 64) and len(whole.blocks) == 1
    torch.testing.assert_close(attn.attend(q, prefix, blocked, diag), attn.attend(q, prefix, whole, diag))
    segmented = prefix_mask(visible, torch.float32, segments=[(0, 100), (100, 300)])
    assert [b[:2] for b in segmented.blocks] == [(0, 100), (100, 300)] and segmented.blocks[0][3] == 100
    torch.testing.assert_close(attn.attend(q, prefix, segmented, diag), attn.attend(q, prefix, whole, diag))


def test_variant_record_is_the_filled_config_entry(tiny):
    """variant.json and the checkpoint fingerprint hash the plain data the filled config dict
    held before the typed config: the entry as set, drafters' block_size and head_init, and the
    whole train section with the overrides over it (null fields included), so a checkpoint
    written before keeps its fingerprint."""
    from kvshot.config import fill_defaults
    from kvshot.train.variants import variant_record

    cfg = fill_defaults(copy.deepcopy(tiny["cfg"]))
    entry = copy.deepcopy(cfg["drafters"]["variants"][0])
    entry["train"] = {"max_steps": 9, "plateau": {"patience": 2, "min_delta": 0.0, "min_acc_delta": 0.0}}
    cfg["drafters"]["variants"][0] = entry
    cfg["drafters"]["train"]["train_samples"] = None   # set null, as config/config.yaml does
    old = {**entry, "train": {**cfg["drafters"]["train"], **entry["train"]}}
    if entry["paradigm"] != "standalone":
        old.setdefault("head_init", cfg["drafters"]["head_init"])
    assert variant_record(variant_config(typed(cfg), entry["name"])) == old
