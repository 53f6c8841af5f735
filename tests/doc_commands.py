"""The `snakemake` and `python -m kvshot` commands of README.md and docs/*.md (issue 49), as the
reader would paste them: every fenced code block (backslash continuations joined, `&&`, `;` and
`|` split, comments and leading VAR=value assignments dropped) and every inline code span that
starts with one of the two. Used by tests/unit/test_doc_commands.py (each parses) and
tests/pipeline/test_doc_dry_runs.py (each snakemake command dry-runs)."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .conftest import REPO

DOCS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
PLACEHOLDER = "PLACEHOLDER"
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
WRITES = re.compile(r"printf '([^']*)' > (\S+\.ya?ml)")   # a config file the same block writes first

# Commands that these machines cannot run, or that are patterns rather than commands: parsed
# where they can be, never dry-run. Keyed by the command as written (placeholders as PLACEHOLDER).
NOT_DRY = {
    "--conda-create-envs-only": "builds conda envs: needs conda and the network, which the test machines lack",
    "--report": "renders the report of a finished run",
    "--unlock": "unlocks a working directory a killed Snakemake left locked",
}
NOT_PARSED = {
    "python -m kvshot PLACEHOLDER --help": "a pattern: <stage> stands for any stage name",
}
SDM = {"conda", "apptainer", "env-modules"}


@dataclass
class Command:
    doc: str
    line: int
    text: str                     # as written, placeholders replaced
    argv: list[str]               # after the program (`snakemake` or `python -m kvshot`)
    tool: str                     # "snakemake" or "kvshot"
    written: dict = field(default_factory=dict)   # yaml files the same block writes: name -> text

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _segments(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"\s(?:&&|\|\||;|\|)\s", text) if s.strip()]


def _command(doc: str, line: int, text: str, written: dict) -> Command | None:
    text = re.sub(r"<[^<>]+>", PLACEHOLDER, text)
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and ENV.match(words[0]):
        words = words[1:]
    if words[:1] == ["snakemake"]:
        return Command(doc, line, " ".join(words), words[1:], "snakemake", written)
    if words[:3] in (["python", "-m", "kvshot"], ["python3", "-m", "kvshot"]):
        return Command(doc, line, " ".join(["python", "-m", "kvshot", *words[3:]]), words[3:], "kvshot", written)
    return None


def commands(docs=DOCS) -> list[Command]:
    found = []
    for doc in docs:
        lines = (REPO / doc).read_text(encoding="utf-8").splitlines()
        fence, block = None, []
        for number, raw in enumerate(lines, 1):
            if raw.lstrip().startswith("```"):
                if fence is None:
                    fence, block = number, []
                else:
                    found += _block(doc, block)
                    fence = None
                continue
            if fence is not None:
                block.append((number, raw))
                continue
            for span in re.findall(r"`([^`]+)`", raw):
                for seg in _segments(span):
                    cmd = _command(doc, number, seg, {})
                    if cmd and not (cmd.tool == "kvshot" and len(cmd.argv) <= 1 and "--help" not in cmd.argv):
                        found.append(cmd)   # (a bare `python -m kvshot <stage>` in prose names a stage)
    return found


def _block(doc: str, block: list[tuple[int, str]]) -> list[Command]:
    joined, start, out = "", None, []
    logical = []
    for number, raw in block:
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        start = start or number
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        logical.append((start, joined + line))
        joined, start = "", None
    written = {name: text.encode().decode("unicode_escape") for _, t in logical for text, name in WRITES.findall(t)}
    for number, line in logical:
        for seg in _segments(line):
            cmd = _command(doc, number, seg, written)
            if cmd:
                out.append(cmd)
    return out


def parse_snakemake(cmd: Command):
    """Snakemake 9's own parser over the command; returns (namespace, problems)."""
    from snakemake.cli import get_argument_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = get_argument_parser().parse_args(cmd.argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            return None, []
        return None, [f"does not parse: {err.getvalue().strip().splitlines()[-1]}"]
    problems = []
    for value in args.configfile or []:
        name = str(value)
        if not name.endswith((".yaml", ".yml")):
            problems.append(f"--configfile reads {name!r} as a config file (a target after --configfile?)")
        elif not (REPO / name).is_file() and name not in cmd.written:
            problems.append(f"--configfile {name}: no such file")
    for profile in args.profile or []:
        if not (REPO / profile / "config.yaml").is_file():
            problems.append(f"--profile {profile}: no such profile")
    for method in args.software_deployment_method or []:
        if str(method).lower().replace("_", "-") not in SDM:
            problems.append(f"--sdm {method}: not a deployment method")
    return args, problems


def parse_kvshot(cmd: Command) -> list[str]:
    """kvshot's own CLI parser over the command."""
    from kvshot.__main__ import parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser().parse_args(cmd.argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return [f"does not parse: {err.getvalue().strip().splitlines()[-1]}"]
    return []


def not_dry(cmd: Command) -> str | None:
    """Why a snakemake command is not dry-run, or None."""
    return next((why for flag, why in NOT_DRY.items() if flag in cmd.argv), None)


def dry_run_groups(cmds: list[Command]) -> dict[tuple, dict]:
    """One dry run per distinct (config files, profile): the union of the targets of its commands
    (no target: the default, `all`), with the commands it stands for."""
    groups: dict[tuple, dict] = {}
    for cmd in cmds:
        if cmd.tool != "snakemake" or not_dry(cmd):
            continue
        args, problems = parse_snakemake(cmd)
        if args is None or problems:
            continue
        key = (tuple(str(c) for c in args.configfile or []), tuple(args.profile or []))
        group = groups.setdefault(key, {"targets": [], "commands": [], "written": {}})
        for target in (args.targets or ["all"]):
            if target not in group["targets"]:
                group["targets"].append(target)
        group["commands"].append(str(cmd))
        group["written"].update(cmd.written)
    return groups


def dry_run_argv(key: tuple, targets: list[str]) -> list[str]:
    configfiles, profiles = key
    return ["-n", *targets, "--cores", "1", *[a for p in profiles for a in ("--profile", p)],
            *(["--configfile", *configfiles] if configfiles else [])]


def job_count(output: str) -> int | None:
    m = re.search(r"^total\s+(\d+)$", output, re.M)
    return int(m.group(1)) if m else (0 if "Nothing to be done" in output else None)


def written_files(workdir: Path, written: dict) -> None:
    for name, text in written.items():
        (workdir / name).write_text(text)
