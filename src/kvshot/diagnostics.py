"""Training diagnostics that measure what the paper's mechanism claims are about, on the batch
in hand (no_grad, a logging step only):

kv_own_key_mass  per draft step k, the attention probability that KV-path queries put on the
                 drafter's own keys (the diagonal keys its W_K/W_V project from the drafted
                 tokens) against the target's copied prefix keys; averaged over heads, KV-path
                 layers and the rows whose step k has a label. The paper's sparse-gradient
                 argument needs this mass to be small; the length formula (k+1)/(t+k+2)
                 cannot tell, since it ignores what the queries attend to.
gate_share       per hybrid layer, |g * delta| / |h|: the norm of the gated KV correction
                 against the hidden state it is added to, averaged over the same rows. g alone
                 can stay at 0.5 while delta is negligible.

Both come from one plain K-step unroll (`ttt.reference_unroll`'s loop) over a few sequences of
the batch, with the probabilities from `attention.reference_attention` on a subsample of rows.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor

from .drafters import Drafter
from .drafters.attention import reference_attention
from .drafters.skeleton import Diagonal, stacked
from .ttt import assistant_tokens, context, shift


def own_key_mass(q: Tensor, prefix_k: Tensor, visible: Tensor, diag: Diagonal | None) -> Tensor:
    """[B, H, Tq]: each query row's attention probability on its own (diagonal) keys. The
    reference attention with values 0 on the prefix keys and 1 on the diagonal keys returns
    exactly that sum of probabilities."""
    if diag is None:
        return q.new_zeros(q.shape[:3], dtype=torch.float32)
    f = lambda x: x.float()   # noqa: E731  (probabilities in fp32 whatever the runtime dtype)
    out = reference_attention(f(q), f(prefix_k), torch.zeros_like(f(prefix_k)), visible, f(diag.k),
                              torch.ones_like(f(diag.v)), diag.steps, 1.0 / math.sqrt(q.shape[-1]))
    return out[..., 0]


class _Recorder:
    """Sums per (step, layer) over the rows that step k scores."""

    def __init__(self, steps: int, max_rows: int):
        self.steps, self.max_rows = steps, max_rows
        self.step = 0
        self.rows: Tensor | None = None        # [B, T] bool: rows with a label at the current step
        self.mass: dict[tuple[int, int], list[float]] = {}
        self.gate: dict[int, list[float]] = {}

    def sample(self, tq: int, device) -> Tensor:
        """An even subsample of at most max_rows row indices (the reference holds [H, rows, keys])."""
        if tq <= self.max_rows:
            return torch.arange(tq, device=device)
        return torch.linspace(0, tq - 1, self.max_rows, device=device).round().long().unique()

    def attend(self, layer: int, q: Tensor, prefix, mask, diag) -> None:
        diag = stacked(diag) if isinstance(diag, list) else diag
        rows = self.sample(q.shape[2], q.device)
        if diag is not None and diag.steps:
            raise ValueError("own-key mass: the diagnostic unroll runs step by step (diagonal keys per step)")
        sub = None if diag is None else Diagonal(diag.k[:, :, :, rows], diag.v[:, :, :, rows])
        mass = own_key_mass(q[:, :, rows], prefix.k, mask.visible()[:, rows], sub).mean(1)   # [B, R] over heads
        keep = self.rows[:, rows]
        acc = self.mass.setdefault((self.step, layer), [0.0, 0])
        acc[0] += float(mass[keep].sum())
        acc[1] += int(keep.sum())

    def gated(self, layer: int, h: Tensor, correction: Tensor) -> None:
        ratio = correction.float().norm(dim=-1) / h.float().norm(dim=-1).clamp(min=1e-12)   # [B, T]
        acc = self.gate.setdefault(layer, [0.0, 0])
        acc[0] += float(ratio[self.rows].sum())
        acc[1] += int(self.rows.sum())

    def summary(self) -> dict:
        out = {}
        if self.mass:
            per_step = []
            for k in range(self.steps):
                parts = [v for (s, _), v in self.mass.items() if s == k]
                n = sum(c for _, c in parts)
                per_step.append(sum(m for m, _ in parts) / n if n else None)
            defined = [x for x in per_step if x is not None]
            out["kv_own_key_mass_k"] = per_step
            out["kv_own_key_mass"] = sum(defined) / len(defined) if defined else None
        if self.gate:
            out["gate_share"] = [self.gate[i][0] / self.gate[i][1] if self.gate[i][1] else None
                                 for i in sorted(self.gate)]
        return out


@contextmanager
def _recording(model: Drafter, rec: _Recorder):
    """Route every KV-path attention through `rec` (beside the real call, whose output is
    used) and hand the hybrid's gated corrections to it; undone on exit."""
    patched = []
    for layer, (_, attn) in enumerate(model.kv_attentions()):
        def attend(q, prefix, mask, diag, _attn=attn, _layer=layer):
            rec.attend(_layer, q, prefix, mask, diag)
            return type(_attn).attend(_attn, q, prefix, mask, diag)
        attn.attend = attend     # instance attribute: shadows the method for this module only
        patched.append(attn)
    had_probe = hasattr(model, "gate_probe")
    if had_probe:
        model.gate_probe = rec.gated
    try:
        yield rec
    finally:
        for attn in patched:
            del attn.attend
        if had_probe:
            model.gate_probe = None


@torch.no_grad()
def attention_diagnostics(model: Drafter, batch: dict[str, Tensor], steps: int, sequences: int = 2,
                          max_rows: int = 128) -> dict:
    """`kv_own_key_mass` (mean over steps) with `kv_own_key_mass_k` (per step), and for a hybrid
    `gate_share` (per layer), on the first `sequences` sequences of the batch that have a scored
    row; empty for a drafter with neither, or a batch with no scored row. Teacher-forced, every
    anchor, as training computes the loss."""
    if not model.kv_attentions() and not hasattr(model, "gate_probe"):
        return {}
    labelled = shift(assistant_tokens(batch), 2, False).any(1)   # sequences with a scored row at step 0
    chosen = labelled.nonzero().view(-1)[:sequences]
    if len(chosen) == 0:
        return {}
    sub = {k: v[chosen] for k, v in batch.items()}
    ids = sub["input_ids"].long()
    anchors = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    rec = _Recorder(steps, max_rows)
    with _recording(model, rec):
        state = model.begin(context(sub, model.compute_dtype()), anchors)
        for k in range(steps):
            rec.step, rec.rows = k, shift(assistant_tokens(sub), k + 2, False)
            model.step(state, shift(ids, k + 1), anchors + k + 1, k)
    return rec.summary()
