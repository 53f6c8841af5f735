"""The paper config's GPU rules fit the GPU the SLURM profile books, measured at their real
shapes by the real code on the CPU (`kvshot.paper_shapes.shapes.ShapeMeter`, `kvshot.paper_shapes.shape_rules`,
benchmarks/paper_shapes.py), and the meter itself against computations done by hand.

A rule fits when its measured peak with the CUDA allowance the meter cannot see (x 1.10 for
the allocator, + 3 GB for the context, NCCL and workspaces: `shape_rules.cuda_gb`) stays
under the booked 80 GB GPU less 8 GB of headroom: 72 GB (`shape_rules.gpu_limit_gb`).

The deepest variant of each paradigm and block kind (`HEAVIEST`): its training step, one
rank's `train.evaluate` share and the step-wise natural protocol; chain decoding for three;
the target's rules. Before the paper-path fixes the standalone's evaluate (117.8 GB) and
step-wise (107.9 GB) rows failed here. Not here (benchmarks/paper_shapes.py prints them): the
shallower and same-shaped variants, and tree decoding (~1 min of Python dispatch per variant).
"""
from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvshot.capture.target import target_forward
from kvshot.config import read_config
from kvshot.drafters import attention as attention_backends
from kvshot.drafters.skeleton import PrefixMask
from kvshot.paper_shapes.shape_rules import (PaperShapes, QWEN3_8B, cuda_gb, ddp_buckets_alias_grads, flex_like,
                                             gpu_limit_gb)
from kvshot.paper_shapes.shapes import GB, ShapeMeter
from kvshot.train.diagnostics import grad_norms

from ..conftest import REPO
from ..conftest import typed

# the memory of the GPU profiles/slurm books for every GPU rule: an H100 with 80 GB (the
# paper's; the profile states no model); a rule may use it less the headroom, with the allowance
GPU_GB = float(os.environ.get("KVSHOT_GPU_GB", 80.0))
LIMIT_GB = gpu_limit_gb(GPU_GB)
TARGET_GB = 2 * 8.19e9 / GB   # Qwen3-8B's bf16 weights: resident in every GPU rule


# ---------------------------------------------------------------- the meter, by hand

def test_meter_counts_live_bytes_and_what_autograd_saves():
    m = ShapeMeter()
    with m.measuring():
        x = torch.randn(256, 512)                        # 512 KiB
        w = torch.randn(512, 1024, requires_grad=True)   # 2 MiB
        assert m.live == 4 * (256 * 512 + 512 * 1024)
        y = (x @ w).exp()   # mm's output dies; exp saves its own output (and mm saved x, w)
        assert m.live == 4 * (256 * 512 + 512 * 1024 + 256 * 1024)
        assert m.peak == 4 * (256 * 512 + 512 * 1024 + 2 * 256 * 1024)
        y.sum().backward()
        del y
        assert w.grad.shape == w.shape
        assert m.live == 4 * (256 * 512 + 2 * 512 * 1024)   # x, w, w.grad (the loss was a temporary)
    flops = m.flops
    assert flops == 2 * 256 * 512 * 1024 * 2   # forward x @ w, backward x.T @ grad (x needs none)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_meter_counts_the_same_flops_under_inference_mode(mode):
    """Under inference_mode composite ops (linear, matmul, bool(), int()) reach the meter whole
    (decoding runs so): their FLOPs are counted all the same, and read scalars get the worst case."""
    m = ShapeMeter()
    with m:
        lin = torch.nn.Linear(64, 32)
        x = torch.randn(4, 64)
    with mode(), m.measuring():
        z = lin(x) @ torch.randn(32, 8)
        assert bool((z > 0).any()) is True and int(z.argmax()) == 0
    assert m.flops == 2 * 4 * 64 * 32 + 2 * 4 * 32 * 8


def test_meter_keeps_integer_bookkeeping_real_and_floats_fake():
    from torch._subclasses.fake_tensor import FakeTensor

    m = ShapeMeter()
    with m.measuring():
        mask = torch.arange(10) % 3 == 0
        rows = mask.nonzero().view(-1)
        h = torch.randn(10, 4)
        picked = h.index_select(0, rows)
    assert not isinstance(rows, FakeTensor) and rows.tolist() == [0, 3, 6, 9]   # from the real mask
    assert isinstance(h, FakeTensor) and picked.shape == (4, 4)


def test_meter_flops_of_a_qwen3_forward_match_the_formula():
    arch = dict(vocab_size=1000, hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attn_implementation="sdpa")
    b, t = 2, 48
    m = ShapeMeter()
    with m:
        model = Qwen3ForCausalLM(Qwen3Config(**arch)).eval()
    with m.measuring():
        target_forward(model, torch.ones(b, t, dtype=torch.long), torch.ones(b, t, dtype=torch.long), (1, 2, 3), (0,))
    h, f, d, n, kv = 64, 192, 16, 4, 2
    per_layer = h * n * d * 2 + h * kv * d * 2 + 3 * h * f   # q, o; k, v; the MLP
    attention = 4 * b * n * t * t * d                        # scores and values, dense
    assert m.flops == 3 * (2 * b * t * per_layer + attention)


def test_flex_stand_in_keeps_the_concatenated_keys_and_values_for_backward():
    """`flex_like` (the meter's flex_attention) holds what `attention._flex` concatenates,
    [prefix; diagonal] keys and values, from the forward until the attention's backward, on
    top of what flash_cpu saves; flash_cpu's output and gradients."""
    b, n, g, tq, tp, s, d = 1, 2, 2, 16, 32, 3, 8
    cat_bytes = 2 * 4 * b * n * (tp + s * tq) * d   # k_cat and v_cat, fp32

    def inputs():
        mask = PrefixMask(torch.zeros(b, 1, 1, tq, tp), [(0, tq, 0, tp)])
        return (torch.randn(b, n * g, tq, d, requires_grad=True), torch.randn(b, n, tp, d), torch.randn(b, n, tp, d),
                mask, torch.randn(b, n, s, tq, d, requires_grad=True), torch.randn(b, n, s, tq, d, requires_grad=True))

    def held(fn):
        m = ShapeMeter()
        with m:
            args = inputs()
        with m.measuring():
            before = m.live
            out = fn(*args, 0, d ** -0.5)
            kept = m.live - before   # the output and what the graph saved
            out.sum().backward()
            del out
            return kept, m.live - before

    flash, flex = held(attention_backends._flash_cpu), held(flex_like)
    assert flex[0] - flash[0] == cat_bytes
    assert flex[1] == flash[1]   # freed by the backward
    torch.manual_seed(0)
    real = inputs()
    flex_like(*real, 0, d ** -0.5).square().sum().backward()
    got = [real[0].grad, real[4].grad, real[5].grad]
    for x in (real[0], real[4], real[5]):
        x.grad = None
    attention_backends._flash_cpu(*real, 0, d ** -0.5).square().sum().backward()
    for x, want in zip(got, (real[0].grad, real[4].grad, real[5].grad)):
        torch.testing.assert_close(x, want)


def test_grad_norms_copy_no_whole_gradient():
    """`train.grad_norms` (what a logging step runs) reduces each gradient where it lies: its
    peak over the gradients is scalars, not a float64 copy (8 B per element) of the largest."""
    m = ShapeMeter()
    with m:
        w = torch.nn.Parameter(torch.zeros(1024, 4096))
        w.grad = torch.zeros_like(w)
        small = torch.nn.Parameter(torch.zeros(64))
        small.grad = torch.zeros_like(small)
    with m.measuring():
        base = m.live
        grad_norms({"a": [w], "b": [small], "none": []})
    assert m.peak - base < 4 * 1024 * 4096 // 8, (m.peak - base) / GB


def test_the_trainer_sets_gradient_as_bucket_view():
    """DDP's buckets are the gradients (the meter counts them once, resident all step)."""
    assert ddp_buckets_alias_grads()


def test_the_allowance_and_the_headroom():
    assert LIMIT_GB == GPU_GB - 8.0
    assert cuda_gb(0.0) == 3.0 and cuda_gb(60.0) == pytest.approx(69.0)


# ---------------------------------------------------------------- the paper's rules

@pytest.fixture(scope="module")
def paper():
    return PaperShapes(typed(read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])))


def fits(row) -> None:
    assert row.peak_gb > TARGET_GB, f"{row}: less than the target's own weights: the meter missed them"
    assert row.tflop > 0, row
    assert row.cuda_gb <= LIMIT_GB, (f"{row.rule} {row.what}: {row.peak_gb:.1f} GB per rank at the paper's shapes, "
                                     f"{row.cuda_gb:.1f} GB with the CUDA allowance > {LIMIT_GB:.0f} GB (the "
                                     f"{GPU_GB:.0f} GB GPU the profile books less the headroom)")


def test_the_paper_config_has_the_variants_measured(paper):
    assert set(paper.variants()) == set(ALL_VARIANTS)
    assert paper.target.config.hidden_size == QWEN3_8B["hidden_size"] == 4096


ALL_VARIANTS = ["eagle3", "kv-d1", "kv-d2", "kv-d4", "hybrid", "standalone", "block-kv-d1", "block-kv-d2",
                "block-kv-d4", "block-hidden", "block-dflash", "block-kv-d2-decay", "block-kv-d2-refine", "hybrid-open",
                "hybrid-warm",
                "eagle3.1", "eagle3-fcnorm", "eagle3-postnorm"]   # drift: eagle3's shapes (docs/drift.md)


# one variant per paradigm and block kind, the deepest of each (memory grows with depth: kv-d1/d2
# and block-kv-d1/d2 sit below kv-d4 and block-kv-d4 in benchmarks/paper_shapes.py's table), the
# refine ablation (two passes); hybrid-open/-warm and block-kv-d2-decay have the shapes of
# hybrid and block-kv-d2, block-dflash block-hidden's (less one norm per layer and the per-slot masks). The whole list: `python benchmarks/paper_shapes.py`.
HEAVIEST = ["eagle3", "kv-d4", "hybrid", "standalone", "block-kv-d4", "block-hidden", "block-kv-d2-refine"]


@pytest.mark.parametrize("name", HEAVIEST)
def test_train_drafter_step_and_evaluate_fit(paper, name):
    step, ev = paper.train_rows(name)
    # a step runs at least the online target forward: 2 x 8.2e9 FLOPs per token of the rank's sequence
    assert step.tflop > 2 * 8.19e9 * 2048 / 1e12 * 0.9, step
    fits(step)
    fits(ev)


@pytest.mark.parametrize("name", HEAVIEST)
def test_eval_stepwise_natural_fits(paper, name):
    fits(paper.stepwise_row(name))


@pytest.mark.parametrize("name", ["kv-d4", "hybrid", "standalone"])
def test_eval_e2e_chain_fits(paper, name):
    (row,) = paper.e2e_rows(name, 8, ("chain",))
    fits(row)


def test_target_rules_fit(paper):
    for row in paper.target_rows(4):
        fits(row)


# ---------------------------------------------------------------- drafters side by side

def _paper_groups():
    from kvshot.paper_shapes.group_shapes import config_groups

    return config_groups(typed(read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])))


@pytest.mark.parametrize("names", _paper_groups(), ids="+".join)
def test_every_training_group_of_the_paper_config_fits(paper, names):
    """drafters.group_training: each group's step (one target forward, every member's step,
    every member resident) fits the GPU the profile books, as one drafter's must."""
    from kvshot.paper_shapes.group_shapes import group_train_row

    fits(group_train_row(paper, names))


def test_a_group_step_costs_its_members_less_the_shared_target_forwards(paper):
    """The first core group's TFLOP per step: its members' steps alone less one online target
    forward (measured: the rank's batch through the target) for every member after the first."""
    from kvshot.capture.features import open_features
    from kvshot.paper_shapes.group_shapes import group_train_row

    names = _paper_groups()[0]
    alone = sum(group_train_row(paper, [n]).tflop for n in names)   # a group of one: train_drafter's step
    src, rows = open_features(paper.folder, paper.rt, model=paper.target), []
    with paper._measure(rows, "target forward", "batch", "step", 1):
        src.batch([0])   # every captured layer: the most a group reads
    forward = rows[0].tflop
    assert 2 * 8.19e9 * 2048 / 1e12 * 0.9 < forward < 2 * 8.19e9 * 2048 / 1e12
    grouped = group_train_row(paper, names).tflop
    assert grouped == pytest.approx(alone - (len(names) - 1) * forward, rel=1e-3), (grouped, alone, forward)
