"""Write text lines into a file in an order given by a rank, with memory bounded by a bucket.

prepare_data streams conversations in source order but writes each split in the order of a
seeded permutation. Lines go to bucket files by rank (bucket b holds ranks [b*S, (b+1)*S)),
and the output is the buckets in turn, each sorted in memory: at most S lines are held.
The output appears only when complete (temp file, fsync, os.replace).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from kvshot.core.io import write_lines


def atomic_write(path: Path, lines: Iterable[str]) -> None:
    # io's one atomic writer: temp file beside `path`, fsync, rename, mode 0644
    write_lines(path, lines)


class RankedWriter:
    """`add(rank, line)` for ranks 0..count-1, each once; `close()` writes them in rank order.
    Lines must end with a newline and hold no other one (JSON lines)."""

    def __init__(self, path: str | Path, count: int, bucket_size: int = 4096, max_buckets: int = 256):
        self.path, self.count = Path(path), count
        self.bucket_size = max(bucket_size, -(-count // max_buckets))   # few enough open files
        self.dir = tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".buckets")
        self.files: dict[int, object] = {}
        self.added = 0

    def add(self, rank: int, line: str) -> None:
        if not 0 <= rank < self.count:
            raise ValueError(f"{self.path}: rank {rank} outside 0..{self.count - 1}")
        b = rank // self.bucket_size
        if b not in self.files:
            self.files[b] = open(os.path.join(self.dir, f"{b:05d}"), "w", encoding="utf-8", newline="\n")
        self.files[b].write(f"{rank}\t{line}")
        self.added += 1

    def _ordered(self):
        for b in range(-(-self.count // self.bucket_size)):
            with open(os.path.join(self.dir, f"{b:05d}"), encoding="utf-8", newline="\n") as fh:
                rows = [line.split("\t", 1) for line in fh]
            rows.sort(key=lambda row: int(row[0]))
            yield from (line for _, line in rows)
            del rows

    def close(self) -> None:
        """Write the file (all ranks must have been added), then drop the buckets."""
        try:
            for fh in self.files.values():
                fh.close()
            if self.added != self.count:
                raise ValueError(f"{self.path}: {self.added} lines added, {self.count} expected")
            atomic_write(self.path, self._ordered())
        finally:
            self.discard()

    def discard(self) -> None:
        for fh in self.files.values():
            try:
                fh.close()
            except OSError:   # a full disk fails the last flush: the buckets go anyway
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
