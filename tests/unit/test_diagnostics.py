"""The training diagnostics measure what they name: the attention mass on the drafter's own
keys follows the scores (uniform attention gives the length formula, dominant own keys give 1),
and the hybrid's gate share is |g * delta| / |h|, zero when the gate is closed."""
from __future__ import annotations

import json

import pytest
import torch

from kvshot.drafters.skeleton import Diagonal
from kvshot.drafters.unroll import assistant_tokens, shift
from kvshot.train.diagnostics import attention_diagnostics, kv_key_share, own_key_mass

from .test_drafters import K, make


def test_own_key_mass_follows_the_scores():
    torch.manual_seed(0)
    b, h, hkv, tq, tp, s, d = 1, 4, 2, 6, 6, 3, 8
    q = torch.randn(b, h, tq, d)
    pk = torch.randn(b, hkv, tp, d)
    visible = torch.ones(tq, tp, dtype=torch.bool).tril()[None]          # row r sees prefix keys <= r
    zero_q = own_key_mass(torch.zeros_like(q), pk, visible, Diagonal(torch.randn(b, hkv, s, tq, d),
                                                                      torch.randn(b, hkv, s, tq, d)))
    rows = torch.arange(tq, dtype=torch.float32)
    assert torch.allclose(zero_q, (s / (rows + 1 + s)).expand(b, h, tq))   # uniform: the key count share
    # own keys aligned with each row's query (first head of each KV group) dominate; anti-aligned vanish
    aligned = q[:, ::h // hkv, None].expand(-1, -1, s, -1, -1)
    big = own_key_mass(q, pk, visible, Diagonal(20 * aligned, aligned))[:, ::h // hkv]
    small = own_key_mass(q, pk, visible, Diagonal(-20 * aligned, aligned))[:, ::h // hkv]
    assert float(big.min()) > 0.99 and float(small.max()) < 0.01
    assert float(own_key_mass(q, pk, visible, None).abs().max()) == 0.0


def test_kv_mass_is_measured_per_step_and_equals_the_length_formula_under_uniform_attention(drafter_world):
    src = drafter_world[0]
    batch = src.batch([0, 1])
    model = make(drafter_world, "kv")
    got = attention_diagnostics(model, batch, K, max_rows=10_000)
    mass = got["kv_own_key_mass_k"]
    assert len(mass) == K and all(0 < m < 1 for m in mass) and got["kv_own_key_mass"] == pytest.approx(sum(mass) / K)
    assert "gate_share" not in got
    with torch.no_grad():   # q = 0: every visible key gets the same weight
        for _, attn in model.kv_attentions():
            attn.q_norm.weight.zero_()
    uniform = attention_diagnostics(model, batch, K, max_rows=10_000)["kv_own_key_mass_k"]
    valid = [shift(assistant_tokens(batch), k + 2, False) for k in range(K)]
    for k in range(K):
        only_k = [torch.zeros_like(valid[0])] * k + [valid[k]]   # (k+1)/(t+k+2) over step k's rows
        assert uniform[k] == pytest.approx(kv_key_share(only_k), rel=1e-5)
    assert uniform != pytest.approx(mass, rel=1e-3)   # the trained-free queries do not attend uniformly
    # the diagnostic leaves the model as it was: no instance attribute shadows `attend`
    assert all("attend" not in vars(attn) for _, attn in model.kv_attentions())


def test_row_subsample_estimates_the_same_mass(drafter_world):
    src = drafter_world[0]
    model = make(drafter_world, "kv")
    batch = src.batch([0, 1])
    every = attention_diagnostics(model, batch, K, max_rows=10_000)["kv_own_key_mass"]
    some = attention_diagnostics(model, batch, K, max_rows=8)["kv_own_key_mass"]
    assert some == pytest.approx(every, abs=0.15) and some != every


def test_gate_share_is_zero_with_a_closed_gate_and_grows_with_it(drafter_world):
    src = drafter_world[0]
    batch = src.batch([0, 1])
    model = make(drafter_world, "hybrid")
    shares = {}
    for logit in (-float("inf"), -2.0, 2.0):
        with torch.no_grad():
            model.gate_logit.fill_(logit)
        got = attention_diagnostics(model, batch, K)
        assert len(got["gate_share"]) == model.cfg.num_layers and len(got["kv_own_key_mass_k"]) == K
        shares[logit] = got["gate_share"]
    assert shares[-float("inf")] == [0.0] * model.cfg.num_layers
    assert 0 < shares[-2.0][0] < shares[2.0][0]
    assert model.gate_probe is None


def test_hidden_only_drafter_has_no_diagnostics(drafter_world):
    assert attention_diagnostics(make(drafter_world, "hidden"), drafter_world[0].batch([0]), K) == {}


def test_train_log_carries_the_measured_diagnostics(tiny, tiny_features, tmp_path):
    from .test_train import run, small_cfg

    cfg = small_cfg(tiny, max_steps=2, log_every=1)
    run(tiny, tiny_features, cfg, tmp_path / "hyb", "hyb")
    log = json.loads((tmp_path / "hyb" / "train_log.json").read_text())
    steps = cfg["drafters"]["ttt_steps"]
    for rec in log:
        assert len(rec["kv_own_key_mass_k"]) == steps and 0 < rec["kv_own_key_mass"] < 1
        assert len(rec["gate_share"]) == 1 and rec["gate_share"][0] > 0
        # where the real backward sends gradient: fewer positions into W_K/W_V than into W_Q/W_O
        assert 0 < rec["kv_grad_positions"] < rec["query_grad_positions"] and rec["grad_position_rows"] > 0
        assert 0 < rec["kv_grad_position_ratio"] < 1 and 0 < rec["kv_grad_on_own_keys"] < 1


def test_a_batch_without_scored_rows_measures_nothing(drafter_world):
    batch = drafter_world[0].batch([0, 1])
    batch["loss_mask"] = batch["loss_mask"] * 0
    assert attention_diagnostics(make(drafter_world, "hybrid"), batch, K) == {}


def test_attention_diagnostics_shared_out_over_processes_sum_to_one_processes(drafter_world):
    """The trainer's DDP share-out: process r measures batches r, r + world, ... (the own-key mass
    on the first, so on process 0); the summed totals give what one process measures on all."""
    from kvshot.train.diagnostics import attention_summary, attention_totals

    src = drafter_world[0]
    model = make(drafter_world, "hybrid")
    batches = [src.batch([0, 1]), src.batch([2, 3]), src.batch([1, 2])]
    one = attention_diagnostics(model, batches, K)
    for world in (2, 3):
        parts = [attention_totals(model, batches, K, rank=r, world=world) for r in range(world)]
        assert all(len(p) == len(parts[0]) for p in parts)
        got = attention_summary(model, [sum(x) for x in zip(*parts)], K)
        assert got.keys() == one.keys() and all(got[k] == pytest.approx(one[k], rel=1e-9) for k in one)
    assert parts[1][0] == parts[2][0] == 0   # only process 0 ran the own-key mass
