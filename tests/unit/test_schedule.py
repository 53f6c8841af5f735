"""The trainers' schedules: the learning rate (beside the drafter trainer, the target's
pretraining reads it from there) and a drafter epoch's sample order, optionally length-grouped."""
from __future__ import annotations

import random

import torch

from kvshot.capture import target
from kvshot.core.schedule import epoch_order, lr_at


def test_lr_warms_up_then_decays_to_its_floor():
    assert target.lr_at is lr_at
    assert [lr_at(s, 100, 10, 0.1) for s in (0, 9)] == [0.1, 1.0]
    assert lr_at(10, 100, 10, 0.1) == 1.0 and abs(lr_at(100, 100, 10, 0.1) - 0.1) < 1e-12


def test_without_grouping_the_order_is_the_seeded_permutation():
    """What the trainer always read: a default run's batches do not change."""
    for group in (0, 1):
        assert epoch_order(37, 5, 2, 4, group, list(range(37))) == \
            torch.randperm(37, generator=torch.Generator().manual_seed(5 * 1_000_003 + 2)).tolist()


def test_length_grouped_batches_hold_similar_lengths_in_shuffled_order():
    rng = random.Random(0)
    n, bs, group = 203, 8, 5
    lengths = [rng.randint(10, 2048) for _ in range(n)]
    order = epoch_order(n, 1, 0, bs, group, lengths)
    assert sorted(order) == list(range(n)) and order == epoch_order(n, 1, 0, bs, group, lengths)
    assert order != epoch_order(n, 1, 1, bs, group, lengths)   # each epoch its own
    plain = epoch_order(n, 1, 0)
    window = bs * group
    for w in range(0, n, window):   # a window: the same shuffled samples, sorted into batches
        ids = sorted(plain[w: w + window], key=lambda i: (lengths[i], i))
        full = len(ids) // bs
        batches = sorted(tuple(order[w + b * bs: w + (b + 1) * bs]) for b in range(full))
        assert batches == sorted(tuple(ids[b * bs: (b + 1) * bs]) for b in range(full))
        assert order[w + full * bs: w + window] == ids[full * bs:]   # the tail no step reads stays last
    starts = [lengths[order[b * bs]] for b in range(n // bs)]
    assert starts != sorted(starts)   # the steps do not go from short to long

    def padded(o):   # what a step pads to: its longest sequence
        return sum(max(lengths[i] for i in o[b * bs: (b + 1) * bs]) * bs for b in range(n // bs))
    assert padded(order) < 0.7 * padded(plain)
