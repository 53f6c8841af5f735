"""Tables, figures and the claims verdict, computed from the result files only."""
from __future__ import annotations

import os
from pathlib import Path

from kvshot.core.io import read_json, write_json, write_text

from .claims import claims_markdown, evaluate_claims
from .figures import FIGURES
from .results import load_variants
from .tables import time_capped, write_tables


def run_report(results: str, variants: list[str], tables_dir: str, figures_dir: str, claims_md: str,
               claims_json: str, figures: list[str] | None = None, with_benchmarks: bool = False) -> dict:
    from . import benchmarks

    loaded = load_variants(results, variants)
    # eval.e2e.benchmarks: per prompt set and temperature (a file left by an earlier config is not read)
    bench = benchmarks.load_benchmarks(results, variants) if with_benchmarks else []
    write_tables(loaded, tables_dir, benchmarks.table_files(bench) if bench else None)
    for name in figures or list(FIGURES):
        FIGURES[name](loaded, Path(figures_dir) / f"{name}.pdf")
    if bench:
        benchmarks.figure(bench, Path(figures_dir) / "benchmarks.pdf")
    claims = evaluate_claims(loaded)
    write_json(claims_json, claims)
    target_metrics = Path(results) / "target" / "metrics.json"
    capped = time_capped(loaded, read_json(target_metrics) if target_metrics.exists() else None)
    write_text(claims_md, claims_markdown(claims, capped))
    return {c["claim"]: c["verdict"] for c in claims}


def run_scaling_report(results: str, sizes: list[int], variants: list[str], figure: str, table: str) -> dict:
    """MAT against training-set size per variant, from results/scaling/n{N}/eval/*/stepwise.json."""
    from .figures import scaling
    from .tables import write_rows

    rows = []
    for n in sizes:
        for v in load_variants(Path(results) / f"n{n}", variants, with_e2e=False, with_train=False):
            rows.append({"train_samples": n, "variant": v.name, "paradigm": v.paradigm, "layers": v.layers,
                         "MAT": v.stepwise["mat"], "MAT_lo": v.stepwise["mat_ci"][0], "MAT_hi": v.stepwise["mat_ci"][1],
                         "alpha_0": v.stepwise["alpha"][0], "alpha_last": v.stepwise["alpha"][-1]})
    write_rows(rows, table)
    scaling(rows, figure)
    return {f"{r['variant']}@{r['train_samples']}": round(r["MAT"], 3) for r in rows}


README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"
STEPWISE_NOTE = ("n_k: distinct anchors that reached step k (seed copies count once). A rate that rests on fewer "
                 "than `eval.min_rounds` distinct anchors or fewer than `eval.min_sequences` distinct sequences "
                 "(conversations or prompts), or whose resamples do not vary, reads *insufficient data*, and a claim "
                 "that rests on it reads *inconclusive*. Intervals (95%): whole sequences resampled, the training "
                 "seeds' variance added as its own component, clipped to the statistic's range (docs/statistics.md). "
                 "Protocols: `continuations`, every anchor of the target's greedy continuations of the eval prompts "
                 "(the paper's); `natural`, seeded anchors in real held-out assistant text, each scored against the "
                 "target's greedy rollout from that real prefix. `repetition`: the share of a protocol's reference "
                 "tokens that complete a 4-gram already seen in the same sequence; the claims are judged on a protocol "
                 "whose repetition is at most `eval.max_repetition`. alpha_k by context length: "
                 "`results/tables/context.md`, `figures/context.pdf`.")
MAT_TAU_NOTE = ("Step-wise MAT (of the protocol the decoding prompts come from: natural) and E2E tau differ by design "
                "(column `tau - MAT`): MAT drafts from every anchor, while decoding drafts only where the previous round "
                "stopped, so its anchors follow the accepted runs; decoding covers `eval.e2e.prompts` real held-out "
                "prefixes (one per conversation) and `eval.e2e.max_new_tokens` tokens, and its rounds near that limit "
                "cannot accept all K drafts. tau 95% CI: prompt x seed bootstrap.")


def update_readme(results: str, variants: list[str], readme: str, image: str, full: str | None = None,
                  block_name: str = "results", rounding: str | None = None) -> None:
    """Regenerate the README's results block (decay figure as PNG, a compact table on the judged
    protocol, one line per verdict) between its marker comments (`<!-- <block_name>:start -->`),
    and the full tables and verdicts in `full` (default docs/results.md beside the image). Another
    block_name (smollm2: the real target's run) leaves the default run's blocks alone. The run's
    fingerprint line comes from results/fingerprints.json when the report wrote one; `rounding`, the
    results folder of the same run in other numerics, marks each verdict that differs there."""
    from .figures import decay
    from .tables import _markdown, compact_rows, e2e_rows, stepwise_rows, training_summary_rows

    loaded = load_variants(results, variants)
    decay(loaded, image)
    claims = evaluate_claims(loaded)
    full = Path(full) if full else Path(image).parent / "results.md"
    rel = Path(image).relative_to(Path(readme).parent) if Path(image).is_absolute() else Path(image)
    full_rel = Path(full).relative_to(Path(readme).parent) if Path(full).is_absolute() else Path(full)
    start, end = f"<!-- {block_name}:start -->", f"<!-- {block_name}:end -->"
    block = "\n".join([start, "", f"![alpha_k by draft step]({rel.as_posix()})", "",
                        f"On the protocol the claims are judged on (every table, interval and training curve: "
                        f"[{full_rel.as_posix()}]({full_rel.as_posix()})); n_k: distinct anchors that reached step k:", "",
                        _markdown(compact_rows(loaded)), "",
                        *fingerprint_lines(results),
                        verdict_table(claims, rounding_verdicts(rounding)), end])
    text = _replace_block(Path(readme).read_text(), readme, start, end, block)
    if block_name == "results" and (Path(results) / "blockwise" / "claims.json").exists() and BLOCKWISE_START in text:
        text = _replace_block(text, readme, BLOCKWISE_START, BLOCKWISE_END, blockwise_readme_block(results))
    write_text(readme, text)
    bench = Path(results) / "tables" / "benchmarks.md"   # absent when eval.e2e.benchmarks is null
    bench_section = ["## Benchmarks at T = 0 and T = 1", "", "`results/tables/benchmarks.md`; why tau can be higher "
                     "at T = 1 on this target: [benchmarks.md](benchmarks.md#reading-them).", "",
                     bench.read_text().strip(), ""] if bench.is_file() else []
    write_text(full, "\n".join([
        "# Results of the default run" if block_name == "results" else f"# Results of the {block_name} run", "",
        f"Generated by `python -m kvshot readme --config <the run's config files> --results <run>/results"
        f"{'' if block_name == 'results' else ' --block ' + block_name}` from a "
        "finished run; the README shows the compact view and says which run.", "", f"![alpha_k by draft step]({Path(os.path.relpath(Path(image), Path(full).parent)).as_posix()})", "",
        "## Step-wise acceptance", "", "`results/tables/stepwise.md`; per-step counts, cumulative acceptance and "
        "intervals in `results/tables/steps.md`.", "", _markdown(stepwise_rows(loaded)), STEPWISE_NOTE, "",
        "## End-to-end decoding", "", "`results/tables/e2e.md`.", "", _markdown(e2e_rows(loaded)), MAT_TAU_NOTE, "",
        *bench_section,
        "## Training", "", "Per seed: `results/tables/training.md`. Every variant once per seed; it stops at "
        "`drafters.train.max_steps` or at its plateau (`drafters.train.plateau`); `last interval change`: the "
        "held-out loss's relative change over the curve's last `interval` steps.", "",
        _markdown(training_summary_rows(loaded)), "",
        claims_markdown(claims).replace("# Claims verdict", "## Claims"), ""]))


def fingerprint_lines(results: str) -> list[str]:
    """The run fingerprint beside the machine and numerics it came from (results/fingerprints.json)."""
    path = Path(results) / "fingerprints.json"
    if not path.is_file():
        return []
    prints = read_json(path)
    m = prints.get("machine", {})
    isa = "AVX-512" if m.get("avx512f") else "AVX2" if m.get("avx2") else "no AVX2"
    target = prints.get("files", {}).get("target/model/model.safetensors", "")
    return [f"Run fingerprint **`{prints['run']}`**: numerics {m.get('numerics')} ({m.get('kernels')} kernels) on "
            f"{m.get('cpu')} ({m.get('cpu_id')}; {m.get('cores')} cores, {isa}), torch "
            f"{m.get('versions', {}).get('torch')}; target weights sha256 `{target[:16]}`. If your run's "
            f"`results/fingerprints.json` holds the same run fingerprint, it gave these digits; if not, `python -m "
            f"kvshot compare-runs` names the first stage and tensor that differ "
            f"([docs/reproducibility.md](docs/reproducibility.md)).", ""]


def rounding_verdicts(results: str | None) -> dict[str, str]:
    """{claim: verdict} of the same run in other numerics (its claims.json), or none."""
    if not results:
        return {}
    return {c["claim"]: c["verdict"] for c in read_json(Path(results) / "claims.json")}


def verdict_table(claims: list[dict], rounding: dict[str, str] | None = None) -> str:
    """One row per claim: its verdict and the comparison(s) that decided it, in one line. A claim
    whose verdict differs in `rounding` (the same run in native numerics) is marked fragile."""
    from .claims import comparison_text

    rows = ["| claim | verdict | this run (paired difference, 95% interval) |", "|---|---|---|"]
    for c in claims:
        comps = c.get("comparisons") or []
        if comps:
            shown = [x for x in comps if x.get("verdict") == c["verdict"]] or comps
            evidence = "; ".join(comparison_text(x) for x in shown[:2]) + (f"; +{len(shown) - 2} more" if len(shown) > 2 else "")
        else:
            evidence = "; ".join(f"{k}: {v}" for k, v in list(c["numbers"].items())[:3]) or c.get("note", "")
        seeds = f" ({c['seeds']} seeds)" if c.get("seeds") else ""
        other = (rounding or {}).get(c["claim"])
        fragile = f"; **fragile**: {other} in native numerics" if other and other != c["verdict"] else ""
        rows.append(f"| {c['claim']} | **{c['verdict']}**{seeds}{fragile} | {evidence.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n\nTests, numbers and notes per claim: `results/claims.md`.\n"


def _replace_block(text: str, readme: str, start: str, end: str, block: str) -> str:
    if start not in text or end not in text:
        raise ValueError(f"{readme}: missing the {start} / {end} markers")
    head, rest = text.split(start, 1)
    return head + block + rest.split(end, 1)[1]


BLOCKWISE_START, BLOCKWISE_END = "<!-- blockwise:start -->", "<!-- blockwise:end -->"
def blockwise_readme_block(results: str) -> str:
    """The block-wise target's verdicts (results/blockwise/claims.json), one line each, between the
    blockwise markers; its table stays in results/blockwise/blockwise.csv."""
    base = Path(results) / "blockwise"
    claims = read_json(base / "claims.json")
    protocol = next((c["protocol"] for c in claims if c.get("protocol")), None)
    lines = [f"Verdicts (tests, numbers and notes: `results/blockwise/claims.md`"
             + (f"; judged on the `{protocol}` protocol" if protocol else "") + "):", ""]
    lines += [f"- {c['claim']}: **{c['verdict']}**" + (f" ({c['seeds']} seeds)" if c.get("seeds") else "") for c in claims]
    text = "\n".join(lines) + "\n"
    # the table itself lives in results/blockwise/blockwise.csv (and docs/results.md): the README keeps the verdicts
    return "\n".join([BLOCKWISE_START, "", text, BLOCKWISE_END])
