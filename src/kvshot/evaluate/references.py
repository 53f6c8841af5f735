"""The evaluation's prompts and the target's reference chains, written once by the
target_continuations stage and read by every evaluation:

continuations  the target's greedy continuation of each eval prompt (the paper's protocol);
natural        every candidate anchor in real held-out assistant text (or a seeded cap of them),
               each with the target's greedy rollout from that real prefix, computed as a tree
               of branches at one target pass per conversation (`branches`); and one prompt
               per conversation for end-to-end decoding (`e2e_items`).

`repetition_share` says how much of a reference the target copies from earlier in it.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from kvshot.config import Runtime
from kvshot.core.io import DataError, read_json, write_json
from kvshot.core.progress import progress
from kvshot.data.chat import encode_prompt
from kvshot.evaluate.branches import natural_conversations, rollout
from kvshot.data.sources import read_jsonl
from kvshot.settings import Config, DataSource, PromptSource


def prompt_conversations(eval_jsonl: str | Path, n: int,
                         sources: Sequence[PromptSource] | None = None) -> list[list[dict]]:
    """Held-out conversations from the eval split, or public suites through `datasets`
    (e.g. MT-Bench prompts, schema `mtbench`) when eval.prompt_sources is set."""
    if not sources:
        return [c["messages"] for c in read_jsonl(eval_jsonl)[:n]]
    from kvshot.data.sources import load_sources

    convs: list[list[dict]] = []
    stats: list = []
    for src in sources:
        hub = DataSource(kind="hub", path=None, name=src.name, split=src.split, schema=src.schema,
                         data_files=src.data_files, revision=src.revision, max_records=None)
        convs += load_sources([hub], stats)[: n - len(convs)]
    return convs


def eval_prompts(conversations: list[list[dict]], tokenizer, max_prompt_len: int) -> list[list[int]]:
    """The conversation up to its first assistant turn, with the generation prompt, rendered as
    training text is (`chat`); long prompts keep their end (the part next to the answer)."""
    prompts = []
    for msgs in conversations:
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        prompts.append(encode_prompt(tokenizer, msgs[:first], max_prompt_len))
    return prompts


@torch.no_grad()
def greedy_continuations(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, device: str) -> list[dict]:
    """The target's own greedy output for each prompt (batch 1: no padding effects)."""
    out = []
    for ids in progress(prompts, desc="target continuations", unit="prompt"):
        x = torch.tensor([ids], device=device)
        gen = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        out.append({"prompt": ids, "continuation": gen[0, len(ids):].tolist()})
    return out


def e2e_items(convs: list[dict], tokens: int, eos_id: int | None, seed: int) -> list[dict]:
    """One prompt per conversation with anchors for real speculative decoding (eval.e2e): the
    real prefix up to an anchor drawn with `seed`, its branch's rollout as the reference."""
    rng = random.Random(seed)
    out = []
    for conv in convs:
        if conv["anchors"]:
            i = rng.randrange(len(conv["anchors"]))
            a = conv["anchors"][i]
            out.append({"conversation": conv["conversation"], "prompt": conv["ids"][: a + 1],
                        "continuation": rollout(conv["branches"][i], tokens, eos_id), "anchors": [a]})
    return out


def run_continuations_stage(cfg: Config, rt: Runtime, eval_jsonl: str, target_dir: str, out_path: str,
                            natural_out: str | None = None) -> dict:
    """The reference chains: the target's continuations of the eval prompts, and with
    natural_out its rollouts at seeded anchors in real held-out assistant text."""
    from kvshot.capture.target import load_target
    from kvshot.data.tokenizer import load_tokenizer

    ecfg = cfg.eval
    target = load_target(target_dir, rt, cfg.target.attn_implementation)
    tokenizer = load_tokenizer(target_dir)
    convs = prompt_conversations(eval_jsonl, ecfg.prompts, ecfg.prompt_sources)
    prompts = eval_prompts(convs, tokenizer, ecfg.max_prompt_len)
    start = time.time()
    items = greedy_continuations(target, tokenizer, prompts, ecfg.max_new_tokens, rt.device)
    result = {"target": target_dir, "max_new_tokens": ecfg.max_new_tokens, "eos_id": tokenizer.eos_token_id,
              "seconds": time.time() - start, "items": items}
    write_json(out_path, result)
    summary = {"prompts": len(items), "tokens": sum(len(i["continuation"]) for i in items)}
    if natural_out:
        ncfg, start = ecfg.natural, time.time()
        real = [c["messages"] for c in read_jsonl(eval_jsonl)]   # real assistant text: the eval split itself
        # K + 1 tokens at least (the step-wise chain's inputs c_0..c_{K-1} and the target's c_K): checks.py
        tokens = ncfg.rollout_tokens
        convs = natural_conversations(target, tokenizer, real, ncfg.anchors, ncfg.max_prefix_len, tokens, cfg.seed,
                                      rt.device)
        anchors = sum(len(c["anchors"]) for c in convs)
        if not anchors:
            raise DataError(f"{eval_jsonl}: no assistant text to anchor the natural protocol (eval.natural)")
        eos = tokenizer.eos_token_id
        write_json(natural_out, {"target": target_dir, "protocol": "natural", **asdict(ncfg), "seed": cfg.seed,
                                 "eos_id": eos, "seconds": time.time() - start, "branch_tokens": tokens,
                                 "target_tokens": sum(len(c["ids"]) + len(c["anchors"]) * (tokens - 1) for c in convs
                                                      if c["anchors"]),
                                 "conversations": convs, "items": e2e_items(convs, ncfg.rollout_tokens, eos, cfg.seed)})
        summary["natural_anchors"] = anchors
    return summary


NGRAM = 4


def repetition_share(items: list[dict], n: int = NGRAM) -> dict:
    """The share of reference tokens (each item's continuation) that complete an n-gram already
    seen earlier in the same sequence, prompt included: how much of what alpha_k is scored
    on is the target repeating itself."""
    repeated = total = 0
    for it in items:
        seq, start = it["prompt"] + it["continuation"], len(it["prompt"])
        seen = set()
        for i in range(n - 1, len(seq)):
            gram = tuple(seq[i - n + 1: i + 1])
            repeated += i >= start and gram in seen
            seen.add(gram)
        total += len(it["continuation"])
    return {"share": repeated / total if total else float("nan"), "repeated": repeated, "tokens": total, "ngram": n}


def read_continuations(path: str) -> dict:
    """The target_continuations output; a truncated or damaged file is one DataError line naming it."""
    redo = "delete it and rerun: Snakemake remakes it with target_continuations"
    try:
        cont = read_json(path)
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError: a killed or damaged write
        raise DataError(f"{path}: not a complete JSON file ({' '.join(str(e).split())[:120]}); {redo}") from e
    items = cont.get("items") if isinstance(cont, dict) else None
    if (not isinstance(items, list) or "eos_id" not in cont
            or not all(isinstance(it, dict) and isinstance(it.get("prompt"), list)
                       and isinstance(it.get("continuation"), list) for it in items)):
        raise DataError(f"{path}: expected {{'eos_id', 'items': [{{'prompt', 'continuation'}}]}}; {redo}")
    return cont
