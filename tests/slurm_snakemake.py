"""`snakemake` for the SLURM tests on the single-node test cluster: the real CLI and the real
SLURM executor plugin, with one change to the submitting process only: the plugin's
status-check backoff is capped at the profile's interval.

The plugin (snakemake-executor-plugin-slurm) adds 10 s to the wait before its next `squeue`
whenever a check finds no job finished (up to 180 s, protecting a shared slurmctld); the
smoke DAG's jobs take 5-30 s each, so each of them sat finished for up to ~20 s before
Snakemake saw it and submitted the next (measured: most of the sbatch test's time). The jobs
themselves (the sbatch call, the job script, the Snakemake run inside each job) are untouched.

    python tests/slurm_snakemake.py --profile profiles/slurm-test ...
"""
from __future__ import annotations

import sys

CAP_SECONDS = 2   # profiles/slurm-test: init-seconds-before-status-checks and seconds-between-status-checks


def cap_status_backoff(cap: float = CAP_SECONDS) -> None:
    """Patch the plugin's Executor so that its next status check is at most `cap` seconds away."""
    from snakemake_executor_plugin_slurm import Executor

    if getattr(Executor.check_active_jobs, "_capped", False):
        return
    check = Executor.check_active_jobs

    async def check_active_jobs(self, active_jobs):
        async for job in check(self, active_jobs):
            yield job
        self.next_seconds_between_status_checks = min(self.next_seconds_between_status_checks or cap, cap)

    check_active_jobs._capped = True
    Executor.check_active_jobs = check_active_jobs


if __name__ == "__main__":
    cap_status_backoff()
    from snakemake.cli import main

    sys.argv[0] = "snakemake"
    sys.exit(main())
