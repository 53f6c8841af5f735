"""Published EAGLE-3 heads as they ship (issue 39): one fixture per layout family, each the field set
of a real published config (tests/fixtures/published/*.json, sizes shrunk), random weights under
that publisher's tensor names and a stand-in target with the real layer count. Each is imported
by `kvshot import` and its logits over K TTT steps compared with an independent reference forward
that reads the checkpoint's own tensor names and follows the publisher's code for every switch.

  SpecForge   configs/qwen3-8b-eagle3.json (LlamaForCausalLMEagle3)
  AngelSlim   train/configs/qwen3-8b-eagle3.json (Eagle3LlamaForCausalLM, target_model_type)
  EAGLE       eagle/traineagle3/config.json (LlamaForCausalLM, pytorch_model.bin)
  speculators configs as speculators 0.1, 0.5 and 0.7 write them (layers.0.*, nested layer config)
The cases of the issue are in tests/unit/test_published_cases.py (they reuse these helpers).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvshot.__main__ import main
from kvshot.drafters import load_drafter
from kvshot.drafters.unroll import unroll

FIXTURES = Path(__file__).parents[1] / "fixtures" / "published"
H, V, N, T, K = 32, 64, 24, 14, 4
TARGET_LAYERS = {"specforge-qwen3-8b-eagle3": 36, "specforge-qwen3-30b-a3b-eagle3.1": 48,
                 "specforge-kimi-k25-eagle3": 61, "angelslim-qwen3-8b-eagle3": 36, "angelslim-qwen3-1.7b-eagle3": 28,
                 "eagle-traineagle3": 32, "speculators-0.1": 36, "speculators-0.5": 36, "speculators-0.7": 36}


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def make_target(folder: Path, layers: int, seed: int = 1) -> Path:
    """A stand-in target: its config (the real layer count) and its input embedding."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": H, "vocab_size": V,
                                                    "num_hidden_layers": layers, "max_position_embeddings": 4096}))
    g = torch.Generator().manual_seed(seed)
    save_file({"model.embed_tokens.weight": torch.randn(V, H, generator=g)}, str(folder / "model.safetensors"))
    return folder


def target_embed(folder: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]


def head_tensors(config: dict, seed: int = 0, own_embedding: bool = False) -> dict:
    """Random weights under the publisher's names: `midlayer.*` (flat) or `layers.0.*` (speculators),
    q/k norms for a Qwen3 speculators layer, fc_norm.{i} when on, d2t offsets, t2d."""
    layer_cfg = config.get("transformer_layer_config") or config
    speculators = "transformer_layer_config" in config
    p = "layers.0." if speculators else "midlayer."
    hq, hkv, inner = layer_cfg["num_attention_heads"], layer_cfg["num_key_value_heads"], layer_cfg["intermediate_size"]
    d = layer_cfg.get("head_dim") or H // hq
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=0.2: s * torch.randn(*shape, generator=g)
    norm = lambda n=H: 1.0 + rnd(n, s=0.2)
    d2t = torch.sort(torch.randperm(V, generator=g)[:N]).values
    t = {"fc.weight": rnd(H, 3 * H), p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
         p + "self_attn.q_proj.weight": rnd(hq * d, 2 * H), p + "self_attn.k_proj.weight": rnd(hkv * d, 2 * H),
         p + "self_attn.v_proj.weight": rnd(hkv * d, 2 * H), p + "self_attn.o_proj.weight": rnd(H, hq * d),
         p + "post_attention_layernorm.weight": norm(), p + "mlp.gate_proj.weight": rnd(inner, H),
         p + "mlp.up_proj.weight": rnd(inner, H), p + "mlp.down_proj.weight": rnd(H, inner),
         "norm.weight": norm(), "lm_head.weight": rnd(N, H), "d2t": d2t - torch.arange(N),
         "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, d2t, True)}
    if speculators and layer_cfg.get("model_type", "qwen3") == "qwen3":
        t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = norm(d), norm(d)
    if config.get("fc_norm"):
        t.update({f"fc_norm.{i}.weight": norm() for i in range(3)})
    if own_embedding:
        t["embed_tokens.weight"] = torch.randn(V, H, generator=g)
    return t


def write_head(folder: Path, config: dict, tensors: dict, bin_file: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if bin_file:   # EAGLE's and AngelSlim's heads ship pytorch_model.bin
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------- the reference

def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions, theta):
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * theta ** (-2.0 * torch.arange(half).double() / x.shape[-1])
    cos, sin = angle.cos().float(), angle.sin().float()
    return torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def reference_logits(p: dict, layer: dict, embed, aux, ids, steps: int, *, speculators: bool, fc_norm: bool,
                     norm_before_residual: bool, carry_normed: bool, head_norm: bool):
    """Draft logits [steps, T, N] of one sequence, EAGLE-3's TTT written out step by step over the
    checkpoint's own names. carry_normed: vLLM's norm_output (the next step reads norm(h), the head
    reads it as is); head_norm false: SpecForge's norm_output false (the head reads h itself)."""
    pre = "layers.0." if speculators else "midlayer."
    L = lambda name: p[pre + name].float()
    eps, hq, hkv = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"]
    d = layer.get("head_dim") or H // hq
    theta = layer.get("rope_theta", (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    qk_norm = pre + "self_attn.q_norm.weight" in p
    if fc_norm:
        aux = torch.stack([rms(aux[:, i], p[f"fc_norm.{i}.weight"].float(), eps) for i in range(3)], 1)
    state = aux.flatten(-2) @ p["fc.weight"].float().T
    n = ids.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keys, values, out = [], [], []
    for k in range(steps):
        token = torch.cat([ids[k + 1:], torch.zeros(k + 1, dtype=ids.dtype)])
        pos = torch.arange(n) + k
        normed = rms(state, L("hidden_norm.weight"), eps)
        x = torch.cat([rms(embed[token], L("input_layernorm.weight"), eps), normed], -1)
        q = (x @ L("self_attn.q_proj.weight").T).view(n, hq, d)
        kk = (x @ L("self_attn.k_proj.weight").T).view(n, hkv, d)
        v = (x @ L("self_attn.v_proj.weight").T).view(n, hkv, d).transpose(0, 1)
        if qk_norm:
            q, kk = rms(q, L("self_attn.q_norm.weight"), eps), rms(kk, L("self_attn.k_norm.weight"), eps)
        q, kk = rotate(q.transpose(0, 1), pos, theta), rotate(kk.transpose(0, 1), pos, theta)
        keys.append(kk.repeat_interleave(hq // hkv, 0))
        values.append(v.repeat_interleave(hq // hkv, 0))
        scores = [(q @ keys[0].transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))]
        scores += [(q * keys[j]).sum(-1, keepdim=True) / math.sqrt(d) for j in range(1, k + 1)]
        w = torch.softmax(torch.cat(scores, -1), -1)
        att = w[..., :n] @ values[0]
        for j in range(1, k + 1):
            att = att + w[..., n + j - 1: n + j] * values[j]
        h = (normed if norm_before_residual else state) + att.transpose(0, 1).reshape(n, hq * d) @ L(
            "self_attn.o_proj.weight").T
        m = rms(h, L("post_attention_layernorm.weight"), eps)
        h = h + (F.silu(m @ L("mlp.gate_proj.weight").T) * (m @ L("mlp.up_proj.weight").T)) @ L("mlp.down_proj.weight").T
        if carry_normed:
            h = rms(h, p["norm.weight"].float(), eps)
        head_in = rms(h, p["norm.weight"].float(), eps) if (head_norm and not carry_normed) else h
        out.append(head_in @ p["lm_head.weight"].float().T)
        state = h
    return torch.stack(out)


def inputs(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 3, H, generator=g), torch.randint(0, V, (T,), generator=g)


def kvshot_logits(drafter, aux, ids, steps: int = K):
    batch = {"input_ids": ids[None], "attention_mask": torch.ones(1, T, dtype=torch.long),
             "loss_mask": torch.ones(1, T, dtype=torch.long), "aux_hidden": aux[None]}
    with torch.no_grad():
        return torch.stack([lg[0] for lg in unroll(drafter.eval(), batch, steps).logits])


def max_delta(ours, ref) -> float:
    rows = T - K   # rows whose every step reads a real token
    return (ours[:, :rows] - ref[:, :rows]).abs().max().item()


def import_cli(head: Path, out: Path, target: Path, *flags: str) -> dict:
    assert main(["import", "--format", "eagle3", str(head), str(out), "--target", str(target), *flags]) == 0
    return json.loads((out / "import.json").read_text())


def reference_for(config: dict, tensors: dict, embed, **switches):
    aux, ids = inputs()
    layer = config.get("transformer_layer_config") or config
    kw = {"speculators": "transformer_layer_config" in config, "fc_norm": bool(config.get("fc_norm")),
          "norm_before_residual": False, "carry_normed": False, "head_norm": True, **switches}
    return reference_logits(tensors, layer, embed, aux, ids, K, **kw)


def imported_logits(out: Path, target: Path):
    aux, ids = inputs()
    return kvshot_logits(load_drafter(out, embed=target_embed(target)), aux, ids)


# ---------------------------------------------------------------- one fixture per layout family

FAMILIES = {   # fixture: (file, switches the publisher's code gives it, family)
    "specforge-qwen3-8b-eagle3": (False, {}, "specforge"),
    "angelslim-qwen3-8b-eagle3": (True, {}, "vllm"),
    "eagle-traineagle3": (True, {}, "eagle"),
    "speculators-0.1": (False, {"norm_before_residual": True}, "speculators"),
    "speculators-0.5": (False, {"norm_before_residual": True}, "speculators"),
    "speculators-0.7": (False, {"norm_before_residual": True, "carry_normed": True}, "speculators"),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_layout_family_imports_and_matches_the_reference(name, tmp_path):
    bin_file, switches, family = FAMILIES[name]
    config = fixture_config(name)
    own = bool(config.get("embed_requires_grad"))
    tensors = head_tensors(config, own_embedding=own)
    head = write_head(tmp_path / "head", config, tensors, bin_file)
    target = make_target(tmp_path / "target", TARGET_LAYERS[name])
    meta = import_cli(head, tmp_path / "out", target)
    assert meta["family"] == family and meta["own_embedding"] is own
    assert meta["aux_layers"] == [2, TARGET_LAYERS[name] // 2, TARGET_LAYERS[name] - 3]
    assert set(meta["resolved"]) == {"aux_convention", "norm_output", "norm_before_residual", "embedding"}
    embed = tensors["embed_tokens.weight"] if own else target_embed(target)
    ref = reference_for(config, tensors, embed, **switches)
    delta = max_delta(imported_logits(tmp_path / "out", target), ref)
    print(f"{name}: max |dlogit| {delta:.1e} over {K} steps")
    assert delta <= 1e-4
