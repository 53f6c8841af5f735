"""The models an evaluation stage loads, in one place: the target, the drafters (a list per
variant, one per training seed) in eval mode, and the target layers whose hidden states the
features were captured from (their `index.json`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvshot.config import Runtime
from kvshot.core.io import read_json
from kvshot.drafters import Drafter
from kvshot.settings import Config


@dataclass(frozen=True)
class EvalModels:
    target: object                   # the HF causal LM
    drafters: list[list[Drafter]]    # per variant, its seeds
    aux_layers: tuple[int, ...]

    def aux_for(self, drafters: list[Drafter]) -> tuple[int, ...] | None:
        """The aux layers for these drafters' decoding: None where they read no hidden states."""
        return self.aux_layers if drafters[0].reads_aux_hidden else None


def load_models(cfg: Config, rt: Runtime, target_dir: str | Path, groups: list[list[str]],
                features_index: str | Path) -> EvalModels:
    """Set the drafters' attention backend (drafters.attention), then load the target and every
    drafter folder of `groups` (sharing the target's input embedding)."""
    from kvshot.capture.target import load_target
    from kvshot.drafters import load_drafter
    from kvshot.drafters.attention import use_attention

    use_attention(cfg.drafters.attention)
    target = load_target(target_dir, rt, cfg.target.attn_implementation)
    embed = target.model.embed_tokens.weight
    drafters = [[load_drafter(d, rt.device, embed=embed).eval() for d in dirs] for dirs in groups]
    return EvalModels(target, drafters, tuple(read_json(features_index)["spec"]["aux_layers"]))
