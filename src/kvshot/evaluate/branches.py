"""The natural protocol at one target pass per conversation.

Every candidate anchor t of a held-out conversation (an assistant token followed by more
assistant text, t < max_prefix_len) is scored; the target computes the real text once:

  real pass  one forward over the conversation: at every t the target's greedy token after
             the real prefix <= t (the branch's first token c_0) and its KV cache;
  branches   the target's greedy rollout from every prefix at once, decoded as a tree with one
             branch per anchor: round j feeds c_{j-1} of every branch at position t + j, which
             sees the real prefix <= t and its own branch tokens < j-1 (a 4D mask over the
             cached real text, as the decoder's tree verification builds one), and gives c_j.

A branch is the token list c_0 .. c_{R-1}; it is not cut at EOS here (the target's token
after an EOS is still what the step-wise chain is scored on): `rollout` cuts it as a
`generate` rollout ends.
"""
from __future__ import annotations

import random
from typing import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from kvshot.core.progress import progress
from kvshot.data.chat import tokenize_conversation

# the attention scores one round may hold (fp32, every head, one layer): a conversation with
# more anchors than this allows is rolled out in chunks of anchors that share its real pass
ROUND_BYTES = 512 * 2 ** 20


def candidate_anchors(mask: list[int], length: int, max_prefix_len: int) -> list[int]:
    """Positions a whose token is assistant text followed by more of it, a < max_prefix_len."""
    return [a for a in range(min(length - 1, max_prefix_len)) if mask[a] and mask[a + 1]]


def conversation_anchors(conversations: list[list[dict]], tokenizer, cap: int | None, max_prefix_len: int,
                         seed: int) -> list[dict]:
    """Per conversation: its tokens up to the one after its last anchor, and its anchors, every candidate
    (`cap` None) or `cap` of them drawn over all conversations (seeded, without replacement).
    Conversations with no anchor are kept, with an empty list (the record counts them)."""
    out, candidates = [], []
    for c, msgs in enumerate(conversations):
        ids, mask = tokenize_conversation(tokenizer, msgs, max_prefix_len + 1)
        out.append({"conversation": c, "ids": ids, "anchors": []})
        candidates += [(c, a) for a in candidate_anchors(mask, len(ids), max_prefix_len)]
    if cap is not None:
        candidates = sorted(random.Random(seed).sample(candidates, min(cap, len(candidates))))
    for c, a in candidates:
        out[c]["anchors"].append(a)
    for conv in out:
        conv["ids"] = conv["ids"][: max(conv["anchors"], default=-2) + 2]   # past the last anchor's next token: not read
    return out


def branch_visibility(anchors: Tensor, n_real: int, rounds_done: int) -> Tensor:
    """[N, n_real + N * (rounds_done + 1)] bool: the keys branch token row i (anchor t_i) sees in a
    round: the real text <= t_i, then per earlier round and this one, its own branch key only."""
    real = torch.arange(n_real, device=anchors.device)[None, :] <= anchors[:, None]
    own = torch.eye(len(anchors), dtype=torch.bool, device=anchors.device)
    return torch.cat([real, *[own] * (rounds_done + 1)], dim=1)


Visibility = Callable[[Tensor, int, int], Tensor]


def anchor_chunk(n_real: int, n_anchors: int, rounds: int, heads: int) -> int:
    """Anchors per chunk: the most whose last round's scores fit ROUND_BYTES."""
    chunk = max(1, n_anchors)
    while chunk > 1 and heads * 4 * chunk * (n_real + chunk * rounds) > ROUND_BYTES:
        chunk = (chunk + 1) // 2
    return chunk


@torch.no_grad()
def branch_rollouts(target, ids: list[int], anchors: list[int], tokens: int, device: str,
                    visibility: Visibility = branch_visibility) -> list[list[int]]:
    """The target's greedy `tokens` after every anchor's real prefix: one pass over the real
    text, then tokens - 1 rounds that extend every branch by one token (`branch_visibility`;
    tests pass a broken one as a control). Returns one list of `tokens` per anchor, not cut at EOS."""
    if not anchors:
        return []
    x = torch.tensor([ids], device=device)
    with torch.autocast(torch.device(device).type, enabled=False):   # the target in its own dtype
        real = target.model(input_ids=x, use_cache=True)
        head = target.lm_head.weight
        first = (real.last_hidden_state[0] @ head.T).argmax(-1)                 # c_0 at every position
        cache = real.past_key_values
        n_real = len(ids)
        out: list[list[int]] = []
        chunk = anchor_chunk(n_real, len(anchors), tokens - 1, target.config.num_attention_heads)
        for lo in range(0, len(anchors), chunk):
            at = torch.tensor(anchors[lo: lo + chunk], device=device)
            branch = [first[at]]
            own = DynamicCache()
            for layer, src in enumerate(cache.layers):   # the real text's cache, shared by every chunk
                own.update(src.keys.clone(), src.values.clone(), layer)
            for j in range(1, tokens):
                visible = visibility(at, n_real, j - 1)
                mask = torch.zeros(visible.shape, dtype=head.dtype, device=device)
                mask = mask.masked_fill(~visible, torch.finfo(head.dtype).min)[None, None]
                step = target.model(input_ids=branch[-1][None], position_ids=(at + j)[None], attention_mask=mask,
                                    past_key_values=own, use_cache=True)
                branch.append((step.last_hidden_state[0] @ head.T).argmax(-1))
            out += torch.stack(branch, 1).tolist()
    return out


def rollout(branch: list[int], length: int, eos_id: int | None) -> list[int]:
    """A branch's first `length` tokens, ending after its first EOS as a `generate` rollout does."""
    toks = branch[:length]
    return toks[: toks.index(eos_id) + 1] if eos_id is not None and eos_id in toks else toks


def natural_conversations(target, tokenizer, conversations: list[list[dict]], cap: int | None, max_prefix_len: int,
                          tokens: int, seed: int, device: str) -> list[dict]:
    """`conversation_anchors` with each anchor's branch of `tokens` (`branch_rollouts`)."""
    convs = conversation_anchors(conversations, tokenizer, cap, max_prefix_len, seed)
    for conv in progress(convs, desc="natural branches", unit="conversation"):
        conv["branches"] = branch_rollouts(target, conv["ids"], conv["anchors"], tokens, device)
    return convs


def branch_items(conv: dict) -> list[dict]:
    """A conversation's anchors as the per-anchor items they replace: the real prefix up to the
    anchor, the branch as its continuation (for tests and the benchmark's per-anchor path)."""
    return [{"conversation": conv["conversation"], "prompt": conv["ids"][: a + 1], "continuation": b,
             "anchors": [a]} for a, b in zip(conv["anchors"], conv["branches"])]
