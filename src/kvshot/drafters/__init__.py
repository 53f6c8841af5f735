"""Drafter paradigms: one skeleton, three ways to read the target's context, a block-wise
drafter (one forward per block, the paper's proposed remedy), and a standalone draft model
that reads none of it (the classic baseline). The registry below is
the one place that names them: building and loading a drafter go through it. `unroll` runs a
drafter over a batch, the one way training and evaluation both do."""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from torch import Tensor

from kvshot.core.integrity import verify_folder

from .block import BlockDrafter
from .hidden import HiddenDrafter
from .hybrid import HybridDrafter
from .kv import KVDrafter
from .skeleton import FROM_TARGET, Drafter, DrafterConfig
from .standalone import StandaloneDrafter

PARADIGMS = {"hidden": HiddenDrafter, "kv": KVDrafter, "hybrid": HybridDrafter,
             "standalone": StandaloneDrafter, "block": BlockDrafter}


def build_drafter(cfg: DrafterConfig) -> Drafter:
    return PARADIGMS[cfg.paradigm](cfg)


def load_drafter(folder: str | Path, device: str = "cpu", embed: Tensor | None = None,
                 need_embedding: bool = True) -> Drafter:
    """A drafter folder as `Drafter.save` writes it, checked against its manifest first. `embed`:
    the target's input embedding (`target.model.embed_tokens.weight`), which a drafter shares
    and its folder does not hold (`FROM_TARGET`); need_embedding=False leaves it unset, for a
    reader of the trained weights alone (export)."""
    folder = Path(folder)
    verify_folder(folder)   # a damaged weights file fails here, in one line naming it
    model = build_drafter(DrafterConfig.load(folder / "config.json"))
    state = load_file(str(folder / "model.safetensors"))   # saved on the CPU, wherever trained
    absent = [k for k in FROM_TARGET if k not in state]
    if absent and embed is None and need_embedding:
        raise ValueError(f"{folder}/model.safetensors: no {absent[0]} (a drafter shares its target's): "
                         f"load it with the target's embedding, load_drafter(..., embed=...)")
    model.load_state_dict(state, strict=False)
    unexpected = set(model.state_dict()) - set(state) - set(FROM_TARGET)
    if unexpected:   # strict for everything the folder should hold
        raise ValueError(f"{folder}/model.safetensors: missing {sorted(unexpected)[0]}")
    if absent and embed is not None:
        if tuple(embed.shape) != tuple(model.embed_tokens.weight.shape):
            raise ValueError(f"{folder}: the embedding given is {tuple(embed.shape)}, the drafter's is "
                             f"{tuple(model.embed_tokens.weight.shape)} (another target?)")
        model.embed_tokens.weight.data.copy_(embed.detach().to(model.embed_tokens.weight.dtype))
    return model.to(device)


__all__ = ["PARADIGMS", "Drafter", "DrafterConfig", "build_drafter", "load_drafter"]
