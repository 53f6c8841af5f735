"""The benchmarks axis (eval.e2e.benchmarks): prompt sets through the chat template, the
eval_benchmarks stage at T = 0 and T = 1, and results/tables/benchmarks.{md,csv,tex}."""
from __future__ import annotations

import csv
import io
import json

import pytest

from kvshot.core.io import DataError
from kvshot.data.chat import IM_START
from kvshot.data.sources import normalize_record
from ..conftest import typed, section
from kvshot.settings import BenchmarkSet


def test_humaneval_loader_reads_the_packaged_file_through_the_chat_template(tiny):
    from kvshot.data.tokenizer import load_tokenizer
    from kvshot.evaluate.benchmarks import benchmark_prompts, humaneval_problems

    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    tok = load_tokenizer(str(tiny["tokenizer"]))
    prompts = benchmark_prompts(section(BenchmarkSet, {"name": "humaneval", "kind": "humaneval_package"}), str(tiny["eval"]), 3, tok, 4096)
    assert len(prompts) == 3
    text = tok.decode(prompts[0])
    # the user's turn holds the problem's signature and docstring; the assistant header follows
    assert text.startswith(f"{IM_START}user\n") and text.endswith(f"{IM_START}assistant\n")
    assert "def has_close_elements" in text


def test_heldout_benchmark_is_the_eval_splits_first_user_turns(tiny):
    from kvshot.evaluate.benchmarks import benchmark_conversations

    convs = benchmark_conversations(section(BenchmarkSet, {"name": "sharegpt", "kind": "heldout"}), str(tiny["eval"]), 2)
    first = [json.loads(line)["messages"] for line in tiny["eval"].read_text().splitlines()[:2]]
    assert convs == first
    with pytest.raises(DataError, match="unknown kind"):
        benchmark_conversations(section(BenchmarkSet, {"name": "x", "kind": "nope"}), str(tiny["eval"]), 2)


def test_prompt_only_schemas_make_one_user_message():
    assert normalize_record({"question": "2+2?", "answer": "4"}, "gsm8k")[0] == [{"role": "user", "content": "2+2?"}]
    msgs, _ = normalize_record({"instruction": "Translate.", "input": "hallo", "output": "hello"}, "alpaca")
    assert msgs == [{"role": "user", "content": "Translate.\n\nhallo"}]
    assert normalize_record({"instruction": "Name a color.", "input": ""}, "alpaca")[0][0]["content"] == "Name a color."
    assert normalize_record({"prompt": "def f():\n", "task_id": "x"}, "humaneval")[0][0]["content"] == "def f():\n"
    assert normalize_record({"answer": "4"}, "gsm8k") == (None, "missing_field")


@pytest.fixture(scope="module")
def bench_run(tiny, tiny_features, tmp_path_factory):
    """The stage on two hybrid drafters (2 training seeds, a few steps), twice: a rerun must repeat."""
    from kvshot.config import runtime
    from kvshot.evaluate.benchmarks import run_benchmarks_stage
    from kvshot.train.loop import train_variant

    root = tmp_path_factory.mktemp("bench")
    cfg = json.loads(json.dumps(tiny["cfg"]))
    dirs = []
    for seed in (0, 1):
        cfg["seed"] = seed
        out = root / "drafters" / "hybrid" / f"seed{seed}"
        train_variant(typed(cfg), runtime(typed(cfg)), "hybrid", str(tiny_features["train"]), str(tiny_features["eval"]),
                      str(tiny["model"]), str(out))
        dirs.append(str(out))
    cfg["seed"] = 0
    cfg["eval"]["e2e"]["benchmarks"] = {"prompts": 3, "max_new_tokens": 8, "temperatures": [0.0, 1.0],
                                        "modes": ["chain", "tree"],
                                        "sets": [{"name": "sharegpt", "kind": "heldout"},
                                                 {"name": "humaneval", "kind": "humaneval_package"}]}
    index = str(tiny_features["eval"] / "index.json")
    outs = []
    for k in range(2):
        out = root / "eval" / "hybrid" / ("benchmarks.json" if k == 0 else "rerun.json")
        run_benchmarks_stage(typed(cfg), tiny["rt"], dirs, str(tiny["model"]), str(tiny["eval"]), index, str(out))
        outs.append(json.loads(out.read_text()))
    return {"root": root, "records": outs, "cfg": cfg}


def test_stage_records_per_benchmark_temperature_and_prompt(bench_run):
    rec = bench_run["records"][0]
    assert list(rec["benchmarks"]) == ["sharegpt", "humaneval"] and rec["seeds"] == [0, 1]
    for b in rec["benchmarks"].values():
        assert b["prompts"] == 3 and list(b["temperatures"]) == ["T=0", "T=1"]
        for t in b["temperatures"].values():
            assert set(t["modes"]) == {"chain", "tree"}
            for m in t["modes"].values():
                assert len(m["per_seed"]) == 2
                for s in m["per_seed"]:   # per-prompt counts: the prompt bootstrap's cells
                    assert len(s["per_prompt"]["rounds"]) == len(s["per_prompt"]["emitted"]) == 3
                assert sum(sum(s["per_prompt"]["rounds"]) for s in m["per_seed"]) == m["rounds"]
                tau = m["intervals"]["tau"]
                assert tau["value"] == pytest.approx(m["tau"]) and 1 <= m["tau"] <= m["spec"]["depth"] + 1
                assert tau["ci"][0] <= tau["ci"][1]
                acc = m["acceptance_by_position"]
                assert len(acc) == m["spec"]["depth"] and all(a >= b for a, b in zip(acc, acc[1:]))
                assert m["speedup"] > 0


def test_stage_decodes_at_t1_deterministically_with_seeded_generators(bench_run):
    first, rerun = bench_run["records"]

    def counts(rec, t):
        return [s["per_prompt"] | {"draft_s": None} for b in rec["benchmarks"].values()
                for m in b["temperatures"][t]["modes"].values() for s in m["per_seed"]]

    assert counts(first, "T=1") == counts(rerun, "T=1")   # same tokens, same rounds: a seeded sampler
    assert counts(first, "T=0") == counts(rerun, "T=0")


def test_table_has_benchmark_columns_and_temperature_row_groups(bench_run, tmp_path):
    from kvshot.report.benchmarks import figure, load_benchmarks, table_files

    records = load_benchmarks(bench_run["root"], ["hybrid", "eagle3"])   # eagle3: none written, skipped
    assert [r["variant"] for r in records] == ["hybrid"]
    files = table_files(records)
    md = files["benchmarks.md"].splitlines()
    assert md[0] == "| variant | mode | sharegpt tau | sharegpt speedup | humaneval tau | humaneval speedup |"
    groups = [i for i, line in enumerate(md) if line.startswith("| **T = ")]
    assert [md[i].split("**")[1] for i in groups] == ["T = 0", "T = 1"]
    rows = md[groups[0] + 1: groups[1]]
    assert [r.split(" | ")[1] for r in rows] == ["chain", "tree"]
    assert all(cell.count("[") == 1 for r in rows for cell in r.split(" | ")[2::2])   # tau with its interval
    long = list(csv.DictReader(io.StringIO(files["benchmarks.csv"])))
    assert len(long) == 2 * 2 * 2 and {r["benchmark"] for r in long} == {"sharegpt", "humaneval"}
    assert all(float(r["tau_lo"]) <= float(r["tau_hi"]) for r in long)
    tex = files["benchmarks.tex"]
    assert r"\multicolumn{2}{c}{humaneval}" in tex and "$T = 1$" in tex
    figure(records, tmp_path / "benchmarks.pdf")
    assert (tmp_path / "benchmarks.pdf").read_bytes().startswith(b"%PDF")


LOAD_PAPER_SETS = """
import json, sys, yaml
from kvshot.evaluate.benchmarks import benchmark_conversations
from kvshot.settings import BenchmarkSet, build
sets = yaml.safe_load(open(sys.argv[1]))["eval"]["e2e"]["benchmarks"]["sets"]
print(json.dumps({b["name"]: benchmark_conversations(build(BenchmarkSet, b), "unused.jsonl", 3) for b in sets}))
"""


def test_paper_hub_sets_load_offline_from_the_cache_through_their_schemas(tmp_path):
    """The paper config's sets (MT-Bench, HumanEval, GSM8K, Alpaca) resolve offline from a hub
    cache laid out as `scripts/predownload_hub.py` leaves it, each record one user turn."""
    import os
    import subprocess
    import sys

    from ..conftest import REPO
    from ..paper_fixture import build_hub_cache, offline_env

    cache = build_hub_cache(tmp_path, conversations=40)
    env = {**os.environ, **offline_env(cache, tmp_path / "home"), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", LOAD_PAPER_SETS, str(REPO / "config/paper.yaml")], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert list(got) == ["mt-bench", "humaneval", "gsm8k", "alpaca"]
    assert {k: len(v) for k, v in got.items()} == dict.fromkeys(got, 3), proc.stderr[-2000:]
    for convs in got.values():
        assert len(convs) == 3 and all(len(c) == 1 and c[0]["role"] == "user" and c[0]["content"] for c in convs)
    assert got["humaneval"][0][0]["content"].startswith("def f0():")


