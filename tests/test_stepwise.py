"""Evaluation prompts (eval split and public suites through `datasets`) and chain rows."""
from __future__ import annotations

import json

from kvshot.data import render_chat
from kvshot.stepwise import chain_rows, eval_prompts, prompt_conversations
from kvshot.tokenizer import load_tokenizer


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
    convs = prompt_conversations(tiny["eval"], 10, [src])
    assert convs == [[{"role": "user", "content": f"Compose a travel blog post number {i}."}] for i in range(3)]
    tok = load_tokenizer(tiny["tokenizer"])
    assert tok.decode(eval_prompts(convs, tok, 1000)[0]).endswith("<|im_start|>assistant\n")


def test_chain_rows_leave_room_for_every_step():
    rows = chain_rows(prompt_len=10, length=30, steps=7)
    assert rows[0] == 9 and rows[-1] + 7 == 29   # position t + K exists, t >= last prompt token
    assert len(chain_rows(10, 15, 7)) == 0
