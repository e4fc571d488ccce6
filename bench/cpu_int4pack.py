"""CPU weight forms for the embedded model's projections at M rows: what a CPU INT4 path could run on.

SmolLM2-135M's 30 layers of projections (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; random
weights) as one pass, median of 7, for: float32 and bfloat16 ``F.linear`` on dense weights, float32
``target.model.cpu_linear`` (the CPU path's form: ``(w @ x.T).T``); torch's
weight-only int8 kernel (``_weight_int8pack_mm``, per-channel scales) and its CPU int4 kernel
(``_weight_int4pack_mm_for_cpu``, the tinygemm format: groups of 32 with a scale and a float offset, which
holds GGUF Q4_1's ``q * d + m`` exactly as ``(q - 8) * d + (m + 8 d)``), each with float32 and bfloat16
activations. ``rel_err``: each form's output against float32 dense on the same (quantized) weights, so it
shows the activations' and the kernel's rounding, not the quantization's.

    PYTHONPATH=.:bench python bench/cpu_int4pack.py --out bench/results/cpu_int4pack.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

import provenance
from cpu_forms import median_ms
from target.model import cpu_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] per layer
LAYERS = 30
G = 32


def q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of G along K: codes [N, K] int32, scales and offsets [N, K // G]."""
    n, k = w.shape
    g = w.reshape(n, k // G, G)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).clamp(min=1e-8)
    codes = ((g - lo[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    return codes, d, lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,9,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k in SHAPES:
            codes, d, lo = q4(torch.randn(n, k, generator=gen) * 0.02)
            dense = (codes.reshape(n, k // G, G) * d[..., None] + lo[..., None]).reshape(n, k)  # what the codes hold
            sz = torch.stack([d.t(), (lo + 8 * d).t()], -1).contiguous()  # [K // G, N, 2]
            scale8 = dense.abs().amax(1) / 127
            w8 = (dense / scale8[:, None]).round().clamp(-127, 127).to(torch.int8)
            layer.append({"dense": dense, "bf16": dense.bfloat16(), "w8": w8, "s8": scale8, "s8b": scale8.bfloat16(),
                          "w4": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), "sz": sz,
                          "szb": sz.bfloat16()})
        layers.append(layer)
    forms = {
        "f32 dense": lambda x, w: F.linear(x, w["dense"]),
        "f32 dense, cpu_linear": lambda x, w: cpu_linear(x, w["dense"]),  # the CPU path's form today
        "bf16 dense": lambda x, w: F.linear(x.bfloat16(), w["bf16"]),
        "int8 f32": lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w["w8"], w["s8"]),
        "int8 bf16": lambda x, w: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w["w8"], w["s8b"]),
        "int4 f32": lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w["w4"], G, w["sz"]),
        "int4 bf16": lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), w["w4"], G, w["szb"]),
    }
    rows = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
        row = {"rows": m, "ms": {}, "rel_err": {}}
        ref = F.linear(xs[576], layers[0][2]["dense"])
        for name, fn in forms.items():
            run = lambda: [fn(xs[w["dense"].shape[1]], w) for lay in layers for w in lay]  # noqa: E731
            run()  # warm-up
            row["ms"][name] = median_ms(run, 7)
            y = fn(xs[576], layers[0][2]).float()
            row["rel_err"][name] = float(f"{((y - ref).norm() / ref.norm()).item():.2e}")
        print(row, flush=True)
        rows.append(row)
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps({
            "device": f"cpu ({platform.machine()}, {args.threads} threads)", "date": datetime.date.today().isoformat(),
            "commit": provenance.commit(), "torch": torch.__version__, "command": "python bench/cpu_int4pack.py",
            "rows": rows}, indent=1) + "\n")
        plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ms = [r["rows"] for r in rows]
    for name in rows[0]["ms"]:
        ax.plot(ms, [r["ms"][name] for r in rows], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("rows (M)")
    ax.set_ylabel("ms for 30 layers of projections")
    ax.set_title("SmolLM2-135M projections on the CPU, by weight form", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
