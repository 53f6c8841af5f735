"""Evaluation prompts, the target's cached greedy continuations, and the step-wise
chain-drafting simulation (alpha_k, acc_k, MAT, retention with bootstrap intervals)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from .config import Runtime, drafter_autocast
from .chat import encode_prompt
from .data import DataError, read_jsonl
from .drafters import Drafter
from .features import pad_batch
from .io import read_json, write_json
from .metrics import DEFAULT_MIN_ROUNDS, chain_counts, chain_summary
from .target import target_forward
from .ttt import unroll
from .progress import progress


def prompt_conversations(eval_jsonl: str | Path, n: int, sources: list[dict] | None = None) -> list[list[dict]]:
    """Held-out conversations from the eval split, or public suites through `datasets`
    (e.g. MT-Bench prompts, schema `mtbench`) when eval.prompt_sources is set."""
    if not sources:
        return [c["messages"] for c in read_jsonl(eval_jsonl)[:n]]
    from .data import load_sources

    convs: list[list[dict]] = []
    stats: list = []
    for src in sources:
        convs += load_sources([src], stats)[: n - len(convs)]
    return convs


def eval_prompts(conversations: list[list[dict]], tokenizer, max_prompt_len: int) -> list[list[int]]:
    """The conversation up to its first assistant turn, with the generation prompt, rendered as
    training text is (`chat`); long prompts keep their end (the part next to the answer)."""
    prompts = []
    for msgs in conversations:
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        prompts.append(encode_prompt(tokenizer, msgs[:first], max_prompt_len))
    return prompts


@torch.no_grad()
def greedy_continuations(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, device: str) -> list[dict]:
    """The target's own greedy output for each prompt (batch 1: no padding effects)."""
    out = []
    for ids in progress(prompts, desc="target continuations", unit="prompt"):
        x = torch.tensor([ids], device=device)
        gen = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        out.append({"prompt": ids, "continuation": gen[0, len(ids):].tolist()})
    return out


def run_continuations_stage(cfg: dict, rt: Runtime, eval_jsonl: str, target_dir: str, out_path: str) -> dict:
    from .target import load_target
    from .tokenizer import load_tokenizer

    ecfg = cfg["eval"]
    target = load_target(target_dir, rt, cfg["target"]["attn_implementation"])
    tokenizer = load_tokenizer(target_dir)
    convs = prompt_conversations(eval_jsonl, ecfg["prompts"], ecfg.get("prompt_sources"))
    prompts = eval_prompts(convs, tokenizer, ecfg["max_prompt_len"])
    start = time.time()
    items = greedy_continuations(target, tokenizer, prompts, ecfg["max_new_tokens"], rt.device)
    result = {"target": target_dir, "max_new_tokens": ecfg["max_new_tokens"], "eos_id": tokenizer.eos_token_id,
              "seconds": time.time() - start, "items": items}
    write_json(out_path, result)
    return {"prompts": len(items), "tokens": sum(len(i["continuation"]) for i in items)}


def chain_rows(prompt_len: int, length: int, steps: int) -> range:
    """Anchors inside the continuation that leave room for all K steps: the target has
    computed the prompt (anchor prompt_len-1 onwards) and position t+K exists."""
    return range(prompt_len - 1, length - steps)


@torch.no_grad()
def chain_correct(drafter: Drafter, target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
                  batch_size: int, device: str, dtype: str = "float32") -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """Per sequence: the chain anchors (`chain_rows`), and for each anchor and step whether the
    drafter's token equals the target's greedy token, drafting on its own outputs (chain) and
    teacher-forced. Batched over anchors and sequences: no loop per position. The drafter runs
    in the runtime `dtype`'s precision (`drafter_autocast`), as in training; results on the CPU."""
    drafter.eval()
    kv_layers = tuple(drafter.cfg.kv_layers)
    head = target.lm_head.weight
    for i in progress(range(0, len(items), batch_size), desc="stepwise", unit="batch"):
        group = items[i: i + batch_size]
        seqs = [torch.tensor(it["prompt"] + it["continuation"]) for it in group]
        batch = pad_batch([{"input_ids": s, "loss_mask": torch.ones_like(s, dtype=torch.uint8)} for s in seqs])
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        ctx = target_forward(target, ids, mask, aux_layers, kv_layers)
        greedy = (ctx.last_hidden @ head.T).argmax(-1)                           # target's token after t
        feats = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, "aux_hidden": ctx.aux_hidden}
        for l in kv_layers:
            feats[f"key_{l}"], feats[f"value_{l}"] = ctx.keys[l], ctx.values[l]
        with drafter_autocast(device, dtype):
            chain = unroll(drafter, feats, steps, own_tokens=True)
            forced = unroll(drafter, feats, steps)
        for b, it in enumerate(group):
            rows = torch.tensor(list(chain_rows(len(it["prompt"]), len(seqs[b]), steps)), dtype=torch.long)
            at = rows.to(ids.device)
            want = torch.stack([greedy[b, at + k + 1] for k in range(steps)], dim=1)
            drafted = torch.stack([drafter.d2t[chain.logits[k][b, at].argmax(-1)] for k in range(steps)], dim=1)
            tf = torch.stack([drafter.d2t[forced.logits[k][b, at].argmax(-1)] for k in range(steps)], dim=1)
            yield rows, (drafted == want).cpu(), (tf == want).cpu()


def stepwise(drafter: Drafter, target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
             batch_size: int, device: str, bootstrap_samples: int = 1000, seed: int = 0,
             dtype: str = "float32", min_rounds: int = DEFAULT_MIN_ROUNDS) -> dict:
    """Exact greedy chain drafting from every anchor of the target's continuations: alpha_k,
    acc_k, MAT, retention, with intervals that resample whole sequences (`chain_summary`)."""
    reached_seq, accepted_seq, tf_correct, tf_total = [], [], torch.zeros(steps), 0
    for rows, chain_ok, forced_ok in chain_correct(drafter, target, items, aux_layers, steps, batch_size, device,
                                                   dtype):
        if len(rows) == 0:
            continue
        r, a = chain_counts(chain_ok)
        reached_seq.append(r)
        accepted_seq.append(a)
        tf_correct += forced_ok.sum(0).float()
        tf_total += len(rows)
    if not reached_seq:
        raise ValueError(f"no continuation is longer than {steps} tokens: nothing to evaluate")
    reached, accepted = torch.stack(reached_seq), torch.stack(accepted_seq)
    result = {
        "acc": (tf_correct / max(tf_total, 1)).tolist(),
        "acc_note": "unconditional teacher-forced top-1 accuracy per step (acc_k), not alpha_k",
        "sequences": int(reached.shape[0]),
        "steps": steps,
    }
    result.update(chain_summary(reached, accepted, bootstrap_samples, seed, min_rounds))
    return result


def read_continuations(path: str) -> dict:
    """The target_continuations output; a truncated or damaged file is one DataError line naming it."""
    redo = "delete it and rerun: Snakemake remakes it with target_continuations"
    try:
        cont = read_json(path)
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError: a killed or damaged write
        raise DataError(f"{path}: not a complete JSON file ({' '.join(str(e).split())[:120]}); {redo}") from e
    items = cont.get("items") if isinstance(cont, dict) else None
    if (not isinstance(items, list) or "eos_id" not in cont
            or not all(isinstance(it, dict) and isinstance(it.get("prompt"), list)
                       and isinstance(it.get("continuation"), list) for it in items)):
        raise DataError(f"{path}: expected {{'eos_id', 'items': [{{'prompt', 'continuation'}}]}}; {redo}")
    return cont


def run_stepwise_stage(cfg: dict, rt: Runtime, drafter_dir: str, target_dir: str, continuations: str,
                       features_index: str, out_path: str) -> dict:
    from .drafters import load_drafter
    from .target import load_target

    from .drafters.attention import use_attention

    use_attention(cfg["drafters"].get("attention", "auto"))
    items = read_continuations(continuations)["items"]   # before the models load: a damaged file fails fast
    target = load_target(target_dir, rt, cfg["target"]["attn_implementation"])
    drafter = load_drafter(drafter_dir, rt.device)
    aux = tuple(read_json(features_index)["spec"]["aux_layers"])
    start = time.time()
    result = stepwise(drafter, target, items, aux, cfg["drafters"]["ttt_steps"], cfg["eval"]["batch_size"],
                      rt.device, cfg["eval"]["bootstrap_samples"], cfg["seed"], rt.dtype,
                      min_rounds=cfg["eval"]["min_rounds"])
    result.update(variant=Path(drafter_dir).name, paradigm=drafter.cfg.paradigm, layers=drafter.cfg.num_layers,
                  seconds=time.time() - start, device=rt.device, threads=rt.threads)
    write_json(out_path, result)
    return {k: result[k] for k in ("alpha", "mat", "retention")}
