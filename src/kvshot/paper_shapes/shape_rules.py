"""The paper config's GPU rules at their real shapes, run by `shapes.ShapeMeter`: peak memory
per rank and FLOPs of one training step, evaluation batch or decoding call, with the real
kvshot functions and a Qwen3-8B-shaped target (bf16, no weights).

Data: every sequence at its full length and every token an assistant token, the worst case
for every size the code derives from the masks (packed rows, labelled anchors). Attention:
the drafters run `flex_like` for every dtype (`cuda_like_attention`): what CUDA's
flex_attention keeps for backward (q, the concatenated [prefix; diagonal] keys and values,
the output and logsumexp) and SDPA's efficient kernel allocates (keys repeated per head),
with `flash_cpu`'s math, where the CPU's own bf16 pick (`block`) would keep [heads, rows,
keys] probabilities; the target runs SDPA (flash-attn's memory).

What the fake-tensor peak cannot see is booked as a stated allowance (`cuda_gb`): the CUDA
context, NCCL's buffers, the cuBLAS/Triton workspaces (`CUDA_FIXED_GB`) and the caching
allocator's rounding and fragmentation (`FRAGMENTATION`, under
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which workflow/rules/common.smk exports
to every job). A rule fits when its peak with the allowance stays under the booked GPU less
`HEADROOM_GB` (`fits_gpu`); docs/paper-scale.md states the numbers and their sources.
`benchmarks/paper_shapes.py` prints the table.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvshot.capture.features import batch_rows, open_features, pad_batch
from kvshot.capture.target import heldout_loss
from kvshot.config import Runtime, feature_spec
from kvshot.drafters import attention as attention_backends
from kvshot.drafters.unroll import label_positions, training_forward
from kvshot.evaluate.decode import speculative_generate
from kvshot.evaluate.e2e import specs
from kvshot.evaluate.branches import branch_rollouts
from kvshot.evaluate.natural import natural_results
from kvshot.evaluate.references import greedy_continuations
from kvshot.paper_shapes.shapes import GB, ShapeMeter
from kvshot.settings import Config
from kvshot.train import loop as train_module
from kvshot.train.diagnostics import grad_norms
from kvshot.train.heldout import evaluate
from kvshot.train.objective import objective, scored_tokens, step_losses, target_labels, weighted_loss
from kvshot.train.variants import build_variant, param_groups, variant_config

# Qwen/Qwen3-8B's config.json (the revision config/paper.yaml pins): the shapes that matter
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False)
# The smaller Qwen3s a config can name (config/one-gpu.yaml), from their config.json at the pinned revision
QWEN3_ARCHS = {
    "Qwen/Qwen3-8B": QWEN3_8B,
    "Qwen/Qwen3-1.7B": {**QWEN3_8B, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "tie_word_embeddings": True},
    "Qwen/Qwen3-0.6B": {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                        "num_attention_heads": 16, "tie_word_embeddings": True},
}


# ---------------------------------------------------------------- what the meter cannot see
# The GPU every GPU rule books: profiles/slurm books `gpu: 1` of its GPU partition per process
# and states no model, so the paper's: an H100 SXM with 80 GB (GB = 10^9 bytes, as the meter's).
GPU_GB = 80.0
# Never plan a rule above GPU_GB - HEADROOM_GB = 72 GB: what the allowance below gets wrong
# (an unmeasured kernel workspace, a longer packed row, a new PyTorch) must still fit.
HEADROOM_GB = 8.0
# Per rank, fixed: the CUDA context with its loaded modules (~0.5-1 GB on an H100 with CUDA 12's
# lazy loading), NCCL's communicator buffers for DDP over 8 NVLink GPUs (~1.6 GB reported for
# one communicator after an all-reduce, NVIDIA/nccl#864; NVLS on H100 adds to it), the cuBLAS and
# cuBLASLt workspaces (32 MiB per handle on Hopper) and the compiled flex kernels. A one-GPU rule
# has no NCCL: the same number over-books it by ~1.6 GB.
CUDA_FIXED_GB = 3.0
# The caching allocator's reserved-over-allocated under packed shapes that change every step:
# block rounding (512 B; 2 MiB pages with expandable segments) and fragmentation, which
# expandable_segments:True bounds by growing one segment instead of caching odd-sized blocks.
FRAGMENTATION = 0.10


def cuda_gb(peak_gb: float) -> float:
    """A measured peak (GB) with the CUDA allowance: peak x (1 + FRAGMENTATION) + CUDA_FIXED_GB."""
    return peak_gb * (1 + FRAGMENTATION) + CUDA_FIXED_GB


def gpu_limit_gb(gpu_gb: float = GPU_GB) -> float:
    """What a rule may use of the booked GPU: its memory less HEADROOM_GB."""
    return gpu_gb - HEADROOM_GB


def ddp_buckets_alias_grads() -> bool:
    """Whether the trainer's DDP wrap sets `gradient_as_bucket_view=True` (read from
    `train.loop.setup_member`'s source: the meter cannot run DDP). Then DDP's buckets are the gradients,
    resident all step; otherwise each bucket is one more copy of them."""
    return "gradient_as_bucket_view=True" in inspect.getsource(train_module.setup_member)


def config_arch(cfg: Config) -> dict:
    """The shapes of the config's pretrained target (QWEN3_ARCHS by hub name); Qwen3-8B otherwise."""
    return QWEN3_ARCHS.get(cfg.target.name, QWEN3_8B)


@dataclass
class Row:
    rule: str        # the Snakemake rule (or the part of one)
    what: str        # variant or path
    peak_gb: float   # peak bytes per rank / 1e9
    tflop: float     # FLOPs of the measured call / 1e12
    per: str         # what the FLOPs are for: "step", "anchor", "token", ...
    units: float     # how many `per` the measured call covers (tflop / units per unit)
    seconds: float   # CPU time the measurement took

    @property
    def tflop_per(self) -> float:
        return self.tflop / self.units

    @property
    def cuda_gb(self) -> float:
        """The peak with the CUDA allowance (context, NCCL, workspaces, fragmentation)."""
        return cuda_gb(self.peak_gb)

    def fits(self, gpu_gb: float = GPU_GB) -> bool:
        return self.cuda_gb <= gpu_limit_gb(gpu_gb)


class _FlexSaves(torch.autograd.Function):
    """An identity on q whose node holds the concatenated keys and values until the attention's
    backward has run (it sits before the attention: its backward runs after it), as
    flex_attention's own node does; it adds nothing to the FLOPs."""

    @staticmethod
    def forward(ctx, q, k_cat, v_cat):
        ctx.save_for_backward(k_cat, v_cat)
        return q.view_as(q)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def flex_like(q, k, v, mask, dk, dv, steps, scale):
    """`attention._flex`'s memory with `flash_cpu`'s math (flex has no CPU backward). Training:
    the same torch.cat of [prefix; diagonal] keys and values, kept for backward beside what
    flash_cpu saves (q, k, v, dk, dv, the output and logsumexp: q, the output and logsumexp
    are what flex keeps too; k, v, dk, dv are the layer's own tensors, live anyway; flash_cpu
    also keeps its diagonal probabilities, [B, N, S, G, Tq], which flex does not: a slight
    over-count). No grad (`_sdpa` on CUDA: evaluation, decoding): the concatenated keys repeated
    per query head (GQA as the efficient kernel takes it), live for the call; _sdpa makes them
    per row block, this for all rows at once (an upper bound)."""
    k_cat, v_cat = k, v
    if dk is not None:
        k_cat = torch.cat([k, dk if steps else dk.flatten(2, 3)], dim=2)
        v_cat = torch.cat([v, dv if steps else dv.flatten(2, 3)], dim=2)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, dk, dv)):
        q = _FlexSaves.apply(q, k_cat, v_cat)
        return attention_backends._flash_cpu(q, k, v, mask, dk, dv, steps, scale)
    g = q.shape[1] // k.shape[1]
    repeated = (k_cat.repeat_interleave(g, 1), v_cat.repeat_interleave(g, 1))
    out = attention_backends._flash_cpu(q, k, v, mask, dk, dv, steps, scale)
    del repeated
    return out


@contextlib.contextmanager
def cuda_like_attention():
    """Every drafter attention through `flex_like` in any dtype: the memory of CUDA's flex
    (training) and SDPA efficient (decoding) kernels, flash_cpu's math."""
    chosen = attention_backends.chosen_attention()
    saved = attention_backends._BACKEND_FUNCTIONS["flex"]
    attention_backends._BACKEND_FUNCTIONS["flex"] = flex_like
    attention_backends.use_attention("flex")
    try:
        yield
    finally:
        attention_backends._BACKEND_FUNCTIONS["flex"] = saved
        attention_backends.use_attention(chosen)


def build_target(arch: dict, attn: str = "sdpa") -> Qwen3ForCausalLM:
    """A Qwen3 of these shapes in bf16 (built under a ShapeMeter: no weights in memory)."""
    config = Qwen3Config(attn_implementation=attn, **arch)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)   # built in bf16: no fp32 copy first
    try:
        return Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)


def token_folder(folder: Path, samples: int, length: int, spec, pad_id: int = 0) -> Path:
    """A features folder as capture_features writes it in online mode (tokens only):
    `samples` sequences of `length` tokens, every one an assistant token."""
    folder.mkdir(parents=True, exist_ok=True)
    n = samples * length
    save_file({"input_ids": torch.ones(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8)},
              str(folder / "shard0.safetensors"))
    index = {"mode": "online", "target": "in-memory", "spec": {"aux_layers": list(spec.aux_layers),
             "kv_layers": list(spec.kv_layers), "dtype": spec.dtype}, "pad_id": pad_id,
             "num_samples": samples, "shards": ["shard0.safetensors"],
             "samples": [[0, i * length, length] for i in range(samples)]}
    (folder / "index.json").write_text(json.dumps(index))
    return folder


class PaperShapes:
    """The paper config's shapes and one ShapeMeter-built target, shared by every row."""

    def __init__(self, cfg: Config, arch: dict | None = None, world: int | None = None):
        self.cfg = cfg
        self.arch = arch or config_arch(cfg)
        tc = cfg.drafters.train
        self.world = world or tc.num_processes
        self.length = tc.max_len
        self.rt = Runtime(device="cpu", dtype=cfg.dtype, threads=1, seed=0)
        self.meter = ShapeMeter()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvshot-shapes-")
        with self.meter:
            self.target = build_target(self.arch)
        self.spec = feature_spec(cfg.features, self.arch["num_hidden_layers"])
        samples = max(tc.batch_size, cfg.eval.natural.batch_size)
        self.folder = token_folder(Path(self._tmp.name) / "features", samples, self.length, self.spec)

    def variants(self) -> list[str]:
        return [v.name for v in self.cfg.all_variants()]

    def drafter(self, name: str):
        v = variant_config(self.cfg, name)
        d2t = torch.arange(self.cfg.drafters.draft_vocab_size)   # the count is what matters
        model = build_variant(v, self.target.config, self.target.model.embed_tokens.weight.detach(), d2t, self.target)
        return v, model

    @contextlib.contextmanager
    def _measure(self, rows: list, rule: str, what: str, per: str, units: float):
        """Measure the enclosed call: peak over it (with what is resident), its FLOPs."""
        m, start = self.meter, time.perf_counter()
        with cuda_like_attention(), m.measuring():
            yield
        rows.append(Row(rule, what, m.peak / GB, m.flops / 1e12, per, units,
                        time.perf_counter() - start))

    # ------------------------------------------------------------ training
    def train_rows(self, name: str) -> list[Row]:
        """train_drafter: one logging step per rank, as `train.train_step` runs it (online target
        forward, labels, the unroll, the losses, backward, `train.grad_norms`, clip, AdamW with
        its state; the unroll's logits, the labels and the graph dropped after the backward, the
        batch live until the step ends: the worst case, a logging step without probe batches),
        then `train.evaluate`
        on one batch. DDP (world > 1): its buckets are resident all step, the gradients
        themselves when `gradient_as_bucket_view=True` (`ddp_buckets_alias_grads`), one more
        copy otherwise. Nothing of the previous step is live when a step starts (the trainer
        drops it)."""
        rows: list[Row] = []
        tc = self.cfg.drafters.train
        m = self.member(name)
        src = open_features(self.folder, self.rt, model=self.target)
        src.read_only(m.model.cfg.kv_layers, m.model.reads_aux_hidden)
        head_w = self.target.lm_head.weight.detach()
        with self._measure(rows, "train_drafter", name, "step", 1):
            batch = src.batch(list(range(tc.batch_size // self.world)))   # the online target forward
            self.member_step(m, batch, head_w)   # the batch still live: a logging step without probe batches keeps it
            del batch
        kv = bool(m.model.kv_attentions())
        share = tc.batch_size // self.world   # one rank's share of a global evaluation batch (DDP: `evaluate`)
        with self._measure(rows, "train_drafter evaluate", name, "sequence", share):
            evaluate(m.model, src, head_w, m.steps, share, 1, self.target if kv else None, self.rt.dtype)
        del m
        return rows

    def member(self, name: str, embed_from=None) -> SimpleNamespace:
        """A drafter as the trainer holds it between steps (built under the meter): the model,
        AdamW with its state (from the second step on: a steady step), DDP's buckets.
        embed_from: a drafter whose frozen embedding it shares, as a group's members do
        (`train.loop.setup_member`)."""
        tc, dcfg = self.cfg.drafters.train, self.cfg.drafters
        ddp = self.world > 1
        with self.meter:
            v, model = self.drafter(name)
            if embed_from is not None:
                model.embed_tokens.weight = embed_from.embed_tokens.weight
            model.train()
            steps, decay = objective(model, dcfg, v)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95),
                                    foreach=True)   # CUDA's default: foreach
            for p in params:   # AdamW's state exists from the second step on: measure a steady step
                p.grad = torch.zeros_like(p)
            opt.step()
            # DDP: the buckets stay allocated from step to step (zero_grad only drops the views)
            opt.zero_grad(set_to_none=not ddp)
            buckets = [torch.zeros_like(p) for p in params] if ddp and not ddp_buckets_alias_grads() else []
        return SimpleNamespace(name=name, model=model, steps=steps, decay=decay, params=params,
                               groups=param_groups(model), opt=opt, buckets=buckets, fwd=training_forward(model))

    def member_step(self, m: SimpleNamespace, batch: dict, head_w: torch.Tensor) -> None:
        """One drafter's logging step on a batch in hand, as `train.train_step` runs it."""
        tc = self.cfg.drafters.train
        labels = target_labels(batch["last_hidden"], head_w, m.model.d2t, positions=label_positions(batch))
        local = [float(scored_tokens(batch, labels, m.model.t2d, k)[1].sum()) for k in range(m.steps)]
        denominators = [max(x, 1.0) for x in local]
        with self.rt.autocast():
            un = m.fwd(batch, m.steps)
            losses, _, _, _ = step_losses(m.model, un, batch, labels, denominators)
            loss = weighted_loss(losses, m.decay)
        loss.backward()
        del un, losses, loss, labels   # the trainer drops the logits, labels and graph here
        grad_norms(m.groups)   # a logging step: the trainer's own function
        torch.nn.utils.clip_grad_norm_(m.params, tc.grad_clip)
        m.opt.step()
        m.opt.zero_grad(set_to_none=self.world == 1)

    # ------------------------------------------------------------ evaluation
    def stepwise_row(self, name: str) -> Row:
        """eval_stepwise, natural protocol: one pass over a batch of conversations of the longest
        prefix, every position but the last an anchor (the most a pass scores)."""
        rows: list[Row] = []
        ncfg = self.cfg.eval.natural
        steps = self.cfg.drafters.ttt_steps
        prefix, batch = ncfg.max_prefix_len, ncfg.batch_size
        convs = [{"conversation": i, "ids": [1] * prefix, "anchors": list(range(prefix - 1)),
                  "branches": [[1] * (steps + 1)] * (prefix - 1)} for i in range(batch)]
        with self.meter:
            _, model = self.drafter(name)
            model.eval()
        with self._measure(rows, "eval_stepwise natural", name, "anchor", batch * (prefix - 1)):
            list(natural_results([model], self.target, convs, self.spec.aux_layers, steps, steps + 1, None, batch,
                                 "cpu", self.rt.dtype))
        return rows[0]

    def e2e_rows(self, name: str, new_tokens: int, modes: tuple[str, ...] = ("chain", "tree")) -> list[Row]:
        """eval_e2e: batch-1 speculative decoding from a prefix of the natural protocol's longest
        length, chain and tree (`e2e.specs`). Drafted tokens are fake argmaxes (token 0, the
        target's too): every draft is accepted (tau = depth + 1, the fewest rounds per token).
        FLOPs per token leave out the prefill (a 1-token call's FLOPs)."""
        rows: list[Row] = []
        with self.meter:
            _, model = self.drafter(name)
            model.eval()
        ids = torch.ones(1, self.cfg.eval.natural.max_prefix_len, dtype=torch.long)
        aux = self.spec.aux_layers if model.reads_aux_hidden else None
        for mode, spec in specs(self.cfg).items():
            if mode not in modes or (mode != "chain" and getattr(model, "block_wise", False)):
                continue   # a block drafter drafts chains only (as eval_e2e runs it)
            prefill: list[Row] = []
            with self._measure(prefill, "prefill", name, "call", 1):
                speculative_generate(self.target, model, ids, 1, None, aux, spec)
            with self._measure(rows, f"eval_e2e {mode}", name, "token", new_tokens - 1):
                speculative_generate(self.target, model, ids, new_tokens, None, aux, spec)
            rows[-1].tflop -= prefill[0].tflop
        return rows

    # ------------------------------------------------------------ the target's own rules
    def target_rows(self, new_tokens: int) -> list[Row]:
        rows: list[Row] = []
        tp = self.cfg.target.pretrain
        blocks = torch.ones(tp.batch_size, tp.block_size, dtype=torch.long)
        with self._measure(rows, "target heldout loss", self.cfg.target.name or "target", "token", blocks.numel()):
            heldout_loss(self.target, blocks, tp.batch_size, "cpu")
        ecfg, ncfg = self.cfg.eval, self.cfg.eval.natural
        stub = SimpleNamespace(eos_token_id=None, pad_token_id=0)   # no EOS: every generation runs its length
        prompt = [1] * ecfg.max_prompt_len
        with self._measure(rows, "target_continuations prefill", "batch 1", "prompt", 1):
            greedy_continuations(self.target, stub, [prompt], 1, "cpu")
        with self._measure(rows, "target_continuations decode", "batch 1", "token", new_tokens - 1):
            greedy_continuations(self.target, stub, [prompt], new_tokens, "cpu")
        rows[-1].tflop -= rows[-2].tflop   # the tokens after the first: the prefill left out
        # one conversation of the longest prefix, every position an anchor: its real pass and K rounds
        prefix, tokens = ncfg.max_prefix_len, ncfg.rollout_tokens   # >= K + 1 (checks.py)
        with self._measure(rows, "target_continuations natural", "1 conversation", "anchor", prefix - 1):
            branch_rollouts(self.target, [1] * prefix, list(range(prefix - 1)), tokens, "cpu")
        fcfg = self.cfg.features
        n = max(1, fcfg.batch_tokens // self.length)
        batch = pad_batch([{"input_ids": torch.ones(self.length, dtype=torch.int32),
                            "loss_mask": torch.ones(self.length, dtype=torch.uint8)}] * n)
        with self._measure(rows, "capture_features offline", f"batch {n}", "token", n * self.length):
            out = batch_rows(self.target, batch, self.spec, "cpu")
            del out
        return rows

