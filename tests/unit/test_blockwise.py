"""The block drafter and its one-call training objective: the packed forward over every anchor
equals a plainly written per-anchor reference (logits, loss, gradients), no future leakage,
bidirectional attention gives every slot's W_K/W_V key gradient from every position, the
kv_wk_wv gradient group against a KV-only chain drafter's on the same batch, and the trainer
runs the objective (checkpoints, metrics) end to end."""
from __future__ import annotations

import copy
from dataclasses import replace
import math

import pytest
import torch

from kvshot.drafters.attention import use_attention
from kvshot.drafters.unroll import assistant_tokens, block_unroll, context, label_positions, unroll
from kvshot.train.diagnostics import grad_norms
from kvshot.train.objective import objective, step_losses, target_labels, weighted_loss
from kvshot.train.variants import param_groups

from ..conftest import build_test_drafter
from .test_train import die_at_call
from ..conftest import typed, section
from kvshot.settings import VariantSettings

S = 5            # block slots: x_{t+1} and four masks
P = S - 1        # positions predicted
BLOCKS = {
    "block-kv-d2": {"name": "bk2", "paradigm": "block", "context": "kv", "layers": 2, "block_size": S},
    "block-hidden-d1": {"name": "bh1", "paradigm": "block", "context": "hidden", "layers": 1, "block_size": S},
    "block-kv-d1-refine": {"name": "bkr", "paradigm": "block", "context": "kv", "layers": 1, "block_size": S,
                           "refine_passes": 1},   # one refinement pass
    "block-dflash-d2": {"name": "bd2", "paradigm": "block", "context": "dflash", "layers": 2, "block_size": S},
}


def make(world, name: str, seed: int = 0):
    return build_test_drafter(world, BLOCKS[name], seed)


def two_sequences(src):
    """Two sequences of different lengths (the shorter one padded): packing must keep them apart."""
    batch = src.batch([0, 3])
    n = min(48, batch["input_ids"].shape[1])
    return {k: v[:, :n] for k, v in batch.items()}


# ---------------------------------------------------------------- the plain reference

def context_keys(model, ctx: dict, b: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's context keys and values [Hkv, T, D] for sequence b: the target's KV cache, or
    the fused hidden states projected by the layer's own W_K/W_V at their positions."""
    if model.cfg.block_context == "kv":
        l = model.cfg.kv_layers[i]
        return ctx[f"key_{l}"][b].transpose(0, 1), ctx[f"value_{l}"][b].transpose(0, 1)
    layer, rot = model.layers[i], model.rotary(torch.arange(ctx["aux_hidden"].shape[1])[None])
    fused = model.fc(ctx["aux_hidden"][b].flatten(-2))[None]
    if model.cfg.block_context == "dflash":   # one hidden_norm, then the layer's W_K/W_V (no attn_norm)
        _, keys = layer.self_attn.project(model.hidden_norm(fused), rot)
    else:
        _, keys = layer.self_attn.project(layer.attn_norm(model.context_norm(fused)), rot)
    return keys.k[0], keys.v[0]


def reference_block(model, ctx: dict, ids: torch.Tensor, valid: torch.Tensor, b: int, t: int,
                    guesses: torch.Tensor | None = None) -> torch.Tensor:
    """The block after anchor t of sequence b, written out: S query rows at t+1.., keys = the
    valid context keys of positions <= t plus the block's own S keys, softmax, values. [S, H].
    guesses (a refinement pass): S - 1 target tokens whose embeddings the mask slots add."""
    x_next = ids[b, t + 1] if t + 1 < ids.shape[1] else torch.tensor(0)
    masks = model.mask_embed.expand(S - 1, -1)   # one row per slot, or DFlash's one for all
    masks = masks if guesses is None else masks + model.embed_tokens(guesses)
    h = torch.cat([model.embed_tokens(x_next)[None], masks])[None]                    # [1, S, H]
    rot = model.rotary((t + 1 + torch.arange(S))[None])
    seen = valid[b, : t + 1]
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, own = attn.project(layer.attn_norm(h), rot)                                  # [1, H, S, D]
        ck, cv = context_keys(model, ctx, b, i)
        keys = torch.cat([ck[:, : t + 1][:, seen], own.k[0]], dim=1)                   # [Hkv, n + S, D]
        values = torch.cat([cv[:, : t + 1][:, seen], own.v[0]], dim=1)
        group = attn.n_heads // attn.n_kv
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        probs = torch.softmax(q[0] @ keys.transpose(-1, -2) / math.sqrt(attn.head_dim), dim=-1)
        out = (probs @ values).transpose(0, 1).reshape(1, S, -1)
        h = layer.mlp_block(h + attn.o_proj(out))
    return h[0]


def reference_passes(model, ctx: dict, ids: torch.Tensor, valid: torch.Tensor, b: int, t: int) -> list[torch.Tensor]:
    """Every pass's block: the first, then per refinement pass the block re-run with mask slot j
    adding the embedding of the previous pass's greedy token at slot j - 1 (mapped to the target vocabulary)."""
    passes = [reference_block(model, ctx, ids, valid, b, t)]
    for _ in range(model.cfg.block_refine):
        guesses = model.d2t[model.logits(passes[-1][:-1]).argmax(-1)].detach()
        passes.append(reference_block(model, ctx, ids, valid, b, t, guesses))
    return passes


def reference_loss(model, batch: dict, labels, decay: float) -> tuple[dict, torch.Tensor]:
    """Loop over sequences and anchors: each labelled anchor's block, position k scored by the
    soft cross-entropy to the target's distribution for x_{t+k+2} where that token is an
    assistant token and the target's greedy token is in the draft vocabulary; per position the
    mean over those (and over every refinement pass), weighted decay ** k. Returns
    ({(b, t): every pass's logits [P, N]}, the loss)."""
    ctx = context(batch, torch.float32)
    ids, valid = batch["input_ids"].long(), batch["attention_mask"].bool()
    scored = assistant_tokens(batch)
    sums, counts, logits_of = [0.0] * P, [0] * P, {}
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            ks = [k for k in range(P) if t + k + 2 < ids.shape[1] and scored[b, t + k + 2]]
            if not ks:
                continue
            logits_of[(b, t)] = []
            for h in reference_passes(model, ctx, ids, valid, b, t):
                logits = model.logits(h[1:])   # slot k+1: position k
                logits_of[(b, t)].append(logits)
                for k in ks:
                    if not model.t2d[labels.argmax[b, t + k + 1]]:
                        continue
                    p = labels.probs[b, t + k + 1]
                    sums[k] = sums[k] - (p * torch.log_softmax(logits[k], -1)).sum()
                    counts[k] += 1
    return logits_of, sum(decay ** k * s / max(c, 1) for k, (s, c) in enumerate(zip(sums, counts)))


# ---------------------------------------------------------------- tests

def test_refinement_pass_equals_the_per_anchor_reference(drafter_world):
    """One refinement pass (refine_passes 1): training scores both passes, loss and every
    gradient equal the per-anchor loop's; evaluation drafts with the second pass, whose mask
    slots read the first pass's greedy tokens; with no passes the drafter is the plain block."""
    src, target, _ = drafter_world
    spec = {**BLOCKS["block-kv-d2"], "refine_passes": 1}
    model = build_test_drafter(drafter_world, spec, 0).train()
    assert model.cfg.block_refine == 1
    batch = two_sequences(src)
    labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t,
                           positions=label_positions(batch))
    un = block_unroll(model, batch)
    fast = weighted_loss(step_losses(model, un, batch, labels)[0], 0.8)
    fast.backward()
    fast_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ref_logits, ref = reference_loss(model, batch, labels, 0.8)
    ref.backward()
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(fast_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
    model.eval()
    with torch.no_grad():
        un = block_unroll(model, batch, skip_unlabelled=False)
        width, compared = batch["input_ids"].shape[1], 0
        for k in range(P):
            for row, logits in zip(un.rows[k].tolist(), un.logits[k][0]):
                if divmod(row, width) in ref_logits:   # evaluation: the last pass
                    torch.testing.assert_close(logits, ref_logits[divmod(row, width)][-1][k], atol=1e-5, rtol=1e-5)
                    compared += 1
        assert compared > 40
        plain = build_test_drafter(drafter_world, BLOCKS["block-kv-d2"], 0).eval()
        first = block_unroll(plain, batch, skip_unlabelled=False)
        assert not torch.allclose(first.logits[1], un.logits[1])   # the second pass changes the draft


@pytest.mark.parametrize("name", list(BLOCKS))
@pytest.mark.parametrize("backend", ["flash_cpu", "reference"])
def test_one_call_forward_equals_the_per_anchor_reference(drafter_world, name, backend):
    """Logits, loss and every parameter's gradient of the packed one-call objective equal the
    per-anchor loop's, with uniform (1.0) and decaying (0.8) position weights."""
    src, target, _ = drafter_world
    model = make(drafter_world, name).train()
    batch = two_sequences(src)
    labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t,
                           positions=label_positions(batch))
    use_attention(backend)
    try:
        for decay in (1.0, 0.8):
            model.zero_grad(set_to_none=True)
            un = block_unroll(model, batch)
            fast = weighted_loss(step_losses(model, un, batch, labels)[0], decay)
            fast.backward()
            fast_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            ref_logits, ref = reference_loss(model, batch, labels, decay)
            ref.backward()
            torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
            width = batch["input_ids"].shape[1]
            compared = 0
            passes = 1 + model.cfg.block_refine   # training scores each pass's rows, pass-major
            for k in range(P):
                per_pass = len(un.rows[k]) // passes
                for i, (row, logits) in enumerate(zip(un.rows[k].tolist(), un.logits[k][0])):
                    want = ref_logits[divmod(row, width)][i // per_pass][k]
                    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
                    compared += 1
            assert compared > 40
            for n, p in model.named_parameters():
                if p.requires_grad:
                    assert n in fast_grads and fast_grads[n].abs().sum() > 0, f"{name}: no gradient reaches {n}"
                    torch.testing.assert_close(fast_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=f"{name} {n}")
    finally:
        use_attention("auto")


@pytest.mark.parametrize("name", list(BLOCKS))
def test_no_future_leakage(drafter_world, name):
    """Position k at anchor t sees target context <= t and the token x_{t+1} only."""
    model = make(drafter_world, name)
    batch = drafter_world[0].batch([1, 0])
    base = block_unroll(model, batch, skip_unlabelled=False)
    width = batch["input_ids"].shape[1]
    everywhere = set.intersection(*(set(r.tolist()) for r in base.rows))
    scored = sorted(r for r in everywhere if r < width - S)   # sequence 0's anchors scored at every position
    assert len(scored) > 4
    for t in (scored[0], scored[len(scored) // 2]):
        b2 = copy.deepcopy(batch)
        b2["input_ids"][:, t + 2:] = (b2["input_ids"][:, t + 2:] + 7) % 100
        for key, v in b2.items():
            if key.startswith(("aux_hidden", "key_", "value_", "last_hidden")):
                v[:, t + 1:] = torch.randn_like(v[:, t + 1:])
        after = block_unroll(model, b2, skip_unlabelled=False)
        for k in range(P):
            at = (base.rows[k] == t).nonzero().view(-1)   # sequence 0's anchor t
            assert len(at) == 1
            torch.testing.assert_close(after.logits[k][0, at], base.logits[k][0, at], atol=1e-5, rtol=1e-5)
        b3 = copy.deepcopy(batch)
        b3["input_ids"][:, t + 1] = (b3["input_ids"][:, t + 1] + 7) % 100
        at = (base.rows[P - 1] == t).nonzero().view(-1)
        assert not torch.allclose(block_unroll(model, b3, skip_unlabelled=False).logits[P - 1][0, at],
                                  base.logits[P - 1][0, at])


def slot_key_gradients(model, batch, labels, position: int) -> torch.Tensor:
    """|d loss_position / d key| per block slot, summed over rows, heads and layers: [S]."""
    grads = []
    for layer in model.layers:
        attn = layer.self_attn
        original = attn.project

        def project(x, rot, _orig=original):
            q, keys = _orig(x, rot)
            keys.k.retain_grad()
            grads.append(keys.k)
            return q, keys
        attn.project = project
    try:
        un = block_unroll(model, batch)
        losses = step_losses(model, un, batch, labels)[0]
        losses[position].backward()
    finally:
        for layer in model.layers:
            del layer.self_attn.project
    total = torch.zeros(S)
    for k in grads:   # [1, Hkv, R * S, D]: rows (anchor, slot)
        total += k.grad.abs().view(k.shape[1], -1, S, k.shape[-1]).sum((0, 1, 3))
    return total


def test_every_slot_key_gets_gradient_from_every_position(drafter_world):
    """Bidirectional attention: even the first position's loss reaches the keys W_K projects
    for every slot, the last mask slot's included (a causal chain's step 0 reaches only its own)."""
    src, target, _ = drafter_world
    model = make(drafter_world, "block-kv-d2").train()
    batch = two_sequences(src)
    labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t)
    for position in (0, P - 1):
        model.zero_grad(set_to_none=True)
        per_slot = slot_key_gradients(model, batch, labels, position)
        assert bool((per_slot > 0).all()), f"position {position}: slot key gradients {per_slot.tolist()}"


def kv_gradient(model, batch, labels, steps: int, forward) -> tuple[float, float]:
    """One backward of the model's objective on `batch`, through the trainer's gradient groups
    (`train.param_groups`, `grad_norms`): (|grad kv_wk_wv| / |grad| over every group,
    |grad kv_wk_wv| / |grad kv_query_out|, the ratio the sparse-gradient claim reads)."""
    model.zero_grad(set_to_none=True)
    losses = step_losses(model, forward(model, batch, steps), batch, labels)[0]
    weighted_loss(losses, 1.0).backward()
    norms = grad_norms(param_groups(model))
    return (norms["kv_wk_wv"] / math.sqrt(sum(v * v for v in norms.values())),
            norms["kv_wk_wv"] / norms["kv_query_out"])


def test_wk_wv_gradient_against_the_kv_chain(drafter_world):
    """On the same batch, from the same initial weights of the shared parts (three inits), the
    block drafter's W_K/W_V carry more gradient against W_Q/W_O, and a larger share of the
    whole, than a 2-layer KV-only chain drafter's under TTT. Both read the same target layers."""
    src, target, _ = drafter_world
    batch = src.batch([0, 1, 2])
    head = target.lm_head.weight.detach()
    ttt = lambda m, b, k: unroll(m, b, k, skip_unlabelled=True)   # noqa: E731  (the trainer's forward)
    for seed in range(3):
        chain = build_test_drafter(drafter_world, {"name": "k2", "paradigm": "kv", "layers": 2}, seed).train()
        block = make(drafter_world, "block-kv-d2", seed).train()
        block.load_state_dict(chain.state_dict(), strict=False)   # same layers, head and norms
        assert block.cfg.kv_layers == chain.cfg.kv_layers
        labels = target_labels(batch["last_hidden"], head, chain.d2t)
        chain_share, chain_ratio = kv_gradient(chain, batch, labels, P, ttt)
        block_share, block_ratio = kv_gradient(block, batch, labels, P, block_unroll)   # the trainer's forward
        print(f"seed {seed}: kv_wk_wv share block {block_share:.4f} chain {chain_share:.4f}; "
              f"wk_wv/query_out block {block_ratio:.4f} chain {chain_ratio:.4f}")
        assert block_ratio > chain_ratio and block_share > chain_share, (seed, block_ratio, chain_ratio)


def test_objective_and_default_block_size(tiny):
    """The trainer's objective: a block's positions and block_position_decay (default uniform);
    the default block drafts as far as the K-step chain (S = K + 1)."""
    from kvshot.train.variants import variant_config

    cfg = copy.deepcopy(tiny["cfg"])
    cfg["blockwise"] = {"variants": [{"name": "bk", "paradigm": "block", "context": "kv", "layers": 1}]}
    v = variant_config(typed(cfg), "bk")
    assert v.block_size == cfg["drafters"]["ttt_steps"] + 1

    class Fake:
        block_wise, positions = True, 7
    dcfg, own = typed(cfg).drafters, section(VariantSettings, {"position_decay": 0.8})
    assert objective(Fake(), dcfg) == (7, 1.0)
    assert objective(Fake(), replace(dcfg, block_position_decay=0.8)) == (7, 0.8)
    assert objective(Fake(), dcfg, own) == (7, 0.8)   # the variant's own wins
    assert objective(Fake(), replace(dcfg, block_position_decay=0.5), own) == (7, 0.8)
    assert objective(object(), dcfg) == (dcfg.ttt_steps, dcfg.step_decay)


# ---------------------------------------------------------------- the trainer

def block_cfg(tiny, **train) -> dict:
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["blockwise"] = {"variants": [{"name": "bk2", "paradigm": "block", "context": "kv", "layers": 2},
                                     {"name": "bh1", "paradigm": "block", "context": "hidden", "layers": 1}]}
    cfg["drafters"]["train"].update({"max_steps": 6, "ckpt_every": 2, "batch_size": 2, "max_len": 48,
                                     "eval_batches": 1, "eval_every": 3, "plateau": None, "log_every": 1,
                                     "lr": 3e-3, **train})
    return cfg


@pytest.mark.parametrize("name", ["bk2", "bh1"])
def test_trainer_runs_the_block_objective_and_resumes_bit_identically(tiny, tiny_features, tmp_path, monkeypatch,
                                                                     name):
    """The same trainer: a block variant trains on every block position (K = ttt_steps by
    default), logs the gradient groups and its own-key diagnostics, keeps the held-out curve,
    and a kill after the step-2 checkpoint resumes to the same weights."""
    import json

    from safetensors.torch import load_file

    import kvshot.train.loop as train_mod

    cfg = block_cfg(tiny)
    K = cfg["drafters"]["ttt_steps"]

    def run(out):
        return train_mod.train_variant(typed(cfg), tiny["rt"], name, str(tiny_features["train"]), str(tiny_features["eval"]),
                                       str(tiny["model"]), str(out))

    metrics = run(tmp_path / "whole")
    assert metrics["paradigm"] == "block" and metrics["steps"] == 6 and len(metrics["eval"]["loss"]) == K
    log = json.loads((tmp_path / "whole/train_log.json").read_text())
    assert len(log[0]["loss_k"]) == K and len(log[0]["acc_k"]) == K
    if name == "bk2":
        assert {"kv_wk_wv", "kv_query_out", "lm_head", "body"} <= set(log[-1]["grad_norm"])
        assert 0 < log[-1]["kv_key_share"] < 1 and len(log[-1]["kv_own_key_mass_k"]) == K
        assert 0 < log[-1]["kv_own_key_mass"] < 1
    else:   # reads no KV: the fused hidden context is its `fusion` group
        assert "fusion" in log[-1]["grad_norm"] and log[-1]["kv_key_share"] is None
    assert [p["step"] for p in metrics["heldout_curve"]] == [3, 6]
    config = json.loads((tmp_path / "whole/config.json").read_text())
    assert config["block_size"] == K + 1 and config["block_context"] == ("kv" if name == "bk2" else "hidden")

    die_at_call(monkeypatch, 4, KeyboardInterrupt)   # step 3: the checkpoint of step 2 exists, step 3 is lost
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    monkeypatch.undo()
    assert run(tmp_path / "resumed")["resumed_from"] == 2
    a, b = load_file(str(tmp_path / "whole/model.safetensors")), load_file(str(tmp_path / "resumed/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- step-wise evaluation

def drafted_alone(model, target, ids: torch.Tensor, t: int, aux_layers) -> list[int]:
    """The block after anchor t as a decoder drafts it: the target's context of ids[:t+1] only,
    one anchor row, one `draft_block` call; block position k's greedy token (target ids)."""
    from kvshot.capture.target import target_forward

    prefix = ids[None, : t + 1]
    out = target_forward(target, prefix, torch.ones_like(prefix), aux_layers, tuple(model.cfg.kv_layers))
    ctx = {"aux_hidden": out.aux_hidden}
    for l in model.cfg.kv_layers:
        ctx[f"key_{l}"], ctx[f"value_{l}"] = out.keys[l], out.values[l]
    state = model.begin(ctx, torch.arange(t + 1)[None])
    state.select_rows(slice(-1, None))
    h = model.draft_block(state, ids[None, t + 1: t + 2], torch.tensor([[t + 1]]))
    return model.d2t[model.logits(h[0, 0, 1:]).argmax(-1)].tolist()


@pytest.mark.parametrize("name", list(BLOCKS))
def test_stepwise_scores_block_position_k_as_chain_step_k(drafter_world, name):
    """chain_correct on a block drafter: every anchor's drafted tokens are its block's greedy
    tokens as a decoder drafts them alone, compared with the target's greedy tokens; chain
    acceptance stops at the first wrong position, and the summary has K = P steps."""
    from kvshot.evaluate.stepwise import chain_correct, stepwise
    from kvshot.stats.metrics import chain_counts

    src, target, _ = drafter_world
    model = make(drafter_world, name)
    aux = tuple(src.spec.aux_layers)
    seqs = [src.tokens(i)["input_ids"].long()[:40] for i in (0, 1)]
    items = [{"prompt": s[:16].tolist(), "continuation": s[16:].tolist()} for s in seqs]
    results = list(chain_correct(model, target, items, aux, P, batch_size=2, device="cpu"))
    checked = 0
    for seq, (rows, chain_ok, forced_ok) in zip(seqs, results):
        assert torch.equal(chain_ok, forced_ok)   # a block never reads its drafts
        greedy = target(seq[None]).logits[0].argmax(-1)
        for t, ok in zip(rows.tolist()[::5], chain_ok[::5]):
            want = greedy[t + 1: t + 1 + P].tolist()
            assert ok.tolist() == [a == b for a, b in zip(drafted_alone(model, target, seq, t, aux), want)]
            checked += 1
    assert checked >= 4
    result = stepwise(model, target, items, aux, P, 2, "cpu", bootstrap_samples=20)
    rounds, accepted = chain_counts(torch.cat([r[1] for r in results]))
    assert len(result["alpha"]) == P and result["rounds"] == [int(x) for x in rounds.tolist()]
    assert result["accepted"] == [int(x) for x in accepted.tolist()]


# ---------------------------------------------------------------- speculative decoding

PROMPTS = ((0, 12), (1, 20), (2, 30))   # (train sample, prompt tokens)


def prompt_of(src, i: int, n: int) -> torch.Tensor:
    return src.tokens(i)["input_ids"].long()[None, :n]


@pytest.fixture(scope="module")
def trained_blocks(drafter_world):
    """Each block variant after a few block-objective steps on the target's own greedy
    continuations of the test prompts (acceptance above zero, so that rounds accept drafts and
    the cache handling is exercised)."""
    from kvshot.capture.features import pad_batch
    from kvshot.capture.target import target_forward

    src, target, _ = drafter_world
    samples = []
    for i, n in PROMPTS:
        x = prompt_of(src, i, n)
        ids = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                              eos_token_id=None, pad_token_id=0)
        ctx = target_forward(target, ids, None, tuple(src.spec.aux_layers), tuple(src.spec.kv_layers))
        item = {"input_ids": ids[0], "loss_mask": (torch.arange(ids.shape[1]) >= n).long(),
                "aux_hidden": ctx.aux_hidden[0], "last_hidden": ctx.last_hidden[0]}
        for l in src.spec.kv_layers:
            item[f"key_{l}"], item[f"value_{l}"] = ctx.keys[l][0], ctx.values[l][0]
        samples.append(item)
    batch = pad_batch(samples)
    out = {}
    full_vocab = (src, target, torch.arange(target.config.vocab_size))   # the tiny target's greedy tokens are rare ones
    for name in BLOCKS:
        model = build_test_drafter(full_vocab, BLOCKS[name]).train()
        labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(60 if model.shared_mask else 20):   # one mask embedding for every slot learns slower
            weighted_loss(step_losses(model, block_unroll(model, batch), batch, labels)[0], 1.0).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = model.eval()
    return out


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_decoding_is_lossless_one_forward_per_round(drafter_world, trained_blocks, name):
    """Greedy speculative decoding with a block drafter (one draft_block per round, verified as
    a chain) gives exactly target.generate(do_sample=False)'s tokens; every round drafts the
    whole block; some drafts are accepted; trees are refused; sampling runs."""
    from kvshot.evaluate.decode import speculative_generate
    from kvshot.evaluate.draft_tree import DraftSpec

    src, target, _ = drafter_world
    model = trained_blocks[name]
    aux = tuple(src.spec.aux_layers)
    calls = {"n": 0}
    real = model.draft_block

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    model.draft_block = counted
    try:
        accepted = 0
        for i, n_prompt in PROMPTS:
            x = prompt_of(src, i, n_prompt)
            want = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
                                   eos_token_id=None, pad_token_id=0)[0, n_prompt:].tolist()
            calls["n"] = 0
            res = speculative_generate(target, model, x, 24, None, aux, DraftSpec(depth=P))
            assert res.tokens == want, f"{name}: prompt {i} diverges"
            assert calls["n"] == res.rounds and set(res.drafted) == {P}
            accepted += sum(res.accepted)
            # round 1 drafts from anchor n_prompt - 1 what the step-wise simulation drafts there, and
            # accepts its drafts up to the first that differs from the target's greedy text
            seq = torch.cat([x[0], torch.tensor(want)])
            first = drafted_alone(model, target, seq, n_prompt - 1, aux)
            agree = next((k for k, (a, b) in enumerate(zip(first, want[1:])) if a != b), P)
            assert res.accepted[0] == agree
        assert accepted > 0
        with pytest.raises(ValueError, match="chains only"):
            speculative_generate(target, model, x, 8, None, aux, DraftSpec(depth=P, topk=2))
        sampled = speculative_generate(target, model, x, 12, None, aux, DraftSpec(depth=P), temperature=0.8,
                                       generator=torch.Generator().manual_seed(0))
        assert len(sampled.tokens) == 12
    finally:
        del model.draft_block
