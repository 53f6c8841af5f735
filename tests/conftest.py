"""Shared tiny fixtures: a few synthetic conversations, a BPE tokenizer trained on them
and a 4-layer Qwen3 target, built by the same stage functions the pipeline runs.

Two tiers: tests/unit/ run in-process (seconds each); tests/pipeline/ start Snakemake, SLURM or
a multi-process launch, or run a real pretrained target (SmolLM2-135M), and carry the `pipeline` marker, so `pytest tests/unit` (or
`pytest -m "not pipeline"`) is the inner loop."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from kvshot.core import numerics

# The pipeline's default numerics (AVX2 kernels, docs/reproducibility.md), set before any test
# imports torch, so in-process stages run what the jobs run; subprocesses inherit them.
numerics.apply("portable")

REPO = Path(__file__).resolve().parents[1]
PIPELINE_TIER = Path(__file__).resolve().parent / "pipeline"


# The tests that read the session's one smoke DAG run (`smoke_workdir`) or the SLURM run
# (`slurm_run`): one xdist worker, so that the DAG runs once per pytest run.
SHARED_RUN_FIXTURES = {"smoke_workdir", "slurm_run"}


# tryfirst: the marker must be on the item before xdist's own hook (WorkerInteractor, called
# before this conftest otherwise) turns it into the group; without it, and under pytest 9 (whose
# node ids xdist 3.8 can no longer suffix: pyproject pins pytest 8), every module's tests were
# spread over both workers and their module fixtures built twice (issue 48)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if PIPELINE_TIER in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.pipeline)
        # pytest-xdist (`-n 2 --dist loadgroup`, pyproject.toml): a module's tests stay on one
        # worker, so its module-scoped fixtures are built once
        shared = SHARED_RUN_FIXTURES & set(getattr(item, "fixturenames", ()))
        item.add_marker(pytest.mark.xdist_group("smoke_dag" if shared else item.nodeid.split("::")[0]))

def pytest_xdist_node_collection_finished(node, ids):
    """On the controller under loadgroup: every test id a worker collected must carry its group
    (`nodeid@group`); stop in one line if the grouping silently stopped working."""
    if node.config.getvalue("dist") == "loadgroup" and any("@" not in i for i in ids):
        import xdist

        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: --dist loadgroup "
                                "does not group tests (ids lack '@group'); install the versions pyproject.toml pins")


WORDS = ("the cache keeps every key and value while hidden states summarise what the next "
         "token needs so a drafter may lose context far ahead").split()


def synthetic_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        msgs = []
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))})
            msgs.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 20)))})
        convs.append({"id": f"syn-{i}", "messages": msgs})
    return convs


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_config() -> dict:
    """The smoke config with the schema's defaults filled, as a dict tests may change; `typed`
    makes it the typed config every stage receives."""
    from kvshot.config import fill_defaults, merge

    base = yaml.safe_load((REPO / "config/config.yaml").read_text())
    smoke = yaml.safe_load((REPO / "config/smoke.yaml").read_text())
    cfg = merge(base, smoke)
    cfg["target"]["pretrain"]["max_steps"] = 3
    return fill_defaults(cfg)


def typed(cfg: dict):
    """A config dict (changed by a test) as the stages take it: defaults filled, typed once."""
    import copy

    from kvshot.config import fill_defaults
    from kvshot.settings import Config

    return Config.from_dict(fill_defaults(copy.deepcopy(cfg)))


def variant(**fields):
    """A drafters.variants entry as the typed config holds it (what it leaves out: None)."""
    from kvshot.settings import VariantSettings

    return section(VariantSettings, fields)


def section(cls, value):
    """`value`, a config section as plain data (or already typed), as the settings class `cls`:
    `section(GGUFFile, {...})`; a list: a tuple of them."""
    from kvshot.settings import build

    if isinstance(value, list):
        return tuple(section(cls, v) for v in value)
    return build(cls, value) if isinstance(value, dict) else value


@pytest.fixture(scope="session")
def smoke_workdir(tmp_path_factory):
    """The session's one working directory for the smoke DAG (config/smoke.yaml; see
    tests/pipeline/test_pipeline.py's `workdir`): tests/pipeline/test_pipeline.py runs `all` and the block-wise and
    drift targets in it; tests that need some of its outputs from a local run (the SLURM test's
    comparison, the export rule) ask Snakemake for those targets here, which then runs only what
    is not yet up to date. Built once per session instead of once per test."""
    from .dag import workdir

    return workdir(tmp_path_factory.mktemp("smoke_dag"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Paths of a tiny data split, tokenizer and target produced by the real stage code."""
    from kvshot.capture.target import run_target_stage
    from kvshot.config import runtime
    from kvshot.data.tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    cfg = tiny_config()
    train = write_jsonl(root / "data/train.jsonl", synthetic_conversations(40, seed=1))
    evals = write_jsonl(root / "data/eval.jsonl", synthetic_conversations(8, seed=2))
    build_tokenizer(typed(cfg).tokenizer, train, root / "tokenizer")
    rt = runtime(typed(cfg))
    run_target_stage(typed(cfg), rt, str(train), str(evals), str(root / "tokenizer"), str(root / "model"),
                     str(root / "metrics.json"))
    return {"root": root, "cfg": cfg, "rt": rt, "train": train, "eval": evals,
            "tokenizer": root / "tokenizer", "model": root / "model", "metrics": root / "metrics.json"}


@pytest.fixture(scope="session")
def tiny_features(tiny):
    """Offline features of the tiny target for both splits."""
    from kvshot.capture.features import capture_split

    out = {}
    for split in ("train", "eval"):
        out[split] = tiny["root"] / "features" / split
        capture_split(typed(tiny["cfg"]), tiny["rt"], str(tiny[split]), str(tiny["model"]), str(out[split]))
    return out


@pytest.fixture(scope="module")
def drafter_world(tiny, tiny_features):
    """What a test drafter is built from: (the tiny train features, the tiny target, a
    150-token draft vocabulary)."""
    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.train.variants import draft_vocab

    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    return src, target, draft_vocab(src, 150, target.config.vocab_size)


def assert_gradient_reaches_every_parameter(model, batch: dict, target, steps: int, what: str = "") -> None:
    """One TTT loss backward on `batch`: every trainable parameter gets a nonzero gradient and
    the target's embedding stays frozen."""
    from kvshot.drafters.unroll import unroll
    from kvshot.train.objective import step_losses, target_labels, weighted_loss

    labels = target_labels(batch["last_hidden"], target.lm_head.weight.detach(), model.d2t)
    losses, *_ = step_losses(model, unroll(model, batch, steps), batch, labels)
    weighted_loss(losses, 0.8).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{what}no gradient reaches {name}"
    assert not model.embed_tokens.weight.requires_grad


def build_test_drafter(world, entry: dict, seed: int = 0):
    """A fresh drafter for the variant `entry` (a drafters.variants dict) from `drafter_world` (a standalone one starts from the
    target's layers), in eval mode. Its 1-D parameters (fresh norms at 1, gates at their init)
    get a little noise, so that every path matters to the output."""
    import torch

    from kvshot.settings import VariantSettings
    from kvshot.train.variants import build_variant

    src, target, d2t = world
    torch.manual_seed(seed)
    model = build_variant(section(VariantSettings, entry), target.config, target.model.embed_tokens.weight.detach(), d2t, target)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


# A tiny Llama target beside the Qwen3 one: no q/k norm, GQA 6:3, 6 layers, tied embeddings,
# the same data and tokenizer; what SmolLM2 (target.source gguf) is, at test size.
LLAMA_ARCH = {"model_type": "llama", "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 6,
              "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "max_position_embeddings": 1024,
              "rope_theta": 100000.0, "tie_word_embeddings": True}


@pytest.fixture(scope="session")
def tiny_llama(tiny):
    """`tiny` with a Llama target (LLAMA_ARCH) pretrained by the same stage code."""
    import copy

    from kvshot.capture.target import run_target_stage
    from kvshot.config import validate_config

    root = tiny["root"] / "llama"
    cfg = copy.deepcopy(tiny["cfg"])
    cfg["target"]["arch"] = dict(LLAMA_ARCH)
    validate_config(cfg, ["<tiny_llama>"])
    run_target_stage(typed(cfg), tiny["rt"], str(tiny["train"]), str(tiny["eval"]), str(tiny["tokenizer"]),
                     str(root / "model"), str(root / "metrics.json"))
    return {**tiny, "root": root, "cfg": cfg, "model": root / "model", "metrics": root / "metrics.json"}


@pytest.fixture(scope="session")
def tiny_llama_features(tiny_llama):
    from kvshot.capture.features import capture_split

    out = {}
    for split in ("train", "eval"):
        out[split] = tiny_llama["root"] / "features" / split
        capture_split(typed(tiny_llama["cfg"]), tiny_llama["rt"], str(tiny_llama[split]), str(tiny_llama["model"]),
                      str(out[split]))
    return out
