"""Drafter paradigms: one skeleton, three ways to read the target's context."""
from .hidden import HiddenDrafter
from .hybrid import HybridDrafter
from .kv import KVDrafter
from .skeleton import Drafter, DrafterConfig, load_drafter

PARADIGMS = {"hidden": HiddenDrafter, "kv": KVDrafter, "hybrid": HybridDrafter}


def build_drafter(cfg: DrafterConfig) -> Drafter:
    return PARADIGMS[cfg.paradigm](cfg)


__all__ = ["PARADIGMS", "Drafter", "DrafterConfig", "build_drafter", "load_drafter"]
