"""The standalone draft model is exactly a Qwen3 causal LM: its unroll (every step, x_0
included) equals the converted transformers model, decoding rounds equal the batched unroll,
it starts from the target's layers, and the trainer reaches all of it."""
from __future__ import annotations

import copy

import pytest
import torch

from kvshot.capture.features import open_features
from kvshot.capture.target import load_target
from kvshot.drafters import load_drafter
from kvshot.drafters.standalone import StandaloneDrafter, hf_name, to_hf
from kvshot.drafters.unroll import context, unroll
from kvshot.train.objective import step_losses, target_labels, weighted_loss
from kvshot.train.variants import build_variant, param_groups

from ..conftest import assert_gradient_reaches_every_parameter
from ..conftest import section
from kvshot.settings import VariantSettings

K = 4
VARIANT = {"name": "s", "paradigm": "standalone", "layers": 2, "kv_layers": [0, 1]}   # kv_layers: ignored


@pytest.fixture(scope="module")
def setup(tiny, tiny_features):
    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"], attn="eager")
    return src, target


def random_drafter(target, seed: int = 0) -> StandaloneDrafter:
    """Random layers (not the target's), norms off 1 so every weight matters."""
    torch.manual_seed(seed)
    d2t = torch.arange(10)   # replaced by the full vocabulary
    model = build_variant(section(VariantSettings, VARIANT), target.config, target.model.embed_tokens.weight.detach(), d2t)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def lm_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}


def test_build_variant_full_vocab_no_target_context(setup):
    _, target = setup
    model = random_drafter(target)
    vocab = target.config.vocab_size
    assert isinstance(model, StandaloneDrafter) and model.cfg.kv_layers == [] and not model.reads_aux_hidden
    assert torch.equal(model.d2t, torch.arange(vocab)) and bool(model.t2d.all()) and model.lm_head.out_features == vocab
    assert model.kv_attentions() == [] and set(param_groups(model)) == {"body", "lm_head"}


@torch.no_grad()
def test_to_hf_logits_equal_every_unroll_step(setup):
    """Step k at anchor t reads x_{t+k+1}: the HF model's logits at position t+k+1. Position 0
    (x_0) is what `begin` adds to the prefix; computed alone it is the HF logits at 0."""
    src, target = setup
    model = random_drafter(target)
    hf = to_hf(model, attn_implementation="eager")
    assert hf.config.num_hidden_layers == 2 and not hf.config.tie_word_embeddings
    ids = torch.cat([src.batch([0])["input_ids"][:, :40], src.batch([1])["input_ids"][:, :40]]).long()
    ref = hf(ids).logits
    un = unroll(model, lm_batch(ids), K)
    t = ids.shape[1]
    for k in range(K):
        torch.testing.assert_close(un.step_logits(k)[:, : t - k - 1], ref[:, k + 1:], atol=1e-5, rtol=0)
    state = model.begin({}, torch.full((2, 1), -1))          # x_0 as the only row, nothing before it
    h0 = model.step(state, ids[:, :1], torch.zeros(2, 1, dtype=torch.long), 0)
    torch.testing.assert_close(model.logits(h0)[:, 0], ref[:, 0], atol=1e-5, rtol=0)
    # without x_0 in the prefix the drafter would not be the causal LM (the test can fail)
    assert "first_ids" in context(lm_batch(ids))
    state = model.begin({}, torch.arange(t - 1).expand(2, -1))
    assert not torch.allclose(model.logits(model.step(state, ids[:, 1:], torch.arange(1, t)[None], 0)), ref[:, 1:],
                              atol=1e-3)


@torch.no_grad()
def test_decoding_rounds_equal_the_batched_unroll(setup):
    """As the decoder runs it: round 1 sees x_0 and anchors < split, round 2 extends the
    drafter's own cache (previous state) with anchors split..t, then t drafts K steps."""
    src, target = setup
    model = random_drafter(target, seed=1)
    ids = src.batch([2])["input_ids"].long()
    un = unroll(model, lm_batch(ids), K)
    for t, split in ((5, 2), (ids.shape[1] - K - 2, 7)):
        state = None
        for lo, hi in ((0, split - 1), (split, t)):
            anchors = torch.arange(lo, hi + 1)[None]
            ctx = {"first_ids": ids[:, :1]} if state is None else {}
            state = model.begin(ctx, anchors, previous=state)
            h = model.step(state, ids[:, lo + 1: hi + 2], anchors + 1, 0)
        state.select_rows(slice(-1, None))
        out = [model.logits(h[:, -1:])]
        for k in range(1, K):
            out.append(model.logits(model.step(state, ids[:, t + k + 1: t + k + 2], torch.tensor([[t + k + 1]]), k)))
        for k in range(K):
            torch.testing.assert_close(out[k][0, 0], un.step_logits(k)[0, t], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_no_future_leakage(setup):
    src, target = setup
    model = random_drafter(target, seed=2)
    ids = src.batch([1])["input_ids"].long()
    base = [unroll(model, lm_batch(ids), K).step_logits(k) for k in range(K)]
    t = ids.shape[1] // 2
    for k in range(K):
        changed = ids.clone()
        changed[:, t + k + 2:] = (changed[:, t + k + 2:] + 7) % 100
        after = unroll(model, lm_batch(changed), K).step_logits(k)
        torch.testing.assert_close(after[:, t], base[k][:, t], atol=1e-5, rtol=1e-5)
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 7) % 100     # x_0 is seen by every row
    assert not torch.allclose(unroll(model, lm_batch(changed), 1).logits[0][:, t], base[0][:, t])


def test_starts_from_the_target_and_distills(setup):
    """Built with the target: its first layers, final norm and head (at full depth it is the
    target); TTT's soft labels (the target distribution) then reach every trainable weight."""
    src, target = setup
    embed = target.model.embed_tokens.weight.detach()
    n = target.config.num_hidden_layers
    full = build_variant(section(VariantSettings, {**VARIANT, "layers": n}), target.config, embed, torch.arange(3), target).eval()
    ids = src.batch([0])["input_ids"].long()
    with torch.no_grad():
        ref = target(ids).logits
        torch.testing.assert_close(to_hf(full)(ids).logits, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(unroll(full, lm_batch(ids), 1).logits[0][:, :-1], ref[:, 1:], atol=1e-5, rtol=0)

    model = build_variant(section(VariantSettings, VARIANT), target.config, embed, torch.arange(3), target).train()
    theirs = target.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p, theirs[hf_name(name)]), name
    assert_gradient_reaches_every_parameter(model, src.batch([0, 1, 2]), target, K)


def test_save_load_and_to_hf_refuses_a_reduced_vocab(setup, tmp_path):
    src, target = setup
    model = random_drafter(target)
    model.save(tmp_path / "s")
    with pytest.raises(ValueError, match=r"s/model.safetensors: no embed_tokens.weight"):
        load_drafter(tmp_path / "s")   # the folder holds no copy of the target's embedding
    loaded = load_drafter(tmp_path / "s", embed=target.model.embed_tokens.weight).eval()
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    ids = src.batch([0])["input_ids"][:, :30].long()
    with torch.no_grad():
        assert torch.equal(unroll(loaded, lm_batch(ids), 2).step_logits(1), unroll(model, lm_batch(ids), 2).step_logits(1))
    reduced = copy.deepcopy(model)
    reduced.set_vocab(model.embed_tokens.weight, torch.flip(torch.arange(target.config.vocab_size), [0]))
    with pytest.raises(ValueError, match="full target vocabulary"):
        to_hf(reduced)
    with pytest.raises(ValueError, match="cannot start from the target"):
        build_variant(section(VariantSettings, {**VARIANT, "intermediate_size": 8}), target.config, model.embed_tokens.weight, model.d2t, target)


@torch.no_grad()
def test_hf_assisted_generation_with_the_converted_drafter_matches_ours(setup):
    """What benchmarks/assisted.py compares: HF's assisted generation with `to_hf(drafter)`
    drafting a constant K per round, kvshot's decoder with the drafter itself, and the target
    alone give the same greedy tokens."""
    from kvshot.evaluate.decode import speculative_generate
    from kvshot.evaluate.draft_tree import DraftSpec

    src, target = setup
    model = build_variant(section(VariantSettings, VARIANT), target.config, target.model.embed_tokens.weight.detach(), torch.arange(3),
                          target).eval()
    hf = to_hf(model, attn_implementation="eager")
    hf.generation_config.num_assistant_tokens = K
    hf.generation_config.num_assistant_tokens_schedule = "constant"
    hf.generation_config.assistant_confidence_threshold = 0.0
    for i in range(3):
        x = src.batch([i])["input_ids"][:, :24].long()
        kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=20, eos_token_id=None,
                  pad_token_id=target.config.pad_token_id)
        plain = target.generate(x, **kw)[0, x.shape[1]:].tolist()
        assisted = target.generate(x, assistant_model=hf, **kw)[0, x.shape[1]:].tolist()
        ours = speculative_generate(target, model, x, 20, None, None, DraftSpec(depth=K)).tokens
        assert plain == assisted == ours, i


def test_teacher_forced_shortcut_equals_the_step_by_step_unroll(setup):
    """A causal LM's teacher-forced step k at anchor t is its step 0 at anchor t + k: the
    one-pass unroll equals K explicit steps (diagonal keys and all) where labels exist."""
    src, target = setup
    model = random_drafter(target)
    batch = lm_batch(torch.cat([src.batch([0])["input_ids"][:, :40], src.batch([1])["input_ids"][:, :40]]).long())
    fast = unroll(model, batch, K)
    model.causal_lm = False                      # this instance only: the generic K-step unroll
    slow = unroll(model, batch, K)
    t = batch["input_ids"].shape[1]
    for k in range(K):
        torch.testing.assert_close(fast.step_logits(k)[:, : t - k - 1], slow.logits[k][:, : t - k - 1], atol=1e-5, rtol=0)
        assert torch.equal(fast.valid[k], slow.valid[k])


def test_shared_logits_loss_equals_the_step_by_step_loss(setup):
    """The K steps' losses from one [B, T, N] tensor (the soft CE once per position) equal the
    generic unroll's per-step losses, counts, accuracies and gradients; the unroll holds one
    logits tensor, not K shifted copies (the paper-scale evaluation's memory)."""
    src, target = setup
    batch = src.batch([0, 1, 2])
    grads, results = [], []
    for generic in (False, True):
        model = random_drafter(target, seed=3)
        model.causal_lm = not generic
        labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t)
        un = unroll(model, batch, K)
        assert un.shared_logits == (not generic) and len(un.logits) == (K if generic else 1)
        out = step_losses(model, un, batch, labels, [5.0 + k for k in range(K)])   # DDP-style denominators
        weighted_loss(out[0], 0.8).backward()
        results.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (fast, slow) = results
    for k in range(K):
        torch.testing.assert_close(fast[0][k], slow[0][k], atol=1e-5, rtol=1e-5)
        for i in (1, 2, 3):
            assert int(fast[i][k]) == int(slow[i][k]), (k, i)
    assert any(float(fast[0][k].detach()) != float(fast[0][0].detach()) for k in range(1, K))   # the steps differ
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_anchor_rows_slice_before_the_head(setup):
    """With anchor rows (step-wise evaluation) the causal LM's head runs on R rows per step,
    not on every position: the logits equal the full unroll's at those anchors."""
    src, target = setup
    model = random_drafter(target, seed=4)
    ids = torch.cat([src.batch([0])["input_ids"][:, :40], src.batch([1])["input_ids"][:, :40]]).long()
    batch, t = lm_batch(ids), ids.shape[1]
    full = unroll(model, batch, K)
    anchors = torch.tensor([3, 17, 30, t + 5, t + 20])          # flat rows b * T + t
    some = unroll(model, batch, K, anchor_rows=anchors)
    assert not some.shared_logits
    for k in range(K):
        assert some.logits[k].shape[:2] == (1, len(anchors)) and torch.equal(some.rows[k], anchors)
        torch.testing.assert_close(some.logits[k][0], full.step_logits(k).reshape(-1, full.logits[0].shape[-1])[anchors],
                                   atol=1e-5, rtol=1e-5)
        assert torch.equal(some.valid[k][0], full.valid[k].flatten()[anchors])
