"""Target features behind one interface: offline safetensors shards, or an online
target forward for scales where disk cannot hold the KV cache.

Both modes write the tokenized split (input_ids, loss_mask) into shards with an
index; offline shards also hold, per token, the three aux hidden states, the final
hidden state, and keys/values of the chosen layers. Tensors are token-major and
concatenated without padding, so bytes per token is exactly the sum of the parts.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open
from torch import Tensor

from kvshot.capture.shard_writer import ShardWriter
from kvshot.capture.target import load_target, load_target_config, target_forward
from kvshot.config import FeatureSpec, Runtime, feature_spec
from kvshot.core.integrity import file_record, verify_file
from kvshot.core.io import atomic_dir, read_json, write_json
from kvshot.core.progress import progress
from kvshot.data.chat import tokenize_conversation
from kvshot.data.sources import read_jsonl
from kvshot.settings import Config

INDEX = "index.json"
TOKEN_KEYS = ("input_ids", "loss_mask")


def feature_names(spec: FeatureSpec, kv_layers=None, aux_hidden: bool = True) -> list[str]:
    """The stored tensors' names; kv_layers / aux_hidden: only those a reader needs (the
    labels' `last_hidden` always)."""
    names = ["aux_hidden", "last_hidden"] if aux_hidden else ["last_hidden"]
    for l in spec.kv_layers if kv_layers is None else kv_layers:
        names += [f"key_{l}", f"value_{l}"]
    return names


def feature_bytes_per_token(spec: FeatureSpec, config) -> int:
    elem = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    per_layer_kv = 2 * config.num_key_value_heads * config.head_dim
    return elem * (4 * config.hidden_size + len(spec.kv_layers) * per_layer_kv)


def context_features(ctx, spec: FeatureSpec, kv_layers=None, aux_hidden: bool = True,
                     device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """What is stored of a padded batch's TargetContext, by name, on `device` in the spec's dtype
    ([B, T, ...]; keys/values stay strided views when no conversion is needed); kv_layers /
    aux_hidden: only what a reader needs (`feature_names`)."""
    dtype = getattr(torch, spec.dtype)
    named = {"aux_hidden": ctx.aux_hidden} if aux_hidden else {}
    named["last_hidden"] = ctx.last_hidden
    for l in spec.kv_layers if kv_layers is None else kv_layers:
        named[f"key_{l}"], named[f"value_{l}"] = ctx.keys[l], ctx.values[l]
    return {k: v.to(device=device, dtype=dtype) for k, v in named.items()}


def batch_rows(model, batch: dict[str, Tensor], spec: FeatureSpec, device: str) -> dict[str, Tensor]:
    """Everything stored for a padded batch, by name ([B, T, ...])."""
    ctx = target_forward(model, batch["input_ids"].long().to(device), batch["attention_mask"].to(device),
                         spec.aux_layers, spec.kv_layers)
    return {**{k: batch[k] for k in TOKEN_KEYS}, **context_features(ctx, spec)}


def pad_batch(samples: list[dict[str, Tensor]], pad_id: int = 0) -> dict[str, Tensor]:
    """Right-pad per-sample tensors to [B, T_max, ...] and add attention_mask."""
    t_max = max(s["input_ids"].shape[0] for s in samples)
    batch: dict[str, Tensor] = {}
    for key in samples[0]:
        first = samples[0][key]
        fill = pad_id if key == "input_ids" else 0
        out = torch.full((len(samples), t_max, *first.shape[1:]), fill, dtype=first.dtype)
        for b, s in enumerate(samples):
            out[b, : s[key].shape[0]] = s[key]
        batch[key] = out
    batch["attention_mask"] = torch.zeros(len(samples), t_max, dtype=torch.long)
    for b, s in enumerate(samples):
        batch["attention_mask"][b, : s["input_ids"].shape[0]] = 1
    return batch


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices (sorted by length) so each padded batch stays under batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def tokenize_split(jsonl: str | Path, tokenizer, max_len: int) -> list[dict[str, Tensor]]:
    samples = []
    for conv in read_jsonl(jsonl):
        ids, mask = tokenize_conversation(tokenizer, conv["messages"], max_len)
        samples.append({"input_ids": torch.tensor(ids, dtype=torch.int32),
                        "loss_mask": torch.tensor(mask, dtype=torch.uint8)})
    return samples


def capture_split(cfg: Config, rt: Runtime, split_jsonl: str, target_dir: str, out_dir: str) -> dict:
    """The `capture_features` stage for one split."""
    fcfg = cfg.features
    offline = fcfg.mode == "offline"
    # online: the trainer runs the target; this stage only tokenizes, so it reads the config alone
    model = load_target(target_dir, rt, cfg.target.attn_implementation) if offline else None
    config = model.config if offline else load_target_config(target_dir)
    from kvshot.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    spec = feature_spec(fcfg, config.num_hidden_layers)
    max_len = fcfg.max_len or cfg.data.max_len
    samples = tokenize_split(split_jsonl, tokenizer, max_len)[: fcfg.max_samples or None]
    lengths = [s["input_ids"].shape[0] for s in samples]
    start = time.perf_counter()
    with atomic_dir(out_dir) as tmp:
        groups = length_batches(lengths, fcfg.batch_tokens)
        with ShardWriter(tmp, [i for g in groups for i in g], lengths, fcfg.shard_tokens) as writer:
            for group in progress(groups, desc=f"capture {Path(split_jsonl).stem}", unit="batch"):
                batch = pad_batch([samples[i] for i in group], tokenizer.pad_token_id)
                # a temporary: the batch's activations are freed before the next forward allocates its own
                writer.add(group, batch_rows(model, batch, spec, rt.device) if offline else
                           {k: batch[k] for k in TOKEN_KEYS}, padded=True)
        tokens = sum(lengths)
        index = {
            "mode": fcfg.mode,
            "target": str(target_dir),
            "spec": {"aux_layers": list(spec.aux_layers), "kv_layers": list(spec.kv_layers), "dtype": spec.dtype},
            "hidden_size": config.hidden_size,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "pad_id": tokenizer.pad_token_id,
            "num_samples": len(samples),
            "tokens": tokens,
            "assistant_tokens": int(sum(int(s["loss_mask"].sum()) for s in samples)),
            "bytes_written": writer.bytes,
            "bytes_per_token": writer.bytes / max(1, tokens),
            "bytes_per_token_by_tensor": {k: v / max(1, tokens) for k, v in writer.bytes_by_name.items()},
            # what caching every feature would cost per token (online mode pays target forwards instead)
            "feature_bytes_per_token": feature_bytes_per_token(spec, config),
            "capture_seconds": time.perf_counter() - start,   # the capture loop: forwards and writes
            "shards": writer.shards,
            # size and sha256 per shard: a reader checks a shard the first time it opens it
            "shard_checksums": {name: file_record(tmp / name) for name in writer.shards},
            "samples": [writer.locations[i] for i in range(len(samples))],
        }
        write_json(tmp / INDEX, index)
    return {k: v for k, v in index.items() if k != "samples"}


# ------------------------------------------------------------------ reading

class FeatureSource(Protocol):
    """What the trainer and evaluator read; offline and online look the same."""

    spec: FeatureSpec
    index: dict

    def __len__(self) -> int: ...
    def tokens(self, i: int) -> dict[str, Tensor]: ...
    def sample(self, i: int) -> dict[str, Tensor]: ...
    def batch(self, ids: list[int]) -> dict[str, Tensor]: ...
    def read_only(self, kv_layers=None, aux_hidden: bool = True) -> "FeatureSource": ...


def batches(source: FeatureSource, batch_size: int, shuffle: bool = False, seed: int = 0,
            epoch: int = 0) -> Iterator[dict[str, Tensor]]:
    """Padded batches in a seed- and epoch-determined order."""
    order = list(range(len(source)))
    if shuffle:
        gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(len(source), generator=gen).tolist()
    for i in range(0, len(order), batch_size):
        yield source.batch(order[i: i + batch_size])


class _Tokens:
    """Shared by both modes: the index and lazy per-sample slices of the shards."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            self.index = read_json(self.folder / INDEX)
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"{self.folder / INDEX}: cannot read feature index ({exc})") from None
        s = self.index["spec"]
        self.spec = FeatureSpec(tuple(s["aux_layers"]), tuple(s["kv_layers"]), s["dtype"])
        self._handles: dict[int, object] = {}
        self.kv_layers, self.aux_hidden = self.spec.kv_layers, True   # what `read_only` keeps

    def __len__(self) -> int:
        return self.index["num_samples"]

    def read_only(self, kv_layers=None, aux_hidden: bool = True) -> "_Tokens":
        """From here on, batches hold only these KV layers (None: all the spec holds) and the
        aux hidden states only if asked: what one drafter reads, not every captured layer."""
        kv_layers = self.spec.kv_layers if kv_layers is None else tuple(kv_layers)
        missing = sorted(set(kv_layers) - set(self.spec.kv_layers))
        if missing:
            raise ValueError(f"{self.folder / INDEX}: spec.kv_layers: layers {missing} are not captured "
                             f"(have {list(self.spec.kv_layers)})")
        self.kv_layers, self.aux_hidden = kv_layers, aux_hidden
        return self

    def tokens(self, i: int) -> dict[str, Tensor]:
        return self._read(i, TOKEN_KEYS)

    def _read(self, i: int, names) -> dict[str, Tensor]:
        shard, start, n = self.index["samples"][i]
        if shard not in self._handles:
            name = self.index["shards"][shard]
            if "shard_checksums" in self.index:   # indexes written before checksums have none
                verify_file(self.folder / name, self.index["shard_checksums"][name])
            self._handles[shard] = safe_open(str(self.folder / name), framework="pt")
        h = self._handles[shard]
        return {k: h.get_slice(k)[start: start + n] for k in names}


class OfflineFeatures(_Tokens):
    def sample(self, i: int) -> dict[str, Tensor]:
        return self._read(i, [*TOKEN_KEYS, *feature_names(self.spec, self.kv_layers, self.aux_hidden)])

    def batch(self, ids: list[int]) -> dict[str, Tensor]:
        return pad_batch([self.sample(i) for i in ids], self.index["pad_id"])


class OnlineFeatures(_Tokens):
    """Runs the target on each batch instead of reading cached activations. Batches stay on
    the target's device (no round trip through the host) and hold only what `read_only`
    keeps; padding is zero, as offline."""

    def __init__(self, folder: str | Path, rt: Runtime, attn: str = "auto", model=None):
        super().__init__(folder)
        self.rt = rt
        self.model = model if model is not None else load_target(self.index["target"], rt, attn)

    def sample(self, i: int) -> dict[str, Tensor]:
        return {k: v[0] for k, v in self.batch([i]).items() if k != "attention_mask"}

    def batch(self, ids: list[int]) -> dict[str, Tensor]:
        device = self.model.device
        batch = {k: v.to(device) for k, v in pad_batch([self.tokens(i) for i in ids], self.index["pad_id"]).items()}
        ctx = target_forward(self.model, batch["input_ids"].long(), batch["attention_mask"], self.spec.aux_layers,
                             self.kv_layers)
        pad = ~batch["attention_mask"].bool()
        for name, v in context_features(ctx, self.spec, self.kv_layers, self.aux_hidden, device).items():
            batch[name] = v.masked_fill(pad.view(*pad.shape, *[1] * (v.dim() - 2)), 0)
        return batch


def open_features(folder: str | Path, rt: Runtime | None = None, attn: str = "auto", model=None,
                  kv_layers=None, aux_hidden: bool = True) -> FeatureSource:
    """Offline or online, as the capture stage recorded; `model` shares an already loaded target;
    kv_layers / aux_hidden: read only these (`read_only`)."""
    src = _Tokens(folder)
    if src.index["mode"] == "offline":
        return OfflineFeatures(folder).read_only(kv_layers, aux_hidden)
    if rt is None:
        raise ValueError(f"{folder}: online features need a Runtime to run the target")
    return OnlineFeatures(folder, rt, attn, model).read_only(kv_layers, aux_hidden)
