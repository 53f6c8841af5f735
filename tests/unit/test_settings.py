"""The typed config (kvshot.settings) names exactly the schema's fields, and every shipped
config reads into it and back unchanged."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from kvshot import settings
from kvshot.config import load_schema, read_config
from kvshot.settings import Config

REPO = Path(__file__).resolve().parents[2]


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref", "")
    if ref.startswith("#/$defs/"):
        return _resolve(schema, schema["$defs"][ref.rsplit("/", 1)[-1]])
    if ref.startswith("#/properties/"):
        out = schema
        for key in ref[2:].split("/"):
            out = out[key]
        return _resolve(schema, out)
    if "allOf" in node:   # blockwise/drift variants: drafters' variant entries with a fixed paradigm
        return _resolve(schema, node["allOf"][0])
    return node


def _object_of(schema: dict, node: dict) -> dict | None:
    """The object schema a field holds: itself, its array's items, or a oneOf member."""
    node = _resolve(schema, node)
    if "properties" in node:
        return node
    if isinstance(node.get("items"), dict):
        return _object_of(schema, node["items"])
    for option in node.get("oneOf", []):
        found = _object_of(schema, option)
        if found is not None:
            return found
    return None


def _dataclass_of(tp):
    for member in typing.get_args(tp) or (tp,):
        if dataclasses.is_dataclass(member):
            return member
        for inner in typing.get_args(member):
            if dataclasses.is_dataclass(inner):
                return inner
    return None


def _pairs(schema: dict, node: dict, cls, path: str):
    yield path, node, cls
    hints = typing.get_type_hints(cls)
    for name, sub in node["properties"].items():
        obj = _object_of(schema, sub)
        sub_cls = _dataclass_of(hints.get(name))
        if obj is not None and sub_cls is not None:
            yield from _pairs(schema, obj, sub_cls, f"{path}.{name}")


def test_every_schema_object_has_a_dataclass_with_its_fields():
    schema = load_schema()
    pairs = list(_pairs(schema, schema, Config, "config"))
    for path, node, cls in pairs:
        fields = [f.name for f in dataclasses.fields(cls)]
        assert sorted(fields) == sorted(node["properties"]), (path, cls.__name__)
        assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in dataclasses.fields(cls)), f"{cls.__name__}: a default belongs in the schema"
    # every dataclass of the module is reached from Config through the schema
    reached = {cls for _, _, cls in pairs}
    reached |= {base for cls in reached for base in cls.__mro__[1:] if dataclasses.is_dataclass(base)}
    declared = {c for c in vars(settings).values() if dataclasses.is_dataclass(c) and c.__module__ == settings.__name__}
    assert declared == reached, sorted(c.__name__ for c in declared ^ reached)


@pytest.mark.parametrize("overlay", [None, "smoke.yaml", "smollm2.yaml", "one-gpu.yaml", "paper.yaml"])
def test_shipped_configs_read_into_the_dataclasses_and_back(overlay):
    specs = [str(REPO / "config/config.yaml")] + ([str(REPO / "config" / overlay)] if overlay else [])
    cfg = read_config(specs)
    typed = Config.from_dict(cfg)
    assert isinstance(typed.drafters.variants[0], settings.VariantSettings)
    assert isinstance(typed.drafters.train, settings.TrainSettings)

    def no_none(x):
        if isinstance(x, dict):
            return {k: no_none(v) for k, v in x.items() if v is not None}
        if isinstance(x, list):
            return [no_none(v) for v in x]
        return x

    assert typed.to_dict() == no_none(cfg)


def test_the_typed_config_cannot_be_changed():
    cfg = Config.from_dict(read_config([str(REPO / "config/config.yaml")]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.drafters.train.lr = 1.0
    assert isinstance(cfg.drafters.variants, tuple) and isinstance(cfg.eval.context_buckets, tuple)
    changed = dataclasses.replace(cfg, seed=cfg.seed + 1)
    assert changed.seed == cfg.seed + 1 and changed.drafters is cfg.drafters


def test_a_field_the_dataclasses_do_not_know_is_an_error():
    cfg = read_config([str(REPO / "config/config.yaml")])
    cfg["drafters"]["train"]["not_a_field"] = 1   # past the schema only by a bug
    with pytest.raises(TypeError, match="config.drafters.train: \\['not_a_field'\\]"):
        Config.from_dict(cfg)


def test_published_figures_read_as_a_mapping():
    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])
    typed = Config.from_dict(cfg)
    head = typed.published.heads[0]
    assert dict(head.published) == cfg["published"]["heads"][0]["published"]
    assert yaml.safe_dump(typed.to_dict())   # plain data again


# builds a rule's params for Snakemake (common.smk), whose config is plain data
PLAIN_CONFIG = {("head_stage.py", "head_stage_config")}
STAGE_PACKAGES = ("data", "capture", "drafters", "train", "evaluate", "interop", "serve", "paper_shapes", "report")


def test_the_stages_take_the_typed_config():
    """Past the schema, no stage reads the config as a dict: a function's `cfg` parameter is the
    typed Config (or a drafter's DrafterConfig), and no `cfg[...]` or `cfg.get(...)` is left in
    the stage packages."""
    import ast

    package = REPO / "src" / "kvshot"
    untyped, indexed = [], []
    for path in (p for name in STAGE_PACKAGES for p in (package / name).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (path.name, node.name) not in PLAIN_CONFIG:
                for arg in node.args.args + node.args.kwonlyargs:
                    # `cfg`: the typed config, or a drafter's own model config
                    if arg.arg == "cfg" and (arg.annotation is None
                                             or ast.unparse(arg.annotation) not in ("Config", "DrafterConfig")):
                        untyped.append(f"{path.name}:{node.lineno} {node.name}")
                for inner in ast.walk(node):
                    reads = (isinstance(inner, ast.Subscript) and ast.unparse(inner.value) == "cfg") or (
                        isinstance(inner, ast.Call) and ast.unparse(inner.func) == "cfg.get")
                    if reads and (path.name, node.name) not in PLAIN_CONFIG:
                        indexed.append(f"{path.name}:{inner.lineno} {node.name}")
    assert untyped == [] and indexed == []
    # the scan sees the one function allowed plain data
    published = ast.parse((package / "interop" / "head_stage.py").read_text())
    assert any(isinstance(n, ast.Subscript) and ast.unparse(n.value) == "cfg" for n in ast.walk(published))
