"""The `train_drafter` stage: one TTT trainer for every variant, with checkpoints that
resume bit-identically, NaN guards, bottleneck diagnostics and optional DDP (accelerate).
Precision follows the runtime dtype (`config.drafter_autocast`): bf16 autocast over fp32
parameters and optimizer state, or plain fp32. Given the job's runtime, training
checkpoints and exits (code 75) before it, and the rerun resumes."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from .blockwise import any_unroll, block_attention_diagnostics, block_key_share, is_block, objective, training_forward
from .config import ConfigError, Runtime, all_variants, drafter_autocast
from .diagnostics import GradientPositions, attention_diagnostics, diagnostic_batches
from .drafters import Drafter, DrafterConfig, build_drafter
from .drafters.attention import use_attention
from .drafters.standalone import init_from_target
from .features import FeatureSource, open_features
from .integrity import content_digest, folder_digest
from .io import read_json, write_json
from .progress import Progress
from .target import load_target, lr_at, rope_theta, target_queries
from .ttt import Unrolled, label_positions, query_cosine, scored_tokens, step_losses, target_labels, weighted_loss


def launcher_args(num_processes: int) -> list[str]:
    """`accelerate launch` flags for DDP: torchrun-style processes; each process's
    Accelerator(cpu=True) then joins a gloo group on CPU (`--cpu` would run only one)."""
    return ["--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no"]


def variant_config(cfg: dict, name: str) -> dict:
    """A variant's settings: the drafter defaults, its own entry, and its train overrides."""
    dcfg = cfg["drafters"]
    entries = {v["name"]: v for _, v in all_variants(cfg)}   # with the block variants and gate remedies
    if name not in entries:
        raise ConfigError(f"config: drafters.variants: no variant named {name!r} (have {sorted(entries)})")
    v = copy.deepcopy(entries[name])
    v["train"] = {**dcfg["train"], **v.get("train", {})}
    if v["paradigm"] == "block":   # default: K mask slots after x_{t+1}, as far as the K-step chain drafts
        v.setdefault("block_size", dcfg.get("block_size") or dcfg["ttt_steps"] + 1)
    if v["paradigm"] != "standalone":   # the standalone LM starts from the target's layers and head anyway
        v.setdefault("head_init", dcfg.get("head_init", "random"))
    return v


def draft_vocab(source: FeatureSource, size: int, vocab_size: int, samples: int | None = None) -> torch.Tensor:
    """The `size` most frequent assistant-side tokens of the (first `samples`) train samples
    (ties: lower id), as sorted target ids (d2t)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(samples or len(source)):
        s = source.tokens(i)
        counts += torch.bincount(s["input_ids"][s["loss_mask"].bool()].long(), minlength=vocab_size)
    size = min(size, vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def build_variant(v: dict, target_cfg, embed: torch.Tensor, d2t: torch.Tensor, target=None) -> Drafter:
    """A fresh drafter for variant `v`. The standalone LM drafts over the full vocabulary and,
    given the `target` model, starts from its first layers (then TTT distills it)."""
    n_target = target_cfg.num_hidden_layers
    depth, paradigm = v["layers"], v["paradigm"]
    reads_kv = paradigm in ("kv", "hybrid") or (paradigm == "block" and v.get("context", "kv") == "kv")
    kv_layers = v.get("kv_layers") or list(range(n_target - depth, n_target))  # the top target layers
    if reads_kv and len(kv_layers) != depth:
        raise ConfigError(f"config: drafters.variants.{v['name']}.kv_layers: {len(kv_layers)} layers for depth {depth}")
    if paradigm == "standalone":
        d2t = torch.arange(target_cfg.vocab_size)
    dc = DrafterConfig(
        paradigm=paradigm, hidden_size=target_cfg.hidden_size, num_layers=depth,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim, intermediate_size=v.get("intermediate_size") or target_cfg.intermediate_size,
        vocab_size=target_cfg.vocab_size, draft_vocab_size=len(d2t), rope_theta=rope_theta(target_cfg),
        rms_norm_eps=target_cfg.rms_norm_eps, kv_layers=list(kv_layers) if reads_kv else [],
        gate_shape=v.get("gate_shape", "scalar"), gate_init=float(v.get("gate_init", 0.5)),
        qk_norm=bool(v.get("qk_norm", True)), block_size=int(v.get("block_size") or 0),
        block_refine=int(v.get("refine_passes") or 0),
        block_context=v.get("context", "kv"))
    model = build_drafter(dc)
    model.set_vocab(embed, d2t)
    if paradigm == "standalone" and target is not None:
        init_from_target(model, target)
    elif v.get("head_init", "random") == "target" and target is not None:
        init_head_from_target(model, target, d2t)
    return model


@torch.no_grad()
def init_head_from_target(model: Drafter, target, d2t: torch.Tensor) -> None:
    """Start the drafter's output norm and LM head from the target's (its rows for the draft
    vocabulary), as EAGLE-1/2 reuse the target's head and the standalone LM starts from it:
    the head need not be learned from scratch in a short training budget."""
    model.lm_head.weight.copy_(target.lm_head.weight[d2t.to(target.lm_head.weight.device)].to(model.lm_head.weight))
    model.norm.weight.copy_(target.model.norm.weight.to(model.norm.weight))


KV_BRANCH = ("kv_attns.", "kv_norms.", "gate_logit")   # the hybrid's KV branch and its gate


def held_back(model: Drafter, v: dict) -> list[torch.nn.Parameter]:
    """The parameters a variant's kv_warmup_steps hold back (the hybrid-warm gate remedy):
    everything outside the hybrid's KV branch, so that the branch learns alone at first."""
    if not v.get("kv_warmup_steps"):
        return []
    if v["paradigm"] != "hybrid":
        raise ConfigError(f"config: drafters.variants.{v['name']}.kv_warmup_steps: a hybrid setting "
                          f"(paradigm {v['paradigm']} has no gated KV branch)")
    return [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(KV_BRANCH)]


# ---------------------------------------------------------------- diagnostics

def param_groups(model: Drafter) -> dict[str, list[torch.nn.Parameter]]:
    """Groups for gradient norms; the KV path's drafter-side W_K/W_V stand alone."""
    kv_modules = {id(attn) for _, attn in model.kv_attentions()}
    kv_names = {f"{name}." for name, mod in model.named_modules() if id(mod) in kv_modules}
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prefix = next((k for k in kv_names if name.startswith(k)), None)
        if prefix is not None:
            g = "kv_wk_wv" if name[len(prefix):].startswith(("k_proj", "v_proj")) else "kv_query_out"
        elif name.startswith("gate"):
            g = "gate"
        elif name.startswith("fc."):
            g = "fusion"
        elif name.startswith("lm_head"):
            g = "lm_head"
        else:
            g = "body"
        groups.setdefault(g, []).append(p)
    return groups


def grad_norms(groups: dict[str, list]) -> dict[str, float]:
    out = {}
    for g, params in groups.items():
        sq = sum(float(p.grad.float().pow(2).sum()) for p in params if p.grad is not None)
        out[g] = math.sqrt(sq)
    return out


def kv_key_share(valid: list[torch.Tensor], anchors: list[torch.Tensor | None] | None = None) -> float:
    """Share of the keys a KV-path query attends that come from the drafter's own W_K/W_V
    (and so pass gradient to them): (k+1) drafted keys vs (t+1) copied target keys at
    anchor t, step k, averaged over scored (anchor, step) pairs. anchors: each row's
    anchor per step (None: row r is anchor r)."""
    num, den = 0.0, 0
    for k, v in enumerate(valid):
        rows = anchors[k] if anchors else None
        t = (torch.arange(v.shape[1], device=v.device).expand_as(v) if rows is None else rows).to(torch.float32)
        num += float(((k + 1) / (t + k + 2))[v].sum())
        den += int(v.sum())
    return num / max(den, 1)


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model: Drafter, source: FeatureSource, head_w: torch.Tensor, steps: int, batch_size: int,
             max_batches: int, target=None, dtype: str = "float32") -> dict:
    """Teacher-forced metrics per step on the eval split: loss_k, acc_k, and the query error.
    Batches move to the drafter's device; it runs in the runtime `dtype`'s precision, as in training."""
    model.eval()
    from .features import batches

    device = model.d2t.device
    sums = {"loss": [0.0] * steps, "n": [0] * steps, "correct": [0] * steps, "acc_n": [0] * steps}
    cos_sum, cos_n = [0.0] * steps, 0
    kv = model.kv_attentions()
    for i, batch in enumerate(batches(source, batch_size)):
        if i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = target_labels(batch["last_hidden"], head_w, model.d2t, positions=label_positions(batch))
        with drafter_autocast(device.type, dtype):
            un = any_unroll(model, batch, steps, keep_queries=bool(kv) and target is not None)   # a block: block_unroll
            losses, counts, correct, acc_n = step_losses(model, un, batch, labels)
        for k in range(steps):
            sums["loss"][k] += float(losses[k]) * int(counts[k])
            sums["n"][k] += int(counts[k])
            sums["correct"][k] += int(correct[k])
            sums["acc_n"][k] += int(acc_n[k])
        if un.queries:
            layers = [l for l, _ in kv]
            tq = target_queries(target, batch["input_ids"].long(), batch["attention_mask"], layers)
            cos = query_cosine(un, tq, layers)
            cos_sum = [a + b for a, b in zip(cos_sum, cos)]
            cos_n += 1
    model.train()
    return {
        "loss": [l / max(n, 1) for l, n in zip(sums["loss"], sums["n"])],
        "acc": [c / max(n, 1) for c, n in zip(sums["correct"], sums["acc_n"])],
        "acc_note": "teacher-forced top-1 agreement with the target's greedy token (acc_k), not alpha_k",
        "tokens": sums["acc_n"],
        "query_cosine": [c / cos_n for c in cos_sum] if cos_n else None,
    }


# ---------------------------------------------------------------- stopping before the job's limit

STOP_EXIT_CODE = 75   # EX_TEMPFAIL: "try again"; Snakemake's retry reruns the job, which resumes


class StoppedForRuntime(Exception):
    """Training saved a checkpoint and stopped before the job's wall-clock limit."""


def process_start_time() -> float:
    """When this process started (epoch seconds): the job's clock runs from before loading."""
    import psutil

    return psutil.Process().create_time()


def stop_deadline(runtime_minutes: float | None, margin_minutes: float, started: float | None = None) -> float | None:
    """The time past which training checkpoints and stops: the job's runtime less a margin for
    the checkpoint, the exit and whatever ran before this process, from process start."""
    if runtime_minutes is None:
        return None
    if runtime_minutes <= margin_minutes:
        print(f"warning: runtime {runtime_minutes} min is within drafters.train.stop_margin_minutes "
              f"({margin_minutes}): each attempt trains one step", flush=True)
    return (process_start_time() if started is None else started) + 60 * (runtime_minutes - margin_minutes)


# ---------------------------------------------------------------- training

# settings that do not change what is trained: a checkpoint made under other values resumes
_NOT_FINGERPRINTED = ("stop_margin_minutes",)


def _fingerprint(v: dict, cfg: dict, rt: Runtime, train_dir: str, eval_dir: str, target_dir: str,
                 val_dir: str) -> str:
    """What a checkpoint must match to be resumed: the config this stage reads and the content
    of its inputs (a retrained target or recaptured features start afresh, at the same paths)."""
    v = {**v, "train": {k: x for k, x in v["train"].items() if k not in _NOT_FINGERPRINTED}}
    key = {"variant": v, "seed": cfg["seed"], "dtype": rt.dtype,
           "drafters": {k: cfg["drafters"][k] for k in ("ttt_steps", "step_decay", "draft_vocab_size")},
           "train": content_digest(Path(train_dir) / "index.json"), "eval": content_digest(Path(eval_dir) / "index.json"),
           "target": folder_digest(target_dir), "val": content_digest(Path(val_dir) / "index.json")}
    if v["paradigm"] == "block":   # the block objective's position weights
        key["block_position_decay"] = cfg["drafters"].get("block_position_decay")
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _set_aside(ckpt: Path, why: str) -> None:
    """Move a checkpoint that must not be resumed out of the way (kept for inspection)."""
    aside = ckpt.with_name(f"{ckpt.name}.{why}")
    os.replace(ckpt, aside)
    print(f"set aside {ckpt} as {aside.name} ({why}); training starts from step 0", flush=True)


def _load_checkpoint(ckpt: Path, fp: str) -> dict | None:
    """The checkpoint to resume from, or None: a missing, stale or unreadable one starts afresh."""
    if not ckpt.exists():
        return None
    try:
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)   # wherever it was written
        written_for = saved["progress"]["fingerprint"]
    except Exception as exc:   # truncated or damaged: torch/pickle raise many kinds
        print(f"{ckpt}: unreadable ({type(exc).__name__})", flush=True)
        _set_aside(ckpt, "corrupt")
        return None
    if written_for != fp:
        print(f"{ckpt}: written for other inputs or config", flush=True)
        _set_aside(ckpt, "stale")
        return None
    return saved


def _truncate(batch: dict[str, torch.Tensor], max_len: int) -> dict[str, torch.Tensor]:
    return {k: v[:, :max_len] for k, v in batch.items()}


def _save_checkpoint(path: Path, model, opt, sched, progress: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "progress": progress}, tmp)
    os.replace(tmp, path)   # a kill mid-save keeps the previous checkpoint


def _any_rank(accel, *flags: bool) -> list[bool]:
    """Each flag, true if it is on any process (every rank then takes the same branch)."""
    if accel.num_processes == 1:
        return list(flags)
    total = accel.reduce(torch.tensor([float(f) for f in flags], device=accel.device), "sum")
    return [bool(x > 0) for x in total.tolist()]


def plateaued(curve: list[dict], patience: int, min_delta: float, min_acc_delta: float) -> bool:
    """Has training stopped improving on the validation split? True when none of the last
    `patience` evaluations beat the best before them, neither in held-out loss by more than
    `min_delta` (relative) nor in held-out acc_0 by more than `min_acc_delta` (absolute).
    Both: the loss is mostly the target's own entropy, a floor the drafter cannot go under, so
    it flattens (0.2-0.6% per 50 steps) while acc_0 still climbs (docs/paper-vs-kvshot.md)."""
    if patience < 1 or len(curve) <= patience:
        return False
    before, last = curve[:-patience], curve[-patience:]
    best_loss = min(p["heldout_loss"] for p in before)
    best_acc = max(p["heldout_acc_k"][0] for p in before)
    return (all(p["heldout_loss"] > best_loss * (1 - min_delta) for p in last)
            and all(p["heldout_acc_k"][0] <= best_acc + min_acc_delta for p in last))


def heldout_point(model: Drafter, source: FeatureSource, head_w: torch.Tensor, steps: int, decay: float,
                  batch_size: int, batches: int, dtype: str, step: int) -> dict:
    """One point of the held-out curve: the TTT objective and acc_k on the first validation batches."""
    ev = evaluate(model, source, head_w, steps, batch_size, batches, None, dtype)
    return {"step": step, "heldout_loss": float(weighted_loss(torch.tensor(ev["loss"]), decay)),
            "heldout_loss_k": ev["loss"], "heldout_acc_k": ev["acc"]}


class JsonLines:
    """The live training log: one JSON record per line, flushed as training goes (`tail -f`);
    rewritten from the checkpoint's records on resume, so it never holds steps that were undone."""

    def __init__(self, path: Path, records: list[dict], enabled: bool = True):
        self.path, self.enabled = path, enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in records)

    def append(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")


def train_variant(cfg: dict, rt: Runtime, name: str, train_dir: str, eval_dir: str, target_dir: str,
                  out_dir: str, runtime_minutes: float | None = None, val_dir: str | None = None) -> dict:
    """Train one variant. runtime_minutes: the job's wall-clock limit; past it less
    `stop_margin_minutes` (from process start) training checkpoints and raises StoppedForRuntime.
    val_dir: the validation features the held-out curve and plateau stop read (the pipeline's
    results/features/val, disjoint from the evaluation's conversations); None reads eval_dir's
    instead, recorded as metrics `heldout_split: eval`. eval_dir: the final teacher-forced
    metrics (metrics `eval`), which steer nothing."""
    from accelerate import Accelerator

    v = variant_config(cfg, name)
    tc, dcfg = v["train"], cfg["drafters"]
    use_attention(dcfg.get("attention", "auto"))
    deadline = stop_deadline(runtime_minutes, tc.get("stop_margin_minutes", 0))
    accel = Accelerator(cpu=rt.device == "cpu")
    world, rank = accel.num_processes, accel.process_index
    torch.manual_seed(rt.seed)
    random.seed(rt.seed)
    if rt.device == "cuda":   # what stays fp32 under autocast (the fp32 parameters' own products) may use TF32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    target = load_target(target_dir, rt)
    train_src, eval_src = open_features(train_dir, rt, model=target), open_features(eval_dir, rt, model=target)
    heldout_split = "eval" if val_dir is None else "val"
    val_dir = eval_dir if val_dir is None else val_dir
    val_src = eval_src if val_dir == eval_dir else open_features(val_dir, rt, model=target)
    head_w = target.lm_head.weight.detach()
    n = min(len(train_src), tc.get("train_samples") or len(train_src))   # the data-scaling knob
    d2t = draft_vocab(train_src, dcfg["draft_vocab_size"], target.config.vocab_size, n)
    model = build_variant(v, target.config, target.model.embed_tokens.weight.detach(), d2t, target).to(rt.device)
    steps_k, decay = objective(model, dcfg, v)   # TTT: K steps, step_decay; a block: its positions, block_position_decay
    missing = sorted(set(model.cfg.kv_layers) - set(train_src.spec.kv_layers))
    if missing:
        raise ConfigError(f"config: features.kv_layers: variant {name} reads target layers {missing}, "
                          f"which the features do not hold ({list(train_src.spec.kv_layers)})")
    for src in (train_src, eval_src, val_src):   # batches carry (and online: compute) only what this variant reads
        src.read_only(model.cfg.kv_layers, model.reads_aux_hidden)
    params = [p for p in model.parameters() if p.requires_grad]   # fp32: so is the optimizer state
    opt = torch.optim.AdamW(params, lr=tc["lr"], weight_decay=tc["weight_decay"], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, tc["max_steps"], tc["warmup_steps"], tc["min_lr_ratio"]))
    groups = param_groups(model)
    warm_steps, waiting = int(v.get("kv_warmup_steps") or 0), held_back(model, v)

    ckpt = Path(f"{out_dir}.ckpt") / "checkpoint.pt"
    fp = _fingerprint(v, cfg, rt, train_dir, eval_dir, target_dir, val_dir)
    progress = {"step": 0, "epoch": 0, "cursor": 0, "log": [], "heldout": [], "fingerprint": fp,
                "resumed_from": None, "world_size": world}
    saved_step = None   # the step of the checkpoint on disk that this run would resume from
    saved = _load_checkpoint(ckpt, fp) if rank == 0 else None
    if world > 1:   # rank 0 decides (and sets aside); every rank then loads the same file or none
        accel.wait_for_everyone()
        resume = _any_rank(accel, saved is not None)[0]
        saved = saved if rank == 0 else (torch.load(ckpt, map_location="cpu", weights_only=False) if resume else None)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["torch_rng"])
        random.setstate(saved["python_rng"])
        progress = saved["progress"]
        progress["resumed_from"] = saved_step = progress["step"]
        progress.pop("stopped_by", None)
        print(f"resuming {name} from step {progress['step']} ({ckpt})", flush=True)
    ddp = training_forward(model) if world == 1 else torch.nn.parallel.DistributedDataParallel(training_forward(model))
    progress.setdefault("heldout", [])
    live = JsonLines(ckpt.parent / "train_log.jsonl",
                     sorted(progress["log"] + progress["heldout"], key=lambda r: r["step"]), enabled=rank == 0)
    plateau = tc.get("plateau") or {}
    eval_every = tc.get("eval_every") or 0

    def no_good_state() -> str:
        return f"last good checkpoint: step {saved_step} at {ckpt}" if saved_step is not None else "no checkpoint yet"

    bs = tc["batch_size"]
    if bs % world:
        raise ConfigError(f"config: drafters.train.batch_size: {bs} is not divisible by {world} processes")
    start, tokens_seen = time.time(), 0
    bar = Progress(total=tc["max_steps"], initial=progress["step"], desc=f"train {name}", unit="step",
                   disable=rank != 0)
    # the validation split: held out like eval, and what training-time measurements read (not the eval anchors)
    probe_batches = diagnostic_batches(val_src, tc.get("diagnostic_sequences", 4), tc["max_len"], rt.device)
    model.train()
    while progress["step"] < tc["max_steps"]:
        step = progress["step"]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(rt.seed * 1_000_003 + progress["epoch"]))
        if progress["cursor"] + bs > n:
            progress["epoch"], progress["cursor"] = progress["epoch"] + 1, 0
            continue
        ids = order[progress["cursor"]: progress["cursor"] + bs].tolist()[rank::world]
        batch = {k: t.to(rt.device) for k, t in _truncate(train_src.batch(ids), tc["max_len"]).items()}
        labels = target_labels(batch["last_hidden"], head_w, model.d2t, positions=label_positions(batch))
        local = torch.tensor([float(scored_tokens(batch, labels, model.t2d, k)[1].sum()) for k in range(steps_k)])
        denominators = (accel.reduce(local.to(accel.device), "sum").cpu().clamp(min=1) / world).tolist()
        logging = step % tc["log_every"] == 0 or step + 1 == tc["max_steps"]
        # on a logging step: which positions the real backward sends gradient from (`diagnostics`)
        with GradientPositions(model, enabled=logging) as positions:
            with rt.autocast():   # bf16 runtime: bf16 compute over the fp32 parameters; losses in fp32
                un: Unrolled = ddp(batch, steps_k)
                losses, counts, correct, acc_n = step_losses(model, un, batch, labels, denominators)
                loss = weighted_loss(losses, decay)
            bad = accel.reduce(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=accel.device), "sum")
            if float(bad) > 0:
                raise FloatingPointError(f"train {name}: loss is {loss.item()} at step {step}; {no_good_state()}")
            loss.backward()
        if step < warm_steps:   # hybrid-warm: no update outside the KV branch yet (AdamW skips grad None)
            for p in waiting:
                p.grad = None
        norms = grad_norms(groups) if logging else None
        total_norm = torch.nn.utils.clip_grad_norm_(params, tc["grad_clip"])
        if not torch.isfinite(total_norm):   # gradients are all-reduced: every rank sees the same norm
            raise FloatingPointError(f"train {name}: gradient norm is {float(total_norm)} at step {step}; "
                                     f"{no_good_state()}")
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        progress["cursor"] += bs
        progress["step"] = step + 1
        tokens_seen += int(batch["attention_mask"].sum())
        if logging:
            rec = {"step": step, "lr": sched.get_last_lr()[0], "loss": float(loss.detach()) / world,
                   "loss_k": [float(l.detach()) / world for l in losses],
                   "acc_k": [int(c) / max(int(a), 1) for c, a in zip(correct, acc_n)],
                   "grad_norm": norms, "kv_key_share": ((block_key_share(un.valid, un.anchors, model.cfg.block_size)
                                                         if is_block(model) else kv_key_share(un.valid, un.anchors))
                                                        if model.kv_attentions() else None)}
            rec.update(positions.summary())
            with rt.autocast():   # own-key attention mass and hybrid gate share on the fixed held-out batches
                rec.update(block_attention_diagnostics(model, batch, steps_k) if is_block(model)
                           else attention_diagnostics(model, probe_batches or batch, steps_k))
            if hasattr(model, "gate"):
                g = model.gate().detach()
                rec["gate"] = {"mean": float(g.mean()), "min": float(g.min()), "max": float(g.max())}
            progress["log"].append(rec)
            live.append(rec)
            tok_s = tokens_seen * world / max(time.time() - start, 1e-9)
            bar.set_postfix(loss=round(rec["loss"], 4), acc0=round(rec["acc_k"][0], 3), lr=rec["lr"], tok_s=round(tok_s))
            # the loss log, one flushed line per log_every steps (progress lines fill gaps over 30 s)
            bar.write(f"train {name}: step {step + 1}/{tc['max_steps']} loss {rec['loss']:.4f} "
                      f"acc0 {rec['acc_k'][0]:.3f} lr {rec['lr']:.3g} tokens/s {tok_s:.0f}")
        bar.update(1)
        if eval_every and progress["step"] % eval_every == 0:   # the held-out curve (every rank: same numbers)
            point = heldout_point(model, val_src, head_w, steps_k, decay, tc["batch_size"], tc["eval_batches"],
                                  rt.dtype, progress["step"])
            progress["heldout"].append(point)
            live.append(point)
            bar.write(f"train {name}: step {progress['step']} held-out loss {point['heldout_loss']:.4f} "
                      f"acc0 {point['heldout_acc_k'][0]:.3f}")
            if plateau and plateaued(progress["heldout"], plateau["patience"], plateau["min_delta"],
                                     plateau["min_acc_delta"]):
                progress["stopped_by"] = "plateau"
                break
        if progress["step"] % tc["ckpt_every"] == 0 and progress["step"] < tc["max_steps"]:
            if rank == 0:
                _save_checkpoint(ckpt, model, opt, sched, progress)
            saved_step = progress["step"]
            accel.wait_for_everyone()
        if progress["step"] >= tc["max_steps"]:
            break
        now = time.time()
        over_budget, over_runtime = _any_rank(accel, now - start > 60 * tc["max_minutes"],
                                              deadline is not None and now > deadline)
        if over_runtime:
            progress["stopped_by"] = "runtime"
            if rank == 0:
                _save_checkpoint(ckpt, model, opt, sched, progress)
            accel.wait_for_everyone()
            bar.close()
            msg = (f"train {name}: stopped at step {progress['step']} of {tc['max_steps']}, "
                   f"{tc.get('stop_margin_minutes', 0)} min before the job's {runtime_minutes} min runtime; "
                   f"checkpoint {ckpt}; a rerun resumes from it")
            if rank == 0:
                print(msg, flush=True)
            raise StoppedForRuntime(msg)
        if over_budget:   # the training budget: finish (eval, save) with the steps done
            progress["stopped_by"] = "max_minutes"
            break
    bar.close()
    seconds = time.time() - start
    metrics = {"variant": name, "paradigm": v["paradigm"], "layers": v["layers"], "steps": progress["step"],
               "stopped_by": progress.get("stopped_by", "max_steps"), "seed": rt.seed, "train_samples": n,
               "heldout_curve": progress["heldout"], "heldout_split": heldout_split, "plateau_rule": plateau or None,
               "resumed_from": progress["resumed_from"], "world_size": world, "train_seconds": seconds,
               "train_tokens_per_s": tokens_seen * world / max(seconds, 1e-9),
               "parameters": sum(p.numel() for p in params), "draft_vocab_size": len(model.d2t),
               "dtype": rt.dtype, "device": rt.device}
    if rank == 0:
        metrics["eval"] = evaluate(model, eval_src, head_w, steps_k, tc["batch_size"], tc["eval_batches"],
                                   target if model.kv_attentions() else None, rt.dtype)
        model.save(out_dir, {"metrics.json": metrics, "train_log.json": progress["log"], "variant.json": v})
        shutil.copyfile(live.path, Path(out_dir) / "train_log.jsonl")   # the live log, training and held-out lines
        shutil.rmtree(ckpt.parent, ignore_errors=True)   # the drafter is saved: nothing left to resume
    accel.wait_for_everyone()
    return metrics
