"""kvshot's eagle3 drafter (hidden-only, one Llama-style layer: qk_norm false) against an
independent, plainly written EAGLE-3 test-time-training reference: logits, loss, gradients.

The reference follows EAGLE-3's training math (SafeAILab/EAGLE, eagle/traineagle3/cnets.py),
written out here as a loop over the 7 steps:
  - the carried state starts as fc([low; mid; high] target hidden states) at every position;
  - step k reads token x_{t+k+1} at row t, normalizes embedding and state separately,
    concatenates them [emb; state] and runs one decoder layer (residual: the state);
  - attention at step k: the step-0 keys of positions <= t (a causal, padding-masked cache
    shared by all steps) plus, one score each, the row's own keys of steps 1..k (the diagonal);
  - RoPE at position t + k, as upstream (kvshot uses t + k + 1: RoPE sees only differences);
  - the loss of step k: soft cross-entropy to the target's softmax over the draft vocabulary at
    position t+k+1, on tokens x_{t+k+2} that are assistant tokens whose target argmax is in the
    draft vocabulary, averaged over them, weighted 0.8^k.
Nothing of kvshot's code is used to compute it; it reads the drafter's parameters by name.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvshot.drafters import DrafterConfig, build_drafter
from kvshot.drafters.unroll import TTTUnroll, unroll
from kvshot.train.objective import step_losses, target_labels, weighted_loss

STEPS, DECAY = 7, 0.8
B, T, H, HQ, HKV, D, I, V, N = 2, 12, 32, 4, 2, 8, 48, 60, 24
EPS, THETA = 1e-6, 10000.0


# ---------------------------------------------------------------- the reference

def rms_norm(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate(x, positions):
    """RoPE on x [B, heads, T, D] at positions [T]: each pair (x_i, x_{i+D/2}) turned by
    position * THETA^(-2i/D)."""
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * THETA ** (-2.0 * torch.arange(half).double() / x.shape[-1])
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ahead(x, n):
    """x[:, t + n] at row t, zero past the end."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def heads(x, n):
    return x.view(B, T, n, D).transpose(1, 2)


def reference_logits(p: dict, aux, ids, key_valid, fc_norm: bool = False, norm_output: bool = False):
    """Per step [B, T, N]: the EAGLE-3 TTT unroll, step by step with a per-step key cache.
    EAGLE-3.1's switches (speculators' Eagle3DraftModel, models/eagle3/core.py): fc_norm, each
    aux state RMS-normed by its own weight before fc; norm_output, the final norm's output is
    the state the next step reads (the head reads it as is: normed once)."""
    if fc_norm:
        aux = torch.stack([rms_norm(aux[..., i, :], p[f"fc_norm.{i}.weight"]) for i in range(aux.shape[-2])], -2)
    state = aux.flatten(-2) @ p["fc.weight"].T
    keys, values = [], []                                  # one entry per step: [B, HQ, T, D]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    seen = causal & key_valid[:, None, None, :].bool()     # step-0 keys: position <= t, not padding
    seen = seen | torch.eye(T, dtype=torch.bool)           # padded rows see themselves (never scored)
    out = []
    for k in range(STEPS):
        token = ahead(ids, k + 1)
        positions = torch.arange(T) + k
        x = torch.cat([rms_norm(p["embed_tokens.weight"][token], p["input_norm.weight"]),
                       rms_norm(state, p["hidden_norm.weight"])], dim=-1)
        q = rotate(heads(x @ p["layers.0.self_attn.q_proj.weight"].T, HQ), positions)
        key = rotate(heads(x @ p["layers.0.self_attn.k_proj.weight"].T, HKV), positions)
        value = heads(x @ p["layers.0.self_attn.v_proj.weight"].T, HKV)
        keys.append(key.repeat_interleave(HQ // HKV, dim=1))      # query head j reads kv head j // group
        values.append(value.repeat_interleave(HQ // HKV, dim=1))
        scores = [(q @ keys[0].transpose(-1, -2) / math.sqrt(D)).masked_fill(~seen, float("-inf"))]
        for j in range(1, k + 1):                                  # the diagonal: the row's own step-j key
            scores.append((q * keys[j]).sum(-1, keepdim=True) / math.sqrt(D))
        weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        attended = weights[..., :T] @ values[0]
        for j in range(1, k + 1):
            attended = attended + weights[..., T + j - 1: T + j] * values[j]
        state = state + attended.transpose(1, 2).reshape(B, T, HQ * D) @ p["layers.0.self_attn.o_proj.weight"].T
        y = rms_norm(state, p["layers.0.mlp_norm.weight"])
        gate, up = y @ p["layers.0.mlp.gate_proj.weight"].T, y @ p["layers.0.mlp.up_proj.weight"].T
        state = state + (F.silu(gate) * up) @ p["layers.0.mlp.down_proj.weight"].T
        if norm_output:
            state = rms_norm(state, p["norm.weight"])
            out.append(state @ p["lm_head.weight"].T)
        else:
            out.append(rms_norm(state, p["norm.weight"]) @ p["lm_head.weight"].T)
    return out


def reference_loss(logits, target_logits, t2d, assistant):
    total = 0.0
    for k, lg in enumerate(logits):
        target = ahead(target_logits, k + 1)                     # the target's view of x_{t+k+2}
        probs = torch.softmax(target[..., t2d], dim=-1)          # over the draft vocabulary
        scored = ahead(assistant, k + 2) & t2d[target.argmax(-1)]
        ce = -(probs * torch.log_softmax(lg, dim=-1)).sum(-1)
        total = total + DECAY ** k * torch.where(scored, ce, 0.0).sum() / scored.sum().clamp(min=1)
    return total


# ---------------------------------------------------------------- kvshot against it

def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attention = torch.ones(B, T, dtype=torch.long)
    attention[1, -3:] = 0                                    # a right-padded row, as batches are
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long()
    aux = torch.randn(B, T, 3, H, generator=g)
    last_hidden = torch.randn(B, T, H, generator=g)
    head = torch.randn(V, H, generator=g)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "aux_hidden": aux}, last_hidden, head


def drafter(qk_norm: bool = False, seed: int = 0, **switches):
    cfg = DrafterConfig(paradigm="hidden", hidden_size=H, num_layers=1, num_attention_heads=HQ, num_key_value_heads=HKV,
                        head_dim=D, intermediate_size=I, vocab_size=V, draft_vocab_size=N, rope_theta=THETA,
                        rms_norm_eps=EPS, qk_norm=qk_norm, **switches)
    torch.manual_seed(seed)
    model = build_drafter(cfg)
    d2t = torch.sort(torch.randperm(V)[:N]).values
    model.set_vocab(torch.randn(V, H), d2t)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    return model


def reference_parameters(model):
    return {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["every-anchor", "labelled-anchors-packed"])
def test_eagle3_unroll_matches_the_reference(packed):
    batch, last_hidden, head = inputs()
    model = drafter()
    params = reference_parameters(model)
    theirs = reference_logits(params, batch["aux_hidden"], batch["input_ids"], batch["attention_mask"])
    assistant = (batch["loss_mask"] & batch["attention_mask"]).bool()
    ref_loss = reference_loss(theirs, last_hidden @ head.T, model.t2d, assistant)
    ref_grads = torch.autograd.grad(ref_loss, [t for t in params.values() if t.requires_grad])

    un = TTTUnroll(model)(batch, STEPS) if packed else unroll(model, batch, STEPS)   # the trainer's packed path
    losses, *_ = step_losses(model, un, batch, target_labels(last_hidden, head, model.d2t))
    loss = weighted_loss(losses, DECAY)
    loss.backward()
    if not packed:   # logits of every real (non-padding) anchor row, every step
        real = batch["attention_mask"].bool()
        for k in range(STEPS):
            torch.testing.assert_close(un.logits[k][real], theirs[k][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    names = [n for n, t in params.items() if t.requires_grad]
    for name, ref in zip(names, ref_grads):
        got = dict(model.named_parameters())[name].grad
        assert ref.abs().max() > 0, f"{name}: the reference gives it no gradient"
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_the_qwen3_style_layer_is_not_eagle3():
    """With q/k norm (the Qwen3 layer) the same weights give other logits: the reference sees it."""
    batch, _, _ = inputs()
    faithful, qwen3 = drafter(False), drafter(True)
    state = {n: t for n, t in faithful.state_dict().items()}
    qwen3.load_state_dict(state, strict=False)   # same weights, plus q/k norm (weights 1 + noise)
    theirs = reference_logits(reference_parameters(faithful), batch["aux_hidden"], batch["input_ids"],
                              batch["attention_mask"])
    with torch.no_grad():
        ours = unroll(qwen3, batch, STEPS).logits
    real = batch["attention_mask"].bool()
    assert (ours[0][real] - theirs[0][real]).abs().max() > 1e-3
