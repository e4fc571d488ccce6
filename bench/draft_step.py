"""What a draft costs against its target, forward by forward and tree by tree, in one run.

    python bench/draft_step.py [--reps 3] [--out bench/results/draft_step.json]

The target is SmolLM2-135M's shape with random weights (INT4 g128, 30 layers), the draft the shipped
draft's shape (3 dense bf16 layers); costs do not depend on the weights. On CUDA:

1. ``forward``: one decode forward (batch 1, one token after 128 cached), replayed from a CUDA graph,
   as device time (forwards back to back, one sync) and as latency (each synchronised alone), for the
   target and for the draft with the dense fusions on and off (``target.model.DENSE_FUSION``: the
   residual add in the GEMM, one silu(gate) * up kernel). The arms alternate ``--reps`` times; each
   figure is the median.
2. ``tree``: one greedy tree grown by the draft's device loop (``GreedyTreeLoop``, one graph for every
   level, one host copy), against one target forward over the same number of nodes, both synchronised.

Elsewhere everything runs eagerly, which measures the host, not the device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import provenance  # noqa: E402
import target.model as model_mod  # noqa: E402
from drafters import forward_seconds  # noqa: E402
from draft.tree_loop import GreedyTreeLoop  # noqa: E402
from step_profile import random_model  # noqa: E402
from target.batch import Segment, build_batch  # noqa: E402
from target.graphs import CudaGraphRunner  # noqa: E402

CONTEXT = 128


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def tree_seconds(draft, target, widths: tuple[int, ...], cuda: bool, reps: int = 20) -> tuple[float, float]:
    """Median seconds of one grown tree (batch 1) and of one target forward over its nodes, each synced."""
    nodes = 1 + sum(widths)
    pages = (CONTEXT + nodes) // 16 + 2
    d_cache, t_cache = draft.new_cache(pages + 1, 16), target.new_cache(pages + 1, 16)
    d_table, t_table = d_cache.new_table(), t_cache.new_table()
    prompt = list(range(1000, 1000 + CONTEXT))
    draft.forward(build_batch([Segment(d_table, 0, prompt)], d_cache, draft.device), d_cache)
    target.forward(build_batch([Segment(t_table, 0, prompt)], t_cache, target.device), t_cache)
    loop = GreedyTreeLoop(draft, d_cache, pages, graphs=cuda)
    root = torch.zeros(1, draft.config.vocab_size, device=draft.device)
    root[0, 42] = 1.0
    run = CudaGraphRunner(target, t_cache, pages).forward if cuda else target.forward
    tree_t, fwd_t = [], []
    for _ in range(reps + 2):
        sync(cuda)
        t0 = time.perf_counter()
        loop.grow(root, [CONTEXT - 1], [d_table], widths)
        tree_t.append(time.perf_counter() - t0)
        d_table.truncate(CONTEXT)
        batch = build_batch([Segment(t_table, CONTEXT, list(range(5, 5 + nodes)), logits="all")], t_cache,
                            target.device)
        sync(cuda)
        t0 = time.perf_counter()
        run(batch, t_cache)
        sync(cuda)
        fwd_t.append(time.perf_counter() - t0)
        t_table.truncate(CONTEXT)
    return statistics.median(tree_t[2:]), statistics.median(fwd_t[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trees", default="2,2,2,1/9,9,9,9,9,9,9")
    ap.add_argument("--out", default=str(HERE / "results" / "draft_step.json"))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    target = random_model(30, device, dtype, seed=0).quantize(128)
    draft = random_model(3, device, dtype, seed=1)
    ms = lambda s: round(s * 1e3, 4)  # noqa: E731
    figs: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for name, model, fusion in (("target", target, True), ("draft_fused", draft, True),
                                    ("draft_unfused", draft, False)):
            model_mod.DENSE_FUSION = fusion
            figs.setdefault(f"{name}_device_ms", []).append(
                ms(forward_seconds(model, CONTEXT, graphs=cuda, pipelined=True, reps=50)))
            figs.setdefault(f"{name}_latency_ms", []).append(ms(forward_seconds(model, CONTEXT, graphs=cuda)))
    model_mod.DENSE_FUSION = True
    forward = {k: statistics.median(v) for k, v in figs.items()}
    for kind in ("device", "latency"):
        for arm in ("fused", "unfused"):
            forward[f"draft_{arm}_over_target_{kind}"] = round(
                forward[f"draft_{arm}_{kind}_ms"] / forward[f"target_{kind}_ms"], 4)
    print(json.dumps(forward), flush=True)
    trees = []
    for spec in args.trees.split("/"):
        widths = tuple(int(x) for x in spec.split(","))
        grow_s, verify_s = tree_seconds(draft, target, widths, cuda)
        trees.append({"tree": list(widths), "nodes": 1 + sum(widths), "grow_ms": ms(grow_s),
                      "target_forward_ms": ms(verify_s), "grow_over_forward": round(grow_s / verify_s, 3)})
        print(trees[-1], flush=True)
    dev = torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})"
    Path(args.out).write_text(json.dumps({
        "device": dev, "date": datetime.date.today().isoformat(), "commit": provenance.commit(),
        "torch": torch.__version__, "context": CONTEXT, "reps": args.reps, "forward": forward, "runs": figs,
        "tree": trees}, indent=2) + "\n")


if __name__ == "__main__":
    main()
