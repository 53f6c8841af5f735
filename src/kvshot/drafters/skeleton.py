"""The drafter skeleton every paradigm shares.

A drafter is unrolled for K steps from a set of *anchors*: anchor t is a position
the target has computed (its context covers tokens <= t). At step k the drafter
reads the token x_{t+k+1} (at position t+k+1) and predicts x_{t+k+2}.

Attention at step k for anchor t sees two kinds of keys:
  prefix  keys shared by all steps, visible when key_anchor <= t: the drafter's own
          step-0 keys (hidden-only, as EAGLE-3) or the target's KV cache (KV path);
  diag    the drafter's own keys from the steps of the *same* anchor (one per step).
Training runs all anchors of a sequence at once (no loop over positions); decoding
runs the same code with the anchors of one round.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from kvshot.core.integrity import write_manifest
from kvshot.core.io import atomic_dir, write_json

from .attention import attention
from .fused import rms_norm


@dataclass
class DrafterConfig:
    paradigm: str                      # hidden | kv | hybrid | standalone
    hidden_size: int                   # = the target's hidden size (embedding is shared)
    num_layers: int
    num_attention_heads: int           # KV path: must equal the target's (shared query geometry)
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                    # target vocabulary
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    num_aux: int = 3                   # EAGLE-3 fuses three target hidden states
    kv_layers: list[int] = field(default_factory=list)   # target layer read by each KV-path layer
    gate_shape: str = "scalar"         # hybrid: scalar | channel
    gate_init: float = 0.5             # hybrid: initial g = sigmoid(gate_logit)
    qk_norm: bool = True               # Qwen3's q/k RMSNorm; False: a Llama-style layer (EAGLE-3's)
    block_size: int = 0                # block paradigm: query slots per block (x_{t+1}, then block_size - 1 masks)
    block_context: str = "kv"          # block paradigm: kv (the target's KV cache) | hidden (fused aux hidden states) | dflash (the same in DFlash's layout)
    block_refine: int = 0              # block paradigm: refinement passes, each re-reading the previous pass's tokens
    norm_before_residual: bool = False  # hidden paradigm, layer 0: the residual is hidden_norm(h), not h (speculators' switch)
    norm_before_fc: bool = False       # hidden paradigm: one RMSNorm over the concatenated aux states before fc (speculators)
    fc_norm: bool = False              # hidden paradigm (EAGLE-3.1): one RMSNorm per aux state before fc; excludes norm_before_fc
    norm_output: bool = False          # hidden paradigm (EAGLE-3.1): what it means is `norm_output_convention`'s
    # whose definition of norm_output (docs/published-heads.md): vllm (vLLM, speculators: true, the next step
    # and the head read norm(h)); specforge (SpecForge: the carried state stays raw, the head reads norm(h)
    # when true and h itself when false). Absent or false under vllm: standard EAGLE-3.
    norm_output_convention: str = "vllm"
    own_embedding: bool = False        # the head's own token embedding, saved in the folder (not the target's)

    def __post_init__(self) -> None:
        self.check()

    def check(self, where: str = "drafter config") -> None:
        """Refuse what cannot be one drafter, in one line naming `where` and the field."""
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(f"{where}: field 'fc_norm' with 'norm_before_fc': per-state norms and one norm over "
                             "their concatenation exclude each other (EAGLE-3.1 uses fc_norm); set one")
        if self.norm_output_convention not in NORM_OUTPUT_CONVENTIONS:
            raise ValueError(f"{where}: field 'norm_output_convention' {self.norm_output_convention!r}: one of "
                             f"{list(NORM_OUTPUT_CONVENTIONS)}")
        if self.norm_output_convention != "vllm" and self.paradigm != "hidden":
            raise ValueError(f"{where}: field 'norm_output_convention': a hidden-paradigm (EAGLE-3) switch, "
                             f"not {self.paradigm}'s")
        for key in ("norm_before_fc", "fc_norm", "norm_output"):
            if getattr(self, key) and self.paradigm != "hidden":
                raise ValueError(f"{where}: field {key!r}: a hidden-paradigm (EAGLE-3) switch, not {self.paradigm}'s")

    def save(self, path: Path) -> None:
        # HF-style self-description first (docs/drafter_format.md), then the fields
        meta = {"architectures": [f"KVShot{self.paradigm.capitalize()}Drafter"], "model_type": DRAFTER_MODEL_TYPE,
                "format_version": DRAFTER_FORMAT_VERSION}
        # fields added after format 1 shipped are written only when set: folders that do not use them are unchanged
        own = {k: v for k, v in asdict(self).items() if k not in LATER_DEFAULTS or v != LATER_DEFAULTS[k]}
        path.write_text(json.dumps({**meta, **own}, indent=2))

    def carries_normed(self) -> bool:
        """Whether the state carried to the next step is norm(h) (vLLM's norm_output)."""
        return self.norm_output and self.norm_output_convention == "vllm"

    def head_norm(self) -> bool:
        """Whether the head applies the final norm to what `step` returns (false: already normed,
        vLLM's norm_output; or SpecForge's norm_output false, the head reading h itself)."""
        if self.norm_output_convention == "specforge":
            return self.norm_output
        return not self.norm_output

    @classmethod
    def load(cls, path: Path) -> "DrafterConfig":
        """Reads what `save` writes, and older files (no metadata keys, no qk_norm: q/k norm on)."""
        raw = json.loads(Path(path).read_text())
        for key in ("architectures", "model_type", "format_version"):
            raw.pop(key, None)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown} for a kvshot drafter config")
        try:
            return cls(**raw)
        except ValueError as err:   # name the file, not the dataclass
            raise ValueError(str(err).replace("drafter config", str(path), 1)) from None


NORM_OUTPUT_CONVENTIONS = ("vllm", "specforge")
LATER_DEFAULTS = {"norm_output_convention": "vllm", "own_embedding": False}
DRAFTER_MODEL_TYPE = "kvshot_drafter"
DRAFTER_FORMAT_VERSION = 1


def compute_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """What a drafter computes in on a device: autocast's dtype inside an autocast region
    (a bfloat16 runtime, `config.drafter_autocast`), else `dtype` (its parameters')."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:   # a closed-form backward (`fused`)
            return rms_norm(x, self.weight, self.eps)
        # Qwen3: normalize in fp32, scale in the input dtype
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight


@dataclass
class Rotary:
    """cos/sin tables [B, 1, T, D] for one step's positions, computed once for every layer;
    the sin table carries rotate-half's sign (-sin on the first half)."""

    cos: Tensor
    sin: Tensor


def rotary(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> Rotary:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq          # [B, T, D/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]                  # [B, 1, T, D]
    sin = emb.sin()
    sin[..., : head_dim // 2].neg_()
    return Rotary(emb.cos().to(dtype), sin.to(dtype))


def rope(x: Tensor, rot: Rotary) -> Tensor:
    """Rotate x [B, H, T, D]; the rotate-half form Qwen3 uses: x cos + [-x2, x1] sin."""
    return torch.addcmul(x * rot.cos, x.roll(x.shape[-1] // 2, -1), rot.sin)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # one product for both input projections (same weights, one wider matmul)
        gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class Keys:
    """Rotated keys and values, [B, H_kv, T, D]."""

    k: Tensor
    v: Tensor


@dataclass
class Diagonal:
    """Each query row's own keys. Step by step: k, v [B, H_kv, S, Tq, D], the row's keys of
    its S earlier steps, all seen. Steps in rows (`steps` > 0, rows (anchor, step) anchor-major):
    k, v [B, H_kv, Tq, D], each row's own key, seen by the rows of its anchor from its step on."""

    k: Tensor
    v: Tensor
    steps: int = 0


def stacked(keys: list[Keys]) -> Diagonal | None:
    """One key per earlier step of the same row."""
    return Diagonal(torch.stack([x.k for x in keys], 2), torch.stack([x.v for x in keys], 2)) if keys else None


class Attention(nn.Module):
    """Qwen3-style attention (q/k norm unless cfg.qk_norm is False, RoPE, GQA) over prefix + diagonal keys."""

    def __init__(self, in_dim: int, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        # per-head q/k RMSNorm (Qwen3); without it the layer is Llama's, as EAGLE-3's is
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.last_query: Tensor | None = None   # pre-RoPE normed query, for the query-error diagnostic

    def project(self, x: Tensor, rot: Rotary) -> tuple[Tensor, Keys]:
        b, t, _ = x.shape
        # one product for q, k and v (same weights, one wider matmul)
        qkv = F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        q, k, v = qkv.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
        q = self.q_norm(q.reshape(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.reshape(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        self.last_query = q
        return rope(q, rot), Keys(rope(k, rot), v)

    def attend(self, q: Tensor, prefix: Keys, mask: "PrefixMask", diag: list[Keys] | Diagonal | None) -> Tensor:
        """q [B, H, Tq, D]; prefix keys [B, Hkv, Tp, D] seen through `mask`; diag: per earlier
        step, keys [B, Hkv, Tq, D] of the same query row (or already a `Diagonal`). Row blocks
        skip the prefix keys they cannot see (a causal batch's upper triangle; other
        sequences' keys when packed)."""
        b, h, tq, d = q.shape
        if isinstance(diag, list):
            diag = stacked(diag)
        dk, dv, steps = (None, None, 0) if diag is None else (diag.k, diag.v, diag.steps)
        # one compute dtype for every operand: autocast's (bf16 runtime) or the query's
        dt = compute_dtype(q.device.type, q.dtype)
        q, pk, pv = q.to(dt), prefix.k.to(dt), prefix.v.to(dt)
        dk, dv = (None, None) if dk is None else (dk.to(dt), dv.to(dt))
        # the configured backend (`drafters.attention`; auto: per device and dtype), see `attention`
        out = attention(q, pk, pv, mask, dk, dv, steps, 1.0 / math.sqrt(d))
        return self.o_proj(out.transpose(1, 2).reshape(b, tq, h * d))   # a view when it wrote [B, Tq, H, D]


@dataclass
class PrefixMask:
    """Which prefix keys each query row sees, built once per slot and row set (every step
    and layer of an unroll reuses it): an additive bias, and row blocks with the span of
    keys the block can see at all (keys are in sequence and anchor order)."""

    bias: Tensor                               # [B, 1, 1, Tq, Tp]: 0 where visible, -inf elsewhere
    blocks: list[tuple[int, int, int, int]]    # (first row, end row, first key, end key)
    _flash: list | None = field(default=None, repr=False)
    cache: dict = field(default_factory=dict, repr=False)   # a backend's per-step masks, shared by the layers

    def visible(self) -> Tensor:
        """[B, Tq, Tp] bool: the keys each row sees (built once)."""
        if "visible" not in self.cache:
            self.cache["visible"] = self.bias[:, 0, 0] == 0
        return self.cache["visible"]

    def spread(self, steps: int) -> "PrefixMask":
        """Each row as `steps` consecutive rows that see the same keys."""
        if steps == 1:
            return self
        return PrefixMask(self.bias.repeat_interleave(steps, dim=3),
                          [(r0 * steps, r1 * steps, k0, k1) for r0, r1, k0, k1 in self.blocks])

    def flash_blocks(self) -> list:
        """The blocks with their bias for the fused kernel, broadcast over heads: (r0, r1, k0,
        k1, bias [B, 1, R, Tk], rows that see no key [B, 1, R] or None); built once."""
        if self._flash is None:
            self._flash = []
            for r0, r1, k0, k1 in self.blocks:
                bias = self.bias[:, 0, :, r0:r1, k0:k1].contiguous()
                blind = torch.isinf(bias).all(-1)
                self._flash.append((r0, r1, k0, k1, bias, blind if bool(blind.any()) else None))
        return self._flash


# query rows per attention block (None: one block per packed sequence). A sequence's rows up to
# here run as one block: a fused kernel call costs more than the invisible keys it would skip
# in a short block; past it, blocks skip the keys past their last anchor.
BLOCK_ROWS: int | None = 512


def prefix_mask(visible: Tensor, dtype: torch.dtype, segments: list[tuple[int, int]] | None = None,
                block_rows: int | None = None) -> PrefixMask:
    """visible [B, Tq, Tp] -> PrefixMask. `segments`: row ranges of one packed sequence each
    (None: one block); each block reads only the span of keys it can see, so packed rows
    skip the other sequences' keys and a sequence's rows skip its keys past their anchors."""
    b, tq, tp = visible.shape
    block_rows = block_rows or BLOCK_ROWS
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    ranges = [(r0, r1) for s0, s1 in (segments or [(0, tq)])
              for r0 in range(s0, s1, block_rows or s1 - s0) for r1 in [min(r0 + (block_rows or s1 - s0), s1)]]
    if ranges == [(0, tq)]:
        return PrefixMask(bias[:, None, None], [(0, tq, 0, tp)])
    seen = visible.any(0)                                                # [Tq, Tp]
    cols = torch.arange(tp, device=visible.device)
    first = torch.where(seen, cols, tp).amin(-1).tolist()               # per row: first visible key (tp: none)
    last = torch.where(seen, cols, -1).amax(-1).tolist()                # per row: last visible key (-1: none)
    blocks = []
    for r0, r1 in ranges:
        k0, k1 = min(first[r0:r1]), max(last[r0:r1]) + 1
        blocks.append((r0, r1, *((k0, k1) if k1 > k0 else (0, tp))))    # a block that sees nothing: as before
    return PrefixMask(bias[:, None, None], blocks)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU. `in_dim` may exceed hidden_size (EAGLE-3's first
    layer reads [embedding; hidden]); the residual is then the hidden half."""

    def __init__(self, in_dim: int, cfg: DrafterConfig):
        super().__init__()
        self.attn_norm = RMSNorm(in_dim, cfg.rms_norm_eps)
        self.self_attn = Attention(in_dim, cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def mlp_block(self, h: Tensor) -> Tensor:
        return h + self.mlp(self.mlp_norm(h))


@dataclass
class StepState:
    """What a paradigm carries between steps of one unroll."""

    anchors: Tensor                       # [B, Tq] anchor index of each query row
    prefix: list[Keys | None]             # per layer
    prefix_anchor: list[Tensor | None]    # per layer, [B, Tp] anchor index of each prefix key
    prefix_valid: list[Tensor | None]     # per layer, [B, Tp] padding mask (None: all valid)
    diag: list[list[Keys]] = field(default_factory=list)   # per layer, one Keys per step
    hidden: Tensor | None = None          # hidden-state paradigms: the carried state
    extra: dict = field(default_factory=dict)

    steps_in_rows: int = 0                # > 0: rows are (anchor, step) pairs, anchor-major (`spread_steps`)
    row_seq: Tensor | None = None         # packed rows: [1, Tq] the sequence of each row
    pack_after_prefix: Tensor | None = None   # rows to pack once step 0 has written every prefix key
    step0_prefix: bool = True             # step 0's own keys join the prefix (False: a diagonal, `branch_unroll`)
    prefix_seq: list[Tensor | None] = field(default_factory=list)   # packed: per layer [1, Tp] each key's sequence
    _masks: list = field(default_factory=list, repr=False)   # (what it was built from, PrefixMask)

    def add_slots(self, n: int) -> int:
        """Append `n` slots with no prefix yet; returns the first new slot."""
        first = len(self.prefix)
        self.prefix += [None] * n
        self.prefix_anchor += [None] * n
        self.prefix_valid += [None] * n
        self.diag += [[] for _ in range(n)]
        return first

    def select_rows(self, rows: Tensor | slice) -> None:
        """Keep only some query rows (decoding: after step 0 over the newly accepted tokens,
        only the last anchor drafts on; tree children take their parent's row). Prefix
        caches are untouched."""
        self._take_rows(lambda x, dim: x[(slice(None),) * dim + (rows,)])

    def _take_rows(self, take) -> None:
        """Apply `take(tensor, row_dim)` to everything indexed by query row."""
        self.anchors = take(self.anchors, 1)
        if self.hidden is not None:
            self.hidden = take(self.hidden, 1)
        self.diag = [[Keys(take(d.k, 2), take(d.v, 2)) for d in slot] for slot in self.diag]
        if self.extra.get("valid") is not None:
            self.extra["valid"] = take(self.extra["valid"], 1)

    def pack(self, rows: Tensor):
        """Training: keep the query rows `rows` (flat indices b * Tq + r, ascending) as one
        packed sequence [1, R]. Every sequence's prefix is concatenated into one [1, B * Tp]
        and visibility also asks for the same sequence, so no row is padded to the longest.
        Returns `take(x, row_dim)`, which packs any other per-row tensor the same way."""
        b, tq = self.anchors.shape

        def take(x: Tensor, dim: int) -> Tensor:   # rows along `dim` -> one packed row dim
            return x.movedim(dim, 1).reshape(b * tq, *x.shape[1:dim], *x.shape[dim + 1:])[rows][None].movedim(1, dim)

        done: dict[int, Tensor] = {}   # slots that share a tensor share its packed form (and their masks)

        def concat(x: Tensor, dim: int) -> Tensor:   # every sequence's keys in one row dim
            if id(x) not in done:
                done[id(x)] = x.movedim(dim, 1).reshape(1, -1, *x.shape[1:dim], *x.shape[dim + 1:]).movedim(1, dim)
            return done[id(x)]

        self.row_seq = (rows // tq)[None]
        self.prefix_seq = [None if a is None else torch.arange(b, device=a.device).repeat_interleave(a.shape[1])[None]
                           for a in self.prefix_anchor]
        self.prefix = [None if p is None else Keys(concat(p.k, 2), concat(p.v, 2)) for p in self.prefix]
        self.prefix_anchor = [None if a is None else concat(a, 1) for a in self.prefix_anchor]
        self.prefix_valid = [None if v is None else concat(v, 1) for v in self.prefix_valid]
        self._take_rows(take)
        self.pack_after_prefix = None
        return take

    def spread_steps(self, steps: int) -> None:
        """Training, a drafter whose steps share nothing but their own keys: each query row
        becomes `steps` rows (anchor-major), one per step, all computed in one call."""
        self._take_rows(lambda x, dim: x.repeat_interleave(steps, dim))
        if self.row_seq is not None:
            self.row_seq = self.row_seq.repeat_interleave(steps, 1)
        self.steps_in_rows = steps

    def diagonal(self, slot: int) -> list[Keys] | Diagonal:
        """The slot's own keys for `Attention.attend`: every earlier step's key of the row, or,
        with steps in rows, the keys one call wrote for every row."""
        if not self.steps_in_rows:
            return self.diag[slot]
        (own,) = self.diag[slot]
        return Diagonal(own.k, own.v, self.steps_in_rows)

    def visible(self, slot: int, every: int = 1) -> Tensor:
        """[B, Tq, Tp]: a prefix key is visible to an anchor computed no later than it (packed:
        of the same sequence); `every`: only every so many rows."""
        anchors = self.anchors[:, ::every]
        vis = self.prefix_anchor[slot][:, None, :] <= anchors[:, :, None]
        if self.prefix_valid[slot] is not None:
            vis = vis & self.prefix_valid[slot][:, None, :].bool()
        if self.row_seq is not None:
            vis = vis & (self.prefix_seq[slot][:, None, :] == self.row_seq[:, ::every, None])
        return vis

    def segments(self, every: int = 1) -> list[tuple[int, int]] | None:
        """Packed rows: the row range of each sequence (rows are in sequence order)."""
        if self.row_seq is None:
            return None
        seq = self.row_seq[0, ::every]
        starts = [0] + (torch.nonzero(seq[1:] != seq[:-1]).view(-1) + 1).tolist() + [len(seq)]
        return list(zip(starts[:-1], starts[1:]))

    def mask(self, slot: int, dtype: torch.dtype) -> PrefixMask:
        """`visible` as a PrefixMask, rebuilt only when the prefix or the rows change (slots
        with the same prefix share one). Steps in rows: built per anchor, then spread."""
        built_from = (self.prefix_anchor[slot], self.prefix_valid[slot], self.anchors)
        for cached_from, cached in self._masks:
            if all(a is b for a, b in zip(cached_from, built_from)):
                return cached
        every = self.steps_in_rows or 1   # built per anchor: an anchor's step rows see the same keys
        block_rows = BLOCK_ROWS and max(1, BLOCK_ROWS // every)
        mask = prefix_mask(self.visible(slot, every), dtype, self.segments(every), block_rows).spread(every)
        self._masks = [(f, m) for f, m in self._masks if f[2] is self.anchors] + [(built_from, mask)]
        return mask


# frozen copies of the target's tensors: never saved (2.5 GB fp32 at Qwen3-8B); loading takes them from the target
FROM_TARGET = ("embed_tokens.weight",)


class Drafter(nn.Module):
    """Shared parts: frozen target embedding, decoder layers, final norm, draft-vocab head.
    A paradigm subclass says how the target's context enters (`begin`, `step`). There is no
    `forward`: what a drafter computes is an unroll (`unroll.unroll`; under DDP, `unroll.TTTUnroll`)."""

    paradigm = "base"
    reads_aux_hidden = False   # whether `begin` needs the target's aux hidden states
    prefix_from_step0 = True   # step 0's keys are the prefix of later anchors: every anchor runs step 0
    causal_lm = False          # a plain causal LM: teacher-forced step k at anchor t = step 0 at anchor t + k
    steps_in_one_pass = False  # teacher-forced steps share only their own keys: every step in one call (`unroll`)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool), persistent=True)

    # -------------------------------------------------------------- paradigm hooks
    def begin(self, ctx: dict[str, Tensor], anchors: Tensor, previous: StepState | None = None) -> StepState:
        """Start an unroll from `anchors` [B, Tq]. ctx holds the target's context: aux hidden
        states at the anchor rows, and/or the prefix KV [B, Tp, H_kv, D] (with `valid`, and
        `prefix_anchor` when it is not simply 0..Tp-1). `previous` carries the drafter's own
        prefix cache from earlier rounds (decoding)."""
        raise NotImplementedError

    def step(self, state: StepState, input_ids: Tensor, positions: Tensor, k: int) -> Tensor:
        """One draft step for every anchor row: returns the output hidden state [B, Tq, H]."""
        raise NotImplementedError

    def kv_path_parameters(self) -> dict[str, list[nn.Parameter]]:
        """Parameter groups of the KV path, for the gradient diagnostics (empty: no KV path)."""
        return {}

    def kv_attentions(self) -> list[tuple[int, Attention]]:
        """(target layer, attention) pairs whose queries re-attend to the target's KV."""
        return []

    # -------------------------------------------------------------- shared
    def compute_dtype(self) -> torch.dtype:
        """The dtype the target's features are cast to on entry (`unroll.context`)."""
        w = self.lm_head.weight
        return compute_dtype(w.device.type, w.dtype)

    def rotary(self, positions: Tensor) -> Rotary:
        return rotary(positions, self.cfg.head_dim, self.cfg.rope_theta, self.embed_tokens.weight.dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def set_vocab(self, embed: Tensor, d2t: Tensor) -> None:
        self.embed_tokens.weight.data.copy_(embed)
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[d2t] = True

    def save(self, folder: str | Path, extra_files: dict[str, object] | None = None) -> None:
        with atomic_dir(folder) as tmp:
            self.cfg.save(tmp / "config.json")
            shared = () if self.cfg.own_embedding else FROM_TARGET   # a head's own embedding is its own tensor
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items() if k not in shared},
                      str(tmp / "model.safetensors"))
            for name, obj in (extra_files or {}).items():
                write_json(tmp / name, obj)
            write_manifest(tmp, ["config.json", "model.safetensors"])   # checked in full on load
