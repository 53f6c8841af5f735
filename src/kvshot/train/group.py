"""Drafters trained side by side (`drafters.group_training`): one stream of batches for a
group of drafters, so each batch's target forward (online features) or feature read (offline)
happens once for all of them instead of once per drafter.

Each member is the drafter `loop.train_variant` would train alone, at the same seed: its own
initialisation (the RNG state it would see alone), optimizer, schedule, checkpoint, held-out
curve, plateau stop, outputs and metrics. The group shares the target, the feature sources
(reading the union of what its members read), the draft vocabulary, the fixed probe batches,
the frozen copy of the target's embedding, and each step's batch: members whose next samples
are the same (all of them, unless a resume put them at different points) train on one batch.
A member that stops (plateau, max_steps, max_minutes) is finished and saved and leaves the
group; the others train on. Past the job's runtime every member still training checkpoints
and the job exits 75, as one drafter's does; the rerun resumes each from its own checkpoint
(a member that had finished is saved again from its final checkpoint, kept until the whole
group is done). Under DDP each member has its own DistributedDataParallel wrap; every process
walks the members in the same order, so their collectives pair up.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict

from kvshot.checks import GROUP_SHARED, stream_settings
from kvshot.config import ConfigError, Runtime
from kvshot.core.progress import Progress
from kvshot.settings import Config
from kvshot.train.diagnostics import diagnostic_batches
from kvshot.train.loop import (Run, StoppedForRuntime, checkpoint, evaluate_heldout, fetch_batch, finish, heldout_due,
                               log, open_shared, setup_member, step_ids, stop_for_time, train_step)


def check_members(runs: list[Run]) -> None:
    """Members read one stream of batches: the same samples (n), batch size, cut and order."""
    first = runs[0]
    for run in runs[1:]:   # the samples, their cut and their order
        for key, a, b in zip(GROUP_SHARED, stream_settings(asdict(first.tc)), stream_settings(asdict(run.tc))):
            if a != b:
                raise ConfigError(f"config: drafters.group_training: {first.name} and {run.name} train with "
                                  f"{key} {a} and {b}: a group reads one stream of batches")
        if run.n != first.n:
            raise ConfigError(f"config: drafters.group_training: {first.name} and {run.name} read {first.n} and "
                              f"{run.n} train samples: a group reads one stream of batches")


def read_union(runs: list[Run]) -> None:
    """From here on every batch holds what any member reads (each member reads its own part)."""
    kv = sorted({l for r in runs for l in r.model.cfg.kv_layers})
    aux = any(r.model.reads_aux_hidden for r in runs)
    first = runs[0]
    for src in {id(s): s for s in (first.shared.train_src, first.shared.eval_src, first.shared.val_src)}.values():
        src.read_only(kv, aux)


def share_probe_batches(runs: list[Run]) -> None:
    """The fixed held-out probe batches, built once (with every member's features) per size."""
    built: dict[int, list] = {}
    for run in runs:
        count = run.tc.diagnostic_sequences
        if count not in built:
            built[count] = diagnostic_batches(run.shared.val_src, count, run.tc.max_len, run.rt.device)
        run.probe_batches = built[count]


def _leave(run: Run, out_dir: str, others: bool) -> dict:
    """Finish a member (eval, save). While others train on, its final state is checkpointed
    first and kept until the group is done: a rerun after a later kill saves it again from
    there instead of training it again."""
    if others:
        run.progress["finished"] = True
        checkpoint(run)
    run.bar.close()
    return finish(run, out_dir, remove_checkpoint=False)


def _stop_all_for_runtime(runs: list[Run]) -> None:
    for run in runs:
        run.progress["stopped_by"] = "runtime"
        checkpoint(run)
        run.bar.close()
    first = runs[0]
    where = ", ".join(f"{r.name} at step {r.progress['step']} of {r.tc.max_steps}" for r in runs)
    msg = (f"train group: stopped {where}, {first.tc.stop_margin_minutes} min before the job's "
           f"{first.runtime_minutes} min runtime; checkpoints {', '.join(str(r.ckpt) for r in runs)}; "
           "a rerun resumes from them")
    if first.rank == 0:
        print(msg, flush=True)
    raise StoppedForRuntime(msg)


def train_group(cfg: Config, rt: Runtime, names: list[str], train_dir: str, eval_dir: str, target_dir: str,
                out_dirs: list[str], runtime_minutes: float | None = None, val_dir: str | None = None,
                ckpt_dirs: list[str] | None = None) -> dict[str, dict]:
    """Train `names` side by side into out_dirs (one each); ckpt_dirs: each member's checkpoint
    folder (default `<out>.ckpt`, as alone). Returns each member's metrics, by name."""
    if len(set(names)) != len(names) or len(out_dirs) != len(names):
        raise ConfigError(f"train group: {names}: one output per variant, each variant once")
    ckpt_dirs = ckpt_dirs or [f"{o}.ckpt" for o in out_dirs]
    shared = open_shared(cfg, rt, train_dir, eval_dir, target_dir, val_dir)
    runs: list[Run] = []
    for name, out, ckpt in zip(names, out_dirs, ckpt_dirs):
        runs.append(setup_member(cfg, rt, shared, name, train_dir, eval_dir, target_dir, out, runtime_minutes,
                                 ckpt_dir=ckpt, group=names, embed_from=runs[0].model if runs else None))
    check_members(runs)
    read_union(runs)
    share_probe_batches(runs)
    out_of = dict(zip(names, out_dirs))
    for run in runs:
        run.bar = Progress(total=run.tc.max_steps, initial=run.progress["step"], desc=f"train {run.name}",
                           unit="step", disable=run.rank != 0)
        run.model.train()
    results: dict[str, dict] = {}
    active = list(runs)

    def leave(run: Run) -> None:
        active.remove(run)
        results[run.name] = _leave(run, out_of[run.name], bool(active))

    for run in [r for r in runs if r.progress.get("finished")]:   # finished before a kill: save it again
        leave(run)
    while active:   # per member, as alone: its held-out point, then its stops; then one step for all
        for run in list(active):
            p = run.progress
            if heldout_due(run) and evaluate_heldout(run):
                p["stopped_by"] = "plateau"
                leave(run)
            elif p["step"] >= run.tc.max_steps:
                leave(run)
        for run in list(active):
            if run.steps_here:   # each attempt trains every member at least one step
                stop = stop_for_time(run)
                if stop == "runtime":
                    _stop_all_for_runtime(active)
                if stop == "max_minutes":
                    run.progress["stopped_by"] = "max_minutes"
                    leave(run)
        batches: dict[tuple, dict] = {}   # by sample ids: one read (online: one target forward) per batch
        for run in active:
            ids = tuple(step_ids(run))
            if ids not in batches:
                batches[ids] = fetch_batch(run, list(ids))
            p = run.progress
            logging = p["step"] % run.tc.log_every == 0 or p["step"] + 1 == run.tc.max_steps
            started = time.perf_counter()
            s = train_step(run, logging, batches[ids])
            if logging:
                log(run, s)
            p["seconds"] += time.perf_counter() - started   # its own step (the shared read apart)
            del s
            run.bar.update(1)
            if p["step"] % run.tc.ckpt_every == 0 and p["step"] < run.tc.max_steps:
                checkpoint(run)
        del batches
    if runs[0].rank == 0:   # every member saved: nothing left to resume
        for run in runs:
            shutil.rmtree(run.ckpt.parent, ignore_errors=True)
    runs[0].shared.accel.wait_for_everyone()
    return {name: results[name] for name in names}

