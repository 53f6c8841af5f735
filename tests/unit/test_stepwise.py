"""Evaluation prompts (eval split and public suites through `datasets`) and chain rows."""
from __future__ import annotations

import json

import pytest

from kvshot.data.chat import render_chat
from kvshot.data.tokenizer import load_tokenizer
from kvshot.evaluate.references import eval_prompts, prompt_conversations
from kvshot.evaluate.stepwise import chain_rows
from ..conftest import section
from kvshot.settings import NaturalSettings, PromptSource, VariantSettings


def test_prompts_from_the_eval_split_stop_at_the_first_answer(tiny):
    convs = prompt_conversations(tiny["eval"], 3)
    tok = load_tokenizer(tiny["tokenizer"])
    prompts = eval_prompts(convs, tok, 1000)
    first = convs[0][: next(i for i, m in enumerate(convs[0]) if m["role"] == "assistant")]
    assert tok.decode(prompts[0]) == render_chat(first, add_generation_prompt=True)
    assert len(eval_prompts(convs, tok, 5)[0]) == 5      # long prompts keep their end


def test_mt_bench_prompts_through_datasets(tmp_path, tiny, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt_id": 81 + i, "category": "writing", "reference": [],
             "prompt": [f"Compose a travel blog post number {i}.", "Rewrite it."]} for i in range(3)]
    rows.append({"prompt_id": 99, "category": "x", "reference": [], "prompt": ["   ", "y"]})   # empty: skipped
    path = tmp_path / "mt_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = {"kind": "hub", "name": "HuggingFaceH4/mt_bench_prompts", "split": "train", "schema": "mtbench",
           "data_files": str(path)}
    convs = prompt_conversations(tiny["eval"], 10, section(PromptSource, [src]))
    assert convs == [[{"role": "user", "content": f"Compose a travel blog post number {i}."}] for i in range(3)]
    tok = load_tokenizer(tiny["tokenizer"])
    assert tok.decode(eval_prompts(convs, tok, 1000)[0]).endswith("<|im_start|>assistant\n")


def test_chain_rows_leave_room_for_every_step():
    rows = chain_rows(prompt_len=10, length=30, steps=7)
    assert rows[0] == 9 and rows[-1] + 7 == 29   # position t + K exists, t >= last prompt token
    assert len(chain_rows(10, 15, 7)) == 0


# ---------------------------------------------------------------- the natural-text protocol

def test_repetition_share_counts_tokens_that_complete_an_earlier_4gram():
    from kvshot.evaluate.references import repetition_share

    # prompt 1 2 3 4; continuation 1 2 3 4 5: "4" completes (1,2,3,4), seen in the prompt; 1,2,3 and 5 do not
    got = repetition_share([{"prompt": [1, 2, 3, 4], "continuation": [1, 2, 3, 4, 5]}])
    assert (got["repeated"], got["tokens"]) == (1, 5) and got["share"] == pytest.approx(0.2)
    loop = repetition_share([{"prompt": [9], "continuation": [7, 8] * 10}])
    assert loop["repeated"] == 20 - 5                       # from the 6th token on, every 4-gram is a repeat
    assert repetition_share([{"prompt": [], "continuation": list(range(30))}])["share"] == 0.0


def test_natural_anchors_lie_in_real_assistant_text_and_are_seeded(tiny):
    from kvshot.data.chat import tokenize_conversation
    from kvshot.evaluate.references import natural_anchors

    convs = prompt_conversations(tiny["eval"], 100)
    tok = load_tokenizer(tiny["tokenizer"])
    items = natural_anchors(convs, tok, 12, 64, seed=3)
    assert len(items) == 12 and items == natural_anchors(convs, tok, 12, 64, seed=3)
    assert items != natural_anchors(convs, tok, 12, 64, seed=4)
    for it in items:
        ids, mask = tokenize_conversation(tok, convs[it["conversation"]], 1000)
        a = len(it["prompt"]) - 1
        assert it["prompt"] == ids[: a + 1] and len(it["prompt"]) <= 64
        assert mask[a] == 1 and mask[a + 1] == 1         # inside an answer, with real text after it
    assert len(natural_anchors(convs, tok, 10_000, 64, seed=0)) < 10_000   # all candidates, no more


def test_batched_rollouts_equal_one_prompt_at_a_time(tiny):
    import torch

    from kvshot.capture.target import load_target
    from kvshot.evaluate.references import greedy_rollouts, natural_anchors

    target = load_target(tiny["model"], tiny["rt"])
    tok = load_tokenizer(tiny["tokenizer"])
    prompts = [it["prompt"] for it in natural_anchors(prompt_conversations(tiny["eval"], 100), tok, 6, 80, seed=1)]
    assert len({len(p) for p in prompts}) > 1                                  # padding is exercised
    batched = greedy_rollouts(target, prompts, 8, tok.eos_token_id, tok.pad_token_id, "cpu", batch_size=6)
    for p, got in zip(prompts, batched):
        x = torch.tensor([p])
        one = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert got == one and 1 <= len(got) <= 8


def test_item_rows_take_an_items_own_anchors():
    from kvshot.evaluate.stepwise import item_rows

    assert item_rows({"prompt": [0] * 10, "continuation": [0] * 8, "anchors": [9]}, 7) == [9]
    assert item_rows({"prompt": [0] * 10, "continuation": [0] * 6, "anchors": [9]}, 7) == []   # ended early (EOS)
    assert item_rows({"prompt": [0] * 10, "continuation": [0] * 20}, 7) == list(chain_rows(10, 30, 7))


def test_alpha_by_context_length_buckets():
    import torch

    from kvshot.evaluate.stepwise import by_context

    contexts = torch.tensor([10, 127, 128, 300, 600, 700])
    correct = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1], [0, 0]], dtype=torch.bool)
    got = by_context(contexts, correct, [128, 256, 512])
    assert got["labels"] == ["<128", "128-256", "256-512", ">=512"] and got["anchors"] == [2, 1, 1, 2]
    assert got["rounds"][0] == [2, 2] and got["accepted"][0] == [2, 1] and got["alpha"][0] == [1.0, 0.5]
    assert got["alpha"][1] == [0.0, None] and got["alpha_jeffreys_ci"][1][1] is None   # step 1 never reached
    assert got["alpha"][3] == [0.5, 1.0]


def test_stepwise_on_natural_items_scores_one_anchor_each_and_groups_conversations(tiny, tiny_features):
    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.evaluate.references import natural_items
    from kvshot.evaluate.stepwise import stepwise

    from .test_drafters import K, make

    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    tok = load_tokenizer(tiny["tokenizer"])
    ncfg = {"anchors": 20, "max_prefix_len": 80, "rollout_tokens": K + 1, "batch_size": 8}
    items = natural_items(target, tok, prompt_conversations(tiny["eval"], 100), section(NaturalSettings, ncfg), 0, "cpu")
    assert len(items) == 20 and all(it["anchors"] == [len(it["prompt"]) - 1] for it in items)
    from kvshot.train.variants import draft_vocab

    model = make((src, target, draft_vocab(src, 150, target.config.vocab_size)), "kv")
    result = stepwise(model, target, items, src.spec.aux_layers, K, 8, "cpu", bootstrap_samples=20,
                      context_buckets=[32, 64])
    scored = [it for it in items if len(it["continuation"]) >= K]
    assert result["rounds"][0] == result["anchors"] == len(scored)            # one round per anchor
    assert result["sequences"] == len({it["conversation"] for it in scored})  # resampled by conversation
    assert sum(result["by_context"]["anchors"]) == len(scored)
    assert [sum(r[0] for r in result["by_context"]["rounds"])] == [result["rounds"][0]]
    assert 0 <= result["repetition"]["share"] <= 1 and result["repetition"]["tokens"] == sum(
        len(it["continuation"]) for it in items)


@pytest.mark.parametrize("paradigm", ["hidden", "kv", "hybrid", "standalone"])
def test_drafting_from_chosen_anchors_equals_the_full_unroll(tiny, tiny_features, paradigm):
    """The natural protocol drafts from one anchor per sequence (`unroll(anchor_rows=...)`):
    the same logits, chain and teacher-forced, as drafting from every anchor."""
    import torch

    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.drafters.unroll import unroll
    from kvshot.train.variants import build_variant, draft_vocab

    from .test_drafters import K, VARIANTS

    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    torch.manual_seed(0)
    spec = VARIANTS.get(paradigm) or {"name": "s", "paradigm": "standalone", "layers": 1}
    model = build_variant(section(VariantSettings, spec), target.config, target.model.embed_tokens.weight.detach(),
                          draft_vocab(src, 150, target.config.vocab_size)).eval()
    batch = src.batch([0, 1, 2])
    width = batch["input_ids"].shape[1]
    lengths = batch["attention_mask"].sum(1).tolist()
    anchors = [length // 2 - b for b, length in enumerate(lengths)]
    only = torch.tensor([b * width + a for b, a in enumerate(anchors)])
    with torch.no_grad():
        for own in (True, False):
            full = unroll(model, batch, K, own_tokens=own)
            some = unroll(model, batch, K, own_tokens=own, anchor_rows=only)
            for k in range(K):
                got = some.logits[k][0] if some.rows and some.rows[k] is not None else some.logits[k][range(3), anchors]
                torch.testing.assert_close(got, full.step_logits(k)[range(3), anchors], rtol=1e-4, atol=1e-5)
