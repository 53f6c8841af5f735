"""How a drafter is unrolled over a batch: the autoregressive test-time-training (TTT)
unroll every chain paradigm shares, and the block drafter's one-call block.

TTT: for every anchor t of a sequence at once, the drafter is unrolled K steps on its own
outputs (EAGLE-3's recipe: its hidden state is its own, the input tokens are the sequence's).
Step k reads token x_{t+k+1} and is scored against the target's distribution for x_{t+k+2},
i.e. the target's logits at position t+k+1 (`train.objective`).

Block (`drafters.block`): for many anchors t in one call, slot 0 reads x_{t+1} and the mask
slots predict x_{t+2} .. x_{t+S}. There is no unroll: each position's loss reaches every slot's
W_K/W_V through the block's bidirectional attention, and a block position is a chain step to
the trainer, the step-wise evaluation and the report. A drafter with refinement passes
(`refine_passes`) is scored on every pass while training, each pass's predictions as rows of
the same position, and drafts with its last.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from kvshot.drafters.skeleton import Drafter


def shift(x: Tensor, n: int, fill=0) -> Tensor:
    """x[:, t + n] at row t, padded with `fill` past the end (dim 1)."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], n, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def assistant_tokens(batch: dict[str, Tensor]) -> Tensor:
    """[B, T] bool: the tokens a loss scores (assistant, not padding)."""
    return batch["loss_mask"].bool() & batch["attention_mask"].bool()


def label_positions(batch: dict[str, Tensor]) -> Tensor:
    """[B, T]: the positions whose target view a loss or accuracy reads: step k at anchor t
    reads position t+k+1 when x_{t+k+2} is a (non-padding) assistant token."""
    return shift(assistant_tokens(batch), 1, False)


@dataclass
class Unrolled:
    logits: list[Tensor]       # per step [B, T, N] (packed: [1, R, N])
    valid: list[Tensor]        # per step [B, T] bool: x_{t+k+2} exists and is an assistant token
    queries: list[list[Tensor]]  # per step, per KV attention: pre-RoPE normed query [B, H, T, D]
    rows: list[Tensor | None] = field(default_factory=list)      # per step: the logits' rows b * T + t (None: every anchor)
    anchors: list[Tensor | None] = field(default_factory=list)   # per step: packed rows' anchors t [1, R]
    # a teacher-forced causal LM: logits[0] is step 0 at every position, and step k at anchor t
    # is its row t + k, so the K steps share one [B, T, N] tensor instead of K shifted copies
    shared_logits: bool = False

    def step_logits(self, k: int) -> Tensor:
        """Step k's logits in the unshared layout (a copy when shared: for tests and small batches)."""
        return shift(self.logits[0], k) if self.shared_logits else self.logits[k]


def at_rows(x: Tensor, rows: Tensor | None, n: int | Tensor, fill=0) -> Tensor:
    """x[:, t + n] at every anchor t (`shift`), or for packed rows b * T + t: x[b, t + n],
    as [1, R, ...] (n: one offset, or one per row); `fill` past the end of a sequence."""
    if rows is None:
        return shift(x, n, fill)
    t = x.shape[1]
    past = (rows % t + n >= t)
    out = x.reshape(-1, *x.shape[2:]).index_select(0, (rows + n).clamp(max=x.shape[0] * t - 1))
    out = out.masked_fill(past.view(-1, *[1] * (x.dim() - 2)), fill) if bool(past.any()) else out
    return out[None]


def labelled_rows(loss_mask: Tensor, steps: int, keep_share: float = 0.98) -> Tensor | None:
    """Flat indices b * T + t (ascending) of the anchors with a label at some step
    (x_{t+k+2} an assistant token for some k < steps); None when (nearly) every anchor has
    one."""
    b, t = loss_mask.shape
    zeros = lambda n: torch.zeros(b, n, dtype=torch.long, device=loss_mask.device)
    csum = torch.cat([zeros(1), torch.cat([loss_mask.long(), zeros(steps + 2)], 1).cumsum(1)], 1)
    pos = torch.arange(t, device=loss_mask.device)
    labelled = (csum[:, pos + steps + 2] - csum[:, pos + 2]) > 0                      # [B, T]
    if not bool(labelled.any()) or float(labelled.float().mean()) > keep_share:
        return None
    return labelled.flatten().nonzero().view(-1)


def context(batch: dict[str, Tensor], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """What a drafter may read of the target: activations at anchor positions + padding mask.
    dtype: the drafter's compute dtype, the one place the target's features (any dtype:
    fp32 or bf16 shards, a bf16 target online) are cast to it."""
    ctx = {k: v if dtype is None else v.to(dtype) for k, v in batch.items()
           if k == "aux_hidden" or k.startswith(("key_", "value_"))}
    ctx["valid"] = batch["attention_mask"].bool()          # prefix keys (training: one per position)
    ctx["anchor_valid"] = ctx["valid"]                      # query rows (training: every position)
    ctx["first_ids"] = batch["input_ids"][:, :1].long()     # x_0: no anchor reads it (the standalone LM does)
    return ctx


def reference_unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int) -> Unrolled:
    """The TTT unroll as the plain K-step loop, the algorithm `unroll` optimizes and is tested
    against: every anchor of every sequence, one step after another; step k feeds the
    sequence's token x_{t+k+1} at position t+k+1 and the drafter's own state from step k-1,
    and its logits predict x_{t+k+2}. No packing, no one-call steps, no causal-LM shortcut."""
    ids = batch["input_ids"].long()
    b, t = ids.shape
    anchors = torch.arange(t, device=ids.device).expand(b, -1)
    state = drafter.begin(context(batch, drafter.compute_dtype()), anchors)
    out = Unrolled([], [], [])
    for k in range(steps):
        hidden = drafter.step(state, shift(ids, k + 1), anchors + k + 1, k)
        out.logits.append(drafter.logits(hidden))
        out.valid.append(shift(assistant_tokens(batch), k + 2, False))
    return out


def unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int, keep_queries: bool = False,
           own_tokens: bool = False, skip_unlabelled: bool = False, anchor_rows: Tensor | None = None) -> Unrolled:
    """K steps for every anchor at once. Inputs are the sequence's tokens (training, as EAGLE-3)
    or, with own_tokens, the drafter's own greedy drafts from step 1 on (chain simulation).
    skip_unlabelled: anchors with no label at any step are dropped (for a paradigm whose
    step-0 keys are every anchor's prefix, once step 0 has written them) and the rest packed
    into one row list (`StepState.pack`): the loss and its gradient are the same, the work
    is not; the head runs only on the rows step k scores. Logits are then [1, R_k, N] for
    the rows `Unrolled.rows[k]`. anchor_rows: flat indices b * T + t (ascending) of the only
    anchors to draft from (packed the same way; a step-wise evaluation with one anchor per
    sequence); every anchor still runs step 0 where its keys are later anchors' prefix."""
    ids = batch["input_ids"].long()
    b, t = ids.shape
    loss_mask = assistant_tokens(batch)
    anchors = torch.arange(t, device=ids.device).expand(b, -1)
    state = drafter.begin(context(batch, drafter.compute_dtype()), anchors)
    out = Unrolled([], [], [])
    if drafter.causal_lm and not own_tokens:
        # teacher-forced, step k at anchor t reads what step 0 reads at anchor t + k: one pass
        hidden = drafter.step(state, shift(ids, 1), state.anchors + 1, 0)
        if anchor_rows is None:
            out.logits.append(drafter.logits(hidden))
            out.shared_logits = True
        else:   # the head only on the rows the anchors' steps read (a full-vocab head is the memory)
            flat = hidden.reshape(-1, hidden.shape[-1])
            for k in range(steps):
                at = (anchor_rows + k).clamp(max=b * t - 1)   # past the end: not valid, masked below
                out.logits.append(drafter.logits(flat.index_select(0, at)[None]))
        for k in range(steps):
            out.valid.append(shift(loss_mask, k + 2, False) if anchor_rows is None
                             else at_rows(loss_mask, anchor_rows, k + 2, False))
            out.rows.append(anchor_rows)
            out.anchors.append(None if anchor_rows is None else (anchor_rows % t)[None])
        return out
    scoring_only = skip_unlabelled and not (own_tokens or keep_queries)
    rows = anchor_rows if anchor_rows is not None else labelled_rows(loss_mask, steps) if scoring_only else None
    if scoring_only and drafter.steps_in_one_pass:
        return one_pass(drafter, state, ids, loss_mask, steps,
                        torch.arange(b * t, device=ids.device) if rows is None else rows)
    packed = None
    if rows is not None and drafter.prefix_from_step0:
        state.pack_after_prefix = rows   # step 0 packs once its keys are the prefix (or step 1 does)
    for k in range(steps):
        if rows is not None and packed is None and (k > 0 or not drafter.prefix_from_step0):
            state.pack(rows)
            packed = rows
        if own_tokens and k > 0:
            tokens = drafter.d2t[out.logits[-1].argmax(-1)]
            if packed is not None and out.rows[-1] is None:   # packed at this step: the last drafts of its rows
                tokens = tokens.flatten()[packed][None]
        else:
            tokens = at_rows(ids, packed, k + 1)
        h = drafter.step(state, tokens, state.anchors + k + 1, k)
        if rows is not None and packed is None and state.row_seq is not None:   # packed within step 0
            packed = rows
        valid = at_rows(loss_mask, packed, k + 2, False)
        if scoring_only:   # the head and the loss only where step k has a label
            keep = valid.flatten().nonzero().view(-1)
            out.logits.append(drafter.logits(h.reshape(-1, h.shape[-1]).index_select(0, keep)[None]))
            out.valid.append(valid.flatten()[keep][None])
            out.rows.append((torch.arange(b * t, device=ids.device) if packed is None else packed)[keep])
            out.anchors.append(state.anchors.flatten()[keep][None])
            continue
        out.logits.append(drafter.logits(h))
        out.valid.append(valid)
        out.rows.append(packed)
        out.anchors.append(None if packed is None else state.anchors)
        if keep_queries:
            out.queries.append([attn.last_query for _, attn in drafter.kv_attentions()])
    return out


class TTTUnroll(nn.Module):
    """The trainer's forward, the module DDP wraps: `unroll` with skip_unlabelled over the
    anchors of a batch that have labels. The drafter is its only submodule, so DDP syncs
    exactly the drafter's parameters and buffers."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict[str, Tensor], steps: int, keep_queries: bool = False) -> Unrolled:
        return unroll(self.drafter, batch, steps, keep_queries, skip_unlabelled=True)


def one_pass(drafter: Drafter, state, ids: Tensor, loss_mask: Tensor, steps: int, rows: Tensor) -> Unrolled:
    """`unroll` with skip_unlabelled for a drafter whose teacher-forced steps share nothing but
    their own keys (`steps_in_one_pass`): the rows (anchor, step) of every step at once, so
    each layer runs once on R * K rows instead of K times on R; the head on scored rows only."""
    state.pack(rows)
    state.spread_steps(steps)
    step = torch.arange(steps, device=ids.device).repeat(len(rows))              # each row's step
    anchor_rows = rows.repeat_interleave(steps)
    h = drafter.step(state, at_rows(ids, anchor_rows, step + 1), state.anchors + step + 1, 0)[0]
    out = Unrolled([], [], [])
    keep = [at_rows(loss_mask, rows, k + 2, False)[0].nonzero().view(-1) for k in range(steps)]
    logits = drafter.logits(h[torch.cat([r * steps + k for k, r in enumerate(keep)])][None])
    for k, part in enumerate(logits.split([len(r) for r in keep], dim=1)):
        out.logits.append(part)
        out.valid.append(torch.ones_like(keep[k], dtype=torch.bool)[None])
        out.rows.append(rows[keep[k]])
        out.anchors.append(state.anchors[0, keep[k] * steps][None])
    return out


def is_block(drafter: Drafter) -> bool:
    return getattr(drafter, "block_wise", False)


def block_unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int | None = None,
                 anchor_rows: Tensor | None = None, skip_unlabelled: bool = True) -> Unrolled:
    """The block after every anchor of every sequence in one forward, as an `Unrolled` whose
    step k is block position k. Anchors (flat b * T + t, ascending): `anchor_rows`, else those
    with a label at some position (skip_unlabelled), else all; packed into one row list
    (`StepState.pack`). skip_unlabelled (training): logits only where position k has a label,
    [1, R_k, N] for the rows `rows[k]`, as `unroll.one_pass` gives them; otherwise (evaluation)
    every anchor's logits at every position, [1, R, N], with `valid` saying which have a
    label. steps: positions scored (default: all of them)."""
    ids = batch["input_ids"].long()
    b, t = ids.shape
    steps = drafter.positions if steps is None else steps
    if steps > drafter.positions:
        raise ValueError(f"block drafter: {steps} steps asked, its block predicts {drafter.positions} positions "
                         f"(block_size {drafter.cfg.block_size})")
    loss_mask = assistant_tokens(batch)
    anchors = torch.arange(t, device=ids.device).expand(b, -1)
    state = drafter.begin(context(batch, drafter.compute_dtype()), anchors)
    rows = anchor_rows if anchor_rows is not None else labelled_rows(loss_mask, steps) if skip_unlabelled else None
    rows = torch.arange(b * t, device=ids.device) if rows is None else rows
    state.pack(rows)
    row_anchors = state.anchors                                               # [1, R]: t of each row
    earlier: list[Tensor] = []
    h = drafter.draft_block(state, at_rows(ids, rows, 1), row_anchors + 1, earlier)[0]  # [R, S, H]
    # training scores every refinement pass, as extra rows of the same position; otherwise the draft (last pass)
    scored = [p[0] for p in earlier] + [h] if drafter.training else [h]
    n = len(scored)
    valid = [at_rows(loss_mask, rows, k + 2, False)[0] for k in range(steps)]
    everyone = torch.arange(len(rows), device=ids.device)
    keep = [v.nonzero().view(-1) if skip_unlabelled else everyone for v in valid]
    logits = drafter.logits(torch.cat([x[r, k + 1] for k, r in enumerate(keep) for x in scored])[None])
    out = Unrolled([], [], [])
    for k, part in enumerate(logits.split([len(r) * n for r in keep], dim=1)):
        out.logits.append(part)
        out.valid.append(valid[k][keep[k]].repeat(n)[None])
        out.rows.append(rows[keep[k]].repeat(n))
        out.anchors.append(row_anchors[:, keep[k]].repeat(1, n))
    return out


def branch_unroll(drafter: Drafter, batch: dict[str, Tensor], rows: Tensor, branch: Tensor, steps: int,
                  own_prefix_sees_itself: bool = False) -> Unrolled:
    """Teacher-forced on the target's branches, for the anchors `rows` (flat b * T + t,
    ascending) of real text: step k at anchor t reads branch[r, k] at position t + k + 1
    (branch [R, >= steps]: c_0, the target's token after t, then its rollout). The drafter's
    context is what it reads at t while decoding that text: the target's features at positions
    <= t and, for a paradigm with its own prefix, its step-0 keys of the real anchors < t, written
    by one step 0 over the real tokens; an anchor's own step 0 reads c_0 and is a diagonal key.
    A chain that accepted steps 0..k-1 read exactly these tokens, so step k's logits are the
    chain's (the step-wise evaluation's one pass). Logits [1, R, N] per step, rows `rows`.
    own_prefix_sees_itself: a control for tests (the step-0 key of the real next token stays
    visible to its own anchor), never the product's."""
    ids = batch["input_ids"].long()
    b, t = ids.shape
    anchors = torch.arange(t, device=ids.device).expand(b, -1)
    state = drafter.begin(context(batch, drafter.compute_dtype()), anchors)
    out = Unrolled([], [], [])
    if is_block(drafter):   # its context is the target's alone; slot 0 reads c_0
        state.pack(rows)
        h = drafter.draft_block(state, branch[None, :, 0], state.anchors + 1)[0]
        logits = drafter.logits(h[:, 1: steps + 1])
        out.logits = [logits[:, k][None] for k in range(steps)]
    else:
        start_hidden = state.hidden
        if drafter.prefix_from_step0:   # the real text's step-0 keys: every later anchor's prefix
            before = list(state.prefix_anchor)
            drafter.step(state, shift(ids, 1), anchors + 1, 0)
            own = [i for i, a in enumerate(state.prefix_anchor) if a is not before[i]]
            if not own_prefix_sees_itself:   # key of anchor t' (it read x_{t'+1}): visible to anchors > t'
                for i in own:
                    state.prefix_anchor[i] = state.prefix_anchor[i] + 1
            state.diag = [[] for _ in state.diag]   # a KV slot's step-0 diagonal of the real tokens
            state.step0_prefix = False
        take = state.pack(rows)
        if start_hidden is not None:   # step 0 starts from the target's context again
            state.hidden = take(start_hidden, 1)
        for k in range(steps):
            h = drafter.step(state, branch[None, :, k], state.anchors + k + 1, k)
            out.logits.append(drafter.logits(h))
    for _ in range(steps):
        out.valid.append(torch.ones(1, len(rows), dtype=torch.bool, device=ids.device))
        out.rows.append(rows)
        out.anchors.append((rows % t)[None])
    return out


def any_unroll(drafter: Drafter, batch: dict[str, Tensor], steps: int, keep_queries: bool = False,
               own_tokens: bool = False, skip_unlabelled: bool = False, anchor_rows: Tensor | None = None) -> Unrolled:
    """`unroll.unroll`, or a block drafter's `block_unroll` (its drafts never feed back, so drafting
    on its own tokens is the teacher-forced block; it keeps no queries)."""
    if is_block(drafter):   # scoring rows only where `unroll` would (training's skip_unlabelled)
        return block_unroll(drafter, batch, steps, anchor_rows, skip_unlabelled and not (own_tokens or keep_queries))
    return unroll(drafter, batch, steps, keep_queries, own_tokens, skip_unlabelled, anchor_rows)


class BlockUnroll(nn.Module):
    """The trainer's forward for a block drafter, the module DDP wraps (`unroll.TTTUnroll`'s
    counterpart): every labelled anchor's block in one call."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch: dict[str, Tensor], steps: int, keep_queries: bool = False) -> Unrolled:
        return block_unroll(self.drafter, batch, steps)


def training_forward(drafter: Drafter) -> nn.Module:
    return BlockUnroll(drafter) if is_block(drafter) else TTTUnroll(drafter)
