"""vLLM offline, as a user runs it: `LLM(...)` on the target's folder, plain or with an EAGLE-3 or
DFlash drafter exported by `kvshot export`, greedy, token ids in and out (no tokenizer: the prompts are
kvshot's own token ids), and vLLM's own acceptance counts for every request.

vLLM counts acceptance in its scheduler, once a verify step, into two places: the aggregate
Prometheus counters (`LLM.get_metrics()`: vllm:spec_decode_num_drafts, _num_draft_tokens,
_num_accepted_tokens, _num_accepted_tokens_per_pos) and, with `per_request_spec_decode_metrics=
"detailed"`, each request's ordered accepted/drafted counts per verify step (its output's
`spec_decode_metrics`). The Prometheus registry is one per process: the serve stage's engines
share it, and the engine started last owns the counters (what an earlier engine counted is no
longer readable). So the stage reads every engine's per-request counts, and checks them against
the Prometheus counters' differences on the engine that owns them (`prometheus_counts`).
  drafts        verify steps with a draft (kvshot: rounds);
  draft_tokens  tokens drafted (K a step);
  accepted      draft tokens accepted (the bonus token excluded; kvshot: sum of `accepted`);
  per_pos[i]    steps whose draft was accepted through position i (kvshot: rounds with accepted > i).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "per_pos"}


@dataclass
class Counts:
    """vLLM's speculative-decoding counters (or kvshot's, counted the same way)."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def __sub__(self, other: "Counts") -> "Counts":
        pos = [a - b for a, b in zip(self.per_pos, other.per_pos + [0] * len(self.per_pos))]
        return Counts(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                      self.accepted - other.accepted, pos)

    def __add__(self, other: "Counts") -> "Counts":
        n = max(len(self.per_pos), len(other.per_pos))
        pad = lambda v: v + [0] * (n - len(v))   # noqa: E731
        return Counts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                      self.accepted + other.accepted, [a + b for a, b in zip(pad(self.per_pos), pad(other.per_pos))])

    def as_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "per_pos": list(self.per_pos),
                "alpha_by_pos": [a / self.drafts if self.drafts else None for a in self.per_pos],
                "tau": (self.accepted + self.drafts) / self.drafts if self.drafts else None}


def step_counts(accepted: list[int], drafted: list[int], k: int) -> Counts:
    """Counts from per-step accepted and drafted tokens (vLLM's per-request arrays, or kvshot's rounds)."""
    return Counts(drafts=len(accepted), draft_tokens=sum(drafted), accepted=sum(accepted),
                  per_pos=[sum(a > i for a in accepted) for i in range(k)])


def kvshot_counts(accepted_per_round: list[int], k: int) -> Counts:
    """kvshot's rounds counted as vLLM counts them (a chain of K drafted every round)."""
    return step_counts(accepted_per_round, [k] * len(accepted_per_round), k)


def engine_environment(threads: int) -> None:
    """vLLM's CPU settings, before an engine starts: its OpenMP threads bound to the first `threads`
    cores (vLLM's default keeps one core back for the frontend: a different thread count than the
    HF rows), no legacy KV-cache size (the engines take `kv_cache_memory_bytes`), and no
    torch.compile cache across runs (vLLM
    0.32's CPU build reloading an AOT-compiled drafter engine from its cache recompiled it and
    crashed with a stack overflow here; compiling afresh costs ~40 s an engine)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)   # whole GiB only; it would override kv_cache_memory_bytes
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def draft_method(draft_dir: str) -> str:
    """vLLM's speculative method for an exported drafter folder: dflash (kvshot export --format
    dflash: architectures DFlashDraftModel) or eagle3."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return "dflash" if "DFlashDraftModel" in (config.get("architectures") or []) else "eagle3"


def max_draft_tokens(draft_dir: str) -> int | None:
    """The most tokens a drafter folder drafts per round: a DFlash block's mask slots (block_size - 1);
    None: any (an EAGLE-3 head drafts a chain)."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return int(config["block_size"]) - 1 if draft_method(draft_dir) == "dflash" and config.get("block_size") else None


class Engine:
    """One vLLM engine: the target alone (`draft_dir` None) or with an exported drafter (EAGLE-3 or
    DFlash, `draft_method`) at K."""

    def __init__(self, target_dir: str, draft_dir: str | None = None, k: int = 0, max_model_len: int = 2048,
                 compile: bool = True, seed: int = 0, dtype: str = "float32", gpu_memory_utilization: float | None = None,
                 kv_cache_gib: float | None = None):
        """gpu_memory_utilization: on CUDA, this engine's share of the GPU (weights, activations and
        KV cache); the stage's engines and the HF target share one GPU. None on CPU. kv_cache_gib:
        on CPU, the KV cache it allocates when it starts (every engine of the stage is alive at once)."""
        from vllm import LLM

        spec = (None if draft_dir is None else
                {"method": draft_method(draft_dir), "model": str(draft_dir), "num_speculative_tokens": k})
        self.k, self.draft_dir = k, draft_dir
        extra = {} if spec is None else {"per_request_spec_decode_metrics": "detailed"}
        if gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = gpu_memory_utilization
        elif kv_cache_gib is not None:
            extra["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        start = time.perf_counter()
        self.llm = LLM(model=str(target_dir), dtype=dtype, skip_tokenizer_init=True, seed=seed,
                       max_model_len=max_model_len, disable_log_stats=False, enforce_eager=not compile,
                       speculative_config=spec, **extra)
        self.load_s = time.perf_counter() - start

    def prometheus_counts(self) -> Counts:
        """The process's Prometheus counters (the last-started engine's: see the module docstring)."""
        got = {COUNTERS[m.name]: (list(m.values) if hasattr(m, "values") else int(m.value))
               for m in self.llm.get_metrics() if m.name in COUNTERS}
        return Counts(**{k: got.get(k, [] if k == "per_pos" else 0) for k in ("drafts", "draft_tokens", "accepted",
                                                                               "per_pos")})

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None
                 ) -> tuple[list[list[int]], list[tuple[list[int], list[int]]], float]:
        """Greedy continuations of `prompts` in one call (a batch when several), stopping after eos
        (kept, as kvshot's decoder keeps it) or max_new_tokens; each request's (accepted, drafted)
        tokens per verify step (empty without a drafter); the call's seconds."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False,
                                stop_token_ids=[] if eos_token_id is None else [eos_token_id])
        start = time.perf_counter()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        steps = []
        for o in outs:
            m = o.outputs[0].spec_decode_metrics
            steps.append(([], []) if m is None else (list(m.per_step_accepted), list(m.per_step_drafted)))
        return [list(o.outputs[0].token_ids) for o in outs], steps, seconds
