"""The drafter's TTT objective weighs every token alike, whatever the length grouping: each
step's summed loss is divided by the run's fixed token budget B_k (`schedule.token_budget`,
`train.loss_denominators`), not by that step's own token count, which under length grouping
gave a step of short sequences as much weight as a step of long ones (issue 37)."""
from __future__ import annotations

import random

import pytest

from kvshot.core.schedule import epoch_order, token_budget
from kvshot.train.loop import loss_denominators

BUCKETS = [(0, 256), (256, 512), (512, 1024), (1024, 2048)]   # token positions; the last: "at or beyond 1,024"
STEPS, DECAY, BATCH, GROUP, MAX_LEN = 3, 0.8, 8, 64, 2048


def long_tailed(n: int = 4096) -> list[int]:
    rng = random.Random(0)
    return [min(MAX_LEN, max(8, int(rng.lognormvariate(6.0, 1.1)))) for _ in range(n)]


def overlap(lo: int, hi: int, a: int, b: int) -> int:
    """Positions in [lo, hi) and [a, b)."""
    return max(0, min(hi, b) - max(lo, a))


def labels(length: int, k: int, lo: int, hi: int) -> int:
    """Step k's labels of a sequence at positions in [lo, hi): x_{t+k+2} for anchors t, i.e. positions k+2..L-1."""
    return overlap(lo, hi, k + 2, length)


def shares(lengths: list[int], group: int, world: int, rule: str) -> tuple[list[float], list[float]]:
    """Each bucket's share of the trained tokens and of the loss weight over one epoch of steps
    (every token an assistant token). rule "budget": the trainer's denominators, each process
    dividing its share of the step by them and DDP averaging over processes; "own": the step's
    own label count (the rule before issue 37)."""
    order = epoch_order(len(lengths), 0, 0, BATCH, group, lengths)
    denominators = loss_denominators(token_budget(lengths, BATCH, STEPS), world).tolist()
    tokens, weight = [0.0] * len(BUCKETS), [0.0] * len(BUCKETS)
    for b in range(len(lengths) // BATCH):
        step = order[b * BATCH: (b + 1) * BATCH]
        own = [sum(labels(lengths[i], k, 0, MAX_LEN) for i in step) for k in range(STEPS)]
        for rank in range(world):
            for i in step[rank::world]:   # this process's share of the step (`train.step_ids`)
                for j, (lo, hi) in enumerate(BUCKETS):
                    tokens[j] += overlap(lo, hi, 0, lengths[i])
                    for k in range(STEPS):
                        per_token = DECAY ** k / (denominators[k] if rule == "budget" else own[k] / world)
                        weight[j] += labels(lengths[i], k, lo, hi) * per_token / world   # DDP: mean over processes
    return [t / sum(tokens) for t in tokens], [w / sum(weight) for w in weight]


@pytest.mark.parametrize("group", [0, GROUP])
@pytest.mark.parametrize("world", [1, 2])
def test_each_length_buckets_loss_weight_is_its_token_share(group, world):
    lengths = long_tailed()
    tokens, weight = shares(lengths, group, world, "budget")
    assert 0.15 < tokens[-1] < 0.25   # long-tailed: positions >= 1,024 hold about a fifth of the tokens
    for t, w in zip(tokens, weight):
        assert abs(w - t) < 0.01, (tokens, weight)


def test_the_steps_own_count_underweighs_long_sequences_under_grouping():
    """What the test above guards against: with each step divided by its own label count, the
    length-grouped steps give the tokens at positions >= 1,024 far less than their share."""
    lengths = long_tailed()
    tokens, weight = shares(lengths, GROUP, 1, "own")
    assert weight[-1] < tokens[-1] - 0.05, (tokens, weight)
    _, plain = shares(lengths, 0, 1, "own")
    assert abs(plain[-1] - tokens[-1]) < abs(weight[-1] - tokens[-1])


def test_the_budget_is_the_expected_labels_of_a_global_batch():
    """B_k = batch_size * assistant share * mean max(0, L - k - 2): a constant of the data and
    the global batch, not of the process count; each process divides by B_k / world."""
    lengths = [10, 3, 50, 1]
    assert token_budget(lengths, 4, 2, 0.5) == [4 * 0.5 * (8 + 1 + 48 + 0) / 4, 4 * 0.5 * (7 + 0 + 47 + 0) / 4]
    assert token_budget([1, 2], 2, 1) == [1.0]   # never below 1
    assert loss_denominators([8.0, 6.0], 2).tolist() == [4.0, 3.0]
