"""alpha_k, MAT, retention and the theory formulas against values worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from kvshot.metrics import alpha, bootstrap, chain_counts, expected_speedup, expected_tokens, mat, retention

# four drafting rounds, K = 4; worked out by hand:
#   reached  = [4, 3, 2, 1]  (round 2 fails step 0; round 1 fails step 1; round 0 fails step 2)
#   accepted = [3, 2, 1, 0]
#   alpha = [3/4, 2/3, 1/2, 0]; MAT = 1 + 3/4 + 1/2 + 1/4 + 0 = 2.5; retention = 0
CORRECT = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def test_hand_worked_chain_example():
    reached, accepted = chain_counts(CORRECT)
    assert reached.tolist() == [4, 3, 2, 1] and accepted.tolist() == [3, 2, 1, 0]
    a = alpha(reached, accepted)
    assert a == pytest.approx([0.75, 2 / 3, 0.5, 0.0])
    assert mat(a) == pytest.approx(2.5)
    assert retention(a) == 0.0
    # the unconditional rate is a different number: step 3 is right in 3 of 4 rounds
    assert CORRECT.float().mean(0).tolist()[3] == 0.75


def test_mat_of_constant_alpha_matches_leviathan():
    a, k = 0.8, 7
    assert mat([a] * k) == pytest.approx(expected_tokens(a, k))
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert expected_tokens(1.0, 5) == 6


def test_retention_and_nan_steps():
    assert retention([0.8, 0.6, 0.4]) == pytest.approx(0.5)
    assert mat([0.5, float("nan"), 0.5]) == pytest.approx(1.5)  # no rounds reached step 1
    assert math.isnan(alpha(torch.tensor([2, 0]), torch.tensor([0, 0]))[1])


def test_bootstrap_interval_contains_the_estimate_and_shrinks_with_data():
    gen = torch.Generator().manual_seed(0)
    small = torch.rand(20, 7, generator=gen) < 0.7
    big = torch.rand(2000, 7, generator=gen) < 0.7

    def per_seq(correct, seqs):
        rows = correct.view(seqs, -1, 7)
        counts = [chain_counts(r) for r in rows]
        return torch.stack([c[0] for c in counts]), torch.stack([c[1] for c in counts])

    widths = []
    for correct, seqs in ((small, 4), (big, 40)):
        r, a = per_seq(correct, seqs)
        point = alpha(r.sum(0), a.sum(0))
        ci = bootstrap(r, a, samples=400, seed=1)
        assert ci["alpha_ci"][0][0] <= point[0] <= ci["alpha_ci"][0][1]
        assert ci["mat_ci"][0] <= mat(point) <= ci["mat_ci"][1]
        widths.append(ci["alpha_ci"][0][1] - ci["alpha_ci"][0][0])
    assert widths[1] < widths[0]
    r, a = per_seq(big, 40)
    assert bootstrap(r, a, samples=50, seed=3) == bootstrap(r, a, samples=50, seed=3)
