"""The draft tree of one speculative-decoding round: how a drafter drafts it (a chain, an
EAGLE-2 style tree, or a block drafter's one-forward chain; greedy or sampled at a temperature)
and how the target's logits verify it (greedy, or lossless speculative sampling over chains and
trees: each node's children, drawn without replacement from q, tried in turn against the
residual). `decode.speculative_generate` runs the rounds."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvshot.drafters import Drafter
from kvshot.drafters.skeleton import StepState

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
    verified as a chain (a shared-mask drafter's block is depth + 1 slots long, vLLM's DFlash block).
    Greedy: each position's argmax. Sampling: each position's token drawn
    from its own q_k, which speculative sampling verifies losslessly whatever q_k is."""
    if not spec.chain:
        raise ValueError("a block drafter drafts chains only (DraftSpec.topk == 1)")
    if spec.depth > drafter.positions:
        raise ValueError(f"draft depth {spec.depth} > the block's {drafter.positions} positions")
    t = int(anchors[0, -1])
    state.select_rows(slice(-1, None))
    # DFlash's layout (one shared mask) drafts K tokens with K + 1 slots, as vLLM does; else the trained block
    slots = spec.depth + 1 if getattr(drafter, "shared_mask", False) else None
    h = drafter.draft_block(state, step0_ids[:, -1:], torch.full((1, 1), t + 1, device=anchors.device), slots=slots)
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
