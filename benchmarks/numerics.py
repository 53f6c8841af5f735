"""Which CPU settings change the target's weights, and what each costs in time: the target stage
(`python -m kvshot target`, the real code) pretrained for --steps steps under each setting, one
after another on this machine, each compared with the portable run tensor by tensor.

    python benchmarks/numerics.py --results results --steps 60 [--out docs/numerics-target.md]

--results: a run's results folder (its data split and tokenizer are the inputs). Rows:
native (this machine's own kernels), each ATen capability this CPU offers, MKL_CBWR alone, the
three AVX2 variables together without and with STRICT (portable), and portable at 1 thread.
Also the tokenizer trained with 1 and 2 Rayon threads and the data split under two hash seeds.
Prints one table: seconds, the ratio to native, and where the weights part from portable's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvshot.core.numerics import PORTABLE_ENV, cpu_flags, cpu_model  # noqa: E402
from kvshot.report.fingerprint import content_digest, file_difference  # noqa: E402

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def settings(flags: set[str]) -> list[tuple[str, str, dict, int]]:
    """(name, numerics mode, environment, threads); portable first: every row is compared with it."""
    rows = [("portable", "portable", {}, 2),
            ("portable, 1 thread", "portable", {}, 1),
            ("native", "native", {}, 2),
            ("native, 1 thread", "native", {}, 1),
            ("ATEN_CPU_CAPABILITY=default", "native", {"ATEN_CPU_CAPABILITY": "default"}, 2),
            ("ATEN_CPU_CAPABILITY=avx2", "native", {"ATEN_CPU_CAPABILITY": "avx2"}, 2)]
    if "avx512f" in flags:
        rows.append(("ATEN_CPU_CAPABILITY=avx512", "native", {"ATEN_CPU_CAPABILITY": "avx512"}, 2))
    rows += [("MKL_CBWR=AVX2", "native", {"MKL_CBWR": "AVX2"}, 2),
             ("MKL_CBWR=COMPATIBLE", "native", {"MKL_CBWR": "COMPATIBLE"}, 2),
             ("AVX2 three (reference's)", "native", dict(AVX2), 2)]
    return rows


def clean_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def run_target(results: Path, out: Path, mode: str, env: dict, threads: int, steps: int) -> float:
    overlay = json.dumps({"numerics": mode, "target": {"pretrain": {"max_steps": steps, "generations": 0}}})
    cmd = [sys.executable, "-m", "kvshot", "target", "--config", str(REPO / "config/config.yaml"), "--config", overlay,
           "--threads", str(threads), "--train", str(results / "data/train.jsonl"),
           "--eval", str(results / "data/eval.jsonl"), "--tokenizer", str(results / "target/tokenizer"),
           "--out", str(out / "model"), "--metrics", str(out / "metrics.json")]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=clean_env(env), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd[:4])}: failed\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def tokenizer_rows(results: Path, work: Path) -> list[str]:
    digests = {}
    for threads in ("1", "2"):
        out = work / f"tokenizer-rayon{threads}"
        cmd = [sys.executable, "-m", "kvshot", "train-tokenizer", "--config", str(REPO / "config/config.yaml"),
               "--train", str(results / "data/train.jsonl"), "--out", str(out)]
        subprocess.run(cmd, env=clean_env({"RAYON_NUM_THREADS": threads}), check=True, capture_output=True)
        digests[threads] = content_digest(out / "tokenizer.json")
    same = digests["1"] == digests["2"]
    return [f"| tokenizer, RAYON_NUM_THREADS 1 vs 2 | | | {'same' if same else 'differs'} |"]


def data_rows(work: Path) -> list[str]:
    digests = {}
    for seed in ("0", "12345"):
        out = work / f"data-hash{seed}"
        cmd = [sys.executable, "-m", "kvshot", "prepare-data", "--config", str(REPO / "config/config.yaml"),
               "--config", '{"numerics": "native"}', "--out", str(out)]
        subprocess.run(cmd, env=clean_env({"PYTHONHASHSEED": seed}), check=True,
                       capture_output=True)
        digests[seed] = [content_digest(out / f"{s}.jsonl") for s in ("train", "eval", "val")]
    same = digests["0"] == digests["12345"]
    return [f"| data split, PYTHONHASHSEED 0 vs 12345 | | | {'same' if same else 'differs'} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="a run's results folder (data split and tokenizer)")
    ap.add_argument("--steps", type=int, default=60, help="pretraining steps per setting")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    ap.add_argument("--no-stages", action="store_true", help="the target rows only (no tokenizer and data rows)")
    args = ap.parse_args()
    results = Path(args.results)
    flags = cpu_flags()
    lines = [f"CPU: {cpu_model()}, {os.cpu_count()} cores, AVX2 {'yes' if 'avx2' in flags else 'no'}, "
             f"AVX-512 {'yes' if 'avx512f' in flags else 'no'}; target pretrained {args.steps} steps per setting", "",
             "| setting | seconds | / native | weights against portable |", "|---|---:|---:|---|"]
    with tempfile.TemporaryDirectory(prefix="kvshot-numerics-") as tmp:
        work = Path(tmp)
        timed = []
        for i, (name, mode, env, threads) in enumerate(settings(flags)):
            out = work / f"run{i}"
            seconds = run_target(results, out, mode, env, threads, args.steps)
            timed.append((name, out, seconds))
            print(f"{name}: {seconds:.1f} s", file=sys.stderr, flush=True)
        native = next(s for n, _, s in timed if n == "native")
        reference = timed[0][1] / "model" / "model.safetensors"
        for name, out, seconds in timed:
            weights = out / "model" / "model.safetensors"
            same = content_digest(weights) == content_digest(reference)
            where = "same bytes" if same else f"differs: {file_difference(reference, weights)}"
            lines.append(f"| {name} | {seconds:.1f} | {seconds / native:.2f} | {where} |")
        if not args.no_stages:
            lines += tokenizer_rows(results, work) + data_rows(work)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
