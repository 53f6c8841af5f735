"""The pins in envs/*.yaml agree with pyproject.toml."""
from __future__ import annotations

import re
import tomllib

import yaml

from .conftest import REPO


def _pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(==|>=)\s*([^\s;#]+)", line)
        if m:
            out[m.group(1).lower()] = m.group(2) + m.group(3)
    return out


def test_env_pins_match_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = _pins(project["dependencies"])
    for orchestrator in ("snakemake", "snakemake-executor-plugin-slurm"):   # runs outside the job envs
        wanted.pop(orchestrator)
    for env in sorted((REPO / "envs").glob("*.yaml")):
        deps = yaml.safe_load(env.read_text())["dependencies"]
        pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
        pins = _pins(pip)
        for name, pin in wanted.items():
            assert pins.get(name) == pin, f"{env.name}: {name} pinned {pins.get(name)}, pyproject says {pin}"
