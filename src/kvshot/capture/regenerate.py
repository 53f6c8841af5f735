"""The optional `regenerate_data` stage: the target writes the training answers itself.

EAGLE-3 and SpecForge train drafters on the target's own responses, so the drafter learns
the distribution it has to predict at decode time rather than ShareGPT's (ChatGPT's) text.
Each conversation keeps its system and user turns; every assistant turn is replaced by what
the target generates for the conversation so far (with its own earlier answers), rendered
with the same chat template as training and eval (`chat.encode_prompt`: Qwen3 with thinking
disabled). Batched over conversations with left padding; greedy, or sampling at a temperature.

config data.regenerate: {enabled, max_new_tokens, batch_size, temperature, max_turns}; the
stage runs only when a rule asks for it (workflow/rules/regenerate.smk).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from kvshot.config import Runtime
from kvshot.core.progress import progress
from kvshot.core.ranked_writer import atomic_write
from kvshot.data.chat import encode_prompt
from kvshot.data.sources import read_jsonl
from kvshot.settings import Config, RegenerateSettings

@torch.no_grad()
def generate_batch(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   ) -> list[tuple[list[int], bool]]:
    """Left-padded batched generation: per prompt, the new tokens up to and without the first
    eos, and whether an eos ended it (False: cut at max_new_tokens)."""
    device = next(target.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=pad, **sampling)
    results = []
    for row in out[:, width:].tolist():
        ended = tokenizer.eos_token_id in row
        results.append((row[: row.index(tokenizer.eos_token_id)] if ended else row, ended))
    return results


def regenerate_conversations(target, tokenizer, conversations: list[dict], rcfg: RegenerateSettings) -> tuple[list[dict], dict]:
    """New conversations with the target's answers, and counts. Turn by turn over a batch of
    conversations: all first answers, then all second ones, ... An empty answer ends its
    conversation there (one without any answer is dropped)."""
    stats = {"conversations": len(conversations), "answers": 0, "tokens": 0, "cut_at_max_new_tokens": 0,
             "empty_answers": 0, "dropped": 0}
    out: list[dict] = []
    bs = rcfg.batch_size
    for first in progress(range(0, len(conversations), bs), desc="regenerate", unit="batch"):
        batch = conversations[first: first + bs]
        # per conversation: the messages up to each assistant turn's position, that turn dropped
        todo = [[i for i, m in enumerate(c["messages"]) if m["role"] == "assistant"][: rcfg.max_turns]
                for c in batch]
        new = [[] for _ in batch]          # the rewritten messages so far
        done = [0] * len(batch)            # messages of the original consumed so far
        alive = [True] * len(batch)
        for turn in range(max(map(len, todo), default=0)):
            active = [b for b in range(len(batch)) if alive[b] and turn < len(todo[b])]
            if not active:
                break
            prompts = []
            for b in active:
                upto = todo[b][turn]
                new[b] += [m for m in batch[b]["messages"][done[b]: upto] if m["role"] != "assistant"]
                done[b] = upto + 1
                prompts.append(encode_prompt(tokenizer, new[b], rcfg.max_prompt_len))
            for b, (ids, ended) in zip(active, generate_batch(target, tokenizer, prompts, rcfg.max_new_tokens,
                                                              rcfg.temperature)):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                if not text.strip():
                    stats["empty_answers"] += 1
                    alive[b] = False
                    continue
                new[b].append({"role": "assistant", "content": text})
                stats["answers"] += 1
                stats["tokens"] += len(ids)
                stats["cut_at_max_new_tokens"] += not ended
        for b, conv in enumerate(batch):
            while new[b] and new[b][-1]["role"] != "assistant":   # user turns left without an answer
                new[b].pop()
            if new[b]:
                out.append({"id": conv["id"], "messages": new[b]})
            else:
                stats["dropped"] += 1
    return out, stats


def run_regenerate_stage(cfg: Config, rt: Runtime, train_jsonl: str, target_dir: str, out_path: str) -> dict:
    from kvshot.capture.target import load_target
    from kvshot.data.tokenizer import load_tokenizer

    rcfg = replace(cfg.data.regenerate, max_prompt_len=min(cfg.data.regenerate.max_prompt_len, cfg.data.max_len))
    torch.manual_seed(rt.seed)
    target = load_target(target_dir, rt, cfg.target.attn_implementation)
    tokenizer = load_tokenizer(target_dir)
    start = time.time()
    convs, stats = regenerate_conversations(target, tokenizer, read_jsonl(train_jsonl), rcfg)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, (json.dumps(c, ensure_ascii=False) + "\n" for c in convs))
    stats.update(settings={k: v for k, v in asdict(rcfg).items() if k != "enabled"}, source=train_jsonl, target=target_dir,
                 seconds=time.time() - start, written=len(convs))
    atomic_write(out.with_name("stats.json"), [json.dumps(stats, indent=2) + "\n"])
    return {k: stats[k] for k in ("written", "answers", "tokens", "cut_at_max_new_tokens", "seconds")}
