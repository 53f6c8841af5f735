"""The `train_drafter` stage: one TTT trainer for every variant, with checkpoints that
resume bit-identically, NaN guards, bottleneck diagnostics and optional DDP (accelerate).
Precision follows the runtime dtype (`config.drafter_autocast`): bf16 autocast over fp32
parameters and optimizer state, or plain fp32. Given the job's runtime, training
checkpoints and exits (code 75) before it, and the rerun resumes."""
from __future__ import annotations

import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvshot.capture.features import FeatureSource, open_features
from kvshot.capture.target import load_target
from kvshot.config import ConfigError, Runtime
from kvshot.core.io import JsonLines
from kvshot.core.progress import Progress
from kvshot.core.schedule import epoch_order, lr_at, sample_lengths, token_budget
from kvshot.drafters import Drafter
from kvshot.drafters.attention import use_attention
from kvshot.drafters.unroll import Unrolled, is_block, label_positions, training_forward
from kvshot.train.checkpoint import fingerprint, load_checkpoint, restore_checkpoint, save_checkpoint
from kvshot.train.diagnostics import (GradientPositions, attention_summary, attention_totals,
                                      block_attention_diagnostics, block_key_share, diagnostic_batches, grad_norms,
                                      kv_key_share)
from kvshot.train.heldout import all_sum, evaluate, heldout_point, plateaued
from kvshot.train.objective import objective, step_losses, target_labels, weighted_loss
from kvshot.settings import Config, TrainSettings, to_dict
from kvshot.train.variants import (Variant, build_variant, draft_vocab, held_back, param_groups, variant_config,
                                   variant_record)


# ---------------------------------------------------------------- the loss's scale

def loss_denominators(budget: list[float], world: int, device=None) -> torch.Tensor:
    """What each process divides step k's summed per-token loss by: B_k / world (`token_budget`).
    DDP averages the processes' gradients (divides by world again), so every token's weight in
    the objective is decay^k / B_k: the same in every step, length group and world size."""
    return torch.tensor(budget, dtype=torch.float32, device=device) / world


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


def _truncate(batch: dict[str, torch.Tensor], max_len: int) -> dict[str, torch.Tensor]:
    return {k: v[:, :max_len] for k, v in batch.items()}


def _any_rank(accel, *flags: bool) -> list[bool]:
    """Each flag, true if it is on any process (every rank then takes the same branch)."""
    if accel.num_processes == 1:
        return list(flags)
    total = accel.reduce(torch.tensor([float(f) for f in flags], device=accel.device), "sum")
    return [bool(x > 0) for x in total.tolist()]


# ---------------------------------------------------------------- training, phase by phase

@dataclass
class Shared:
    """What every drafter of a job reads alike: the accelerator, the target, the feature sources,
    and the RNG state a drafter is initialised from (the state after loading them, as alone)."""
    accel: object
    target: object
    train_src: FeatureSource
    eval_src: FeatureSource
    val_src: FeatureSource
    heldout_split: str
    val_dir: str
    rng: tuple                  # (torch, python) RNG states right before a drafter is built
    d2t: dict = field(default_factory=dict)   # the draft vocabulary, by (size, samples)


@dataclass
class Run:
    """One variant's training: what `setup` built, and `progress`, what a checkpoint saves."""
    name: str
    v: Variant
    rt: Runtime
    shared: Shared              # the accelerator, target and feature sources (those of its group)
    n: int                      # the train samples read
    model: Drafter
    head_w: torch.Tensor        # the target's LM head: the labels
    groups: dict                # parameter groups for the logged gradient norms
    waiting: list               # parameters kv_warmup_steps hold back
    ddp: torch.nn.Module        # the forward the optimizer steps through (DDP-wrapped under accelerate)
    steps_k: int
    decay: float
    params: list
    opt: torch.optim.Optimizer
    sched: object
    ckpt: Path
    progress: dict
    saved_step: int | None      # the step of the checkpoint on disk a rerun would resume from
    live: JsonLines
    probe_batches: list
    deadline: float | None
    runtime_minutes: float | None
    lengths: list[int] | None   # per train sample, for length-grouped batches
    budget: list[float]         # B_k: step k's loss normaliser for the whole run (`token_budget`)
    denominators: torch.Tensor  # B_k / world, on the device (`loss_denominators`)
    order: tuple[int, list[int]] | None = None   # (epoch, its sample order): built once per epoch
    start: float = field(default_factory=time.time)
    tokens: torch.Tensor | int = 0   # tokens this process trained on since it started (a device tensor)
    steps_here: int = 0              # steps this process trained
    bar: Progress | None = None
    group: list[str] | None = None   # the drafters trained side by side with this one (`train.group`)

    @property
    def tc(self) -> TrainSettings:
        return self.v.train

    @property
    def world(self) -> int:
        return self.shared.accel.num_processes

    @property
    def rank(self) -> int:
        return self.shared.accel.process_index

    def no_good_state(self) -> str:
        return (f"last good checkpoint: step {self.saved_step} at {self.ckpt}" if self.saved_step is not None
                else "no checkpoint yet")


@dataclass
class Step:
    """What one optimization step leaves for its log record: no logits (freed before the
    optimizer step), and the batch only on a logging step that has no probe batches."""
    step: int
    batch: dict | None
    key_share: tuple[float, int] | None   # this process's (kv_key_share, its scored pairs); None: no KV path
    positions: GradientPositions
    norms: dict | None
    totals: list[float]   # summed over processes: the objective, ce_sum_k, correct_k, acc_n_k, scored_k


def open_shared(cfg: Config, rt: Runtime, train_dir: str, eval_dir: str, target_dir: str,
                val_dir: str | None) -> Shared:
    """Seed, the accelerator, the target and the feature sources: once per job."""
    from accelerate import Accelerator

    use_attention(cfg.drafters.attention)
    accel = Accelerator(cpu=rt.device == "cpu")
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
    return Shared(accel=accel, target=target, train_src=train_src, eval_src=eval_src, val_src=val_src,
                  heldout_split=heldout_split, val_dir=val_dir, rng=(torch.get_rng_state(), random.getstate()))


def setup_member(cfg: Config, rt: Runtime, shared: Shared, name: str, train_dir: str, eval_dir: str, target_dir: str,
                 out_dir: str, runtime_minutes: float | None, ckpt_dir: str | None = None,
                 group: list[str] | None = None, embed_from: Drafter | None = None) -> Run:
    """Build one drafter on the shared target and features, make its optimizer, and resume its
    checkpoint (`<out_dir>.ckpt`, or ckpt_dir). group: the job trains several drafters side by
    side (`train.group`): the caller then sets what the batches carry and the probe batches for
    all of them. embed_from: a drafter whose frozen copy of the target's embedding this one shares."""
    v = variant_config(cfg, name)
    tc, dcfg = v.train, cfg.drafters
    deadline = stop_deadline(runtime_minutes, tc.stop_margin_minutes)
    accel, target, train_src, eval_src, val_src = (shared.accel, shared.target, shared.train_src, shared.eval_src,
                                                   shared.val_src)
    world, rank = accel.num_processes, accel.process_index
    n = min(len(train_src), tc.train_samples or len(train_src))   # the data-scaling knob
    if tc.batch_size % world:
        raise ConfigError(f"config: drafters.train.batch_size: {tc.batch_size} is not divisible by {world} processes")
    if n < tc.batch_size:
        raise ConfigError(f"config: drafters.train.batch_size: {tc.batch_size} is more than the {n} train samples")
    key = (dcfg.draft_vocab_size, n)
    if key not in shared.d2t:
        shared.d2t[key] = draft_vocab(train_src, dcfg.draft_vocab_size, target.config.vocab_size, n)
    torch.set_rng_state(shared.rng[0])   # every drafter starts from the RNG state it would see alone
    random.setstate(shared.rng[1])
    model = build_variant(v, target.config, target.model.embed_tokens.weight.detach(), shared.d2t[key],
                          target).to(rt.device)
    if embed_from is not None and _same_frozen(embed_from.embed_tokens.weight, model.embed_tokens.weight):
        model.embed_tokens.weight = embed_from.embed_tokens.weight   # one copy for the group (frozen)
    steps_k, decay = objective(model, dcfg, v)   # TTT: K steps, step_decay; a block: its positions, block_position_decay
    missing = sorted(set(model.cfg.kv_layers) - set(train_src.spec.kv_layers))
    if missing:
        raise ConfigError(f"config: features.kv_layers: variant {name} reads target layers {missing}, "
                          f"which the features do not hold ({list(train_src.spec.kv_layers)})")
    if group is None:
        for src in (train_src, eval_src, val_src):   # batches carry (and online: compute) only what this variant reads
            src.read_only(model.cfg.kv_layers, model.reads_aux_hidden)
    params = [p for p in model.parameters() if p.requires_grad]   # fp32: so is the optimizer state
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s, tc.max_steps, tc.warmup_steps, tc.min_lr_ratio))

    ckpt = Path(ckpt_dir or f"{out_dir}.ckpt") / "checkpoint.pt"
    fp = fingerprint(v, cfg, rt, train_dir, eval_dir, target_dir, shared.val_dir)
    progress = {"step": 0, "epoch": 0, "cursor": 0, "log": [], "heldout": [], "fingerprint": fp,
                "resumed_from": None, "world_size": world}
    saved_step = None
    saved = load_checkpoint(ckpt, fp) if rank == 0 else None
    if world > 1:   # rank 0 decides (and sets aside); every rank then loads the same file or none
        accel.wait_for_everyone()
        resume = _any_rank(accel, saved is not None)[0]
        saved = saved if rank == 0 else (torch.load(ckpt, map_location="cpu", weights_only=False) if resume else None)
    if saved is not None:   # the model was built with the target's frozen tensors: the checkpoint holds the rest
        progress = restore_checkpoint(saved, model, opt, sched)
        progress["resumed_from"] = saved_step = progress["step"]
        if not progress.get("finished"):   # a group member that had finished keeps why it stopped
            progress.pop("stopped_by", None)
        print(f"resuming {name} from step {progress['step']} ({ckpt})", flush=True)
    progress.setdefault("heldout", [])
    progress.setdefault("tokens", 0)      # training tokens of earlier attempts (`tokens_so_far`) and seconds
    progress.setdefault("seconds", 0.0)   # so far: the held-out points' x; a checkpoint older than them starts here
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second fp32 copy
    ddp = training_forward(model) if world == 1 else \
        torch.nn.parallel.DistributedDataParallel(training_forward(model), gradient_as_bucket_view=True)
    live = JsonLines(ckpt.parent / "train_log.jsonl",
                     sorted(progress["log"] + progress["heldout"], key=lambda r: r["step"]), enabled=rank == 0)
    grouping = int(tc.length_grouping or 0)
    lengths = sample_lengths(train_src, n, tc.max_len)
    index = train_src.index
    share = index["assistant_tokens"] / index["tokens"] if index.get("assistant_tokens") and index.get("tokens") else 1.0
    budget = token_budget(lengths, tc.batch_size, steps_k, share)
    return Run(
        name=name, v=v, rt=rt, shared=shared, n=n, model=model, head_w=target.lm_head.weight.detach(),
        groups=param_groups(model), waiting=held_back(model, v), ddp=ddp, steps_k=steps_k, decay=decay, params=params,
        opt=opt, sched=sched, ckpt=ckpt, progress=progress, saved_step=saved_step, live=live,
        # the validation split: held out like eval, and what training-time measurements read (not the eval anchors)
        probe_batches=[] if group else diagnostic_batches(val_src, tc.diagnostic_sequences, tc.max_len, rt.device),
        deadline=deadline, runtime_minutes=runtime_minutes,
        lengths=lengths if grouping > 1 else None, budget=budget,
        denominators=loss_denominators(budget, world, rt.device), group=group)


def _same_frozen(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (not a.requires_grad and not b.requires_grad and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device and torch.equal(a, b))


def setup(cfg: Config, rt: Runtime, name: str, train_dir: str, eval_dir: str, target_dir: str, out_dir: str,
          runtime_minutes: float | None, val_dir: str | None) -> Run:
    """Build the drafter, open the features, make the optimizer, and resume a checkpoint."""
    shared = open_shared(cfg, rt, train_dir, eval_dir, target_dir, val_dir)
    return setup_member(cfg, rt, shared, name, train_dir, eval_dir, target_dir, out_dir, runtime_minutes)


def step_ids(run: Run) -> list[int]:
    """This process's share of the next step's samples (a new epoch when the rest fills no batch)."""
    p, bs = run.progress, run.tc.batch_size
    if p["cursor"] + bs > run.n:
        p["epoch"], p["cursor"] = p["epoch"] + 1, 0
    if run.order is None or run.order[0] != p["epoch"]:
        group = int(run.tc.length_grouping or 0)
        run.order = (p["epoch"], epoch_order(run.n, run.rt.seed, p["epoch"], bs, group, run.lengths))
    return run.order[1][p["cursor"]: p["cursor"] + bs][run.rank::run.world]


def fetch_batch(run: Run, ids: list[int]) -> dict[str, torch.Tensor]:
    """This process's samples `ids`, cut to max_len, on the device (online: the target's forward)."""
    return {k: t.to(run.rt.device) for k, t in _truncate(run.shared.train_src.batch(ids), run.tc.max_len).items()}


def train_step(run: Run, logging: bool, batch: dict[str, torch.Tensor] | None = None) -> Step:
    """One optimization step. The host waits on the device once (the NaN guards, with what
    the log reads), and the processes exchange one small tensor (and DDP its gradients).
    Step k's summed per-token loss is divided by the run's fixed B_k / world (`loss_denominators`),
    not by the step's own token count: every token weighs the same (docs/training.md).
    Memory: the logits, the soft labels and the autograd graph are dropped right after the
    backward, the batch too unless the log reads it, so the optimizer step holds none of them;
    the returned Step holds no logits, and the caller drops it before the next step. batch: the
    step's samples already read (`fetch_batch`; a group's members share it), else read here."""
    tc, model, world, step, k_steps = run.tc, run.model, run.world, run.progress["step"], run.steps_k
    batch = fetch_batch(run, step_ids(run)) if batch is None else batch
    labels = target_labels(batch["last_hidden"], run.head_w, model.d2t, positions=label_positions(batch))
    # on a logging step: which positions the real backward sends gradient from (`diagnostics`), each
    # process sampling its share of the rows one process would
    with GradientPositions(model, enabled=logging, max_rows=-(-GradientPositions.MAX_ROWS // world)) as positions:
        with run.rt.autocast():   # bf16 runtime: bf16 compute over the fp32 parameters; losses in fp32
            un: Unrolled = run.ddp(batch, k_steps)
            losses, counts, correct, acc_n = step_losses(model, un, batch, labels, run.denominators)
            loss = weighted_loss(losses, run.decay)
        loss.backward()   # a non-finite loss stops below, before the update
    key_share = None
    if logging and model.kv_attentions():   # this process's pairs; the log sums them over processes
        key_share = ((block_key_share(un.valid, un.anchors, model.cfg.block_size) if is_block(model)
                      else kv_key_share(un.valid, un.anchors)), sum(int(v.sum()) for v in un.valid))
    # nothing of the forward outlives the backward: not the logits, the soft labels nor the graph
    loss, losses = loss.detach(), [x.detach() for x in losses]
    del un, labels
    tokens = batch["attention_mask"].sum()
    if not (logging and not run.probe_batches):   # the log measures on this batch only without probe batches
        batch = None
    if step < int(run.v.kv_warmup_steps or 0):   # hybrid-warm: no update outside the KV branch yet
        for p in run.waiting:                              # (AdamW skips grad None)
            p.grad = None
    norms = grad_norms(run.groups) if logging else None
    total_norm = torch.nn.utils.clip_grad_norm_(run.params, tc.grad_clip)
    # per step: the summed per-token loss (the log's per-token mean divides it by the summed count)
    ce_sums = torch.stack(losses).float() * run.denominators
    local = torch.cat([(~torch.isfinite(loss)).float().view(1), loss.float().view(1), ce_sums,
                       torch.stack(correct).float(), torch.stack(acc_n).float(), torch.stack(counts).float()])
    # gradients are all-reduced: every process has the same norm
    totals = torch.cat([all_sum(local, world), total_norm.detach().float().view(1).to(local.device)]).tolist()
    if totals[0] > 0:
        raise FloatingPointError(f"train {run.name}: loss is {totals[1] / world} at step {step}; "
                                 f"{run.no_good_state()}")
    if not math.isfinite(totals[-1]):
        raise FloatingPointError(f"train {run.name}: gradient norm is {totals[-1]} at step {step}; "
                                 f"{run.no_good_state()}")
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    run.progress["cursor"] += tc.batch_size
    run.progress["step"] = step + 1
    run.tokens = run.tokens + tokens
    run.steps_here += 1
    return Step(step, batch, key_share, positions, norms, totals[1:-1])


def shared_diagnostics(run: Run, s: Step) -> dict:
    """The bottleneck diagnostics of a logging step over the whole global batch, every process
    doing its share once: the key share and the gradient positions from each process's own
    sequences, the attention diagnostics on the fixed probe batches, batch i on process
    i % world (a block's: the first probe batch, on process 0); their sums and counts are
    all-reduced in one tensor (every process calls this). Without probe batches the attention
    diagnostics read process 0's training sequences."""
    model, k, world = run.model, run.steps_k, run.world
    key = [s.key_share[0] * s.key_share[1], s.key_share[1]] if s.key_share else [0.0, 0]
    grads = s.positions.totals()
    batches = run.probe_batches or ([s.batch] if s.batch is not None else [])
    with run.rt.autocast():   # own-key attention mass and hybrid gate share on the fixed held-out batches
        if is_block(model):
            got = block_attention_diagnostics(model, batches[0], k) if run.rank == 0 and batches else {}
            per_k = got.get("kv_own_key_mass_k") or [None] * k
            attention = [float(bool(got)), *[x or 0.0 for x in per_k], *[float(x is not None) for x in per_k]]
        else:
            attention = attention_totals(model, batches, k, rank=run.rank, world=world)
    local = torch.tensor([*key, *grads, *attention], dtype=torch.float64, device=run.shared.accel.device)
    flat = all_sum(local, world).tolist()
    key, grads, attention = flat[:2], flat[2: 2 + len(grads)], flat[2 + len(grads):]
    rec = {"kv_key_share": key[0] / max(key[1], 1) if model.kv_attentions() else None}
    rec.update(GradientPositions.summarize(grads))
    if is_block(model):
        if attention[0] > 0:
            per_k = [v / d if d else None for v, d in zip(attention[1: 1 + k], attention[1 + k:])]
            defined = [x for x in per_k if x is not None]
            rec.update({"kv_own_key_mass_k": per_k,
                        "kv_own_key_mass": sum(defined) / len(defined) if defined else None})
    else:
        rec.update(attention_summary(model, attention, k))
    return rec


def log(run: Run, s: Step) -> None:
    """A logging step's record (train_log, the live log, the log line), over every process's
    sequences: `loss` and `loss_k` the per-token means of the soft cross-entropy (as the held-out
    curve's), `objective` what the step minimized (sum_k decay^k ce_sum_k / B_k, docs/training.md),
    acc_k, and the bottleneck diagnostics. Every process calls it (the diagnostics all-reduce)."""
    k, world, model = run.steps_k, run.world, run.model
    objective, ce_k = s.totals[0] / world, s.totals[1: 1 + k]
    correct, acc_n, scored = s.totals[1 + k: 1 + 2 * k], s.totals[1 + 2 * k: 1 + 3 * k], s.totals[1 + 3 * k:]
    loss_k = [c / max(n, 1) for c, n in zip(ce_k, scored)]
    loss = sum(run.decay ** i * x for i, x in enumerate(loss_k))
    rec = {"step": s.step, "lr": run.sched.get_last_lr()[0], "loss": loss, "loss_k": loss_k, "objective": objective,
           "acc_k": [c / max(a, 1) for c, a in zip(correct, acc_n)], "grad_norm": s.norms}
    rec.update(shared_diagnostics(run, s))
    if hasattr(model, "gate"):
        g = model.gate().detach()
        rec["gate"] = {"mean": float(g.mean()), "min": float(g.min()), "max": float(g.max())}
    run.progress["log"].append(rec)
    run.live.append(rec)
    tok_s = int(run.tokens) * world / max(time.time() - run.start, 1e-9)
    run.bar.set_postfix(loss=round(loss, 4), acc0=round(rec["acc_k"][0], 3), lr=rec["lr"], tok_s=round(tok_s))
    # the loss log, one flushed line per log_every steps (progress lines fill gaps over 30 s)
    run.bar.write(f"train {run.name}: step {s.step + 1}/{run.tc.max_steps} loss {loss:.4f} "
                  f"acc0 {rec['acc_k'][0]:.3f} lr {rec['lr']:.3g} tokens/s {tok_s:.0f}")


def heldout_due(run: Run) -> bool:
    """An eval_every step without its held-out point (also one resumed from the checkpoint
    written just before that point: a crash in the evaluation loses no training)."""
    every, p = run.tc.eval_every or 0, run.progress
    due = (bool(every) and p["step"] % every == 0) or p["step"] in (run.tc.eval_steps or ())
    return due and p["step"] > 0 and not (p["heldout"] and p["heldout"][-1]["step"] == p["step"])


def evaluate_heldout(run: Run) -> bool:
    """A point of the held-out curve, each process on its share of the batches; True when the
    plateau rule stops training (every process decides alike on the same all-reduced numbers)."""
    tc, step = run.tc, run.progress["step"]
    point = heldout_point(run.model, run.shared.val_src, run.head_w, run.steps_k, run.decay, tc.batch_size,
                          tc.eval_batches, run.rt.dtype, step, rank=run.rank, world=run.world)
    # where on the learning curve: tokens and seconds trained so far, over resumes (not the evaluation's)
    point.update(train_tokens=tokens_so_far(run), train_seconds=round(run.progress["seconds"], 3))
    run.progress["heldout"].append(point)
    run.live.append(point)
    run.bar.write(f"train {run.name}: step {step} held-out loss {point['heldout_loss']:.4f} "
                  f"acc0 {point['heldout_acc_k'][0]:.3f}")
    plateau = tc.plateau
    return plateau is not None and plateaued(run.progress["heldout"], plateau.patience, plateau.min_delta,
                                             plateau.min_acc_delta)


def tokens_so_far(run: Run) -> int:
    """Training tokens over every attempt (all processes): progress["tokens"] holds the earlier
    attempts' and stays put during this one (a device read here, not one per step)."""
    return run.progress["tokens"] + int(run.tokens) * run.world


def checkpoint(run: Run) -> None:
    if run.rank == 0:   # the saved progress counts this attempt's tokens in
        save_checkpoint(run.ckpt, run.model, run.opt, run.sched, {**run.progress, "tokens": tokens_so_far(run)})
    run.saved_step = run.progress["step"]
    run.shared.accel.wait_for_everyone()


def stop_for_time(run: Run) -> str | None:
    """'runtime' past the job's deadline (checkpoint and raise StoppedForRuntime), 'max_minutes'
    past the training budget (finish with the steps done), on any process; else None."""
    now = time.time()
    over_budget, over_runtime = _any_rank(run.shared.accel, now - run.start > 60 * run.tc.max_minutes,
                                          run.deadline is not None and now > run.deadline)
    return "runtime" if over_runtime else "max_minutes" if over_budget else None


def stop_for_runtime(run: Run) -> None:
    run.progress["stopped_by"] = "runtime"
    checkpoint(run)
    run.bar.close()
    msg = (f"train {run.name}: stopped at step {run.progress['step']} of {run.tc.max_steps}, "
           f"{run.tc.stop_margin_minutes} min before the job's {run.runtime_minutes} min runtime; "
           f"checkpoint {run.ckpt}; a rerun resumes from it")
    if run.rank == 0:
        print(msg, flush=True)
    raise StoppedForRuntime(msg)


def finish(run: Run, out_dir: str, remove_checkpoint: bool = True) -> dict:
    """The final teacher-forced evaluation (every process its share), metrics.json and the
    saved drafter; the checkpoint goes (a group removes its members' once all are saved)."""
    seconds, p, tc, model = time.time() - run.start, run.progress, run.tc, run.model
    plateau = to_dict(tc.plateau) if tc.plateau is not None else None
    metrics = {"variant": run.name, "paradigm": run.v.paradigm, "layers": run.v.layers, "steps": p["step"],
               "stopped_by": p.get("stopped_by", "max_steps"), "seed": run.rt.seed, "train_samples": run.n,
               "heldout_curve": p["heldout"], "heldout_split": run.shared.heldout_split, "plateau_rule": plateau or None,
               "resumed_from": p["resumed_from"], "world_size": run.world, "train_seconds": seconds,
               "train_tokens_per_s": int(run.tokens) * run.world / max(seconds, 1e-9),
               "loss_budget": run.budget,   # B_k: each step's loss normaliser (docs/training.md)
               "parameters": sum(x.numel() for x in run.params), "draft_vocab_size": len(model.d2t),
               "dtype": run.rt.dtype, "device": run.rt.device}
    if run.group and len(run.group) > 1:   # trained side by side, on the same batches (`train.group`)
        metrics["group"] = run.group
    metrics["eval"] = evaluate(model, run.shared.eval_src, run.head_w, run.steps_k, tc.batch_size, tc.eval_batches,
                               run.shared.target if model.kv_attentions() else None, run.rt.dtype,
                               rank=run.rank, world=run.world)
    if run.rank == 0:
        model.save(out_dir, {"metrics.json": metrics, "train_log.json": p["log"], "variant.json": variant_record(run.v)})
        shutil.copyfile(run.live.path, Path(out_dir) / "train_log.jsonl")   # the live log, training and held-out lines
        if remove_checkpoint:   # the drafter is saved: nothing left to resume
            shutil.rmtree(run.ckpt.parent, ignore_errors=True)
    run.shared.accel.wait_for_everyone()
    return metrics


def train_variant(cfg: Config, rt: Runtime, name: str, train_dir: str, eval_dir: str, target_dir: str,
                  out_dir: str, runtime_minutes: float | None = None, val_dir: str | None = None) -> dict:
    """Train one variant. runtime_minutes: the job's wall-clock limit; past it less
    `stop_margin_minutes` (from process start) training checkpoints and raises StoppedForRuntime.
    val_dir: the validation features the held-out curve and plateau stop read (the pipeline's
    results/features/val, disjoint from the evaluation's conversations); None reads eval_dir's
    instead, recorded as metrics `heldout_split: eval`. eval_dir: the final teacher-forced
    metrics (metrics `eval`), which steer nothing."""
    run = setup(cfg, rt, name, train_dir, eval_dir, target_dir, out_dir, runtime_minutes, val_dir)
    tc, p = run.tc, run.progress
    run.bar = Progress(total=tc.max_steps, initial=p["step"], desc=f"train {name}", unit="step",
                       disable=run.rank != 0)
    run.model.train()
    while True:   # after each step: its checkpoint, then its held-out point, then the stops
        if heldout_due(run) and evaluate_heldout(run):
            p["stopped_by"] = "plateau"
            break
        if p["step"] >= tc.max_steps:
            break
        if run.steps_here:   # each attempt trains at least one step
            stop = stop_for_time(run)
            if stop == "runtime":
                stop_for_runtime(run)
            if stop == "max_minutes":   # the training budget: finish (eval, save) with the steps done
                p["stopped_by"] = "max_minutes"
                break
        logging = p["step"] % tc.log_every == 0 or p["step"] + 1 == tc.max_steps
        started = time.perf_counter()
        s = train_step(run, logging)
        if logging:
            log(run, s)
        p["seconds"] += time.perf_counter() - started   # training only, over resumes
        del s   # nothing of this step is alive while the next one runs
        run.bar.update(1)
        if p["step"] % tc.ckpt_every == 0 and p["step"] < tc.max_steps:
            checkpoint(run)
    run.bar.close()
    return finish(run, out_dir)
