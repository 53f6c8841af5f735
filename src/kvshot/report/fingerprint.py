"""Fingerprints of a run's results, stage by stage, and the comparison of two runs.

A stage's fingerprint is the SHA-256 over its files' content digests. Weights, shards and data
are hashed as bytes. A JSON record is hashed after dropping what a clock wrote (seconds,
tokens/s, speedups: TIMING_KEY), so two runs of the same numerics on machines of different
speed give the same digits. The run fingerprint is a short digest of every stage's.

`compare_runs` walks two results folders in stage order and names the first file that
differs, and in it the first tensor (a safetensors file, read here without torch), the first
JSON field or the first JSONL line: where two runs' digits part.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

from kvshot.core.integrity import MANIFEST, file_digest

# a clock's value (seconds, ms, per-second rates, speedups, overheads, where a run stopped for
# time) or a job's bookkeeping (the checkpoint a resumed job started from): not part of the digits
TIMING_KEY = re.compile(r"(seconds|_s$|_s_|per_s|ms/|speedup|overhead|latency|timing|elapsed|wall|minutes|stopped_by"
                        r"|resumed_from|^date$|^host$)")
SKIP_NAMES = {MANIFEST, "progress.json"}   # a manifest repeats its folder; progress is bookkeeping
SKIP_SUFFIXES = {".ckpt", ".log", ".tsv", ".pdf", ".png", ".lock"}


def stage_globs(results: Path) -> list[tuple[str, list[str]]]:
    """(stage, globs under results/) in the DAG's order; every drafter is a stage of its own."""
    stages = [("data", ["data/train.jsonl", "data/eval.jsonl", "data/val.jsonl"]),
              ("tokenizer", ["target/tokenizer/**/*"]),
              ("target", ["target/model/**/*", "target/metrics.json"]),
              ("features", ["features/train/**/*", "features/eval/**/*", "features/val/**/*"]),
              ("references", ["eval/continuations.json", "eval/natural.json"])]
    drafters = sorted({p.parent.parent.name for p in (results / "drafters").glob("*/seed*/model.safetensors")})
    seeds = {v: sorted(q.name for q in (results / "drafters" / v).glob("seed*") if q.is_dir()) for v in drafters}
    stages += [(f"drafter {v}/{s}", [f"drafters/{v}/{s}/**/*"]) for v in drafters for s in seeds[v]]
    evals = sorted(p.name for p in (results / "eval").glob("*") if p.is_dir())
    stages += [(f"evaluation {v}", [f"eval/{v}/*.json"]) for v in evals]
    stages.append(("claims", ["claims.json"]))
    return stages


def stage_files(results: Path, globs: list[str]) -> list[str]:
    out = set()
    for pattern in globs:
        for p in results.glob(pattern):
            if p.is_file() and p.name not in SKIP_NAMES and p.suffix not in SKIP_SUFFIXES \
                    and not any(part.startswith(".") for part in p.relative_to(results).parts):
                out.add(str(p.relative_to(results)))
    return sorted(out)


def without_timing(value):
    """A JSON value with every clock-written field dropped, recursively."""
    if isinstance(value, dict):
        return {k: without_timing(v) for k, v in value.items() if not TIMING_KEY.search(str(k))}
    if isinstance(value, list):
        return [without_timing(v) for v in value]
    return value


def content_digest(path: Path, recorded: dict[str, str] | None = None) -> str:
    """SHA-256 of what a file says: a JSON file's fields without timing, else its bytes, as the
    stage that wrote it recorded them (`recorded_digests`) or hashed here."""
    if path.suffix == ".json":
        return hashlib.sha256(json.dumps(without_timing(json.loads(path.read_text())), sort_keys=True).encode()).hexdigest()
    return (recorded or {}).get(str(path)) or file_digest(path)


def recorded_digests(results: Path) -> dict[str, str]:
    """{path: sha256} of the files whose writer recorded them: each folder's checksums.json
    (kvshot.core.integrity) and a features index's shard_checksums. Weights and feature shards
    are the bulk of a run's bytes; their stages hashed them once already, and check them on read."""
    out = {}
    for manifest in results.rglob(MANIFEST):
        out.update({str(manifest.parent / n): r["sha256"] for n, r in json.loads(manifest.read_text()).items()})
    for index in results.glob("features/*/index.json"):
        shards = json.loads(index.read_text()).get("shard_checksums", {})
        out.update({str(index.parent / n): r["sha256"] for n, r in shards.items()})
    return out


def fingerprints(results: str | Path) -> dict:
    """{"run": 16 hex digits, "stages": {stage: 16 hex}, "files": {path: sha256}, "members": {stage:
    [paths]}} for a results folder."""
    results = Path(results)
    files, stages, members = {}, {}, {}
    recorded = recorded_digests(results)
    for stage, globs in stage_globs(results):
        names = stage_files(results, globs)
        if not names:
            continue
        digests = {n: content_digest(results / n, recorded) for n in names}
        files.update(digests)
        members[stage] = names
        stages[stage] = hashlib.sha256("".join(f"{n}\0{d}\n" for n, d in digests.items()).encode()).hexdigest()[:16]
    run = hashlib.sha256("".join(f"{s}\0{d}\n" for s, d in stages.items()).encode()).hexdigest()[:16]
    return {"run": run, "stages": stages, "files": files, "members": members}


def write_fingerprints(results: str | Path, out: str | Path, machine: dict) -> str:
    """results/fingerprints.json: the run's, each stage's and each file's digest, and the machine
    and numerics they came from; returns the run fingerprint."""
    from kvshot.core.io import write_json

    found = fingerprints(results)
    write_json(out, {"run": found["run"], "machine": machine, "stages": found["stages"], "files": found["files"]})
    return found["run"]


# ---------------------------------------------------------------- where two runs part

_DTYPES = {"F64": ("d", 8), "F32": ("f", 4), "F16": ("e", 2), "I64": ("q", 8), "I32": ("i", 4), "I16": ("h", 2),
           "I8": ("b", 1), "U8": ("B", 1), "BOOL": ("?", 1)}


def safetensors_tensors(path: Path) -> tuple[dict, int]:
    """The header's tensors {name: {dtype, shape, data_offsets}} and where the data starts."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def first_tensor_difference(a: Path, b: Path) -> str:
    """The first tensor (in file order) whose bytes differ, its element count that differ and
    the largest absolute difference."""
    ha, start_a = safetensors_tensors(a)
    hb, start_b = safetensors_tensors(b)
    if set(ha) != set(hb):
        return f"tensor names differ: {sorted(set(ha) ^ set(hb))[:3]}"
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for name in sorted(ha, key=lambda k: ha[k]["data_offsets"][0]):
            ta, tb = ha[name], hb[name]
            if (ta["dtype"], ta["shape"]) != (tb["dtype"], tb["shape"]):
                return f"tensor {name}: {ta['dtype']}{ta['shape']} against {tb['dtype']}{tb['shape']}"
            (sa, ea), (sb, eb) = ta["data_offsets"], tb["data_offsets"]
            fa.seek(start_a + sa)
            fb.seek(start_b + sb)
            ba, bb = fa.read(ea - sa), fb.read(eb - sb)
            if ba == bb:
                continue
            return f"tensor {name} {ta['dtype']}{ta['shape']}: " + _element_difference(ba, bb, ta["dtype"])
    return "no tensor differs (the header or metadata does)"


def _element_difference(ba: bytes, bb: bytes, dtype: str) -> str:
    if dtype not in _DTYPES:
        return "bytes differ"
    code, size = _DTYPES[dtype]
    n = len(ba) // size
    va, vb = struct.unpack(f"<{n}{code}", ba), struct.unpack(f"<{n}{code}", bb)
    diffs = [(i, abs(x - y)) for i, (x, y) in enumerate(zip(va, vb)) if x != y]
    first, largest = diffs[0][0], max(d for _, d in diffs)
    return f"{len(diffs)} of {n} elements differ (first at {first}), max |diff| {largest:.3g}"


def first_json_difference(a, b, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"field {path}{k} only in {'the first' if k in a else 'the second'}"
            found = first_json_difference(a[k], b[k], f"{path}{k}.")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"field {path.rstrip('.')}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_json_difference(x, y, f"{path}{i}.")
            if found:
                return found
        return None
    return None if a == b else f"field {path.rstrip('.')}: {_short(a)} against {_short(b)}"


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 60 else text[:57] + "..."


def first_line_difference(a: Path, b: Path) -> str:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for i, (la, lb) in enumerate(zip(fa, fb), 1):
            if la != lb:
                return f"line {i} differs"
    return "one file is longer"


def file_difference(a: Path, b: Path) -> str:
    """Where two versions of one file first differ, in words."""
    if a.suffix == ".safetensors":
        return first_tensor_difference(a, b)
    if a.suffix == ".json":
        found = first_json_difference(without_timing(json.loads(a.read_text())), without_timing(json.loads(b.read_text())))
        return found or "the same fields (timing aside)"
    if a.suffix in {".jsonl", ".txt", ".md"}:
        return first_line_difference(a, b)
    return "bytes differ"


def compare_runs(a: str | Path, b: str | Path) -> dict:
    """Stage by stage: same, differs (how many files, the first and where in it) or missing.
    `first` names the first stage that differs and where."""
    a, b = Path(a), Path(b)
    fa, fb = fingerprints(a), fingerprints(b)
    rows, first = [], None
    stage_order = list(fa["stages"]) + [s for s in fb["stages"] if s not in fa["stages"]]
    for stage in stage_order:
        if stage not in fa["stages"] or stage not in fb["stages"]:
            rows.append({"stage": stage, "status": "missing in " + ("the first" if stage not in fa["stages"] else "the second")})
            continue
        if fa["stages"][stage] == fb["stages"][stage]:
            rows.append({"stage": stage, "status": "same"})
            continue
        names = sorted(set(fa["members"][stage]) | set(fb["members"][stage]))
        # weights and shards first: the tensor that parts is what a reader wants, then records
        differing = sorted((n for n in names if fa["files"].get(n) != fb["files"].get(n)),
                           key=lambda n: (not n.endswith(".safetensors"), n))
        where = None
        if differing:
            n = differing[0]
            where = (f"{n}: only in one run" if n not in fa["files"] or n not in fb["files"]
                     else f"{n}: {file_difference(a / n, b / n)}")
        rows.append({"stage": stage, "status": "differs", "files": f"{len(differing)} of {len(names)}", "first": where})
        first = first or {"stage": stage, "where": where}
    return {"first": first, "stages": rows, "run": [fa["run"], fb["run"]]}


def comparison_text(report: dict, a: str, b: str) -> str:
    lines = [f"first run:  {a} (run fingerprint {report['run'][0]})",
             f"second run: {b} (run fingerprint {report['run'][1]})", ""]
    width = max(len(r["stage"]) for r in report["stages"]) if report["stages"] else 5
    for r in report["stages"]:
        extra = f"  {r['files']} files; first: {r['first']}" if r["status"] == "differs" else ""
        lines.append(f"{r['stage']:<{width}}  {r['status']}{extra}")
    first = report["first"]
    lines += ["", "identical" if first is None else f"first difference: {first['stage']}: {first['where']}"]
    return "\n".join(lines) + "\n"
