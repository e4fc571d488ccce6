"""How the CPU's projections are computed, timed in one run: ``F.linear`` (``x @ W.T``), ``cpu_linear``
(``(W @ x.T).T``, one row padded to two) and oneDNN's linear over a prepacked weight (measured, not used:
see its memory below), then the embedded target's forward at one token and at a 9-node tree with
``target.model.CPU_LINEAR`` on and off.

    python bench/cpu_forms.py [--out bench/results/cpu_forms.json]

1. ``projections_ms``: SmolLM2-135M's 30 layers of projections (qkv 960x576, o 576x576, gate_up 3072x576,
   down 576x1536; random float32 weights, row-major ``[N, K]``) at M rows, median of 7 passes.
2. ``lm_head_ms``: its 49,152 x 576 head, median of 9.
3. ``forward_ms``: the embedded target (its Q4_1 weights, float32) after 128 cached tokens, one new token or
   a 9-node binary tree, median of 7.
4. ``onednn_rss_mb``: resident memory as five small prepacked weights meet row counts 3..299 once, then again
   (oneDNN builds and caches a primitive per shape).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from draft.tree import TokenTree, mask_to_bits  # noqa: E402
from gateway.llm import LLM, LoadConfig  # noqa: E402
from target import model as target_model  # noqa: E402
from target.batch import Segment, build_batch  # noqa: E402
from target.model import cpu_linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = (1, 2, 4, 9, 16, 64, 256)
ONEDNN = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[reps // 2] * 1e3, 2)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return round(next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024, 1)


def projections(g: torch.Generator) -> dict:
    layers = [[torch.randn(n, k, generator=g) for n, k in SHAPES] for _ in range(30)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in layers] if ONEDNN else None
    forms = {"f_linear": lambda x, w, p: F.linear(x, w), "cpu_linear": lambda x, w, p: cpu_linear(x, w)}
    if ONEDNN:
        forms["onednn"] = lambda x, w, p: onednn(x, p)
    out: dict[str, dict[int, float]] = {f: {} for f in forms}
    for M in ROWS:
        xs = {k: torch.randn(M, k, generator=g) for _, k in SHAPES}
        for name, form in forms.items():
            def run():
                for i, layer in enumerate(layers):
                    for j, w in enumerate(layer):
                        form(xs[w.shape[1]], w, None if packed is None else packed[i][j])
            run()  # first call: kernels and primitives built
            out[name][M] = median_ms(run, 7)
        print(M, {f: out[f][M] for f in forms}, flush=True)
    return out


def lm_head(g: torch.Generator) -> dict:
    w = torch.randn(49152, 576, generator=g)
    out: dict[str, dict[int, float]] = {"f_linear": {}, "cpu_linear": {}}
    for M in (1, 2, 9):
        x = torch.randn(M, 576, generator=g)
        out["f_linear"][M] = median_ms(lambda: F.linear(x, w), 9)
        out["cpu_linear"][M] = median_ms(lambda: cpu_linear(x, w), 9)
    return out


def forward() -> dict:
    llm = LLM.load(LoadConfig(device="cpu", draft="none"), log=lambda m: print(m, file=sys.stderr))
    model = llm.engine.target
    cache = model.new_cache(64, 16)
    table = cache.new_table()
    model.forward(build_batch([Segment(table, 0, list(range(1000, 1128)))], cache, "cpu"), cache)
    parents = [-1, 0, 0, 1, 1, 2, 2, 3, 3]
    tree = TokenTree.from_lists([42] * 9, parents)
    segs = {"one_token": Segment(table, 128, [42]),
            "tree_9": Segment(table, 128, [42] * 9, positions=[128 + d for d in tree.depths.tolist()],
                              mask_bits=mask_to_bits(tree.ancestor_mask()).tolist(), logits="all")}
    out: dict[str, dict[str, float]] = {}
    for on in (True, False, True, False):  # alternated; each arm keeps its better median
        target_model.CPU_LINEAR = on
        arm = "cpu_linear" if on else "f_linear"
        for name, seg in segs.items():
            def step():
                model.forward(build_batch([seg], cache, "cpu"), cache)
                table.truncate(128)
            step()
            ms = median_ms(step, 7)
            out.setdefault(arm, {})[name] = min(ms, out.get(arm, {}).get(name, ms))
    target_model.CPU_LINEAR = True
    return out


def onednn_memory(g: torch.Generator) -> dict:
    weights = [torch.randn(n, k, generator=g) for n, k in [(96, 64), (64, 64), (256, 64), (64, 128), (200, 64)]]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    marks = {"start": rss_mb()}
    for p in (1, 2):
        for M in range(3, 300):
            for w, pw in zip(weights, packed):
                onednn(torch.randn(M, w.shape[1]), pw)
        marks[f"after_pass_{p}"] = rss_mb()
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_forms.json"))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    res = {"date": datetime.date.today().isoformat(), "commit": provenance.commit(), "torch": torch.__version__,
           "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
           "note": __doc__.split("\n\n", 2)[2].strip()}
    res["projections_ms"] = projections(g)
    res["lm_head_ms"] = lm_head(g)
    print(res["lm_head_ms"], flush=True)
    res["forward_ms"] = forward()
    print(res["forward_ms"], flush=True)
    if ONEDNN:
        res["onednn_rss_mb"] = onednn_memory(g)  # last: what it allocates stays
        print(res["onednn_rss_mb"], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    """Projection time against rows, one line per form."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, by_m in res["projections_ms"].items():
        ms = sorted(by_m, key=int)
        ax.plot([int(m) for m in ms], [by_m[m] for m in ms], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (M)")
    ax.set_ylabel("ms, 30 layers of projections")
    ax.legend(fontsize=8)
    ax.set_title(f"SmolLM2-135M projections, float32, {res['device']}, {res['date']}, {res['commit'].split()[0]}",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
