"""Feature capture against the target forward alone, in one run.

Capture = the same batched forward with hidden states and cache kept, split per sample and
written to safetensors shards; the baseline = the target's decoder forward alone on the same
batches. Targets: capture overhead at most 10%; bytes per token equal to the sum of what is
stored (no padding waste). Prints the ratios last; exits non-zero when a target is missed.

    python benchmarks/features.py [--target results/target/model] [--split results/data/eval.jsonl]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvshot.core import numerics

numerics.apply_for_script()   # before torch: the pipeline's numerics (KVSHOT_NUMERICS=native: this machine's own)
import torch  # noqa: E402

from kvshot.capture.features import capture_split, length_batches, pad_batch, tokenize_split
from kvshot.capture.target import load_target
from kvshot.config import runtime, typed_config
from kvshot.data.tokenizer import load_tokenizer

OVERHEAD_TARGET = 1.10


def forward_only(model, samples, groups, pad_id) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for group in groups:
            batch = pad_batch([samples[i] for i in group], pad_id)
            model.model(input_ids=batch["input_ids"].long(), attention_mask=batch["attention_mask"], use_cache=False)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--target", default="results/target/model")
    ap.add_argument("--split", default="results/data/eval.jsonl")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    cfg = typed_config(args.config or ["config/config.yaml"])
    rt = runtime(cfg)
    model = load_target(args.target, rt)
    tok = load_tokenizer(args.target)
    fcfg = cfg.features
    samples = tokenize_split(args.split, tok, fcfg.max_len or cfg.data.max_len)[: fcfg.max_samples]
    groups = length_batches([s["input_ids"].shape[0] for s in samples], fcfg.batch_tokens)
    forward_only(model, samples, groups[:2], tok.pad_token_id)            # warm-up

    # Forward, capture, forward, capture, ..., forward: each capture is compared with the mean of
    # the forwards either side of it, which cancels drift (this machine's speed moves by tens of
    # percent within a minute); the median over captures drops the odd disturbed one.
    base, capture, stage, summary = [forward_only(model, samples, groups, tok.pad_token_id)], [], [], {}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            summary = capture_split(cfg, rt, args.split, args.target, str(Path(tmp) / "f"))
            stage.append(time.perf_counter() - start)
        capture.append(summary["capture_seconds"])     # the stage's own timing of its capture loop
        base.append(forward_only(model, samples, groups, tok.pad_token_id))
    ratios = [c / ((before + after) / 2) for c, before, after in zip(capture, base, base[1:])]
    b, c, overhead = statistics.median(base), statistics.median(capture), statistics.median(ratios)
    parts = sum(summary["bytes_per_token_by_tensor"].values())
    out = {"forward_seconds": b, "capture_seconds": c, "stage_seconds": statistics.median(stage),
           "overhead": overhead, "overhead_per_repeat": ratios,
           "bytes_per_token": summary["bytes_per_token"], "sum_of_parts": parts, "tokens": summary["tokens"],
           "device": rt.device, "threads": torch.get_num_threads()}
    Path("results/benchmarks").mkdir(parents=True, exist_ok=True)
    Path("results/benchmarks/features.json").write_text(json.dumps(out, indent=2))
    ok = overhead <= OVERHEAD_TARGET and abs(summary["bytes_per_token"] - parts) < 1e-9
    print(f"tokens {summary['tokens']}  forward {b:.2f}s  capture loop {c:.2f}s  whole stage {out['stage_seconds']:.2f}s"
          f"  (medians of {args.repeats})")
    print(f"capture/forward = {overhead:.3f} (median over captures of capture / mean of the forwards either side; target <= {OVERHEAD_TARGET})  bytes/token {summary['bytes_per_token']:.1f}"
          f" / sum of parts {parts:.1f} = {summary['bytes_per_token'] / parts:.3f} (target 1.000)  "
          f"{'OK' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
