"""End-to-end speculative decoding with a kvshot drafter (batch size 1), and a plain
decoding baseline timed by the same harness.

One round, after the target has computed (and accepted) positions <= n_past - 1 and the
last token x[n_past] (its bonus) is known but not yet in its cache:

  draft   the drafter ingests the newly accepted anchors (step 0 over all of them; the
          hidden-state paradigms extend their own prefix cache), then only the last anchor
          drafts on: a chain of K tokens, or an EAGLE-2 style tree (top-k expansion of the
          best nodes per depth, then the best `total_tokens` nodes overall);
  verify  one target forward over [x[n_past]] + draft nodes with a tree attention mask
          (cache + ancestors; a chain uses HF's own causal mask), positions n_past + depth;
          a target loaded with flash-attn verifies trees with SDPA (`tree_mask_attention`);
          greedy (output identical to `target.generate(do_sample=False)`) or speculative
          sampling at a temperature, no top-k/top-p, on chains and trees (`verify_sampling`:
          each node's drafted children, sampled without replacement from q, are tried in turn
          against the residual; the output follows the target's distribution exactly);
  keep    the target's cache keeps the accepted path (gathered into place, then cropped),
          whose positions become the next round's anchors.

tau = tokens emitted by verification rounds / rounds: accepted drafts plus the bonus token
per round, the quantity EAGLE counts as accept_length + 1. The first token comes from the
prefill, which verifies nothing, so tau = (len(tokens) - 1) / rounds.

Batch size 1, as EAGLE's and the paper's HF decoder: rows of a batch accept different
lengths, which would need per-row cache lengths and padding masks in every round.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor
from transformers import DynamicCache

from .config import drafter_autocast
from .drafters import Drafter
from .drafters.skeleton import StepState


@dataclass
class DraftSpec:
    """depth: draft steps K; topk: children per expanded node and nodes expanded per depth
    (1: a chain); total_tokens: draft nodes sent to the target (None: every drafted node)."""

    depth: int = 7
    topk: int = 1
    total_tokens: int | None = None

    @property
    def chain(self) -> bool:
        return self.topk == 1


@dataclass
class Draft:
    """Draft nodes in an order where parents come first."""

    tokens: list[int]        # target ids
    parents: list[int]       # index into the nodes, -1: the root (the last known token)
    depths: list[int]        # 1..K
    scores: list[float]      # cumulative draft log-probability (EAGLE-2's ranking)
    q: Tensor | None = None  # sampling: [N, draft vocab] the drafter's distribution for each node
    # sampling trees: per tree row (0: the root, i + 1: node i), every child drawn there in draw
    # order (target ids, also those the token budget left out; [] if the row drafted none), and
    # the distribution over the draft vocab they were drawn from (None if none). None: a chain.
    drawn: list[list[int]] | None = None
    drawn_q: list[Tensor | None] | None = None


@dataclass
class DecodeResult:
    tokens: list[int]                      # generated tokens (prompt excluded), eos included
    rounds: int                            # verification forwards (plain decoding: decode forwards)
    accepted: list[int] = field(default_factory=list)   # per round: draft tokens the target accepted
    emitted: list[int] = field(default_factory=list)    # per round: tokens added (accepted + bonus, clipped)
    drafted: list[int] = field(default_factory=list)    # per round: draft nodes verified
    stopped_by: str = "max_new_tokens"     # eos | max_new_tokens
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    verify_attention: str = ""             # the attention implementation tree rounds verified with
    top2: list[tuple[float, float]] = field(default_factory=list)   # plain decoding: the target's two
    #                                        largest logits for each token, to classify divergences

    @property
    def tau(self) -> float:
        return sum(self.emitted) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "tau": self.tau, "tokens_per_s": self.tokens_per_s}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":   # kernels are asynchronous: time what ran, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _pick(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The next token from one row of target logits: argmax, or a sample at `temperature`."""
    if temperature <= 0:
        return int(logits.argmax(-1))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _remove_after(cache: DynamicCache, length: int) -> None:
    """Crop the cache to `length` tokens. A negative count works for transformers 4.x
    (crop(max_length), negative: remove) and 5.x (crop(-tokens_to_remove))."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def keep_path(cache: DynamicCache, n_past: int, path: list[int]) -> None:
    """Keep the cache entries of the accepted tree rows `path` (ascending, root first)
    right after the prefix, then drop the rest of the tree."""
    if path != list(range(len(path))):   # a chain's path is a prefix: cropping suffices
        src = torch.tensor(path, device=cache.layers[0].keys.device) + n_past
        for layer in cache.layers:
            layer.keys[:, :, n_past: n_past + len(path)] = layer.keys[:, :, src]
            layer.values[:, :, n_past: n_past + len(path)] = layer.values[:, :, src]
    _remove_after(cache, n_past + len(path))


def drafter_context(cache: DynamicCache, hidden_states: Sequence[Tensor] | None, rows: Tensor,
                    aux_layers: Sequence[int] | None, kv_layers: Sequence[int], dtype: torch.dtype,
                    first_ids: Tensor | None = None) -> dict[str, Tensor]:
    """What a drafter reads of the target: aux hidden states at the new anchor rows and the
    target's own cache for the whole prefix (a view, transposed to [B, T, H_kv, D]); in the
    first round also the first token [B, 1], which no anchor's step reads (a standalone LM sees it)."""
    ctx: dict[str, Tensor] = {} if first_ids is None else {"first_ids": first_ids}
    if aux_layers:
        ctx["aux_hidden"] = torch.stack([hidden_states[i][:, rows] for i in aux_layers], dim=2).to(dtype)
    for l in kv_layers:
        ctx[f"key_{l}"] = cache.layers[l].keys.transpose(1, 2).to(dtype)
        ctx[f"value_{l}"] = cache.layers[l].values.transpose(1, 2).to(dtype)
    return ctx


@torch.no_grad()
def draft(drafter: Drafter, state: StepState, step0_ids: Tensor, anchors: Tensor, spec: DraftSpec,
          temperature: float = 0.0, generator: torch.Generator | None = None) -> Draft:
    """Step 0 over the new anchors, then K-1 steps from the last one. Every drafting row is a
    tree node; `select_rows` with a parent index gives each child its ancestors' diagonal keys
    and its parent's hidden state. Greedy: EAGLE-2 tree (chain when topk == 1), nodes scored
    by cumulative draft log-probability. Sampling: a chain of tokens sampled from q, or a tree
    of children sampled without replacement (`_sampled_tree`). A chain's one row stays itself
    (no `select_rows` copies), and every depth's nodes stay on the device until the end: no
    host sync per step."""
    if getattr(drafter, "block_wise", False):   # a block drafter: one forward per round
        return draft_block(drafter, state, step0_ids, anchors, spec, temperature, generator)
    sample = temperature > 0
    d2t, device = drafter.d2t, anchors.device
    t = int(anchors[0, -1])
    h = drafter.step(state, step0_ids, anchors + 1, 0)[:, -1:]   # step 0 over every new anchor
    state.select_rows(slice(-1, None))                           # only the last one drafts on
    if sample and not spec.chain:
        return _sampled_tree(drafter, state, h, t, spec, temperature, generator)
    positions = torch.arange(t + 1, t + spec.depth + 1, device=device).view(-1, 1, 1)   # step k: t + k + 1
    tokens: list[Tensor] = []    # per depth: the candidates' draft-vocab ids
    parents: list[Tensor] = []   # per depth: each candidate's parent node (-1: the root)
    scores: list[Tensor] = []    # per depth: cumulative draft log-probabilities
    qs: list[Tensor] = []
    row_node = torch.tensor([-1], device=device)   # the node each drafting row stands for
    row_score = torch.zeros(1, device=device)
    n_nodes, ids = 0, None
    for k in range(spec.depth):
        if k > 0:   # the frontier's tokens, at position anchor + k + 1
            h = drafter.step(state, ids, positions[k].expand_as(ids), k)
        logits = drafter.logits(h)[0].float()                     # [rows, draft vocab]
        if sample:
            q = torch.softmax(logits / temperature, dim=-1)
            cand_tok = torch.multinomial(q, 1, generator=generator).view(-1)
            cand_row, cand_score = torch.zeros(1, dtype=torch.long, device=device), row_score + q[0, cand_tok].log()
            qs.append(q[0])
        elif spec.chain:   # the argmax and its log-probability
            cand_tok = logits.argmax(-1)
            cand_row = torch.zeros(1, dtype=torch.long, device=device)
            cand_score = row_score + torch.log_softmax(logits, dim=-1).gather(1, cand_tok[:, None]).squeeze(1)
        else:
            top, idx = torch.log_softmax(logits, dim=-1).topk(spec.topk, dim=-1)
            cand_tok, cand_score = idx.flatten(), (row_score[:, None] + top).flatten()
            cand_row = torch.arange(len(logits), device=device).repeat_interleave(spec.topk)
        tokens.append(cand_tok)
        parents.append(row_node[cand_row])
        scores.append(cand_score)
        first, n_nodes = n_nodes, n_nodes + len(cand_tok)
        if k + 1 == spec.depth:
            break
        if spec.chain:   # the one candidate drafts on in the same row
            row_node, row_score, ids = row_node.new_full((1,), first), cand_score, d2t[cand_tok][None]
            continue
        keep = cand_score.topk(min(spec.topk, len(cand_score))).indices   # the frontier drafts on
        state.select_rows(cand_row[keep])
        row_node, row_score, ids = first + keep, cand_score[keep], d2t[cand_tok[keep]][None]
    depths = [k + 1 for k, x in enumerate(tokens) for _ in range(len(x))]
    out = Draft(d2t[torch.cat(tokens)].tolist(), torch.cat(parents).tolist(), depths, torch.cat(scores).tolist(),
                torch.stack(qs) if sample else None)
    return out if spec.total_tokens is None else _best_nodes(out, spec.total_tokens)


def sample_without_replacement(q: Tensor, k: int, generator: torch.Generator | None) -> Tensor:
    """[rows, k] distinct draws from each row of q, in draw order: sequential sampling without
    replacement (each draw from q renormalized over the tokens not yet drawn). An exponential
    race: token v finishes at E_v / q_v with E_v ~ Exp(1) i.i.d.; the first finisher is v with
    probability q_v / sum(q), and by memorylessness the race among the rest starts afresh, so
    the finishing order is that sequence (the Gumbel-top-k trick). q must be positive."""
    e = torch.empty_like(q).exponential_(1.0, generator=generator)
    return (q / e).topk(min(k, q.shape[-1]), dim=-1).indices   # sorted: the finishing order


def _sampled_tree(drafter: Drafter, state: StepState, h: Tensor, t: int, spec: DraftSpec, temperature: float,
                  generator: torch.Generator | None) -> Draft:
    """A tree for speculative sampling. The EAGLE-2 shape: each frontier row draws `topk`
    distinct children from its q (`sample_without_replacement`), and the `topk` best candidates
    by cumulative log q draft on. Every drawn child is kept in `Draft.drawn`: verification tries
    all of them, in draw order, whichever nodes the target sees.

    The token budget (`total_tokens`) cannot be EAGLE-2's global top-n here: whether a node that
    drafted children is sent to the target must not depend on its children's values (a node is
    only descended into when the target sees it, and its children's law given that must stay q),
    and a global ranking does depend on them (they compete for frontier rows with the cousins'
    children, whose descendants then compete with the node for the budget). So the rows that
    drafted on are kept first, depth by depth and by score within a depth (decided before their
    children exist), and what the budget leaves goes to the best other candidates by score
    (leaves: nothing is drawn below them, so their selection may depend on anything)."""
    d2t, device = drafter.d2t, h.device
    positions = torch.arange(t + 1, t + spec.depth + 1, device=device).view(-1, 1, 1)   # step k: t + k + 1
    tokens: list[Tensor] = []        # per depth: the candidates' draft-vocab ids, row-major in draw order
    parents: list[Tensor] = []       # per depth: each candidate's parent node (-1: the root)
    scores: list[Tensor] = []        # per depth: cumulative draft log-probabilities
    row_nodes: list[Tensor] = []     # per depth: the node each drafting row stands for
    row_qs: list[Tensor] = []        # per depth: [rows, draft vocab] the q each row drew from
    row_node = torch.tensor([-1], device=device)
    row_score = torch.zeros(1, device=device)
    n_nodes, ids = 0, None
    tiny = torch.finfo(torch.float32).tiny
    for k in range(spec.depth):
        if k > 0:
            h = drafter.step(state, ids, positions[k].expand_as(ids), k)
        # positive everywhere, so k distinct tokens always have q > 0; drawing and verifying
        # both use this very q, so the floor changes nothing about exactness
        q = torch.softmax(drafter.logits(h)[0].float() / temperature, dim=-1).clamp_min(tiny)
        idx = sample_without_replacement(q, spec.topk, generator)              # [rows, topk]
        cand_tok = idx.flatten()
        cand_row = torch.arange(len(q), device=device).repeat_interleave(idx.shape[1])
        cand_score = (row_score[:, None] + q.gather(1, idx).log()).flatten()
        tokens.append(cand_tok)
        parents.append(row_node[cand_row])
        scores.append(cand_score)
        row_nodes.append(row_node)
        row_qs.append(q)
        first, n_nodes = n_nodes, n_nodes + len(cand_tok)
        if k + 1 == spec.depth:
            break
        keep = cand_score.topk(min(spec.topk, len(cand_score))).indices   # the frontier drafts on
        state.select_rows(cand_row[keep])
        row_node, row_score, ids = first + keep, cand_score[keep], d2t[cand_tok[keep]][None]

    tok = d2t[torch.cat(tokens)].tolist()
    par, score = torch.cat(parents).tolist(), torch.cat(scores).tolist()
    depth = [k + 1 for k, x in enumerate(tokens) for _ in range(len(x))]
    q_of = {}                                   # drafting node (-1: the root) -> its q
    for nodes, q in zip(row_nodes, row_qs):
        q_of.update(zip(nodes.tolist(), q))
    budget = len(tok) if spec.total_tokens is None else spec.total_tokens
    kept: list[int] = []
    for k in range(1, spec.depth):              # rows that drafted on, depth by depth
        for i in sorted((i for i in q_of if i >= 0 and depth[i] == k), key=lambda i: (-score[i], i)):
            if len(kept) < budget:
                kept.append(i)
    inner = set(kept)
    leaves = sorted((i for i in range(len(tok)) if i not in q_of and (par[i] == -1 or par[i] in inner)),
                    key=lambda i: (-score[i], i))
    order = sorted(kept + leaves[: max(budget - len(kept), 0)])
    row = {old: j for j, old in enumerate(order, start=1)}
    row[-1] = 0
    drawn: list[list[int]] = [[] for _ in range(len(order) + 1)]
    for i in range(len(tok)):                   # node order is draw order within a parent
        if par[i] in row:
            drawn[row[par[i]]].append(tok[i])
    drawn_q = [q_of.get(i) for i in [-1] + order]
    return Draft([tok[i] for i in order], [row[par[i]] - 1 for i in order], [depth[i] for i in order],
                 [score[i] for i in order], torch.stack([q_of[par[i]] for i in order]) if order else None,
                 drawn, drawn_q)


@torch.no_grad()
def draft_block(drafter: Drafter, state: StepState, step0_ids: Tensor, anchors: Tensor, spec: DraftSpec,
                temperature: float = 0.0, generator: torch.Generator | None = None) -> Draft:
    """A block drafter's round (`drafters.block`): one forward from the last new anchor t, whose
    slot 0 reads x_{t+1} (the bonus token, step0_ids' last); block position k is depth k + 1,
    verified as a chain. Greedy: each position's argmax. Sampling: each position's token drawn
    from its own q_k, which speculative sampling verifies losslessly whatever q_k is."""
    if not spec.chain:
        raise ValueError("a block drafter drafts chains only (DraftSpec.topk == 1)")
    if spec.depth > drafter.positions:
        raise ValueError(f"draft depth {spec.depth} > the block's {drafter.positions} positions")
    t = int(anchors[0, -1])
    state.select_rows(slice(-1, None))
    h = drafter.draft_block(state, step0_ids[:, -1:], torch.full((1, 1), t + 1, device=anchors.device))
    logits = drafter.logits(h[0, 0, 1: spec.depth + 1]).float()                 # [depth, draft vocab]
    q = None
    if temperature > 0:
        q = torch.softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(q, 1, generator=generator).view(-1)
        logp = q.gather(1, tokens[:, None]).squeeze(1).log()
    else:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    n = spec.depth
    return Draft(drafter.d2t[tokens].tolist(), list(range(-1, n - 1)), list(range(1, n + 1)),
                 logp.cumsum(0).tolist(), q)


def _best_nodes(d: Draft, n: int) -> Draft:
    """The n best nodes by cumulative score (ties: the earlier node). A child's score never
    exceeds its parent's and parents come earlier, so the set is closed under ancestors;
    ancestors are still added explicitly in case of a NaN."""
    chosen = set(sorted(range(len(d.scores)), key=lambda i: (-d.scores[i], i))[:n])
    for i in list(chosen):
        while d.parents[i] >= 0 and d.parents[i] not in chosen:
            i = d.parents[i]
            chosen.add(i)
    order = sorted(chosen)
    new = {old: j for j, old in enumerate(order)}
    return Draft([d.tokens[i] for i in order], [new.get(d.parents[i], -1) for i in order],
                 [d.depths[i] for i in order], [d.scores[i] for i in order], None if d.q is None else d.q[order])


def tree_attention(parents: list[int], n_past: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask [1, 1, 1 + N, n_past + 1 + N]: every tree row sees the whole prefix and
    its ancestors (and itself); row 0 is the root. Float, so eager and sdpa both take it."""
    n = len(parents) + 1
    anc = torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    for i, p in enumerate(parents, start=1):      # parents come first: their rows are done
        anc[i] = anc[p + 1]
        anc[i, i] = True
    visible = torch.cat([torch.ones(n, n_past, dtype=torch.bool), anc], dim=1).to(device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def verify_greedy(logits: Tensor, d: Draft) -> tuple[list[int], int]:
    """Walk down from the root while a child holds the target's greedy token. Returns the
    accepted tree rows (root first) and the target's token after the last of them."""
    greedy = logits.argmax(-1).tolist()
    children: dict[int, list[int]] = {}
    for i, p in enumerate(d.parents, start=1):
        children.setdefault(p + 1, []).append(i)
    path = [0]
    while True:
        nxt = next((c for c in children.get(path[-1], []) if d.tokens[c - 1] == greedy[path[-1]]), None)
        if nxt is None:
            return path, greedy[path[-1]]
        path.append(nxt)


def _accept_prob(p: Tensor, q: Tensor, x: int) -> Tensor:
    """Speculative sampling's acceptance probability of a draft x drawn from q, for target p."""
    return torch.clamp(p[x] / q[x], max=1.0)


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p - q, 0)): the target's distribution given that a draft from q was rejected
    (p itself when p == q, where a rejection has probability 0)."""
    r = torch.clamp(p - q, min=0)
    s = r.sum()
    return r / s if s > 0 else p


def _without(q: Tensor, x: int) -> Tensor:
    """The law of the next sibling drawn without replacement after x: q with x removed, renormalized."""
    q = q.clone()
    q[x] = 0
    return q / q.sum()


def verify_sampling(logits: Tensor, d: Draft, d2t: Tensor, temperature: float,
                    generator: torch.Generator | None) -> tuple[list[int], int]:
    """Speculative sampling, lossless in distribution. Chain (Leviathan et al. 2023): accept
    x_i with probability min(1, p_i(x) / q_i(x)); on the first rejection sample from
    norm(max(0, p_i - q_i)); if all are accepted, the bonus comes from p_N.

    Tree (recursive rejection sampling over siblings, as SpecInfer's multi-step speculative
    sampling and EAGLE's sampling mode, with drafts drawn without replacement): at a row with
    target distribution r_0 = p and children x_1..x_m drawn sequentially without replacement
    from q, let q_0 = q and q_j = q with x_1..x_j removed, renormalized (`_without`): x_j is
    then distributed as q_{j-1} given everything before it. Try x_j with probability
    min(1, r_{j-1}(x_j) / q_{j-1}(x_j)); on rejection r_j = norm(max(r_{j-1} - q_{j-1}, 0)); if
    all are rejected, sample from r_m. Each try is one speculative-sampling step of draft
    q_{j-1} against target r_{j-1}, and P(out = y) = min(r, q)(y) + (1 - sum min(r, q)) *
    max(r - q, 0)(y) / sum max(r - q, 0) = r(y); by induction from the last try the output
    follows r_0 = p. (With replacement, i.e. i.i.d. siblings, the same steps with q_j = q
    would be exact; without, using q for later siblings is not.) An accepted child the target
    saw is descended into; one the budget left out (`Draft.drawn`) ends the round as its last
    token, as a residual sample does; a row that drafted nothing yields its bonus from p.
    Whether a row that drafted children is seen never depends on those children
    (`_sampled_tree`), so below it the same argument holds. q is zero outside the draft vocab."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if d.drawn is None:   # a chain: row i drew node i, from q_i, and nothing else
        drawn, drawn_q = [[x] for x in d.tokens] + [[]], list(d.q) + [None]
    else:
        drawn, drawn_q = d.drawn, d.drawn_q
    seen = {(parent + 1, x): i for i, (parent, x) in enumerate(zip(d.parents, d.tokens), start=1)}
    device = generator.device if generator else p.device
    path = [0]
    while True:
        row = path[-1]
        r = p[row]
        if drawn[row]:
            q = torch.zeros_like(r).index_add_(0, d2t, drawn_q[row].to(p.dtype))
        for j, x in enumerate(drawn[row]):
            if j:
                q = _without(q, drawn[row][j - 1])
            u = torch.rand((), generator=generator, device=device)
            if u < _accept_prob(r, q, x):
                if (row, x) not in seen:   # drawn, but the target did not see it
                    return path, x
                path.append(seen[(row, x)])
                break
            r = _residual(r, q)
        else:   # every child rejected (or none drawn: the bonus)
            return path, int(torch.multinomial(r, 1, generator=generator))


# Implementations that take kvshot's additive 4D tree mask. flash-attn (and other kernels
# that only know causal/padding masks) would silently ignore a tree's branches.
TREE_MASK_ATTENTION = ("sdpa", "eager")


@contextmanager
def tree_mask_attention(target) -> Iterator[str]:
    """Run the target with an implementation that takes a 4D mask for the enclosed calls.
    Every attention layer reads `config._attn_implementation` per call, and the KV cache
    layout does not depend on it, so a flash-attn target verifies trees with SDPA and goes
    back to flash-attn for the prefill and chain rounds."""
    loaded = target.config._attn_implementation
    if loaded in TREE_MASK_ATTENTION:
        yield loaded
        return
    target.config._attn_implementation = "sdpa"
    try:
        yield "sdpa"
    finally:
        target.config._attn_implementation = loaded


def _forward(target, ids: list[int], positions: Tensor, cache: DynamicCache, mask: Tensor | None,
             hidden: bool, device: torch.device, last_only: bool = False):
    """The decoder body (filling `cache`), then the LM head on the rows that are needed: a
    prefill needs only its last row (a 152k vocabulary over a whole prompt is large)."""
    with torch.autocast(device.type, enabled=False):   # the target in its own dtype, inside drafting's autocast
        out = target.model(input_ids=torch.tensor([ids], device=device), position_ids=positions[None],
                           attention_mask=mask, past_key_values=cache, use_cache=True, output_hidden_states=hidden)
        h = out.last_hidden_state[0, -1:] if last_only else out.last_hidden_state[0]
        return target.lm_head(h), out.hidden_states


def _append(tokens: list[int], new: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[int, str | None]:
    """Append up to the first eos (kept) or max_new_tokens; returns (added, why it stopped)."""
    for n, tok in enumerate(new, start=1):
        tokens.append(tok)
        if eos_token_id is not None and tok == eos_token_id:
            return n, "eos"
        if len(tokens) >= max_new_tokens:
            return n, "max_new_tokens"
    return len(new), None


def speculative_generate(target, drafter: Drafter, input_ids: Tensor, max_new_tokens: int,
                         eos_token_id: int | None = None, aux_layers: Sequence[int] | None = None,
                         spec: DraftSpec | None = None, temperature: float = 0.0,
                         generator: torch.Generator | None = None, precision: str = "float32") -> DecodeResult:
    """Speculative decoding, batch size 1. `aux_layers`: HF hidden_states indices the drafter
    fuses (the features index's spec.aux_layers; None for a drafter that reads none);
    the drafter reads the target KV of `drafter.cfg.kv_layers`. temperature 0: greedy.
    precision: the runtime dtype the drafter was trained and evaluated step-wise in
    (`config.drafter_autocast`: bf16 autocast over its fp32 weights); one autocast region spans
    the call, so each weight is cast once per call (autocast's cache), not once per round."""
    with drafter_autocast(input_ids.device.type, precision):
        return _speculative_generate(target, drafter, input_ids, max_new_tokens, eos_token_id, aux_layers, spec,
                                     temperature, generator)


@torch.inference_mode()   # no autograd bookkeeping at all: many small ops per round
def _speculative_generate(target, drafter: Drafter, input_ids: Tensor, max_new_tokens: int,
                          eos_token_id: int | None, aux_layers: Sequence[int] | None, spec: DraftSpec | None,
                          temperature: float, generator: torch.Generator | None) -> DecodeResult:
    if input_ids.shape[0] != 1 or max_new_tokens < 1:
        raise ValueError(f"speculative_generate: batch size 1 and max_new_tokens >= 1, got "
                         f"{input_ids.shape[0]} and {max_new_tokens}")
    spec = spec or DraftSpec()
    device = input_ids.device
    dtype = drafter.compute_dtype()   # what the target's context is cast to (bf16 under autocast)
    kv_layers = list(drafter.cfg.kv_layers)
    seq = input_ids[0].tolist()
    res = DecodeResult(tokens=[], rounds=0)
    start = _clock(device)

    cache = DynamicCache(config=target.config)
    n_past = len(seq)
    logits, hidden = _forward(target, seq, torch.arange(n_past, device=device), cache, None, bool(aux_layers), device,
                              last_only=True)
    _, stop = _append(res.tokens, [_pick(logits[-1], temperature, generator)], max_new_tokens, eos_token_id)
    rows, lo = torch.arange(n_past, device=device), 0          # the new anchors' rows and first position
    state: StepState | None = None
    res.prefill_s = _clock(device) - start
    while stop is None:
        t0 = _clock(device)
        seq = input_ids[0].tolist() + res.tokens
        ctx = drafter_context(cache, hidden, rows, aux_layers, kv_layers, dtype, input_ids[:, :1] if state is None else None)
        anchors = torch.arange(lo, n_past, device=device)[None]
        state = drafter.begin(ctx, anchors, previous=state)
        d = draft(drafter, state, torch.tensor([seq[lo + 1: n_past + 1]], device=device), anchors, spec,
                  temperature, generator)
        t1 = _clock(device)

        positions = n_past + torch.tensor([0] + d.depths, device=device)
        chain = d.parents == list(range(-1, len(d.parents) - 1))
        if chain:   # plain causal attention: HF builds that mask itself (flash-attn works too)
            logits, hidden = _forward(target, [seq[n_past]] + d.tokens, positions, cache, None, bool(aux_layers),
                                      device)
        else:
            with tree_mask_attention(target) as res.verify_attention:
                logits, hidden = _forward(target, [seq[n_past]] + d.tokens, positions, cache,
                                          tree_attention(d.parents, n_past, target.dtype, device),
                                          bool(aux_layers), device)
        if temperature > 0:
            path, bonus = verify_sampling(logits, d, drafter.d2t, temperature, generator)
        else:
            path, bonus = verify_greedy(logits, d)
        added, stop = _append(res.tokens, [d.tokens[i - 1] for i in path[1:]] + [bonus], max_new_tokens, eos_token_id)
        res.rounds += 1
        res.accepted.append(len(path) - 1)
        res.emitted.append(added)
        res.drafted.append(len(d.tokens))
        if stop is None:
            keep_path(cache, n_past, path)
            rows, lo, n_past = torch.tensor(path, device=device), n_past, n_past + len(path)
        res.draft_s += t1 - t0
        res.verify_s += _clock(device) - t1
    res.stopped_by = stop
    res.total_s = _clock(device) - start
    return res


@torch.inference_mode()   # no autograd bookkeeping at all: many small ops per round
def plain_generate(target, input_ids: Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> DecodeResult:
    """The baseline: the target alone, one token per forward, same cache and timing harness.
    `top2` keeps the two largest logits behind each token (a near-tie test for divergences)."""
    if input_ids.shape[0] != 1 or max_new_tokens < 1:
        raise ValueError(f"plain_generate: batch size 1 and max_new_tokens >= 1, got "
                         f"{input_ids.shape[0]} and {max_new_tokens}")
    device = input_ids.device
    res = DecodeResult(tokens=[], rounds=0)
    start = _clock(device)
    cache = DynamicCache(config=target.config)
    n_past = input_ids.shape[1]
    logits, _ = _forward(target, input_ids[0].tolist(), torch.arange(n_past, device=device), cache, None, False, device,
                         last_only=True)
    _, stop = _append(res.tokens, [_pick(logits[-1], temperature, generator)], max_new_tokens, eos_token_id)
    res.top2.append(tuple(logits[-1].float().topk(2).values.tolist()))
    res.prefill_s = _clock(device) - start
    while stop is None:
        logits, _ = _forward(target, res.tokens[-1:], torch.tensor([n_past], device=device), cache, None, False, device)
        n_past += 1
        added, stop = _append(res.tokens, [_pick(logits[-1], temperature, generator)], max_new_tokens, eos_token_id)
        res.top2.append(tuple(logits[-1].float().topk(2).values.tolist()))
        res.rounds += 1
        res.accepted.append(0)
        res.emitted.append(added)
        res.drafted.append(0)
    res.verify_s = _clock(device) - start - res.prefill_s
    res.stopped_by = stop
    res.total_s = _clock(device) - start
    return res
