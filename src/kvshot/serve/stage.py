"""The `serve` stage: kvshot's EAGLE-3 and DFlash-layout block drafters in vLLM, beside kvshot's
decoder and what a user would pick instead, on the run's held-out E2E prompts (`e2e_prompts`).

Three passes, in one process (vLLM's engines run in their own processes, started here):
  check       untimed, batch 1: every method's output against its reference (vLLM speculative
              against vLLM plain, every K; vLLM plain against kvshot plain, each first divergence
              classified by the target's top-2 logit gap as eval_e2e does; HF and kvshot's
              speculative rows against kvshot plain), and per K, vLLM's acceptance counters beside
              kvshot's decoder at the same K (a block drafter: a block of K + 1), prompt by prompt;
  timed       batch 1, `serve.repeats` passes over the prompts, every method once per prompt, the
              order reversed on every other prompt (drift on a shared CPU falls on all alike), the
              engines idle before each call (`settle`); tokens/s = tokens / median seconds of a pass;
  throughput  vLLM only: the whole prompt set in one `generate` call, the same repeats.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from kvshot.config import Runtime
from kvshot.core.io import DataError, write_json, write_text
from kvshot.core.progress import progress
from kvshot.evaluate.decode import DecodeResult, plain_generate, speculative_generate
from kvshot.evaluate.draft_tree import DraftSpec
from kvshot.evaluate.e2e import divergence, e2e_prompts, specs
from kvshot.evaluate.eval_models import load_models
from kvshot.evaluate.references import read_continuations
from kvshot.serve import peers
from kvshot.serve.engine import Counts, Engine, engine_environment, kvshot_counts, max_draft_tokens, step_counts
from kvshot.serve.tables import serve_markdown
from kvshot.settings import Config

Method = Callable[[list[int]], list[int]]   # prompt ids -> generated ids (eos kept)
# After a call, vLLM's worker process keeps spinning on its shared-memory queue (sched_yield) for
# 1 s before it goes idle (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition
# busy_loop_s): on 2 cores that takes one from whatever is timed next. The 2026-12-07 toy runs with a
# fixed 0.1 s pause: kvshot's K=1 chain, timed right after vLLM's K=7 engine on every other prompt,
# ran at 0.55x its neighbours' speed. So after every timed call the stage waits, untimed, until the
# engine processes use less than SETTLE_IDLE of a core over a SETTLE_WINDOW_S window.
SETTLE_WINDOW_S = 0.1
SETTLE_IDLE = 0.1
SETTLE_MAX_S = 5.0


def settle() -> float:
    """Wait until this process's children (vLLM's engine processes) are idle; returns the seconds waited."""
    import psutil

    me = psutil.Process()

    def children_cpu() -> float:
        total = 0.0
        for child in me.children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:   # a process that just exited
                pass
        return total

    start, last = time.perf_counter(), children_cpu()
    while time.perf_counter() - start < SETTLE_MAX_S:
        time.sleep(SETTLE_WINDOW_S)
        now = children_cpu()
        if now - last < SETTLE_IDLE * SETTLE_WINDOW_S:
            break
        last = now
    return time.perf_counter() - start


def _variant_of(folder: str) -> str:
    return Path(folder).name


def export_ks(exports: list[str], ks: list[int]) -> dict[str, list[int]]:
    """The Ks each exported drafter runs at: every K, up to a DFlash block's mask slots."""
    out = {}
    for e in exports:
        most = max_draft_tokens(e)
        out[e] = [k for k in ks if most is None or k <= most]
    return out


def start_engines(target_dir: str, exports: dict[str, list[int]], compile_: bool, seed: int,
                  max_model_len: int, dtype: str, gpu_share: float | None,
                  kv_cache_gib: float | None = None) -> tuple[dict[str, Engine], dict[str, str]]:
    """vLLM plain and every exported drafter at each of its Ks, all alive at once (so the timed pass
    can interleave them); an engine vLLM refuses is one line in `refused`."""
    wanted = [("vllm plain", None, 0)] + [(f"vllm {_variant_of(e)} K={k}", e, k) for e, ks in exports.items() for k in ks]
    engines, refused = {}, {}
    for i, (name, draft, k) in enumerate(wanted, 1):
        try:
            engines[name] = Engine(target_dir, draft, k, max_model_len=max_model_len, compile=compile_, seed=seed,
                                   dtype=dtype, gpu_memory_utilization=gpu_share, kv_cache_gib=kv_cache_gib)
            print(f"serve: vLLM engine {i}/{len(wanted)} ({name}) ready in {engines[name].load_s:.0f} s", flush=True)
        except Exception as e:   # vLLM's refusal (unsupported architecture, config key, shape): say why, go on
            refused[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            print(f"serve: vLLM refused {name}: {refused[name]}", flush=True)
    return engines, refused


def engine_gpu_share(device: str, fraction: float, engines: int) -> float | None:
    """Each engine's gpu_memory_utilization: on CUDA the engines split `fraction` of the one GPU
    (vLLM's default, 0.9 each, would leave the second engine nothing); on CPU none (VLLM_CPU_KVCACHE_SPACE)."""
    return fraction / engines if device == "cuda" else None


def mismatches(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]


def timed_pass(methods: dict[str, Method], prompts: list[list[int]], repeats: int) -> dict[str, dict]:
    """Batch 1, every method once per prompt, the order reversed on every other prompt, the engines
    left to go idle (`settle`, untimed) after every call."""
    names = list(methods)
    seconds = {n: [] for n in names}
    waits = {n: [] for n in names}
    tokens = dict.fromkeys(names, 0)
    for r in range(repeats):
        total = dict.fromkeys(names, 0.0)
        for p, ids in enumerate(progress(prompts, desc=f"serve timed pass {r + 1}/{repeats}", unit="prompt")):
            for n in (names if p % 2 == 0 else names[::-1]):
                start = time.perf_counter()
                out = methods[n](ids)
                total[n] += time.perf_counter() - start
                waits[n].append(settle())
                if r == 0:
                    tokens[n] += len(out)
        for n in names:
            seconds[n].append(total[n])
    return {n: {"tokens": tokens[n], "seconds": seconds[n], "tokens_per_s": tokens[n] / statistics.median(seconds[n]),
                "settle_s_median": statistics.median(waits[n])} for n in names}


@torch.no_grad()
def run_serve_stage(cfg: Config, rt: Runtime, target_dir: str, exports: list[str], drafter_dirs: list[str],
                    assistant_dir: str | None, prompts_path: str, features_index: str, out_json: str,
                    out_md: str) -> dict:
    """results/serve/vllm.json and .md. `exports`: EAGLE-3 and DFlash folders (`kvshot export`),
    paired by index with the kvshot drafter folders they were written from (`drafter_dirs`)."""
    scfg, ecfg = cfg.serve, cfg.eval.e2e
    if len(exports) != len(drafter_dirs):
        raise DataError(f"serve: {len(exports)} exports but {len(drafter_dirs)} drafters: pair them by index")
    cont = read_continuations(prompts_path)
    items = e2e_prompts(cont["items"], scfg.prompts or ecfg.prompts, cfg.seed)
    if not items:
        raise DataError(f"{prompts_path}: no prompts for serve")
    prompts = [list(it["prompt"]) for it in items]
    n_new, eos, ks = scfg.max_new_tokens or ecfg.max_new_tokens, cont["eos_id"], list(scfg.ks)
    groups = [[d] for d in drafter_dirs] + ([[assistant_dir]] if assistant_dir else [])
    models = load_models(cfg, rt, target_dir, groups, features_index)
    target = models.target
    drafters = {_variant_of(e): ds[0] for e, ds in zip(exports, models.drafters)}
    aux = {v: models.aux_for([d]) for v, d in drafters.items()}

    engine_environment(rt.threads)
    max_len = max(len(p) for p in prompts) + n_new + max(ks) + 8
    max_len = min(max_len, int(target.config.max_position_embeddings))
    ks_of = export_ks(exports, ks)
    drafter_ks = {_variant_of(e): k_list for e, k_list in ks_of.items()}
    gpu_share = engine_gpu_share(rt.device, scfg.gpu_memory_fraction, 1 + sum(map(len, ks_of.values())))
    engines, refused = start_engines(target_dir, ks_of, scfg.compile, cfg.seed, max_len,
                                     str(target.dtype).split(".")[-1], gpu_share, scfg.kv_cache_gib)
    last_engine = list(engines.values())[-1] if engines else None

    def ids(p: list[int]) -> torch.Tensor:
        return torch.tensor([p], device=rt.device)

    def kvshot_spec(v: str, spec: DraftSpec) -> Callable[[list[int]], DecodeResult]:
        return lambda p: speculative_generate(target, drafters[v], ids(p), n_new, eos, aux[v], spec, precision=rt.dtype)

    # ---- methods, each prompt ids -> generated ids
    methods: dict[str, Method] = {"hf generate": lambda p: peers.hf_generate(target, p, n_new, eos)}
    notes = {}
    if assistant_dir:
        try:
            assistant = peers.hf_assistant(models.drafters[-1][0], target)
            k_const = cfg.drafters.ttt_steps
            methods["hf assisted (HF defaults)"] = lambda p: peers.hf_assisted(target, assistant, p, n_new, eos, None)
            methods[f"hf assisted K={k_const}"] = lambda p: peers.hf_assisted(target, assistant, p, n_new, eos, k_const)
        except ValueError as e:
            notes["hf assisted"] = f"not run: {e}"
    methods[f"hf prompt lookup ({scfg.prompt_lookup_tokens})"] = (
        lambda p: peers.hf_prompt_lookup(target, p, n_new, eos, scfg.prompt_lookup_tokens))
    methods.update({name: (lambda p, e=e: e.generate([p], n_new, eos)[0][0]) for name, e in engines.items()})
    tree = specs(cfg)["tree"]
    for v, d in drafters.items():
        block = getattr(d, "block_wise", False)   # a block drafter drafts its block as a chain (one forward)
        methods.update({f"kvshot {v} {'block' if block else 'chain'} K={k}":
                        (lambda p, v=v, k=k: kvshot_spec(v, DraftSpec(depth=k, topk=1))(p).tokens) for k in drafter_ks[v]})
        if not block:
            methods[f"kvshot {v} tree {tree.depth}x{tree.topk}/{tree.total_tokens}"] = (
                lambda p, v=v: kvshot_spec(v, tree)(p).tokens)

    # ---- check pass (untimed)
    print(f"serve: {len(prompts)} prompts x {n_new} tokens, {len(methods)} methods, K in {ks}", flush=True)
    for p in prompts[:2]:   # warm-up: allocator, kernels, caches (vLLM's engines warmed up when they started)
        for fn in methods.values():
            fn(p)
    base = [plain_generate(target, ids(p), n_new, eos) for p in prompts]
    reference = [b.tokens for b in base]
    check = {"vs_kvshot_plain": {}, "spec_vs_vllm_plain": {}, "acceptance": {}}
    vllm_plain = None
    if "vllm plain" in engines:
        vllm_plain = [engines["vllm plain"].generate([p], n_new, eos)[0][0] for p in prompts]
        found = [(i, divergence(out, b, target.dtype, ecfg.near_tie_ulps)) for i, (out, b) in enumerate(zip(vllm_plain, base))]
        check["vllm_plain_vs_kvshot_plain"] = {
            "prompts_differing": sum(d is not None for _, d in found),
            "tokens_differing": sum(sum(a != b for a, b in zip(out, ref)) + abs(len(out) - len(ref))
                                    for out, ref in zip(vllm_plain, reference)),
            "tokens": sum(len(r) for r in reference),
            "divergences": [{"prompt": i, **d} for i, d in found if d is not None]}
    for name, fn in methods.items():
        if name.startswith("vllm ") and name != "vllm plain":
            continue
        check["vs_kvshot_plain"][name] = mismatches([fn(p) for p in prompts], reference)
    for v in drafters:
        for k in drafter_ks[v]:
            name = f"vllm {v} K={k}"
            kv_runs = [kvshot_spec(v, DraftSpec(depth=k, topk=1))(p) for p in prompts]
            kv_per_prompt = [kvshot_counts(r.accepted, k) for r in kv_runs]
            rounds = sum(r.rounds for r in kv_runs)
            row = {"kvshot": sum(kv_per_prompt, Counts()).as_dict(), "kvshot_lossless": mismatches(
                [r.tokens for r in kv_runs], reference),
                   # where kvshot's round goes (untimed pass, no other method running): drafting, verifying
                   "kvshot_ms_per_round": {"draft": 1000 * sum(r.draft_s for r in kv_runs) / max(rounds, 1),
                                           "verify": 1000 * sum(r.verify_s for r in kv_runs) / max(rounds, 1)}}
            if name in engines:
                engine = engines[name]
                before = engine.prometheus_counts()
                got = [engine.generate([p], n_new, eos) for p in prompts]
                check["spec_vs_vllm_plain"][name] = mismatches([g[0][0] for g in got], vllm_plain or reference)
                vl_steps = [g[1][0] for g in got]
                vl_per_prompt = [step_counts(acc, drafted, k) for acc, drafted in vl_steps]
                row["vllm"] = sum(vl_per_prompt, Counts()).as_dict()
                # round by round: vLLM's accepted tokens per verify step against kvshot's per round
                row["prompts_differing"] = [
                    {"prompt": i, "vllm": acc, "kvshot": r.accepted, "vllm_drafted": drafted}
                    for i, ((acc, drafted), r) in enumerate(zip(vl_steps, kv_runs)) if acc != r.accepted]
                if engine is last_engine:   # the Prometheus counters are this engine's: the same counts?
                    prom = (engine.prometheus_counts() - before).as_dict()
                    check["prometheus_cross_check"] = {"engine": name, "prometheus": prom, "per_request": row["vllm"],
                                                       "equal": prom == row["vllm"]}
            check["acceptance"][f"{v} K={k}"] = row

    # ---- timed pass, then vLLM's whole-set throughput
    timed = timed_pass(methods, prompts, scfg.repeats)
    throughput = {}
    for name, e in engines.items():
        outs, steps, _ = e.generate(prompts, n_new, eos)   # untimed: outputs and counts of the batch
        secs = []
        for _ in range(scfg.repeats):
            settle()   # the previous call's engine idle first
            secs.append(e.generate(prompts, n_new, eos)[2])
        n_tok = sum(len(o) for o in outs)
        throughput[name] = {"tokens": n_tok, "seconds": secs, "tokens_per_s": n_tok / statistics.median(secs),
                            "mismatches_vs_batch1_plain": mismatches(outs, vllm_plain or reference),
                            "counts": sum((step_counts(a, d, e.k) for a, d in steps), Counts()).as_dict()
                            if e.draft_dir else None}

    result = {
        "target": str(target_dir), "exports": list(exports), "drafters": list(drafter_dirs),
        "assistant": assistant_dir, "prompts": len(prompts), "max_new_tokens": n_new, "ks": ks,
        "prompt_tokens": [len(p) for p in prompts], "threads": rt.threads, "device": rt.device,
        "target_dtype": str(target.dtype).split(".")[-1], "vllm_compile": scfg.compile,
        "repeats": scfg.repeats, "refused": refused, "notes": notes,
        "engine_load_seconds": {n: e.load_s for n, e in engines.items()},
        "check": check, "timed": timed, "throughput": throughput,
        "order": "batch 1: every method once per prompt, the order reversed on every other prompt, vLLM's "
                 "engines idle before each call; tokens/s = tokens / median seconds of a pass",
    }
    result["summary"] = summarize(result)
    write_json(out_json, result)
    write_text(out_md, serve_markdown(result))
    return result["summary"]


def summarize(result: dict) -> dict:
    """The headline: lossless counts, acceptance agreement, best K per drafter, ratios."""
    timed, check = result["timed"], result["check"]
    spec_bad = sum(len(v) for v in check["spec_vs_vllm_plain"].values())
    agree = [k for k, row in check["acceptance"].items() if "vllm" in row and not row["prompts_differing"]]
    best = {}
    for name, row in timed.items():
        if name.startswith("vllm ") and name != "vllm plain":
            v = name.split()[1]
            if v not in best or row["tokens_per_s"] > timed[best[v]]["tokens_per_s"]:
                best[v] = name
    return {"vllm_spec_mismatches": spec_bad,
            "vllm_plain_prompts_differing": check.get("vllm_plain_vs_kvshot_plain", {}).get("prompts_differing"),
            "acceptance_identical": f"{len(agree)}/{sum('vllm' in r for r in check['acceptance'].values())}",
            "best_k": best,
            "prometheus_equal": check.get("prometheus_cross_check", {}).get("equal"),
            "refused": len(result["refused"])}
