"""Draw bench/results/int4_matmul.png from int4_matmul.json (written on the GPU by bench_int4_matmul.py).

    python bench/kernels/plot_int4_matmul.py [bench/results/int4_matmul.json]

An A/B of two environments (runs of bench_int4_matmul.py alternated in one call, e.g. gpu_run.sh's
int4_atomic stage) merges into one JSON and PNG: each arm's best time per M over its runs, and B over A.

    python bench/kernels/plot_int4_matmul.py --ab OUT.json "ARM_A=run1.json,run3.json" "ARM_B=run2.json,run4.json"
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path: str) -> None:
    with open(path) as f:
        res = json.load(f)
    rows = res["rows"]
    ms = [r["M"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [("us_per_layer", "ours (Triton W4A16)", "C0"),
              ("int4pack_us_per_layer", "torch _weight_int4pack_mm", "C1"),
              ("cublas_us_per_layer", "bf16 cuBLAS F.linear", "C2"),
              ("dequant_cublas_us_per_layer", "dequant + cuBLAS", "C3")]
    for key, label, color in series:
        ys = [r.get(key) for r in rows]
        pts = [(m, y) for m, y in zip(ms, ys) if y is not None and y == y]
        if pts:
            ax.plot(*zip(*pts), "o-", label=label, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("us per layer (qkv + o + gate_up + down)")
    ax.set_title(f"Llama-3-8B layer, G=128, {res['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax2.plot(ms, [r["pct_copy"] for r in rows], "o-", color="C0")
    ax2.axhline(100, color="gray", ls="--", lw=1)
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(0, 110)
    ax2.set_xlabel("M (tokens)")
    ax2.set_ylabel(f"% of copy bandwidth ({res['copy_tbps']:.2f} TB/s)")
    ax2.set_title("ours: bytes moved / time")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(f"commit {res['commit']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=120)
    print("wrote", out)


def merge_ab(out: str, arms: list[str]) -> None:
    """``arms``: "NAME=run.json,run.json" each; the first arm is the reference of the ratios."""
    runs: dict[str, list[dict]] = {}
    for arm in arms:
        name, paths = arm.rsplit("=", 1)  # names may hold "=" (NAME=VALUE), paths do not
        runs[name] = []
        for p in paths.split(","):
            with open(p) as f:
                runs[name].append(json.load(f))
    first = next(iter(runs.values()))[0]
    keep = ("device", "date", "commit", "torch", "sms", "pdl", "copy_tbps")
    res = {k: first.get(k) for k in keep}
    res["arms"] = {}
    for name, rs in runs.items():
        ms = sorted({r["M"] for run in rs for r in run["rows"]})
        times = {m: [r["us_per_layer"] for run in rs for r in run["rows"] if r["M"] == m] for m in ms}
        res["arms"][name] = {"graph_max_rel_err": max(run.get("graph_max_rel_err") or 0.0 for run in rs),
                             "copy_tbps": [run.get("copy_tbps") for run in rs],
                             "us_per_layer_runs": {str(m): [round(t, 2) for t in times[m]] for m in ms},
                             "us_per_layer": {str(m): round(min(times[m]), 2) for m in ms}}
    names = list(runs)
    ref = res["arms"][names[0]]["us_per_layer"]
    res["ratio_to_" + names[0]] = {n: {m: round(res["arms"][n]["us_per_layer"][m] / ref[m], 4)
                                       for m in res["arms"][n]["us_per_layer"] if m in ref} for n in names[1:]}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, n in enumerate(names):
        us = res["arms"][n]["us_per_layer"]
        ax.plot([int(m) for m in us], list(us.values()), "o-", label=n, color=f"C{i}")
        if i:
            r = res["ratio_to_" + names[0]][n]
            ax2.plot([int(m) for m in r], list(r.values()), "o-", label=f"{n} / {names[0]}", color=f"C{i}")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("M (tokens)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax.set_ylabel("us per layer (best of the arm's runs)")
    ax.set_title(f"Llama-3-8B layer, G=128, {res['device']}")
    ax2.axhline(1.0, color="gray", ls="--", lw=1)
    ax2.set_ylabel("time ratio")
    fig.suptitle(f"commit {res['commit']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.splitext(out)[0] + ".png", dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--ab":
        merge_ab(sys.argv[2], sys.argv[3:])
        sys.exit()
    default = os.path.join(os.path.dirname(__file__), "..", "results", "int4_matmul.json")
    main(sys.argv[1] if len(sys.argv) > 1 else default)
