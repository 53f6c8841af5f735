"""The trainer's resumable checkpoint: what it must match to be resumed (the fingerprint),
an atomic write of only what training changes, and the load that sets aside a stale or
damaged file."""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch

from kvshot.config import Runtime
from kvshot.core.integrity import content_digest, folder_digest
from kvshot.settings import Config
from kvshot.train.variants import Variant, variant_record

# settings that do not change what is trained: a checkpoint made under other values resumes.
# The process count: each step's samples are the global batch's, split by rank, and DDP averages
# the gradients over a global token count, so 8 GPUs or 4 train the same model (a job resubmitted
# on fewer GPUs resumes); the logging, checkpoint and diagnostic cadence; the wall-clock limits.
NOT_FINGERPRINTED = ("stop_margin_minutes", "num_processes", "log_every", "ckpt_every", "max_minutes",
                     "diagnostic_sequences")
# what checkpoints written before the list above grew were fingerprinted without (they resume too)
_LEGACY_NOT_FINGERPRINTED = ("stop_margin_minutes",)
# fingerprint -> the fingerprints runs that train alike had under the legacy rule
_legacy: dict[str, set[str]] = {}


def _trains_alike(key: str, value, ignored: tuple[str, ...] = NOT_FINGERPRINTED) -> bool:
    """A setting that does not change what is trained: one of `ignored`, or length grouping off
    (0 or 1) or no eval_steps (both added after checkpoints existed: off, they leave their
    fingerprint as it was)."""
    return key in ignored or (key == "length_grouping" and int(value or 0) <= 1) or (key == "eval_steps" and not value)


def _digest(variant: Variant, cfg: Config, rt: Runtime, inputs: dict, ignored: tuple[str, ...]) -> str:
    v = variant_record(variant)
    v = {**v, "train": {k: x for k, x in v["train"].items() if not _trains_alike(k, x, ignored)}}
    dcfg = cfg.drafters
    key = {"variant": v, "seed": cfg.seed, "dtype": rt.dtype,
           "drafters": {"ttt_steps": dcfg.ttt_steps, "step_decay": dcfg.step_decay,
                        "draft_vocab_size": dcfg.draft_vocab_size}, **inputs}
    if variant.paradigm == "block":   # the block objective's position weights
        key["block_position_decay"] = dcfg.block_position_decay
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(v: Variant, cfg: Config, rt: Runtime, train_dir: str, eval_dir: str, target_dir: str,
                val_dir: str) -> str:
    """What a checkpoint must match to be resumed: what changes the trained model, i.e. the
    variant (model and its training settings: global batch, lr, schedule, steps, lengths,
    grouping, ...), the seed, dtype and TTT objective, and the content of its inputs (a retrained
    target or recaptured features start afresh, at the same paths); not NOT_FINGERPRINTED."""
    inputs = {"train": content_digest(Path(train_dir) / "index.json"),
              "eval": content_digest(Path(eval_dir) / "index.json"),
              "target": folder_digest(target_dir), "val": content_digest(Path(val_dir) / "index.json")}
    fp = _digest(v, cfg, rt, inputs, NOT_FINGERPRINTED)
    _legacy.setdefault(fp, set()).add(_digest(v, cfg, rt, inputs, _LEGACY_NOT_FINGERPRINTED))
    return fp


def set_aside(ckpt: Path, why: str) -> None:
    """Move a checkpoint that must not be resumed out of the way (kept for inspection)."""
    aside = ckpt.with_name(f"{ckpt.name}.{why}")
    os.replace(ckpt, aside)
    print(f"set aside {ckpt} as {aside.name} ({why}); training starts from step 0", flush=True)


def load_checkpoint(ckpt: Path, fp: str) -> dict | None:
    """The checkpoint to resume from, or None: a missing, stale or unreadable one starts afresh."""
    if not ckpt.exists():
        return None
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)   # wherever it was written
        written_for = saved["progress"]["fingerprint"]
    except Exception as exc:   # truncated or damaged: torch/pickle raise many kinds
        print(f"{ckpt}: unreadable ({type(exc).__name__})", flush=True)
        set_aside(ckpt, "corrupt")
        return None
    if written_for != fp and written_for not in _legacy.get(fp, ()):
        print(f"{ckpt}: written for other inputs or config", flush=True)
        set_aside(ckpt, "stale")
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))   # set by accelerate launch / torchrun
    if saved["progress"].get("world_size", world) != world:
        print(f"{ckpt}: written by {saved['progress']['world_size']} processes, resumed by {world} "
              f"(the same global batch)", flush=True)
    # what this run's next checkpoint records (a legacy checkpoint's saves carry today's fingerprint)
    saved["progress"].update(fingerprint=fp, world_size=world)
    return saved


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The frozen parameters: copied from the target when the drafter is built (the token
    embedding, 2.5 GB in fp32 at Qwen3-8B), so a resume rebuilds them instead of reading them."""
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    frozen = frozen_names(model)
    return {k: t for k, t in model.state_dict().items() if k not in frozen}


def save_checkpoint(path: Path, model, opt, sched, progress: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": trained_state(model), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "progress": progress}, tmp)
    os.replace(tmp, path)   # a kill mid-save keeps the previous checkpoint


def restore_checkpoint(saved: dict, model, opt, sched) -> dict:
    """Load a checkpoint into a model built afresh (its frozen tensors from the target; a
    checkpoint written with them loads too); returns its progress."""
    missing, unexpected = model.load_state_dict(saved["model"], strict=False)
    if unexpected or set(missing) - frozen_names(model):
        raise RuntimeError(f"checkpoint does not fit the drafter: missing {sorted(set(missing) - frozen_names(model))}, "
                           f"unexpected {sorted(unexpected)}")
    opt.load_state_dict(saved["optimizer"])
    sched.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["torch_rng"])
    random.setstate(saved["python_rng"])
    return saved["progress"]
