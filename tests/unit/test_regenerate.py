"""The regenerate_data stage: the target's own answers replace the training answers, batched
generation equals one-at-a-time generation, and the stage's CLI writes a readable split."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvshot.capture.regenerate import regenerate_conversations
from kvshot.capture.target import load_target
from kvshot.config import fill_defaults
from kvshot.data.chat import encode_prompt
from kvshot.data.sources import read_jsonl
from kvshot.data.tokenizer import load_tokenizer
from ..conftest import section
from kvshot.settings import ArchSettings, RegenerateSettings

# data.regenerate as the stage gets it: the schema's defaults filled in
SETTINGS = fill_defaults({"data": {"regenerate": {"max_new_tokens": 12, "batch_size": 3}}})["data"]["regenerate"]


@pytest.fixture(scope="module")
def random_target(tiny, tmp_path_factory):
    """A target folder like the target stage's, with random weights (the fixture's 3-step
    target only says newlines; untied, so it does not echo its last token): varied greedy
    text, rarely an early eos."""
    import shutil

    from kvshot.capture.target import META_FILE, build_target

    tok = load_tokenizer(tiny["model"])
    torch.manual_seed(0)
    model = build_target(section(ArchSettings, {**tiny["cfg"]["target"]["arch"], "tie_word_embeddings": False}), len(tok), tok.pad_token_id)
    folder = tmp_path_factory.mktemp("random_target")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    shutil.copy(tiny["model"] / META_FILE, folder / META_FILE)
    return folder


@pytest.fixture(scope="module")
def setup(tiny, random_target):
    rt = dataclasses.replace(tiny["rt"], device="cpu", dtype="float32")
    target = load_target(random_target, rt, attn="sdpa")
    tok = load_tokenizer(random_target)
    convs = read_jsonl(tiny["train"])[:7]
    return target, tok, convs


def greedy_answer(target, tok, messages: list[dict], max_new: int) -> list[int]:
    x = torch.tensor([encode_prompt(tok, messages)])
    g = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, x.shape[1]:].tolist()
    return g[: g.index(tok.eos_token_id)] if tok.eos_token_id in g else g


def test_answers_are_the_targets_and_batching_changes_nothing(setup):
    target, tok, convs = setup
    assert len({len(encode_prompt(tok, c["messages"][:1])) for c in convs}) > 1   # padding is exercised
    batched, stats = regenerate_conversations(target, tok, convs, section(RegenerateSettings, SETTINGS))
    single, _ = regenerate_conversations(target, tok, convs, section(RegenerateSettings, {**SETTINGS, "batch_size": 1}))
    assert batched == single
    assert [c["id"] for c in batched] == [c["id"] for c in convs][: len(batched)]
    for old, new in zip(convs, batched):
        assert [m for m in new["messages"] if m["role"] != "assistant"] == \
            [m for m in old["messages"] if m["role"] != "assistant"][: sum(m["role"] == "user" for m in new["messages"])]
        # each answer is the target's greedy text for the rewritten conversation so far
        for i, m in enumerate(new["messages"]):
            if m["role"] == "assistant":
                ids = greedy_answer(target, tok, new["messages"][:i], SETTINGS["max_new_tokens"])
                assert m["content"] == tok.decode(ids, skip_special_tokens=True)
    assert stats["answers"] == sum(m["role"] == "assistant" for c in batched for m in c["messages"])
    assert stats["conversations"] == 7 and stats["answers"] > 7   # several multi-turn conversations
    assert 0 < stats["tokens"] <= stats["answers"] * SETTINGS["max_new_tokens"]


def test_max_turns_and_sampling(setup):
    target, tok, convs = setup
    first, _ = regenerate_conversations(target, tok, convs, section(RegenerateSettings, {**SETTINGS, "max_turns": 1}))
    assert all(len(c["messages"]) == 2 and c["messages"][1]["role"] == "assistant" for c in first)
    torch.manual_seed(0)
    a, _ = regenerate_conversations(target, tok, convs[:3], section(RegenerateSettings, {**SETTINGS, "temperature": 1.5, "max_turns": 1}))
    torch.manual_seed(0)
    b, _ = regenerate_conversations(target, tok, convs[:3], section(RegenerateSettings, {**SETTINGS, "temperature": 1.5, "max_turns": 1}))
    assert a == b and a != first[:3]


def test_cli_writes_the_regenerated_split(tiny, random_target, tmp_path):
    from kvshot.__main__ import main

    cfg = {**tiny["cfg"], "device": "cpu", "dtype": "float32"}
    cfg["data"] = {**cfg["data"], "regenerate": {"enabled": True, "max_new_tokens": 6, "batch_size": 4,
                                                  "max_turns": 2}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = tmp_path / "regenerated" / "train.jsonl"
    assert main(["regenerate-data", "--config", str(tmp_path / "cfg.json"), "--train", str(tiny["train"]),
                 "--target", str(random_target), "--out", str(out)]) == 0
    rows = read_jsonl(out)
    stats = json.loads((out.parent / "stats.json").read_text())
    assert len(rows) == stats["written"] == 40 - stats["dropped"]
    assert stats["settings"]["max_new_tokens"] == 6 and stats["conversations"] == 40
    assert all(sum(m["role"] == "assistant" for m in r["messages"]) <= 2 for r in rows)
