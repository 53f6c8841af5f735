"""A training group's step at the paper's shapes (`drafters.group_training`, `train.group`):
one online target forward for the rank's batch, then each member's step on it, as
`train.group.train_group` runs them, with every member resident (its weights, gradients or
DDP buckets, AdamW state) and one frozen copy of the target's embedding for the group."""
from __future__ import annotations

from kvshot.capture.features import open_features
from kvshot.checks import all_variants, training_groups
from kvshot.paper_shapes.shape_rules import PaperShapes, Row


def variant_sets(cfg: dict) -> dict[str, list[str]]:
    """The variant sets a config trains, each by its own rules: the core drafters, the block-wise
    target's variants and gate remedies, the drift target's variants."""
    sets: dict[str, list[str]] = {"drafters": [], "blockwise": [], "drift": []}
    for path, v in all_variants(cfg):
        sets[path[0]].append(v["name"])
    return {k: names for k, names in sets.items() if names}


def config_groups(cfg: dict) -> list[list[str]]:
    """Every group the config trains side by side (`checks.training_groups`, per variant set)."""
    return [g for names in variant_sets(cfg).values() for g in training_groups(cfg, names)]


def group_train_row(ps: PaperShapes, names: list[str]) -> Row:
    """train_drafter_group: one logging step per rank of the whole group (the batch live until
    the last member's step ends: a logging step without probe batches keeps it)."""
    rows: list[Row] = []
    tc = ps.cfg["drafters"]["train"]
    members = []
    for name in names:
        members.append(ps.member(name, embed_from=members[0].model if members else None))
    src = open_features(ps.folder, ps.rt, model=ps.target)
    src.read_only(sorted({l for m in members for l in m.model.cfg.kv_layers}),
                  any(m.model.reads_aux_hidden for m in members))
    head_w = ps.target.lm_head.weight.detach()
    with ps._measure(rows, "train_drafter_group", "+".join(names), "step", 1):
        batch = src.batch(list(range(tc["batch_size"] // ps.world)))   # one online target forward for all
        for m in members:
            ps.member_step(m, batch, head_w)
        del batch
    del members
    return rows[0]
