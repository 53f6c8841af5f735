"""A published head's stage config, as plain data: Snakemake builds rule params with it
(workflow/rules/common.smk), so this module imports neither torch nor the drafters (every
`snakemake` call, dry runs and the SLURM jobs' own, would pay ~5 s for them)."""
from __future__ import annotations

import json


def head_variant(head: dict) -> dict:
    """The drafters.variants entry that imports a published head (train-drafter's `weights:`)."""
    v = {"name": head["name"], "paradigm": "hidden", "layers": 1, "weights": f"hub:{head['repo']}@{head['revision']}",
         "format": head["format"]}
    return {**v, "aux_convention": head["aux_convention"]} if head.get("aux_convention") else v


def head_stage_config(cfg: dict, head: dict) -> dict:
    """A stage config for one published head: its variant alone, and the publisher's decoding
    (a chain of `depth` drafts is drafters.ttt_steps; a tree is eval.e2e.tree)."""
    cfg = json.loads(json.dumps(cfg))
    dec = head["decoding"]
    if "drafters" in cfg:
        cfg["drafters"]["variants"] = [head_variant(head)]
        if dec["mode"] == "chain":
            cfg["drafters"]["ttt_steps"] = dec.get("depth", cfg["drafters"]["ttt_steps"])
    if "eval" in cfg:
        if dec["mode"] == "tree":
            cfg["eval"]["e2e"]["tree"] = {k: dec[k] for k in ("depth", "topk", "total_tokens")}
        if dec.get("max_new_tokens"):
            cfg["eval"]["e2e"]["max_new_tokens"] = dec["max_new_tokens"]
        bench = cfg["eval"]["e2e"].get("benchmarks")
        if bench:   # the publisher's shape only, at the temperatures it reports
            bench["modes"] = [dec["mode"]]
            bench["temperatures"] = sorted({float(t[1:]) for t in head["published"]}) or bench["temperatures"]
            if dec.get("max_new_tokens"):
                bench["max_new_tokens"] = dec["max_new_tokens"]
    return cfg
