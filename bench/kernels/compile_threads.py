"""How long the INT4 kernels take to build one by one and on a thread pool (what ``_precompile`` relies on:
Triton's passes release the GIL, ptxas runs as a process of its own). Builds ``bench/kernels/sass.py``'s INT4
cases for sm_90 (no GPU needed), each arm into an empty Triton cache, arms alternated.

    python bench/kernels/compile_threads.py --threads 2 --rounds 2 --out bench/results/compile_threads_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
import triton  # noqa: E402

import sass  # noqa: E402
from bench import provenance  # noqa: E402


def build_all(cases: list, threads: int) -> float:
    """Seconds to build ``cases`` into a fresh Triton cache on ``threads`` threads (1: one by one)."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")
    build = lambda c: sass.compile_sm90(c[1], c[2], c[3], c[4], c[5], c[6])  # noqa: E731
    t = time.perf_counter()
    if threads == 1:
        for c in cases:
            build(c)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(build, cases))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cases", type=int, default=6, help="the first N of sass.py's INT4 cases")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    cases = sass.int4_cases()[: args.cases]
    build_all(cases[:1], 1)  # untimed: the first build in a process loads the compiler's libraries
    runs = {1: [], args.threads: []}
    for _ in range(args.rounds):
        for threads in runs:
            runs[threads].append(round(build_all(cases, threads), 2))
            print(f"{threads} thread(s): {runs[threads][-1]:.2f} s", flush=True)
    doc = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
           "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "triton": triton.__version__,
           "target": "sm_90", "cases": [c[0] for c in cases], "seconds": {str(k): v for k, v in runs.items()},
           "speedup_of_best": round(min(runs[1]) / min(runs[args.threads]), 2)}
    doc["note"] = ("Each arm builds every case into an empty Triton cache; arms alternated; one untimed build first. "
                   "speedup_of_best: the best one-by-one time over the best pooled time.")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out, doc["speedup_of_best"])
    plot(doc, args.out)


def plot(doc: dict, json_path: str) -> None:
    """Each arm's builds, round by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plotting import save_beside

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for threads, secs in doc["seconds"].items():
        ax.plot(range(1, len(secs) + 1), secs, "o-", label=f"{threads} thread(s)")
    ax.set_xlabel("round")
    ax.set_ylabel(f"s to build {len(doc['cases'])} INT4 kernels (sm_90)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{doc['device']}, {doc['commit']}, {doc['date']}", fontsize=8)
    print("wrote", save_beside(fig, ax, json_path))


if __name__ == "__main__":
    main()
