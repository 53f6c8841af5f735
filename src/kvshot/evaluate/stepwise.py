"""The step-wise chain-drafting simulation (alpha_k, acc_k, MAT, retention with intervals) on
the target's reference chains (`references`), under both protocols:

continuations  every anchor of the target's greedy continuation of each eval prompt;
natural        one anchor per item, in real held-out assistant text.

Each record carries the repetition share of its reference tokens and alpha_k by the anchor's
context length (`by_context`). Several variants can be scored in one pass that runs the target
once per batch for all their drafters (`chain_correct_many`, eval.shared_target_pass).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor

from kvshot.capture.features import pad_batch
from kvshot.capture.target import target_forward
from kvshot.config import ConfigError, Runtime, drafter_autocast
from kvshot.core.io import DataError, read_json, write_json
from kvshot.core.progress import progress
from kvshot.drafters import Drafter
from kvshot.drafters.unroll import any_unroll, is_block
from kvshot.evaluate.eval_models import load_models
from kvshot.evaluate.natural import branch_repetition, natural_results, read_natural, scored_anchors
from kvshot.evaluate.references import read_continuations, repetition_share
from kvshot.settings import Config
from kvshot.stats.metrics import (DEFAULT_MIN_ROUNDS, DEFAULT_MIN_SEQUENCES, chain_counts, chain_summary,
                                  jeffreys_interval)
from kvshot.stats.resample import AnchorPanel, panel, panel_record


def chain_rows(prompt_len: int, length: int, steps: int) -> range:
    """Anchors inside the continuation that leave room for all K steps: the target has
    computed the prompt (anchor prompt_len-1 onwards) and position t+K exists."""
    return range(prompt_len - 1, length - steps)


def item_rows(item: dict, steps: int) -> list[int]:
    """An item's chain anchors: its own `anchors` (natural protocol) where position t+K exists,
    else every anchor of its continuation (`chain_rows`)."""
    length = len(item["prompt"]) + len(item["continuation"])
    if "anchors" in item:
        return [t for t in item["anchors"] if t + steps < length]
    return list(chain_rows(len(item["prompt"]), length, steps))


Results = tuple[Tensor, Tensor, Tensor]   # an item's chain anchors, chain-correct [N, K], teacher-forced-correct [N, K]


def greedy_at(last_hidden: Tensor, head: Tensor, rows_of: list[list[int]], steps: int) -> Tensor:
    """The target's greedy token after each position the chains are scored on (anchor + 1 ..
    anchor + K of every item; -1 elsewhere): the vocabulary projection only where it is read
    (index lists, not a mask: the shapes stay static for the fake-tensor meter)."""
    where = sorted({(b, t + k) for b, rows in enumerate(rows_of) for t in rows for k in range(1, steps + 1)})
    greedy = torch.full(last_hidden.shape[:2], -1, dtype=torch.long, device=last_hidden.device)
    if where:
        bs, ts = (torch.tensor(x, device=last_hidden.device) for x in zip(*where))
        greedy[bs, ts] = (last_hidden[bs, ts] @ head.T).argmax(-1)
    return greedy


@torch.no_grad()
def drafter_results(drafter: Drafter, feats: dict, greedy: Tensor, rows_of: list[Tensor], only: Tensor | None,
                    steps: int, device: str, dtype: str) -> list[Results]:
    """One drafter on one batch of target context: per item, `Results` (see chain_correct)."""
    drafter.eval()
    ids = feats["input_ids"]
    with drafter_autocast(device, dtype):   # a block drafter: block position k is step k (`blockwise`)
        chain = any_unroll(drafter, feats, steps, own_tokens=True, anchor_rows=only)
        # a block never reads its own drafts: its chain is its teacher-forced block
        forced = chain if is_block(drafter) else any_unroll(drafter, feats, steps, anchor_rows=only)

    def pick(out, k: int, b: int, at: Tensor) -> Tensor:
        """Step k's logits at anchors `at` of sequence b (packed: found among the drafted rows)."""
        packed = out.rows[k] if out.rows else None
        if out.shared_logits:   # a causal LM's step k at anchor t is its step 0 at t + k
            return out.logits[0][b, at + k]
        if packed is None:
            return out.logits[k][b, at]
        return out.logits[k][0, torch.searchsorted(packed, b * ids.shape[1] + at)]

    out = []
    for b, rows in enumerate(rows_of):
        at = rows.to(ids.device)
        want = torch.stack([greedy[b, at + k + 1] for k in range(steps)], dim=1)
        drafted = torch.stack([drafter.d2t[pick(chain, k, b, at).argmax(-1)] for k in range(steps)], dim=1)
        tf = torch.stack([drafter.d2t[pick(forced, k, b, at).argmax(-1)] for k in range(steps)], dim=1)
        out.append((rows, (drafted == want).cpu(), (tf == want).cpu()))
    return out


@torch.no_grad()
def chain_correct_many(drafters: list[Drafter], target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
                       batch_size: int, device: str, dtype: str = "float32") -> Iterator[list[Results]]:
    """`chain_correct` for several drafters on the same items, one target forward per batch for
    all of them (the target is most of the cost): per item, one `Results` per drafter."""
    kv_layers = tuple(sorted({l for d in drafters for l in d.cfg.kv_layers}))
    head = target.lm_head.weight
    for i in progress(range(0, len(items), batch_size), desc="stepwise", unit="batch"):
        group = items[i: i + batch_size]
        seqs = [torch.tensor(it["prompt"] + it["continuation"]) for it in group]
        batch = pad_batch([{"input_ids": s, "loss_mask": torch.ones_like(s, dtype=torch.uint8)} for s in seqs])
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        rows = [item_rows(it, steps) for it in group]
        rows_of = [torch.tensor(r, dtype=torch.long) for r in rows]
        only = None   # items with their own anchors (natural protocol): draft from those rows alone
        if all("anchors" in it for it in group):
            width = ids.shape[1]
            only = torch.cat([b * width + r for b, r in enumerate(rows_of)]).to(ids.device)
            if only.numel() == 0:   # every rollout ended before K tokens
                empty = torch.zeros(0, steps, dtype=torch.bool)
                yield from ([(r, empty, empty)] * len(drafters) for r in rows_of)
                continue
        ctx = target_forward(target, ids, mask, aux_layers, kv_layers)
        greedy = greedy_at(ctx.last_hidden, head, rows, steps)                 # target's token after t
        feats = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, "aux_hidden": ctx.aux_hidden}
        for l in kv_layers:
            feats[f"key_{l}"], feats[f"value_{l}"] = ctx.keys[l], ctx.values[l]
        per_drafter = [drafter_results(d, feats, greedy, rows_of, only, steps, device, dtype) for d in drafters]
        yield from (list(r) for r in zip(*per_drafter))


def chain_correct(drafter: Drafter, target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
                  batch_size: int, device: str, dtype: str = "float32") -> Iterator[Results]:
    """Per sequence: the chain anchors (`item_rows`), and for each anchor and step whether the
    drafter's token equals the target's greedy token, drafting on its own outputs (chain) and
    teacher-forced. Batched over anchors and sequences: no loop per position. The drafter runs
    in the runtime `dtype`'s precision (`drafter_autocast`), as in training; results on the CPU."""
    for results in chain_correct_many([drafter], target, items, aux_layers, steps, batch_size, device, dtype):
        yield results[0]


def bucket_labels(edges: list[int]) -> list[str]:
    bounds = [0, *edges]
    return [f"<{edges[0]}"] + [f"{lo}-{hi}" for lo, hi in zip(bounds[1:], bounds[2:])] + [f">={edges[-1]}"]


def by_context(contexts: Tensor, correct: Tensor, edges: list[int], level: float = 0.95) -> dict:
    """alpha_k per bucket of the anchor's context length (prefix tokens t + 1): counts, rates
    (null where no round reaches k) and pooled Jeffreys intervals. contexts [N], correct [N, K]."""
    bucket = torch.bucketize(contexts, torch.tensor(edges), right=True)
    out = {"edges": edges, "labels": bucket_labels(edges), "anchors": [], "rounds": [], "accepted": [], "alpha": [],
           "alpha_jeffreys_ci": []}
    for b in range(len(edges) + 1):
        ok = correct[bucket == b]
        r, a = chain_counts(ok) if len(ok) else (torch.zeros(correct.shape[1]), torch.zeros(correct.shape[1]))
        rounds, acc = [int(x) for x in r.tolist()], [int(x) for x in a.tolist()]
        out["anchors"].append(len(ok))
        out["rounds"].append(rounds)
        out["accepted"].append(acc)
        out["alpha"].append([x / n if n else None for x, n in zip(acc, rounds)])
        out["alpha_jeffreys_ci"].append([jeffreys_interval(x, n, level) if n else None for x, n in zip(acc, rounds)])
    return out


def chain_tallies(drafters: list[Drafter], target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
                  batch_size: int, device: str, dtype: str = "float32") -> list[dict]:
    """Exact greedy chain drafting from every anchor of the items, for each drafter (one target
    forward per batch for all): `tallies_of` its results, items of one `conversation` one sequence."""
    results = chain_correct_many(drafters, target, items, aux_layers, steps, batch_size, device, dtype)
    keys = [it.get("conversation", f"item {i}") for i, it in enumerate(items)]
    return tallies_of(zip(keys, results), len(drafters), steps)


def tallies_of(keyed_results: Iterable[tuple[object, list[Results]]], n_drafters: int, steps: int) -> list[dict]:
    """Per drafter: per-sequence counts, each anchor's context length and chain, and the
    teacher-forced tallies, from (sequence key, one `Results` per drafter) pairs. The raw
    material of `summarize_tally`; tallies of several drafters (seeds) on the same anchors add up
    sequence by sequence."""
    tallies = [{"groups": {}, "contexts": [], "chains": [], "tf_correct": torch.zeros(steps), "tf_total": 0,
                "keys": []} for _ in range(n_drafters)]
    for key, per_drafter in keyed_results:
        for tally, (rows, chain_ok, forced_ok) in zip(tallies, per_drafter):
            if len(rows) == 0:
                continue
            r, a = chain_counts(chain_ok)
            prev = tally["groups"].get(key)
            tally["groups"][key] = (r, a) if prev is None else (prev[0] + r, prev[1] + a)
            tally["keys"] += [(key, int(t)) for t in rows.tolist()]
            tally["contexts"].append(rows + 1)
            tally["chains"].append(chain_ok)
            tally["tf_correct"] += forced_ok.sum(0).float()
            tally["tf_total"] += len(rows)
    if not tallies[0]["groups"]:
        raise ValueError(f"no continuation is longer than {steps} tokens: nothing to evaluate")
    for tally in tallies:
        tally["contexts"], tally["chains"] = torch.cat(tally["contexts"]), torch.cat(tally["chains"])
    return tallies


def chain_tally(drafter: Drafter, target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
                batch_size: int, device: str, dtype: str = "float32") -> dict:
    """`chain_tallies` of one drafter."""
    return chain_tallies([drafter], target, items, aux_layers, steps, batch_size, device, dtype)[0]


def anchor_panel(tallies: list[dict], steps: int) -> AnchorPanel:
    """The per-anchor chain lengths of several drafters' tallies on the same items (one row per
    seed, anchors in evaluation order, each with its sequence index)."""
    keys = tallies[0]["keys"]
    if any(t["keys"] != keys for t in tallies):
        raise ValueError("the seeds' tallies score different anchors: they cannot be pooled or paired")
    groups = {g: j for j, g in enumerate(dict.fromkeys(g for g, _ in keys))}
    lengths = torch.stack([torch.cumprod(t["chains"].long(), dim=1).sum(1) for t in tallies])
    return panel(lengths, [groups[g] for g, _ in keys], steps, keys=tuple(keys))


def pool_tallies(tallies: list[dict]) -> dict:
    """One tally from several drafters' tallies on the same items (the seeds of a variant):
    per-sequence counts summed (the intervals come from the per-anchor panel, `anchor_panel`)."""
    groups: dict = {}
    for t in tallies:
        for key, (r, a) in t["groups"].items():
            prev = groups.get(key)
            groups[key] = (r, a) if prev is None else (prev[0] + r, prev[1] + a)
    return {"groups": groups, "contexts": torch.cat([t["contexts"] for t in tallies]),
            "chains": torch.cat([t["chains"] for t in tallies]),
            "tf_correct": sum(t["tf_correct"] for t in tallies), "tf_total": sum(t["tf_total"] for t in tallies)}


def summarize_tally(tally: dict, repetition: dict, steps: int, bootstrap_samples: int = 1000, seed: int = 0,
                    min_rounds: int = DEFAULT_MIN_ROUNDS, context_buckets: tuple[int, ...] = (),
                    anchors: AnchorPanel | None = None, min_sequences: int = DEFAULT_MIN_SEQUENCES) -> dict:
    """alpha_k, acc_k, MAT, retention with intervals that resample whole sequences
    (`chain_summary`; anchors: the per-anchor panel of every seed pooled in the tally, default the
    tally's own), the repetition share of the reference tokens (`repetition_share`), alpha_k by
    context length."""
    anchors = anchors if anchors is not None else anchor_panel([tally], steps)
    result = {
        "acc": (tally["tf_correct"] / max(tally["tf_total"], 1)).tolist(),
        "acc_note": "unconditional teacher-forced top-1 accuracy per step (acc_k), not alpha_k",
        "sequences": len(tally["groups"]),
        "anchors": tally["tf_total"],
        "steps": steps,
        "repetition": repetition,
    }
    result.update(chain_summary(anchors, bootstrap_samples, seed, min_rounds, min_sequences=min_sequences))
    if context_buckets:   # eval.context_buckets; none given (a direct call): no breakdown by context length
        result["by_context"] = by_context(tally["contexts"], tally["chains"], list(context_buckets))
    return result


def order_items(items: list[dict]) -> list[dict]:
    """One anchor each: batches of similar length pad little."""
    if all("anchors" in it for it in items):
        return sorted(items, key=lambda it: len(it["prompt"]) + len(it["continuation"]))
    return items


def stepwise(drafter: Drafter, target, items: list[dict], aux_layers: tuple[int, ...], steps: int,
             batch_size: int, device: str, bootstrap_samples: int = 1000, seed: int = 0,
             dtype: str = "float32", min_rounds: int = DEFAULT_MIN_ROUNDS,
             context_buckets: tuple[int, ...] = (), min_sequences: int = DEFAULT_MIN_SEQUENCES) -> dict:
    """One drafter's step-wise record (`chain_tally` then `summarize_tally`)."""
    items = order_items(items)
    tally = chain_tally(drafter, target, items, aux_layers, steps, batch_size, device, dtype)
    return summarize_tally(tally, repetition_share(items), steps, bootstrap_samples, seed, min_rounds, context_buckets,
                           None, min_sequences)


SEED_METRICS = ("alpha_observed", "cumulative", "mat", "retention_observed")


def across_seeds(per_seed: list[dict]) -> dict:
    """Mean, min and max over seeds of each seed's own alpha_k, cumulative_k, MAT, retention
    (null where a seed leaves a step undefined): the training spread beside the pooled record."""
    def stats(values: list) -> dict:
        ok = [x for x in values if x is not None and x == x]
        if not ok:
            return {"mean": None, "min": None, "max": None}
        return {"mean": sum(ok) / len(ok), "min": min(ok), "max": max(ok)}

    out = {"seeds": [s.get("seed") for s in per_seed]}
    for key in SEED_METRICS:
        if isinstance(per_seed[0][key], list):
            cols = [stats([s[key][k] for s in per_seed]) for k in range(len(per_seed[0][key]))]
            out[key] = {stat: [c[stat] for c in cols] for stat in ("mean", "min", "max")}
        else:
            out[key] = stats([s[key] for s in per_seed])
    return out


def stepwise_seeds(drafters: list[tuple[int, Drafter]], target, items: list[dict], aux_layers: tuple[int, ...],
                   steps: int, batch_size: int, device: str, bootstrap_samples: int = 1000, seed: int = 0,
                   dtype: str = "float32", min_rounds: int = DEFAULT_MIN_ROUNDS,
                   context_buckets: tuple[int, ...] = (), min_sequences: int = DEFAULT_MIN_SEQUENCES) -> dict:
    """The step-wise record of a variant trained with several seeds, [(seed, drafter)]: pooled
    over seeds (per-sequence counts summed: the seed-averaged drafter, prompt intervals), with
    every seed's own record in `per_seed` and their spread in `across_seeds`."""
    items = order_items(items)
    tallies = chain_tallies([d for _, d in drafters], target, items, aux_layers, steps, batch_size, device, dtype)
    return seeds_record([s for s, _ in drafters], tallies, repetition_share(items), steps, bootstrap_samples, seed, min_rounds,
                        context_buckets, min_sequences)


def seeds_record(seeds: list[int | None], tallies: list[dict], repetition: dict, steps: int,
                 bootstrap_samples: int = 1000, seed: int = 0, min_rounds: int = DEFAULT_MIN_ROUNDS,
                 context_buckets: tuple[int, ...] = (), min_sequences: int = DEFAULT_MIN_SEQUENCES) -> dict:
    """`stepwise_seeds`' record from the seeds' tallies (`tallies_of`) and the repetition share of
    the reference tokens they were scored on."""
    per_seed = []
    for s, tally in zip(seeds, tallies):
        own = summarize_tally(tally, repetition, steps, bootstrap_samples, seed, min_rounds, context_buckets, None,
                              min_sequences)
        per_seed.append({"seed": s} | {k: own[k] for k in own if k not in ("by_context", "repetition", "acc_note")})
    anchors = anchor_panel(tallies, steps)
    result = summarize_tally(pool_tallies(tallies) if len(tallies) > 1 else tallies[0], repetition, steps,
                             bootstrap_samples, seed, min_rounds, context_buckets, anchors, min_sequences)
    result["pooled"] = (f"{len(per_seed)} training seeds: counts summed per sequence over seeds; intervals "
                        f"with the seeds' variance (resample.py)" if len(per_seed) > 1 else "one training seed")
    result["anchors_panel"] = panel_record(anchors, list(seeds))
    result["per_seed"] = per_seed
    result["across_seeds"] = across_seeds(per_seed)
    return result




def drafter_seed(drafter_dir: str | Path) -> int | None:
    """The training seed a drafter folder was trained with (its metrics.json)."""
    path = Path(drafter_dir) / "metrics.json"
    return read_json(path).get("seed") if path.exists() else None


def drafter_variant(drafter_dir: str | Path) -> str:
    """The variant name of a drafter folder (results/drafters/<variant>/seed<N>)."""
    path = Path(drafter_dir) / "variant.json"
    return read_json(path)["name"] if path.exists() else Path(drafter_dir).name


def variant_groups(drafter_dirs: list[str], outs: list[str]) -> list[list[str]]:
    """The drafter folders of each output's variant, in the outputs' order: one output takes
    every folder (one variant's seeds); several group the folders by variant (their parent
    results/.../<variant>/seed<N>, in order of first appearance)."""
    if len(outs) == 1:
        return [list(drafter_dirs)]
    groups: dict[str, list[str]] = {}
    for d in drafter_dirs:
        groups.setdefault(str(Path(d).parent), []).append(d)
    if len(groups) != len(outs):
        raise DataError(f"eval-stepwise: {len(outs)} outputs (--out) for the drafters of {len(groups)} variants")
    return list(groups.values())


def natural_tallies(nat: dict, drafters: list[Drafter], target, aux: tuple[int, ...], steps: int, batch_size: int,
                    device: str, dtype: str, path: str) -> tuple[list[dict], dict, dict]:
    """The natural protocol's tallies at one target pass per conversation (`natural_results`),
    the repetition share of every anchor's rollout, and what the record says of its anchors."""
    convs, tokens, eos = nat["conversations"], nat["rollout_tokens"], nat["eos_id"]
    short = [len(b) for c in convs for b in c["branches"] if len(b) < steps + 1]
    if short:
        raise DataError(f"{path}: branches of {min(short)} tokens, the step-wise chain needs K + 1 = {steps + 1} "
                        f"(drafters.ttt_steps); delete it and rerun target_continuations")
    results = natural_results(drafters, target, convs, aux, steps, tokens, eos, batch_size, device, dtype)
    tallies = tallies_of(zip((c["conversation"] for c in convs), results), len(drafters), steps)
    extra = {"natural_anchors": {
        "conversations": len(convs), "without_anchors": sum(not c["anchors"] for c in convs),
        "anchors": sum(len(c["anchors"]) for c in convs),
        "ended_within_k": sum(len(c["anchors"]) - len(scored_anchors(c, steps, tokens, eos)) for c in convs),
        "cap": nat.get("anchors")}}
    return tallies, branch_repetition(convs, tokens, eos), extra


def run_stepwise_stage(cfg: Config, rt: Runtime, drafter_dirs: list[str], target_dir: str, continuations: str,
                       features_index: str, out_path: str | list[str], natural: str | None = None,
                       natural_out: str | list[str] | None = None) -> dict:
    """stepwise.json on the continuations for one variant's drafters (one per training seed,
    pooled with per-seed records); with natural/natural_out also the natural protocol. Several
    outputs: one per variant, all scored in one pass that runs the target once per batch for
    every drafter (eval.shared_target_pass)."""
    outs = [out_path] if isinstance(out_path, (str, Path)) else list(out_path)
    natural_outs = [natural_out] if isinstance(natural_out, (str, Path)) else list(natural_out or [])
    if bool(natural) != bool(natural_outs) or (natural and len(natural_outs) != len(outs)):
        raise DataError("eval-stepwise: --natural and --natural-out go together (one --natural-out per --out)")
    steps, rollout = cfg.drafters.ttt_steps, cfg.eval.natural.rollout_tokens
    if natural and rollout < steps:
        raise ConfigError(f"config: eval.natural.rollout_tokens: {rollout} < drafters.ttt_steps {steps} "
                          f"(a chain of K steps needs K rollout tokens; K + 1 is the reference chain)")
    protocols = {"continuations": (read_continuations(continuations)["items"], outs)}   # fail fast, before loading
    if natural:
        protocols["natural"] = (read_natural(natural), natural_outs)
    drafter_dirs = [drafter_dirs] if isinstance(drafter_dirs, (str, Path)) else list(drafter_dirs)
    groups = variant_groups(drafter_dirs, outs)
    models = load_models(cfg, rt, target_dir, groups, features_index)
    target, aux = models.target, models.aux_layers
    drafters = [[(drafter_seed(d), m) for d, m in zip(dirs, loaded)] for dirs, loaded in zip(groups, models.drafters)]
    ecfg = cfg.eval
    summary: dict = {}
    flat = [d for variant in drafters for _, d in variant]
    for name, (source, paths) in protocols.items():
        start = time.time()
        if name == "continuations":
            items = order_items(source)
            repetition, extra = repetition_share(items), {}
            tallies = iter(chain_tallies(flat, target, items, aux, steps, ecfg.batch_size, rt.device, rt.dtype))
        else:
            tallies, repetition, extra = natural_tallies(source, flat, target, aux, steps, ecfg.natural.batch_size,
                                                         rt.device, rt.dtype, natural)
            tallies = iter(tallies)
        seconds = time.time() - start
        for dirs, variant, path in zip(groups, drafters, paths):
            result = seeds_record([s for s, _ in variant], [next(tallies) for _ in variant], repetition, steps,
                                  ecfg.bootstrap_samples, cfg.seed, ecfg.min_rounds, ecfg.context_buckets,
                                  ecfg.min_sequences)
            result.update(extra)
            first = variant[0][1]
            result.update(protocol=name, max_repetition=ecfg.max_repetition,
                          variant=drafter_variant(dirs[0]), drafters=[str(d) for d in dirs],
                          paradigm=first.cfg.paradigm, layers=first.cfg.num_layers, seconds=seconds,
                          device=rt.device, threads=rt.threads)
            if len(groups) > 1:   # the seconds are the shared pass's, every variant's drafting included
                result["shared_target_pass"] = [drafter_variant(g[0]) for g in groups]
            write_json(path, result)
            numbers = {k: result[k] for k in ("alpha", "mat", "retention")} | {"repetition": result["repetition"]["share"]}
            entry = numbers if name == "continuations" else {name: numbers}
            if len(groups) > 1:
                summary.setdefault(result["variant"], {}).update(entry)
            else:
                summary |= entry
    return summary
