"""The `eval_e2e` stage: real speculative decoding (chain and tree, greedy verification)
against plain decoding in the same harness and the same run, checked lossless token by token
against plain greedy decoding (and that against the target's own cached `generate` output).

Prompts are real held-out assistant prefixes, the natural protocol's (results/eval/natural.json,
at most one per conversation: `e2e_prompts`), so the decoded text is the target continuing real
text, not its own looping greedy continuations. Counts are kept per seed and prompt (`per_prompt`)
for the prompt-bootstrap intervals (`prompt_bootstrap`) and the paired E2E claim.

In bf16 a verify forward over several rows and a one-row decode forward round differently,
so where the target's two best logits are within rounding of each other the two greedy
outputs may part ways without either being wrong. Every divergence is classified by the
baseline's top-2 logits at that position: a near-tie (gap <= eval.e2e.near_tie_ulps units in the last
place of the target dtype at that magnitude) or a real error; only real errors fail `lossless`."""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvshot.config import Runtime
from kvshot.core.io import DataError, write_json
from kvshot.core.progress import progress
from kvshot.evaluate.decode import DecodeResult, plain_generate, speculative_generate
from kvshot.evaluate.draft_tree import DraftSpec
from kvshot.evaluate.eval_models import load_models
from kvshot.evaluate.references import read_continuations, repetition_share
from kvshot.evaluate.stepwise import drafter_seed, drafter_variant
from kvshot.settings import Config
from kvshot.stats.prompt_bootstrap import ratio


def specs(cfg: Config) -> dict[str, DraftSpec]:
    tree = cfg.eval.e2e.tree
    return {"chain": DraftSpec(depth=cfg.drafters.ttt_steps, topk=1),
            "tree": DraftSpec(depth=tree.depth, topk=tree.topk, total_tokens=tree.total_tokens)}


def e2e_prompts(items: list[dict], n: int, seed: int) -> list[dict]:
    """n prompts, at most one per conversation (anchors of one conversation share its text: under a
    prompt bootstrap they would not be independent), the anchor within each conversation drawn
    with `seed`; items without a `conversation` (the continuations protocol) are taken in order."""
    if not any("conversation" in it for it in items):
        return items[:n]
    by_conversation: dict = {}
    for it in items:
        by_conversation.setdefault(it["conversation"], []).append(it)
    rng = random.Random(seed)
    return [rng.choice(group) for _, group in sorted(by_conversation.items())][:n]


def prompt_key(item: dict) -> list[int]:
    """What identifies a prompt across variants' files: its conversation (if any) and length."""
    return [item.get("conversation", -1), len(item["prompt"])]


def per_prompt(runs: list[DecodeResult]) -> dict:
    """The counts each prompt adds (in prompt order): the cells of the prompt bootstrap."""
    return {"emitted": [sum(r.emitted) for r in runs], "rounds": [r.rounds for r in runs],
            "draft_s": [r.draft_s for r in runs], "tokens": [len(r.tokens) for r in runs]}


def seed_prompt_table(per_seed_counts: list[dict], field: str):
    """[seeds, prompts] array of one per-prompt count."""
    import numpy as np

    return np.array([c[field] for c in per_seed_counts], dtype=float)


def pooled_intervals(per_seed_counts: list[dict], samples: int, seed: int) -> dict:
    """tau and drafting seconds per round over every seed and prompt, with crossed prompt x seed
    bootstrap intervals (`prompt_bootstrap`)."""
    rounds = seed_prompt_table(per_seed_counts, "rounds")
    return {"tau": ratio(seed_prompt_table(per_seed_counts, "emitted"), rounds, samples, seed).as_dict(),
            "draft_seconds_per_round": ratio(seed_prompt_table(per_seed_counts, "draft_s"), rounds, samples,
                                             seed).as_dict()}




def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |value| (bf16: 8 significant bits)."""
    finfo = torch.finfo(dtype)
    return 2.0 ** math.floor(math.log2(max(abs(value), finfo.tiny))) * finfo.eps


def divergence(tokens: list[int], base: DecodeResult, dtype: torch.dtype, ulps: float) -> dict | None:
    """None when `tokens` equals the baseline's; else where they first differ and whether the
    baseline's top-2 logits there are a near-tie (after that point the texts differ anyway)."""
    if tokens == base.tokens:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(tokens, base.tokens)) if a != b), min(len(tokens), len(base.tokens)))
    if pos >= len(base.top2):   # the baseline has no token there: a length difference is an error
        return {"position": pos, "gap": None, "tolerance": None, "near_tie": False}
    first, second = base.top2[pos]
    tolerance = ulps * ulp(first, dtype)
    return {"position": pos, "top2": [first, second], "gap": first - second, "tolerance": tolerance,
            "near_tie": first - second <= tolerance}


def match_summary(outputs: list[list[int]], baseline: list[DecodeResult], dtype: torch.dtype,
                  ulps: float) -> dict:
    """Exact-match rate over prompts, every divergence classified; lossless = no real error."""
    found = [(i, divergence(out, base, dtype, ulps)) for i, (out, base) in enumerate(zip(outputs, baseline))]
    divergences = [{"prompt": i, **d} for i, d in found if d is not None]
    near_ties = sum(d["near_tie"] for d in divergences)
    return {"exact_match_rate": 1 - len(divergences) / max(1, len(outputs)), "near_ties": near_ties,
            "real_errors": len(divergences) - near_ties, "lossless": near_ties == len(divergences),
            "divergences": divergences}


def summarize(runs: list, baseline: list, dtype: torch.dtype, ulps: float) -> dict:
    """Totals for tau and per-round times, medians over prompts for throughput and speedup;
    outputs checked against plain greedy decoding (`match_summary`)."""
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
        "verify_attention": sorted({r.verify_attention for r in runs if r.verify_attention}),
        **match_summary([r.tokens for r in runs], baseline, dtype, ulps),
        "per_prompt": per_prompt(runs),
    }


def across_seed_modes(per_seed: list[dict]) -> dict:
    """Mean, min and max over seeds of each mode's tau, speedup and draft time per round."""
    out = {}
    for mode in per_seed[0]["modes"]:
        out[mode] = {}
        for key in ("tau", "speedup", "draft_seconds_per_round"):
            values = [s["modes"][mode][key] for s in per_seed]
            out[mode][key] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    return out


@torch.no_grad()
def run_e2e_stage(cfg: Config, rt: Runtime, drafter_dirs: list[str], target_dir: str, prompts: str,
                  features_index: str, out_path: str) -> dict:
    """e2e.json for one variant's drafters (one per training seed): per-seed records in
    `per_seed` (with per-prompt counts), and `modes` summarized over every seed's runs together
    (the seed-averaged drafter) with prompt x seed bootstrap intervals of tau and drafting time.
    Plain decoding runs once per prompt, interleaved with the speculative runs it is timed against.
    `prompts`: results/eval/natural.json (or a continuations file: its prompts in order)."""
    ecfg = cfg.eval.e2e
    drafter_dirs = [drafter_dirs] if isinstance(drafter_dirs, (str, Path)) else list(drafter_dirs)
    cont = read_continuations(prompts)   # before the models load: a damaged file fails fast
    items = e2e_prompts(cont["items"], ecfg.prompts, cfg.seed)
    if not items:
        raise DataError(f"{prompts}: no prompts for eval.e2e")
    models = load_models(cfg, rt, target_dir, [drafter_dirs], features_index)
    target, drafters = models.target, models.drafters[0]
    aux = models.aux_for(drafters)
    n_new, eos = ecfg.max_new_tokens, cont["eos_id"]
    modes = specs(cfg)
    if getattr(drafters[0], "block_wise", False):   # a block drafter drafts chains only (one forward per round)
        modes = {"chain": modes["chain"]}
    # the target's greedy reference (continuations: generate's output; natural: the anchor's branch rollout), cut
    reference = [it["continuation"][:n_new] for it in items]

    def ids(it):
        return torch.tensor([it["prompt"]], device=rt.device)

    for it in items[: ecfg.warmup]:          # warm-up: allocator, kernels, caches
        plain_generate(target, ids(it), 8, eos)
        for drafter in drafters:
            for spec in modes.values():
                speculative_generate(target, drafter, ids(it), 8, eos, aux, spec, precision=rt.dtype)
    start = time.time()
    variant = drafter_variant(drafter_dirs[0])
    baseline, runs = [], [{m: [] for m in modes} for _ in drafters]
    for it in progress(items, desc=f"e2e {variant}", unit="prompt"):
        baseline.append(plain_generate(target, ids(it), n_new, eos))
        for drafter, own in zip(drafters, runs):
            for m, spec in modes.items():
                own[m].append(speculative_generate(target, drafter, ids(it), n_new, eos, aux, spec,
                                                     precision=rt.dtype))
    ulps = ecfg.near_tie_ulps

    def mode_summaries(by_mode: dict, base: list) -> dict:
        return {m: summarize(r, base, target.dtype, ulps) | {"spec": vars(modes[m])} for m, r in by_mode.items()}

    per_seed = [{"seed": drafter_seed(d), "drafter": str(d), "modes": mode_summaries(own, baseline)}
                for d, own in zip(drafter_dirs, runs)]
    pooled = {m: [r for own in runs for r in own[m]] for m in modes}
    pooled_modes = mode_summaries(pooled, baseline * len(drafters))
    for m, summary in pooled_modes.items():   # cells are per seed and prompt: per_seed holds them
        del summary["per_prompt"]
        summary["intervals"] = pooled_intervals([s["modes"][m]["per_prompt"] for s in per_seed],
                                                cfg.eval.bootstrap_samples, cfg.seed)
    generated = [{"prompt": it["prompt"], "continuation": b.tokens} for it, b in zip(items, baseline)]
    # the reference the prefixes are compared on: the target's generate() output (short for natural rollouts)
    baseline_cut = [replace(b, tokens=b.tokens[: len(ref)]) for b, ref in zip(baseline, reference)]
    result = {
        "variant": variant, "paradigm": drafters[0].cfg.paradigm, "layers": drafters[0].cfg.num_layers,
        "protocol": cont.get("protocol", "continuations"), "prompt_keys": [prompt_key(it) for it in items],
        # how much of the decoded text repeats an earlier 4-gram (the plain greedy output)
        "reference_repetition": repetition_share(generated),
        "modes": pooled_modes,
        "pooled": f"{len(drafters)} training seeds: every seed's runs together" if len(drafters) > 1 else "one training seed",
        "per_seed": per_seed,
        "across_seeds": across_seed_modes(per_seed),
        # plain decoding against target.generate: same target, a different harness
        "baseline": {"tokens_per_s": statistics.median(b.tokens_per_s for b in baseline),
                     "seconds_per_token": sum(b.total_s for b in baseline) / max(1, sum(len(b.tokens) for b in baseline)),
                     **match_summary(reference, baseline_cut, target.dtype, ulps)},
        "target_attention": target.config._attn_implementation, "target_dtype": str(target.dtype).split(".")[-1],
        "drafter_precision": rt.dtype,   # as in training and step-wise (`config.drafter_autocast`)
        "near_tie_ulps": ulps,
        "prompts": len(items), "max_new_tokens": n_new, "device": rt.device, "threads": torch.get_num_threads(),
        "timing": "medians over prompts after warm-up; tau and per-round times are totals over all rounds; "
                  "intervals: prompt x seed bootstrap (prompt_bootstrap)",
        "seconds": time.time() - start,
    }
    result["lossless"] = all(m["lossless"] for m in result["modes"].values())
    write_json(out_path, result)
    return {m: {k: v[k] for k in ("tau", "speedup", "lossless", "exact_match_rate")} for m, v in result["modes"].items()}


@torch.no_grad()
def run_e2e_timing_stage(cfg: Config, rt: Runtime, reference_dirs: list[str], hybrid_dirs: list[str], target_dir: str,
                         prompts: str, features_index: str, out_path: str) -> dict:
    """e2e_timing.json: EAGLE-3's and the hybrid's drafters (one per training seed, paired by
    index) decode the same prompts in one process, chain mode, alternating variant by variant
    within every prompt and seed, the order reversed from one prompt to the next, so the speed
    drift of a shared CPU falls on both alike. Per-prompt counts per variant and seed, and the
    hybrid's drafting time per round over EAGLE-3's with a paired prompt x seed interval."""
    from kvshot.stats.prompt_bootstrap import paired_ratio_change

    ecfg = cfg.eval.e2e
    if len(reference_dirs) != len(hybrid_dirs):
        raise DataError(f"e2e-timing: {len(reference_dirs)} reference drafters but {len(hybrid_dirs)} hybrid "
                        "drafters: the seeds are paired, give one of each per seed")
    cont = read_continuations(prompts)
    items = e2e_prompts(cont["items"], ecfg.prompts, cfg.seed)
    if not items:
        raise DataError(f"{prompts}: no prompts for eval.e2e")
    models = load_models(cfg, rt, target_dir, [list(reference_dirs), list(hybrid_dirs)], features_index)
    target, groups = models.target, {}
    for dirs, drafters in zip((reference_dirs, hybrid_dirs), models.drafters):
        groups[drafter_variant(dirs[0])] = (dirs, drafters, models.aux_for(drafters))
    if len(groups) != 2:
        raise DataError("e2e-timing: --reference and --hybrid name the same variant")
    names, chain = list(groups), specs(cfg)["chain"]
    n_new, eos = ecfg.max_new_tokens, cont["eos_id"]

    def decode(name: str, seed_index: int, it: dict, tokens: int) -> DecodeResult:
        _, drafters, aux = groups[name]
        ids = torch.tensor([it["prompt"]], device=rt.device)
        return speculative_generate(target, drafters[seed_index], ids, tokens, eos, aux, chain, precision=rt.dtype)

    for it in items[: ecfg.warmup]:
        for name in names:
            for s in range(len(reference_dirs)):
                decode(name, s, it, 8)
    start = time.time()
    runs = {name: [[] for _ in reference_dirs] for name in names}
    for p, it in enumerate(progress(items, desc="e2e timing", unit="prompt")):
        for s in range(len(reference_dirs)):
            for name in (names if p % 2 == 0 else names[::-1]):
                runs[name][s].append(decode(name, s, it, n_new))
    counts = {name: [per_prompt(own) for own in runs[name]] for name in names}
    samples, seed = cfg.eval.bootstrap_samples, cfg.seed
    ref, hyb = names
    overhead = paired_ratio_change(seed_prompt_table(counts[ref], "draft_s"), seed_prompt_table(counts[ref], "rounds"),
                                   seed_prompt_table(counts[hyb], "draft_s"), seed_prompt_table(counts[hyb], "rounds"),
                                   samples, seed)
    result = {
        "reference": ref, "hybrid": hyb, "mode": "chain", "spec": vars(chain),
        "protocol": cont.get("protocol", "continuations"), "prompt_keys": [prompt_key(it) for it in items],
        "prompts": len(items), "max_new_tokens": n_new, "device": rt.device, "threads": torch.get_num_threads(),
        "order": "per prompt and seed both variants, the order reversed every other prompt",
        "variants": {name: {"per_seed": [{"seed": drafter_seed(d), "drafter": str(d), "per_prompt": c}
                                         for d, c in zip(groups[name][0], counts[name])],
                            **pooled_intervals(counts[name], samples, seed)} for name in names},
        "draft_overhead": overhead.as_dict(),
        "seconds": time.time() - start,
    }
    write_json(out_path, result)
    return {"draft_overhead": overhead.value, "ci": list(overhead.ci),
            **{f"draft ms/round {n}": 1e3 * result["variants"][n]["draft_seconds_per_round"]["value"] for n in names}}
