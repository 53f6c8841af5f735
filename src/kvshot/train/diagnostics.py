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

Both come from one plain K-step unroll (`unroll.reference_unroll`'s loop) per diagnostic batch,
with the probabilities from `attention.reference_attention` on a subsample of rows. The gate
share pools the scored rows of several held-out batches (train.diagnostic_sequences) into one
log point; the costlier own-key mass is read on the first of them. Under DDP the trainer
shards the batches over the processes and all-reduces the sums (`attention_totals`).

kv_grad_positions / query_grad_positions  (`GradientPositions`, from the real backward of a
                 logging step) per scored query row of a KV-path attention, the effective number
                 of attended positions whose gradient reaches the drafter's W_K/W_V (its own,
                 drafted keys: the copied prefix KV passes gradient to nothing) against those
                 whose gradient reaches W_Q/W_O (every attended key and value); their per-row
                 ratio is `kv_grad_position_ratio`. This is the paper's sparse-gradient
                 mechanism counted where it acts, not a ratio of parameter-gradient norms.
                 Under DDP each process samples its share of the rows and the sums are
                 all-reduced (`GradientPositions.totals`, `summarize`).

The logs also carry each parameter group's gradient norm (`grad_norms`) and the length formula's
key share (`kv_key_share` for a chain, `block_key_share` for a block).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import Tensor

from kvshot.drafters import Drafter
from kvshot.drafters.attention import reference_attention
from kvshot.drafters.skeleton import Diagonal, stacked
from kvshot.drafters.unroll import assistant_tokens, block_unroll, context, labelled_rows, shift


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
    """Sums per (step, layer) over the rows that step k scores: own-key mass [step][layer] and
    gate share [layer], each a [sum, count], and how often each was recorded."""

    def __init__(self, steps: int, max_rows: int, kv_layers: int, gate_layers: int):
        self.steps, self.max_rows = steps, max_rows
        self.step = 0
        self.rows: Tensor | None = None        # [B, T] bool: rows with a label at the current step
        self.mass_calls = 0
        self.mass = [[[0.0, 0] for _ in range(kv_layers)] for _ in range(steps)]
        self.gate = [[0.0, 0, 0] for _ in range(gate_layers)]   # sum, count, calls

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
        acc = self.mass[self.step][layer]
        acc[0] += float(mass[keep].sum())
        acc[1] += int(keep.sum())
        self.mass_calls += 1

    def gated(self, layer: int, h: Tensor, correction: Tensor) -> None:
        ratio = correction.float().norm(dim=-1) / h.float().norm(dim=-1).clamp(min=1e-12)   # [B, T]
        acc = self.gate[layer]
        acc[0] += float(ratio[self.rows].sum())
        acc[1] += int(self.rows.sum())
        acc[2] += 1

    def totals(self) -> list[float]:
        """[mass calls, mass sums [step][layer], mass counts [step][layer], gate (sum, count, calls)
        per layer]: what processes add up (`attention_summary` reads it)."""
        return [float(self.mass_calls), *[m[0] for per in self.mass for m in per],
                *[float(m[1]) for per in self.mass for m in per], *[float(x) for g in self.gate for x in g]]


def _layers(model: Drafter) -> tuple[int, int]:
    """(KV-path attentions, gated hybrid layers) of a drafter: the shape of its totals."""
    return len(model.kv_attentions()), (model.cfg.num_layers if hasattr(model, "gate_probe") else 0)


def attention_summary(model: Drafter, totals: list[float], steps: int) -> dict:
    """`attention_diagnostics`' record from `attention_totals` (one process's, or their sum)."""
    kv, gates = _layers(model)
    if not totals:
        return {}
    calls, cells = totals[0], steps * kv
    sums, counts, gate = totals[1: 1 + cells], totals[1 + cells: 1 + 2 * cells], totals[1 + 2 * cells:]
    out = {}
    if calls > 0:
        per_step = []
        for k in range(steps):
            n = sum(counts[k * kv: (k + 1) * kv])
            per_step.append(sum(sums[k * kv: (k + 1) * kv]) / n if n else None)
        defined = [x for x in per_step if x is not None]
        out["kv_own_key_mass_k"] = per_step
        out["kv_own_key_mass"] = sum(defined) / len(defined) if defined else None
    called = [(gate[3 * i], gate[3 * i + 1]) for i in range(gates) if gate[3 * i + 2] > 0]
    if called:
        out["gate_share"] = [m / n if n else None for m, n in called]
    return out


@contextmanager
def _recording(model: Drafter, rec: _Recorder, attend: bool = True):
    """Route every KV-path attention through `rec` (beside the real call, whose output is
    used; attend=False: not) and hand the hybrid's gated corrections to it; undone on exit."""
    patched = []
    for layer, (_, attn) in enumerate(model.kv_attentions() if attend else []):
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
def attention_diagnostics(model: Drafter, batches: dict[str, Tensor] | list[dict[str, Tensor]], steps: int,
                          sequences: int = 2, max_rows: int = 128) -> dict:
    """`kv_own_key_mass` (mean over steps) with `kv_own_key_mass_k` (per step) on the first batch,
    and for a hybrid `gate_share` (per layer) pooled over the scored rows of every batch given (one
    batch or a list: the log point's diagnostic batches), each on its first `sequences` sequences
    that have a scored row; empty for a drafter with neither, or batches with no scored row.
    Teacher-forced, every anchor, as training computes the loss."""
    return attention_summary(model, attention_totals(model, batches, steps, sequences, max_rows), steps)


@torch.no_grad()
def attention_totals(model: Drafter, batches: dict[str, Tensor] | list[dict[str, Tensor]], steps: int,
                     sequences: int = 2, max_rows: int = 128, *, rank: int = 0, world: int = 1) -> list[float]:
    """The sums `attention_diagnostics` averages (`attention_summary` reads them), over this
    process's share of the batches: batch i on process i % world, so the own-key mass (first
    batch) on process 0. Summed over the processes they are one process's sums over every batch.
    [] for a drafter with neither diagnostic."""
    if not model.kv_attentions() and not hasattr(model, "gate_probe"):
        return []
    rec = _Recorder(steps, max_rows, *_layers(model))
    batches = [batches] if isinstance(batches, dict) else batches
    gated = hasattr(model, "gate_probe")
    # the gate share is cheap (one unroll) and averaged over every batch; the own-key mass needs
    # the reference attention per layer and step, so its first batch carries it alone
    for i, batch in enumerate(batches if gated else batches[:1]):
        if i % world != rank:
            continue
        labelled = shift(assistant_tokens(batch), 2, False).any(1)   # sequences with a scored row at step 0
        chosen = labelled.nonzero().view(-1)[:sequences]
        if len(chosen) == 0:
            continue
        sub = {k: v[chosen] for k, v in batch.items()}
        ids = sub["input_ids"].long()
        anchors = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        with _recording(model, rec, attend=i == 0):
            state = model.begin(context(sub, model.compute_dtype()), anchors)
            for k in range(steps):
                rec.step, rec.rows = k, shift(assistant_tokens(sub), k + 2, False)
                model.step(state, shift(ids, k + 1), anchors + k + 1, k)
    return rec.totals()


# ---------------------------------------------------------------- where the KV path's gradient comes from

def participation(w: Tensor) -> Tensor:
    """(sum w)^2 / sum w^2 over the last dim: the effective number of positions sharing the
    non-negative weights w (n equal weights give n, one dominant weight gives 1; 0 if all zero).
    Parameter-free, so "how many positions" needs no threshold on "non-negligible"."""
    return w.sum(-1).square() / w.square().sum(-1).clamp(min=1e-30)


def own_keys_of_rows(diag: Diagonal, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The drafter's own keys and values that each query row in `rows` attends, [B, Hkv, R, S, D],
    and which of the S it sees [R, S] (`Diagonal`'s two layouts)."""
    if diag.steps:   # steps in rows: row (a, s) sees its anchor's keys of steps 0..s
        slot = torch.arange(diag.steps, device=rows.device)
        idx = (rows // diag.steps * diag.steps)[:, None] + slot
        return diag.k[:, :, idx], diag.v[:, :, idx], slot[None] <= (rows % diag.steps)[:, None]
    k, v = diag.k[:, :, :, rows].transpose(2, 3), diag.v[:, :, :, rows].transpose(2, 3)
    return k, v, torch.ones(len(rows), diag.k.shape[2], dtype=torch.bool, device=rows.device)


def gradient_positions(q: Tensor, prefix_k: Tensor, prefix_v: Tensor, visible: Tensor, own_k: Tensor, own_v: Tensor,
                       own_seen: Tensor, d_out: Tensor, d_y_norm: Tensor, scale: float) -> dict[str, Tensor]:
    """Per query row [B, R], from the gradient d_out [B, H, R, D] that the loss sends to the
    attention's output (the o_proj input; d_y_norm [B, R]: the norm at the o_proj output): every
    attended position j passes gradient to its key (|dS_ij| |q_i|) and value (p_ij |dO_i|), and
    into the query (|dS_ij| |k_j|) and W_O (p_ij |v_j| |dY_i|), dS = p (dP - sum p dP) the
    softmax backward. Keys and values of the copied prefix belong to the target: only the own
    positions' share reaches W_K/W_V. Returns `kv` and `query` (effective positions, `participation`,
    summed over heads) and `on_own` (the share of the key/value gradient on own positions).
    q [B, H, R, D]; prefix_k/v [B, Hkv, Tp, D] seen where visible [B, R, Tp]; own_k/v [B, Hkv, R, S, D]."""
    f = lambda x: x.float()   # noqa: E731
    group = q.shape[1] // prefix_k.shape[1]
    pk, pv = f(prefix_k).repeat_interleave(group, 1), f(prefix_v).repeat_interleave(group, 1)
    ok, ov = f(own_k).repeat_interleave(group, 1), f(own_v).repeat_interleave(group, 1)
    q, d_out = f(q), f(d_out)
    b, h, r, _ = q.shape
    tp, s = pk.shape[2], ok.shape[3]
    scores = torch.cat([q @ pk.transpose(-1, -2), (q[..., None, :] * ok).sum(-1)], -1) * scale
    seen = torch.cat([visible[:, None].expand(b, 1, r, tp), own_seen.expand(b, 1, r, s)], -1)
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    d_p = torch.cat([d_out @ pv.transpose(-1, -2), (d_out[..., None, :] * ov).sum(-1)], -1)
    d_s = probs * (d_p - (probs * d_p).sum(-1, keepdim=True))
    key_norm = torch.cat([pk.norm(dim=-1)[:, :, None].expand(b, h, r, tp), ok.norm(dim=-1)], -1)
    value_norm = torch.cat([pv.norm(dim=-1)[:, :, None].expand(b, h, r, tp), ov.norm(dim=-1)], -1)
    to_kv = (d_s.abs() * scale * q.norm(dim=-1, keepdim=True) + probs * d_out.norm(dim=-1, keepdim=True)).sum(1)
    to_query = (d_s.abs() * scale * key_norm + probs * value_norm * f(d_y_norm)[:, None, :, None]).sum(1)
    own = to_kv[..., tp:]
    return {"kv": participation(own), "query": participation(to_query),
            "on_own": own.sum(-1) / to_kv.sum(-1).clamp(min=1e-30)}


class GradientPositions:
    """On a logging step, around the real forward and backward: each KV-path attention call
    keeps a subsample of its query rows (at most max_rows, evenly spread) and a hook on its
    output; the backward hands the hook the loss's gradient, which `gradient_positions` turns
    into per-row position counts before the optimizer moves the weights. Rows without a loss
    (zero gradient) are left out. enabled=False: nothing is patched."""

    MAX_ROWS = 32   # rows sampled per call for the whole batch (the trainer: each process its share)

    def __init__(self, model: Drafter, enabled: bool = True, max_rows: int = MAX_ROWS):
        self.model, self.enabled, self.max_rows = model, enabled and bool(model.kv_attentions()), max_rows
        self.sums = {"kv": 0.0, "query": 0.0, "ratio": 0.0, "on_own": 0.0}
        self.rows = 0
        self._patched: list = []

    def _attend(self, attn):
        def attend(q, prefix, mask, diag):
            out = type(attn).attend(attn, q, prefix, mask, diag)
            if not diag or not out.requires_grad:
                return out
            tq = q.shape[2]
            rows = (torch.arange(tq, device=q.device) if tq <= self.max_rows else
                    torch.linspace(0, tq - 1, self.max_rows, device=q.device).round().long().unique())
            if isinstance(diag, list):   # step by step: only the sampled rows' keys, not a copy of every row's
                own = own_keys_of_rows(Diagonal(torch.stack([x.k[:, :, rows].detach() for x in diag], 2),
                                                torch.stack([x.v[:, :, rows].detach() for x in diag], 2)),
                                       torch.arange(len(rows), device=q.device))
            else:
                own = own_keys_of_rows(Diagonal(diag.k.detach(), diag.v.detach(), diag.steps), rows)
            kept = (q[:, :, rows].detach(), prefix.k.detach(), prefix.v.detach(), mask.visible()[:, rows], *own)
            w_o = attn.o_proj.weight

            def on_grad(d_y: Tensor) -> None:
                d_y = d_y[:, rows].detach().float()                           # [B, R, hidden]
                b, r = d_y.shape[:2]
                d_out = (d_y @ w_o.detach().float()).view(b, r, q.shape[1], q.shape[3]).transpose(1, 2)
                got = gradient_positions(*kept, d_out, d_y.norm(dim=-1), 1.0 / math.sqrt(q.shape[-1]))
                scored = d_y.norm(dim=-1) > 0
                if scored.any():
                    kv, query = got["kv"][scored], got["query"][scored]
                    self.sums["kv"] += float(kv.sum())
                    self.sums["query"] += float(query.sum())
                    self.sums["ratio"] += float((kv / query.clamp(min=1e-30)).sum())
                    self.sums["on_own"] += float(got["on_own"][scored].sum())
                    self.rows += int(scored.sum())

            out.register_hook(on_grad)
            return out
        return attend

    def __enter__(self) -> "GradientPositions":
        if self.enabled:
            for _, attn in self.model.kv_attentions():
                attn.attend = self._attend(attn)   # instance attribute: shadows the method for this module only
                self._patched.append(attn)
        return self

    def __exit__(self, *exc) -> None:
        for attn in self._patched:
            del attn.attend
        self._patched = []

    def totals(self) -> list[float]:
        """[kv, query, ratio, on_own sums, rows]: what processes add up (`summarize`)."""
        return [self.sums["kv"], self.sums["query"], self.sums["ratio"], self.sums["on_own"], float(self.rows)]

    @staticmethod
    def summarize(totals: list[float]) -> dict:
        """Means over the scored sampled rows of every KV-path call (layers, steps) from `totals`
        (one process's, or their sum); empty if none."""
        kv, query, ratio, on_own, n = totals
        if not n:
            return {}
        return {"kv_grad_positions": kv / n, "query_grad_positions": query / n, "kv_grad_position_ratio": ratio / n,
                "kv_grad_on_own_keys": on_own / n, "grad_position_rows": int(round(n))}

    def summary(self) -> dict:
        """Means over the scored sampled rows of every KV-path call (layers, steps); empty if none."""
        return self.summarize(self.totals())


DIAGNOSTIC_BATCH = 2   # sequences per diagnostic unroll: its reference attention holds [H, rows, keys] per layer


def diagnostic_batches(source, sequences: int, max_len: int, device) -> list[dict[str, Tensor]]:
    """The first `sequences` held-out sequences that have a scored row within max_len, in batches
    of DIAGNOSTIC_BATCH, cut to max_len and on `device`: the same at every log point, so a
    diagnostic's trajectory follows the drafter, not the batch it happened to be measured on.
    Empty when no held-out sequence has a scored row (the caller measures on its training batch)."""
    chosen = []
    for i in range(len(source)):
        one = {k: t[:, :max_len] for k, t in source.batch([i]).items()}
        if shift(assistant_tokens(one), 2, False).any():
            chosen.append(i)
            if len(chosen) == sequences:
                break
    out = []
    for i in range(0, len(chosen), DIAGNOSTIC_BATCH):
        batch = source.batch(chosen[i: i + DIAGNOSTIC_BATCH])
        out.append({k: t[:, :max_len].to(device) for k, t in batch.items()})
    return out


def grad_norms(groups: dict[str, list]) -> dict[str, float]:
    """Each group's gradient norm (one host sync for all of them): each gradient's own norm in
    its dtype (a reduction: no copy of the gradient), the squares of those scalars summed in
    float64."""
    norms = {g: [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
             for g, params in groups.items()}
    device = next((x[0].device for x in norms.values() if x), "cpu")
    values = torch.stack([torch.stack(x).double().square().sum() if x
                          else torch.zeros((), dtype=torch.float64, device=device) for x in norms.values()]).tolist()
    return {g: math.sqrt(x) for g, x in zip(norms, values)}


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


def block_key_share(valid: list[Tensor], anchors: list[Tensor], slots: int) -> float:
    """The chain's `train.kv_key_share` for a block: at anchor t every slot attends the block's
    S keys, which its own W_K/W_V project, beside the t + 1 copied target keys: S / (t + 1 + S),
    averaged over the scored (anchor, position) pairs."""
    num, den = 0.0, 0
    for v, a in zip(valid, anchors):
        share = slots / (a.to(torch.float32) + 1 + slots)
        num += float(share[v].sum())
        den += int(v.sum())
    return num / max(den, 1)


@torch.no_grad()
def block_attention_diagnostics(model: Drafter, batch: dict[str, Tensor], steps: int, sequences: int = 2,
                                max_anchors: int = 64) -> dict:
    """`diagnostics.attention_diagnostics` for a block drafter: per block position k, the
    attention probability its KV-path queries put on the block's own keys (which its W_K/W_V
    project) against the target's copied keys, averaged over heads, layers and the scored
    anchors of the first `sequences` sequences (at most `max_anchors`, evenly spread)."""
    if not model.kv_attentions():
        return {}
    labelled = shift(assistant_tokens(batch), 2, False).any(1)
    chosen = labelled.nonzero().view(-1)[:sequences]
    if len(chosen) == 0:
        return {}
    sub = {k: v[chosen] for k, v in batch.items()}
    b, t = sub["input_ids"].shape
    rows = labelled_rows(assistant_tokens(sub), steps)
    rows = torch.arange(b * t, device=chosen.device) if rows is None else rows
    rows = rows[torch.linspace(0, len(rows) - 1, min(max_anchors, len(rows))).round().long().unique()]
    masses: list[Tensor] = []

    def recorder(attn):
        def attend(q, prefix, mask, diag):
            masses.append(own_key_mass(q, prefix.k, mask.visible(), diag).mean(1)[0])   # [R * S], over heads
            return type(attn).attend(attn, q, prefix, mask, diag)
        return attend

    attns = [attn for _, attn in model.kv_attentions()]
    for attn in attns:
        attn.attend = recorder(attn)   # instance attribute: shadows the method for this module only
    try:
        un = block_unroll(model, sub, steps, anchor_rows=rows)
    finally:
        for attn in attns:
            del attn.attend
    mass = torch.stack(masses).mean(0).view(len(rows), -1)   # [R, S], over layers
    per_k = []
    for k in range(steps):
        at = torch.searchsorted(rows, un.rows[k])
        per_k.append(float(mass[at, k + 1].mean()) if len(at) else None)
    defined = [x for x in per_k if x is not None]
    return {"kv_own_key_mass_k": per_k, "kv_own_key_mass": sum(defined) / len(defined) if defined else None}
