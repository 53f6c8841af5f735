"""The target model: pretrain a small Qwen3 or Llama (embedded default: Qwen3), load a
hub model (paper: Qwen3-8B) or a GGUF file a Python package ships (SmolLM2-135M-Instruct,
`kvshot.core.gguf`), and one forward that returns what every drafter paradigm reads. Every later
stage loads the target through `load_target` (transformers' Auto classes: any decoder
family with HF `hidden_states` and a DynamicCache)."""
from __future__ import annotations

import functools
import importlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel,
                          Qwen3Config, Qwen3ForCausalLM)

from kvshot.config import Runtime
from kvshot.core.integrity import verify_folder, write_manifest
from kvshot.core.io import atomic_dir, read_json, write_json
from kvshot.core.progress import Progress
from kvshot.core.schedule import lr_at
from kvshot.data.chat import encode_prompt, tokenize_conversation
from kvshot.data.sources import read_jsonl
from kvshot.data.tokenizer import load_tokenizer
from kvshot.settings import ArchSettings, Config, PretrainSettings, to_dict

META_FILE = "kvshot_target.json"
# the target stage saved these targets' weights in its folder; a `pretrained` target stays in the hub cache
LOCAL_SOURCES = ("pretrain", "gguf")


@functools.cache
def flash_attn_problem() -> str | None:
    """Why flash-attn cannot be used in this process, or None when it imports. The import is
    tried, not only found: a half-installed build (a missing CUDA symbol, a wheel for another
    torch) raises here, once per process, instead of in every stage that loads the target."""
    try:
        importlib.import_module("flash_attn")
    except ModuleNotFoundError as exc:
        if exc.name == "flash_attn":
            return "flash-attn is not installed"
        return f"flash-attn fails to import ({type(exc).__name__}: {_first_line(exc)})"
    except Exception as exc:   # ImportError from a missing CUDA symbol, OSError, RuntimeError...
        return f"flash-attn fails to import ({type(exc).__name__}: {_first_line(exc)})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else "no message"


_warned: set[str] = set()


def attn_implementation(requested: str, device: str) -> str:
    """The target's attention: `requested` as given unless it is "auto"; "auto" is
    flash_attention_2 on CUDA when flash-attn imports, else SDPA. A CUDA run that falls back
    says why in one warning line (once per process)."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "sdpa"
    problem = flash_attn_problem()
    if problem is None:
        return "flash_attention_2"
    if problem not in _warned:
        _warned.add(problem)
        print(f"warning: {problem}; the target uses SDPA attention", file=sys.stderr, flush=True)
    return "sdpa"


# target.arch.model_type -> the transformers classes a pretrained target is built from
ARCHS = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def build_target(arch: ArchSettings, vocab_size: int, pad_id: int, attn: str = "sdpa") -> PreTrainedModel:
    """A fresh target of `arch` (model_type qwen3 or llama: no q/k norm)."""
    fields = to_dict(arch)
    config_cls, model_cls = ARCHS[fields.pop("model_type")]
    config = config_cls(vocab_size=vocab_size, pad_token_id=pad_id, attn_implementation=attn, **fields)
    return model_cls(config)


def _weights(target_dir: str | Path) -> tuple[str, str | None]:
    """Where the target's weights are: the stage's folder (pretrain, gguf), or a hub id."""
    verify_folder(target_dir)   # a damaged weights file fails here, in one line naming it
    meta = read_json(Path(target_dir) / META_FILE)
    local = meta["source"] in LOCAL_SOURCES
    return (str(target_dir), None) if local else (meta["name"], meta.get("revision"))


def load_target(target_dir: str | Path, rt: Runtime, attn: str = "auto") -> PreTrainedModel:
    """Load what the `target` stage wrote: local weights, or the hub id it names."""
    weights, revision = _weights(target_dir)
    model = AutoModelForCausalLM.from_pretrained(
        weights, dtype=rt.torch_dtype, attn_implementation=attn_implementation(attn, rt.device), revision=revision)
    return model.to(rt.device).eval()


def load_target_config(target_dir: str | Path):
    """The target's config alone (no weights): what online capture needs to describe the features."""
    weights, revision = _weights(target_dir)
    return AutoConfig.from_pretrained(weights, revision=revision)


def has_qk_norm(config) -> bool:
    """Whether the target's attention normalises q and k per head (Qwen3) or not (Llama)."""
    return getattr(config, "model_type", "qwen3").startswith("qwen3")


def rope_theta(config) -> float:
    """The target's RoPE base; KV-path drafters must rotate their queries the same way."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"target uses rope_type {params['rope_type']!r}; kvshot's drafters implement 'default' only")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


# ------------------------------------------------------------------ the capture forward

@dataclass
class TargetContext:
    """Target activations for a right-padded batch, token-major.

    aux_hidden: [B, T, 3, H] low/middle/high hidden states (EAGLE-3 taps)
    last_hidden: [B, T, H] final-norm output; lm_head(last_hidden) gives the target logits
    keys/values: layer -> [B, T, H_kv, D]; keys are after RoPE (and Qwen3's k-norm), as
                 the target's own KV cache holds them
    """

    aux_hidden: Tensor
    last_hidden: Tensor
    keys: dict[int, Tensor]
    values: dict[int, Tensor]


@torch.no_grad()
def target_forward(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None,
                   aux_layers: tuple[int, ...], kv_layers: tuple[int, ...]) -> TargetContext:
    # The decoder body only: the LM head over a 152k vocab is not needed to capture.
    out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                      output_hidden_states=True, use_cache=True)
    hidden = out.hidden_states
    cache = out.past_key_values
    return TargetContext(
        aux_hidden=torch.stack([hidden[i] for i in aux_layers], dim=2),
        last_hidden=hidden[-1],
        keys={l: cache.layers[l].keys.transpose(1, 2) for l in kv_layers},
        values={l: cache.layers[l].values.transpose(1, 2) for l in kv_layers},
    )


# ------------------------------------------------------------------ pretraining

def pack_blocks(token_lists: list[list[int]], sep_id: int, block_size: int) -> Tensor:
    """Concatenate conversations (separated by <|endoftext|>) into [N, block_size]."""
    stream: list[int] = []
    for ids in token_lists:
        stream.extend(ids)
        stream.append(sep_id)
    n = len(stream) // block_size
    if n == 0:
        raise ValueError(f"only {len(stream)} tokens: fewer than one block of {block_size}")
    return torch.tensor(stream[: n * block_size], dtype=torch.long).view(n, block_size)


@torch.no_grad()
def heldout_loss(model, blocks: Tensor, batch_size: int, device: str) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        x = blocks[i: i + batch_size].to(device)
        loss = model(input_ids=x, labels=x).loss
        total += loss.item() * x.numel()
        count += x.numel()
    return total / count


@torch.no_grad()
def sample_generations(model, tokenizer, conversations: list[dict], n: int, max_new: int, device: str) -> list[dict]:
    out = []
    for conv in conversations[:n]:
        prompt_msgs = conv["messages"][: next(i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant")]
        ids = torch.tensor([encode_prompt(tokenizer, prompt_msgs, 256)], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        out.append({"prompt": prompt_msgs[-1]["content"][:200],
                    "greedy": tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)})
    return out


def tokenized(conversations: list[dict], tokenizer, max_len: int) -> list[list[int]]:
    return [tokenize_conversation(tokenizer, c["messages"], max_len)[0] for c in conversations]


def run_target_stage(cfg: Config, rt: Runtime, train_jsonl: str, eval_jsonl: str,
                     tokenizer_dir: str, out_dir: str, metrics_path: str) -> dict:
    tcfg, pcfg = cfg.target, cfg.target.pretrain
    tokenizer = load_tokenizer(tokenizer_dir)
    sep_id = tokenizer.pad_token_id
    eval_convs = read_jsonl(eval_jsonl)
    block = pcfg.block_size
    eval_blocks = pack_blocks(tokenized(eval_convs, tokenizer, cfg.data.max_len), sep_id, block)
    eval_blocks = eval_blocks[: pcfg.eval_blocks]
    torch.manual_seed(rt.seed)
    metrics: dict = {"source": tcfg.source, "device": rt.device, "dtype": rt.dtype, "threads": rt.threads}

    with atomic_dir(out_dir) as tmp:
        if tcfg.source == "pretrain":
            model = build_target(tcfg.arch, len(tokenizer), sep_id).to(rt.device)
            train_blocks = pack_blocks(tokenized(read_jsonl(train_jsonl), tokenizer, cfg.data.max_len),
                                       sep_id, block)
            metrics["initial_heldout_loss"] = heldout_loss(model, eval_blocks, pcfg.batch_size, rt.device)
            metrics.update(pretrain(model, train_blocks, pcfg, rt))
            model.save_pretrained(tmp)
            meta = {"source": "pretrain", "name": None}
        elif tcfg.source == "gguf":
            from kvshot.core.gguf import load_gguf_model

            model = load_gguf_model(tcfg.gguf).to(device=rt.device, dtype=rt.torch_dtype)
            model.save_pretrained(tmp)   # every later stage reads this folder, never the GGUF file
            meta = {"source": "gguf", "name": None, "gguf": to_dict(tcfg.gguf)}
        else:
            model = AutoModelForCausalLM.from_pretrained(
                tcfg.name, dtype=rt.torch_dtype, revision=tcfg.revision,
                attn_implementation=attn_implementation(tcfg.attn_implementation, rt.device)).to(rt.device)
            meta = {"source": "pretrained", "name": tcfg.name, "revision": tcfg.revision}
        tokenizer.save_pretrained(tmp)
        c = model.config
        meta.update(num_hidden_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
                    parameters=sum(p.numel() for p in model.parameters()))
        write_json(Path(tmp) / META_FILE, meta)
        write_manifest(tmp)   # weights (pretrained here), tokenizer and meta: checked when loaded
        loss = heldout_loss(model, eval_blocks, pcfg.batch_size, rt.device)
        metrics.update(meta)
        metrics.update(heldout_loss=loss, heldout_ppl=math.exp(min(loss, 50.0)),
                       heldout_tokens=int(eval_blocks.numel()),
                       generations=sample_generations(model, tokenizer, eval_convs, pcfg.generations,
                                                      pcfg.generation_tokens, rt.device))
    write_json(metrics_path, metrics)
    return metrics


def pretrain(model: PreTrainedModel, blocks: Tensor, pcfg: PretrainSettings, rt: Runtime) -> dict:
    """Next-token pretraining on packed blocks; the step count is the budget."""
    steps, bs = pcfg.max_steps, pcfg.batch_size
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": pcfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=pcfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, steps, pcfg.warmup_steps, pcfg.min_lr_ratio))
    gen = torch.Generator().manual_seed(rt.seed)
    order = torch.randperm(len(blocks), generator=gen)
    cursor, epoch, losses = 0, 0, []
    start, stopped_by = time.time(), "max_steps"
    model.train()
    bar = Progress(total=steps, desc="pretrain target", unit="step")
    for step in range(steps):
        if cursor + bs > len(order):
            order, cursor, epoch = torch.randperm(len(blocks), generator=gen), 0, epoch + 1
        x = blocks[order[cursor: cursor + bs]].to(rt.device)
        cursor += bs
        loss = model(input_ids=x, labels=x).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"target pretraining: loss is {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), pcfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=round(losses[-1], 4), lr=sched.get_last_lr()[0])
        bar.update(1)
        if time.time() - start > 60 * pcfg.max_minutes:
            stopped_by = "max_minutes"
            break
    bar.close()
    model.eval()
    return {"train_steps": len(losses), "train_epochs": epoch + cursor / len(order), "train_blocks": len(blocks),
            "train_tokens_seen": len(losses) * bs * blocks.shape[1], "stopped_by": stopped_by,
            "train_loss_first": losses[0] if losses else None,
            "train_loss_last10": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "train_seconds": time.time() - start}


@torch.no_grad()
def target_queries(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None,
                   layers: list[int]) -> dict[int, Tensor]:
    """The target's own attention queries (after Qwen3's q-norm, before RoPE) per layer,
    [B, H, T, D]: what a KV-path drafter has to estimate for a future position. A layer
    without q-norm (Llama) gives its q_proj output, split into heads."""
    captured: dict[int, Tensor] = {}
    head_dim = model.config.head_dim

    def hook(layer: int, attn) -> object:
        if hasattr(attn, "q_norm"):   # [B, T, H, D] out of the norm
            return attn.q_norm.register_forward_hook(lambda _m, _i, out: captured.__setitem__(layer, out.transpose(1, 2)))
        return attn.q_proj.register_forward_hook(   # [B, T, H * D]
            lambda _m, _i, out: captured.__setitem__(layer, out.unflatten(-1, (-1, head_dim)).transpose(1, 2)))

    hooks = [hook(l, model.model.layers[l].self_attn) for l in set(layers)]
    try:
        model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return captured
