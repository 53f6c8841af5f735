"""The typed config: one frozen dataclass per schema object, built once from the filled config
(`Config.from_dict(read_config(...))`) and passed to the stages.

The schema (schema/config.schema.yaml) is the one place a field is described, validated and
given its default; these classes only name the fields and their types, so none has a default
here. A field the config leaves out and the schema gives no default is None: its consumer says
what that means (a variant's paradigm fields: the drafter format's defaults, DrafterConfig).
Lists become tuples and mappings these classes, so a stage cannot change the config it was
given; `dataclasses.replace` makes a changed copy. tests/unit/test_settings.py checks that the
fields here are the schema's, object by object.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Union


@dataclass(frozen=True)
class GGUFFile:
    package: str
    file: str
    sha256: str
    pip: str


@dataclass(frozen=True)
class HubRecords:
    """Where a `datasets` dataset's records come from (kvshot.data.sources.iter_hub_dataset)."""
    split: str | None
    schema: str | None              # the record layout
    data_files: str | tuple[str, ...] | None
    revision: str | None


@dataclass(frozen=True)
class DataSource(HubRecords):
    kind: str                       # sharegpt_package | sharegpt_file | hub
    path: str | None
    name: str | None
    max_records: int | None


@dataclass(frozen=True)
class RegenerateSettings:
    enabled: bool
    max_new_tokens: int
    batch_size: int
    temperature: float
    max_turns: int | None
    max_prompt_len: int


@dataclass(frozen=True)
class DataSettings:
    sources: tuple[DataSource, ...]
    train_samples: int
    eval_samples: int
    val_samples: int | None
    max_len: int
    regenerate: RegenerateSettings | None


@dataclass(frozen=True)
class Origin:
    """Where a tokenizer or target comes from: trained here, a hub id or folder, or a GGUF file."""
    source: str
    gguf: GGUFFile | None
    name: str | None
    revision: str | None


@dataclass(frozen=True)
class TokenizerSettings(Origin):
    vocab_size: int


@dataclass(frozen=True)
class ArchSettings:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool


@dataclass(frozen=True)
class PretrainSettings:
    block_size: int
    batch_size: int
    max_steps: int
    max_minutes: float
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    eval_blocks: int
    generations: int
    generation_tokens: int


@dataclass(frozen=True)
class TargetSettings(Origin):
    attn_implementation: str
    arch: ArchSettings | None
    pretrain: PretrainSettings | None


@dataclass(frozen=True)
class FeaturesSettings:
    mode: str                       # offline | online
    aux_rule: str
    aux_layers: tuple[int, ...] | None
    kv_layers: str | tuple[int, ...]   # "all" or target layers
    dtype: str
    shard_tokens: int
    batch_tokens: int
    max_len: int | None
    max_samples: int | None


@dataclass(frozen=True)
class PlateauRule:
    patience: int
    min_delta: float
    min_acc_delta: float


@dataclass(frozen=True)
class TrainSettings:
    batch_size: int
    max_len: int
    max_steps: int
    max_minutes: float
    stop_margin_minutes: float
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    log_every: int
    ckpt_every: int
    eval_batches: int
    diagnostic_sequences: int
    length_grouping: int
    eval_every: int
    eval_steps: tuple[int, ...]
    plateau: PlateauRule | None
    num_processes: int
    train_samples: int | None


def _overrides_of(cls, name: str, doc: str):
    """A frozen dataclass with `cls`'s fields, each optional (None: not overridden)."""
    out = dataclasses.make_dataclass(name, [(f.name, f"{f.type} | None") for f in dataclasses.fields(cls)],
                                     frozen=True)
    out.__module__, out.__doc__ = __name__, doc
    return out


# the schema's train_overrides: drafters.train's fields (one list: the schema's &train_fields)
TrainOverrides = _overrides_of(TrainSettings, "TrainOverrides",
                               "A variant's own drafters.train fields; None: drafters.train's (`merged_train`).")


@dataclass(frozen=True)
class VariantSettings:
    name: str
    paradigm: str                   # hidden | kv | hybrid | standalone | block
    context: str | None
    block_size: int | None
    position_decay: float | None
    refine_passes: int | None
    layers: int
    kv_layers: tuple[int, ...] | None
    intermediate_size: int | None
    gate_shape: str | None
    gate_init: float | None
    kv_warmup_steps: int | None
    head_init: str | None
    fc_norm: bool | None
    norm_before_fc: bool | None
    norm_output: bool | None
    norm_output_convention: str | None
    qk_norm: bool | None
    weights: str | None
    format: str | None
    aux_convention: str | None
    train: TrainOverrides | None


@dataclass(frozen=True)
class DraftersSettings:
    ttt_steps: int
    step_decay: float
    draft_vocab_size: int
    head_init: str
    seeds: tuple[int, ...] | None
    block_size: int | None
    block_position_decay: float | None
    attention: str
    train: TrainSettings
    group_training: bool | tuple[tuple[str, ...], ...] | None
    variants: tuple[VariantSettings, ...]


@dataclass(frozen=True)
class TreeSettings:
    depth: int
    topk: int
    total_tokens: int | None


@dataclass(frozen=True)
class BenchmarkSet(HubRecords):
    name: str
    kind: str                       # heldout | humaneval_package | hub
    dataset: str | None
    max_records: int | None


@dataclass(frozen=True)
class BenchmarksSettings:
    prompts: int
    max_new_tokens: int
    temperatures: tuple[float, ...]
    modes: tuple[str, ...]
    sets: tuple[BenchmarkSet, ...]


@dataclass(frozen=True)
class E2ESettings:
    prompts: int
    max_new_tokens: int
    warmup: int
    near_tie_ulps: float
    tree: TreeSettings
    benchmarks: BenchmarksSettings | None


@dataclass(frozen=True)
class NaturalSettings:
    anchors: int | None        # a cap; None: every candidate anchor
    max_prefix_len: int
    rollout_tokens: int
    batch_size: int


@dataclass(frozen=True)
class PromptSource(HubRecords):
    kind: str
    name: str


@dataclass(frozen=True)
class EvalSettings:
    e2e: E2ESettings
    prompts: int
    max_prompt_len: int
    max_new_tokens: int
    batch_size: int
    bootstrap_samples: int
    min_rounds: int
    min_sequences: int
    max_repetition: float
    context_buckets: tuple[int, ...]
    shared_target_pass: bool
    natural: NaturalSettings
    prompt_sources: tuple[PromptSource, ...] | None


@dataclass(frozen=True)
class BlockwiseSettings:
    variants: tuple[VariantSettings, ...]
    remedies: tuple[VariantSettings, ...] | None


@dataclass(frozen=True)
class DriftSettings:
    variants: tuple[VariantSettings, ...]
    compare: tuple[str, ...]
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class HeadDecoding:
    mode: str                       # chain | tree
    depth: int | None
    topk: int | None
    total_tokens: int | None
    max_new_tokens: int | None


@dataclass(frozen=True)
class PublishedHead:
    name: str
    repo: str
    revision: str
    format: str
    aux_convention: str | None
    decoding: HeadDecoding
    published: Mapping[str, Mapping[str, float]]   # temperature key -> benchmark -> tau
    source: str | None


@dataclass(frozen=True)
class PublishedSettings:
    tolerance: float
    heads: tuple[PublishedHead, ...]


@dataclass(frozen=True)
class PlateauSettings:
    max_steps: int
    eval_every: int
    rule: PlateauRule
    seeds: tuple[int, ...] | None


@dataclass(frozen=True)
class CurveSettings:
    variants: tuple[str, ...]
    tokens: int
    points: int
    train_samples: int | None
    max_minutes: float | None
    flat_gain: float
    target_acc: float
    seeds: tuple[int, ...] | None


@dataclass(frozen=True)
class ServeSettings:
    ks: tuple[int, ...]
    prompts: int | None
    max_new_tokens: int | None
    repeats: int
    prompt_lookup_tokens: int
    kv_cache_gib: float
    gpu_memory_fraction: float
    compile: bool


@dataclass(frozen=True)
class ScalingSettings:
    train_samples: tuple[int, ...]
    variants: tuple[str, ...]
    seeds: tuple[int, ...] | None


@dataclass(frozen=True)
class Config:
    """The whole config. A stage run by hand is given its own sections: the others are None."""
    seed: int
    device: str
    dtype: str
    threads: int
    numerics: str                   # portable | native (kvshot.core.numerics)
    data: DataSettings | None
    tokenizer: TokenizerSettings | None
    target: TargetSettings | None
    features: FeaturesSettings | None
    drafters: DraftersSettings | None
    eval: EvalSettings | None
    blockwise: BlockwiseSettings | None
    drift: DriftSettings | None
    published: PublishedSettings | None
    plateau: PlateauSettings | None
    scaling: ScalingSettings | None
    curve: CurveSettings | None
    serve: ServeSettings | None

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "Config":
        """The typed view of a validated config whose defaults the schema has filled."""
        return build(cls, cfg)

    def to_dict(self) -> dict:
        return to_dict(self)

    def all_variants(self) -> tuple[VariantSettings, ...]:
        """Every drafter variant: drafters.variants, then the block-wise target's blockwise.variants
        and blockwise.remedies, the drift target's drift.variants (kvshot.checks.all_variants' order)."""
        out = tuple(self.drafters.variants) if self.drafters else ()
        if self.blockwise:
            out += self.blockwise.variants + (self.blockwise.remedies or ())
        if self.drift:
            out += self.drift.variants
        return out


# ---------------------------------------------------------------- dict <-> dataclasses

def _members(tp) -> tuple:
    """The types a field may hold (`X | None` -> (X, NoneType))."""
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin in (Union, types.UnionType) else (tp,)


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def build(tp, value: Any, path: str = "config"):
    """`value` (parsed YAML/JSON) as type `tp`: a dataclass from a mapping, a tuple from a list."""
    if value is None:
        return None
    for member in _members(tp):
        if dataclasses.is_dataclass(member) and isinstance(value, Mapping):
            hints = _hints(member)
            unknown = set(value) - set(hints)
            if unknown:   # the schema refuses these first; a mismatch here is a bug in this file
                raise TypeError(f"{path}: {sorted(unknown)} have no field in {member.__name__}")
            return member(**{name: build(hints[name], value.get(name), f"{path}.{name}") for name in hints})
        if typing.get_origin(member) is tuple and isinstance(value, (list, tuple)):
            (item, *_) = typing.get_args(member)
            return tuple(build(item, v, f"{path}.{i}") for i, v in enumerate(value))
        if typing.get_origin(member) is Mapping and isinstance(value, Mapping):
            _, item = typing.get_args(member)
            return types.MappingProxyType({k: build(item, v, f"{path}.{k}") for k, v in value.items()})
    return value


def to_dict(value: Any) -> Any:
    """The config as plain data again (JSON-ready); a None field is left out."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_dict(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, tuple):
        return [to_dict(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_dict(v) for k, v in value.items()}
    return value
