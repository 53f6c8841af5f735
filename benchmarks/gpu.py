"""One GPU's costs for the paper-scale drafters, prepared for whoever has a GPU for ten minutes.

With a Qwen3-8B-shaped target of random bf16 weights (no downloads; acceptance is meaningless
with random weights, so only costs are reported) it measures, one JSON line per figure:
  config          what runs: device, shapes, and the attention backend `auto` picks on CUDA
                  for training and decoding (read from the config and `attention.pick_backend`)
  train_step      per paradigm x GPU attention backend: tokens/s, MFU, peak memory, at the
                  config's sequence length (2,048), one sequence, K TTT steps, AdamW step included
  online_features the target forward that captures a batch's features, against the drafter's step
  decode_round    per paradigm: a chain round's drafting and verify times (prompt of 512 tokens)
  smoke_dag       the smoke DAG (config/smoke.yaml) with device cuda, in a scratch directory
Everything runs under one wall-clock budget (--budget-s, default 450 s: within 8 minutes on an
H200); a figure that fails or is out of time prints its line with "error" or "skipped".

    python benchmarks/gpu.py [--config config/paper.yaml] [--out results/benchmarks/gpu.jsonl]
    python benchmarks/gpu.py --dry     # CPU, tiny shapes, the same code paths (tests, CI)

--dry uses the smoke overlay's tiny target (config.yaml + smoke.yaml) at sequence length 16 on CPU in fp32: the
training step runs under `sdpa` (flex_attention has no CPU backward: its loss runs forward
only), and the smoke DAG is checked with `snakemake -n` instead of run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from kvshot.config import drafter_autocast, read_config
from kvshot.decode import DraftSpec, plain_generate, speculative_generate
from kvshot.drafters.attention import pick_backend, use_attention
from kvshot.target import target_forward
from kvshot.train import build_variant
from kvshot.ttt import TTTUnroll, label_positions, step_losses, target_labels, weighted_loss
from ttt import matmul_peak   # benchmarks/ttt.py: this script's folder is on sys.path

REPO = Path(__file__).resolve().parents[1]
# Qwen3-8B's config.json (the pretrained target of config/paper.yaml)
QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1e6,
            "rms_norm_eps": 1e-6, "vocab_size": 151936}
H200_BF16_PEAK = 989e12   # dense bf16 tensor-core FLOP/s (H100/H200 SXM datasheet)


class Run:
    """Where the lines go, and the budget."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.deadline = out, time.monotonic() + budget_s
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")

    def emit(self, figure: str, **fields) -> None:
        line = json.dumps({"figure": figure, **fields})
        print(line, flush=True)
        with self.out.open("a") as f:
            f.write(line + "\n")

    def figure(self, figure: str, fn, **labels) -> None:
        """Run fn() -> dict and print its line; errors and the budget as lines too."""
        if time.monotonic() > self.deadline:
            return self.emit(figure, **labels, skipped="time budget")
        try:
            self.emit(figure, **labels, **fn())
        except Exception as e:   # one figure's failure must not cost the others
            traceback.print_exc(file=sys.stderr)
            self.emit(figure, **labels, error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_target(arch: dict, vocab: int, device: str, dtype: torch.dtype):
    """A Qwen3 of the given shape with random weights, built directly on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{"tie_word_embeddings": False, **arch, "vocab_size": vocab, "attn_implementation": "sdpa"})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def feature_batch(target, seq: int, device: str, aux: tuple[int, ...]) -> dict:
    n = target.config.num_hidden_layers
    ids = torch.randint(3, target.config.vocab_size, (1, seq), device=device)
    ctx = target_forward(target, ids, None, aux, tuple(range(n)))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
            "aux_hidden": ctx.aux_hidden, "last_hidden": ctx.last_hidden,
            **{f"key_{l}": ctx.keys[l] for l in range(n)}, **{f"value_{l}": ctx.values[l] for l in range(n)}}


def train_step(model, opt, batch, head_w, steps, decay, autocast, backward: bool = True) -> float:
    labels = target_labels(batch["last_hidden"], head_w, model.d2t, positions=label_positions(batch))
    with autocast:
        loss = weighted_loss(step_losses(model, TTTUnroll(model)(batch, steps), batch, labels)[0], decay)
    if backward:
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure_train(model, batch, head_w, steps, decay, autocast, device, backend, iters, peak_flops, backward):
    use_attention(backend)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    grad = contextlib.nullcontext() if backward else torch.no_grad()
    with grad:
        start = time.perf_counter()
        train_step(model, opt, batch, head_w, steps, decay, autocast, backward)   # warm-up (compiles)
        sync(device)
        first_s = time.perf_counter() - start
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() if device == "cuda" else 0
        start = time.perf_counter()
        for _ in range(iters):
            loss = train_step(model, opt, batch, head_w, steps, decay, autocast, backward)
        sync(device)
        step_s = (time.perf_counter() - start) / iters
    tokens = int(batch["attention_mask"].sum())
    out = {"tokens_per_s": tokens / step_s, "step_s": step_s, "first_step_s": first_s, "loss": loss,
           "backward": backward, "tokens": tokens}
    if device == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        out["peak_over_resident_gib"] = (torch.cuda.max_memory_allocated() - resident) / 2 ** 30
    if peak_flops:
        out["mfu"] = peak_flops["flops"] / step_s / peak_flops["peak"]
        out["flops_per_step"] = peak_flops["flops"]
    return out


def count_flops(model, batch, head_w, steps, decay, autocast, backward: bool) -> int:
    """One step's FLOPs as PyTorch's counter sees them under the `sdpa` backend (eager: the
    compiled flex kernel hides its ops from the counter); attention counts the tiles of each
    block's keys that SDPA computes."""
    use_attention("sdpa")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with FlopCounterMode(display=False) as counter, (contextlib.nullcontext() if backward else torch.no_grad()):
        train_step(model, opt, batch, head_w, steps, decay, autocast, backward)
    return counter.get_total_flops()


def decode_round(target, model, aux, steps, device, prompt_len, new_tokens) -> dict:
    use_attention("auto")
    ids = torch.randint(3, target.config.vocab_size, (1, prompt_len), device=device)
    model.eval()
    with torch.no_grad():
        speculative_generate(target, model, ids, 4, None, aux if model.reads_aux_hidden else None, DraftSpec(depth=steps))
        r = speculative_generate(target, model, ids, new_tokens, None, aux if model.reads_aux_hidden else None,
                                 DraftSpec(depth=steps))
        plain = plain_generate(target, ids, new_tokens, None)
    model.train()
    return {"rounds": r.rounds, "draft_ms_per_round": 1e3 * r.draft_s / r.rounds,
            "verify_ms_per_round": 1e3 * r.verify_s / r.rounds, "plain_ms_per_token": 1e3 * plain.total_s / len(plain.tokens),
            "draft_ms_per_step": 1e3 * r.draft_s / r.rounds / steps, "prompt_len": prompt_len,
            "backend": pick_backend(device, torch.bfloat16 if device == "cuda" else torch.float32, training=False)}


def smoke_dag(dry: bool, budget_s: float) -> dict:
    """The smoke DAG with device cuda in a scratch directory (dry: `snakemake -n` only)."""
    work = Path(tempfile.mkdtemp(prefix="kvshot-gpu-smoke-"))
    try:
        for name in ("Snakefile", "workflow", "config", "envs", "src"):
            (work / name).symlink_to(REPO / name)
        cmd = ["snakemake", "--cores", str(min(8, os.cpu_count() or 1)), "--configfile", "config/smoke.yaml",
               "--config", "device=cuda"] + (["-n"] if dry else [])
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=max(10.0, budget_s))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}")
        return {"command": " ".join(cmd), "seconds": time.perf_counter() - start, "dry_run": dry}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes (tests)")
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--out", default="results/benchmarks/gpu.jsonl")
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--backends", default=None, help="comma-separated GPU backends (default flex,sdpa)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--skip-dag", action="store_true")
    args = ap.parse_args()
    cfg = read_config(args.config or (["config/config.yaml", "config/smoke.yaml"] if args.dry else ["config/paper.yaml"]))
    run = Run(Path(args.out), args.budget_s)
    if not args.dry and not torch.cuda.is_available():
        run.emit("config", error="no CUDA device: run with --dry for the CPU check")
        return 1
    device, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    dcfg = cfg["drafters"]
    if args.dry:
        arch, vocab = dict(cfg["target"]["arch"]), cfg["tokenizer"]["vocab_size"]
        seq, prompt_len, new_tokens = 16, 8, 4
        args.iters = 1
    else:
        arch, vocab = {k: v for k, v in QWEN3_8B.items() if k != "vocab_size"}, QWEN3_8B["vocab_size"]
        seq, prompt_len, new_tokens = dcfg["train"]["max_len"], 512, 32
    steps, decay = dcfg["ttt_steps"], dcfg["step_decay"]
    backends = (args.backends or "flex,sdpa").split(",")
    configured = dcfg.get("attention", "auto")
    run.emit("config", device=device, dtype=str(dtype), arch=arch, vocab=vocab, seq_len=seq, ttt_steps=steps,
             configured_attention=configured, backends=backends,
             cuda_training_backend=pick_backend("cuda", torch.bfloat16, training=True, choice=configured),
             cuda_decoding_backend=pick_backend("cuda", torch.bfloat16, training=False, choice=configured),
             cpu_fp32_training_backend=pick_backend("cpu", torch.float32, training=True, choice=configured),
             gpu=torch.cuda.get_device_name() if device == "cuda" else None, torch=torch.__version__)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    start = time.perf_counter()
    target = random_target(arch, vocab, device, dtype)
    n = target.config.num_hidden_layers
    aux = (2, n // 2, n - 3)
    sync(device)
    built_s = time.perf_counter() - start
    head_w = target.lm_head.weight
    autocast = drafter_autocast(device, "bfloat16" if device == "cuda" else "float32")
    batch = {}

    def features():
        sync(device)
        t0 = time.perf_counter()
        batch.update(feature_batch(target, seq, device, aux))
        sync(device)
        return {"target_build_s": built_s, "target_forward_s": time.perf_counter() - t0, "seq_len": seq}

    run.figure("online_features", features)
    if not batch:
        return 1
    paradigms = {}
    for v in dcfg["variants"]:
        paradigms.setdefault(v["paradigm"], v)   # the first variant of each paradigm
    models = {}
    for paradigm, v in paradigms.items():
        d2t = torch.arange(min(dcfg["draft_vocab_size"], vocab))
        model = build_variant(v, target.config, target.model.embed_tokens.weight, d2t).to(device)
        models[paradigm] = model
        flops = {}

        def flop_count():
            flops["flops"] = count_flops(model, batch, head_w, steps, decay, autocast, backward=True)
            flops["peak"] = matmul_peak(512, 5) if args.dry else H200_BF16_PEAK
            return {"flops_per_step": flops["flops"], "peak_flops": flops["peak"]}

        run.figure("flop_count", flop_count, paradigm=paradigm, variant=v["name"])
        for backend in backends:
            backward = device == "cuda" or backend != "flex"   # flex: no backward on CPU
            run.figure("train_step", lambda: measure_train(model, batch, head_w, steps, decay, autocast, device, backend,
                                                           args.iters, flops or None, backward),
                       paradigm=paradigm, variant=v["name"], backend=backend, seq_len=seq)
    use_attention("auto")

    def overhead():
        t_features = []
        for _ in range(2):
            sync(device)
            t0 = time.perf_counter()
            feature_batch(target, seq, device, aux)
            sync(device)
            t_features.append(time.perf_counter() - t0)
        step = measure_train(next(iter(models.values())), batch, head_w, steps, decay, autocast, device,
                             pick_backend(device, dtype, training=True), 1, None, device == "cuda")
        return {"target_forward_s": min(t_features), "drafter_step_s": step["step_s"],
                "overhead_share": min(t_features) / (min(t_features) + step["step_s"]),
                "paradigm": next(iter(models))}

    run.figure("online_features_overhead", overhead)
    for paradigm, model in models.items():
        run.figure("decode_round", lambda: decode_round(target, model, aux, steps, device, prompt_len, new_tokens),
                   paradigm=paradigm)
    del target, models, batch
    if not args.skip_dag:
        run.figure("smoke_dag", lambda: smoke_dag(args.dry, run.deadline - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
