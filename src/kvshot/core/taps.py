"""Which target layers the hidden-state drafters read: EAGLE-3's low, middle and high taps,
as indices into HF `hidden_states` (0 = embeddings, L = the final-norm output)."""
from __future__ import annotations

EAGLE3_DEPTH, EAGLE3_HIGH = 36, 33   # Qwen3-8B: EAGLE-3's high tap is hidden_states[33] of 36 layers
AUX_RULES = ("relative", "eagle3")


def reads_target_kv(paradigm: str, block_context: str | None = None) -> bool:
    """Whether a drafter reads the target's KV cache (its kv_layers): KV-only, hybrid, and a block
    drafter with KV context (the default); hidden and DFlash blocks read aux hidden states instead."""
    return paradigm in ("kv", "hybrid") or (paradigm == "block" and (block_context or "kv") == "kv")


def eagle3_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/middle/high taps: inputs of layers 2, L//2 and L-3, i.e. HF
    `hidden_states[2]`, `[L//2]`, `[L-3]` (outputs of layers 1, L//2-1, L-4)."""
    return (2, num_layers // 2, num_layers - 3)


def default_aux_layers(num_layers: int, rule: str = "relative") -> tuple[int, int, int]:
    """The aux taps when features.aux_layers is null. `eagle3`: (2, L//2, L-3) as EAGLE-3 sets
    them. `relative` (default): the same low and middle taps, and the high tap at the relative
    depth EAGLE-3 gives it on a 36-layer model, round(33 L / 36), at most L - 1 (hidden_states[L]
    is the final-norm output). Both give Qwen3-8B's (2, 18, 33); on shallow targets L-3 sits far
    below the top (8 layers: 5 of 8 against 33 of 36), and `relative` gives 7.
    An unknown rule is a ValueError naming the field (config.feature_spec makes it a ConfigError)."""
    if rule == "eagle3":
        return eagle3_aux_layers(num_layers)
    if rule != "relative":
        raise ValueError(f"config: features.aux_rule: {rule!r}, expected one of {list(AUX_RULES)}")
    high = min(num_layers - 1, round(EAGLE3_HIGH * num_layers / EAGLE3_DEPTH))
    return (2, num_layers // 2, high)
