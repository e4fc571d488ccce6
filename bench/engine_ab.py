"""A/B of an environment switch on the 8B-shape verify step, arms alternated over several runs.

One run of ``bench/engine.py --synthetic --verify-only`` moves by several percent from the next on the
same machine (each run tunes the INT4 kernels afresh; bench/results/scale_dot_engine_ab.json: the M=1
step 2.66-2.86 ms over ten runs), more than most kernel changes move it. So an arm's figure is the mean
of several runs, the arms alternate (A B A B ...), and the table also counts the pairs each arm won.

    python bench/engine_ab.py --arm SPECGATE_INT4_SCALE_DOT=0 --arm SPECGATE_INT4_SCALE_DOT=1 --runs 3 --out OUT.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_arm(text: str) -> dict[str, str]:
    """``NAME=VALUE[,NAME=VALUE...]`` -> environment overrides (an empty string: no override)."""
    env = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"an arm is NAME=VALUE[,NAME=VALUE...], not {text!r}")
        env[name] = value
    return env


def summarise(runs: list[dict], arms: list[str]) -> dict:
    """Per arm, the mean step per tree size; per size, how many alternated pairs each arm won."""
    sizes = list(runs[0]["verify_ms"])
    mean = {a: {n: round(sum(r["verify_ms"][n] for r in runs if r["arm"] == a)
                          / sum(r["arm"] == a for r in runs), 3) for n in sizes} for a in arms}
    by_arm = {a: [r["verify_ms"] for r in runs if r["arm"] == a] for a in arms}
    pairs = list(zip(*by_arm.values()))
    wins = {n: {a: sum(min(range(len(arms)), key=lambda i: p[i][n]) == k for p in pairs) for k, a in enumerate(arms)}
            for n in sizes}
    return {"mean_verify_ms": mean, "pair_wins": wins, "pairs": len(pairs)}


def plot(paths: list[str], out: str) -> None:
    """One panel per A/B file: each arm's mean verify-step time against tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths), 4), squeeze=False)
    for ax, path in zip(axes[0], paths):
        r = json.loads(Path(path).read_text())
        for arm, ms in r["mean_verify_ms"].items():
            sizes = sorted(ms, key=int)
            ax.plot([int(n) for n in sizes], [ms[n] for n in sizes], marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes (M)")
        ax.set_ylabel("8B verify step, ms")
        ax.set_title(f"{Path(path).stem}: {r['device']}, {r['commit']}, {r['pairs']} run(s) an arm", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="only draw these results into --out (a PNG)")
    ap.add_argument("--arm", action="append", help="NAME=VALUE[,NAME=VALUE...]; two or more")
    ap.add_argument("--runs", type=int, default=3, help="runs per arm")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.out)
        return
    if not args.arm or len(args.arm) < 2:
        raise SystemExit("give two or more --arm")
    arms = {a: parse_arm(a) for a in args.arm}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, env in arms.items():
                out = Path(tmp) / f"run{i}_{len(runs)}.json"
                cmd = [sys.executable, str(HERE / "engine.py"), "--synthetic", "--verify-only", "--out", str(out)]
                proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                      timeout=args.timeout)
                if proc.returncode or not out.is_file():
                    raise SystemExit(f"{name}, run {i}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
                res = json.loads(out.read_text())
                runs.append({"arm": name, "run": i, "verify_ms": res["verify_ms"], "floor_ms": res["floor_ms"],
                             "int4_configs": res.get("int4_configs")})
                print(f"{name:40s} run {i}: {res['verify_ms']}", flush=True)
    result = {"date": datetime.date.today().isoformat(), "device": res.get("device"), "commit": res.get("commit"),
              "arms": list(arms), "runs": runs, **summarise(runs, list(arms))}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\nmean ms per tree size:")
    for a, m in result["mean_verify_ms"].items():
        print(f"  {a:40s} {m}")
    print("pairs won per size:", result["pair_wins"])


if __name__ == "__main__":
    main()
