"""The `eval_e2e` stage: real speculative decoding (chain and tree, greedy verification)
against plain decoding in the same harness and the same run, checked lossless token by token
against plain greedy decoding (and that against the target's own cached `generate` output).

In bf16 a verify forward over several rows and a one-row decode forward round differently,
so where the target's two best logits are within rounding of each other the two greedy
outputs may part ways without either being wrong. Every divergence is classified by the
baseline's top-2 logits at that position: a near-tie (gap <= NEAR_TIE_ULPS units in the last
place of the target dtype at that magnitude) or a real error; only real errors fail `lossless`."""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

from .config import Runtime
from .data import DataError
from .decode import DecodeResult, DraftSpec, plain_generate, speculative_generate
from .io import read_json, write_json
from .progress import progress
from .stepwise import drafter_seed, drafter_variant, read_continuations


def specs(cfg: dict) -> dict[str, DraftSpec]:
    tree = cfg["eval"]["e2e"]["tree"]
    return {"chain": DraftSpec(depth=cfg["drafters"]["ttt_steps"], topk=1),
            "tree": DraftSpec(depth=tree["depth"], topk=tree["topk"], total_tokens=tree["total_tokens"])}


NEAR_TIE_ULPS = 4   # a verify forward and a decode forward differ by a few roundings per logit


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |value| (bf16: 8 significant bits)."""
    finfo = torch.finfo(dtype)
    return 2.0 ** math.floor(math.log2(max(abs(value), finfo.tiny))) * finfo.eps


def divergence(tokens: list[int], base: DecodeResult, dtype: torch.dtype, ulps: float = NEAR_TIE_ULPS) -> dict | None:
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
                  ulps: float = NEAR_TIE_ULPS) -> dict:
    """Exact-match rate over prompts, every divergence classified; lossless = no real error."""
    found = [(i, divergence(out, base, dtype, ulps)) for i, (out, base) in enumerate(zip(outputs, baseline))]
    divergences = [{"prompt": i, **d} for i, d in found if d is not None]
    near_ties = sum(d["near_tie"] for d in divergences)
    return {"exact_match_rate": 1 - len(divergences) / max(1, len(outputs)), "near_ties": near_ties,
            "real_errors": len(divergences) - near_ties, "lossless": near_ties == len(divergences),
            "divergences": divergences}


def summarize(runs: list, baseline: list, dtype: torch.dtype, ulps: float = NEAR_TIE_ULPS) -> dict:
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
def run_e2e_stage(cfg: dict, rt: Runtime, drafter_dirs: list[str], target_dir: str, continuations: str,
                  features_index: str, out_path: str) -> dict:
    """e2e.json for one variant's drafters (one per training seed): per-seed records in
    `per_seed`, and `modes` summarized over every seed's runs together (the seed-averaged drafter).
    Plain decoding runs once per prompt, interleaved with the speculative runs it is timed against."""
    from .drafters import load_drafter
    from .target import load_target

    from .drafters.attention import use_attention

    ecfg = cfg["eval"]["e2e"]
    use_attention(cfg["drafters"].get("attention", "auto"))
    drafter_dirs = [drafter_dirs] if isinstance(drafter_dirs, (str, Path)) else list(drafter_dirs)
    cont = read_continuations(continuations)   # before the models load: a damaged file fails fast
    target = load_target(target_dir, rt, cfg["target"]["attn_implementation"])
    drafters = [load_drafter(d, rt.device).eval() for d in drafter_dirs]
    aux = tuple(read_json(features_index)["spec"]["aux_layers"]) if drafters[0].reads_aux_hidden else None
    items = cont["items"][: ecfg["prompts"]]
    n_new, eos = ecfg["max_new_tokens"], cont["eos_id"]
    modes = specs(cfg)
    if getattr(drafters[0], "block_wise", False):   # a block drafter drafts chains only (one forward per round)
        modes = {"chain": modes["chain"]}
    # what target.generate(do_sample=False) produced, cut to this stage's length
    reference = [it["continuation"][:n_new] for it in items]
    if any(len(it["continuation"]) < n_new and it["continuation"][-1:] != [eos] for it in items):
        raise DataError(f"{continuations}: continuations shorter than eval.e2e.max_new_tokens={n_new} "
                        "(eval.max_new_tokens sets their length: raise it, or lower eval.e2e.max_new_tokens)")

    def ids(it):
        return torch.tensor([it["prompt"]], device=rt.device)

    for it in items[: ecfg["warmup"]]:          # warm-up: allocator, kernels, caches
        plain_generate(target, ids(it), 8, eos)
        for drafter in drafters:
            for spec in modes.values():
                speculative_generate(target, drafter, ids(it), 8, eos, aux, spec)
    start = time.time()
    variant = drafter_variant(drafter_dirs[0])
    baseline, runs = [], [{m: [] for m in modes} for _ in drafters]
    for it in progress(items, desc=f"e2e {variant}", unit="prompt"):
        baseline.append(plain_generate(target, ids(it), n_new, eos))
        for drafter, own in zip(drafters, runs):
            for m, spec in modes.items():
                own[m].append(speculative_generate(target, drafter, ids(it), n_new, eos, aux, spec))
    ulps = ecfg.get("near_tie_ulps", NEAR_TIE_ULPS)

    def mode_summaries(by_mode: dict, base: list) -> dict:
        return {m: summarize(r, base, target.dtype, ulps) | {"spec": vars(modes[m])} for m, r in by_mode.items()}

    per_seed = [{"seed": drafter_seed(d), "drafter": str(d), "modes": mode_summaries(own, baseline)}
                for d, own in zip(drafter_dirs, runs)]
    pooled = {m: [r for own in runs for r in own[m]] for m in modes}
    result = {
        "variant": variant, "paradigm": drafters[0].cfg.paradigm, "layers": drafters[0].cfg.num_layers,
        "modes": mode_summaries(pooled, baseline * len(drafters)),
        "pooled": f"{len(drafters)} training seeds: every seed's runs together" if len(drafters) > 1 else "one training seed",
        "per_seed": per_seed,
        "across_seeds": across_seed_modes(per_seed),
        # plain decoding against target.generate: same target, a different harness
        "baseline": {"tokens_per_s": statistics.median(b.tokens_per_s for b in baseline),
                     "seconds_per_token": sum(b.total_s for b in baseline) / max(1, sum(len(b.tokens) for b in baseline)),
                     **match_summary(reference, baseline, target.dtype, ulps)},
        "target_attention": target.config._attn_implementation, "target_dtype": str(target.dtype).split(".")[-1],
        "near_tie_ulps": ulps,
        "prompts": len(items), "max_new_tokens": n_new, "device": rt.device, "threads": torch.get_num_threads(),
        "timing": "medians over prompts after warm-up; tau and per-round times are totals over all rounds",
        "seconds": time.time() - start,
    }
    result["lossless"] = all(m["lossless"] for m in result["modes"].values())
    write_json(out_path, result)
    return {m: {k: v[k] for k in ("tau", "speedup", "lossless", "exact_match_rate")} for m, v in result["modes"].items()}
