"""Plot bench/results/attention.json (written by bench_attention.py) to a PNG beside it.

    python bench/kernels/plot_attention.py [bench/results/attention.json]

Runs where matplotlib is installed; the GPU image has none, so the JSON comes back and is plotted here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(path: Path) -> Path:
    res = json.loads(path.read_text())
    fig, (ax_dec, ax_ver) = plt.subplots(1, 2, figsize=(13, 4.8))

    # Decode: achieved KV bandwidth against the copy ceiling, ours and the peers over the same bytes.
    rows = [r for r in res["decode"] if r["page"] == 16]
    labels = [f"B={r['B']}\nctx={r['ctx'] // 1024}k" for r in rows]
    tb = lambda r, us: r["tbps"] * r["us"] / us if us else 0.0  # noqa: E731 - same bytes, other time
    x = range(len(rows))
    for i, (name, key) in enumerate([("paged (ours, P=16)", "us"), ("SDPA, contiguous KV", "sdpa_us"),
                                     ("flex_attention", "flex_us")]):
        ax_dec.bar([j + (i - 1) * 0.27 for j in x], [tb(r, r[key]) for r in rows], 0.27, label=name)
    ax_dec.axhline(res["copy_tbps"], color="k", ls="--", lw=1, label=f"copy {res['copy_tbps']:.2f} TB/s")
    ax_dec.set_xticks(list(x), labels)
    ax_dec.set_ylabel("KV bytes / time (TB/s)")
    ax_dec.set_title("Decode, bf16, 32 q / 8 kv heads, D=128")
    ax_dec.legend(fontsize=8)

    # Tree verification: time against tree size, with the one-token decode over the same KV as floor.
    ver = res["verify"]
    nodes = [r["nodes"] for r in ver]
    for name, key, style in [("tree kernel (ours)", "us", "o-"), ("one-token decode (ours)", "decode_us", "k--"),
                             ("SDPA, no mask", "sdpa_nomask_us", "s-"), ("SDPA, bool mask", "sdpa_mask_us", "^-"),
                             ("flex, block mask", "flex_us", "x:")]:
        pts = [(n, r[key]) for n, r in zip(nodes, ver) if r.get(key)]
        ax_ver.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name)
    ax_ver.set_xscale("log", base=2)
    ax_ver.set_yscale("log")
    ax_ver.set_xticks(nodes, [str(n) for n in nodes])
    ax_ver.set_xlabel("tree nodes per sequence")
    ax_ver.set_ylabel("time (us)")
    ax_ver.set_title(f"Tree verify, B={ver[0]['B']}, ctx={ver[0]['ctx']}")
    ax_ver.legend(fontsize=8)

    fig.suptitle(f"{res['device']}  {res['date']}  {res['commit']}", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/attention.json")))
