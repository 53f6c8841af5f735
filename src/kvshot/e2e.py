"""The `eval_e2e` stage: real speculative decoding (chain and tree, greedy verification)
against plain decoding in the same harness and the same run, checked lossless against the
target's own cached greedy output."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .config import Runtime
from .decode import DraftSpec, plain_generate, speculative_generate
from .io import read_json, write_json


def specs(cfg: dict) -> dict[str, DraftSpec]:
    tree = cfg["eval"]["e2e"]["tree"]
    return {"chain": DraftSpec(depth=cfg["drafters"]["ttt_steps"], topk=1),
            "tree": DraftSpec(depth=tree["depth"], topk=tree["topk"], total_tokens=tree["total_tokens"])}


def summarize(runs: list, baseline: list, reference: list[list[int]]) -> dict:
    """Totals for tau and per-round times, medians over prompts for throughput and speedup."""
    rounds = sum(r.rounds for r in runs)
    return {
        "tau": sum(sum(r.emitted) for r in runs) / max(rounds, 1),
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "speedup": statistics.median(r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, baseline)),
        "draft_seconds_per_round": sum(r.draft_s for r in runs) / max(rounds, 1),
        "verify_seconds_per_round": sum(r.verify_s for r in runs) / max(rounds, 1),
        "rounds": rounds,
        "tokens": sum(len(r.tokens) for r in runs),
        "accepted_per_round": sum(sum(r.accepted) for r in runs) / max(rounds, 1),
        "lossless": all(r.tokens == ref for r, ref in zip(runs, reference)),
    }


@torch.no_grad()
def run_e2e_stage(cfg: dict, rt: Runtime, drafter_dir: str, target_dir: str, continuations: str,
                  features_index: str, out_path: str) -> dict:
    from .drafters import load_drafter
    from .target import load_target

    ecfg = cfg["eval"]["e2e"]
    target = load_target(target_dir, rt, cfg["target"]["attn_implementation"])
    drafter = load_drafter(drafter_dir, rt.device).eval()
    aux = tuple(read_json(features_index)["spec"]["aux_layers"]) if drafter.reads_aux_hidden else None
    cont = read_json(continuations)
    items = cont["items"][: ecfg["prompts"]]
    n_new, eos = ecfg["max_new_tokens"], cont["eos_id"]
    modes = specs(cfg)
    # what target.generate(do_sample=False) produced, cut to this stage's length
    reference = [it["continuation"][:n_new] for it in items]
    if any(len(it["continuation"]) < n_new and it["continuation"][-1:] != [eos] for it in items):
        raise ValueError(f"{continuations}: continuations shorter than eval.e2e.max_new_tokens={n_new}")

    def ids(it):
        return torch.tensor([it["prompt"]], device=rt.device)

    for it in items[: ecfg["warmup"]]:          # warm-up: allocator, kernels, caches
        plain_generate(target, ids(it), 8, eos)
        for spec in modes.values():
            speculative_generate(target, drafter, ids(it), 8, eos, aux, spec)
    start = time.time()
    baseline, runs = [], {m: [] for m in modes}
    for it in tqdm(items, desc=f"e2e {Path(drafter_dir).name}", mininterval=5):
        baseline.append(plain_generate(target, ids(it), n_new, eos))
        for m, spec in modes.items():
            runs[m].append(speculative_generate(target, drafter, ids(it), n_new, eos, aux, spec))
    result = {
        "variant": Path(drafter_dir).name, "paradigm": drafter.cfg.paradigm, "layers": drafter.cfg.num_layers,
        "modes": {m: summarize(r, baseline, reference) | {"spec": vars(modes[m])} for m, r in runs.items()},
        "baseline": {"tokens_per_s": statistics.median(b.tokens_per_s for b in baseline),
                     "seconds_per_token": sum(b.total_s for b in baseline) / max(1, sum(len(b.tokens) for b in baseline)),
                     "lossless": all(b.tokens == ref for b, ref in zip(baseline, reference))},
        "prompts": len(items), "max_new_tokens": n_new, "device": rt.device, "threads": torch.get_num_threads(),
        "timing": "medians over prompts after warm-up; tau and per-round times are totals over all rounds",
        "seconds": time.time() - start,
    }
    result["lossless"] = all(m["lossless"] for m in result["modes"].values())
    write_json(out_path, result)
    return {m: {k: v[k] for k in ("tau", "speedup", "lossless")} for m, v in result["modes"].items()}
