"""Peak memory of `prepare_data` on a synthetic ShareGPT file, against the SLURM profile's
6 GB for the rule (workflow/rules/data.smk: mem_mb=6000).

  python benchmarks/prepare_data_memory.py --conversations 300000 --train 280000 --eval 1000
  python benchmarks/prepare_data_memory.py --conversations 60000 --train 56000 --eval 1000 --old

Each measured run is its own process, which reports its peak RSS (getrusage ru_maxrss).
`--old` also runs the in-memory method prepare_data used before streaming (load every
conversation, split the list with `split_conversations`, write), which it still serves as
the reference for. The synthetic file has ShareGPT's record layout and roughly its lengths:
1-6 exchanges, user turns of ~60-1500 and answers of ~200-6000 characters (log-uniform).

Measured 2026-11-30 on the 2-core CPU machine (file 2.34 GB at 300k, 0.47 GB at 60k):
  300k conversations, train 280k / eval 1k: streaming   54 MB (175 s), in-memory 4925 MB (211 s)
   60k conversations, train 56k / eval 1k:  streaming   53 MB  (19 s), in-memory 1005 MB  (11 s)
Streaming memory does not grow with the data (ranks: 8 bytes per record; one bucket of at
most 4096 lines); the in-memory method's grows with it and real ShareGPT records cost more
(1.64 GB was measured at 60k).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
BUDGET_MB = 6000
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so can more what about out up into "
         "function return value model data token python error because example should could system memory").split()


def synthetic_file(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    # a pool of word salad to cut texts from: varied text without generating each word
    pool = " ".join(rng.choice(WORDS) for _ in range(400_000))

    def text(lo: int, hi: int) -> str:
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        start = rng.randrange(len(pool) - length)
        return pool[start:start + length]

    with open(path, "w", encoding="utf-8") as fh:
        fh.write("[\n")
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 6)):
                turns += [{"from": "human", "value": text(60, 1500)}, {"from": "gpt", "value": text(200, 6000)}]
            fh.write(("" if i == 0 else ",\n") + json.dumps({"id": f"syn{i}", "conversations": turns}))
        fh.write("\n]\n")


CHILD = """
import json, resource, sys, time
from pathlib import Path
from kvshot.core.ranked_writer import atomic_write
from kvshot.data.sources import load_sources
from kvshot.data.split import prepare_data, split_conversations
from kvshot.settings import DataSource, build
method, src, out, n_train, n_eval = sys.argv[1:6]
sources = [build(DataSource, {"kind": "sharegpt_file", "path": src})]
start = time.time()
if method == "streaming":
    prepare_data(sources, int(n_train), int(n_eval), 0, out)
else:   # what prepare_data did before: every conversation in memory, then split and write
    convs = load_sources(sources, [])
    items = [{"id": f"0:{k}", "messages": m} for k, m in enumerate(convs)]
    parts = split_conversations(items, int(n_train), int(n_eval), 0)
    Path(out).mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        atomic_write(Path(out) / f"{name}.jsonl", [json.dumps(it, ensure_ascii=False) + "\\n" for it in part])
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.time() - start}))
"""


def measure(method: str, src: Path, out: Path, n_train: int, n_eval: int) -> dict:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", CHILD, method, str(src), str(out), str(n_train), str(n_eval)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=300_000)
    p.add_argument("--train", type=int, default=280_000)
    p.add_argument("--eval", type=int, default=1000)
    p.add_argument("--workdir", default="/tmp/kvshot_prepare_memory")
    p.add_argument("--old", action="store_true", help="also measure the in-memory method")
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"sharegpt_{args.conversations}.json"
    if not src.exists():
        t = time.time()
        synthetic_file(src, args.conversations)
        print(f"wrote {src} ({src.stat().st_size / 1e9:.2f} GB) in {time.time() - t:.0f} s")
    print(f"{args.conversations} conversations ({src.stat().st_size / 1e9:.2f} GB JSON), "
          f"train {args.train}, eval {args.eval}; rule budget {BUDGET_MB} MB")
    for method in ("streaming",) + (("in-memory (before)",) if args.old else ()):
        m = measure(method.split()[0], src, work / method.split()[0], args.train, args.eval)
        print(f"  {method:20s} peak RSS {m['peak_rss_mb']:8.0f} MB  ({100 * m['peak_rss_mb'] / BUDGET_MB:5.1f}% "
              f"of {BUDGET_MB} MB)  {m['seconds']:6.0f} s")


if __name__ == "__main__":
    main()
