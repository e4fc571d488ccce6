"""Two host-side hot spots, timed alone and compared across commits in one run.

* The n-gram drafter's lookups: 16 sequences with fresh prompts of ``--prompt`` tokens (word-like ids with
  heavy reuse), one lookup each per step (depth 4, 2 branches) for 128 steps, each sequence growing by a
  token a step. Reports the first step (what a fresh prompt costs) and the mean of the rest.
* ``Metrics.observe_step``: one request's step figures (a plain step), per call.

Each ref runs from its own git worktree in its own process (bench/worktrees.py), refs alternating within
every repetition; each figure is the best repetition.

    python bench/host_micro.py --refs 63518fe,HEAD --out bench/results/host_micro_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

from worktrees import short, worktrees  # bench/, this script's own directory

STEPS, SEQS = 128, 16


def measure(prompts: list[int]) -> dict[str, float]:
    """This process's figures (the ref's code is first on sys.path)."""
    from draft.ngram import NgramDrafter
    from gateway.metrics import Metrics
    from gateway.sequence import SpecStats
    from gateway.stats import Arm

    out: dict[str, float] = {}
    for plen in prompts:
        rng = random.Random(1)
        seqs = [[int(rng.paretovariate(1.1)) % 49152 for _ in range(plen)] for _ in range(SEQS)]
        drafter = NgramDrafter()
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            for i, ids in enumerate(seqs):
                drafter.continuations(ids, 4, 2, seq_id=str(i))
            times.append(time.perf_counter() - t)
            for ids in seqs:
                ids.append(rng.randrange(49152) if rng.random() < 0.7 else ids[-5])
        out[f"ngram_first_step_ms_prompt{plen}"] = 1e3 * times[0]
        out[f"ngram_later_step_ms_prompt{plen}"] = 1e3 * sum(times[1:]) / (STEPS - 1)
    metrics, arm, delta = Metrics(), Arm("on", "ngram", "adaptive"), SpecStats(1, 0, 0, [], 1, [])
    n = 20000
    t = time.perf_counter()
    for _ in range(n):
        metrics.observe_step(arm, delta)
    out["observe_step_us"] = 1e6 * (time.perf_counter() - t) / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", default="HEAD", help="commits to compare, comma-separated")
    ap.add_argument("--prompts", default="300,2000", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process, one ref
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompts.split(",")]
    if args.measure:
        print(json.dumps(measure(prompts)))
        return
    refs = args.refs.split(",")
    best: dict[str, dict[str, float]] = {ref: {} for ref in refs}
    with worktrees(refs) as trees:
        for rep in range(args.reps):
            for ref in refs:
                env = {**os.environ, "PYTHONPATH": str(trees[ref])}
                run = subprocess.run([sys.executable, __file__, "--measure", "--prompts", args.prompts],
                                     cwd=trees[ref], env=env, capture_output=True, text=True, check=True)
                got = json.loads(run.stdout.strip().splitlines()[-1])
                for k, v in got.items():
                    best[ref][k] = min(best[ref].get(k, v), v)
                print(f"rep {rep} {ref}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    rows = [{"measure": k, **{short(ref): round(best[ref][k], 3) for ref in refs}} for k in best[refs[0]]]
    for row in rows:
        print(row)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": f"cpu ({platform.machine()}, {os.cpu_count()} cpus)", "date": datetime.date.today().isoformat(),
            "commit": short("HEAD"), "refs": {ref: short(ref) for ref in refs}, "reps": args.reps,
            "command": "python bench/host_micro.py " + " ".join(sys.argv[1:]),
            "notes": __doc__.split("\n\n", 1)[1].strip(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
