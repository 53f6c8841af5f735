"""Config validation: bad config fails in one line naming the file and the field."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import yaml
from pathlib import Path

from kvshot.config import BENCHMARKS_AXIS, ConfigError, merge, read_config, stage_config, validate_config

from ..conftest import REPO

DEFAULT = str(REPO / "config/config.yaml")


@pytest.mark.parametrize("name", ["config.yaml", "smoke.yaml", "paper.yaml", "one-gpu.yaml"])
def test_shipped_configs_validate(name):
    specs = [DEFAULT] if name == "config.yaml" else [DEFAULT, str(REPO / "config" / name)]
    cfg = read_config(specs)
    assert cfg["features"]["mode"] in ("offline", "online")


def test_paper_config_is_the_paper_setup():
    cfg = read_config([DEFAULT, str(REPO / "config/paper.yaml")])
    assert cfg["target"] == {**cfg["target"], "source": "pretrained", "name": "Qwen/Qwen3-8B"}
    assert cfg["dtype"] == "bfloat16" and cfg["features"]["mode"] == "online"
    names = {s["name"] for s in cfg["data"]["sources"]}
    assert names == {"Aeala/ShareGPT_Vicuna_unfiltered", "HuggingFaceH4/ultrachat_200k"}
    assert cfg["data"]["train_samples"] == 280000 and cfg["scaling"]["train_samples"] == [70000, 140000, 280000]


def test_one_gpu_config_is_the_paper_study_on_one_gpu():
    """config/one-gpu.yaml: a pinned Qwen3-1.7B, one process per job, the paper's six drafters,
    data sources and natural protocol (sized for P1 and retention: docs/statistics.md)."""
    paper = read_config([DEFAULT, str(REPO / "config/paper.yaml")])
    cfg = read_config([DEFAULT, str(REPO / "config/one-gpu.yaml")])
    for part in ("target", "tokenizer"):
        assert cfg[part]["name"] == "Qwen/Qwen3-1.7B" and cfg[part]["source"] == "pretrained"
        assert len(cfg[part]["revision"]) == 40 and int(cfg[part]["revision"], 16) >= 0
    assert cfg["device"] == "cuda" and cfg["dtype"] == "bfloat16" and cfg["features"]["mode"] == "online"
    assert cfg["drafters"]["train"]["num_processes"] == 1 and len(cfg["drafters"]["seeds"]) == 3
    assert cfg["drafters"]["variants"] == paper["drafters"]["variants"]
    assert cfg["data"]["sources"] == paper["data"]["sources"]
    assert cfg["eval"]["prompt_sources"] == paper["eval"]["prompt_sources"]
    assert cfg["eval"]["natural"] == paper["eval"]["natural"] and cfg["eval"]["natural"]["anchors"] is None
    assert cfg["drafters"]["ttt_steps"] == paper["drafters"]["ttt_steps"]


def _overlay(tmp_path, text: str) -> str:
    p = tmp_path / "overlay.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, field, words", [
    ("data:\n  train_samples: abc\n", "data.train_samples", "not of type 'integer'"),
    ("features:\n  mode: sideways\n", "features.mode", "sideways"),
    ("target:\n  arch:\n    hidden_size: 8.5\n", "target.arch.hidden_size", "integer"),
    ("tokenizer:\n  vocab_szie: 10\n", "tokenizer", "unknown key"),
    ("seed: -1\n", "seed", "minimum"),
])
def test_bad_overlay_names_file_and_field(tmp_path, text, field, words):
    overlay = _overlay(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        read_config([DEFAULT, overlay])
    msg = str(err.value)
    assert msg.startswith(f"{overlay}: {field}") and words in msg and "\n" not in msg


def test_missing_key_is_named(tmp_path):
    cfg = yaml.safe_load(open(DEFAULT))
    del cfg["data"]["eval_samples"]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=rf"^{path}: data.eval_samples: missing required key$"):
        read_config([str(path)])


def test_mode_dependent_fields():
    cfg = read_config([DEFAULT])
    cfg["target"] = {"source": "pretrained", "name": None, "attn_implementation": "auto"}
    with pytest.raises(ConfigError, match="target.name"):
        validate_config(cfg, "x.yaml")
    cfg = read_config([DEFAULT])
    cfg["data"]["sources"] = [{"kind": "hub", "name": "a/b", "split": "train"}]
    with pytest.raises(ConfigError, match=r"data.sources.0.schema"):
        validate_config(cfg, "x.yaml")


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: <file>: cannot read"):
        read_config([str(tmp_path / "nope.yaml")])
    bad = _overlay(tmp_path, "data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_config([bad])


def test_merge_is_recursive_and_stage_config_is_partial():
    assert merge({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 5}}) == {"a": {"b": 5, "c": 2}, "d": 1}
    cfg = read_config([DEFAULT])
    part = stage_config(cfg, "data")
    assert set(part) == {"seed", "device", "dtype", "threads", "numerics", "data"}
    validate_config(part, "x", sections=("data",))  # a stage validates only what it reads


def test_the_benchmarks_axis_is_in_no_stage_config_but_its_own():
    """config/smollm2-benchmarks.yaml turns the axis on after a study: only eval_benchmarks
    (which names the pseudo-section) sees it, so every other stage's params stay as they were."""
    off = read_config([DEFAULT, str(REPO / "config/smollm2.yaml")])
    on = read_config([DEFAULT, str(REPO / "config/smollm2.yaml"), str(REPO / "config/smollm2-benchmarks.yaml")])
    assert off["eval"]["e2e"]["benchmarks"] is None and on["eval"]["e2e"]["benchmarks"]["sets"]
    for sections in [("eval",), ("target", "drafters", "eval"), ("drafters",), ("data", "features", "eval")]:
        assert stage_config(on, *sections) == stage_config(off, *sections)
        assert "benchmarks" not in stage_config(on, *sections).get("eval", {}).get("e2e", {})
    axis = stage_config(on, "target", "drafters", "eval", BENCHMARKS_AXIS)
    assert axis["eval"]["e2e"]["benchmarks"] == on["eval"]["e2e"]["benchmarks"]
    assert axis["eval"]["e2e"]["prompts"] == on["eval"]["e2e"]["prompts"] == 10
    validate_config(axis, "x", sections=("target", "drafters", "eval"))


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    overlay = _overlay(tmp_path, "data:\n  train_samples: abc\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kvshot", "prepare-data", "--config", DEFAULT, "--config", overlay,
                           "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"kvshot prepare-data: error: {overlay}: data.train_samples: 'abc' is not of type 'integer'"]
    assert not out.exists()


def test_inline_json_config():
    cfg = read_config([DEFAULT, json.dumps({"data": {"train_samples": 1000}})])
    assert cfg["data"]["train_samples"] == 1000
    with pytest.raises(ConfigError, match=r"^<inline config>: data.train_samples"):
        read_config([DEFAULT, json.dumps({"data": {"train_samples": "7"}})])


def test_schema_states_defaults_and_describes_every_field():
    """What an omitted field means is the schema's `default` (filled on read), never a variant's
    override; and every field of the schema says what it is."""
    from kvshot.config import fill_defaults, load_schema

    schema = load_schema()
    missing = []

    def walk(node: dict, path: str) -> None:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node
        for key, sub in (node.get("properties") or {}).items():
            if "description" not in sub and "$ref" not in sub:
                missing.append(path + key)
            walk(sub, f"{path}{key}.")
            if isinstance(sub.get("items"), dict):
                walk(sub["items"], f"{path}{key}.")

    walk(schema, "")
    assert not missing, missing
    cfg = {"target": {"pretrain": {"max_steps": 3}}, "eval": {"natural": {"anchors": 5}},
           "drafters": {"train": {"lr": 1.0}, "variants": [{"name": "a", "paradigm": "kv", "layers": 1, "train": {"lr": 2.0}}]}}
    fill_defaults(cfg, schema)
    assert cfg["target"]["pretrain"]["block_size"] == 256 and cfg["target"]["pretrain"]["max_steps"] == 3
    assert cfg["eval"]["natural"] == {"anchors": 5, "max_prefix_len": 512, "rollout_tokens": 8, "batch_size": 4}
    assert cfg["drafters"]["train"]["eval_every"] == 0 and cfg["drafters"]["attention"] == "auto"
    assert cfg["drafters"]["variants"][0]["train"] == {"lr": 2.0}   # overrides: omitted fields fall back to drafters.train
    assert "features" not in cfg                                       # a missing section stays missing


def literal_defaults(path: Path) -> list[str]:
    """`.get("key", <a literal value>)` calls: a default written in the code. An empty container
    or None says "absent", not what an omitted field means, and is not counted."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and ast.unparse(node.func.value) != "os.environ"):   # environment variables are not config
            d = node.args[1]
            value = (isinstance(d, ast.Constant) and d.value is not None) or (
                isinstance(d, (ast.List, ast.Tuple, ast.Dict, ast.Set)) and (d.elts if not isinstance(d, ast.Dict) else d.keys))
            if value:
                found.append(f"{path.name}:{node.lineno} {node.args[0].value}")
    return found


# reads of other documents: result items, a checkpoint's progress, a HF config.json, the schema
# itself, the fake-tensor meter's table of operators
NOT_CONFIG = {"e2e.py": {"conversation", "protocol"}, "stepwise.py": {"conversation"}, "loop.py": {"stopped_by"},
              "target.py": {"rope_type"}, "config.py": {"$ref", "description"}, "shapes.py": {"aten.index.Tensor (bool mask)"},
              "dflash.py": {"rope_theta"}}   # dflash.py: a DFlash folder's config.json (vLLM's, not kvshot's config)


def test_no_stage_writes_a_config_default_of_its_own():
    """Every default lives in the schema: the stages read the filled config (fill_defaults), so
    no `.get(key, literal)` is left in them. report/ reads result files and interop/head_config
    reads publishers' config.json files, both outside the schema."""
    package = REPO / "src" / "kvshot"
    files = [p for p in package.rglob("*.py") if "report" not in p.parts and p.name != "head_config.py"]
    found = [f for p in files for f in literal_defaults(p) if f.split(" ", 1)[1] not in NOT_CONFIG.get(p.name, set())]
    assert found == []
    sample = package / "evaluate" / "e2e.py"
    assert len(literal_defaults(sample)) >= 2   # the scan sees the allowed result-file reads


def test_a_stage_sees_group_members_of_sections_it_does_not_hold():
    """config/paper.yaml trains block-wise variants in groups (drafters.group_training names them;
    blockwise.variants defines them). train-drafter's stage validates only its own sections, so it
    cannot see them and lets them be; the whole config, as Snakemake checks it, refuses a name no
    section defines."""
    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])
    assert any("block-kv-d1" in g for g in cfg["drafters"]["group_training"])
    validate_config(stage_config(cfg, "drafters"), "x", sections=("drafters",))
    cfg["drafters"]["group_training"][0].append("nope")
    with pytest.raises(ConfigError, match="group_training.0: no variant named 'nope'"):
        validate_config(cfg, "x")
