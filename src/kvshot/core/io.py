"""Atomic outputs: a killed job leaves the old file or nothing, never half a file."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator


class DataError(Exception):
    """A whole input (file, dataset, split) is unusable; the message is one line."""


def _finite(obj):
    """NaN/inf are not JSON: an undefined metric (e.g. alpha of a step no round reached) is null."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def link_tree(src: str | Path, dst: str | Path) -> None:
    """`dst` becomes a tree of hard links to src's files (a copy where the filesystem has none),
    atomically (`atomic_dir`)."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: no such folder")
    with atomic_dir(dst) as tmp:
        for f in sorted(src.rglob("*")):
            to = tmp / f.relative_to(src)
            if f.is_dir():
                to.mkdir(parents=True, exist_ok=True)
                continue
            to.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, to)
            except OSError:
                shutil.copy2(f, to)


def remove_leftovers(path: str | Path) -> list[Path]:
    """Scratch files and folders a killed writer of `path` left beside it (`.{name}.*.tmp`).
    One job writes one output, so any found when that job starts again are dead."""
    path = Path(path)
    gone = []
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        gone.append(stale)
    if gone:
        print(f"removed {len(gone)} leftover scratch path(s) of {path} from a killed run", flush=True)
    return gone


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a scratch file name beside `path`; it becomes `path` (mode 0644) only if the block
    succeeds. The one atomic-file writer: text, JSON lines, figures (`savefig(tmp, format=...)`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_lines(path: str | Path, lines: Iterable[str]) -> None:
    """Stream `lines` (each with its newline) into `path` atomically, synced before the rename."""
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(lines)
            fh.flush()
            os.fsync(fh.fileno())


def write_text(path: str | Path, text: str) -> None:
    write_lines(path, [text])


# Past this size a JSON file is data for programs (per-anchor panels), not for reading: written
# compact by the C encoder; indent=2 takes the pure-Python one (~10x slower on 30k-anchor panels).
INDENT_MAX_CHARS = 1_000_000


def json_text(obj) -> str:
    """`obj` as JSON, NaN/inf as null (`_finite`), indented unless past INDENT_MAX_CHARS."""
    try:   # most records hold no NaN: the C encoder checks that in one pass
        compact = json.dumps(obj, allow_nan=False)
    except ValueError:
        obj = _finite(obj)
        compact = json.dumps(obj, allow_nan=False)
    return compact if len(compact) > INDENT_MAX_CHARS else json.dumps(obj, indent=2, allow_nan=False)


def write_json(path: str | Path, obj) -> None:
    write_text(path, json_text(obj) + "\n")


def temperature_key(t: float) -> str:
    """The key of one sampling temperature in benchmarks.json (written by evaluate.benchmarks,
    read by report.published)."""
    return f"T={t:g}"


def read_json(path: str | Path):
    with open(path) as fh:
        return json.load(fh)


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a scratch folder beside `path`; it becomes `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, 0o644)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class JsonLines:
    """The live training log: one JSON record per line, flushed as training goes (`tail -f`);
    rewritten from the checkpoint's records on resume, so it never holds steps that were undone."""

    def __init__(self, path: Path, records: list[dict], enabled: bool = True):
        self.path, self.enabled = path, enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in records)

    def append(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
