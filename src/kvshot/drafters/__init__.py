"""Drafter paradigms: one skeleton, three ways to read the target's context, and a
standalone draft model that reads none of it (the classic baseline)."""
from .hidden import HiddenDrafter
from .hybrid import HybridDrafter
from .kv import KVDrafter
from .skeleton import Drafter, DrafterConfig, load_drafter
from .standalone import StandaloneDrafter

PARADIGMS = {"hidden": HiddenDrafter, "kv": KVDrafter, "hybrid": HybridDrafter,
             "standalone": StandaloneDrafter}


def build_drafter(cfg: DrafterConfig) -> Drafter:
    return PARADIGMS[cfg.paradigm](cfg)


__all__ = ["PARADIGMS", "Drafter", "DrafterConfig", "build_drafter", "load_drafter"]
