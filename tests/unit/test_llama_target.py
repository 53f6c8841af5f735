"""A Llama target (no q/k norm, 3 KV heads, tied embeddings: SmolLM2's family) through
every stage the Qwen3 one goes through: the target stage, capture, the aux-layer rule,
the TTT trainer, step-wise evaluation and lossless speculative decoding (chain and tree)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from kvshot.capture.features import open_features
from kvshot.capture.target import has_qk_norm, load_target, target_forward, target_queries
from kvshot.core.taps import default_aux_layers
from kvshot.data.sources import read_jsonl
from kvshot.evaluate.decode import speculative_generate
from kvshot.train.loop import train_variant
from kvshot.train.variants import build_variant, draft_vocab

from ..conftest import LLAMA_ARCH
from .test_decode import CHAIN, TREE, K, distill_batch, prompts_of, train_quick, trained_target
from .test_train import small_cfg
from ..conftest import typed, section
from kvshot.settings import VariantSettings

VARIANTS = {
    "hidden-1": {"name": "h1", "paradigm": "hidden", "layers": 1},
    "kv-2": {"name": "k2", "paradigm": "kv", "layers": 2},
    "hybrid-1": {"name": "y1", "paradigm": "hybrid", "layers": 1},
    "standalone-2": {"name": "s2", "paradigm": "standalone", "layers": 2},
}
MAX_NEW = 20


def test_aux_rule_on_smollm2_depth():
    """30 layers (SmolLM2-135M): low, middle and a high tap near the top, as on Qwen3-8B."""
    assert default_aux_layers(30, "eagle3") == (2, 15, 27)
    assert default_aux_layers(30, "relative") == (2, 15, 28)


def test_llama_target_stage_and_capture(tiny_llama, tiny_llama_features):
    target = load_target(tiny_llama["model"], tiny_llama["rt"], attn="sdpa")
    assert isinstance(target, LlamaForCausalLM) and not has_qk_norm(target.config)
    assert not hasattr(target.model.layers[0].self_attn, "q_norm")
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()   # tied
    metrics = json.loads(tiny_llama["metrics"].read_text())
    assert metrics["num_hidden_layers"] == 6 and metrics["num_key_value_heads"] == 3 and metrics["head_dim"] == 16
    src = open_features(tiny_llama_features["train"])
    assert src.index["num_key_value_heads"] == 3 and src.index["hidden_size"] == LLAMA_ARCH["hidden_size"]
    s = src.sample(0)
    x = s["input_ids"].long()[None]
    ctx = target_forward(target, x, None, src.spec.aux_layers, src.spec.kv_layers)
    top = max(src.spec.kv_layers)
    assert s[f"key_{top}"].shape == (x.shape[1], 3, 16)
    torch.testing.assert_close(s[f"key_{top}"], ctx.keys[top][0].to(s[f"key_{top}"].dtype))   # post-RoPE cache keys
    # the target's queries (no q-norm): q_proj's output per head, what the query diagnostics compare
    q = target_queries(target, x, None, [top])[top]
    assert q.shape == (1, 6, x.shape[1], 16)
    attn = target.model.layers[top].self_attn
    captured = {}
    h = attn.q_proj.register_forward_hook(lambda _m, i, o: captured.setdefault("q", o))
    target.model(input_ids=x)
    h.remove()
    torch.testing.assert_close(q, captured["q"].view(1, x.shape[1], 6, 16).transpose(1, 2))


@pytest.mark.parametrize("name", ["hyb", "kv2", "sa"])
def test_trainer_on_a_llama_target(tiny_llama, tiny_llama_features, tmp_path, name):
    """The real trainer (a few steps); its KV drafters read the target's top layers, and
    every drafter layer is the target's family (no q/k norm)."""
    cfg = small_cfg(tiny_llama, max_steps=4, ckpt_every=100, log_every=1)
    train_variant(typed(cfg), tiny_llama["rt"], name, str(tiny_llama_features["train"]), str(tiny_llama_features["eval"]),
                  str(tiny_llama["model"]), str(tmp_path / "out"))
    log = json.loads((tmp_path / "out/train_log.json").read_text())
    assert len(log) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    dcfg = json.loads((tmp_path / "out/config.json").read_text())
    assert dcfg["qk_norm"] is False
    if name == "kv2":
        assert dcfg["kv_layers"] == [4, 5]


def test_block_dflash_has_qwen3_layers_on_a_llama_target(tiny_llama):
    """vLLM serves DFlash drafters with Qwen3 layers (q/k norm) whatever the target: block-dflash
    keeps them on a Llama target, where the other paradigms take the target's family."""
    target = load_target(tiny_llama["model"], tiny_llama["rt"], attn="sdpa")
    embed, d2t = target.model.embed_tokens.weight.detach(), torch.arange(target.config.vocab_size)
    entry = {"name": "bd", "paradigm": "block", "context": "dflash", "layers": 1, "block_size": 4}
    assert build_variant(section(VariantSettings, entry), target.config, embed, d2t).cfg.qk_norm is True
    assert build_variant(section(VariantSettings, {**entry, "context": "hidden"}), target.config, embed, d2t).cfg.qk_norm is False
    assert build_variant(section(VariantSettings, {**entry, "qk_norm": False}), target.config, embed, d2t).cfg.qk_norm is False


@pytest.fixture(scope="module")
def world(tiny_llama, tiny_llama_features):
    """As test_decode's world, on the Llama target: pretrained further, briefly trained drafters."""
    tok, target = trained_target(tiny_llama)
    src = open_features(tiny_llama_features["train"])
    aux, n_layers = tuple(src.spec.aux_layers), target.config.num_hidden_layers
    d2t = draft_vocab(src, 150, target.config.vocab_size)
    evals = read_jsonl(tiny_llama["eval"])
    prompts = prompts_of(evals[:4], tok, False) + prompts_of(evals[4:6], tok, True)
    seqs = []
    for p in prompts:
        x = torch.tensor([p])
        g = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                            eos_token_id=None, pad_token_id=tok.pad_token_id)
        seqs.append((g[0].tolist(), len(p)))
    batch = distill_batch(target, seqs, aux, tuple(range(n_layers)))
    drafters = {}
    for i, (name, v) in enumerate(VARIANTS.items()):
        torch.manual_seed(i)
        model = build_variant(section(VariantSettings, v), target.config, target.model.embed_tokens.weight.detach(), d2t, target)
        assert model.cfg.qk_norm is False
        drafters[name] = train_quick(model, batch, target.lm_head.weight.detach(), steps=24, lr=1.2e-2)
    refs = []
    for p in prompts:
        x = torch.tensor([p])
        g = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW + K + 2,
                            eos_token_id=None, pad_token_id=tok.pad_token_id)
        refs.append(g[0, x.shape[1]:].tolist())
    return {"tok": tok, "target": target, "aux": aux, "prompts": prompts, "drafters": drafters, "refs": refs,
            "batch": batch, "d2t": d2t}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_greedy_decoding_is_lossless_and_agrees_with_stepwise(world, variant):
    """Chain and tree speculative decoding give the target's own greedy tokens (no eos stop),
    and the step-wise evaluator predicts every chain round's accepted length."""
    from kvshot.evaluate.stepwise import chain_correct

    drafter, target = world["drafters"][variant], world["target"]
    accepted = []
    for spec in (CHAIN, TREE):
        for i, p in enumerate(world["prompts"]):
            res = speculative_generate(target, drafter, torch.tensor([p]), MAX_NEW, None, world["aux"], spec)
            assert res.tokens == world["refs"][i][:MAX_NEW], (variant, spec.topk, i)
            if spec is CHAIN:
                accepted.append(res.accepted)
    # drafts are accepted (else the test would hide the accept path's bugs); a 6-layer target
    # trained 150 steps and drafters trained 24 do not always reach 2 tokens in one round
    assert sum(map(sum, accepted)) >= 3, f"{variant}: drafts are hardly accepted; the test would hide bugs"
    items = [{"prompt": p, "continuation": world["refs"][i]} for i, p in enumerate(world["prompts"])]
    compared = 0
    for i, (rows, chain_ok, _) in enumerate(chain_correct(drafter, target, items, world["aux"], K, 2, "cpu")):
        by_anchor = dict(zip(rows.tolist(), torch.cumprod(chain_ok.long(), dim=1).sum(1).tolist()))
        t = len(world["prompts"][i]) - 1
        for acc in accepted[i]:
            if t in by_anchor:
                assert acc == by_anchor[t], (variant, i, t)
                compared += 1
            t += acc + 1
    assert compared >= 10


@torch.no_grad()
def test_standalone_on_llama_is_a_llama_lm(tiny_llama, tiny_llama_features):
    """The standalone LM of a Llama target starts from its layers (no q/k norm to find) and
    converts to a LlamaForCausalLM whose logits equal every unroll step."""
    from kvshot.drafters.standalone import to_hf
    from kvshot.drafters.unroll import unroll

    target = load_target(tiny_llama["model"], tiny_llama["rt"], attn="eager")
    v = {"name": "s", "paradigm": "standalone", "layers": 2}
    model = build_variant(section(VariantSettings, v), target.config, target.model.embed_tokens.weight.detach(), torch.arange(10), target).eval()
    assert model.cfg.qk_norm is False
    torch.testing.assert_close(model.layers[1].self_attn.k_proj.weight, target.model.layers[1].self_attn.k_proj.weight)
    hf = to_hf(model, attn_implementation="eager")
    assert isinstance(hf, LlamaForCausalLM)
    ids = open_features(tiny_llama_features["train"]).batch([0])["input_ids"][:, :40].long()
    ref = hf(ids).logits
    un = unroll(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}, K)
    for k in range(K):
        torch.testing.assert_close(un.step_logits(k)[:, : ids.shape[1] - k - 1], ref[:, k + 1:], atol=1e-5, rtol=0)


def test_natural_one_pass_equals_the_per_anchor_protocol_on_a_llama_target(world, tiny_llama):
    """As tests/unit/test_decode.py checks it on the Qwen3 target: the branches equal generate's
    rollouts, and every paradigm's chain lengths and teacher-forced rows equal the per-anchor
    protocol's (block-wise drafters trained as there)."""
    from .test_decode import BLOCKS, train_block
    from tests.natural_equivalence import both_ways, disagreements, natural_world, rollouts_match

    convs = [c["messages"] for c in read_jsonl(tiny_llama["eval"])]
    nat = natural_world(world["target"], world["tok"], convs, K)
    assert rollouts_match(nat) == 0
    drafters = dict(world["drafters"]) | {n: train_block(world, v, 10 + i, steps=64) for i, (n, v) in enumerate(BLOCKS.items())}
    ref, new = both_ways(world["target"], list(drafters.values()), world["aux"], K, nat)
    for name, r, n in zip(drafters, ref, new):
        assert len(r) >= 20   # of 48: the rest end at EOS within K tokens
        assert disagreements(r, n) == 0, (name, disagreements(r, n), len(r))
        # some drafted tokens are the target's (else equal rows would hide bugs); block drafters trained
        # 64 steps on this target are right at some positions, if rarely at step 0
        assert sum(sum(row) for _, row in r.values()) >= 3, f"{name}: drafts are hardly ever right"
