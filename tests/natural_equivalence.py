"""The natural protocol both ways on the same anchors: per anchor (its real prefix plus the
target's `generate` rollout as one item, `stepwise.chain_correct_many`, the reference) and at
one pass per conversation (`branches.branch_rollouts`, `natural.natural_results`). Shared by the
toy Qwen3 (tests/unit/test_decode.py) and tiny Llama (tests/unit/test_llama_target.py) worlds."""
from __future__ import annotations

import torch

from kvshot.evaluate.branches import branch_items, branch_rollouts, conversation_anchors, rollout
from kvshot.evaluate.natural import by_anchor, natural_results
from kvshot.evaluate.stepwise import chain_correct_many

MAX_PREFIX = 96
ANCHORS = 48          # a seeded cap over the eval conversations: every test paradigm on the same anchors


def natural_world(target, tok, conversations: list[list[dict]], steps: int) -> dict:
    """The anchors, their branches, and each anchor's `generate` rollout from its own prefix."""
    convs = conversation_anchors(conversations, tok, ANCHORS, MAX_PREFIX, seed=0)
    tokens = steps + 1
    for conv in convs:
        conv["branches"] = branch_rollouts(target, conv["ids"], conv["anchors"], tokens, "cpu")
    generated = []
    for conv in convs:
        for a in conv["anchors"]:
            x = torch.tensor([conv["ids"][: a + 1]])
            g = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=tokens,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            generated.append(g[0, x.shape[1]:].tolist())
    return {"convs": convs, "generated": generated, "tokens": tokens, "eos": tok.eos_token_id}


def rollouts_match(world: dict) -> int:
    """How many anchors' branches (cut as generate cuts them) differ from generate."""
    branches = [rollout(b, world["tokens"], world["eos"]) for c in world["convs"] for b in c["branches"]]
    return sum(b != g for b, g in zip(branches, world["generated"]))


def both_ways(target, drafters: list, aux, steps: int, world: dict, convs: list[dict] | None = None):
    """Per anchor (conversation, t): chain length and teacher-forced row, from the per-anchor
    reference on generate's rollouts and from the one-pass path on `convs` (default the world's)."""
    convs = world["convs"] if convs is None else convs
    items, i = [], 0
    for conv in world["convs"]:
        for it in branch_items(conv):
            items.append(it | {"continuation": world["generated"][i]})
            i += 1
    ref = by_anchor(((it["conversation"], r) for it, r in
                     zip(items, chain_correct_many(drafters, target, items, aux, steps, 8, "cpu"))), len(drafters))
    results = natural_results(drafters, target, convs, aux, steps, world["tokens"], world["eos"], 3, "cpu")
    return ref, by_anchor(((c["conversation"], r) for c, r in zip(convs, results)), len(drafters))


def disagreements(ref: dict, new: dict) -> int:
    """Anchors scored by one path only, or with another chain length or teacher-forced row."""
    return len(ref.keys() ^ new.keys()) + sum(ref[k] != new[k] for k in ref.keys() & new.keys())
