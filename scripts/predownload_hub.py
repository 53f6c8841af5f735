#!/usr/bin/env python
"""Put every HF hub repo a config reads into the HF cache at its pinned revision, for compute
nodes without internet: the pretrained target and tokenizer, the hub data sources, the eval
prompt sources and the published heads (published.heads). Run it on a login node with HF_HOME set to a shared folder, then run the
pipeline with HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 and the same HF_HOME.

    python scripts/predownload_hub.py                 # print the `hf download` commands
    python scripts/predownload_hub.py --run           # run them

The config defaults to config/config.yaml overlaid with config/paper.yaml (repeat --config to
choose others, later wins). A repo without a `revision` is fetched at `main`, with a warning:
its content can change under the run.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvshot.config import ConfigError, read_config  # noqa: E402


def hub_downloads(cfg: dict) -> list[dict]:
    """One entry per (repo type, repo, revision): the files to fetch (None: the whole repo)
    and the config fields that name it. A data source with `data_files` needs only those
    files (and the dataset card); split-based sources need the repo's split files."""
    wanted: dict[tuple, dict] = {}

    def add(kind: str, name: str, revision: str | None, files: list[str] | None, field: str) -> None:
        entry = wanted.setdefault((kind, name, revision or "main"),
                                  {"repo_type": kind, "name": name, "revision": revision or "main",
                                   "files": [], "whole": False, "fields": []})
        entry["fields"].append(field)
        if files is None:
            entry["whole"] = True
        else:
            entry["files"] += [f for f in files if f not in entry["files"]]

    for section in ("tokenizer", "target"):
        sec = cfg.get(section, {})
        if sec.get("source") == "pretrained":
            add("model", sec["name"], sec.get("revision"), None, section)
    sources = [("data.sources", s) for s in cfg.get("data", {}).get("sources", [])]
    sources += [("eval.prompt_sources", s) for s in (cfg.get("eval", {}).get("prompt_sources") or [])]
    bench = ((cfg.get("eval", {}).get("e2e") or {}).get("benchmarks") or {}).get("sets") or []
    sources += [("eval.e2e.benchmarks", {**b, "name": b["dataset"]}) for b in bench if b.get("kind") == "hub"]
    for field, src in sources:
        if src.get("kind") != "hub":
            continue
        files = src.get("data_files")
        files = None if files is None else ([files] if isinstance(files, str) else list(files)) + ["README.md"]
        add("dataset", src["name"], src.get("revision"), files, f"{field}[{src['name']}]")
    for head in (cfg.get("published") or {}).get("heads", []):   # the head's config and weights only
        add("model", head["repo"], head.get("revision"), ["config.json", "*.safetensors", "*.safetensors.index.json",
                                                          "pytorch_model.bin"], f"published.heads[{head['name']}]")
    return list(wanted.values())


def download_command(entry: dict) -> list[str]:
    cmd = ["hf", "download", entry["name"], "--revision", entry["revision"]]
    if entry["repo_type"] != "model":
        cmd[2:2] = ["--repo-type", entry["repo_type"]]
    if not entry["whole"]:
        for f in entry["files"]:
            cmd += ["--include", f]
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", help="config file (repeat to overlay; default: config.yaml + paper.yaml)")
    p.add_argument("--run", action="store_true", help="run the commands (default: print them)")
    args = p.parse_args(argv)
    specs = args.config or [str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")]
    try:
        cfg = read_config(specs)
    except ConfigError as exc:
        print(f"predownload_hub: error: {exc}", file=sys.stderr)
        return 2
    entries = hub_downloads(cfg)
    if not entries:
        print("predownload_hub: the config reads nothing from the hub", file=sys.stderr)
    for entry in entries:
        if entry["revision"] == "main":
            print(f"predownload_hub: warning: {entry['name']} ({', '.join(entry['fields'])}) has no pinned "
                  "revision: `main` can change; put the commit `hf download` reports into the config", file=sys.stderr)
        cmd = download_command(entry)
        print(shlex.join(cmd), flush=True)
        if args.run:
            subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
