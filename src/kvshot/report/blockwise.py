"""The block-wise drafters against the KV-only chains, from the result files only:
figures/blockwise.pdf (alpha_k by position, block vs chain, per depth), a table, and verdicts
in the claims machinery (`claims.Judge`: 95% intervals, enough rounds, every seed agreeing).

Block variants live under results/blockwise/ (drafters/<variant>/seed<N>, eval/<variant>/);
the chains they are judged against are the default run's KV-only variants under results/.
Block position k is chain step k: alpha_k, MAT and retention read the same way for both.
The gate remedies for the hybrid (`blockwise.remedies`, also under results/blockwise/) are
judged against the default run's hybrid, where its gate collapsed: does the KV branch's share
|g delta| / |h| stay open, and does that buy acceptance?
"""
from __future__ import annotations

import statistics
from pathlib import Path

from kvshot.core.io import read_json, write_json, write_text

from .claims import (INCONCLUSIVE, MISSING, NOT_REPRODUCED, REPRODUCED, Judge, _gate_claim, _per_seed, agree, alpha_at,
                     claim, claims_markdown, combine, mat_of)
from .diagnostic_rules import band, log_values, paired_replicates, side
from .figures import _err, _save, _style, decay, depth, plt
from .results import (Variant, block_context, is_ablation, judged_protocol, load_variants, position_decay,
                      refine_passes, seed_folders, seed_runs, with_protocol)
from .tables import write_rows

CONTEXT_OF = {"kv": "KV cache", "hidden": "fused hidden states", "dflash": "fused hidden states, DFlash's layout"}


def ablation_what(v: Variant) -> str:
    parts = ([f"{position_decay(v)}^k position weights"] if position_decay(v) is not None else []) + (
        [f"{refine_passes(v)} refinement pass{'es' if refine_passes(v) > 1 else ''}"] if refine_passes(v) else [])
    return ", ".join(parts)


def read_contexts(results: Path, variants: list[Variant]) -> None:
    """Each block variant's drafter config (block_context) and own position_decay into its metrics record."""
    for v in variants:
        folders = seed_folders(results / "drafters" / v.name, v.stepwise)
        config = read_json(folders[0] / "config.json") if folders else {}
        v.train["block_context"] = config.get("block_context", "kv")
        entry = read_json(folders[0] / "variant.json") if folders and (folders[0] / "variant.json").exists() else {}
        v.train["position_decay"], v.train["refine_passes"] = entry.get("position_decay"), entry.get("refine_passes", 0)


def split_roles(block: list[Variant], chain: list[Variant]) -> dict:
    """Block-KV by depth, block-hidden and block-dflash (the shallowest), the KV-only chains by depth, and the
    ablations (position weights, refinement) with their plain twins (same context and depth)."""
    uniform = [v for v in block if not is_ablation(v)]
    kv_blocks = {v.layers: v for v in uniform if block_context(v) == "kv"}
    hidden = sorted((v for v in uniform if block_context(v) == "hidden"), key=lambda v: v.layers)
    dflash = sorted((v for v in uniform if block_context(v) == "dflash"), key=lambda v: v.layers)
    ablations = []
    for v in block:
        twin = [u for u in uniform if u.layers == v.layers and block_context(u) == block_context(v)]
        if is_ablation(v) and twin:
            ablations.append((v, twin[0]))
    return {"block_kv": kv_blocks, "block_hidden": hidden[0] if hidden else None, "block_dflash": dflash[0] if dflash else None,
            "chain": {v.layers: v for v in chain if v.paradigm == "kv"}, "ablations": ablations}


def median_position_ratio(v: Variant | None) -> float | None:
    """Positions sending gradient into W_K,W_V / into W_Q,W_O (train_log kv_grad_position_ratio):
    the median over each seed's log points, averaged over the seeds."""
    per_seed = [[x for _, x in log_values(lg)] for lg in (v.seed_logs if v else [])]
    per_seed = [statistics.median(xs) for xs in per_seed if xs]
    return statistics.mean(per_seed) if per_seed else None


def _gradient_verdict(pairs: list[tuple[Variant, Variant]]) -> tuple[str, dict]:
    """Does the block's KV path draw gradient from more positions than the chain's at every depth?
    Per depth the block - chain difference of `kv_grad_position_ratio`, paired by seed, decides
    when its 95% seed band (`diagnostic_rules.band`; one seed: its log points) excludes 0."""
    numbers, verdicts = {}, []
    for block, chain in pairs:
        diffs = paired_replicates(block.seed_logs, chain.seed_logs)
        b, c = median_position_ratio(block), median_position_ratio(chain)
        if b is None or c is None or not diffs:
            verdicts.append(MISSING)
            continue
        spread = band(diffs)
        numbers[f"{block.name} / {chain.name}"] = f"{b:.3f} / {c:.3f}"
        numbers[f"{block.name} - {chain.name}"] = (f"{statistics.mean(diffs):+.3f}" +
                                                   (f" [{spread[1]:+.3f}, {spread[2]:+.3f}]" if spread else ""))
        where = side(spread, 0.0)
        verdicts.append(INCONCLUSIVE if not where else REPRODUCED if where > 0 else NOT_REPRODUCED)
    return combine(verdicts), numbers


def evaluate_block_claims(block: list[Variant], chain: list[Variant]) -> list[dict]:
    """The block-wise verdicts, judged on the protocol the main claims use (`judged_protocol`)."""
    everyone = block + chain
    judged = judged_protocol(everyone)
    everyone = with_protocol(everyone, judged["protocol"])
    block, chain = everyone[: len(block)], everyone[len(block):]
    per_seed = seed_runs(everyone)
    judge, n_seeds = Judge(per_seed), len(per_seed)
    r = split_roles(block, chain)
    depths = sorted(set(r["block_kv"]) & set(r["chain"]))
    steps = min(v.stepwise["steps"] for v in everyone) if everyone else 7
    last = steps - 1
    out = []

    def add(name, paper, test, numbers, verdict, seeds=n_seeds):
        c = claim(name, paper, test, numbers, verdict, judge.take_notes(), seeds)
        c["protocol"], c["reference_repetition"] = judged["protocol"], judged["repetition"]
        if judged["note"]:
            c["note"] = "; ".join(filter(None, [c.get("note"), judged["note"]]))
        out.append(c)

    paper = ("the paper's conclusion: autoregressive TTT cannot exploit the KV signal; block-wise parallel "
             "training (as DFlash) is the way out (not measured in the paper)")
    if depths:
        verdicts, nums = [], {}
        for d in depths:
            b, c = r["block_kv"][d], r["chain"][d]
            for get in (alpha_at(last), mat_of):
                verdicts.append(judge.greater(b, c, get))
                nums[f"{get(b).what} {b.name}"], nums[f"{get(c).what} {c.name}"] = get(b).text(), get(c).text()
        add("block-wise training rescues long-range KV drafting", paper,
            f"alpha_{last} and MAT of block-kv-dN > of kv-dN at every depth N in {depths}, 95% intervals, every seed",
            nums, combine(verdicts))
    else:
        add("block-wise training rescues long-range KV drafting", paper,
            "block-kv-dN vs kv-dN at equal depth", {}, MISSING)

    hid = r["block_hidden"]
    twin = r["block_kv"].get(hid.layers) if hid else None
    test = (f"alpha_{last} and MAT of block-wise KV context > of block-wise hidden context at equal depth "
            f"(layers: {hid.layers if hid else 'N'}), 95% intervals, every seed")
    if hid and twin:
        verdicts, nums = [], {}
        for get in (alpha_at(last), mat_of):
            verdicts.append(judge.greater(twin, hid, get))
            nums[f"{get(twin).what} {twin.name}"], nums[f"{get(hid).what} {hid.name}"] = get(twin).text(), get(hid).text()
        add("block-wise KV context vs block-wise hidden context",
            "the paper's premise: the KV cache keeps what hidden states drop, so KV context should win at long range",
            test, nums, combine(verdicts))
    else:
        add("block-wise KV context vs block-wise hidden context", "", test, {}, MISSING)

    pairs = [(r["block_kv"][d], r["chain"][d]) for d in depths]
    verdict, nums = _gradient_verdict(pairs) if pairs else (MISSING, {})
    add("block-wise training densifies the KV-path gradient",
        "sparse KV-path gradient under autoregressive TTT (drafter-side W_K/W_V see only the drafted tokens)",
        "positions sending gradient into W_K,W_V / into W_Q,W_O (per scored query, median over training), "
        "block-kv-dN - kv-dN paired by seed: its 95% seed band above 0 at every depth (reproduced), below 0 at one "
        "(not reproduced), else inconclusive; one seed: the band over its log points", nums, verdict)

    for abl, twin in r["ablations"]:   # ablations, not claims of the paper: either direction is reported
        nums, ups, downs = {}, [], []
        for get in (alpha_at(last), mat_of):
            ups.append(judge.greater(abl, twin, get))
            downs.append(judge.greater(twin, abl, get))
            nums[f"{get(abl).what} {abl.name}"], nums[f"{get(twin).what} {twin.name}"] = get(abl).text(), get(twin).text()
        for v in (abl, twin):   # what it costs while decoding
            chain_e2e = (v.e2e or {}).get("modes", {}).get("chain")
            if chain_e2e:
                nums[f"tau / draft ms per round {v.name}"] = (f"{chain_e2e['tau']:.3f} / "
                                                              f"{1000 * chain_e2e['draft_seconds_per_round']:.2f}")
        up, down = combine(ups), combine(downs)
        verdict = MISSING if MISSING in (up, down) else up if up == REPRODUCED else NOT_REPRODUCED if down == REPRODUCED else INCONCLUSIVE
        what = ablation_what(abl)
        name = (f"block position weights {position_decay(abl)}^k beat uniform" if not refine_passes(abl)
                else f"block refinement pays ({what})")
        add(f"{name} ({abl.name} vs {twin.name})",
            f"ablation (not in the paper): {what} against the default block (uniform weights, one pass)",
            f"alpha_{last} and MAT of {abl.name} > of {twin.name}, 95% intervals, every seed "
            f"(not reproduced: {twin.name} is higher on both)", nums, verdict)
    return out


def evaluate_remedy_claims(remedies: list[Variant], hybrids: list[Variant]) -> list[dict]:
    """One verdict per gate remedy against the default hybrid, credited only where that hybrid's
    gate collapsed (`claims._gate_claim`, every seed agreeing); otherwise inconclusive: there is
    nothing to remedy. Where it did: reproduced when the remedy's gate does not collapse (in
    every seed) and MAT(remedy) > MAT(hybrid) by the 95% intervals in every seed; not reproduced
    when it collapses too or MAT is lower."""
    hybrid = min(hybrids, key=lambda v: v.layers) if hybrids else None
    if not remedies:
        return []
    everyone = remedies + ([hybrid] if hybrid else [])
    judged = judged_protocol(everyone)
    everyone = with_protocol(everyone, judged["protocol"])
    per_seed = seed_runs(everyone)
    judge, out = Judge(per_seed), []
    hybrid = everyone[-1] if hybrid else None
    baseline = _per_seed(_gate_claim, (hybrid,), [(run[-1],) for run in per_seed])["verdict"] if hybrid else MISSING
    for i, r in enumerate(everyone[: len(remedies)]):
        test = (f"only where {hybrid.name if hybrid else 'the hybrid'}'s gate collapsed (gate collapse reproduced): "
                f"the gate of {r.name} does not collapse (every seed) and MAT({r.name}) > "
                f"MAT({hybrid.name if hybrid else 'hybrid'}), 95% intervals")
        gate = _gate_claim(r)
        seeds = [_gate_claim(run[i])["verdict"] for run in per_seed]
        collapse = agree(gate["verdict"], seeds)   # reproduced: the remedy's gate collapsed too
        numbers = {f"{r.name}: {k}": x for k, x in gate["numbers"].items()}
        numbers[f"gate collapse of {hybrid.name if hybrid else 'the hybrid'}"] = baseline
        notes = [gate.get("note", "")]
        if hybrid is None or collapse == MISSING or gate["verdict"] == MISSING or baseline == MISSING:
            verdict = MISSING
        elif baseline != REPRODUCED:
            verdict = INCONCLUSIVE
            notes.append(f"not applicable: the baseline hybrid's gate did not collapse (gate collapse: {baseline})")
        else:
            mat = judge.greater(r, hybrid, mat_of)
            numbers |= {f"MAT {r.name}": mat_of(r).text(), f"MAT {hybrid.name}": mat_of(hybrid).text()}
            if collapse == REPRODUCED or mat == NOT_REPRODUCED:
                verdict = NOT_REPRODUCED
            elif gate["verdict"] != REPRODUCED and all(v != REPRODUCED for v in seeds) and mat == REPRODUCED:
                verdict = REPRODUCED
            else:
                verdict = INCONCLUSIVE
        c = claim(f"gate remedy {r.name}", "gate-induced gradient starvation: the hybrid gate closes early and "
                  "stays closed (remedies: not measured in the paper)", test, numbers, verdict,
                  "; ".join(filter(None, [judge.take_notes(), *notes])), len(per_seed))
        c["protocol"], c["reference_repetition"] = judged["protocol"], judged["repetition"]
        out.append(c)
    return out


def block_rows(block: list[Variant], chain: list[Variant]) -> list[dict]:
    """One row per variant, on the protocol the verdicts are judged on."""
    judged = judged_protocol(block + chain)["protocol"]
    block, chain = with_protocol(block, judged), with_protocol(chain, judged)
    rows = []
    for kind, group in (("block", block), ("chain", chain)):
        for v in group:
            sw = v.stepwise
            row = {"variant": v.name, "kind": "ablation" if kind == "block" and is_ablation(v) else kind,
                   "position_decay": (position_decay(v) or 1.0) if kind == "block" else None,
                   "refine_passes": refine_passes(v) if kind == "block" else None,
                   "context": block_context(v) if kind == "block" else "kv",
                   "layers": v.layers, "protocol": sw.get("protocol", "continuations"),
                   "MAT": sw["mat"], "MAT_lo": sw["mat_ci"][0], "MAT_hi": sw["mat_ci"][1],
                   "retention": sw["retention_observed"], "kv_grad_positions": median_position_ratio(v)}
            row |= {f"alpha_{k}": a for k, a in enumerate(sw["alpha_observed"])}
            row |= {f"n_{k}": n for k, n in enumerate(sw["rounds"])}
            row |= {"min_rounds": sw["min_rounds"], "min_sequences": sw.get("min_sequences")}
            chain_e2e = (v.e2e or {}).get("modes", {}).get("chain")
            if chain_e2e:
                row |= {"tau_chain": chain_e2e["tau"], "draft_s_per_round": chain_e2e["draft_seconds_per_round"],
                        "lossless": chain_e2e["lossless"]}
            rows.append(row)
    return rows


def remedy_rows(variants: list[Variant]) -> list[dict]:
    """The hybrid and its remedies: MAT (on the judged protocol), and the KV branch's share at
    the start and the end of training."""
    rows = []
    for v in with_protocol(variants, judged_protocol(variants)["protocol"]):
        shares = [r["gate_share"] for r in v.log if any(x is not None for x in r.get("gate_share") or [])]   # pooled
        mean = lambda xs: statistics.mean(x for x in xs if x is not None)   # noqa: E731
        rows.append({"variant": v.name, "kind": "remedy" if v.train.get("remedy") else "hybrid", "layers": v.layers,
                     "protocol": v.stepwise.get("protocol", "continuations"), "MAT": v.stepwise["mat"],
                     "MAT_lo": v.stepwise["mat_ci"][0], "MAT_hi": v.stepwise["mat_ci"][1],
                     "gate_share_initial": mean(shares[0]) if shares else None,
                     "gate_share_final": mean(shares[-1]) if shares else None})
    return rows


def blockwise_figure(block: list[Variant], chain: list[Variant], path) -> None:
    """alpha_k by position: per depth a panel with the KV-only chain and the block-KV drafter
    (block-hidden in the panel of its depth), on the protocol the claims are judged on."""
    _style()
    judged = judged_protocol(block + chain)["protocol"]
    both = with_protocol(block + chain, judged)
    r = split_roles(both[: len(block)], both[len(block):])
    extra = [r[k] for k in ("block_hidden", "block_dflash") if r[k]]
    depths = sorted(set(r["block_kv"]) | set(r["chain"]) | {v.layers for v in extra})
    fig, axes = plt.subplots(1, len(depths), figsize=(4.6 * len(depths), 3.8), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], depths):
        shown = [(r["chain"].get(d), "--", "KV-only chain (TTT)"), (r["block_kv"].get(d), "-", "block, KV context")]
        if r["block_hidden"] and r["block_hidden"].layers == d:
            shown.append((r["block_hidden"], ":", "block, hidden context"))
        if r["block_dflash"] and r["block_dflash"].layers == d:
            shown.append((r["block_dflash"], (0, (3, 1, 1, 1, 1, 1)), "block, DFlash's layout (served by vLLM)"))
        shown += [(a, "-.", f"block, {ablation_what(a)}") for a, _ in r["ablations"] if a.layers == d]
        for v, style, what in shown:
            if v is None:
                continue
            sw = v.stepwise
            ok = [k for k in range(len(sw["alpha_observed"])) if sw["alpha_sufficient"][k]]
            a = [sw["alpha_observed"][k] for k in ok]
            ax.errorbar(ok, a, yerr=_err(a, [sw["alpha_ci"][k] for k in ok]), linestyle=style, marker="o",
                        capsize=3, label=f"{v.name}: {what}, MAT {sw['mat']:.2f}")
        ax.set_title(f"{d} layer{'s' if d > 1 else ''}")
        ax.set_xlabel("draft step / block position k")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel(r"$\alpha_k$ (conditional acceptance)")
    fig.suptitle(f"Block-wise vs chain drafting ({judged} protocol; insufficient points, too few anchors or sequences, left out)")
    _save(fig, path)


def run_blockwise_report(results: str, block_names: list[str], chain_names: list[str], figure: str, table: str,
                         claims_md: str, claims_json: str, remedy_names: list[str] = (),
                         hybrid_names: list[str] = (), main_names: list[str] = (), decay_figure: str | None = None,
                         depth_figure: str | None = None) -> dict:
    """results/blockwise/{eval,drafters} for the block variants and gate remedies,
    results/{eval,drafters} for the chains and the hybrid the remedies are judged against.
    decay_figure / depth_figure: the default run's figures redrawn with the block variants and
    remedies beside every variant of drafters.variants (main_names)."""
    block = load_variants(Path(results) / "blockwise", block_names)
    read_contexts(Path(results) / "blockwise", block)
    chain = load_variants(results, chain_names)
    remedies = load_variants(Path(results) / "blockwise", list(remedy_names))
    for v in remedies:
        v.train["remedy"] = True
    hybrids = load_variants(results, list(hybrid_names)) if remedies else []
    claims = evaluate_block_claims(block, chain) + evaluate_remedy_claims(remedies, hybrids)
    write_rows(block_rows(block, chain), table)
    if remedies:   # beside the table: results/blockwise/remedies.csv
        write_rows(remedy_rows(remedies + hybrids), Path(table).with_name("remedies.csv"))
    blockwise_figure(block, chain, figure)
    if decay_figure or depth_figure:
        loaded = {v.name: v for v in chain + hybrids}
        names = list(main_names or chain_names)
        rest = {v.name: v for v in load_variants(results, [n for n in names if n not in loaded])}
        everyone = [loaded.get(n) or rest[n] for n in names] + block + remedies
        if decay_figure:
            decay(everyone, decay_figure)
        if depth_figure:
            depth(everyone, depth_figure)
    write_json(claims_json, claims)
    text = claims_markdown(claims).replace("# Claims verdict", "# Block-wise drafting: verdicts")
    write_text(claims_md, text.replace("by `kvshot report`", "by `kvshot blockwise-report`"))
    return {c["claim"]: c["verdict"] for c in claims}
