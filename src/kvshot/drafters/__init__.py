"""Drafter paradigms: one skeleton, three ways to read the target's context, a block-wise
drafter (one forward per block, the paper's proposed remedy), and a standalone draft model
that reads none of it (the classic baseline). The registry below is
the one place that names them: building and loading a drafter go through it."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from ..integrity import verify_folder
from .block import BlockDrafter
from .hidden import HiddenDrafter
from .hybrid import HybridDrafter
from .kv import KVDrafter
from .skeleton import Drafter, DrafterConfig
from .standalone import StandaloneDrafter

PARADIGMS = {"hidden": HiddenDrafter, "kv": KVDrafter, "hybrid": HybridDrafter,
             "standalone": StandaloneDrafter, "block": BlockDrafter}


def build_drafter(cfg: DrafterConfig) -> Drafter:
    return PARADIGMS[cfg.paradigm](cfg)


def load_drafter(folder: str | Path, device: str = "cpu") -> Drafter:
    """A drafter folder as `Drafter.save` writes it, checked against its manifest first."""
    folder = Path(folder)
    verify_folder(folder)   # a damaged weights file fails here, in one line naming it
    model = build_drafter(DrafterConfig.load(folder / "config.json"))
    model.load_state_dict(load_file(str(folder / "model.safetensors")))   # saved on the CPU, wherever trained
    return model.to(device)


__all__ = ["PARADIGMS", "Drafter", "DrafterConfig", "build_drafter", "load_drafter"]
