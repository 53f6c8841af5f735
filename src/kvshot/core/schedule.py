"""What the trainers do when: the learning rate per step (the target's pretraining and the
drafters' TTT training), a drafter epoch's sample order, optionally grouped by length, and
the per-step token budget that normalises the drafter's loss whatever the grouping."""
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


def token_budget(lengths: list[int], batch_size: int, steps: int, assistant_share: float = 1.0) -> list[float]:
    """The TTT loss's normaliser per step k, one constant for the whole run (docs/training.md):
    the expected number of step-k labels in a global batch,
        B_k = batch_size * assistant_share * mean_i max(0, L_i - k - 2),
    L_i the train samples' lengths as trained (`sample_lengths`): step k at anchor t is scored
    against x_{t+k+2}, so a sequence of L tokens has L - k - 2 anchors with a label when every
    token is an assistant token; assistant_share (the split's assistant tokens over its tokens,
    from the feature index) scales that to the assistant tokens. Dividing each step's summed
    per-token loss by B_k (not by that step's own count) gives every token the same weight
    whichever step, length group or process it lands in. A function of the index and the
    config alone: the same on every process, for every world size, seed and resume."""
    n = max(len(lengths), 1)
    return [max(batch_size * assistant_share * sum(max(0, L - k - 2) for L in lengths) / n, 1.0)
            for k in range(steps)]


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
