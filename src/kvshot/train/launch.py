"""How a drafter-training job starts: one process, or DDP over N processes through
`accelerate launch`, each DDP job on a rendezvous port it picks when it starts.

The Snakemake rules build their command line here (`launcher_command`); the port is a shell
command substitution, `$(python -m kvshot.train.launch free-port)`, so it is chosen when the job
runs on its node, not when Snakemake builds the DAG: two DDP jobs on one node then do not
both take accelerate's default port 29500. Imports nothing heavy: the port lookup runs
before every DDP job.
"""
from __future__ import annotations

import argparse
import socket
import sys

# accelerate's own mixed precision stays off: the trainer does its bf16 autocast itself
# (fp32 master weights and optimizer state), and on CPU it runs fp32.
MIXED_PRECISION = "no"
FREE_PORT_SHELL = "$(python -m kvshot.train.launch free-port)"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now: bind port 0, let the kernel choose, release it.
    accelerate binds it a moment later; should another process take it in between, the
    job fails at rendezvous and Snakemake's retry picks a new one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def accelerate_args(num_processes: int, main_process_port: int | str | None = None) -> list[str]:
    """`accelerate launch` flags for single-node DDP over `num_processes` processes
    (torchrun-style; on CPU each process's Accelerator joins a gloo group)."""
    if num_processes < 2:
        raise ValueError(f"accelerate_args: DDP needs at least 2 processes, got {num_processes}")
    args = ["--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
            "--mixed_precision", MIXED_PRECISION, "--dynamo_backend", "no"]
    if main_process_port is not None:
        args += ["--main_process_port", str(main_process_port)]
    return args


def launcher_command(num_processes: int) -> str:
    """The shell words that come before a kvshot stage name: `python -m kvshot` for one
    process, else `accelerate launch ... --main_process_port $(...) -m kvshot`."""
    if num_processes < 1:
        raise ValueError(f"drafters.train.num_processes: must be >= 1, got {num_processes}")
    if num_processes == 1:
        return "python -m kvshot"
    return " ".join(["accelerate launch", *accelerate_args(num_processes, FREE_PORT_SHELL), "-m kvshot"])


def rank_threads(device: str, threads: int) -> int:
    """torch threads per training process. On CUDA a rank's CPU threads feed its GPU (batch
    assembly, host-side feature work): the config's `threads`, which the SLURM profile books
    as cpus_per_gpu. On CPU the processes are the parallelism: one thread each."""
    return max(1, int(threads)) if device == "cuda" else 1


def scaled_steps(max_steps: int, n: int, n_max: int) -> int:
    """Steps for a scaling point of n samples that give it the epochs the largest point gets
    at `max_steps`: epochs = steps * batch / n is then the same for every n (rounded up,
    at least 1 step)."""
    if n < 1 or n_max < 1:
        raise ValueError(f"scaling.train_samples: sizes must be >= 1, got n={n}, largest={n_max}")
    return max(1, -(-max_steps * n // n_max))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvshot.train.launch", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    port = sub.add_parser("free-port", help="print a free TCP port (a DDP job's rendezvous port)")
    port.add_argument("--host", default="127.0.0.1")
    cmd = sub.add_parser("command", help="print the launcher words for N training processes")
    cmd.add_argument("--num-processes", type=int, required=True)
    args = p.parse_args(argv)
    if args.command == "free-port":
        print(free_port(args.host))
    else:
        print(launcher_command(args.num_processes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
