"""Checksums for what the pipeline stores and reads back: feature shards, target and drafter
weights. A damaged file (truncated, zeroed, bit-flipped) fails in one line naming it, instead
of loading and training on garbage.

A folder's `checksums.json` maps each file (relative path) to its size and SHA-256. Readers
check the size at once (free) and the hash once per file and process: in full before weights
are used, and for a feature shard the first time it is opened.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvshot.core.io import DataError

MANIFEST = "checksums.json"
_CHUNK = 8 << 20
_verified: set[tuple] = set()   # files (path, digest, stat) already hashed by this process


class IntegrityError(DataError):
    """A stored file does not match its recorded checksum (one line, naming the file)."""


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: str | Path) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": file_digest(path)}


def write_manifest(folder: str | Path, names: list[str] | None = None) -> dict:
    """Record every file of `folder` (or `names`, relative paths) in its checksums.json."""
    folder = Path(folder)
    if names is None:
        names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    records = {name: file_record(folder / name) for name in names}
    (folder / MANIFEST).write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
    return records


def verify_file(path: str | Path, record: dict) -> None:
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise IntegrityError(f"{path}: cannot read ({exc.strerror}); rerun the stage that writes it") from None
    size = st.st_size
    key = (str(path.resolve()), record["sha256"], st.st_ino, size, st.st_mtime_ns)   # rewritten files: hashed again
    if key in _verified:
        return
    if size != record["bytes"]:
        raise IntegrityError(f"{path}: {size} bytes where {record['bytes']} were written (truncated or "
                             f"overwritten); delete it and rerun the stage that writes it")
    if file_digest(path) != record["sha256"]:
        raise IntegrityError(f"{path}: checksum mismatch (the file is damaged); delete it and rerun the stage "
                             f"that writes it")
    _verified.add(key)


def verify_folder(folder: str | Path, required: bool = False) -> dict | None:
    """Check every file listed in the folder's checksums.json. Folders written before checksums
    existed have none: then nothing is checked, unless `required`."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if required:
            raise IntegrityError(f"{manifest}: missing; rerun the stage that writes {folder}")
        return None
    try:
        records = json.loads(manifest.read_text())
    except ValueError:
        raise IntegrityError(f"{manifest}: not valid JSON (damaged); rerun the stage that writes {folder}") from None
    for name, record in records.items():
        verify_file(folder / name, record)
    return records


def manifest_digest(folder: str | Path) -> str | None:
    """A short digest of a folder's checksums.json: changes whenever any recorded file does."""
    manifest = Path(folder) / MANIFEST
    return hashlib.sha256(manifest.read_bytes()).hexdigest()[:16] if manifest.is_file() else None


def content_digest(path: str | Path) -> str:
    """A short digest of one (small) file's bytes, e.g. a feature index that lists its shards."""
    return file_digest(path)[:16]


def folder_digest(folder: str | Path) -> str:
    """A short digest of a folder's content: its checksums.json when it has one, else every
    file hashed (a folder written before checksums existed)."""
    folder = Path(folder)
    recorded = manifest_digest(folder)
    if recorded is not None:
        return recorded
    h = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(folder)}\0{file_digest(p)}\n".encode())
    return h.hexdigest()[:16]
