"""results/serve/vllm.md: the serve stage's tables from its JSON (kvshot.serve.stage)."""
from __future__ import annotations


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def lossless_lines(result: dict) -> list[str]:
    check, out = result["check"], []
    spec = check["spec_vs_vllm_plain"]
    bad = {n: v for n, v in spec.items() if v}
    out.append(f"- vLLM speculative against vLLM plain (batch 1): {sum(len(v) for v in spec.values())} mismatching "
               f"outputs over {len(spec)} engines x {result['prompts']} prompts" + (f" ({bad})" if bad else ""))
    vp = check.get("vllm_plain_vs_kvshot_plain")
    if vp:
        out.append(f"- vLLM plain against kvshot plain: {vp['prompts_differing']} of {result['prompts']} prompts differ, "
                   f"{vp['tokens_differing']} of {vp['tokens']} tokens")
        for d in vp["divergences"]:
            gap = "-" if d.get("gap") is None else f"{d['gap']:.3g}"
            tol = "-" if d.get("tolerance") is None else f"{d['tolerance']:.3g}"
            out.append(f"  - prompt {d['prompt']}, token {d['position']}: top-2 gap {gap} "
                       f"(near-tie tolerance {tol}): {'near-tie' if d['near_tie'] else 'NOT a near-tie'}")
    others = {n: v for n, v in check["vs_kvshot_plain"].items()}
    out.append("- against kvshot plain (prompts whose output differs): "
               + ", ".join(f"{n} {len(v)}" for n, v in others.items()))
    for name, row in result["throughput"].items():
        if row["mismatches_vs_batch1_plain"]:
            out.append(f"- {name}, whole set in one batch: prompts {row['mismatches_vs_batch1_plain']} differ "
                       "from batch-1 vLLM plain")
    return out


def acceptance_table(result: dict) -> list[str]:
    rows = ["| drafter, K | engine | rounds | accepted | tau | alpha by position (rounds accepting through i / rounds) "
            "| kvshot ms per round: draft / verify |",
            "|---|---|---:|---:|---:|---|---|"]
    for key, row in result["check"]["acceptance"].items():
        for engine in ("vllm", "kvshot"):
            c = row.get(engine)
            if c is None:
                continue
            alphas = " ".join(_fmt(a, 2) for a in c["alpha_by_pos"])
            ms = row.get("kvshot_ms_per_round") if engine == "kvshot" else None
            split = f"{ms['draft']:.2f} / {ms['verify']:.2f}" if ms else ""
            rows.append(f"| {key} | {engine} | {c['drafts']} | {c['accepted']} | {_fmt(c['tau'], 3)} | {alphas} | {split} |")
        if "vllm" in row:
            rows.append(f"| {key} | prompts whose rounds differ | {len(row['prompts_differing'])} | | | | |")
    cross = result["check"].get("prometheus_cross_check")
    if cross:
        rows += ["", f"vLLM's per-request counts against its Prometheus counters ({cross['engine']}, the engine that "
                     f"owns them): {'equal' if cross['equal'] else 'DIFFERENT: ' + str(cross)}"]
    return rows


def speed_table(result: dict) -> list[str]:
    timed, thr = result["timed"], result["throughput"]
    plain_v = timed.get("vllm plain", {}).get("tokens_per_s")
    plain_h = timed["hf generate"]["tokens_per_s"]
    best = set(result["summary"]["best_k"].values())
    rows = ["| method | tokens/s, batch 1 | / vLLM plain | / HF plain | tokens/s, whole set in one batch |",
            "|---|---:|---:|---:|---:|"]
    for name, row in timed.items():
        tps = row["tokens_per_s"]
        mark = " (best K)" if name in best else ""
        batch = _fmt(thr[name]["tokens_per_s"], 1) if name in thr else ""
        rows.append(f"| {name}{mark} | {tps:.1f} | {_fmt(tps / plain_v if plain_v else None, 2)} | "
                    f"{tps / plain_h:.2f} | {batch} |")
    return rows


def serve_markdown(result: dict) -> str:
    head = (f"# Serving: vLLM beside kvshot and HF\n\n{result['prompts']} held-out prompts x {result['max_new_tokens']} "
            f"new tokens, greedy, {result['target_dtype']}, {result['device']}, {result['threads']} thread(s) for every "
            f"method; {result['repeats']} timed passes ({result['order']}).\n")
    parts = [head, "## Lossless", *lossless_lines(result), "", "## Acceptance: vLLM's counters beside kvshot's",
             *acceptance_table(result), "", "## Speed", *speed_table(result), ""]
    if result["refused"]:
        parts += ["## Refused by vLLM", *[f"- {n}: {why}" for n, why in result["refused"].items()], ""]
    if result["notes"]:
        parts += ["## Notes", *[f"- {n}: {why}" for n, why in result["notes"].items()], ""]
    return "\n".join(parts)
