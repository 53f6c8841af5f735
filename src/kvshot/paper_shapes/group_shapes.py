"""A training group's step at the paper's shapes (`drafters.group_training`, `train.group`):
one online target forward for the rank's batch, then each member's step on it, as
`train.group.train_group` runs them, with every member resident (its weights, gradients or
DDP buckets, AdamW state) and one frozen copy of the target's embedding for the group."""
from __future__ import annotations

from kvshot.capture.features import open_features
from kvshot.checks import training_groups
from kvshot.paper_shapes.shape_rules import PaperShapes, Row
from kvshot.settings import Config


def variant_sets(cfg: Config) -> dict[str, list[str]]:
    """The variant sets a config trains, each by its own rules: the core drafters, the block-wise
    target's variants and gate remedies, the drift target's variants."""
    sets = {"drafters": [v.name for v in cfg.drafters.variants],
            "blockwise": [v.name for v in (cfg.blockwise.variants + (cfg.blockwise.remedies or ()))
                          if cfg.blockwise] if cfg.blockwise else [],
            "drift": [v.name for v in cfg.drift.variants] if cfg.drift else []}
    return {k: names for k, names in sets.items() if names}


def config_groups(cfg: Config) -> list[list[str]]:
    """Every group the config trains side by side (`checks.training_groups`, per variant set)."""
    return [g for names in variant_sets(cfg).values()
            for g in training_groups(cfg.drafters.group_training, names)]


def group_train_row(ps: PaperShapes, names: list[str]) -> Row:
    """train_drafter_group: one logging step per rank of the whole group (the batch live until
    the last member's step ends: a logging step without probe batches keeps it)."""
    rows: list[Row] = []
    tc = ps.cfg.drafters.train
    members = []
    for name in names:
        members.append(ps.member(name, embed_from=members[0].model if members else None))
    src = open_features(ps.folder, ps.rt, model=ps.target)
    src.read_only(sorted({l for m in members for l in m.model.cfg.kv_layers}),
                  any(m.model.reads_aux_hidden for m in members))
    head_w = ps.target.lm_head.weight.detach()
    with ps._measure(rows, "train_drafter_group", "+".join(names), "step", 1):
        batch = src.batch(list(range(tc.batch_size // ps.world)))   # one online target forward for all
        for m in members:
            ps.member_step(m, batch, head_w)
        del batch
    del members
    return rows[0]
