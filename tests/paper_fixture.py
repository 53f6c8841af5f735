"""A Hugging Face hub cache as the paper run would find it on an offline cluster node, in
miniature: a random-weight Qwen3 saved with `save_pretrained` under the config's target
(`Qwen/Qwen3-8B` for config/paper.yaml, `Qwen/Qwen3-1.7B` for config/one-gpu.yaml), a
byte-level BPE carrying Qwen3's special tokens and a chat template with Qwen3's thinking
switch, and the three hub datasets in their own schemas and file layouts, filled with real
ShareGPT text from the packaged file.

`build_hub_cache(root)` lays it out as `huggingface_hub` does (`models--Owner--Name/snapshots/
<commit>/...`, `refs/main`), so the pipeline's real loaders resolve it with HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"   # the fake repos' commits derive from it

# Qwen3's special tokens the pipeline relies on; the real tokenizer has ~150k more tokens.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Written for this fixture after the behaviour of Qwen3's template: ChatML turns; the answer
# after the last user turn opens with a (here empty) think block, earlier answers carry none;
# a generation prompt with enable_thinking=false pre-fills the empty think block.
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

ULTRACHAT_README = """---
configs:
- config_name: default
  data_files:
  - split: train_sft
    path: data/train_sft-*
  - split: test_sft
    path: data/test_sft-*
---
"""

MTBENCH_README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
"""

HUMANEVAL_README = """---
configs:
- config_name: openai_humaneval
  data_files:
  - split: test
    path: openai_humaneval/test-*
---
"""

ALPACA_README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
"""

PAPER = "config/paper.yaml"
# The sizes the GPU configs' CPU path tests shrink them to (each adds its drafters, steps and
# lengths): everything else is the config as a researcher runs it.
CPU_SIZES = {
    "device": "cpu",
    "threads": 2,
    "data": {"train_samples": 120, "eval_samples": 16, "val_samples": 8, "max_len": 160},
    "target": {"pretrain": {"eval_blocks": 4, "generations": 1, "generation_tokens": 8}},
    "features": {"batch_tokens": 2048, "shard_tokens": 16384},
    "eval": {"prompts": 4, "max_prompt_len": 64, "batch_size": 4, "bootstrap_samples": 50,
             "e2e": {"prompts": 2, "warmup": 1, "tree": {"depth": 3, "topk": 2, "total_tokens": 6},
                     "benchmarks": {"prompts": 1, "max_new_tokens": 6}}},   # every set and mode, 1 prompt each
}


def pinned_revisions(config: str = PAPER) -> dict[str, str]:
    """repo id -> the revision the config pins for it (a commit, or a branch name)."""
    import yaml

    from .conftest import REPO

    cfg = yaml.safe_load((REPO / config).read_text())
    pins = {cfg["target"]["name"]: cfg["target"].get("revision"), cfg["tokenizer"]["name"]: cfg["tokenizer"].get("revision")}
    for src in cfg["data"]["sources"] + cfg["eval"].get("prompt_sources", []):
        pins[src["name"]] = src.get("revision")
    for src in ((cfg["eval"]["e2e"].get("benchmarks") or {}).get("sets") or []):
        if src["kind"] == "hub":
            pins[src["dataset"]] = src.get("revision")
    return {repo: rev for repo, rev in pins.items() if rev}


def _snapshot(cache: Path, kind: str, repo: str, config: str = PAPER) -> Path:
    """models--Owner--Name / datasets--Owner--Name at the revision the config pins (what
    `hf download --revision` leaves), refs/main pointing at it; returns the snapshot folder."""
    rev = pinned_revisions(config).get(repo, "main")
    # a branch pin: a commit of this repo's own (as on the hub: `datasets` names its cache of a
    # local folder by the folder, so two repos at one fake commit would share a cache entry)
    commit = rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else \
        hashlib.sha1(f"{COMMIT}{repo}".encode()).hexdigest()
    top = cache / f"{kind}--{repo.replace('/', '--')}"
    (top / "refs").mkdir(parents=True, exist_ok=True)
    (top / "refs" / "main").write_text(commit)
    if commit != rev:   # a branch pin resolves through its ref
        (top / "refs" / rev).write_text(commit)
    snap = top / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def real_conversations(n: int, max_chars: int = 400) -> list[list[dict]]:
    """The first n multi-role conversations of the packaged ShareGPT file, turns cut short."""
    from kvshot.data.sources import LoadStats, iter_sharegpt_file, sharegpt_package_path

    convs = []
    for messages in iter_sharegpt_file(sharegpt_package_path(), LoadStats("fixture"), max_records=4 * n):
        convs.append([{**m, "content": m["content"][:max_chars]} for m in messages[:4]])
        if len(convs) == n:
            break
    return convs


def _tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = QWEN3_LIKE_TEMPLATE
    return fast


def build_hub_cache(root: Path, conversations: int = 160, vocab_size: int = 512, config: str = PAPER) -> Path:
    """Write the fake hub cache under root/hub for the config's target and hub datasets at its
    pinned revisions; returns its path (set HF_HUB_CACHE to it). The target ties its embedding
    and head as the real model does (Qwen3-1.7B and 0.6B tie, Qwen3-8B does not)."""
    import datasets
    import torch
    import yaml
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvshot.paper_shapes.shape_rules import QWEN3_ARCHS

    from .conftest import REPO

    target = yaml.safe_load((REPO / config).read_text())["target"]["name"]
    tied = QWEN3_ARCHS[target]["tie_word_embeddings"]

    cache = root / "hub"
    convs = real_conversations(conversations)
    half = len(convs) // 2
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in convs]

    snap = _snapshot(cache, "models", target, config)
    tokenizer = _tokenizer(texts, vocab_size)
    tokenizer.save_pretrained(snap)
    torch.manual_seed(0)
    arch = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rope_theta=1_000_000.0, tie_word_embeddings=tied, torch_dtype="bfloat16",
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(arch).to(torch.bfloat16)
    model.save_pretrained(snap)

    # Aeala/ShareGPT_Vicuna_unfiltered: one JSON array of {id, conversations: [{from, value}]}
    role = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [{"id": f"sg{i}", "conversations": [{"from": role[m["role"]], "value": m["content"]} for m in c]}
                for i, c in enumerate(convs[:half])]
    snap = _snapshot(cache, "datasets", "Aeala/ShareGPT_Vicuna_unfiltered", config)
    (snap / "ShareGPT_V4.3_unfiltered_cleaned_split.json").write_text(json.dumps(sharegpt))

    # HuggingFaceH4/ultrachat_200k: parquet shards per split, {prompt, prompt_id, messages}
    snap = _snapshot(cache, "datasets", "HuggingFaceH4/ultrachat_200k", config)
    (snap / "README.md").write_text(ULTRACHAT_README)
    (snap / "data").mkdir(exist_ok=True)
    rows = [{"prompt": c[0]["content"], "prompt_id": f"uc{i}", "messages": c} for i, c in enumerate(convs[half:])]
    datasets.Dataset.from_list(rows).to_parquet(str(snap / "data/train_sft-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[:4]).to_parquet(str(snap / "data/test_sft-00000-of-00001.parquet"))

    # HuggingFaceH4/mt_bench_prompts: {prompt: [turn 1, turn 2], category, prompt_id, reference}
    snap = _snapshot(cache, "datasets", "HuggingFaceH4/mt_bench_prompts", config)
    (snap / "README.md").write_text(MTBENCH_README)
    (snap / "data").mkdir(exist_ok=True)
    prompts = [{"prompt": [c[0]["content"][:200], "Explain your answer."], "category": "writing",
                "prompt_id": 81 + i, "reference": []} for i, c in enumerate(convs[:16])]
    datasets.Dataset.from_list(prompts).to_parquet(str(snap / "data/train-00000-of-00001.parquet"))

    # eval.e2e.benchmarks' hub sets, each in its own layout: openai/openai_humaneval (config
    # openai_humaneval, split test), openai/gsm8k (config main: main/test-*.parquet, read by
    # data_files), tatsu-lab/alpaca (data/train-*.parquet); the text is ShareGPT's, the fields theirs
    for repo, readme, path, rows in (
            ("openai/openai_humaneval", HUMANEVAL_README, "openai_humaneval/test-00000-of-00001.parquet",
             [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    \"\"\"{c[0]['content'][:120]}\"\"\"\n",
               "canonical_solution": "    return 0\n", "test": "", "entry_point": f"f{i}"}
              for i, c in enumerate(convs[:8])]),
            ("openai/gsm8k", None, "main/test-00000-of-00001.parquet",
             [{"question": c[0]["content"][:200], "answer": "#### 4"} for c in convs[8:16]]),
            ("tatsu-lab/alpaca", ALPACA_README, "data/train-00000-of-00001.parquet",
             [{"instruction": c[0]["content"][:200], "input": "", "output": c[1]["content"][:200], "text": ""}
              for c in convs[16:24]])):
        snap = _snapshot(cache, "datasets", repo, config)
        if readme:
            (snap / "README.md").write_text(readme)
        (snap / path).parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(str(snap / path))
    return cache


def offline_env(cache: Path, home: Path) -> dict[str, str]:
    """The environment of an offline cluster node whose shared HF_HOME holds the cache."""
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(home / "datasets"),
            "TRANSFORMERS_OFFLINE": "1"}
