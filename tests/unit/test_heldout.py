"""Teacher-forced evaluation under DDP: each process reads batch_size // world of every batch
and the all-reduced sums give every process the numbers one process gets on the same batches
(2 gloo processes on CPU, torch.multiprocessing)."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from kvshot.train.heldout import batch_ids, evaluate

from ..conftest import build_test_drafter
from ..conftest import typed

STEPS = 3
CASES = [(4, 2), (6, 3)]   # (global batch, max batches) on the 8 eval samples: even shares; a short last batch


def test_batch_ids_cut_each_batch_into_shares():
    assert batch_ids(8, 4, 5) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batch_ids(8, 4, 1, rank=1, world=2) == [[2, 3]]
    assert batch_ids(8, 6, 3, rank=0, world=2) == [[0, 1, 2], [6, 7]]
    assert batch_ids(8, 6, 3, rank=1, world=2) == [[3, 4, 5], []]


def _world(paths: dict):
    from kvshot.capture.features import open_features
    from kvshot.capture.target import load_target
    from kvshot.config import runtime
    from kvshot.train.variants import draft_vocab

    from ..conftest import tiny_config

    target = load_target(paths["model"], runtime(typed(tiny_config())))
    train = open_features(paths["train"])
    return train, target, draft_vocab(train, 150, target.config.vocab_size)


def _evaluations(world, eval_dir: str, rank: int = 0, n: int = 1) -> dict:
    """Each case's evaluation of a KV drafter (query cosine too), and the batch sizes read."""
    from kvshot.capture.features import open_features

    _, target, _ = world
    model = build_test_drafter(world, {"name": "kv2", "paradigm": "kv", "layers": 2})
    src = open_features(eval_dir)
    sizes, real = [], src.batch
    src.batch = lambda ids: sizes.append(len(ids)) or real(ids)
    head_w = target.lm_head.weight.detach()
    out = {"eval": [], "sizes": []}
    for bs, batches in CASES:
        sizes.clear()
        out["eval"].append(evaluate(model, src, head_w, STEPS, bs, batches, target, rank=rank, world=n))
        out["sizes"].append(list(sizes))
    return out


def _process(rank: int, n: int, port: int, paths: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=n)
    try:
        result = _evaluations(_world(paths), paths["eval"], rank, n)
        with open(os.path.join(out, f"{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_evaluation_equals_one_process(tiny, tiny_features, tmp_path):
    paths = {"model": str(tiny["model"]), "train": str(tiny_features["train"]), "eval": str(tiny_features["eval"])}
    one = _evaluations(_world(paths), paths["eval"])
    mp.spawn(_process, args=(2, free_port(), paths, str(tmp_path)), nprocs=2, join=True)
    two = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert one["sizes"] == [[4, 4], [6, 2]]
    assert [two[0]["sizes"], two[1]["sizes"]] == [[[2, 2], [3, 2]], [[2, 2], [3]]]   # batch_size // 2 a process
    for case, ev in enumerate(one["eval"]):
        a, b = two[0]["eval"][case], two[1]["eval"][case]
        assert a == b   # every process: the same numbers
        assert a["tokens"] == ev["tokens"] and a["acc"] == pytest.approx(ev["acc"], abs=1e-12)
        assert a["loss"] == pytest.approx(ev["loss"], rel=1e-5)
        assert a["query_cosine"] == pytest.approx(ev["query_cosine"], rel=1e-5)
