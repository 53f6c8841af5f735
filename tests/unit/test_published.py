"""Published EAGLE-3 heads (kvshot.interop.published): a tiny random head saved in each publisher's
layout and config, imported, checked against a reference computation, and decoded losslessly
against the tiny target through the pipeline's step-wise and end-to-end evaluation.

  AngelSlim (SpecForge/SGLang's LlamaForCausalLMEagle3): written here, as AngelSlim ships it
    (pytorch_model.bin, `midlayer.*`, d2t offsets, no embedding), with explicit aux ids in
    SGLang's convention; the reference is a plain forward that reads the checkpoint's own names.
  RedHatAI (vLLM's speculators, norm_before_residual on): written by `speculators` itself (its
    converter, in its own venv, tests/speculators_env.py); the reference is speculators' own
    Eagle3DraftModel, 7 TTT steps.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvshot.__main__ import main
from kvshot.capture.features import open_features
from kvshot.capture.target import load_target
from kvshot.config import BENCHMARKS_AXIS, stage_config
from kvshot.drafters import build_drafter, load_drafter
from kvshot.drafters.unroll import unroll
from kvshot.interop.export import FormatError
from kvshot.interop.head_config import read_head_config
from kvshot.interop.published import eagle_aux_ids, hf_aux_layers, import_head
from kvshot.train.variants import draft_vocab
from ..conftest import typed, section
from kvshot.settings import PublishedSettings

K = 7
INTER = 48


@pytest.fixture(scope="module")
def world(tiny, tiny_features):
    src = open_features(tiny_features["train"])
    target = load_target(tiny["model"], tiny["rt"])
    return {"src": src, "target": target, "d2t": draft_vocab(src, 150, target.config.vocab_size),
            "aux": list(tiny["cfg"]["features"]["aux_layers"])}


def angelslim_head(world, folder, seed: int = 0):
    """A random one-layer head in AngelSlim's layout and config (LlamaForCausalLMEagle3 as SpecForge
    writes it for Qwen3-8B, scaled down): every tensor random, norms away from 1."""
    tc = world["target"].config
    h, hq, hkv, d = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=0.2: scale * torch.randn(*shape, generator=g)
    norm = lambda: 1.0 + rnd(h, scale=0.1)
    d2t = world["d2t"]
    tensors = {
        "fc.weight": rnd(h, 3 * h), "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rnd(hq * d, 2 * h), "midlayer.self_attn.k_proj.weight": rnd(hkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(hkv * d, 2 * h), "midlayer.self_attn.o_proj.weight": rnd(h, hq * d),
        "midlayer.post_attention_layernorm.weight": norm(), "midlayer.mlp.gate_proj.weight": rnd(INTER, h),
        "midlayer.mlp.up_proj.weight": rnd(INTER, h), "midlayer.mlp.down_proj.weight": rnd(h, INTER),
        "norm.weight": norm(), "lm_head.weight": rnd(len(d2t), h),
        "d2t": d2t - torch.arange(len(d2t)),                                   # offsets
        "t2d": torch.zeros(tc.vocab_size, dtype=torch.bool).index_fill_(0, d2t, True),
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": d, "hidden_act": "silu",
        "hidden_size": h, "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 4096,
        "num_attention_heads": hq, "num_hidden_layers": 1, "num_key_value_heads": hkv, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "vocab_size": tc.vocab_size,
        "draft_vocab_size": len(d2t),
        # SpecForge writes the ids SGLang reads: the OUTPUT of layer i (hidden_states[i + 1])
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": eagle_aux_ids(world["aux"], "sglang")},
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(tensors, folder / "pytorch_model.bin")
    return config, tensors


@pytest.fixture(scope="module")
def angelslim(world, tmp_path_factory):
    folder = tmp_path_factory.mktemp("angelslim") / "Qwen3-8B_eagle3"
    config, tensors = angelslim_head(world, folder)
    return {"dir": folder, "config": config, "tensors": tensors}


# ---------------------------------------------------------------- a plain reference

def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_step0(p: dict, prefix: str, embed, aux, ids, theta: float, heads: int, kv_heads: int,
                    norm_before_residual: bool):
    """Step-0 draft logits [T, N] of a one-layer EAGLE-3 head over one sequence, read from the
    checkpoint's own tensor names: row t fuses the target's aux hidden states at t, reads token
    ids[t] at position t + 1 and attends causally to rows <= t."""
    L = lambda name: p[prefix + name].float()
    t_len = ids.shape[0]
    state = aux @ p["fc.weight"].float().T
    normed = rms(state, L("hidden_norm.weight"))
    x = torch.cat([rms(embed[ids], L("input_layernorm.weight")), normed], dim=-1)
    q = (x @ L("self_attn.q_proj.weight").T).view(t_len, heads, -1).transpose(0, 1)
    k = (x @ L("self_attn.k_proj.weight").T).view(t_len, kv_heads, -1).transpose(0, 1)
    v = (x @ L("self_attn.v_proj.weight").T).view(t_len, kv_heads, -1).transpose(0, 1)
    d = q.shape[-1]
    angle = torch.arange(1, t_len + 1).double()[:, None] * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([angle, angle], -1).cos().float(), torch.cat([angle, angle], -1).sin().float()
    half = lambda y: torch.cat([-y[..., d // 2:], y[..., : d // 2]], dim=-1)
    q, k = q * cos + half(q) * sin, k * cos + half(k) * sin
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t_len, t_len, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t_len, -1) @ L("self_attn.o_proj.weight").T
    h = (normed if norm_before_residual else state) + attn
    m = rms(h, L("post_attention_layernorm.weight"))
    h = h + (F.silu(m @ L("mlp.gate_proj.weight").T) * (m @ L("mlp.up_proj.weight").T)) @ L("mlp.down_proj.weight").T
    return rms(h, p["norm.weight"].float()) @ p["lm_head.weight"].float().T


def kvshot_logits(drafter, world, sample_id: int, steps: int):
    sample = world["src"].batch([sample_id])
    n = sample["input_ids"].shape[1]
    batch = {**sample, "attention_mask": torch.ones_like(sample["input_ids"]),
             "loss_mask": torch.ones_like(sample["input_ids"])}
    with torch.no_grad():
        return sample, torch.stack([lg[0, : n - 1] for lg in unroll(drafter, batch, steps).logits])


def reference_inputs(sample):
    n = sample["input_ids"].shape[1]
    return sample["aux_hidden"][0, : n - 1].flatten(-2).float(), sample["input_ids"][0, 1:].long()


# ---------------------------------------------------------------- aux layers and the switch

def test_aux_layer_conventions_convert_explicitly():
    """kvshot's features.aux_layers are HF hidden_states indices. vLLM/speculators count the input
    of layer i (the same numbers), SGLang the output of layer i (one less)."""
    assert hf_aux_layers([2, 18, 33], "vllm") == [2, 18, 33]
    assert hf_aux_layers([1, 17, 32], "sglang") == [2, 18, 33]
    assert eagle_aux_ids([2, 18, 33], "sglang") == [1, 17, 32] and eagle_aux_ids([2, 18, 33], "vllm") == [2, 18, 33]
    with pytest.raises(FormatError, match="aux convention"):
        hf_aux_layers([1, 2, 3], "hf")


def test_norm_before_residual_changes_the_computation_and_matches_the_reference(world, angelslim):
    """The same weights with the switch off and on: different logits, each equal to the plain
    reference with the same switch (speculators' first layer: residual = hidden_norm(h))."""
    embed = world["target"].model.embed_tokens.weight.detach().float()
    config, tensors = angelslim["config"], angelslim["tensors"]
    out = {}
    for switch in (False, True):
        layout, cfg, _ = read_head_config({**config, "norm_before_residual": switch}, "head/config.json")
        assert layout == "eagle3" and cfg.norm_before_residual is switch and cfg.qk_norm is False
        from kvshot.interop.published import head_from_tensors

        drafter = head_from_tensors(cfg, layout, tensors, embed, "head")
        sample, ours = kvshot_logits(drafter, world, 2, 1)
        aux, ids = reference_inputs(sample)
        ref = reference_step0(tensors, "midlayer.", embed, aux, ids, cfg.rope_theta, cfg.num_attention_heads,
                              cfg.num_key_value_heads, switch)
        delta = (ours[0] - ref).abs().max().item()
        assert delta <= 1e-4, f"norm_before_residual={switch}: max |dlogit| {delta}"
        out[switch] = ours[0]
    assert (out[True] - out[False]).abs().max().item() > 1e-2, "the switch must change the computation"


# ---------------------------------------------------------------- AngelSlim's layout

def test_angelslim_layout_imports_with_sglang_aux_ids(angelslim, world, tiny, tmp_path):
    out = tmp_path / "imported"
    assert main(["import", "--format", "eagle3", "--aux-convention", "sglang", str(angelslim["dir"]), str(out),
                 "--target", str(tiny["model"])]) == 0
    meta = json.loads((out / "import.json").read_text())
    assert meta["format"] == "eagle3" and meta["aux_layers"] == world["aux"] and meta["aux_convention"] == "sglang"
    assert meta["aux_ids"] == [a - 1 for a in world["aux"]] and meta["norm_before_residual"] is False
    embed = world["target"].model.embed_tokens.weight.detach().float()
    drafter = load_drafter(out, embed=embed)
    assert torch.equal(drafter.d2t, world["d2t"]) and int(drafter.t2d.sum()) == len(world["d2t"])
    sample, ours = kvshot_logits(drafter, world, 3, 1)
    aux, ids = reference_inputs(sample)
    cfg = drafter.cfg
    ref = reference_step0(angelslim["tensors"], "midlayer.", embed, aux, ids, cfg.rope_theta,
                          cfg.num_attention_heads, cfg.num_key_value_heads, False)
    delta = (ours[0] - ref).abs().max().item()
    print(f"AngelSlim layout vs plain reference: max |dlogit| {delta:.2e}")
    assert delta <= 1e-4


def scored_losslessly(cfg, tiny, tiny_features, world, variant: dict, tmp_path):
    """train-drafter imports the head (variant `weights:`), then eval-stepwise and eval-e2e."""
    from kvshot.evaluate.e2e import run_e2e_stage
    from kvshot.evaluate.references import run_continuations_stage
    from kvshot.evaluate.stepwise import run_stepwise_stage

    cfg = json.loads(json.dumps(cfg))
    cfg["drafters"]["variants"] = [variant]
    drafter_dir = tmp_path / "drafters" / variant["name"]
    assert main(["train-drafter", "--config", json.dumps(stage_config(cfg, "drafters")), "--variant", variant["name"],
                 "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
                 "--target", str(tiny["model"]), "--out", str(drafter_dir)]) == 0
    index = str(tiny_features["eval"] / "index.json")
    cont = tmp_path / "continuations.json"
    run_continuations_stage(typed(cfg), tiny["rt"], str(tiny["eval"]), str(tiny["model"]), str(cont))
    step = run_stepwise_stage(typed(cfg), tiny["rt"], str(drafter_dir), str(tiny["model"]), str(cont), index,
                              str(tmp_path / "stepwise.json"))
    assert step["alpha"] is not None
    run_e2e_stage(typed(cfg), tiny["rt"], str(drafter_dir), str(tiny["model"]), str(cont), index, str(tmp_path / "e2e.json"))
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert e2e["lossless"] and all(m["real_errors"] == 0 for m in e2e["modes"].values())
    return drafter_dir


def test_angelslim_layout_decodes_losslessly(angelslim, world, tiny, tiny_features, tmp_path):
    variant = {"name": "angelslim", "paradigm": "hidden", "layers": 1, "weights": str(angelslim["dir"]),
               "format": "eagle3", "aux_convention": "sglang"}
    drafter_dir = scored_losslessly(tiny["cfg"], tiny, tiny_features, world, variant, tmp_path)
    assert json.loads((drafter_dir / "import.json").read_text())["aux_layers"] == world["aux"]
    # read in the other convention the same ids name other layers than the features hold: refused
    wrong = {**variant, "name": "wrong", "aux_convention": "vllm"}
    cfg = json.loads(json.dumps(tiny["cfg"]))
    cfg["drafters"]["variants"] = [wrong]
    assert main(["train-drafter", "--config", json.dumps(stage_config(cfg, "drafters")), "--variant", "wrong",
                 "--train-features", str(tiny_features["train"]), "--eval-features", str(tiny_features["eval"]),
                 "--target", str(tiny["model"]), "--out", str(tmp_path / "wrong")]) == 2
    assert not (tmp_path / "wrong").exists()


# ---------------------------------------------------------------- RedHatAI's layout (speculators)

@pytest.fixture(scope="module")
def speculators_head(angelslim, world, tiny, tmp_path_factory):
    """speculators converts the head with norm_before_residual on (as RedHatAI's Qwen3-8B heads are
    configured) and the aux ids in its own convention, and drafts K TTT steps on a sample: its
    converted folder is the layout RedHatAI ships, its logits the reference."""
    from ..speculators_env import run_script, write_inputs

    work = tmp_path_factory.mktemp("speculators")
    sample = world["src"].batch([3])
    write_inputs(sample, work / "inputs.safetensors")
    done = run_script(str(angelslim["dir"]), str(tiny["model"]), str(work / "inputs.safetensors"), str(work),
                      str(work / "theirs.safetensors"), str(K), ",".join(map(str, world["aux"])), "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"dir": work / "speculators", "logits": load_file(str(work / "theirs.safetensors"))["logits"]}


def test_speculators_layout_imports_and_matches_speculators(speculators_head, world, tiny, tmp_path):
    raw = json.loads((speculators_head["dir"] / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["norm_before_residual"] is True
    assert raw["eagle_aux_hidden_state_layer_ids"] == world["aux"]
    out = tmp_path / "imported"
    assert main(["import", "--format", "speculators", str(speculators_head["dir"]), str(out),
                 "--target", str(tiny["model"])]) == 0
    meta = json.loads((out / "import.json").read_text())
    assert meta["format"] == "speculators" and meta["norm_before_residual"] is True
    assert meta["aux_layers"] == world["aux"] and meta["aux_convention"] == "vllm"
    assert meta["verifier"] == str(tiny["model"])
    embed = world["target"].model.embed_tokens.weight.detach().float()
    drafter = load_drafter(out, embed=embed)
    assert drafter.cfg.norm_before_residual and not drafter.cfg.qk_norm
    _, ours = kvshot_logits(drafter, world, 3, K)
    theirs = speculators_head["logits"]
    assert theirs.shape == ours.shape
    delta = (theirs - ours).abs().max().item()
    print(f"speculators (norm_before_residual) vs kvshot, {K} TTT steps: max |dlogit| {delta:.2e}")
    assert delta <= 1e-4
    # the trap: the same weights with the switch ignored draft other logits
    from dataclasses import replace

    ignored = build_drafter(replace(drafter.cfg, norm_before_residual=False))
    ignored.load_state_dict(drafter.state_dict())
    _, wrong = kvshot_logits(ignored.eval(), world, 3, K)
    assert (theirs - wrong).abs().max().item() > 1e-2


def test_speculators_layout_decodes_losslessly(speculators_head, world, tiny, tiny_features, tmp_path):
    variant = {"name": "redhat", "paradigm": "hidden", "layers": 1, "weights": str(speculators_head["dir"]),
               "format": "speculators"}
    drafter_dir = scored_losslessly(tiny["cfg"], tiny, tiny_features, world, variant, tmp_path)
    assert load_drafter(drafter_dir, need_embedding=False).cfg.norm_before_residual


# ---------------------------------------------------------------- refusals, one line each

def test_unknown_or_unsupported_fields_are_refused(speculators_head, angelslim, tiny, tmp_path):
    raw = json.loads((speculators_head["dir"] / "config.json").read_text())
    cases = [({**raw, "norm_before_fc": True}, "norm_before_fc"), ({**raw, "fc_norm": "yes"}, "fc_norm"),
             ({**raw, "colour": "red"}, "colour"),
             ({**raw, "transformer_layer_config": {**raw["transformer_layer_config"], "model_type": "mistral"}},
              "model_type"),
             ({**raw, "transformer_layer_config": {**raw["transformer_layer_config"], "attention_bias": True}},
              "attention_bias"),
             ({**angelslim["config"], "colour": "red"}, "colour"),
             ({**angelslim["config"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling")]
    for i, (config, field) in enumerate(cases):
        with pytest.raises(FormatError, match=field) as err:
            read_head_config(config, f"case{i}/config.json")
        assert "\n" not in str(err.value) and f"case{i}/config.json" in str(err.value)
    with pytest.raises(FormatError, match="--format eagle3"):
        import_head(angelslim["dir"], tiny["model"], tmp_path / "x", layout="speculators")
    # a tensor the layout does not have
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(angelslim["config"]))
    torch.save({**angelslim["tensors"], "midlayer.self_attn.q_norm.weight": torch.ones(4)}, bad / "pytorch_model.bin")
    with pytest.raises(FormatError, match="q_norm"):
        import_head(bad, tiny["model"], tmp_path / "y", aux_convention="sglang")


# ---------------------------------------------------------------- the published-head target

def test_publisher_decoding_and_the_table(tmp_path):
    """Each head's stage config carries its publisher's chain or tree; the table sets our tau
    beside theirs with the relative difference and a verdict against the tolerance."""
    from kvshot.config import read_config
    from kvshot.interop.published import head_stage_config, resolve_weights
    from kvshot.report.published import published_table

    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    cfg = read_config([str(repo / "config/config.yaml"), str(repo / "config/paper.yaml")])
    heads = {h["name"]: h for h in cfg["published"]["heads"]}
    bench_stage = stage_config(cfg, "target", "drafters", "eval", BENCHMARKS_AXIS)   # published_benchmarks' params
    redhat = head_stage_config(bench_stage, heads["redhat-eagle3"])
    assert redhat["drafters"]["ttt_steps"] == 7 and redhat["drafters"]["variants"] == [
        {"name": "redhat-eagle3", "paradigm": "hidden", "layers": 1, "format": "speculators",
         "weights": "hub:RedHatAI/Qwen3-8B-speculator.eagle3@08610ffa01dd9f16731fe8f627b85905b6aa51c4"}]
    angel = head_stage_config(bench_stage, heads["angelslim-eagle3"])
    assert "benchmarks" not in head_stage_config(stage_config(cfg, "target", "drafters", "eval"),
                                                 heads["angelslim-eagle3"])["eval"]["e2e"]   # published_e2e's
    assert angel["eval"]["e2e"]["tree"] == {"depth": 6, "topk": 10, "total_tokens": 60}
    # the benchmarks axis at the publisher's shape and temperatures only
    bench = angel["eval"]["e2e"]["benchmarks"]
    assert bench["modes"] == ["tree"] and bench["temperatures"] == [0.0, 1.0]
    assert redhat["eval"]["e2e"]["benchmarks"]["modes"] == ["chain"]
    assert redhat["eval"]["e2e"]["benchmarks"]["temperatures"] == [0.0]   # RedHatAI's figures are T = 0 only
    assert resolve_weights("/some/folder") == "/some/folder"
    for name, tau in (("redhat-eagle3", 2.80), ("angelslim-eagle3", 3.00)):
        (tmp_path / name).mkdir()
        mode = heads[name]["decoding"]["mode"]
        (tmp_path / name / "e2e.json").write_text(json.dumps({"lossless": True, "modes": {mode: {"tau": tau}}}))

    def cell(tau):
        return {"modes": {"tree": {"tau": tau, "intervals": {"tau": {"ci": [tau - 0.2, tau + 0.2]}}}}}

    # AngelSlim's head also ran the benchmarks axis: MT-Bench and GSM8K at T = 0 and T = 1
    (tmp_path / "angelslim-eagle3" / "benchmarks.json").write_text(json.dumps({"benchmarks": {
        "mt-bench": {"temperatures": {"T=0": cell(3.50), "T=1": cell(2.00)}},
        "gsm8k": {"temperatures": {"T=0": cell(3.80)}}}}))
    out = published_table(section(PublishedSettings, cfg["published"]), tmp_path, tmp_path / "table.md")
    judged = {(r["head"], r["T"], r["benchmark"]): r for r in out["rows"] if r["ours"] is not None}
    assert set(judged) == {("redhat-eagle3", "T0", "mtbench"), ("angelslim-eagle3", "T0", "mtbench"),
                           ("angelslim-eagle3", "T1", "mtbench"), ("angelslim-eagle3", "T0", "gsm8k")}
    assert judged["redhat-eagle3", "T0", "mtbench"]["verdict"] == "within"       # e2e.json: 2.80 vs 2.72, +2.9%
    assert judged["angelslim-eagle3", "T0", "mtbench"]["verdict"] == "within"    # 3.50 vs 3.65: -4.1%
    assert judged["angelslim-eagle3", "T1", "mtbench"]["verdict"] == "outside"   # 2.00 vs 2.75: -27.3%
    assert judged["angelslim-eagle3", "T0", "gsm8k"]["rel_diff"] == pytest.approx(3.80 / 3.90 - 1)
    text = (tmp_path / "table.md").read_text()
    assert "| redhat-eagle3 | chain 7 | 0 | mtbench | 2.72 | 2.80 | - | +2.9% | within | yes |" in text
    assert "| angelslim-eagle3 | tree 6/10/60 | 1 | mtbench | 2.75 | 2.00 | [1.80, 2.20] | -27.3% | outside | yes |" in text
    assert "| angelslim-eagle3 | tree 6/10/60 | 0 | alpaca | 3.48 | - | - | - | not run" in text
