"""Every `snakemake` command of README.md and docs/*.md dry-runs against the configs and profiles
it names (issue 49; the parse checks are tests/unit/test_doc_commands.py). One dry run per
distinct (config files, profile), with the union of its commands' targets, in a scratch
directory that sees the repo's workflow (tests/dag.py); two at a time. Not dry-run, by name in
tests/doc_commands.py: NOT_DRY (conda env builds, the report of a finished run, --unlock) and
NOT_PARSED (patterns). `hf download` and `sbatch` lines are not snakemake commands: the slurm
profile's dry run needs no sbatch."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .. import doc_commands as dc
from ..dag import snakemake, workdir


def test_every_snakemake_command_dry_runs(tmp_path):
    groups = dc.dry_run_groups(dc.commands())
    assert (("config/paper.yaml",), ("profiles/slurm",)) in groups, sorted(groups)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def one(item):
        i, (key, group) = item
        cwd = workdir(tmp_path / f"g{i}")
        dc.written_files(cwd, group["written"])
        return key, group, snakemake(cwd, *dc.dry_run_argv(key, group["targets"]), timeout=300, env=env)

    for i in range(len(groups)):
        (tmp_path / f"g{i}").mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(one, enumerate(groups.items())))
    failed = []
    for key, group, proc in runs:
        jobs = dc.job_count(proc.stdout + proc.stderr)
        print(f"{key}: {group['targets']}: {jobs} jobs ({len(group['commands'])} commands)")
        if proc.returncode != 0 or jobs is None:
            tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-5:])
            failed.append(f"{key} {group['targets']}, for:\n  " + "\n  ".join(group["commands"]) + f"\n{tail}")
    assert not failed, "dry runs that fail:\n" + "\n\n".join(failed)
