"""One GPU's costs for the paper-scale drafters, prepared for whoever has a GPU for ten minutes.

With a Qwen3-8B-shaped target of random bf16 weights (no downloads; acceptance is meaningless
with random weights, so only costs are reported) it measures, one JSON line per figure:
  config          what runs: device, shapes, and the attention backend `auto` picks on CUDA
                  for training and decoding (read from the config and `attention.pick_backend`)
  train_step      per paradigm x GPU attention backend: tokens/s, MFU, peak memory, at the
                  config's sequence length (2,048), one sequence, K TTT steps, AdamW step included
  online_features the target forward that captures a batch's features, against the drafter's step
  decode_round    per paradigm: a chain round's drafting and verify times (prompt of 512 tokens)
  compiled_step   per paradigm (block-wise included), at the small shape: one training step through
                  the backend `auto` picks on CUDA (flex and its block masks compiled), first step with
                  the compilation and a second, loss and gradient norm against the reference attention
                  (on CPU with --dry: under `attention.cuda_branches()`, CUDA's branches)
  rule_cost       per paradigm (block-wise included), rows named as benchmarks/paper_shapes.py's:
                  train_drafter/<p> (one rank's training step, online target forward included),
                  evaluate/<p> (`train.evaluate`, one batch), eval_stepwise/<p> (`stepwise.chain_correct`
                  on one batch of natural-protocol prefixes, one anchor row each): seconds, peak
                  memory (CUDA; GB = 10^9 B, as paper_shapes) and ratios to the hidden paradigm, at
                  --shape paper (T = 2,048, per-rank batch 1, 16 prefixes) or small (CPU, seconds)
  smoke_dag       the smoke DAG (config/smoke.yaml) with device cuda, in a scratch directory
Everything runs under one wall-clock budget (--budget-s, default 450 s: within 8 minutes on an
H200); a figure that fails or is out of time prints its line with "error" or "skipped".

    python benchmarks/gpu.py [--config config/paper.yaml] [--out results/benchmarks/gpu.jsonl]
    python benchmarks/gpu.py --dry     # CPU, tiny shapes, the same code paths (tests, CI)
    python benchmarks/gpu.py --only-costs [--shape paper]   # config, online_features, compiled_step, rule_cost
    python benchmarks/gpu.py --dry --compiled hidden   # compiled_step for one paradigm only (the unit test's run)

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
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from kvshot.capture.features import INDEX, TOKEN_KEYS, open_features
from kvshot.capture.shard_writer import ShardWriter
from kvshot.capture.target import target_forward
from kvshot.config import Runtime, drafter_autocast, feature_spec, typed_config
from kvshot.core.io import write_json
from kvshot.drafters import attention as attention_backends
from kvshot.drafters.attention import pick_backend, use_attention
from kvshot.drafters.unroll import TTTUnroll, label_positions, training_forward
from kvshot.evaluate import stepwise
from kvshot.evaluate.decode import plain_generate, speculative_generate
from kvshot.evaluate.draft_tree import DraftSpec
from kvshot.train import loop as train
from kvshot.train.objective import objective, step_losses, target_labels, weighted_loss
from kvshot.settings import Config, FeaturesSettings, to_dict
from kvshot.train.variants import build_variant, variant_config
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


# ---------------------------------------------------------------- per-paradigm rule costs

CPU_PEAK_NOTE = "n/a on CPU: torch's CPU allocator keeps no peak, and tracemalloc does not see its storage"
GB = 1e9   # as benchmarks/paper_shapes.py: 10^9 bytes


def cost_shape(shape: str) -> dict:
    """The per-paradigm section's sizes. paper: one rank's work under config/paper.yaml, as
    benchmarks/paper_shapes.py measures it with fake tensors (Qwen3-8B shapes, T =
    drafters.train.max_len, the per-rank batch batch_size / num_processes for a training step
    and for `train.evaluate`, eval.natural's batch of prefixes of max_prefix_len with their
    rollout tokens for the step-wise natural protocol). small: the smoke target at a few
    tokens, seconds on a CPU."""
    if shape == "paper":
        cfg = typed_config([str(REPO / "config/config.yaml"), str(REPO / "config/paper.yaml")])
        tc, ncfg = cfg.drafters.train, cfg.eval.natural
        per_rank = max(1, tc.batch_size // tc.num_processes)
        return {"arch": {k: v for k, v in QWEN3_8B.items() if k != "vocab_size"}, "vocab": QWEN3_8B["vocab_size"],
                "seq_len": tc.max_len, "train_batch": per_rank, "eval_batch": per_rank,
                "stepwise_batch": ncfg.batch_size, "prefix_len": ncfg.max_prefix_len,
                "rollout_tokens": ncfg.rollout_tokens, "features": cfg.features}
    cfg = typed_config([str(REPO / "config/config.yaml"), str(REPO / "config/smoke.yaml")])
    return {"arch": to_dict(cfg.target.arch), "vocab": cfg.tokenizer.vocab_size, "seq_len": 32,
            "train_batch": 1, "eval_batch": 1, "stepwise_batch": 4, "prefix_len": 24, "rollout_tokens": 8,
            "features": cfg.features}


def online_source(folder: Path, target, samples: int, seq: int, fcfg: FeaturesSettings, rt: Runtime):
    """An online feature folder of random token sequences (the aux layers of config section
    `fcfg`, every KV layer), read through kvshot.capture.features as the trainer reads it: every batch
    is a target forward."""
    n = target.config.num_hidden_layers
    spec = feature_spec(replace(fcfg, kv_layers="all", dtype=rt.dtype), n)
    ids = torch.randint(3, target.config.vocab_size, (samples, seq), dtype=torch.int32)
    rows = {"input_ids": ids, "loss_mask": torch.ones(samples, seq, dtype=torch.uint8)}
    folder.mkdir(parents=True)
    with ShardWriter(folder, list(range(samples)), [seq] * samples, samples * seq) as writer:
        writer.add(list(range(samples)), {k: rows[k] for k in TOKEN_KEYS}, padded=True)
    write_json(folder / INDEX, {"mode": "online", "target": "random", "pad_id": 0, "num_samples": samples,
                                "spec": {"aux_layers": list(spec.aux_layers), "kv_layers": list(spec.kv_layers),
                                         "dtype": spec.dtype},
                                "shards": writer.shards, "samples": [writer.locations[i] for i in range(samples)]})
    return open_features(folder, rt, model=target)


def measured(fn, device: str) -> dict:
    """fn() once to warm up (compilation, AdamW's state), then once timed: seconds, and on CUDA
    the peak allocated over the timed call with what was resident, and the peak above it."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    first_s = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if device == "cuda" else 0
    t0 = time.perf_counter()
    extra = fn() or {}
    sync(device)
    out = {"seconds": time.perf_counter() - t0, "first_call_s": first_s, **extra}
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
        out |= {"peak_memory_gb": peak / GB, "peak_over_resident_gb": (peak - resident) / GB}
    else:
        out |= {"peak_memory_gb": None, "peak_memory": CPU_PEAK_NOTE}
    return out


def rank_step(model, fwd, opt, params, src, sequences: int, head_w, steps: int, decay: float, rt: Runtime,
              clip: float) -> dict:
    """One rank's training step as the trainer takes it: the online target forward (the
    batch), labels, the unroll, the losses, backward, clip, AdamW. Its loss and gradient norm."""
    batch = src.batch(list(range(sequences)))
    lab = target_labels(batch["last_hidden"], head_w, model.d2t, positions=label_positions(batch))
    with rt.autocast():
        loss = weighted_loss(step_losses(model, fwd(batch, steps), batch, lab)[0], decay)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "grad_norm": float(norm)}


def compiled_steps(run: "Run", cfg: Config, device: str, dtype: torch.dtype, only: list[str] | None = None) -> None:
    """Per paradigm (block-wise included), at the small shape: two training steps through the
    backend `auto` picks for training on CUDA (flex, its block masks and kernel compiled), the
    first with the compilation, against the same first step through the reference attention
    from the same weights. On CPU (--dry) under `attention.cuda_branches()`: the branches CUDA
    takes. Lines `compiled_step`: backend, seconds, loss and gradient-norm relative errors."""
    size = cost_shape("small")
    rt = Runtime(device=device, dtype="bfloat16", threads=1, seed=0)
    target = random_target(size["arch"], size["vocab"], device, dtype)
    dcfg = cfg.drafters
    paradigms: dict[str, str] = {}
    for v in cfg.all_variants():
        if only is None or v.paradigm in only:
            paradigms.setdefault(v.paradigm, v.name)
    folder = Path(tempfile.mkdtemp(prefix="kvshot-gpu-compiled-"))
    try:
        src = online_source(folder / "features", target, 2, size["seq_len"], size["features"], rt)
        for paradigm, name in paradigms.items():
            def row(name=name):
                v = variant_config(cfg, name)
                d2t = torch.arange(min(dcfg.draft_vocab_size, size["vocab"]))
                out, state = {}, None
                for backend in ("reference", "auto"):
                    torch.manual_seed(0)
                    model = build_variant(v, target.config, target.model.embed_tokens.weight, d2t, target).to(device)
                    if state is None:
                        state = {k: t.clone() for k, t in model.state_dict().items()}
                    model.load_state_dict(state)
                    src.read_only(model.cfg.kv_layers, model.reads_aux_hidden)
                    steps, decay = objective(model, dcfg, v)
                    params = [p for p in model.parameters() if p.requires_grad]
                    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95))
                    use_attention(backend)
                    ran = []
                    saved = dict(attention_backends._BACKEND_FUNCTIONS)
                    attention_backends._BACKEND_FUNCTIONS.update(
                        {n: (lambda f, n: lambda *a: ran.append(n) or f(*a))(f, n) for n, f in saved.items()})
                    try:
                        times = []
                        for _ in range(1 if backend == "reference" else 2):
                            sync(device)
                            t0 = time.perf_counter()
                            as_cuda = device == "cpu" and backend == "auto"
                            with attention_backends.cuda_branches() if as_cuda else contextlib.nullcontext():
                                step = rank_step(model, training_forward(model), opt, params, src, 2,
                                                 target.lm_head.weight, steps, decay, rt, v.train.grad_clip)
                            sync(device)
                            times.append(time.perf_counter() - t0)
                            out.setdefault(backend, step)
                    finally:
                        attention_backends._BACKEND_FUNCTIONS.update(saved)
                        use_attention("auto")
                    if backend == "auto":
                        ref = out["reference"]
                        return {"backend": sorted(set(ran)), "first_step_s": times[0], "step_s": times[1],
                                "loss": step["loss"], "loss_rel_err": abs(out["auto"]["loss"] - ref["loss"]) / abs(ref["loss"]),
                                "grad_norm_rel_err": abs(out["auto"]["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
                                "cpu_as_cuda": device == "cpu"}

            run.figure("compiled_step", row, paradigm=paradigm, variant=name, seq_len=size["seq_len"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        use_attention("auto")


def paradigm_costs(run: "Run", cfg: Config, shape: str, target, target_shape: tuple[dict, int], device: str,
                   dtype: torch.dtype) -> None:
    """Per paradigm (the first variant of each, block-wise ones included), at `shape`
    (cost_shape): `train_drafter/<p>` one training step of one rank (the online target forward,
    labels, the unroll, the losses, backward, clip, AdamW), `evaluate/<p>` `train.evaluate` on
    one batch, `eval_stepwise/<p>` `stepwise.chain_correct` on one batch of the natural
    protocol's prefixes (one anchor row each): time and peak memory, and the ratios to the
    hidden paradigm (EAGLE-3). The rows are benchmarks/paper_shapes.py's, measured for real.
    `target` is reused when target_shape, its (arch, vocab), is the shape's."""
    size = cost_shape(shape)
    rt = Runtime(device=device, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", threads=1, seed=0)
    if (size["arch"], size["vocab"]) != target_shape:   # `target` (arch, vocab) is another shape: build this one
        target = random_target(size["arch"], size["vocab"], device, dtype)
    dcfg, steps_k = cfg.drafters, cfg.drafters.ttt_steps
    head_w = target.lm_head.weight
    paradigms: dict[str, str] = {}
    for v in cfg.all_variants():
        paradigms.setdefault(v.paradigm, v.name)
    labels = {"shape": shape, "seq_len": size["seq_len"]}
    base: dict[str, dict] = {}
    folder = Path(tempfile.mkdtemp(prefix="kvshot-gpu-costs-"))
    use_attention(dcfg.attention)
    try:
        src = online_source(folder / "features", target, max(size["train_batch"], size["eval_batch"]),
                            size["seq_len"], size["features"], rt)
        rng = torch.Generator().manual_seed(0)
        prefix, rollout = size["prefix_len"], max(size["rollout_tokens"], steps_k)
        items = [{"conversation": i, "anchors": [prefix - 1],
                  "prompt": torch.randint(3, size["vocab"], (prefix,), generator=rng).tolist(),
                  "continuation": torch.randint(3, size["vocab"], (rollout,), generator=rng).tolist()}
                 for i in range(size["stepwise_batch"])]
        for paradigm, name in paradigms.items():
            v = variant_config(cfg, name)
            d2t = torch.arange(min(dcfg.draft_vocab_size, size["vocab"]))
            try:
                model = build_variant(v, target.config, target.model.embed_tokens.weight, d2t, target).to(device)
            except Exception as e:   # one paradigm's failure must not cost the others
                traceback.print_exc(file=sys.stderr)
                run.emit("rule_cost", row=f"*/{paradigm}", paradigm=paradigm, variant=name, **labels,
                         error=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            src.read_only(model.cfg.kv_layers, model.reads_aux_hidden)
            steps, decay = objective(model, dcfg, v)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95))
            fwd = training_forward(model)

            def train_once():
                return rank_step(model, fwd, opt, params, src, size["train_batch"], head_w, steps, decay, rt,
                                 v.train.grad_clip)

            def evaluate_once():
                ev = train.evaluate(model, src, head_w, steps, size["eval_batch"], 1,
                                    target=target if model.kv_attentions() else None, dtype=rt.dtype)
                return {"tokens": int(sum(ev["tokens"]))}

            def stepwise_once():
                out = list(stepwise.chain_correct(model, target, items, src.spec.aux_layers, steps_k,
                                                  size["stepwise_batch"], device, rt.dtype))
                return {"anchors": sum(len(rows) for rows, _, _ in out)}

            for rule, fn, sizes in (("train_drafter", train_once, {"sequences": size["train_batch"]}),
                                    ("evaluate", evaluate_once, {"sequences": size["eval_batch"]}),
                                    ("eval_stepwise", stepwise_once, {"prefixes": size["stepwise_batch"],
                                                                      "prefix_len": prefix, "rollout_tokens": rollout})):
                def row(fn=fn, rule=rule):
                    out = measured(fn, device)
                    if paradigm == "hidden":
                        base[rule] = out
                    ref = base.get(rule)
                    if ref is not None:   # side by side with EAGLE-3's paradigm
                        out["seconds_vs_hidden"] = out["seconds"] / ref["seconds"]
                        if out.get("peak_over_resident_gb") is not None:
                            out["peak_over_resident_vs_hidden"] = out["peak_over_resident_gb"] / ref["peak_over_resident_gb"]
                    return out

                run.figure("rule_cost", row, row=f"{rule}/{paradigm}", paradigm=paradigm, variant=name, **labels, **sizes)
            model.train()
            del model, opt, fwd, params
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        use_attention("auto")



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes (tests)")
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--out", default="results/benchmarks/gpu.jsonl")
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--backends", default=None, help="comma-separated GPU backends (default flex,sdpa)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--skip-dag", action="store_true")
    ap.add_argument("--shape", choices=("small", "paper"), default=None,
                    help="sizes of the per-paradigm rule_cost rows (default: small with --dry, else paper)")
    ap.add_argument("--compiled", default=None,
                    help="comma-separated paradigms of the compiled_step rows (default: every paradigm of the config)")
    ap.add_argument("--only-costs", action="store_true",
                    help="config, online_features, compiled_step and the rule_cost rows only (a short device check)")
    args = ap.parse_args()
    args.shape = args.shape or ("small" if args.dry else "paper")
    cfg = typed_config(args.config or (["config/config.yaml", "config/smoke.yaml"] if args.dry else ["config/paper.yaml"]))
    run = Run(Path(args.out), args.budget_s)
    if not args.dry and not torch.cuda.is_available():
        run.emit("config", error="no CUDA device: run with --dry for the CPU check")
        return 1
    device, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    dcfg = cfg.drafters
    if args.dry:
        arch, vocab = to_dict(cfg.target.arch), cfg.tokenizer.vocab_size
        seq, prompt_len, new_tokens = 16, 8, 4
        args.iters = 1
    else:
        arch, vocab = {k: v for k, v in QWEN3_8B.items() if k != "vocab_size"}, QWEN3_8B["vocab_size"]
        seq, prompt_len, new_tokens = dcfg.train.max_len, 512, 32
    steps, decay = dcfg.ttt_steps, dcfg.step_decay
    backends = (args.backends or "flex,sdpa").split(",")
    configured = dcfg.attention
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
    for v in dcfg.variants:
        paradigms.setdefault(v.paradigm, v)   # the first variant of each paradigm
    models = {}
    for paradigm, v in (() if args.only_costs else paradigms.items()):
        d2t = torch.arange(min(dcfg.draft_vocab_size, vocab))
        model = build_variant(v, target.config, target.model.embed_tokens.weight, d2t).to(device)
        models[paradigm] = model
        flops = {}

        def flop_count():
            flops["flops"] = count_flops(model, batch, head_w, steps, decay, autocast, backward=True)
            flops["peak"] = matmul_peak(512, 5) if args.dry else H200_BF16_PEAK
            return {"flops_per_step": flops["flops"], "peak_flops": flops["peak"]}

        run.figure("flop_count", flop_count, paradigm=paradigm, variant=v.name)
        for backend in backends:
            backward = device == "cuda" or backend != "flex"   # flex: no backward on CPU
            run.figure("train_step", lambda: measure_train(model, batch, head_w, steps, decay, autocast, device, backend,
                                                           args.iters, flops or None, backward),
                       paradigm=paradigm, variant=v.name, backend=backend, seq_len=seq)
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

    if models:
        run.figure("online_features_overhead", overhead)
    for paradigm, model in models.items():
        run.figure("decode_round", lambda: decode_round(target, model, aux, steps, device, prompt_len, new_tokens),
                   paradigm=paradigm)
    del models, batch
    try:
        compiled_steps(run, cfg, device, dtype, args.compiled.split(",") if args.compiled else None)
    except Exception as e:   # the setup: one line, the rest go on
        traceback.print_exc(file=sys.stderr)
        run.emit("compiled_step", error=f"{type(e).__name__}: {str(e)[:300]}")
    try:
        paradigm_costs(run, cfg, args.shape, target, (arch, vocab), device, dtype)
    except Exception as e:   # the setup (a target of the shape, the feature folder): one line, the rest go on
        traceback.print_exc(file=sys.stderr)
        run.emit("rule_cost", shape=args.shape, error=f"{type(e).__name__}: {str(e)[:300]}")
    del target
    if not args.skip_dag and not args.only_costs:
        run.figure("smoke_dag", lambda: smoke_dag(args.dry, run.deadline - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
