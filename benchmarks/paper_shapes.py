"""Peak memory per rank and FLOPs of every GPU rule of config/paper.yaml at its real shapes
(Qwen3-8B bf16 target, T = 2,048, K = 7, draft vocabulary 32k, 8 DDP ranks), measured on a
CPU by running the real kvshot code with fake float tensors (`kvshot.paper_shapes.shapes`,
`kvshot.paper_shapes.shape_rules`), and the GPU-hours those FLOPs imply at an assumed MFU.

    python benchmarks/paper_shapes.py                      # every rule and variant (9-26 min on 2 cores)
    python benchmarks/paper_shapes.py --only train --variants kv-d1 standalone
    python benchmarks/paper_shapes.py --only groups   # the config's training groups (drafters.group_training)

GB are 10^9 bytes. GPU-hours = FLOPs / (MFU x peak) / 3600: not measured on a GPU. Each row's
peak is also shown with the CUDA allowance the meter cannot see (`shape_rules.cuda_gb`: x 1.10
for the allocator, + 3 GB for the context, NCCL and workspaces) against the booked 80 GB GPU
less the 8 GB headroom (`shape_rules.gpu_limit_gb`: 72 GB).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvshot.config import typed_config  # noqa: E402
from kvshot.paper_shapes.group_shapes import config_groups, group_train_row  # noqa: E402
from kvshot.settings import Config  # noqa: E402
from kvshot.paper_shapes.shape_rules import (CUDA_FIXED_GB, FRAGMENTATION, GPU_GB, HEADROOM_GB, PaperShapes, Row,
                                             ddp_buckets_alias_grads, gpu_limit_gb)

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0   # H100 SXM dense bf16
MFU = 0.40            # assumed, as docs/paper-scale.md: 396 TFLOP/s effective
PARTS = ("train", "groups", "stepwise", "e2e", "target")


def measure(ps: PaperShapes, variants: list[str], parts: tuple[str, ...], e2e_tokens: int,
            e2e_modes: tuple[str, ...] = ("chain", "tree")) -> list[Row]:
    rows: list[Row] = []
    for name in variants:
        if "train" in parts:
            rows += ps.train_rows(name)
        if "stepwise" in parts:
            rows.append(ps.stepwise_row(name))
        if "e2e" in parts:
            rows += ps.e2e_rows(name, e2e_tokens, e2e_modes)
    if "groups" in parts:   # each training group's step (drafters.group_training)
        rows += [group_train_row(ps, g) for g in config_groups(ps.cfg)]
    if "target" in parts:
        rows += ps.target_rows(e2e_tokens)
    return rows


def table(rows: list[Row], gpu_gb: float = GPU_GB) -> str:
    limit = gpu_limit_gb(gpu_gb)
    lines = [f"| rule | variant / path | peak GB per rank | with CUDA allowance | TFLOP per unit | unit | "
             f"over {limit:.0f} GB |", "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r.rule} | {r.what} | {r.peak_gb:.1f} | {r.cuda_gb:.1f} | {r.tflop_per:.3g} | {r.per} | "
                     f"{'' if r.fits(gpu_gb) else '**yes**'} |")
    return "\n".join(lines)


def training_hours(rows: list[Row], cfg: Config, mfu: float = MFU, peak_tflops: float = PEAK_TFLOPS) -> list[tuple]:
    """(variant, TFLOP per step per rank, steps, GPU-h): every rank runs the measured step."""
    tc = cfg.drafters.train
    out = []
    for r in rows:
        if r.rule in ("train_drafter", "train_drafter_group"):
            flops = r.tflop_per * 1e12 * tc.num_processes * tc.max_steps
            out.append((r.what, r.tflop_per, tc.max_steps, flops / (mfu * peak_tflops * 1e12) / 3600))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=[str(ROOT / "config/config.yaml"), str(ROOT / "config/paper.yaml")])
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--variants", nargs="+", default=None, help="default: every variant of the config")
    ap.add_argument("--e2e-tokens", type=int, default=16, help="new tokens per decoding call measured")
    ap.add_argument("--e2e-modes", nargs="+", choices=("chain", "tree"), default=["chain", "tree"])
    ap.add_argument("--gpu-gb", type=float, default=GPU_GB)
    args = ap.parse_args(argv)
    cfg = typed_config(args.config)
    start = time.perf_counter()
    ps = PaperShapes(cfg)
    rows = measure(ps, args.variants or ps.variants(), tuple(args.only), args.e2e_tokens, tuple(args.e2e_modes))
    print(f"Allowance: peak x {1 + FRAGMENTATION:.2f} + {CUDA_FIXED_GB:.0f} GB; limit: {args.gpu_gb:.0f} GB GPU less "
          f"{HEADROOM_GB:.0f} GB headroom = {gpu_limit_gb(args.gpu_gb):.0f} GB; DDP buckets "
          + ("alias the gradients (gradient_as_bucket_view=True)" if ddp_buckets_alias_grads()
             else "counted as one more copy of the gradients") + "\n")
    print(table(rows, args.gpu_gb))
    hours = training_hours(rows, cfg)
    if hours:
        print(f"\nTraining GPU-hours at {MFU:.0%} MFU of {PEAK_TFLOPS:.0f} TFLOP/s "
              f"({MFU * PEAK_TFLOPS:.0f} TFLOP/s effective; derived, not measured on a GPU):\n")
        print("| variant / group | TFLOP per step per rank | steps | GPU-h |\n|---|---:|---:|---:|")
        for name, tflop, steps, h in hours:
            print(f"| {name} | {tflop:.1f} | {steps:,} | {h:.1f} |")
        alone = {name: h for name, _, _, h in hours if "+" not in name}
        grouped = [name for name, _, _, h in hours if "+" in name]
        if grouped and all(n in alone for g in grouped for n in g.split("+")):
            by = dict((name, h) for name, _, _, h in hours)
            print("\nSide by side (drafters.group_training) against alone:\n")
            for g in grouped:
                print(f"- {g}: {by[g]:.1f} GPU-h side by side, {sum(alone[n] for n in g.split('+')):.1f} alone")
    over = [r for r in rows if not r.fits(args.gpu_gb)]
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s; over {gpu_limit_gb(args.gpu_gb):.0f} GB "
          "with the allowance: " + (", ".join(f"{r.rule} {r.what} ({r.cuda_gb:.1f} GB)" for r in over) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
