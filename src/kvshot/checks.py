"""What the schema cannot say: values valid alone but impossible together, or for the target.

Run when Snakemake starts (before any job) and when a stage starts by hand, so an impossible
config fails in one line naming the file and the field instead of after the stages above it
have rerun. The target's shape comes from `target.arch` (a pretrained-here target) or from the
pretrained model's `config.json` (a local folder, or the HF cache when it holds one); where
neither is at hand the shape-dependent checks wait for the stage that loads the target.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvshot.core.taps import default_aux_layers, reads_target_kv


@dataclass(frozen=True)
class TargetShape:
    layers: int
    heads: int
    kv_heads: int
    vocab: int | None   # None: known only once the tokenizer is trained


def _pretrained_config(name: str, revision: str | None) -> dict | None:
    local = Path(name) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json", revision=revision)
    except Exception:   # not a repo id, no cache: the target stage will say what is wrong
        return None
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None


def target_shape(cfg: dict) -> TargetShape | None:
    tgt = cfg.get("target")
    if tgt is None:
        return None
    if tgt["source"] == "pretrain":
        arch = tgt.get("arch", {})
        tok = cfg.get("tokenizer") or {}
        vocab = tok.get("vocab_size") if tok.get("source") == "train" else None
        return TargetShape(arch["num_hidden_layers"], arch["num_attention_heads"], arch["num_key_value_heads"], vocab)
    if tgt["source"] == "gguf":   # a file known by its checksum; any other waits for the target stage
        from kvshot.core.gguf import KNOWN_SHAPES

        c = KNOWN_SHAPES.get(tgt.get("gguf", {}).get("sha256"))
        return TargetShape(c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
                           c["vocab_size"]) if c else None
    try:
        c = _pretrained_config(tgt["name"], tgt.get("revision"))
    except (OSError, ValueError):
        return None
    if not c or "num_hidden_layers" not in c:
        return None
    return TargetShape(c["num_hidden_layers"], c["num_attention_heads"],
                       c.get("num_key_value_heads", c["num_attention_heads"]), c.get("vocab_size"))


def missing_local_path(name: str) -> bool:
    """True for a name that can only be a local path (absolute, ./, ../, ~, or more than one '/':
    a hub id is 'owner/name') and that does not exist."""
    if Path(name).expanduser().exists():
        return False
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


PARADIGM_FIELDS = {"context": "block", "block_size": "block", "position_decay": "block", "refine_passes": "block",
                   "kv_warmup_steps": "hybrid", "gate_shape": "hybrid", "gate_init": "hybrid",
                   "fc_norm": "hidden", "norm_before_fc": "hidden", "norm_output": "hidden"}


def all_variants(cfg: dict) -> list[tuple[list[str], dict]]:
    """(config path, entry) of every drafter variant: drafters.variants, then the block-wise
    target's blockwise.variants and blockwise.remedies, the drift target's drift.variants."""
    out = [(["drafters", "variants", str(i)], v) for i, v in enumerate((cfg.get("drafters") or {}).get("variants", []))]
    for key in ("variants", "remedies"):
        out += [(["blockwise", key, str(i)], v) for i, v in enumerate((cfg.get("blockwise") or {}).get(key) or [])]
    out += [(["drift", "variants", str(i)], v) for i, v in enumerate((cfg.get("drift") or {}).get("variants") or [])]
    return out


# what every member of a training group shares (one stream of batches: kvshot.train.group)
GROUP_SHARED = ("batch_size", "max_len", "length_grouping", "train_samples")


def training_groups(setting, names: list[str]) -> list[list[str]]:
    """The groups of `names` that train side by side (`setting`: drafters.group_training), each in
    the order of `names` and of two or more members (a group of one is a drafter alone): true puts
    all of `names` in one group; a list, each listed group's members among `names`."""
    listed = [list(names)] if setting is True else list(setting or [])
    groups = [[n for n in names if n in g] for g in listed]
    return [g for g in groups if len(g) > 1]


def stream_settings(tc: dict) -> tuple:
    """A train section's GROUP_SHARED values, length_grouping 0 when it groups nothing (0 or 1)."""
    grouping = int(tc.get("length_grouping") or 0)
    return tuple((grouping if grouping > 1 else 0) if k == "length_grouping" else tc.get(k) for k in GROUP_SHARED)


def _group_settings(cfg: dict, name: str) -> tuple:
    entry = next(v for _, v in all_variants(cfg) if v["name"] == name)
    return stream_settings({**cfg["drafters"]["train"], **(entry.get("train") or {})})


def check_groups(cfg: dict, fail: Callable[[list[str], str], None], partial: bool = False) -> None:
    """drafters.group_training: known names, each in one group, members that share a stream of batches.
    `partial`: a stage's view of the config (its own sections), which may leave out the sections
    that define some members (blockwise, drift): those are checked when the whole config is."""
    setting = cfg["drafters"].get("group_training")
    if not isinstance(setting, list):
        return
    known, seen = {v["name"] for _, v in all_variants(cfg)}, {}
    for i, group in enumerate(setting):
        path = ["drafters", "group_training", str(i)]
        if partial:
            group = [name for name in group if name in known]
        for name in group:
            if name not in known:
                fail(path, f"no variant named {name!r} (have {sorted(known)})")
            if name in seen:
                fail(path, f"{name!r} is also in group {seen[name]}: a drafter trains in one group")
            seen[name] = i
        settings = {name: _group_settings(cfg, name) for name in group}
        first = group[0] if group else None
        for name in group[1:]:
            if settings[name] != settings[first]:
                diff = [k for k, a, b in zip(GROUP_SHARED, settings[first], settings[name]) if a != b]
                fail(path, f"{first} and {name} differ in train.{', '.join(diff)}: a group reads one stream of batches")


def check_consistency(cfg: dict, fail: Callable[[list[str], str], None], partial: bool = False) -> None:
    """Call fail(path, problem) for the first impossible combination found. `partial`: the config
    holds only a stage's sections (`validate_config`'s `sections`)."""
    for section in ("target", "tokenizer"):
        part = cfg.get(section) or {}
        if part.get("source") == "pretrained" and part.get("name") and missing_local_path(part["name"]):
            fail([section, "name"], f"{part['name']} does not exist (a local path; a hub id is 'owner/name'): "
                 "fix the path, or download the model there")
    drafters, data, ev, scaling = cfg.get("drafters"), cfg.get("data"), cfg.get("eval"), cfg.get("scaling")
    if drafters is not None:
        seen: dict[str, str] = {}
        for path, v in all_variants(cfg):   # the block-wise target's variants share the name space
            if v["name"] in seen:
                fail(path + ["name"], f"{v['name']!r} is defined twice (also {seen[v['name']]}); names must be unique")
            seen[v["name"]] = ".".join(path)
            for key, paradigm in PARADIGM_FIELDS.items():   # a setting another paradigm would silently ignore
                if key in v and v["paradigm"] != paradigm:
                    fail(path + [key], f"a {paradigm} setting, and variant {v['name']} is {v['paradigm']}")
            if v.get("fc_norm") and v.get("norm_before_fc"):   # one norm per aux state, or one over them all
                fail(path + ["fc_norm"], "excludes norm_before_fc (per-state norms vs one norm over the "
                     "concatenation, EAGLE-3.1 uses fc_norm): set one")
        check_groups(cfg, fail, partial)
        tc = drafters["train"]
        if drafters["ttt_steps"] + 2 > tc["max_len"]:
            fail(["drafters", "ttt_steps"], f"{drafters['ttt_steps']} steps need sequences of at least "
                 f"{drafters['ttt_steps'] + 2} tokens (drafters.train.max_len is {tc['max_len']})")
        natural = (ev or {}).get("natural") or {}
        if natural.get("rollout_tokens", drafters["ttt_steps"] + 1) < drafters["ttt_steps"] + 1:
            # the stage that rolls the branches out reads only eval: the bound is checked here, on the whole config
            fail(["eval", "natural", "rollout_tokens"], f"{natural['rollout_tokens']} tokens per branch, the step-wise "
                 f"chain of drafters.ttt_steps = {drafters['ttt_steps']} needs K + 1 = {drafters['ttt_steps'] + 1}")
        samples = tc.get("train_samples") or (data or {}).get("train_samples")
        if samples is not None and tc["batch_size"] > samples:
            fail(["drafters", "train", "batch_size"],
                 f"{tc['batch_size']} is larger than the {samples} training samples (an epoch would hold no batch)")
        if scaling is not None:
            for i, n in enumerate(scaling["train_samples"]):
                if n < tc["batch_size"]:
                    fail(["scaling", "train_samples", str(i)], f"{n} samples hold no batch of {tc['batch_size']}")
                if data is not None and n > data["train_samples"]:
                    fail(["scaling", "train_samples", str(i)],
                         f"{n} is more than the {data['train_samples']} samples data.train_samples prepares")
    if ev is not None and data is not None and not ev.get("prompt_sources") and ev["prompts"] > data["eval_samples"]:
        fail(["eval", "prompts"], f"{ev['prompts']} prompts from {data['eval_samples']} eval samples "
             f"(raise data.eval_samples or lower eval.prompts)")
    if ev is not None and data is not None and ev["e2e"]["prompts"] > data["eval_samples"]:
        # one natural-protocol prefix per held-out conversation
        fail(["eval", "e2e", "prompts"], f"{ev['e2e']['prompts']} is more than the {data['eval_samples']} held-out "
             f"conversations (data.eval_samples) that hold its prefixes")
    shape = target_shape(cfg)
    if shape is not None:
        _check_target_fit(cfg, shape, fail)


def drift_name_problems(cfg: dict) -> list[tuple[list[str], str]]:
    """(field path, problem) for each `drift.compare` / `drift.blocks` name that is not a variant.
    Checked by the drift target itself (`kvshot drift-report`), not with every config: a run
    that overrides drafters.variants must not fail over an optional target it does not ask for."""
    drift, out = cfg.get("drift") or {}, []
    for key, section in (("compare", (cfg.get("drafters") or {}).get("variants") or []),
                         ("blocks", (cfg.get("blockwise") or {}).get("variants") or [])):
        names = {v["name"] for v in section}
        where = "drafters.variants" if key == "compare" else "blockwise.variants"
        out += [(["drift", key, str(i)], f"{name!r} is not a variant of {where} (have {sorted(names)})")
                for i, name in enumerate(drift.get(key) or []) if name not in names]
    return out


def _check_target_fit(cfg: dict, shape: TargetShape, fail: Callable[[list[str], str], None]) -> None:
    tgt, feats, drafters = cfg["target"], cfg.get("features"), cfg.get("drafters")
    L = shape.layers
    if tgt["source"] == "pretrain" and shape.heads % shape.kv_heads:
        fail(["target", "arch", "num_key_value_heads"],
             f"{shape.kv_heads} KV heads do not divide the {shape.heads} attention heads")
    kv_held = set(range(L))
    if feats is not None:
        aux = feats.get("aux_layers")
        if aux is not None:
            if any(not 0 < a <= L for a in aux):
                fail(["features", "aux_layers"], f"{list(aux)} outside 1..{L} for a {L}-layer target")
            if len(set(aux)) != len(aux):
                fail(["features", "aux_layers"], f"{list(aux)} repeats a layer")
        else:
            rule = feats["aux_rule"]
            aux = default_aux_layers(L, rule) if L >= 4 else ()
            if len(set(aux)) != 3 or L < 4:
                fail(["features", "aux_layers"], f"the {rule} default {aux} is not three distinct "
                     f"layers of a {L}-layer target: set them")
        if feats["kv_layers"] != "all":
            bad = [k for k in feats["kv_layers"] if k >= L]
            if bad:
                fail(["features", "kv_layers"], f"{bad} beyond the target's {L} layers (0..{L - 1})")
            kv_held = set(feats["kv_layers"])
    if drafters is None:
        return
    if shape.vocab is not None and drafters["draft_vocab_size"] > shape.vocab:
        fail(["drafters", "draft_vocab_size"], f"{drafters['draft_vocab_size']} is larger than the target's "
             f"vocabulary ({shape.vocab})")
    for path, v in all_variants(cfg):
        if not reads_target_kv(v["paradigm"], v.get("context")):
            continue
        if v["layers"] > L:
            fail(path + ["layers"], f"{v['layers']} KV layers for a {L}-layer target")
        own = v.get("kv_layers")
        layers = list(own) if own is not None else list(range(L - v["layers"], L))
        field = path + ["kv_layers"] if own is not None else ["features", "kv_layers"]
        if own is not None and len(own) != v["layers"]:
            fail(field, f"{len(own)} target layers for a {v['layers']}-layer drafter")
        missing = sorted(set(layers) - kv_held)
        if missing:
            fail(field, f"variant {v['name']} reads target layers {missing}, which the features do not hold")
