"""The natural protocol two ways on the same anchors, side by side in one run:

per anchor     each anchor its own prompt: the target's greedy rollout from its real prefix
               (`generate`, batched with left padding, as the stage did before), then one
               target forward over prefix + rollout per anchor, drafted from that one row;
one pass       one target pass per conversation plus K batched rounds for every branch
               (`branches.branch_rollouts`), then one forward per batch of conversations and
               one teacher-forced unroll over every anchor (`natural.natural_results`).

Prints the target tokens computed per anchor (query tokens fed to the target, padding
included) and the wall seconds per anchor of each, their ratios, and how many anchors the two
score differently (chain length or teacher-forced row). Targets: >= 20x fewer tokens, >= 10x
less wall time, no disagreement; exits non-zero when one is missed.

    python benchmarks/natural.py [--config config/config.yaml] [--conversations 8] [--anchors N]
    python benchmarks/natural.py --config config/config.yaml config/smollm2.yaml --conversations 1

It reads the run's target (results/target/model: `snakemake results/target/model --cores all`
with the same config) and eval split, and drafts with one fresh drafter per paradigm of the
config (the comparison is of the protocol's arithmetic, not of trained drafters).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from kvshot.core import numerics

numerics.apply_for_script()   # before torch: the pipeline's numerics (KVSHOT_NUMERICS=native: this machine's own)
import torch  # noqa: E402

from kvshot.capture.target import load_target
from kvshot.config import runtime, typed_config
from kvshot.core.taps import default_aux_layers
from kvshot.data.sources import read_jsonl
from kvshot.data.tokenizer import load_tokenizer
from kvshot.evaluate.branches import natural_conversations, rollout
from kvshot.evaluate.natural import by_anchor, natural_results
from kvshot.evaluate.stepwise import chain_correct_many
from kvshot.train.variants import build_variant, variant_config

TOKEN_RATIO, WALL_RATIO = 20.0, 10.0


@torch.no_grad()
def per_anchor_rollouts(target, prompts: list[list[int]], tokens: int, eos_id, pad_id: int,
                        batch_size: int) -> tuple[list[list[int]], int]:
    """The removed per-anchor rollouts, for the comparison: generate from every prefix (sorted
    by length, left padded), each ending after its first EOS. Returns them and the target tokens."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    fed = 0
    for i in range(0, len(order), batch_size):
        group = order[i: i + batch_size]
        width = max(len(prompts[j]) for j in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, j in enumerate(group):
            ids[r, width - len(prompts[j]):] = torch.tensor(prompts[j])
            mask[r, width - len(prompts[j]):] = 1
        gen = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=tokens, eos_token_id=eos_id,
                              pad_token_id=pad_id)[:, width:]
        fed += len(group) * (width + gen.shape[1] - 1)   # the prefill, then one token a row per step
        for r, j in enumerate(group):
            toks = gen[r].tolist()
            out[j] = rollout(toks, tokens, eos_id)
    return out, fed


def per_anchor(target, tok, convs: list[dict], drafters, aux, steps: int, tokens: int, batch_size: int) -> dict:
    start = time.perf_counter()
    items = [{"conversation": c["conversation"], "prompt": c["ids"][: a + 1], "anchors": [a]}
             for c in convs for a in c["anchors"]]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rollouts, fed = per_anchor_rollouts(target, [it["prompt"] for it in items], tokens, tok.eos_token_id, pad,
                                        batch_size)
    items = [it | {"continuation": r} for it, r in zip(items, rollouts)]
    order = sorted(range(len(items)), key=lambda i: len(items[i]["prompt"]) + len(items[i]["continuation"]))
    items = [items[i] for i in order]
    for b in range(0, len(items), batch_size):   # the step-wise forward: every batch padded to its longest
        fed += len(items[b: b + batch_size]) * max(len(it["prompt"]) + len(it["continuation"])
                                                    for it in items[b: b + batch_size])
    results = chain_correct_many(drafters, target, items, aux, steps, batch_size, "cpu")
    scores = by_anchor(((it["conversation"], r) for it, r in zip(items, results)), len(drafters))
    return {"seconds": time.perf_counter() - start, "target_tokens": fed, "scores": scores}


def one_pass(target, tok, conversations, cap, ncfg, drafters, aux, steps: int, tokens: int, seed: int) -> dict:
    start = time.perf_counter()
    # tokens >= K + 1: the config check (checks.py) holds eval.natural.rollout_tokens to it
    convs = natural_conversations(target, tok, conversations, cap, ncfg.max_prefix_len, tokens, seed, "cpu")
    with_anchors = [c for c in convs if c["anchors"]]
    fed = sum(len(c["ids"]) + len(c["anchors"]) * (tokens - 1) for c in with_anchors)
    for b in range(0, len(convs), ncfg.batch_size):   # the step-wise pass over the real text, padded per batch
        group = convs[b: b + ncfg.batch_size]
        fed += len(group) * max(len(c["ids"]) for c in group)
    results = natural_results(drafters, target, convs, aux, steps, tokens, tok.eos_token_id, ncfg.batch_size, "cpu")
    scores = by_anchor(((c["conversation"], r) for c, r in zip(convs, results)), len(drafters))
    return {"seconds": time.perf_counter() - start, "target_tokens": fed, "scores": scores, "convs": convs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", nargs="+", default=["config/config.yaml"])
    ap.add_argument("--conversations", type=int, default=8, help="held-out conversations (the first N)")
    ap.add_argument("--anchors", type=int, default=None, help="a cap on the anchors (default: every one)")
    ap.add_argument("--target", default="results/target/model")
    ap.add_argument("--eval", default="results/data/eval.jsonl")
    args = ap.parse_args()
    cfg = typed_config(args.config)
    rt = runtime(cfg)
    torch.set_num_threads(rt.threads)
    for path in (args.target, args.eval):
        if not Path(path).exists():
            print(f"{path}: missing; make it first: snakemake {path} --cores all --configfile {' '.join(args.config)}",
                  file=sys.stderr)
            return 2
    target = load_target(args.target, dataclasses.replace(rt, device="cpu", dtype="float32"), "sdpa")
    tok = load_tokenizer(args.target)
    ncfg, steps = cfg.eval.natural, cfg.drafters.ttt_steps
    conversations = [c["messages"] for c in read_jsonl(args.eval)[: args.conversations]]
    paradigms: dict[str, object] = {}
    for v in cfg.all_variants():
        paradigms.setdefault(v.paradigm, variant_config(cfg, v.name))
    drafters = []
    for i, v in enumerate(paradigms.values()):
        torch.manual_seed(i)
        d2t = torch.arange(cfg.drafters.draft_vocab_size)
        drafters.append(build_variant(v, target.config, target.model.embed_tokens.weight.detach(), d2t, target).eval())
    aux = tuple(cfg.features.aux_layers) if cfg.features.aux_layers else default_aux_layers(
        target.config.num_hidden_layers, cfg.features.aux_rule)
    fast = one_pass(target, tok, conversations, args.anchors, ncfg, drafters, aux, steps, ncfg.rollout_tokens,
                    cfg.seed)
    anchors = sum(len(c["anchors"]) for c in fast["convs"])
    slow = per_anchor(target, tok, fast["convs"], drafters, aux, steps, ncfg.rollout_tokens, 16)
    differ = sum(len(a.keys() ^ b.keys()) + sum(a[k] != b[k] for k in a.keys() & b.keys())
                 for a, b in zip(slow["scores"], fast["scores"]))
    scored = len(fast["scores"][0])
    rows = {"config": args.config, "threads": rt.threads, "conversations": len(conversations), "anchors": anchors,
            "scored": scored, "paradigms": list(paradigms),
            "per_anchor": {"target_tokens_per_anchor": slow["target_tokens"] / anchors,
                           "seconds_per_anchor": slow["seconds"] / anchors},
            "one_pass": {"target_tokens_per_anchor": fast["target_tokens"] / anchors,
                         "seconds_per_anchor": fast["seconds"] / anchors},
            "disagreements": differ}
    rows["token_ratio"] = slow["target_tokens"] / fast["target_tokens"]
    rows["wall_ratio"] = slow["seconds"] / fast["seconds"]
    print(json.dumps(rows, indent=1))
    ok = rows["token_ratio"] >= TOKEN_RATIO and rows["wall_ratio"] >= WALL_RATIO and differ == 0
    print(f"target tokens per anchor: {rows['token_ratio']:.1f}x fewer (target {TOKEN_RATIO:.0f}x); wall per anchor: "
          f"{rows['wall_ratio']:.1f}x less (target {WALL_RATIO:.0f}x); anchors scored differently: {differ} of {scored} "
          f"-> {'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
