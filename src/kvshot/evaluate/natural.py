"""The natural protocol's step-wise scoring at one target pass per conversation.

The target_continuations stage writes every anchor's branch (`branches`); here one target
forward over a batch of real conversations gives every anchor's context, and each drafter
drafts from all of its anchors in one teacher-forced unroll on their branches
(`unroll.branch_unroll`). A greedy chain that accepted steps 0..k-1 read exactly the branch's
tokens, so conditional alpha_k counts step k on the rows whose steps 0..k-1 matched (the
cumulative product `chain_counts` takes), and acc_k comes out of the same pass.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from kvshot.capture.features import pad_batch
from kvshot.capture.target import target_forward
from kvshot.config import drafter_autocast
from kvshot.core.io import DataError, read_json
from kvshot.core.progress import progress
from kvshot.drafters import Drafter
from kvshot.drafters.unroll import branch_unroll
from kvshot.evaluate.branches import rollout

Results = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # anchors t, chain-correct [N, K], teacher-forced [N, K]


def scored_anchors(conv: dict, steps: int, rollout_tokens: int, eos_id: int | None) -> list[int]:
    """Indices of a conversation's anchors whose rollout holds all K steps' inputs: as the
    per-anchor protocol, a rollout that ends at EOS before K tokens is not scored."""
    return [i for i, br in enumerate(conv["branches"]) if len(rollout(br, rollout_tokens, eos_id)) >= steps]


@torch.no_grad()
def natural_results(drafters: list[Drafter], target, convs: list[dict], aux_layers: tuple[int, ...], steps: int,
                    rollout_tokens: int, eos_id: int | None, batch_size: int, device: str,
                    dtype: str = "float32") -> Iterator[list[Results]]:
    """Per conversation (in order), one `Results` per drafter: a batch of conversations costs
    one target forward over their real text for every drafter and anchor."""
    kv_layers = tuple(sorted({l for d in drafters for l in d.cfg.kv_layers}))
    for i in progress(range(0, len(convs), batch_size), desc="stepwise natural", unit="batch"):
        group = convs[i: i + batch_size]
        keep = [scored_anchors(c, steps, rollout_tokens, eos_id) for c in group]
        anchors = [torch.tensor([c["anchors"][j] for j in kept], dtype=torch.long) for c, kept in zip(group, keep)]
        empty = torch.zeros(0, steps, dtype=torch.bool)
        if not any(len(a) for a in anchors):
            yield from ([(a, empty, empty)] * len(drafters) for a in anchors)
            continue
        live = [b for b, a in enumerate(anchors) if len(a)]   # only conversations with an anchor to score
        seqs = [torch.tensor(group[b]["ids"], dtype=torch.long) for b in live]
        batch = pad_batch([{"input_ids": s, "loss_mask": torch.ones_like(s, dtype=torch.uint8)} for s in seqs])
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        width = ids.shape[1]
        rows = torch.cat([r * width + anchors[b] for r, b in enumerate(live)]).to(device)
        branch = torch.tensor([group[b]["branches"][j][: steps + 1] for b in live for j in keep[b]],
                              dtype=torch.long, device=device)
        ctx = target_forward(target, ids, mask, aux_layers, kv_layers)
        feats = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask, "aux_hidden": ctx.aux_hidden}
        for l in kv_layers:
            feats[f"key_{l}"], feats[f"value_{l}"] = ctx.keys[l], ctx.values[l]
        want = branch[:, 1: steps + 1]                                       # the target's token after each input
        counts = [len(anchors[b]) for b in live]
        per_drafter = []
        for d in drafters:
            d.eval()
            with drafter_autocast(device, dtype):
                out = branch_unroll(d, feats, rows, branch, steps)
            drafted = torch.stack([d.d2t[out.logits[k][0].argmax(-1)] for k in range(steps)], dim=1)
            parts = dict(zip(live, (drafted == want).cpu().split(counts)))
            per_drafter.append([(a, parts.get(b, empty), parts.get(b, empty)) for b, a in enumerate(anchors)])
        yield from (list(r) for r in zip(*per_drafter))


def by_anchor(keyed_results: Iterable[tuple[object, list[Results]]], n_drafters: int) -> list[dict]:
    """Per drafter, {(sequence key, t): (chain length, teacher-forced row)} from (key, one `Results`
    per drafter) pairs: what two scorings of the same anchors must agree on (tests, benchmarks/natural.py)."""
    out: list[dict] = [{} for _ in range(n_drafters)]
    for key, per_drafter in keyed_results:
        for d, (rows, chain_ok, forced_ok) in enumerate(per_drafter):
            for r, t in enumerate(rows.tolist()):
                out[d][(key, t)] = (int(torch.cumprod(chain_ok[r].long(), 0).sum()), forced_ok[r].tolist())
    return out


def branch_repetition(convs: list[dict], rollout_tokens: int, eos_id: int | None, n: int = 4) -> dict:
    """`references.repetition_share` of every anchor's rollout after its real prefix, without
    rescanning the prefix per anchor: an n-gram ending in the rollout repeats if the real text
    <= t holds it (its first end there <= t) or the rollout completed it earlier."""
    repeated = total = 0
    for conv in convs:
        ids = conv["ids"]
        first_end: dict = {}
        for i in range(n - 1, len(ids)):
            first_end.setdefault(tuple(ids[i - n + 1: i + 1]), i)
        for a, br in zip(conv["anchors"], conv["branches"]):
            cont = rollout(br, rollout_tokens, eos_id)
            seq = ids[: a + 1] + cont
            local = set()
            for i in range(max(a + 1, n - 1), len(seq)):
                gram = tuple(seq[i - n + 1: i + 1])
                repeated += first_end.get(gram, len(ids)) <= a or gram in local
                local.add(gram)
            total += len(cont)
    return {"share": repeated / total if total else float("nan"), "repeated": repeated, "tokens": total, "ngram": n}


def read_natural(path: str) -> dict:
    """The natural protocol's file (target_continuations --natural-out): its conversations
    with their anchors and branches; anything else is one DataError line naming it."""
    redo = "delete it and rerun: Snakemake remakes it with target_continuations"
    try:
        nat = read_json(path)
    except ValueError as e:
        raise DataError(f"{path}: not a complete JSON file ({' '.join(str(e).split())[:120]}); {redo}") from e
    convs = nat.get("conversations") if isinstance(nat, dict) else None
    if not isinstance(convs, list) or not all(
            isinstance(c, dict) and isinstance(c.get("ids"), list) and isinstance(c.get("anchors"), list)
            and isinstance(c.get("branches"), list) and len(c["anchors"]) == len(c["branches"]) for c in convs):
        raise DataError(f"{path}: expected {{'conversations': [{{'ids', 'anchors', 'branches'}}]}} (one branch per "
                        f"anchor); {redo}")
    return nat
