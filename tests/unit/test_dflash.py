"""The block drafter in DFlash's layout (`block-dflash`, drafters/block.py) and its vLLM folder
(kvshot.interop.dflash): kvshot's draft of a block equals vLLM's DFlash computation written
out on the exported tensors (fc, hidden_norm, fused context K/V with k_norm and RoPE, a
non-causal block of the bonus token and K mask slots, norm, lm_head, d2t offsets), at every
K up to the trained block; export then import gives the same logits; what the format cannot
hold is refused in one line. vLLM's own loader reads the folder in
tests/pipeline/test_vllm_serve.py."""
from __future__ import annotations

import math

import pytest
import torch

from kvshot.drafters import load_drafter
from kvshot.evaluate.draft_tree import DraftSpec, draft
from kvshot.interop.dflash import drafter_from_dflash, export_dflash, import_dflash, read_dflash
from kvshot.interop.export import FormatError

from ..conftest import build_test_drafter

S = 5   # trained block: the bonus token and four mask slots
ENTRY = {"name": "bd", "paradigm": "block", "context": "dflash", "layers": 2, "block_size": S}


@pytest.fixture(scope="module")
def exported(drafter_world, tiny, tmp_path_factory):
    src, target, _ = drafter_world
    model = build_test_drafter(drafter_world, ENTRY)
    with torch.no_grad():   # a mask embedding unlike any token's
        model.mask_embed.normal_()
    root = tmp_path_factory.mktemp("dflash")
    model.save(root / "drafter")
    aux = list(src.spec.aux_layers)
    summary = export_dflash(root / "drafter", root / "export", tiny["model"], aux)
    return model, root, aux, summary, target


# ---------------------------------------------------------------- vLLM's computation, written out

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated at positions pos [T], neox style (halves), as vLLM's get_rope."""
    d = x.shape[-1]
    ang = pos[:, None].double() * (1.0 / theta ** (torch.arange(0, d, 2).double() / d))   # [T, D/2]
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def vllm_dflash_logits(folder, embed: torch.Tensor, aux_hidden: torch.Tensor, bonus: int, k: int) -> torch.Tensor:
    """What vLLM's DFlashQwen3ForCausalLM computes for one request's first round: context = the
    prompt's T tokens (aux_hidden [T, A, H]), the bonus token at position T and K mask slots
    after it. Returns the K mask slots' logits over the target vocabulary [K, V]."""
    config, w, mask = read_dflash(folder)
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    t = aux_hidden.shape[0]
    context = rms(aux_hidden.flatten(-2) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)   # combine, then hidden_norm
    ids = torch.tensor([bonus] + [config["dflash_config"]["mask_token_id"]] * k)
    h = embed[ids].clone()
    h[1:] = mask                                      # mask_embedding.pt replaces embed[mask_token_id]
    pos_ctx, pos_q = torch.arange(t), t + torch.arange(k + 1)
    for i in range(config["num_hidden_layers"]):
        p = lambda name: w[f"layers.{i}.{name}"]      # noqa: E731
        k_ctx = rope_neox(rms((context @ p("self_attn.k_proj.weight").T).view(t, nkv, hd), p("self_attn.k_norm.weight"), eps),
                          pos_ctx, theta)
        v_ctx = (context @ p("self_attn.v_proj.weight").T).view(t, nkv, hd)
        x = rms(h, p("input_layernorm.weight"), eps)
        q = rope_neox(rms((x @ p("self_attn.q_proj.weight").T).view(k + 1, nh, hd), p("self_attn.q_norm.weight"), eps),
                      pos_q, theta)
        k_q = rope_neox(rms((x @ p("self_attn.k_proj.weight").T).view(k + 1, nkv, hd), p("self_attn.k_norm.weight"), eps),
                        pos_q, theta)
        v_q = (x @ p("self_attn.v_proj.weight").T).view(k + 1, nkv, hd)
        keys = torch.cat([k_ctx, k_q]).repeat_interleave(nh // nkv, 1)     # [T + K + 1, nh, hd]
        values = torch.cat([v_ctx, v_q]).repeat_interleave(nh // nkv, 1)
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(hd), -1)   # no causal mask
        out = torch.einsum("hqk,khd->qhd", probs, values).reshape(k + 1, nh * hd)
        h = h + out @ p("self_attn.o_proj.weight").T
        y = rms(h, p("post_attention_layernorm.weight"), eps)
        gate, up = y @ p("mlp.gate_proj.weight").T, y @ p("mlp.up_proj.weight").T
        h = h + (torch.nn.functional.silu(gate) * up) @ p("mlp.down_proj.weight").T
    logits = rms(h[1:], w["norm.weight"], eps) @ w["lm_head.weight"].T                   # [K, draft vocab]
    if "d2t" not in w:
        return logits
    full = torch.full((k, config["vocab_size"]), float("-inf"))
    full[:, torch.arange(len(w["d2t"])) + w["d2t"]] = logits                              # offsets, as vLLM maps them
    return full


def kvshot_logits(model, aux_hidden: torch.Tensor, bonus: int, k: int) -> tuple[torch.Tensor, list[int]]:
    """kvshot's first round on the same prompt: begin over its T anchors, then the decoder's
    block draft at depth K; the K positions' logits over the target vocabulary and the drafted ids."""
    t = aux_hidden.shape[0]
    anchors = torch.arange(t)[None]
    state = model.begin({"aux_hidden": aux_hidden[None]}, anchors)
    d = draft(model, state, torch.tensor([[bonus]]), anchors, DraftSpec(depth=k))
    state = model.begin({"aux_hidden": aux_hidden[None]}, anchors)
    state.select_rows(slice(-1, None))
    h = model.draft_block(state, torch.tensor([[bonus]]), torch.tensor([[t]]), slots=k + 1)
    draft_logits = model.logits(h[0, 0, 1:])
    full = torch.full((k, model.cfg.vocab_size), float("-inf"))
    full[:, model.d2t] = draft_logits
    return full, d.tokens


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("k", [1, 2, S - 1])
def test_kvshots_block_draft_is_vllms_dflash_computation(drafter_world, exported, k):
    src, target, _ = drafter_world
    model, root, *_ = exported
    aux_hidden = src.batch([0])["aux_hidden"][0, :23].float()
    bonus = int(src.batch([0])["input_ids"][0, 23])
    embed = target.model.embed_tokens.weight.detach()
    want = vllm_dflash_logits(root / "export", embed, aux_hidden, bonus, k)
    got, tokens = kvshot_logits(model, aux_hidden, bonus, k)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], want[finite], atol=2e-5, rtol=1e-4)
    assert tokens == want.argmax(-1).tolist()   # the decoder drafts what vLLM drafts


def test_a_shorter_block_is_a_different_block(drafter_world, exported):
    """Every slot sees the whole block: drafting 2 tokens with 3 slots is not the first 2 of a 5-slot
    block (why the decoder drafts K tokens with K + 1 slots, as vLLM does)."""
    src, *_ = drafter_world
    model = exported[0]
    aux_hidden = src.batch([0])["aux_hidden"][0, :23].float()
    short, _ = kvshot_logits(model, aux_hidden, 7, 2)
    full, _ = kvshot_logits(model, aux_hidden, 7, S - 1)
    assert not torch.allclose(short, full[:2])


def test_export_then_import_gives_the_drafters_logits(drafter_world, exported, tiny, tmp_path):
    src, *_ = drafter_world
    model, root, aux, summary, _ = exported
    assert summary["aux_layers"] == aux and summary["block_size"] == S
    config, tensors, _ = read_dflash(root / "export")
    assert config["dflash_config"]["target_layer_ids"] == [a - 1 for a in aux]   # a layer's output, from 0
    assert "embed_tokens.weight" not in tensors and "t2d" not in tensors
    back, back_aux = drafter_from_dflash(root / "export", tiny["model"])
    assert back_aux == aux
    aux_hidden = src.batch([1])["aux_hidden"][0, :30].float()
    for k in (1, S - 1):
        torch.testing.assert_close(kvshot_logits(back, aux_hidden, 11, k)[0], kvshot_logits(model, aux_hidden, 11, k)[0])
    import_dflash(root / "export", tiny["model"], tmp_path / "imported")
    loaded = load_drafter(tmp_path / "imported", embed=model.embed_tokens.weight)
    torch.testing.assert_close(kvshot_logits(loaded, aux_hidden, 11, 2)[0], kvshot_logits(model, aux_hidden, 11, 2)[0])


def test_what_the_format_cannot_hold_is_refused_in_one_line(drafter_world, tiny, tmp_path):
    src = drafter_world[0]
    for entry, why in (({"name": "bh", "paradigm": "block", "context": "hidden", "layers": 1, "block_size": S},
                        "DFlash's layout only"),
                       ({**ENTRY, "refine_passes": 1}, "one pass")):
        folder = tmp_path / entry["name"] / str(entry.get("refine_passes", 0))
        build_test_drafter(drafter_world, entry).save(folder)
        with pytest.raises(FormatError, match=why) as err:
            export_dflash(folder, tmp_path / "out", tiny["model"], list(src.spec.aux_layers))
        assert "\n" not in str(err.value) and str(folder) in str(err.value)
