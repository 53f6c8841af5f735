"""CPU numerics: the same bits for a seed on every x86-64 machine (`numerics: portable`, the
default), or each machine's own fastest kernels (`native`).

Two x86 machines running the same code on the same inputs round differently where a library
picks its kernels by the CPU it finds (docs/reproducibility.md measures each):
- ATen's vectorized kernels (softmax, exp, the CPU flash-attention kernel, norms, their
  backwards) are built once per instruction set and chosen at start-up: ATEN_CPU_CAPABILITY.
  An AVX-512 machine's softmax and attention differ in the last bits from an AVX2 one's.
- MKL's sgemm code path: MKL_CBWR (conditional numerical reproducibility). STRICT also makes
  it independent of the thread count. MKL keeps AVX2 kernels on AMD CPUs; on Intel AVX-512
  it would not.
- oneDNN's instruction set (convolutions, oneDNN matmuls): ONEDNN_MAX_CPU_ISA.
- the intra-op thread count: a parallel reduction sums each thread's share, then the shares.
  Portable jobs run the config's `threads` even where Snakemake grants fewer cores.
- PYTHONHASHSEED: set iteration order of strings (none known to reach a result; fixed anyway).

AVX2 is the portable level: every x86-64 machine this project runs on has it, and many AMD EPYC
VMs have nothing above it. A CPU without AVX2 cannot give these bits; `check` says so.
On CUDA these settings touch only the host-side work: a GPU run's digits depend on the GPU
model, driver and CUDA libraries (cuBLAS and flash-attn pick kernels per GPU), and its training
is not bitwise repeatable even there (atomic adds in attention backwards).

This module imports no torch: `apply` must run before torch is first imported.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

MODES = ("portable", "native")
PORTABLE_CAPABILITY = "AVX2"   # what torch.backends.cpu.get_cpu_capability() reports
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "PYTHONHASHSEED": "0",
}


class NumericsError(RuntimeError):
    """The process cannot run the requested numerics (one line)."""


def environment(mode: str) -> dict[str, str]:
    """The variables a job of this mode runs under (native: none, each library picks)."""
    if mode not in MODES:
        raise NumericsError(f"config: numerics: {mode!r} is not one of {list(MODES)}")
    return dict(PORTABLE_ENV) if mode == "portable" else {}


def shell_exports(mode: str) -> str:
    """`export A=1 B=2; ` for Snakemake's shell prefix: every job, and every process it starts
    (accelerate's ranks), inherits them. Empty for native."""
    env = environment(mode)
    return f"export {' '.join(f'{k}={v}' for k, v in env.items())}; " if env else ""


def apply(mode: str) -> list[str]:
    """Set this process's variables for `mode` before torch is imported; returns the names it had
    to set (a job Snakemake started already has them all). A variable set to another value, or
    torch imported first, is an error: the libraries read them once, at start-up."""
    wanted = environment(mode)
    wrong = {k: os.environ[k] for k, v in wanted.items() if k in os.environ and os.environ[k] != v}
    if wrong:
        name, value = next(iter(wrong.items()))
        raise NumericsError(f"numerics portable: {name}={value} in the environment, where portable numerics need "
                            f"{name}={wanted[name]}: unset it, or run with --config numerics=native")
    missing = [k for k in wanted if k not in os.environ]
    if missing and "torch" in sys.modules:
        raise NumericsError(f"numerics portable: torch was imported before {missing[0]} could be set: "
                            f"set {shell_exports(mode).strip()} in the calling shell")
    for k in missing:
        os.environ[k] = wanted[k]
    # PYTHONHASHSEED acts only at interpreter start: a process that had to set it runs on;
    # its children (and every Snakemake job, which gets it from the shell prefix) have it.
    return missing


def apply_for_script() -> str:
    """`apply` for a script outside the pipeline (benchmarks/): the mode KVSHOT_NUMERICS names,
    portable by default, as the pipeline's jobs run. Call it before importing torch."""
    mode = os.environ.get("KVSHOT_NUMERICS", "portable")
    apply(mode)
    return mode


def check(mode: str) -> None:
    """After torch is imported: the kernels it chose are the mode's. A script run with
    KVSHOT_NUMERICS=native (`apply_for_script`) asked for the machine's own, whatever its config says."""
    if mode != "portable" or os.environ.get("KVSHOT_NUMERICS") == "native":
        return
    import torch

    found = torch.backends.cpu.get_cpu_capability()
    if found != PORTABLE_CAPABILITY:
        raise NumericsError(f"numerics portable: torch runs {found} kernels where {PORTABLE_CAPABILITY} is needed "
                            f"(this CPU lacks AVX2, or ATEN_CPU_CAPABILITY was read before it was set): "
                            f"run with --config numerics=native, whose digits are this machine's own")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_id() -> str:
    """vendor, family, model and stepping: "AMD EPYC" alone names several generations."""
    info = cpuinfo()
    labels = {"vendor_id": "", "cpu family": "family ", "model": "model ", "stepping": "stepping "}
    return " ".join(f"{label}{info[k]}" for k, label in labels.items() if k in info) or platform.machine()


def cpu_flags() -> set[str]:
    info = cpuinfo()
    return set(info["flags"].split()) if "flags" in info else set()


def describe(mode: str) -> dict:
    """What a run's digits depend on: the mode, the machine, the libraries (imports torch). Each
    job's thread count is the workflow's (the target: the config's `threads`; the others: 1)."""
    import importlib.metadata as md

    import torch

    flags = cpu_flags()
    out = {"numerics": mode, "cpu": cpu_model(), "cpu_id": cpu_id(), "cores": os.cpu_count(),
           "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
           "kernels": torch.backends.cpu.get_cpu_capability(),
           "env": {k: os.environ.get(k) for k in PORTABLE_ENV}}
    out["versions"] = {name: _version(md, name) for name in ("torch", "transformers", "tokenizers", "safetensors")}
    out["versions"]["python"] = platform.python_version()
    return out


def _version(md, name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def status_line(mode: str, set_here: list[str]) -> str:
    """The log line every stage starts with: the mode and where its variables came from."""
    if mode == "native":
        return "numerics: native (this machine's own kernels and digits)"
    source = "from the job's environment" if not set_here else f"set by kvshot: {', '.join(set_here)}"
    return f"numerics: portable ({' '.join(f'{k}={v}' for k, v in PORTABLE_ENV.items())}; {source})"


def kernels_line(threads: int) -> str:
    """After torch is imported: the kernels and threads a stage computes with."""
    import torch

    cores = os.cpu_count() or 0
    note = f" on {cores} core(s): slower, the same digits" if cores < threads else ""
    return f"torch: {torch.backends.cpu.get_cpu_capability()} kernels, {threads} intra-op thread(s){note}"
