"""The sampled draws of one engine step: per-request generators, one host copy.

Two arms in one process, on the same logits, alternating, each timed wall-clock (host and device: at
these sizes the cost is launches, not arithmetic):

* ``per_row``: each sequence processed and drawn alone (``process_logits`` + ``torch.multinomial`` with its
  generator): the engine's path before ``verify.sampling.sample_rows``, restated here.
* ``batched``: ``verify.accept.accept_batch`` as the engine calls it: sequences grouped by processing
  knobs, one processing pass, one small draw per sequence and one pass over all rows (``sample_rows``:
  an exponential race on CUDA, an inverse CDF on the CPU).

Setting ``tree16`` verifies a 16-node tree per sequence (a binary heap with draft probabilities, T=0.7):
``per_row`` is then each tree processed and decided alone (``_stochastic_parallel`` on one tree, the
engine's path before trees were stacked), ``batched`` every tree of the step in one pass (on CUDA one kernel
launch for every decision and bonus, kernels/stochastic_accept.py), ``batched_torch`` the same with the
decisions as torch passes (``SPECGATE_ACCEPT_KERNEL=0``).

Setting ``draft_level`` grows one level of a sampled draft tree (two frontier nodes a sequence, two children
in all, T=0.7): ``per_row`` restates ``draft.base``'s draw before its race top-k (a multinomial and two host copies
per frontier node), ``batched`` is ``draft.base.expand_all`` (a race top-k over every row, one host copy).

    python bench/sampling_step.py --device cuda --out bench/results/sampling_step.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import provenance  # noqa: E402  (bench/, this script's own directory)
from draft.base import TreeBuilder, _allocate, expand_all  # noqa: E402
from draft.tree import TokenTree  # noqa: E402
import verify.accept as accept_mod  # noqa: E402
from verify.accept import _stochastic_parallel, accept_batch  # noqa: E402
from verify.sampling import SamplingParams, make_generator, process_logits  # noqa: E402

SETTINGS = {"T=0.7": SamplingParams(temperature=0.7), "T=0.7 top_p=0.95": SamplingParams(temperature=0.7, top_p=0.95),
            "greedy": SamplingParams(temperature=0), "tree16": SamplingParams(temperature=0.7),
            "draft_level": SamplingParams(temperature=0.7)}
TREE_NODES = 16


def heap_tree(V: int, device: torch.device, seed: int) -> TokenTree:
    """16 nodes, node i's parent (i - 1) // 2, distinct sibling tokens, random draft probabilities."""
    g = torch.Generator(device).manual_seed(seed)
    q = torch.softmax(torch.randn(TREE_NODES, V, device=device, generator=g), -1)
    return TokenTree.from_lists([3 + i for i in range(TREE_NODES)], [-1] + [(i - 1) // 2 for i in range(1, TREE_NODES)],
                                device=device, draft_probs=q)


def level_builders(B: int, params: SamplingParams, gens: list[torch.Generator]) -> list[TreeBuilder]:
    """B builders whose depth-1 frontier holds two nodes (root children 3 and 4)."""
    out = []
    for g in gens[:B]:
        b = TreeBuilder(2, (2, 2), params, g)
        b._add(0, 3, -0.5)
        b._add(0, 4, -1.0)
        out.append(b)
    return out


def level_per_row(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]) -> None:
    for i, b in enumerate(level_builders(len(gens), params, gens)):
        front = b.frontier(1)
        q = process_logits(logits[2 * i : 2 * i + 2].float(), params)
        support = (q > 0).sum(-1).tolist()
        for j, (f, k) in enumerate(zip(front, _allocate(2, [b.cum_logp[f] for f in front]))):
            k = min(k, support[j])
            if k:
                drawn = torch.multinomial(q[j], k, replacement=False, generator=b.generator)
                for tok, lp in zip(drawn.tolist(), q[j][drawn].log().tolist()):
                    b._add(f, tok, b.cum_logp[f] + lp)


def level_batched(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]) -> None:
    builders = level_builders(len(gens), params, gens)
    expand_all(builders, 1, [logits[2 * i : 2 * i + 2] for i in range(len(builders))])


def per_tree(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator],
             trees: list[TokenTree]) -> list[int]:
    picks = [_stochastic_parallel([t], process_logits(logits[i * TREE_NODES : (i + 1) * TREE_NODES], params), [g])
             for i, (t, g) in enumerate(zip(trees, gens))]
    return torch.cat(picks).tolist()


def trees_batched(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator],
                  trees: list[TokenTree]) -> list[int]:
    B = len(trees)
    return [r.tokens[-1] for r in accept_batch(trees, logits, [i * TREE_NODES for i in range(B + 1)], [params] * B,
                                               gens, [(None, None)] * B)]


def torch_passes(fn, *args) -> list[int]:
    """``fn`` with stochastic trees decided by torch passes (``SPECGATE_ACCEPT_KERNEL=0``'s path)."""
    accept_mod.ACCEPT_KERNEL = False
    try:
        return fn(*args)
    finally:
        accept_mod.ACCEPT_KERNEL = True


def per_row(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]) -> list[int]:
    picks = [torch.multinomial(process_logits(logits[i : i + 1], params)[0], 1, generator=g)
             for i, g in enumerate(gens)]
    return torch.cat(picks).tolist()


def batched(logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]) -> list[int]:
    B = logits.shape[0]
    trees = [TokenTree.root_only(0) for _ in range(B)]
    return [r.tokens[-1] for r in accept_batch(trees, logits, list(range(B + 1)), [params] * B, gens,
                                               [(None, None)] * B)]


def wall_ms(fn, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # ends with its host copy, as the engine's step does
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        for name, params in SETTINGS.items():
            gen = torch.Generator(device).manual_seed(B)
            if name == "draft_level":
                logits = torch.randn(2 * B, args.vocab, device=device, generator=gen) * 3
                arms = {"per_row": level_per_row, "batched": level_batched}
            elif name == "tree16":
                trees = [heap_tree(args.vocab, device, i) for i in range(B)]
                logits = torch.randn(B * TREE_NODES, args.vocab, device=device, generator=gen) * 3
                arms = {"per_row": lambda l, p, g: per_tree(l, p, g, trees),
                        "batched": lambda l, p, g: trees_batched(l, p, g, trees)}
                if device.type == "cuda":  # the decisions as torch passes, beside the one-launch kernel
                    arms["batched_torch"] = lambda l, p, g: torch_passes(trees_batched, l, p, g, trees)
            else:
                logits = torch.randn(B, args.vocab, device=device, generator=gen) * 3
                arms = {"batched": batched} if params.is_greedy else {"per_row": per_row, "batched": batched}
            gens = [make_generator(SamplingParams(seed=i), device) for i in range(B)]
            for fn in arms.values():  # warm-up: allocator, kernels
                fn(logits, params, gens)
            got = {k: [] for k in arms}
            for _ in range(3):  # arms alternate; each figure the median of its own reps
                for k, fn in arms.items():
                    got[k].append(wall_ms(lambda: fn(logits, params, gens), device, args.reps // 3))
            row = {"B": B, "setting": name, **{f"{k}_ms": round(min(v), 3) for k, v in got.items()}}
            if "per_row" in arms:
                row["speedup"] = round(row["per_row_ms"] / row["batched_ms"], 2)
            rows.append(row)
            print(row, flush=True)
    if args.out:
        out = Path(args.out)
        cpu = f"cpu ({torch.get_num_threads()} threads)"
        res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
               "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "torch": torch.__version__,
               "vocab": args.vocab, "command": "python bench/sampling_step.py " + " ".join(sys.argv[1:]),
               "notes": __doc__.split("\n\n", 1)[1].split("\n\n")[0].strip(), "rows": rows}
        out.write_text(json.dumps(res, indent=2) + "\n")
        plot(res, out.with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in SETTINGS:
        rows = [r for r in res["rows"] if r["setting"] == name]
        for arm, ls in (("per_row", "--"), ("batched", "-")):
            if all(f"{arm}_ms" in r for r in rows):
                ax.plot([r["B"] for r in rows], [r[f"{arm}_ms"] for r in rows], ls, marker="o", label=f"{name}, {arm}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences in the step")
    ax.set_ylabel("ms per step (draw + host copy)")
    ax.set_title(f"Sampled draws of one step (plain decodes, 16-node trees), {res['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
