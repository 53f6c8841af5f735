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


def test_natural_anchors_lie_in_real_assistant_text_every_one_or_a_seeded_cap(tiny):
    from kvshot.data.chat import tokenize_conversation
    from kvshot.evaluate.branches import conversation_anchors

    convs = prompt_conversations(tiny["eval"], 100)
    tok = load_tokenizer(tiny["tokenizer"])
    every = conversation_anchors(convs, tok, None, 64, seed=3)
    assert [c["conversation"] for c in every] == list(range(len(convs)))   # none dropped, empty or not
    total = 0
    for c in every:
        ids, mask = tokenize_conversation(tok, convs[c["conversation"]], 65)
        candidates = [a for a in range(min(len(ids) - 1, 64)) if mask[a] and mask[a + 1]]
        assert c["anchors"] == candidates                                   # every candidate, in order
        assert c["ids"] == ids[: max(candidates, default=-2) + 2]           # up to the last anchor's next token
        total += len(candidates)
    capped = conversation_anchors(convs, tok, 12, 64, seed=3)
    assert sum(len(c["anchors"]) for c in capped) == 12 and capped == conversation_anchors(convs, tok, 12, 64, seed=3)
    assert capped != conversation_anchors(convs, tok, 12, 64, seed=4)
    assert all(set(c["anchors"]) <= set(e["anchors"]) for c, e in zip(capped, every))
    assert conversation_anchors(convs, tok, 10_000, 64, seed=0) == every   # a cap past the candidates: all of them
    assert total > 12


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


def test_natural_protocol_scores_every_anchor_in_one_pass_and_groups_conversations(tiny, tiny_features):
    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.evaluate.branches import branch_items, natural_conversations, rollout
    from kvshot.evaluate.natural import branch_repetition, scored_anchors
    from kvshot.evaluate.references import repetition_share
    from kvshot.evaluate.stepwise import natural_tallies, seeds_record
    from kvshot.train.variants import draft_vocab

    from .test_drafters import K, make

    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    tok = load_tokenizer(tiny["tokenizer"])
    convs = natural_conversations(target, tok, prompt_conversations(tiny["eval"], 100), None, 80, K + 1, 0, "cpu")
    nat = {"conversations": convs, "rollout_tokens": K + 1, "eos_id": tok.eos_token_id, "anchors": None}
    model = make((src, target, draft_vocab(src, 150, target.config.vocab_size)), "kv")
    tallies, repetition, extra = natural_tallies(nat, [model], target, src.spec.aux_layers, K, 3, "cpu", "float32",
                                                 "<natural>")
    result = seeds_record([None], tallies, repetition, K, 20, context_buckets=(32, 64))
    scored = {(c["conversation"], c["anchors"][i]) for c in convs for i in scored_anchors(c, K, K + 1, tok.eos_token_id)}
    assert result["rounds"][0] == result["anchors"] == len(scored) > 40          # one round per scored anchor
    panel = result["anchors_panel"]
    assert {(int(panel["sequences"][j]), t) for j, t in zip(panel["sequence"], panel["position"])} == scored
    assert result["sequences"] == len({c for c, _ in scored})                    # resampled by conversation
    assert sum(result["by_context"]["anchors"]) == len(scored)
    assert extra["natural_anchors"]["anchors"] == sum(len(c["anchors"]) for c in convs)
    assert extra["natural_anchors"]["ended_within_k"] == extra["natural_anchors"]["anchors"] - len(scored)
    # the repetition share without rescanning each prefix: as repetition_share over the per-anchor items
    items = [it | {"continuation": rollout(it["continuation"], K + 1, tok.eos_token_id)}
             for c in convs for it in branch_items(c)]
    assert repetition == branch_repetition(convs, K + 1, tok.eos_token_id) == repetition_share(items)
    assert 0 <= repetition["share"] <= 1 and repetition["tokens"] == sum(len(it["continuation"]) for it in items)


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
