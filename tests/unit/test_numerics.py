"""Portable CPU numerics (kvshot.core.numerics): the pretraining stage gives the same bytes on
this machine as on an AVX2-only one, its variables are refused when set otherwise, and jobs get
them from Snakemake's shell prefix (the smoke DAG checks every job's log: tests/pipeline)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvshot.core import numerics

from ..conftest import REPO
from ..dag import snakemake, workdir

# what an AVX2-only machine's libraries pick by themselves (no AVX-512 kernels to choose)
AVX2_MACHINE = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def scrubbed(extra: dict | None = None) -> dict:
    """This environment without the portable variables (conftest sets them for the session)."""
    env = {k: v for k, v in os.environ.items() if k not in numerics.PORTABLE_ENV}
    return {**env, "PYTHONPATH": str(REPO / "src"), **(extra or {})}


def native_capability() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=scrubbed(), capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_modes_and_their_variables():
    assert numerics.environment("native") == {} and numerics.shell_exports("native") == ""
    exports = numerics.shell_exports("portable")
    assert exports.startswith("export ") and exports.endswith("; ")
    assert all(f"{k}={v}" in exports for k, v in numerics.PORTABLE_ENV.items())
    assert numerics.PORTABLE_ENV["ATEN_CPU_CAPABILITY"] == "avx2" and "STRICT" in numerics.PORTABLE_ENV["MKL_CBWR"]
    with pytest.raises(numerics.NumericsError, match="numerics: 'fast'"):
        numerics.environment("fast")


def test_a_conflicting_variable_is_refused_in_one_line(tiny):
    """A job whose environment asks for other kernels stops before it computes anything."""
    cmd = [sys.executable, "-m", "kvshot", "train-tokenizer", "--config", str(REPO / "config/config.yaml"),
           "--train", str(tiny["train"]), "--out", str(tiny["root"] / "refused-tokenizer")]
    done = subprocess.run(cmd, env=scrubbed({"ATEN_CPU_CAPABILITY": "avx512"}), capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [(
        "kvshot train-tokenizer: error: numerics portable: ATEN_CPU_CAPABILITY=avx512 in the environment, where "
        "portable numerics need ATEN_CPU_CAPABILITY=avx2: unset it, or run with --config numerics=native")]
    assert not (tiny["root"] / "refused-tokenizer").exists()


def pretrain(tiny, out, numerics_mode: str, env: dict, threads: int = 2) -> tuple[bytes, str]:
    """A few pretraining steps of the smoke target by the real stage, in a fresh process."""
    cfg = json.loads(json.dumps(tiny["cfg"]))
    cfg["numerics"] = numerics_mode
    cfg["target"]["pretrain"].update(max_steps=4, generations=0)
    (out / "cfg.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "cfg.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "kvshot", "target", "--config", str(out / "cfg.json"), "--threads", str(threads),
           "--train", str(tiny["train"]), "--eval", str(tiny["eval"]), "--tokenizer", str(tiny["tokenizer"]),
           "--out", str(out / "model"), "--metrics", str(out / "metrics.json")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return (out / "model/model.safetensors").read_bytes(), done.stdout


def test_portable_pretraining_gives_an_avx2_machines_bytes(tiny, tmp_path):
    """Portable here = native on a machine whose best kernels are AVX2 (the reference VM's kind),
    bit for bit; on a machine with more than AVX2, its own native path differs (the control:
    the comparison can see a rounding difference)."""
    portable, log = pretrain(tiny, tmp_path / "portable", "portable", scrubbed())
    assert "numerics: portable (" in log and "set by kvshot: ATEN_CPU_CAPABILITY" in log
    assert "torch: AVX2 kernels, 2 intra-op thread(s)" in log
    avx2_native, log = pretrain(tiny, tmp_path / "avx2", "native", scrubbed(AVX2_MACHINE))
    assert "numerics: native" in log and "torch: AVX2 kernels" in log
    assert avx2_native == portable
    if native_capability() == "AVX2":
        pytest.skip("this CPU's own kernels are AVX2: no other native path to compare")
    native, log = pretrain(tiny, tmp_path / "native", "native", scrubbed())
    assert "torch: AVX2 kernels" not in log
    assert native != portable, "the machine's own kernels gave the portable bytes: the control found no difference"


def target_command(wd, *extra: str) -> str:
    proc = snakemake(wd, "-n", "-p", "--cores", "1", "results/target/metrics.json", *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [x for x in proc.stdout.splitlines() if "python -m kvshot target " in x]
    return line


def test_the_target_job_runs_the_configs_threads_under_portable_numerics(tmp_path):
    """Snakemake caps a job's threads at --cores; under portable numerics the target's torch
    threads are the config's all the same (a reduction's digits depend on the count: fewer cores
    run slower, not differently), under native the cores granted."""
    wd = workdir(tmp_path)
    assert "--threads 2 " in target_command(wd)   # config/config.yaml: threads 2, on --cores 1
    assert "--threads 1 " in target_command(wd, "--config", "numerics=native")


def test_a_stage_whose_torch_chose_other_kernels_stops_unless_a_script_asked_for_native():
    """torch imported before the variables (a script that skipped `apply_for_script`): the portable
    config's runtime refuses in one line; KVSHOT_NUMERICS=native (a benchmark's own choice) runs."""
    if native_capability() == "AVX2":
        pytest.skip("this CPU's own kernels are AVX2: torch cannot choose others here")
    code = (f"import os, torch\nfrom kvshot.config import runtime, typed_config\n"
            f"from kvshot.core.numerics import NumericsError\n"
            f"cfg = typed_config([{str(REPO / 'config/config.yaml')!r}], ('target',))\n"
            f"try:\n    runtime(cfg)\nexcept NumericsError as exc:\n    print('refused:', exc)\n"
            f"os.environ['KVSHOT_NUMERICS'] = 'native'\nprint('native:', runtime(cfg).threads)\n")
    done = subprocess.run([sys.executable, "-c", code], env=scrubbed(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith(("refused:", "native:"))]
    assert lines[0].startswith("refused: numerics portable: torch runs ") and "where AVX2 is needed" in lines[0]
    assert lines[1] == "native: 2"
