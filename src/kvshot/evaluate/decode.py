"""End-to-end speculative decoding with a kvshot drafter (batch size 1), and a plain
decoding baseline timed by the same harness.

One round, after the target has computed (and accepted) positions <= n_past - 1 and the
last token x[n_past] (its bonus) is known but not yet in its cache:

  draft   the drafter ingests the newly accepted anchors (step 0 over all of them; the
          hidden-state paradigms extend their own prefix cache), then only the last anchor
          drafts on: a chain of K tokens, or an EAGLE-2 style tree (top-k expansion of the
          best nodes per depth, then the best `total_tokens` nodes overall);
  verify  one target forward over [x[n_past]] + draft nodes with a tree attention mask
          (cache + ancestors; a chain uses HF's own causal mask), positions n_past + depth;
          a target loaded with flash-attn verifies trees with SDPA (`tree_mask_attention`);
          greedy (output identical to `target.generate(do_sample=False)`) or speculative
          sampling at a temperature, no top-k/top-p, on chains and trees (`verify_sampling`:
          each node's drafted children, sampled without replacement from q, are tried in turn
          against the residual; the output follows the target's distribution exactly);
  keep    the target's cache keeps the accepted path (gathered into place, then cropped),
          whose positions become the next round's anchors.

tau = tokens emitted by verification rounds / rounds: accepted drafts plus the bonus token
per round, the quantity EAGLE counts as accept_length + 1. The first token comes from the
prefill, which verifies nothing, so tau = (len(tokens) - 1) / rounds.

Batch size 1, as EAGLE's and the paper's HF decoder: rows of a batch accept different
lengths, which would need per-row cache lengths and padding masks in every round.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor
from transformers import DynamicCache

from kvshot.config import drafter_autocast
from kvshot.drafters import Drafter
from kvshot.drafters.skeleton import StepState
from kvshot.evaluate.draft_tree import DraftSpec, draft, tree_attention, verify_greedy, verify_sampling


@dataclass
class DecodeResult:
    tokens: list[int]                      # generated tokens (prompt excluded), eos included
    rounds: int                            # verification forwards (plain decoding: decode forwards)
    accepted: list[int] = field(default_factory=list)   # per round: draft tokens the target accepted
    emitted: list[int] = field(default_factory=list)    # per round: tokens added (accepted + bonus, clipped)
    drafted: list[int] = field(default_factory=list)    # per round: draft nodes verified
    stopped_by: str = "max_new_tokens"     # eos | max_new_tokens
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    verify_attention: str = ""             # the attention implementation tree rounds verified with
    top2: list[tuple[float, float]] = field(default_factory=list)   # plain decoding: the target's two
    #                                        largest logits for each token, to classify divergences

    @property
    def tau(self) -> float:
        return sum(self.emitted) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau, "tokens_per_s": self.tokens_per_s}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":   # kernels are asynchronous: time what ran, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _pick(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The next token from one row of target logits: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _remove_after(cache: DynamicCache, length: int) -> None:
    """Crop the cache to `length` tokens. A negative count works for transformers 4.x
    (crop(max_length), negative: remove) and 5.x (crop(-tokens_to_remove))."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_path(cache: DynamicCache, n_past: int, path: list[int]) -> None:
    """Keep the cache entries of the accepted tree rows `path` (ascending, root first)
    right after the prefix, then drop the rest of the tree."""
    if path != list(range(len(path))):   # a chain's path is a prefix: cropping suffices
        src = torch.tensor(path, device=cache.layers[0].keys.device) + n_past
        for layer in cache.layers:
            layer.keys[:, :, n_past: n_past + len(path)] = layer.keys[:, :, src]
            layer.values[:, :, n_past: n_past + len(path)] = layer.values[:, :, src]
    _remove_after(cache, n_past + len(path))


def drafter_context(cache: DynamicCache, hidden_states: Sequence[Tensor] | None, rows: Tensor,
                    aux_layers: Sequence[int] | None, kv_layers: Sequence[int], dtype: torch.dtype,
                    first_ids: Tensor | None = None) -> dict[str, Tensor]:
    """What a drafter reads of the target: aux hidden states at the new anchor rows and the
    target's own cache for the whole prefix (a view, transposed to [B, T, H_kv, D]); in the
    first round also the first token [B, 1], which no anchor's step reads (a standalone LM sees it)."""
    ctx: dict[str, Tensor] = {} if first_ids is None else {"first_ids": first_ids}
    if aux_layers:
        ctx["aux_hidden"] = torch.stack([hidden_states[i][:, rows] for i in aux_layers], dim=2).to(dtype)
    for l in kv_layers:
        ctx[f"key_{l}"] = cache.layers[l].keys.transpose(1, 2).to(dtype)
        ctx[f"value_{l}"] = cache.layers[l].values.transpose(1, 2).to(dtype)
    return ctx


# Implementations that take kvshot's additive 4D tree mask. flash-attn (and other kernels
# that only know causal/padding masks) would silently ignore a tree's branches.
TREE_MASK_ATTENTION = ("sdpa", "eager")


@contextmanager
def tree_mask_attention(target) -> Iterator[str]:
    """Run the target with an implementation that takes a 4D mask for the enclosed calls.
    Every attention layer reads `config._attn_implementation` per call, and the KV cache
    layout does not depend on it, so a flash-attn target verifies trees with SDPA and goes
    back to flash-attn for the prefill and chain rounds."""
    loaded = target.config._attn_implementation
    if loaded in TREE_MASK_ATTENTION:
        yield loaded
        return
    target.config._attn_implementation = "sdpa"
    try:
        yield "sdpa"
    finally:
        target.config._attn_implementation = loaded


def _forward(target, ids: list[int], positions: Tensor, cache: DynamicCache, mask: Tensor | None,
             hidden: bool, device: torch.device, last_only: bool = False):
    """The decoder body (filling `cache`), then the LM head on the rows that are needed: a
    prefill needs only its last row (a 152k vocabulary over a whole prompt is large)."""
    with torch.autocast(device.type, enabled=False):   # the target in its own dtype, inside drafting's autocast
        out = target.model(input_ids=torch.tensor([ids], device=device), position_ids=positions[None],
                           attention_mask=mask, past_key_values=cache, use_cache=True, output_hidden_states=hidden)
        h = out.last_hidden_state[0, -1:] if last_only else out.last_hidden_state[0]
        return target.lm_head(h), out.hidden_states


def _append(tokens: list[int], new: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[int, str | None]:
    """Append up to the first eos (kept) or max_new_tokens; returns (added, why it stopped)."""
    for n, tok in enumerate(new, start=1):
        tokens.append(tok)
        if eos_token_id is not None and tok == eos_token_id:
            return n, "eos"
        if len(tokens) >= max_new_tokens:
            return n, "max_new_tokens"
    return len(new), None


def speculative_generate(target, drafter: Drafter, input_ids: Tensor, max_new_tokens: int,
                         eos_token_id: int | None = None, aux_layers: Sequence[int] | None = None,
                         spec: DraftSpec | None = None, temperature: float = 0.0,
                         generator: torch.Generator | None = None, precision: str = "float32") -> DecodeResult:
    """Speculative decoding, batch size 1. `aux_layers`: HF hidden_states indices the drafter
    fuses (the features index's spec.aux_layers; None for a drafter that reads none);
    the drafter reads the target KV of `drafter.cfg.kv_layers`. temperature 0: greedy.
    precision: the runtime dtype the drafter was trained and evaluated step-wise in
    (`config.drafter_autocast`: bf16 autocast over its fp32 weights); one autocast region spans
    the call, so each weight is cast once per call (autocast's cache), not once per round."""
    with drafter_autocast(input_ids.device.type, precision):
        return _speculative_generate(target, drafter, input_ids, max_new_tokens, eos_token_id, aux_layers, spec,
                                     temperature, generator)


@torch.inference_mode()   # no autograd bookkeeping at all: many small ops per round
def _speculative_generate(target, drafter: Drafter, input_ids: Tensor, max_new_tokens: int,
                          eos_token_id: int | None, aux_layers: Sequence[int] | None, spec: DraftSpec | None,
                          temperature: float, generator: torch.Generator | None) -> DecodeResult:
    if input_ids.shape[0] != 1 or max_new_tokens < 1:
        raise ValueError(f"speculative_generate: batch size 1 and max_new_tokens >= 1, got "
                         f"{input_ids.shape[0]} and {max_new_tokens}")
    spec = spec or DraftSpec()
    device = input_ids.device
    dtype = drafter.compute_dtype()   # what the target's context is cast to (bf16 under autocast)
    kv_layers = list(drafter.cfg.kv_layers)
    seq = input_ids[0].tolist()
    res = DecodeResult(tokens=[], rounds=0)
    start = _clock(device)

    cache = DynamicCache(config=target.config)
    n_past = len(seq)
    logits, hidden = _forward(target, seq, torch.arange(n_past, device=device), cache, None, bool(aux_layers), device,
                              last_only=True)
    _, stop = _append(res.tokens, [_pick(logits[-1], temperature, generator)], max_new_tokens, eos_token_id)
    rows, lo = torch.arange(n_past, device=device), 0          # the new anchors' rows and first position
    state: StepState | None = None
    res.prefill_s = _clock(device) - start
    while stop is None:
        t0 = _clock(device)
        seq = input_ids[0].tolist() + res.tokens
        ctx = drafter_context(cache, hidden, rows, aux_layers, kv_layers, dtype, input_ids[:, :1] if state is None else None)
        anchors = torch.arange(lo, n_past, device=device)[None]
        state = drafter.begin(ctx, anchors, previous=state)
        d = draft(drafter, state, torch.tensor([seq[lo + 1: n_past + 1]], device=device), anchors, spec,
                  temperature, generator)
        t1 = _clock(device)

        positions = n_past + torch.tensor([0] + d.depths, device=device)
        chain = d.parents == list(range(-1, len(d.parents) - 1))
        if chain:   # plain causal attention: HF builds that mask itself (flash-attn works too)
            logits, hidden = _forward(target, [seq[n_past]] + d.tokens, positions, cache, None, bool(aux_layers),
                                      device)
        else:
            with tree_mask_attention(target) as res.verify_attention:
                logits, hidden = _forward(target, [seq[n_past]] + d.tokens, positions, cache,
                                          tree_attention(d.parents, n_past, target.dtype, device),
                                          bool(aux_layers), device)
        if temperature > 0:
            path, bonus = verify_sampling(logits, d, drafter.d2t, temperature, generator)
        else:
            path, bonus = verify_greedy(logits, d)
        added, stop = _append(res.tokens, [d.tokens[i - 1] for i in path[1:]] + [bonus], max_new_tokens, eos_token_id)
        res.rounds += 1
        res.accepted.append(len(path) - 1)
        res.emitted.append(added)
        res.drafted.append(len(d.tokens))
        if stop is None:
            keep_path(cache, n_past, path)
            rows, lo, n_past = torch.tensor(path, device=device), n_past, n_past + len(path)
        res.draft_s += t1 - t0
        res.verify_s += _clock(device) - t1
    res.stopped_by = stop
    res.total_s = _clock(device) - start
    return res


@torch.inference_mode()   # no autograd bookkeeping at all: many small ops per round
def plain_generate(target, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> DecodeResult:
    """The baseline: the target alone, one token per forward, same cache and timing harness.
    `top2` keeps the two largest logits behind each token (a near-tie test for divergences)."""
    if input_ids.shape[0] != 1 or max_new_tokens < 1:
        raise ValueError(f"plain_generate: batch size 1 and max_new_tokens >= 1, got "
                         f"{input_ids.shape[0]} and {max_new_tokens}")
    device = input_ids.device
    res = DecodeResult(tokens=[], rounds=0)
    start = _clock(device)
    cache = DynamicCache(config=target.config)
    n_past = input_ids.shape[1]
    logits, _ = _forward(target, input_ids[0].tolist(), torch.arange(n_past, device=device), cache, None, False, device,
                         last_only=True)
    _, stop = _append(res.tokens, [_pick(logits[-1], temperature, generator)], max_new_tokens, eos_token_id)
    res.top2.append(tuple(logits[-1].float().topk(2).values.tolist()))
    res.prefill_s = _clock(device) - start
    while stop is None:
        logits, _ = _forward(target, res.tokens[-1:], torch.tensor([n_past], device=device), cache, None, False, device)
        n_past += 1
        added, stop = _append(res.tokens, [_pick(logits[-1], temperature, generator)], max_new_tokens, eos_token_id)
        res.top2.append(tuple(logits[-1].float().topk(2).values.tolist()))
        res.rounds += 1
        res.accepted.append(0)
        res.emitted.append(added)
        res.drafted.append(0)
    res.verify_s = _clock(device) - start - res.prefill_s
    res.stopped_by = stop
    res.total_s = _clock(device) - start
    return res
