"""What the trainers do when: the learning rate per step (the target's pretraining and the
drafters' TTT training) and a drafter epoch's sample order, optionally grouped by length."""
from __future__ import annotations

import math

import torch


def lr_at(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine down to min_ratio (a multiplier of the peak lr)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def sample_lengths(source, n: int, max_len: int) -> list[int]:
    """The first n samples' token counts as trained (truncated to max_len), from the feature
    index: no shard is read."""
    return [min(int(loc[2]), max_len) for loc in source.index["samples"][:n]]


def epoch_order(n: int, seed: int, epoch: int, batch_size: int = 1, group: int = 0,
                lengths: list[int] | None = None) -> list[int]:
    """Sample ids of one epoch, a function of (seed, epoch) alone, so a checkpoint's
    (epoch, cursor) resumes it. group > 1: within each window of batch_size * group shuffled
    samples, sorted by length and cut into batches whose order is shuffled again, so that a
    step's sequences have similar lengths (a DDP step waits for its longest) while the steps
    still come in random order. The tail that fills no batch stays last (no step reads it)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=gen).tolist()
    if group <= 1 or lengths is None:
        return order
    window, out = batch_size * group, []
    for w in range(0, n, window):
        ids = sorted(order[w: w + window], key=lambda i: (lengths[i], i))
        full = len(ids) // batch_size
        chunks = [ids[b * batch_size: (b + 1) * batch_size] for b in range(full)]
        for b in torch.randperm(full, generator=gen).tolist():
            out += chunks[b]
        out += ids[full * batch_size:]
    return out
