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

from .config import Runtime
from .integrity import content_digest, folder_digest

# settings that do not change what is trained: a checkpoint made under other values resumes
NOT_FINGERPRINTED = ("stop_margin_minutes",)


def _trains_alike(key: str, value) -> bool:
    """A setting that does not change what is trained: the margin, or length grouping off (0 or
    1; added after checkpoints existed, so off it leaves their fingerprint as it was)."""
    return key in NOT_FINGERPRINTED or (key == "length_grouping" and int(value or 0) <= 1)


def fingerprint(v: dict, cfg: dict, rt: Runtime, train_dir: str, eval_dir: str, target_dir: str,
                val_dir: str) -> str:
    """What a checkpoint must match to be resumed: the config this stage reads and the content
    of its inputs (a retrained target or recaptured features start afresh, at the same paths)."""
    v = {**v, "train": {k: x for k, x in v["train"].items() if not _trains_alike(k, x)}}
    key = {"variant": v, "seed": cfg["seed"], "dtype": rt.dtype,
           "drafters": {k: cfg["drafters"][k] for k in ("ttt_steps", "step_decay", "draft_vocab_size")},
           "train": content_digest(Path(train_dir) / "index.json"), "eval": content_digest(Path(eval_dir) / "index.json"),
           "target": folder_digest(target_dir), "val": content_digest(Path(val_dir) / "index.json")}
    if v["paradigm"] == "block":   # the block objective's position weights
        key["block_position_decay"] = cfg["drafters"].get("block_position_decay")
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


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
    if written_for != fp:
        print(f"{ckpt}: written for other inputs or config", flush=True)
        set_aside(ckpt, "stale")
        return None
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
