"""The data split: duplicates found on normalised text (`conversation_key`), a seeded
permutation of the unique records cut into eval, val and train, and `prepare_data`, the stage
that writes the three splits from the sources (kvshot.data.sources) in two streaming passes."""
from __future__ import annotations

import hashlib
import json
import random
import sys
import unicodedata
from array import array
from pathlib import Path
from typing import Sequence

from kvshot.core.io import DataError
from kvshot.core.ranked_writer import RankedWriter, atomic_write
from kvshot.data.sources import LoadStats, iter_sources
from kvshot.settings import DataSource


# Invisible characters that make copies of one text differ byte-wise (zero-width space / joiners,
# word joiner, byte order mark, soft hyphen); NFKC keeps them.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"))


def normalize_text(text: str) -> str:
    """The text duplicates are compared on: NFKC, casefolded, invisible characters dropped,
    every whitespace run one space, ends stripped. Punctuation stays (it can change meaning)."""
    return " ".join(unicodedata.normalize("NFKC", text).translate(_INVISIBLE).casefold().split())


def conversation_key(messages: list[dict]) -> int:
    """A signed 64-bit hash of the role-tagged normalized turns: equal for exact and near-exact
    copies (case, spacing, Unicode forms). 8 bytes per record; a false match among a million
    records has odds of about 3e-8."""
    h = hashlib.blake2b(digest_size=8)
    for m in messages:
        h.update(f"{m['role']}\x1f{normalize_text(m['content'])}\x1e".encode("utf-8"))
    return int.from_bytes(h.digest(), "little", signed=True)


def first_occurrences(keys):
    """A boolean mask over `keys`: True at the first record with each key (later ones are duplicates)."""
    import numpy as np

    keys = np.asarray(keys, dtype=np.int64)
    keep = np.zeros(len(keys), dtype=bool)
    keep[np.unique(keys, return_index=True)[1]] = True   # return_index: each key's first index
    return keep


def dedup_conversations(convs: list) -> tuple[list, int]:
    """(the conversations without near-exact copies, in order; how many were removed), in memory:
    the reference for prepare_data's streaming pass. Items are message lists or {"messages": ...}."""
    seen: set[int] = set()
    unique = []
    for conv in convs:
        key = conversation_key(conv["messages"] if isinstance(conv, dict) else conv)
        if key not in seen:
            seen.add(key)
            unique.append(conv)
    return unique, len(convs) - len(unique)


SPLIT_NAMES = ("eval", "val", "train")   # in the order they take the seeded permutation's records


def _split_sizes(available: int, train_samples: int, eval_samples: int, val_samples: int) -> dict[str, int]:
    # A short supply shrinks train instead of failing: small smoke configs still run.
    n_eval = min(eval_samples, available)
    n_val = min(val_samples, available - n_eval)
    n_train = min(train_samples, available - n_eval - n_val)
    if not n_eval or not n_train or not n_val:
        raise DataError(f"split: {available} conversations give {n_train} train / {n_eval} eval / {n_val} val "
                        f"(asked {train_samples} / {eval_samples} / {val_samples})")
    return {"eval": n_eval, "train": n_train, "val": n_val}


def split_order(n: int, seed: int) -> list[int]:
    """The seeded permutation of n records: eval takes its first eval_samples, val (the drafter
    trainer's held-out curve and plateau stop) the next val_samples, train the next train_samples.
    Train comes last, so a smaller train split is a prefix of a larger one and eval and val do not move."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def split_bounds(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each split's [start, end) in the permutation (SPLIT_NAMES order)."""
    bounds, start = {}, 0
    for name in SPLIT_NAMES:
        bounds[name] = (start, start + sizes[name])
        start += sizes[name]
    return bounds


def split_conversations(convs: list, train_samples: int, eval_samples: int, seed: int,
                        val_samples: int | None = None) -> dict[str, list]:
    """{"train", "eval", "val": conversations} in memory (val_samples None: as many as eval),
    the reference for prepare_data's streaming split."""
    val_samples = eval_samples if val_samples is None else val_samples
    bounds = split_bounds(_split_sizes(len(convs), train_samples, eval_samples, val_samples))
    order = split_order(len(convs), seed)
    return {name: [convs[i] for i in order[a:b]] for name, (a, b) in bounds.items()}


def prepare_data(sources: Sequence[DataSource], train_samples: int, eval_samples: int, seed: int,
                 out_dir: str | Path, min_assistant_chars: int = 1, val_samples: int | None = None) -> dict:
    """Filter, deduplicate, split and write train.jsonl / eval.jsonl / val.jsonl / stats.json
    into out_dir, streaming. val_samples: the validation split the drafter trainer's held-out
    curve and plateau stop read (None: as many as eval), so that no evaluation anchor steers training.

    Pass 1 reads the sources and keeps a 64-bit key per usable record (`conversation_key`);
    a record whose key an earlier one (of any source) had is a duplicate, dropped before the
    split so that train, eval and val share no conversation. The split is `split_conversations`'
    seeded permutation of the unique records (ranks: N small ints); pass 2 reads the sources
    again and hands each unique record to its split's RankedWriter, which writes the split in
    permutation order. Memory: 8-byte keys, a mask and ranks, not the conversations."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    val_samples = eval_samples if val_samples is None else val_samples

    def long_enough(messages: list[dict]) -> bool:
        return sum(len(m["content"].strip()) for m in messages if m["role"] == "assistant") >= min_assistant_chars

    stats_list: list[LoadStats] = []
    read = 0
    keys, source_of = array("q"), array("I")   # per usable record: its key and its source
    for index, _, messages in iter_sources(sources, stats_list):
        read += 1
        if long_enough(messages):
            keys.append(conversation_key(messages))
            source_of.append(index)
    usable = len(keys)
    keep = first_occurrences(keys)
    del keys
    for record in (~keep).nonzero()[0]:
        stats_list[source_of[record]].duplicates_removed += 1
    del source_of
    available = int(keep.sum())
    sizes = _split_sizes(available, train_samples, eval_samples, val_samples)
    if sizes["train"] < train_samples:   # not silent: the log says it, stats.json records train vs requested
        print(f"prepare_data: {available} unique conversations ({usable - available} duplicates removed) give "
              f"{sizes['train']} train, fewer than data.train_samples={train_samples}", file=sys.stderr, flush=True)
    rank = array("q", bytes(8 * available))
    for position, record in enumerate(split_order(available, seed)):
        rank[record] = position
    bounds = split_bounds(sizes)
    writers = {name: RankedWriter(out / f"{name}.jsonl", sizes[name]) for name in SPLIT_NAMES}
    try:
        record = unique = 0
        for index, k, messages in iter_sources(sources, []):
            if not long_enough(messages):
                continue
            if record == usable:
                raise DataError(f"source {index}: more records on the second read than the first ({usable})")
            record += 1
            if not keep[record - 1]:
                continue
            position, unique = rank[unique], unique + 1
            name = next((n for n, (a, b) in bounds.items() if a <= position < b), None)
            if name is not None:
                writers[name].add(position - bounds[name][0], json.dumps({"id": f"{index}:{k}", "messages": messages},
                                                                        ensure_ascii=False) + "\n")
        if record != usable:
            raise DataError(f"sources: {record} records on the second read, {usable} on the first")
        for name in ("train", "val", "eval"):
            writers[name].close()
    finally:
        for w in writers.values():
            w.discard()
    stats = {"sources": [s.to_dict() for s in stats_list], "available": available,
             "too_short": read - usable, "duplicates_removed": usable - available,
             "dedup": "NFKC + casefold + invisible characters dropped + whitespace collapsed, role-tagged turns",
             "train": sizes["train"], "eval": sizes["eval"], "val": sizes["val"],
             "seed": seed, "requested": {"train": train_samples, "eval": eval_samples, "val": val_samples,
                                         "min_assistant_chars": min_assistant_chars}}
    atomic_write(out / "stats.json", [json.dumps(stats, indent=2) + "\n"])
    return stats
