"""Ragged graph replays against per-segment padding, in one run on the GPU.

    python bench/graph_rows.py [--out bench/results/graph_rows.json] [--batch 16] [--trees 2,4,8] [--plot-only]

A batch of ``--batch`` sequences (512 cached tokens each) where one sequence verifies a tree of ``k`` nodes
and the rest decode one token: the step the adaptive budget makes whenever one request drafts and the
others do not (and every step where a speculation-off request rides along). ``target/graphs.py`` replays
it ragged in the fewest rows of its graph set (``graph_shape``: 24 rows for 16 + 3); the layout before
padded every segment to the longest, ``bucket(B) * next_pow2(k)`` rows (64 for k = 4). Both arms replay
the same batch through the same ragged loader, in graphs of those two row counts, timed round-robin
(``bench/engine.py``'s ``replay_ms``); the plain decode step of the same sequences is the floor. Each arm's
logits are checked against the eager forward first.

Targets: Llama-3-8B's shape in INT4 g128 (random weights, the synthetic target of bench/engine.py) and
SmolLM2-135M's shape in INT4 g32 (the embedded model's). Writes JSON and a PNG beside it, and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import provenance  # noqa: E402
from bench.engine import LLAMA3_8B, model_config, random_model, replay_ms  # noqa: E402
from target.batch import Segment, build_batch  # noqa: E402
from target.graphs import BATCH_BUCKETS, CudaGraphRunner, graph_shape  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
               intermediate_size=1536, tie_word_embeddings=True)


def mixed_batch(model, cache, batch: int, nodes: int, context: int = 512):
    """``batch`` sequences over ``context`` cached tokens; the first verifies a binary tree of ``nodes``."""
    tables = [cache.new_table() for _ in range(batch)]
    for t in tables:
        model.forward(build_batch([Segment(t, 0, list(range(context)), logits="none")], cache, "cuda"), cache)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    depths, bits = [0], [1]
    for i in range(1, nodes):
        depths.append(depths[parents[i]] + 1)
        bits.append(bits[parents[i]] | (1 << i))
    segs = [Segment(tables[0], context, [7] * nodes, positions=[context + d for d in depths],
                    mask_bits=bits if nodes > 1 else None, logits="all")]
    segs += [Segment(t, context, [7], logits="all") for t in tables[1:]]
    return build_batch(segs, cache, "cuda")


def forced(runner: CudaGraphRunner, batch, key: tuple[int, int, bool]):
    """A replay of ``batch`` in the graph ``key`` (captured here), loaded the way the runner loads it."""
    g = runner._graphs.get(key) or runner._capture(*key)
    runner._graphs[key] = g
    cache = runner.cache

    def run() -> torch.Tensor:
        rows = g.load(batch, cache.scratch_block, cache.page_size)
        g.graph.replay()
        return g.out[: batch.num_tokens] if rows is None else g.out.index_select(0, rows)

    return run


def measure(name: str, shape: dict, group: int, batch: int, trees: list[int], reps: int) -> list[dict]:
    model, _ = random_model(model_config(shape), int4=True, group=group)
    rows = []
    for k in trees:
        blocks = 2 * batch * (512 // 16 + 4) + 8  # the tree step's sequences and the decode step's
        cache = model.new_cache(blocks, 16)
        runner = CudaGraphRunner(model, cache, max_blocks=512 // 16 + 4)
        step = mixed_batch(model, cache, batch, k)
        ragged = graph_shape(step.query_lens, step.num_tokens, BATCH_BUCKETS, 64, 1024)
        b = next(x for x in BATCH_BUCKETS if x >= batch)
        padded = (next(x for x in BATCH_BUCKETS if x > b), b * (1 << (k - 1).bit_length()), False)
        arms = {"ragged": forced(runner, step, ragged), "padded": forced(runner, step, padded)}
        cache_k = cache.k.clone()
        eager = model.forward(step, cache).float()
        check = {}
        for arm, run in arms.items():  # each arm's logits against the eager forward's, before any timing
            got = run().float()
            err = ((got - eager).norm() / eager.norm()).item()  # bf16, INT4 tiles picked per row count
            if not err < 3e-2:
                raise SystemExit(f"{name} k={k} {arm}: logits off the eager forward's, rel err {err:.2e}")
            check[f"rel_err_{arm}"] = float(f"{err:.2e}")
        cache.k.copy_(cache_k)
        decode = mixed_batch(model, cache, batch, 1)  # the same sequences decoding plainly: the floor
        arms["decode"] = forced(runner, decode, graph_shape(decode.query_lens, decode.num_tokens, BATCH_BUCKETS,
                                                            64, 1024))
        ms = replay_ms(arms, reps)
        row = {"target": name, "batch": batch, "tree_nodes": k, "rows_ragged": ragged[1], "rows_padded": padded[1],
               "ms_ragged": round(ms["ragged"], 4), "ms_padded": round(ms["padded"], 4),
               "ms_decode": round(ms["decode"], 4), "padded_over_ragged": round(ms["padded"] / ms["ragged"], 3),
               **check}
        print(row, flush=True)
        rows.append(row)
        del runner, cache
        gc.collect()
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        rows = [r for r in res["rows"] if r["target"] == target]
        xs = range(len(rows))
        for i, (key, label) in enumerate((("ms_decode", "every sequence decoding (floor)"),
                                          ("ms_ragged", "ragged rows"), ("ms_padded", "padded per segment"))):
            ax.bar([x + (i - 1) * 0.27 for x in xs], [r[key] for r in rows], 0.27, label=label)
        ax.set_xticks(list(xs), [f"{r['tree_nodes']}-node tree\n{r['rows_ragged']} vs {r['rows_padded']} rows"
                                 for r in rows])
        ax.set_ylabel("ms per replayed step")
        ax.set_title(f"{target}, batch {rows[0]['batch']}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"bench/graph_rows.py on {res['device']}, commit {res['commit']} ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--trees", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=str(HERE / "results" / "graph_rows.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT's PNG from OUT's JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return
    rows = measure("smollm2-135m shape, int4 g32", SMOLLM2, 32, args.batch, args.trees, args.reps)
    rows += measure("llama-3-8b shape, int4 g128", LLAMA3_8B, 128, args.batch, args.trees, args.reps)
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "commit": provenance.commit(describe=True), "torch": torch.__version__, "rows": rows,
           "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))
    print(f"{'target':<30} {'k':>3} {'rows r/p':>9} {'ragged ms':>10} {'padded ms':>10} {'decode ms':>10} {'p/r':>6}")
    for r in rows:
        print(f"{r['target']:<30} {r['tree_nodes']:>3} {r['rows_ragged']:>4}/{r['rows_padded']:<4} "
              f"{r['ms_ragged']:>10.3f} {r['ms_padded']:>10.3f} {r['ms_decode']:>10.3f} "
              f"{r['padded_over_ragged']:>6.3f}")


if __name__ == "__main__":
    main()
