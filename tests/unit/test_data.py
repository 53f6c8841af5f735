"""Tests for kvshot.data: streaming ShareGPT parser, hub loaders (sources), the split, chat format, tokenization."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvshot.core.io import DataError
from kvshot.data import sources as data
from kvshot.data import split
from kvshot.data.chat import CHAT_TEMPLATE, IM_END, render_chat, tokenize_conversation
from kvshot.data.sources import (LoadStats, iter_hub_dataset, iter_sharegpt_file, load_sources, normalize_record,
                                 read_jsonl, sharegpt_package_path)
from kvshot.data.split import prepare_data, split_conversations
from ..conftest import section
from kvshot.settings import DataSource


def sg(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"r{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


GOOD = [sg(i, ("human", f"question {i} caf\u00e9 \u4e2d\u6587 \U0001f600"), ("gpt", f"answer {i}"))
        for i in range(5)]


def write_array(path: Path, records: list, tail: bytes = b"\n]\n") -> Path:
    # Pretty-printed like the real file, so records span many lines and chunks.
    body = ",\n".join(json.dumps(r, indent=2, ensure_ascii=False) for r in records)
    path.write_bytes(b"[\n" + body.encode("utf-8") + tail)
    return path


def parse(path: Path, **kw) -> tuple[list, LoadStats]:
    stats = LoadStats(str(path))
    return list(iter_sharegpt_file(path, stats, **kw)), stats


# ---------------------------------------------------------------- normalize_record

@pytest.mark.parametrize("record,reason", [
    ({"id": "x"}, "missing_field"),
    ({"conversations": [{"from": "human"}]}, "missing_field"),
    ({"conversations": [{"value": "hi"}, {"from": "gpt", "value": "yo"}]}, "missing_field"),
    ({"conversations": None}, "missing_field"),
    (["not", "a", "dict"], "wrong_type"),
    ({"conversations": "hello"}, "wrong_type"),
    ({"conversations": ["hello"]}, "wrong_type"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]}, "wrong_type"),
    ({"conversations": [{"from": "human", "value": " \n\t"}, {"from": "gpt", "value": "a"}]},
     "empty_turn"),
    ({"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "a"}]},
     "unknown_role"),
    ({"conversations": [{"from": "human", "value": "bad \udcff"}, {"from": "gpt", "value": "a"}]},
     "non_utf8"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "no_assistant"),
    ({"conversations": []}, "no_assistant"),
    ({"conversations": [{"from": "gpt", "value": "hello, I am a bot"}]}, "no_assistant"),
])
def test_normalize_skip_reasons(record, reason):
    assert normalize_record(record, "sharegpt") == (None, reason)


def test_normalize_maps_roles_and_drops_leading_assistant():
    rec = {"conversations": [{"from": "system", "value": "be nice"}, {"from": "gpt", "value": "Hi!"},
                             {"from": "human", "value": "q1"}, {"from": "chatgpt", "value": "a1"},
                             {"from": "user", "value": "q2"}, {"from": "bard", "value": " a2 "}]}
    msgs, reason = normalize_record(rec, "sharegpt")
    assert reason is None
    assert msgs == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "q1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": " a2 "}]
    uc = {"prompt": "p", "prompt_id": "1", "messages": [{"role": "user", "content": "p"},
                                                        {"role": "assistant", "content": "r"}]}
    assert normalize_record(uc, "ultrachat")[0] == [{"role": "user", "content": "p"},
                                                    {"role": "assistant", "content": "r"}]
    assert normalize_record({"messages": [{"role": "human", "content": "p"}]}, "ultrachat") == (
        None, "unknown_role")


# ---------------------------------------------------------------- streaming ShareGPT parser

def test_complete_file_and_chunk_boundaries(tmp_path):
    path = write_array(tmp_path / "ok.json", GOOD)
    big, big_stats = parse(path)
    assert len(big) == 5 and big_stats.to_dict()["skipped"] == {}
    assert big[0][0]["content"] == "question 0 caf\u00e9 \u4e2d\u6587 \U0001f600"
    for size in (1, 2, 7, 13):  # multibyte characters land on chunk boundaries
        small, small_stats = parse(path, chunk_size=size)
        assert small == big and small_stats.to_dict() == big_stats.to_dict()


def test_truncated_file_keeps_complete_records(tmp_path):
    full = write_array(tmp_path / "full.json", GOOD).read_bytes()
    cut_at = full.index(b"answer 4")  # inside the last record
    for name, blob in [("mid_string", full[:cut_at + 3]), ("mid_key", full[:cut_at - 12]),
                       ("after_comma", full[:full.rindex(b",\n{") + 1])]:
        path = tmp_path / f"{name}.json"
        path.write_bytes(blob)
        for size in (7, 1 << 20):
            convs, stats = parse(path, chunk_size=size)
            truncated = 0 if name == "after_comma" else 1
            assert len(convs) == 4, name
            assert stats.read == 4 + truncated
            assert stats.skipped == ({"truncated": 1} if truncated else {})


def test_malformed_records_are_counted(tmp_path):
    records = [GOOD[0], {"id": "m"},  # missing conversations
               {"id": "t", "conversations": "oops"},
               sg(3, ("human", "   "), ("gpt", "a")),
               sg(4, ("alien", "hi"), ("gpt", "a")),
               sg(5, ("human", "placeholder"), ("gpt", "a")),
               sg(6, ("human", "only a question")),
               GOOD[1]]
    raw = b"[\n" + b",\n".join(json.dumps(r).encode() for r in records) + b"\n]"
    # Invalid UTF-8 (a lone continuation byte and a truncated 3-byte sequence) inside a string.
    raw = raw.replace(b"placeholder", b"place\x80hol\xe4\xb8der")
    path = tmp_path / "bad.json"
    path.write_bytes(raw)
    for size in (3, 1 << 20):
        convs, stats = parse(path, chunk_size=size)
        assert len(convs) == 2
        assert stats.to_dict() == {"source": str(path), "read": 8, "kept": 2, "skipped": {
            "empty_turn": 1, "missing_field": 1, "no_assistant": 1, "non_utf8": 1,
            "unknown_role": 1, "wrong_type": 1}, "duplicates_removed": 0}


@pytest.mark.parametrize("content,what", [
    (None, "cannot open"),
    (b"", "empty file"),
    (b'{"id": 1}', "expected '['"),
    (b'[{"conversations": []} {"conversations": []}]', "expected ',' or ']'"),
    (b'[{"conversations": []}, garbage, {"conversations": []}]', "invalid JSON"),
    (b'[{"conversations": []}, xyz', "invalid JSON"),
    (b'[{"conversations": [}]', "invalid JSON"),
    (b'[{"conversations": []}] trailing', "after the closing"),
])
def test_unreadable_files_raise_one_line(tmp_path, content, what):
    path = tmp_path / "broken.json"
    if content is not None:
        path.write_bytes(content)
    for size in (2, 1 << 20):
        with pytest.raises(DataError) as err:
            parse(path, chunk_size=size)
        msg = str(err.value)
        assert str(path) in msg and what in msg and "\n" not in msg


def test_max_records(tmp_path):
    convs, stats = parse(write_array(tmp_path / "ok.json", GOOD), max_records=3)
    assert len(convs) == 3 and stats.read == 3


def test_real_package_file_prefix_and_tail(tmp_path):
    real = sharegpt_package_path()
    assert real.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    with open(real, "rb") as fh:
        head = fh.read(2 << 20)
        fh.seek(-(256 << 10), os.SEEK_END)
        tail = fh.read()
    (tmp_path / "head.json").write_bytes(head)
    big, big_stats = parse(tmp_path / "head.json")
    small, small_stats = parse(tmp_path / "head.json", chunk_size=4093)
    assert big == small and big_stats.to_dict() == small_stats.to_dict()
    assert big_stats.skipped["truncated"] == 1 and len(big) > 100
    assert big_stats.read == big_stats.kept + sum(big_stats.skipped.values())
    # The shipped file is cut short: restart the array at a record boundary near its end.
    start = tail.index(b'\n  {\n    "id": ')
    (tmp_path / "tail.json").write_bytes(b"[" + tail[start:])
    convs, stats = parse(tmp_path / "tail.json")
    assert stats.skipped.get("truncated") == 1 and stats.read >= 2


def test_real_package_file_whole():
    stats = LoadStats("package")
    t0 = time.perf_counter()
    n = sum(1 for _ in iter_sharegpt_file(sharegpt_package_path(), stats))
    seconds = time.perf_counter() - t0
    print(f"\nShareGPT package file: {stats.to_dict()} in {seconds:.2f}s")
    assert n == stats.kept > 10_000 and stats.skipped["truncated"] == 1
    assert stats.read == stats.kept + sum(stats.skipped.values())


# ---------------------------------------------------------------- hub loaders (local files)

@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


def vicuna_file(tmp_path: Path) -> Path:
    # Aeala/ShareGPT_Vicuna_unfiltered layout: one JSON array of {"id", "conversations"}.
    records = GOOD[:3] + [sg(7, ("human", "q"), ("gpt", "")), sg(8, ("narrator", "x"), ("gpt", "y")),
                          sg(9, ("gpt", "greeting"), ("human", "q"), ("gpt", "a"))]
    path = tmp_path / "vicuna.json"
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return path


def ultrachat_rows() -> list[dict]:
    def row(i, *msgs):
        return {"prompt": msgs[0][1], "prompt_id": f"p{i}",
                "messages": [{"content": c, "role": r} for r, c in msgs]}
    return [row(0, ("user", "hi"), ("assistant", "hello")),
            row(1, ("user", "why?"), ("assistant", "because"), ("user", "ok"), ("assistant", "  ")),
            row(2, ("user", "who"), ("critic", "me")),
            row(3, ("user", "one"), ("assistant", "two"), ("user", "three"), ("assistant", "four"))]


def test_hub_sharegpt_schema_via_data_files(hf_cache):
    stats = LoadStats("vicuna")
    convs = list(iter_hub_dataset("Aeala/ShareGPT_Vicuna_unfiltered", "train", "sharegpt", stats,
                                  data_files=str(vicuna_file(hf_cache))))
    assert stats.to_dict()["skipped"] == {"empty_turn": 1, "unknown_role": 1}
    assert stats.read == 6 and stats.kept == 4 == len(convs)
    assert convs[-1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert convs[0][0]["content"] == GOOD[0]["conversations"][0]["value"]


def test_hub_ultrachat_schema_jsonl_and_parquet(hf_cache):
    import datasets
    rows = ultrachat_rows()
    jsonl = hf_cache / "uc.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = hf_cache / "uc.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    results = []
    for files in (str(jsonl), [str(parquet)]):
        stats = LoadStats("uc")
        convs = list(iter_hub_dataset("HuggingFaceH4/ultrachat_200k", "train_sft", "ultrachat",
                                      stats, data_files=files))
        assert stats.to_dict()["skipped"] == {"empty_turn": 1, "unknown_role": 1}
        assert len(convs) == 2 and len(convs[1]) == 4
        results.append(convs)
    assert results[0] == results[1]


def test_hub_name_path_and_errors(monkeypatch):
    import datasets
    calls = []

    def fake_load(*args, **kwargs):
        calls.append((args, kwargs))
        if args[0] == "missing/dataset":
            raise FileNotFoundError("Couldn't find\na dataset")
        return datasets.Dataset.from_list(ultrachat_rows())

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    stats = LoadStats("uc")
    convs = list(iter_hub_dataset("HuggingFaceH4/ultrachat_200k", "train_sft", "ultrachat", stats,
                                  max_records=3))
    assert calls[0] == (("HuggingFaceH4/ultrachat_200k",), {"split": "train_sft"})
    assert len(convs) == 1 and stats.read == 3
    with pytest.raises(DataError, match="missing/dataset") as err:
        list(iter_hub_dataset("missing/dataset", "train", "sharegpt", LoadStats("x")))
    assert "\n" not in str(err.value)
    # a file name that is not a local path picks that file inside the hub repo
    list(iter_hub_dataset("Aeala/ShareGPT_Vicuna_unfiltered", "train", "sharegpt", LoadStats("a"),
                          data_files="ShareGPT_V4.3_unfiltered_cleaned_split.json", max_records=1))
    assert calls[-1] == (("Aeala/ShareGPT_Vicuna_unfiltered",),
                         {"data_files": ["ShareGPT_V4.3_unfiltered_cleaned_split.json"], "split": "train"})


def test_load_sources_mixed(hf_cache, monkeypatch):
    pkg = write_array(hf_cache / "pkg.json", GOOD, tail=b",\n  {\n    \"id\": \"cut")
    monkeypatch.setattr(data, "sharegpt_package_path", lambda: pkg)
    uc = hf_cache / "uc.jsonl"
    uc.write_text("".join(json.dumps(r) + "\n" for r in ultrachat_rows()))
    stats: list[LoadStats] = []
    convs = load_sources(section(DataSource, [{"kind": "sharegpt_package"},
                          {"kind": "sharegpt_file", "path": str(pkg), "max_records": 2},
                          {"kind": "hub", "name": "HuggingFaceH4/ultrachat_200k",
                           "split": "train_sft", "schema": "ultrachat", "data_files": str(uc)}]),
                         stats)
    assert [(s.read, s.kept) for s in stats] == [(6, 5), (2, 2), (4, 2)]
    assert stats[0].skipped == {"truncated": 1}
    assert len(convs) == 9 and convs[5] == convs[0]
    with pytest.raises(DataError, match="unknown kind"):
        load_sources(section(DataSource, [{"kind": "ftp"}]), [])


# ---------------------------------------------------------------- split

def test_split_determinism():
    items = list(range(100))
    parts = split_conversations(items, 60, 10, seed=1, val_samples=12)
    train, evals, val = parts["train"], parts["eval"], parts["val"]
    assert parts == split_conversations(items, 60, 10, seed=1, val_samples=12)
    assert parts != split_conversations(items, 60, 10, seed=2, val_samples=12)
    assert (len(train), len(evals), len(val)) == (60, 10, 12)
    assert not set(train) & set(evals) and not set(val) & set(evals) and not set(val) & set(train)
    assert len(split_conversations(items, 60, 10, seed=1)["val"]) == 10   # default: as many as eval
    # Asking for more than exists: eval and val are full, train takes the rest.
    short = split_conversations(items, 500, 10, seed=1, val_samples=12)
    assert len(short["eval"]) == 10 and len(short["val"]) == 12 and len(short["train"]) == 78
    assert set(short["train"]) | set(short["eval"]) | set(short["val"]) == set(items)
    # eval and val do not move with the train size, and a smaller train is a prefix of a larger one
    assert short["eval"] == evals and short["val"] == val and short["train"][:60] == train
    with pytest.raises(DataError):
        split_conversations(items[:5], 10, 5, seed=0)  # nothing left for val or train
    with pytest.raises(DataError, match="0 train / 3 eval / 2 val"):
        split_conversations(items[:5], 10, 3, seed=0, val_samples=2)
    with pytest.raises(DataError):
        split_conversations([], 10, 5, seed=0)


# ---------------------------------------------------------------- chat format and tokenization

CONVS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?\n"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "caf\u00e9 \U0001f600 {{ x }}"},
     {"role": "assistant", "content": "  spaced\n\ntext  "}],
]


def test_render_chat_matches_jinja_template():
    import jinja2
    assert render_chat(CONVS[0]) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                     "Hello! How can I help?<|im_end|>\n")
    for env in (jinja2.Environment(), jinja2.Environment(trim_blocks=True, lstrip_blocks=True)):
        template = env.from_string(CHAT_TEMPLATE)
        for conv in CONVS:
            for gen in (False, True):
                assert template.render(messages=conv, add_generation_prompt=gen) == \
                    render_chat(conv, add_generation_prompt=gen)
    assert render_chat(CONVS[0], True).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([render_chat(c) for c in CONVS] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=specials[:2],
                                   clean_up_tokenization_spaces=False)


def test_tokenize_conversation_mask(tiny_tokenizer):
    tok = tiny_tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    for conv in CONVS:
        ids, mask = tokenize_conversation(tok, conv, max_len=10_000)
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        assert tok.decode(ids) == render_chat(conv)
        masked = [i for i, m in zip(ids, mask) if m]
        expected = "".join(m["content"] + IM_END for m in conv if m["role"] == "assistant")
        assert tok.decode(masked) == expected
        # every <|im_end|> closing an assistant turn is trained on, the others are not
        ends = [m for i, m in zip(ids, mask) if i == im_end]
        assert ends == [int(m["role"] == "assistant") for m in conv]
        short_ids, short_mask = tokenize_conversation(tok, conv, max_len=9)
        assert short_ids == ids[:9] and short_mask == mask[:9]


def test_chat_template_in_tokenizer(tiny_tokenizer):
    tiny_tokenizer.chat_template = CHAT_TEMPLATE
    for conv in CONVS:
        text = tiny_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert text == render_chat(conv, add_generation_prompt=True)


# A template in the manner of Qwen3's (written for this test): with enable_thinking false the
# generation prompt ends with an empty think block, and so does the answer after the last user turn.
QWEN_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- set no_think = enable_thinking is defined and enable_thinking is false %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    "{%- if no_think and loop.index0 > ns.last_user %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if no_think %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture
def qwen_like_tokenizer(tiny_tokenizer, tmp_path):
    import copy

    from transformers import AutoTokenizer

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN_LIKE_TEMPLATE
    tok.save_pretrained(tmp_path / "tok")            # as the tokenizer stage hands it on
    return AutoTokenizer.from_pretrained(str(tmp_path / "tok"))


def template_ids(tok, conv, **kw) -> list[int]:
    text = tok.apply_chat_template(conv, tokenize=False, enable_thinking=False, **kw)
    return tok.encode(text, add_special_tokens=False)


def test_own_chat_template_renders_training_text_and_prompts(qwen_like_tokenizer):
    from kvshot.data.chat import encode_prompt

    tok = qwen_like_tokenizer
    think = "<think>\n\n</think>\n\n"
    convs = CONVS + [[{"role": "user", "content": "user"}, {"role": "assistant", "content": "user"},
                      {"role": "user", "content": "assistant"}, {"role": "assistant", "content": "\nassistant"}]]
    for conv in convs:
        ids, mask = tokenize_conversation(tok, conv, max_len=10_000)
        assert ids == template_ids(tok, conv) and len(mask) == len(ids)
        text = tok.decode(ids)
        assert text.count(think) == 1 and text.endswith(think + conv[-1]["content"] + IM_END + "\n")
        masked = [i for i, m in zip(ids, mask) if m]
        assert tok.decode(masked) == "".join(m["content"] + IM_END for m in conv if m["role"] == "assistant")
        # each trained span starts right after an assistant header and stops after its <|im_end|>
        starts = [k for k in range(len(mask)) if mask[k] and not mask[k - 1]]
        assert len(starts) == sum(m["role"] == "assistant" for m in conv)
        assert all(tok.decode(ids[:k]).endswith(("<|im_start|>assistant\n", think)) for k in starts)
        # the eval prompt is the training text up to the first answer, think block included
        first = next(i for i, m in enumerate(conv) if m["role"] == "assistant")
        prompt = encode_prompt(tok, conv[:first])
        assert prompt == template_ids(tok, conv[:first], add_generation_prompt=True)
        assert tok.decode(prompt).endswith("<|im_start|>assistant\n" + think)
        assert encode_prompt(tok, conv[:first], max_len=5) == prompt[-5:]
        if first == len(conv) - 1:
            assert ids[:len(prompt)] == prompt and mask[len(prompt):] == [1] * (len(ids) - len(prompt) - 1) + [0]
        short_ids, short_mask = tokenize_conversation(tok, conv, max_len=9)
        assert short_ids == ids[:9] and short_mask == mask[:9]


def test_embedded_template_keeps_chatml(tiny_tokenizer):
    from kvshot.data.chat import encode_prompt, render_conversation

    tiny_tokenizer.chat_template = CHAT_TEMPLATE
    for conv in CONVS:
        assert render_conversation(tiny_tokenizer, conv) == render_chat(conv)
        assert tiny_tokenizer.decode(encode_prompt(tiny_tokenizer, conv[:1])) == render_chat(conv[:1], True)


def test_unrendered_content_is_one_line_error(qwen_like_tokenizer):
    tok = qwen_like_tokenizer
    tok.chat_template = QWEN_LIKE_TEMPLATE.replace("m.content + '<|im_end|>", "m.content | upper + '<|im_end|>")
    with pytest.raises(DataError, match=r"message 0 \(user\) is not rendered verbatim"):
        tokenize_conversation(tok, CONVS[0], 100)


# ---------------------------------------------------------------- prepare_data / read_jsonl

def test_prepare_data_writes_atomically(tmp_path, capsys):
    src = write_array(tmp_path / "src.json",
                      [sg(i, ("human", f"q{i}"), ("gpt", "a" * (i % 4 + 1))) for i in range(30)])
    out = tmp_path / "out"
    stats = prepare_data(section(DataSource, [{"kind": "sharegpt_file", "path": str(src)}]), train_samples=100,
                         eval_samples=5, seed=3, out_dir=out, min_assistant_chars=2, val_samples=4)
    assert sorted(os.listdir(out)) == ["eval.jsonl", "stats.json", "train.jsonl", "val.jsonl"]
    assert json.loads((out / "stats.json").read_text()) == stats
    assert stats["too_short"] == 8 and stats["available"] == 22
    assert (stats["train"], stats["eval"], stats["val"], stats["seed"]) == (13, 5, 4, 3)
    assert stats["requested"]["train"] == 100 and stats["sources"][0]["kept"] == 30
    assert "give 13 train, fewer than data.train_samples=100" in capsys.readouterr().err
    train, evals, val = (read_jsonl(out / f"{name}.jsonl") for name in ("train", "eval", "val"))
    assert len(train) == 13 and len(evals) == 5 and len(val) == 4
    ids = [r["id"] for r in train + evals + val]
    assert len(set(ids)) == 22 and all(i.startswith("0:") for i in ids)
    again = prepare_data(section(DataSource, [{"kind": "sharegpt_file", "path": str(src)}]), 100, 5, 3, tmp_path / "b",
                         min_assistant_chars=2, val_samples=4)
    assert again == stats and (tmp_path / "b" / "train.jsonl").read_bytes() == \
        (out / "train.jsonl").read_bytes()


def test_prepare_data_failure_leaves_nothing(tmp_path, monkeypatch):
    src = write_array(tmp_path / "src.json", GOOD)

    def boom(*_):
        raise OSError("disk full")

    monkeypatch.setattr(data.os, "replace", boom)
    with pytest.raises(OSError):
        prepare_data(section(DataSource, [{"kind": "sharegpt_file", "path": str(src)}]), 3, 1, 0, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == []


def test_read_jsonl_errors(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "q"}]}\n\n{broken\n')
    with pytest.raises(DataError, match=r"x\.jsonl:3: invalid JSON"):
        read_jsonl(path)
    path.write_text('{"id": "a", "messages": [{"role": "robot", "content": "q"}]}\n')
    with pytest.raises(DataError, match=r"x\.jsonl:1:"):
        read_jsonl(path)
    with pytest.raises(DataError, match="cannot open"):
        read_jsonl(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------- streaming split, revisions, offline hub

def test_prepare_data_streams_the_reference_split(tmp_path, monkeypatch):
    import functools

    from kvshot.core.ranked_writer import RankedWriter

    records = [sg(i, ("human", f"q{i} \u4e2d"), ("gpt", "a" * (i % 5) + "\n\tb")) for i in range(57)]
    sources = [{"kind": "sharegpt_file", "path": str(write_array(tmp_path / "a.json", records[:40]))},
               {"kind": "sharegpt_file", "path": str(write_array(tmp_path / "b.json", records[40:]))}]
    # many small buckets: order across and inside buckets both matter
    monkeypatch.setattr(split, "RankedWriter", functools.partial(RankedWriter, bucket_size=3))
    stats = prepare_data(section(DataSource, sources), 30, 7, 11, tmp_path / "out", min_assistant_chars=4)
    items = [{"id": f"{i}:{k}", "messages": m} for i, k, m in data.iter_sources(section(DataSource, sources), [])]
    usable = [it for it in items if sum(len(m["content"].strip()) for m in it["messages"][1:]) >= 4]
    parts = split_conversations(usable, 30, 7, seed=11)
    for name, part in parts.items():
        assert read_jsonl(tmp_path / f"out/{name}.jsonl") == part, name
    assert stats["available"] == len(usable) and stats["too_short"] == 57 - len(usable)
    assert (stats["train"], stats["eval"], stats["val"]) == (30, 7, 7) and sorted(os.listdir(tmp_path / "out")) == [
        "eval.jsonl", "stats.json", "train.jsonl", "val.jsonl"]
    # nested: a smaller train split is a prefix of a larger one, and eval and val do not move
    prepare_data(section(DataSource, sources), 10, 7, 11, tmp_path / "small", min_assistant_chars=4)
    assert read_jsonl(tmp_path / "small/train.jsonl") == parts["train"][:10]
    assert read_jsonl(tmp_path / "small/eval.jsonl") == parts["eval"]
    assert read_jsonl(tmp_path / "small/val.jsonl") == parts["val"]


def test_normalized_key_matches_near_exact_copies():
    base = [{"role": "user", "content": "What is a KV cache?"}, {"role": "assistant", "content": "Keys and values."}]
    same = [  # case, spacing, NFKC forms, zero-width characters
        [{"role": "user", "content": "  what IS a\tKV\n\ncache?"}, {"role": "assistant", "content": "keys and values."}],
        [{"role": "user", "content": "What is a \uff2b\uff36 cache?"}, {"role": "assistant", "content": "Keys and\u00a0values."}],
        [{"role": "user", "content": "What is a K\u200bV cache?"}, {"role": "assistant", "content": "Keys and values.\ufeff"}],
    ]
    differ = [  # punctuation, a role, a turn boundary, an extra turn
        [{"role": "user", "content": "What is a KV cache"}, {"role": "assistant", "content": "Keys and values."}],
        [{"role": "system", "content": "What is a KV cache?"}, {"role": "assistant", "content": "Keys and values."}],
        [{"role": "user", "content": "What is a KV cache? Keys"}, {"role": "assistant", "content": "and values."}],
        base + [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}],
    ]
    key = split.conversation_key(base)
    assert all(split.conversation_key(m) == key for m in same)
    assert len({key, *(split.conversation_key(m) for m in differ)}) == 1 + len(differ)
    unique, removed = split.dedup_conversations([base, *same, *differ, base])
    assert unique == [base, *differ] and removed == 4


def test_prepare_data_removes_duplicates_before_the_split(tmp_path, monkeypatch):
    import functools

    from kvshot.core.ranked_writer import RankedWriter

    records = [sg(i, ("human", f"q{i}"), ("gpt", f"answer {i % 23}")) for i in range(40)]
    records += [sg(100 + i, ("user", f"Q{i} "), ("gpt", f"Answer  {i % 23}")) for i in range(0, 40, 3)]  # near copies
    records += [sg(200, ("human", "q5"), ("gpt", "answer 5"))]                                   # exact copy
    sources = [{"kind": "sharegpt_file", "path": str(write_array(tmp_path / "a.json", records[:45]))},
               {"kind": "sharegpt_file", "path": str(write_array(tmp_path / "b.json", records[45:] + records[:2]))}]
    monkeypatch.setattr(split, "RankedWriter", functools.partial(RankedWriter, bucket_size=4))
    stats = prepare_data(section(DataSource, sources), 100, 6, 5, tmp_path / "out", val_samples=5)
    items = [{"id": f"{i}:{k}", "messages": m} for i, k, m in data.iter_sources(section(DataSource, sources), [])]
    unique, removed = split.dedup_conversations(items)
    assert removed == 14 + 1 + 2 == stats["duplicates_removed"] and stats["available"] == 40 == len(unique)
    # the first copy stays; per source: 5 in a.json (records 40..44), 10 + 2 in b.json
    assert [s["duplicates_removed"] for s in stats["sources"]] == [5, 12]
    assert all(it["id"].startswith("0:") and int(it["id"][2:]) < 40 for it in unique)
    parts = split_conversations(unique, 100, 6, seed=5, val_samples=5)
    for name, part in parts.items():
        assert read_jsonl(tmp_path / f"out/{name}.jsonl") == part, name
    # no conversation, nor a near copy of one, is in two splits: the validation conversations
    # that steer training are disjoint from the evaluation ones
    train, evals, val = ({split.conversation_key(r["messages"]) for r in parts[n]} for n in ("train", "eval", "val"))
    assert (len(train), len(evals), len(val)) == (29, 6, 5)
    assert not train & evals and not val & evals and not val & train


def test_ranked_writer_orders_and_is_all_or_nothing(tmp_path):
    from kvshot.core.ranked_writer import RankedWriter

    w = RankedWriter(tmp_path / "x.jsonl", 10, bucket_size=4)
    for r in (7, 3, 9, 0, 5, 1, 8, 2, 6, 4):
        w.add(r, json.dumps({"r": r, "s": "\u2028\x85"}, ensure_ascii=False) + "\n")   # not line ends in JSONL
    w.close()
    lines = (tmp_path / "x.jsonl").read_text(encoding="utf-8").split("\n")
    assert [json.loads(line)["r"] for line in lines[:-1]] == list(range(10)) and lines[-1] == ""
    w = RankedWriter(tmp_path / "y.jsonl", 3, bucket_size=1)
    w.add(0, "{}\n")
    with pytest.raises(ValueError, match="rank 3"):
        w.add(3, "{}\n")
    with pytest.raises(ValueError, match="1 lines added, 3 expected"):
        w.close()
    assert os.listdir(tmp_path) == ["x.jsonl"]


def test_hub_revision_is_passed(monkeypatch):
    import datasets
    calls = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **kw: calls.append((a, kw)) or datasets.Dataset.from_list(ultrachat_rows()))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    list(data.iter_sources(section(DataSource, [{"kind": "hub", "name": "o/n", "split": "s", "schema": "ultrachat",
                             "revision": "abc123"}]), []))
    assert calls == [(("o/n",), {"split": "s", "revision": "abc123"})]


HUB_SCRIPT = """
import json, sys
import datasets
from kvshot.core.io import DataError
from kvshot.data.sources import LoadStats, iter_hub_dataset
name, split, files, revision = json.loads(sys.argv[1])
try:
    datasets.load_dataset(name, split=split, data_files=files)
    print("datasets: loaded")
except Exception as e:
    print("datasets:", type(e).__name__)
try:
    convs = list(iter_hub_dataset(name, split, "ultrachat" if files is None else "sharegpt", LoadStats(name),
                                  data_files=files, revision=revision))
    print("kvshot:", json.dumps(convs))
except DataError as e:
    print("kvshot error:", e)
"""


def test_hub_dataset_offline_from_the_hf_cache(tmp_path):
    import subprocess
    import sys

    commit, old = "0123456789abcdef0123456789abcdef01234567", "fedcba9876543210fedcba9876543210fedcba98"
    repo = tmp_path / "hub" / "datasets--Owner--Name"
    for rev, answer in ((commit, "new"), (old, "old")):
        snap = repo / "snapshots" / rev
        (snap / "data").mkdir(parents=True)
        write_array(snap / "sharegpt.json", [sg(0, ("human", "q"), ("gpt", answer))])
        (snap / "data" / "train_sft-00000-of-00001.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in ultrachat_rows()))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(Path(data.__file__).parents[2])}

    def load(*args) -> list[str]:
        out = subprocess.run([sys.executable, "-c", HUB_SCRIPT, json.dumps(args)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()

    plain, ours = load("Owner/Name", "train", "sharegpt.json", None)
    assert plain == "datasets: ConnectionError"          # what datasets alone does offline
    assert json.loads(ours.removeprefix("kvshot: ")) == [[{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "new"}]]
    ours = load("Owner/Name", "train", "sharegpt.json", old)[1]
    assert json.loads(ours.removeprefix("kvshot: "))[0][1]["content"] == "old"
    ours = load("Owner/Name", "train_sft", None, None)[1]    # the split found by file name
    assert len(json.loads(ours.removeprefix("kvshot: "))) == 2
    ours = load("Owner/Missing", "train", "sharegpt.json", None)[1]
    assert ours.startswith("kvshot error: dataset Owner/Missing (sharegpt.json): load failed (offline:")
