"""Teacher-forced evaluation on a held-out split: the trainer's held-out curve, its plateau
stop, and the final `metrics.json` `eval`. Under DDP each process evaluates its share of
every batch and the sums are all-reduced, so every process gets the numbers one process
would (within float rounding)."""
from __future__ import annotations

import torch

from kvshot.capture.features import FeatureSource
from kvshot.capture.target import target_queries
from kvshot.config import drafter_autocast
from kvshot.drafters import Drafter
from kvshot.drafters.unroll import any_unroll, label_positions
from kvshot.train.objective import query_cosine, step_losses, target_labels, weighted_loss


def all_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    """The sum over processes (every process gets it); one process: `t` itself."""
    if world > 1:
        t = t.clone()
        torch.distributed.all_reduce(t, torch.distributed.ReduceOp.SUM)
    return t


def batch_ids(n: int, batch_size: int, max_batches: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """Each evaluated batch's sample ids for this process: batches of `batch_size` in order
    (the first `max_batches`), each cut into `world` shares of batch_size // world (rounded up;
    a short last batch can leave a process an empty share)."""
    share = -(-batch_size // world)
    out = []
    for start in range(0, n, batch_size):
        if len(out) >= max_batches:
            break
        ids = list(range(start, min(start + batch_size, n)))
        out.append(ids[rank * share: (rank + 1) * share])
    return out


@torch.no_grad()
def evaluate(model: Drafter, source: FeatureSource, head_w: torch.Tensor, steps: int, batch_size: int,
             max_batches: int, target=None, dtype: str = "float32", *, rank: int = 0, world: int = 1) -> dict:
    """Teacher-forced metrics per step on the eval split: loss_k, acc_k, and the query error.
    Batches move to the drafter's device; it runs in the runtime `dtype`'s precision, as in training.
    batch_size is global: under DDP (rank, world; torch.distributed initialized) each process
    reads its share of each batch and every process returns the same all-reduced numbers."""
    model.eval()
    device = model.d2t.device
    kv = model.kv_attentions()
    layers = [l for l, _ in kv]
    shares = batch_ids(len(source), batch_size, max_batches, rank, world)
    # float64 sums, as the Python floats they were: one process gives the numbers it always did
    sums = torch.zeros(4, steps, dtype=torch.float64, device=device)         # loss * n, n, correct, acc_n
    cos = torch.zeros(len(shares), 2 * steps + 1, dtype=torch.float64, device=device)  # per batch: cos * n, n, any
    for b, ids in enumerate(shares):
        if not ids:
            continue
        batch = {k: v.to(device) for k, v in source.batch(ids).items()}
        labels = target_labels(batch["last_hidden"], head_w, model.d2t, positions=label_positions(batch))
        with drafter_autocast(device.type, dtype):
            un = any_unroll(model, batch, steps, keep_queries=bool(kv) and target is not None)   # a block: block_unroll
            losses, counts, correct, acc_n = step_losses(model, un, batch, labels)
        counts = torch.stack(counts).double()
        sums += torch.stack([torch.stack(losses).double() * counts, counts,
                             torch.stack(correct).double(), torch.stack(acc_n).double()])
        if un.queries:   # the batch's cosine, token-weighted so that shares add up to the whole batch's
            tq = target_queries(target, batch["input_ids"].long(), batch["attention_mask"], layers)
            n = torch.stack([v.sum() for v in un.valid]).double()
            cos[b] = torch.cat([torch.tensor(query_cosine(un, tq, layers), dtype=torch.float64, device=device) * n,
                                n, n.new_ones(1)])
    flat = all_sum(torch.cat([sums.flatten(), cos.flatten()]), world).cpu()
    sums, cos = flat[: sums.numel()].view_as(sums), flat[sums.numel():].view_as(cos)
    model.train()
    loss_n, n, correct, acc_n = sums.tolist()
    cos = cos[cos[:, -1] > 0]
    return {
        "loss": [l / max(c, 1) for l, c in zip(loss_n, n)],
        "acc": [c / max(a, 1) for c, a in zip(correct, acc_n)],
        "acc_note": "teacher-forced top-1 agreement with the target's greedy token (acc_k), not alpha_k",
        "tokens": [int(a) for a in acc_n],
        "query_cosine": ((cos[:, :steps] / cos[:, steps: 2 * steps].clamp(min=1)).mean(0).tolist()
                         if len(cos) else None),
    }


def heldout_point(model: Drafter, source: FeatureSource, head_w: torch.Tensor, steps: int, decay: float,
                  batch_size: int, batches: int, dtype: str, step: int, *, rank: int = 0, world: int = 1) -> dict:
    """One point of the held-out curve: the TTT objective and acc_k on the first validation batches."""
    ev = evaluate(model, source, head_w, steps, batch_size, batches, None, dtype, rank=rank, world=world)
    return {"step": step, "heldout_loss": float(weighted_loss(torch.tensor(ev["loss"]), decay)),
            "heldout_loss_k": ev["loss"], "heldout_acc_k": ev["acc"]}


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
