"""Draw bench/results/int4_matmul.png from int4_matmul.json (written on the GPU by bench_int4_matmul.py).

    python bench/kernels/plot_int4_matmul.py [bench/results/int4_matmul.json]
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


if __name__ == "__main__":
    default = os.path.join(os.path.dirname(__file__), "..", "results", "int4_matmul.json")
    main(sys.argv[1] if len(sys.argv) > 1 else default)
