"""Which CPU settings change the target's weights, and what each costs in time: the target stage
(`python -m kvshot target`, the real code) pretrained for --steps steps under each setting, one
after another on this machine, each compared with the portable run tensor by tensor.

    python benchmarks/numerics.py --results results --steps 60 [--out docs/numerics-target.md]

--results: a run's results folder (its data split and tokenizer are the inputs). Rows:
native (this machine's own kernels), each ATen capability this CPU offers, MKL_CBWR alone, the
three AVX2 variables together without and with STRICT (portable), and portable at 1 thread.
Also the tokenizer trained with 1 and 2 Rayon threads, the data split under two hash seeds, and
single ops (matmul, softmax, attention and its backward, sums, ...) on fixed inputs under each
setting (`--ops-only`: that table alone, in seconds). Prints the tables: seconds, the ratio to
native, where the weights part from portable's, and which ops round differently.
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


# the ops the target's training step runs, each on fixed inputs: which of them round differently
OPS_PROBE = """
import hashlib, json, torch
import torch.nn.functional as F
torch.manual_seed(0)
a, b, x = torch.randn(257, 384), torch.randn(384, 1031), torch.randn(4, 8, 200, 32, requires_grad=True)
def h(t): return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:12]
logits = a @ b
attn = F.scaled_dot_product_attention(x, x, x, is_causal=True)
attn.sum().backward()
print(json.dumps({"kernels": torch.backends.cpu.get_cpu_capability(), "matmul": h(logits),
    "softmax": h(torch.softmax(x, -1)), "exp": h(torch.exp(x)), "silu": h(F.silu(x)),
    "rms_norm": h(F.rms_norm(x, (32,))), "row sums": h(x.sum(-1)), "whole-tensor sum": h(x.sum()),
    "cross_entropy": h(F.cross_entropy(logits, torch.arange(257) % 1031)), "sdpa": h(attn),
    "sdpa backward": h(x.grad)}))
"""


def ops_rows(flags: set[str]) -> list[str]:
    """Each setting's digests of OPS_PROBE's ops against portable's: the ops that part."""
    found = {}
    for name, mode, env, threads in settings(flags):
        env = {**env, **(PORTABLE_ENV if mode == "portable" else {})}
        code = f"import torch; torch.set_num_threads({threads})\n" + OPS_PROBE
        done = subprocess.run([sys.executable, "-c", code], env=clean_env(env), capture_output=True, text=True,
                              check=True)
        found[name] = json.loads(done.stdout.strip().splitlines()[-1])
    base = found["portable"]
    ops = [k for k in base if k != "kernels"]
    lines = ["", "Ops on fixed inputs, against portable (differs: another rounding):", "",
             "| setting | kernels | " + " | ".join(ops) + " |", "|---|---|" + "---|" * len(ops)]
    for name, got in found.items():
        marks = ["same" if got[op] == base[op] else "**differs**" for op in ops]
        lines.append(f"| {name} | {got['kernels']} | " + " | ".join(marks) + " |")
    return lines


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
    ap.add_argument("--ops-only", action="store_true", help="only the table of single ops (seconds, no run needed)")
    args = ap.parse_args()
    results = Path(args.results)
    flags = cpu_flags()
    if args.ops_only:
        print("\n".join(ops_rows(flags)))
        return
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
    lines += ops_rows(flags)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
