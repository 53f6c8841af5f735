"""The drafter's own prefix cache, written once for every paradigm that has one.

In the hidden-only, hybrid (its hidden path) and standalone drafters, step 0's keys of an
anchor are the prefix keys of every later anchor, as a causal LM's KV cache. Within an
unroll they grow by the anchors of that unroll. Between decoding rounds they carry over:
a round's `begin` gets the previous round's state and keeps its prefix.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .skeleton import DecoderLayer, Keys, Rotary, StepState


def carried_state(anchors: Tensor, slots: int, previous: StepState | None, valid: Tensor | None) -> StepState:
    """A new unroll's state with `slots` own-key slots (one per layer). Each keeps `previous`'s
    prefix in that slot (earlier rounds' anchors), or starts empty. `valid` [B, Tq]: which
    query rows are real (None: all of them)."""
    state = StepState(anchors=anchors, prefix=[], prefix_anchor=[], prefix_valid=[], extra={"valid": valid})
    state.add_slots(slots)
    if previous is not None:
        state.prefix[:] = previous.prefix[:slots]
        state.prefix_anchor[:] = previous.prefix_anchor[:slots]
        state.prefix_valid[:] = previous.prefix_valid[:slots]
    return state


def _extend(old: Tensor | None, new: Tensor, dim: int) -> Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def add_own_keys(state: StepState, slot: int, keys: Keys, k: int, valid: Tensor | None) -> None:
    """Step 0's keys join the prefix (this unroll's anchors); later steps' keys are diagonals
    (and step 0's too where the prefix is already written, `unroll.branch_unroll`)."""
    if k > 0 or not state.step0_prefix:
        state.diag[slot].append(keys)
        return
    old = state.prefix[slot]
    state.prefix[slot] = keys if old is None else Keys(torch.cat([old.k, keys.k], 2), torch.cat([old.v, keys.v], 2))
    old_anchor = state.prefix_anchor[slot]
    state.prefix_anchor[slot] = _extend(old_anchor, state.anchors, 1)
    old_valid = state.prefix_valid[slot]
    if valid is not None or old_valid is not None:   # a padding mask once either part has one
        valid = torch.ones_like(state.anchors, dtype=torch.bool) if valid is None else valid.bool()
        if old_anchor is not None and old_valid is None:
            old_valid = torch.ones_like(old_anchor, dtype=torch.bool)
        state.prefix_valid[slot] = _extend(old_valid if old_anchor is not None else None, valid, 1)


def self_attention(state: StepState, slot: int, layer: DecoderLayer, x: Tensor, rot: Rotary, k: int) -> Tensor:
    """A layer's attention over its own keys (`add_own_keys`); the query rows' padding mask is
    the state's."""
    q, keys = layer.self_attn.project(layer.attn_norm(x), rot)
    add_own_keys(state, slot, keys, k, state.extra.get("valid"))
    return layer.self_attn.attend(q, state.prefix[slot], state.mask(slot, q.dtype), state.diag[slot])
