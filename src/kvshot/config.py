"""The pipeline config: merged, validated against the JSON schema, and filled with the schema's
defaults (`fill_defaults`), the only place a default lives; the stages take it typed
(`typed_config`: kvshot.settings.Config, frozen dataclasses).

The same schema checks the config when Snakemake starts (Snakefile) and when a
stage is run by hand (`python -m kvshot ...`), so bad config fails in one line
that names the file and the field.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from kvshot.core import numerics, taps

from .checks import check_consistency
from .settings import Config, FeaturesSettings

SECTIONS = ("data", "tokenizer", "target", "features", "drafters", "eval", "scaling", "curve", "serve")
GLOBALS = ("seed", "device", "dtype", "threads", "numerics")


class ConfigError(ValueError):
    """A config problem, always reported as one line: `<source>: <field>: <problem>`."""


def load_schema() -> dict:
    text = resources.files("kvshot").joinpath("schema", "config.schema.yaml").read_text()
    return yaml.safe_load(text)


def _field_path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) for p in error.absolute_path]
    if error.validator == "required":
        # jsonschema reports the missing key in the message only; put it in the path.
        missing = error.message.split("'")[1] if "'" in error.message else "?"
        parts.append(missing)
    return ".".join(parts) or "<top level>"


def _short_message(error: jsonschema.ValidationError) -> str:
    if error.validator == "required":
        return "missing required key"
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed ", "unknown key ")
    if error.validator == "oneOf":
        return f"{error.instance!r} is not valid here ({error.schema.get('description', 'see config.schema.yaml')})"
    return error.message


def _defines(spec: str, path: list[str]) -> bool:
    """Whether a config file (or inline JSON) sets the value at `path`."""
    try:
        node = json.loads(spec) if spec.lstrip().startswith("{") else yaml.safe_load(Path(spec).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return False
    return True


def blame(sources: list[str], path: list[str]) -> str:
    """The file a bad field comes from: the last one in merge order that sets it."""
    for spec in reversed(sources):
        if _defines(spec, path):
            return "<inline config>" if spec.lstrip().startswith("{") else spec
    return " + ".join("<inline config>" if s.lstrip().startswith("{") else s for s in sources)


def validate_config(cfg: Any, sources: str | list[str], sections: tuple[str, ...] | None = None) -> None:
    """Raise ConfigError for the first schema violation (deepest path first).

    `sources` are the config files in merge order; the error names the one that
    set the bad value (for a missing key: the one that set its parent)."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    source = " + ".join(sources)
    schema = load_schema()
    if sections is not None:
        # A stage sees only its own sections plus the globals.
        schema = copy.deepcopy(schema)
        schema["required"] = [k for k in schema["required"] if k in GLOBALS or k in sections]
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: <top level>: expected a mapping, got {type(cfg).__name__}")
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(cfg),
                    key=lambda e: (-len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        err = errors[0]
        path = [str(p) for p in err.absolute_path]
        raise ConfigError(f"{blame(sources, path)}: {_field_path(err)}: {_short_message(err)}")
    _check_semantics(cfg, source)  # mode-dependent checks name all files

    def fail(path: list[str], problem: str) -> None:
        raise ConfigError(f"{blame(sources, path)}: {'.'.join(path)}: {problem}")

    # an omitted field means the schema's default; a stage's sections alone are a partial view
    check_consistency(fill_defaults(copy.deepcopy(cfg)), fail, partial=sections is not None)


def _check_semantics(cfg: dict, source: str) -> None:
    """What the schema cannot say: fields required only in some modes."""
    tgt = cfg.get("target")
    if tgt is not None:
        if tgt["source"] == "pretrain":
            for key in ("arch", "pretrain"):
                if key not in tgt:
                    raise ConfigError(f"{source}: target.{key}: missing required key (target.source is 'pretrain')")
        elif tgt["source"] == "gguf":
            if "gguf" not in tgt:
                raise ConfigError(f"{source}: target.gguf: missing (target.source is 'gguf')")
        elif not tgt.get("name"):
            raise ConfigError(f"{source}: target.name: missing (target.source is 'pretrained')")
    tok = cfg.get("tokenizer")
    if tok is not None and tok["source"] == "pretrained" and not tok.get("name"):
        raise ConfigError(f"{source}: tokenizer.name: missing (tokenizer.source is 'pretrained')")
    if tok is not None and tok["source"] == "gguf" and "gguf" not in tok:
        raise ConfigError(f"{source}: tokenizer.gguf: missing (tokenizer.source is 'gguf')")
    if tgt is not None and tok is not None and tgt["source"] == "gguf" and tok.get("gguf") != tgt.get("gguf"):
        raise ConfigError(f"{source}: tokenizer.gguf: must name the target's GGUF file (target.gguf), "
                          f"with tokenizer.source 'gguf'")
    if "scaling" in cfg and "drafters" in cfg:
        names = {v["name"] for v in cfg["drafters"]["variants"]}
        for i, name in enumerate(cfg["scaling"]["variants"]):
            if name not in names:
                raise ConfigError(f"{source}: scaling.variants.{i}: {name!r} is not in drafters.variants")
    data = cfg.get("data")
    if data is not None:
        for i, src in enumerate(data["sources"]):
            need = {"sharegpt_file": ("path",), "hub": ("name", "split", "schema")}.get(src["kind"], ())
            for key in need:
                if key not in src:
                    raise ConfigError(f"{source}: data.sources.{i}.{key}: missing (kind is '{src['kind']}')")


def merge(base: dict, overlay: dict) -> dict:
    """Recursive dict merge, the same rule Snakemake applies to --configfile overlays."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_config(specs: list[str], sections: tuple[str, ...] | None = None) -> dict:
    """Merge config files (or inline JSON strings) in order and validate the result, filled with
    the schema's defaults (`typed_config` is the stages' typed view of it)."""
    cfg: dict = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                part = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"<inline config>: <top level>: not valid JSON ({exc.msg})") from None
        else:
            path = Path(spec)
            try:
                part = yaml.safe_load(path.read_text())
            except OSError as exc:
                raise ConfigError(f"{spec}: <file>: cannot read ({exc.strerror})") from None
            except yaml.YAMLError as exc:
                raise ConfigError(f"{spec}: <file>: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(part, dict):
            raise ConfigError(f"{spec}: <top level>: expected a mapping")
        cfg = merge(cfg, part)
    validate_config(cfg, specs, sections)
    return fill_defaults(cfg)


def typed_config(specs: list[str], sections: tuple[str, ...] | None = None) -> Config:
    """`read_config` as the typed config the stages take (kvshot.settings)."""
    return Config.from_dict(read_config(specs, sections))


def fill_defaults(cfg: dict, schema: dict | None = None) -> dict:
    """Set every optional field the config leaves out to the schema's `default` (in place;
    returns cfg): the schema, not the code, states what an omitted field means. Only objects the
    config has are filled (a missing optional section stays missing), array items included."""
    schema = load_schema() if schema is None else schema
    defs = schema.get("$defs", {})

    def resolve(node: dict) -> dict:
        ref = node.get("$ref", "")
        return defs[ref.rsplit("/", 1)[-1]] if ref.startswith("#/$defs/") else node

    def fill(value, node: dict) -> None:
        node = resolve(node)
        if node.get("x-fill-defaults") is False:   # overrides: an omitted field falls back elsewhere
            return
        if isinstance(value, list) and isinstance(node.get("items"), dict):
            for item in value:
                fill(item, node["items"])
        if not isinstance(value, dict):
            return
        for key, sub in (node.get("properties") or {}).items():
            sub = resolve(sub)
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                fill(value[key], sub)

    fill(cfg, schema)
    return cfg


BENCHMARKS_AXIS = "benchmarks"   # a pseudo-section: the stages that read eval.e2e.benchmarks name it


def stage_config(cfg: dict, *sections: str) -> dict:
    """The part of the config one stage depends on (what a rule passes as params). Without
    drafters.group_training: it shapes the DAG (which job trains which drafters), changes no
    drafter, and names variants of sections a stage may not get. Without eval.e2e.benchmarks
    unless `sections` names BENCHMARKS_AXIS: turning the axis on (its own target, e.g.
    config/smollm2-benchmarks.yaml) reruns no other evaluation."""
    out = {k: cfg[k] for k in (*GLOBALS, *sections) if k in cfg}
    if "group_training" in out.get("drafters", {}):
        out["drafters"] = {k: v for k, v in out["drafters"].items() if k != "group_training"}
    e2e = out.get("eval", {}).get("e2e", {})
    if BENCHMARKS_AXIS not in sections and "benchmarks" in e2e:
        out["eval"] = {**out["eval"], "e2e": {k: v for k, v in e2e.items() if k != "benchmarks"}}
    return out


# ---------------------------------------------------------------- runtime choices

@dataclass(frozen=True)
class Runtime:
    device: str
    dtype: str
    threads: int
    seed: int

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def autocast(self):
        """The drafters' compute precision (`drafter_autocast`) for this runtime."""
        return drafter_autocast(self.device, self.dtype)


def drafter_autocast(device: str, dtype: str):
    """Drafters keep fp32 parameters (and so fp32 optimizer state); a bfloat16 runtime runs
    their forward under bf16 autocast. float32 runs plain fp32, and so does float16: fp16
    autocast would need loss scaling, which the trainer does not do."""
    import contextlib

    import torch

    if dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def retain_freed_memory() -> bool:
    """Keep freed memory in glibc's heap instead of handing it back to the OS.

    Every batch of a CPU loop frees megabytes of activations that the next batch allocates
    again. By default glibc returns them (trim, per-size mmap), so each batch faults fresh
    zeroed pages back in; the capture forward, which keeps more alive per batch, spent ~10%
    of its time on that. Peak memory is unchanged (freed pages are reused, not added).
    A no-op off glibc; returns whether both settings took.
    """
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    # 32 MiB is glibc's largest mmap threshold; setting it also stops glibc's own adjustment.
    return bool(mallopt(m_trim_threshold, 1 << 30)) and bool(mallopt(m_mmap_threshold, 32 << 20))


def runtime(cfg: Config) -> Runtime:
    import torch

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config: device: 'cuda' requested but no CUDA device is available")
    dtype = cfg.dtype
    if dtype == "auto":
        # bf16 matmul on CPU is ~400x slower than fp32 here.
        dtype = "bfloat16" if device == "cuda" else "float32"
    torch.set_num_threads(int(cfg.threads))
    if device == "cpu":   # on CUDA a GPU's digits are its own (kvshot.core.numerics): the host's kernels go unchecked
        retain_freed_memory()
        numerics.check(cfg.numerics or "portable")
    print(numerics.kernels_line(int(cfg.threads)), flush=True)   # stdout: stderr holds only a failure's one line
    return Runtime(device=device, dtype=dtype, threads=int(cfg.threads), seed=int(cfg.seed))


@dataclass(frozen=True)
class FeatureSpec:
    """Which target activations a capture records."""

    aux_layers: tuple[int, ...]   # indices into HF `hidden_states` (0 = embeddings)
    kv_layers: tuple[int, ...]    # 0-based decoder layer indices
    dtype: str = "float32"


def default_aux_layers(num_layers: int, rule: str = "relative") -> tuple[int, int, int]:
    """taps.default_aux_layers, an unknown rule as a ConfigError."""
    try:
        return taps.default_aux_layers(num_layers, rule)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


eagle3_aux_layers = taps.eagle3_aux_layers


def feature_spec(features: FeaturesSettings, num_layers: int) -> FeatureSpec:
    aux = features.aux_layers
    aux = tuple(aux) if aux is not None else default_aux_layers(num_layers, features.aux_rule)
    if any(not 0 < a <= num_layers for a in aux):
        raise ConfigError(f"config: features.aux_layers: {list(aux)} outside 1..{num_layers} for a {num_layers}-layer target")
    if len(set(aux)) != 3:
        raise ConfigError(f"config: features.aux_layers: {list(aux)} are not three distinct layers "
                          f"(set them explicitly for a {num_layers}-layer target)")
    kv = features.kv_layers
    kv = tuple(range(num_layers)) if kv == "all" else tuple(kv)
    if any(not 0 <= k < num_layers for k in kv):
        raise ConfigError(f"config: features.kv_layers: {list(kv)} outside 0..{num_layers - 1}")
    return FeatureSpec(aux_layers=aux, kv_layers=kv, dtype=features.dtype)
