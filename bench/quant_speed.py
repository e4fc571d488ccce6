"""What a quantized checkpoint's layout costs at Llama-3-8B's shape: the target's replayed step at M=1 and
for a 16-node tree, INT4 g128 with random weights, in three layouts that share one set of codes and scales:

- ``symmetric``: no zero points (what ``bench/engine.py --synthetic`` times);
- ``zeros``: a zero point per group, as GPTQ (ours, fractional) and AWQ / asymmetric GPTQ files carry;
- ``zeros_perm``: also true act-order's input permutation on ``qkv`` and ``gate_up`` (an AutoGPTQ
  ``desc_act`` checkpoint, or ``act_order="perm"``): each gathers its input before the matmul
  (``Linear.perm``); ``down``'s order is folded into ``gate_up``'s rows and ``o`` keeps its own.

    python bench/quant_speed.py [--out bench/results/quant_speed_8b.json]

Steps are CUDA-graph replays through ``target/graphs.py``, timed round-robin across the layouts
(``bench/engine.py``'s ``replay_ms``), so every ratio is within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import provenance  # noqa: E402  (bench/, this script's own folder)
from bench.engine import LLAMA3_8B, model_config, random_model, replay_ms, tree_step  # noqa: E402
from bench.kernels.bench_int4_matmul import copy_tbps  # noqa: E402
from kernels.int4_matmul import Int4Weight  # noqa: E402
from target.model import Linear, Transformer, int4_linear  # noqa: E402

NODES = (1, 16)


def with_layout(model: Transformer, zeros: bool, perm: bool, seed: int = 0) -> Transformer:
    """``model`` (symmetric INT4) sharing its codes and scales, with zero points (8, the symmetric grid's
    own, so outputs do not change scale) and / or random input permutations on ``qkv`` and ``gate_up``."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def lin(x: Linear, permute: bool) -> Linear:
        w = x.weight
        assert isinstance(w, Int4Weight)
        z = torch.full_like(w.scales, 8.0) if zeros else None
        p = torch.randperm(w.in_features, generator=g, device="cuda") if permute and perm else None
        return int4_linear(Int4Weight(w.qweight, w.scales, z, w.group_size), x.bias, p)

    layers = [replace(l, qkv=lin(l.qkv, True), o=lin(l.o, False), gate_up=lin(l.gate_up, True),
                      down=lin(l.down, False)) for l in model.layers]
    return Transformer(model.config, model.embed, layers, model.norm, model.lm_head, model.dtype)


def check(base: Transformer, other: Transformer) -> float:
    """Largest difference of one layer's qkv output between ``base`` and ``other`` fed the input ``other``
    expects (gathered back): the layouts must compute the same product."""
    x = torch.randn(16, base.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    a, b = base.layers[0].qkv, other.layers[0].qkv
    xb = x if b.perm is None else x[:, torch.argsort(b.perm)]  # b gathers xb[:, perm] == x
    return float((a(x).float() - b(xb).float()).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "quant_speed_8b.json"))
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                 "commit": provenance.commit(), "torch": torch.__version__, "copy_tbps": round(copy_tbps(), 3)}
    base, nbytes = random_model(model_config(LLAMA3_8B), int4=True)
    arms = {"symmetric": base, "zeros": with_layout(base, True, False), "zeros_perm": with_layout(base, True, True)}
    res["max_abs_diff_vs_symmetric"] = {k: check(base, m) for k, m in arms.items()}
    ms = replay_ms({(k, n): tree_step(m, n) for k, m in arms.items() for n in NODES}, args.reps)
    res["rows"] = [{"layout": k, "nodes": n, "step_ms": round(ms[k, n], 4),
                    "ratio_to_symmetric": round(ms[k, n] / ms["symmetric", n], 4)} for k in arms for n in NODES]
    res["floor_ms"] = round(nbytes / (res["copy_tbps"] * 1e12) * 1e3, 3)
    res["note"] = ("Llama-3-8B shape, INT4 g128 random codes, bf16; one sequence over 512 cached tokens; median of "
                   f"{args.reps} CUDA-graph replays per row, synchronised, timed round-robin across rows. zeros: a "
                   "zero point tensor per group (all 8). zeros_perm: also a random input permutation on qkv and "
                   "gate_up, gathered before the matmul. max_abs_diff_vs_symmetric: layer 0's qkv on one input, "
                   "each layout fed the input it expects.")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))
    for r in res["rows"]:
        print(f"{r['layout']:>11} N={r['nodes']:<3} {r['step_ms']:.3f} ms  x{r['ratio_to_symmetric']:.3f}")


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    layouts = list(dict.fromkeys(r["layout"] for r in res["rows"]))
    for j, n in enumerate(NODES):
        vals = [next(r["step_ms"] for r in res["rows"] if r["layout"] == k and r["nodes"] == n) for k in layouts]
        ax.bar([i + 0.38 * j for i in range(len(layouts))], vals, width=0.36, label=f"{n} node(s)")
    ax.set_xticks([i + 0.19 for i in range(len(layouts))], layouts)
    ax.axhline(res["floor_ms"], color="tab:red", ls="--", lw=1, label="floor (M=1)")
    ax.set_ylabel("target step, ms")
    ax.legend(fontsize=8)
    ax.set_title(f"8B shape INT4 g128 layouts, {res['device']}, {res['date']}, {res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
