"""Streaming safetensors shards: each sample's tensors go straight to their place in the file.

The capture stage knows every sample's length before its first forward, so each shard's
layout, and with it the safetensors header, is fixed up front. A sample is written with one
positioned write per tensor as soon as its batch is computed: nothing is buffered or
concatenated, so memory does not grow with `shard_tokens`, and each byte is copied once, from
the target's output to the file. The files are plain safetensors (`safe_open` reads them).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.uint8: "U8",
                torch.int8: "I8", torch.bool: "BOOL"}


def plan_shards(order: list[int], lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Cut the write order into shards; a shard closes once it holds at least shard_tokens tokens."""
    shards, current, tokens = [], [], 0
    for i in order:
        current.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


@dataclass
class _OpenShard:
    fd: int
    offsets: dict[str, int]        # where each tensor's data starts in the file
    row_bytes: dict[str, int]      # bytes per token of each tensor
    row_shape: dict[str, tuple]
    dtype: dict[str, torch.dtype]
    pending: set[int] = field(default_factory=set)


def _row_layout(rows: dict[str, Tensor], lead_dims: int) -> tuple[dict, dict, dict]:
    shapes = {k: tuple(v.shape[lead_dims:]) for k, v in rows.items()}
    dtypes = {k: v.dtype for k, v in rows.items()}
    row_bytes = {k: torch.Size(shapes[k]).numel() * v.element_size() for k, v in rows.items()}
    return shapes, dtypes, row_bytes


def _header(tokens: int, shapes: dict, dtypes: dict, row_bytes: dict) -> tuple[bytes, dict[str, int]]:
    # Widest elements first keeps every tensor aligned to its element size.
    names = sorted(shapes, key=lambda k: (-dtypes[k].itemsize, k))
    header, starts, pos = {}, {}, 0
    for k in names:
        if dtypes[k] not in _DTYPE_NAMES:
            raise TypeError(f"{k}: dtype {dtypes[k]} has no safetensors name")
        end = pos + tokens * row_bytes[k]
        header[k] = {"dtype": _DTYPE_NAMES[dtypes[k]], "shape": [tokens, *shapes[k]], "data_offsets": [pos, end]}
        starts[k], pos = pos, end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)      # data starts on an 8-byte boundary
    head = len(text).to_bytes(8, "little") + text
    return head, {k: len(head) + s for k, s in starts.items()}


def _numpy(t: Tensor) -> np.ndarray:
    """A numpy view (strides kept): per-sample slicing in numpy costs far less than in torch."""
    t = t.detach().to("cpu")
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class ShardWriter:
    """Write samples (token-major tensors under the same names) into planned shards.

    `order` fixes where each sample lands; samples added in that order are written as one
    run per tensor, but any order works. `close()` checks that every planned sample arrived.
    """

    def __init__(self, folder: str | Path, order: list[int], lengths: list[int], shard_tokens: int):
        self.folder = Path(folder)
        self.plan = plan_shards(order, lengths, shard_tokens)
        self.shards = [f"shard-{s:05d}.safetensors" for s in range(len(self.plan))]
        self.tokens = [sum(lengths[i] for i in p) for p in self.plan]
        self.locations: dict[int, list[int]] = {}
        for s, members in enumerate(self.plan):
            start = 0
            for i in members:
                self.locations[i] = [s, start, lengths[i]]
                start += lengths[i]
        self.bytes, self.bytes_by_name = 0, {}
        self._open: dict[int, _OpenShard] = {}
        self._done: set[int] = set()

    def add(self, sample_ids: list[int], rows: dict[str, Tensor], padded: bool = False) -> None:
        """Write samples' rows, packed back to back ([sum of their lengths, ...]) or, with `padded`,
        right-padded ([len(sample_ids), longest, ...]: sample j's rows are [j, :length_j]).

        Padded rows are written straight from the batch, strided ones (keys) by one small copy.
        """
        lengths = [self.locations[i][2] for i in sample_ids]
        lead = (len(sample_ids), max(lengths, default=0)) if padded else (sum(lengths),)
        arrays = {k: _numpy(t) for k, t in rows.items()}
        pos = 0
        for j, run in enumerate([[i] for i in sample_ids] if padded else self._runs(sample_ids)):
            s, start, _ = self.locations[run[0]]
            n = sum(self.locations[i][2] for i in run)
            shard = self._open.get(s) or self._start(s, rows, len(lead))
            self._check(s, shard, run, rows, lead)
            for k, a in arrays.items():
                if n:
                    data = np.ascontiguousarray(a[j, :n] if padded else a[pos: pos + n])
                    os.pwrite(shard.fd, data, shard.offsets[k] + start * shard.row_bytes[k])
                    self.bytes_by_name[k] = self.bytes_by_name.get(k, 0) + data.nbytes
                    self.bytes += data.nbytes
            pos += n
            shard.pending.difference_update(run)
            if not shard.pending:
                os.close(shard.fd)
                del self._open[s]
                self._done.add(s)

    def _runs(self, sample_ids: list[int]) -> list[list[int]]:
        """Split into runs that sit back to back in one shard: each run is one write per tensor."""
        runs: list[list[int]] = []
        for i in sample_ids:
            s, start, _ = self.locations[i]
            if runs:
                ps, pstart, pn = self.locations[runs[-1][-1]]
                if ps == s and pstart + pn == start:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        return runs

    def _check(self, s: int, shard: _OpenShard, run: list[int], rows: dict[str, Tensor], lead: tuple) -> None:
        where = f"{self.shards[s]}: samples {run[:3]}{'...' if len(run) > 3 else ''}"
        if twice := [i for i in run if i not in shard.pending]:
            raise ValueError(f"{self.shards[s]}: samples {twice[:3]} written twice")
        if set(rows) != set(shard.offsets):
            raise ValueError(f"{where} have tensors {sorted(rows)}, the shard holds {sorted(shard.offsets)}")
        for k, t in rows.items():
            if tuple(t.shape) != (*lead, *shard.row_shape[k]) or t.dtype != shard.dtype[k]:
                raise ValueError(f"{where} field {k} is {t.dtype} {tuple(t.shape)}, "
                                 f"expected {shard.dtype[k]} {(*lead, *shard.row_shape[k])}")

    def _start(self, s: int, rows: dict[str, Tensor], lead_dims: int) -> _OpenShard:
        if s in self._done:
            raise ValueError(f"{self.shards[s]}: shard already complete")
        shapes, dtypes, row_bytes = _row_layout(rows, lead_dims)
        head, offsets = _header(self.tokens[s], shapes, dtypes, row_bytes)
        fd = os.open(self.folder / self.shards[s], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, head)
        # Full size up front: a shard missing a sample is caught by close(), never read short.
        os.ftruncate(fd, len(head) + sum(self.tokens[s] * b for b in row_bytes.values()))
        shard = _OpenShard(fd, offsets, row_bytes, shapes, dtypes, set(self.plan[s]))
        self._open[s] = shard
        return shard

    def close(self) -> None:
        """Close every file; raise if a planned sample never arrived."""
        missing = sorted(i for sh in self._open.values() for i in sh.pending)
        missing += [i for s, p in enumerate(self.plan) if s not in self._done and s not in self._open for i in p]
        self._release()
        if missing:
            raise RuntimeError(f"{self.folder}: {len(missing)} samples never written (first: {missing[:5]})")

    def _release(self) -> None:
        for shard in self._open.values():
            os.close(shard.fd)
        self._open.clear()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:   # the caller's error stands; just release the files
            self._release()
