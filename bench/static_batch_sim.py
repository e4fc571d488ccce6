"""A static batch under the adaptive budget, replayed on the target's greedy text with measured step prices.

A simulation, not a measurement: it answers "which steps would the scheduler draft, and how long would the
batch take" for a batch of requests that all start together and are all awaited (``LLM.generate``), under
each budget objective, without a GPU. What is real: the scheduler (``gateway.scheduler``, the budget's
acceptance rule, its cost-aware depth cap and probes), the n-gram drafter with the shipped table
(``draft.ngram``), and the accepted lengths, exact for greedy decoding (greedy speculation emits plain
decoding's tokens, so a tree keeps the longest branch prefix that equals the next tokens of the text; see
bench/ngram_sweep.py, whose greedy texts this reads). What is modelled: every step's seconds, taken from a
results file's measured mean step time per draft depth at that batch size (``steps_by_depth`` of
bench/engine.py --real, e.g. engine_real_h100_2485e10.json's "on" arm), and fed to the scheduler's step-cost
model as the engine feeds its own.

    python bench/static_batch_sim.py --texts TEXTS.json --prices bench/results/engine_real_h100_2485e10.json \\
        --out bench/results/static_batch_sim.json

Arms per batch size: plain decoding, the budget aimed at tokens per second (a server's, ``per-token``), and
aimed at the batch's end (``batch-completion``, LLM.generate's). Makespan = the batch's modelled seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from draft.base import DraftRequest  # noqa: E402
from draft.ngram import NgramDrafter, NgramTable  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from draft.shipped import embedded_ngram_dir  # noqa: E402
from gateway.budget import drafter_set  # noqa: E402
from gateway.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from gateway.sequence import Sequence, Status  # noqa: E402
from ngram_sweep import accepted_path  # noqa: E402
from provenance import commit  # noqa: E402
from target.blocks import BlockPool  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

TEMPLATE = (2, 2, 2, 1)  # the embedded pair's default tree


def prices_from(path: str, arm: str = "on") -> dict[int, dict[int, float]]:
    """batch -> {draft depth: mean seconds a step}, from a bench/engine.py --real file's steps_by_depth (the
    arm's first and later runs pooled, weighted by steps). Depths never measured at a batch take the next
    shallower measured depth's price (a floor: drafting deeper never makes a step cheaper)."""
    out: dict[int, dict[int, float]] = {}
    for row in json.load(open(path))["real_pair"]:
        runs = [row["first_use"].get(arm, {})] + row.get("later_runs", {}).get(arm, [])
        total: dict[int, list[float]] = {}
        for run in runs:
            for d, (n, ms, _) in run.get("steps_by_depth", {}).items():
                t = total.setdefault(int(d), [0, 0.0])
                t[0] += n
                t[1] += n * ms / 1e3
        prices = {d: s / n for d, (n, s) in sorted(total.items())}
        for d in range(1, len(TEMPLATE) + 1):
            prices.setdefault(d, prices[max(k for k in prices if k < d)])
        out[row["batch"]] = prices
    return out


def run_batch(sched: Scheduler, drafter: NgramDrafter, texts: list[tuple[list[int], int]], prices: dict[int, float],
              arm: str, new_tokens: int) -> dict:
    """One static batch of ``texts`` under ``arm`` through ``sched`` (kept across an arm's batches, as an
    engine's: its step prices and drafter prior carry over): steps, modelled seconds, emitted tokens and
    steps that drafted."""
    sched.batch_completion = arm == "batch-completion"
    spec = SpeculationParams(enabled=arm != "plain")
    seqs, future = [], {}  # future: request id -> the greedy text still to emit
    for k, (tokens, P) in enumerate(texts):
        # a text shorter than new_tokens ended at the target's end-of-sequence token: the request ends there
        n = min(new_tokens, len(tokens) - P)
        seq = Sequence(str(k), tokens[:P], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), spec, None,
                       "ngram" if spec.enabled else None)
        future[seq.request_id] = tokens[P:]
        sched.add(seq)
        seqs.append(seq)
    template_of = (lambda s: (TEMPLATE, True)) if spec.enabled else (lambda s: ((), False))
    steps = drafted_steps = seq_steps = 0
    seconds = 0.0
    while sched.has_work():
        plan = sched.schedule(template_of)
        for seq, n in plan.prefills:  # prefill steps are priced alike in every arm: left out of the time
            seq.table.ensure(seq.num_cached + n)
            seq.num_cached += n
        if not plan.decodes:
            continue
        depth_of_step, kinds = 0, set()
        results = []
        for seq, widths in plan.decodes:
            seq.table.ensure(seq.num_cached + 1 + sum(widths))
            done = len(seq.output_ids)
            kept = depth = 0
            if widths:
                tree = drafter.propose([DraftRequest(seq.request_id, seq.token_ids, widths, None, None)])[0]
                if tree.num_nodes > 1:
                    tokens, parents, depths = tree.host()
                    depth = max(depths)
                    kept = accepted_path(tokens, parents, future[seq.request_id][done : done + len(widths)])
                    kinds.add(seq.drafter)
            depth_of_step = max(depth_of_step, depth)
            results.append((seq, widths, kept, depth))
        secs = prices[depth_of_step]
        sched.costs.observe(len(plan.decodes), depth_of_step, secs, drafter_set(kinds))
        seconds += secs
        steps += 1
        seq_steps += len(plan.decodes)
        drafted_steps += depth_of_step > 0
        for seq, widths, kept, depth in results:
            n = min(kept + 1, seq.sampling.max_tokens - len(seq.output_ids))
            seq.output_ids += future[seq.request_id][len(seq.output_ids) : len(seq.output_ids) + n]
            seq.num_cached += n
            sched.observe_step(seq, kept, depth, len(widths))  # as the engine's commit
            seq.table.truncate(seq.num_cached + 1)
            if len(seq.output_ids) >= seq.sampling.max_tokens:
                sched.remove(seq)
                seq.table.release()
                seq.table = None
                seq.status = Status.FINISHED
                drafter.release(seq.request_id)
    return {"steps": steps, "seconds": seconds, "tokens": sum(len(s.output_ids) for s in seqs),
            "drafted_steps": drafted_steps, "seq_steps": seq_steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", required=True, help="bench/ngram_sweep.py's greedy texts (its --texts cache)")
    ap.add_argument("--split", default="mt_bench")
    ap.add_argument("--prices", required=True, help="a bench/engine.py --real results file")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # as bench/engine.py --real (ignore_eos, new_tokens each): the texts the target did not end sooner
    texts = [tuple(t) for t in json.load(open(args.texts))[args.split] if len(t[0]) - t[1] >= args.new_tokens]
    prices = prices_from(args.prices)
    table = NgramTable.find(embedded_ngram_dir())
    rows = []
    for b in map(int, args.batches.split(",")):
        # consecutive groups of b texts, as bench/engine.py --real takes its first b prompts; every group
        groups = [texts[i : i + b] for i in range(0, len(texts) - b + 1, b)]
        row = {"batch": b, "groups": len(groups), "prices_ms": {d: round(1e3 * s, 3) for d, s in prices[b].items()}}
        for arm in ("plain", "per-token", "batch-completion"):
            sched = Scheduler(SchedulerConfig(max_running=b, max_step_tokens=4096), BlockPool(8192, 16))
            drafter = NgramDrafter(table=table)
            run_batch(sched, drafter, groups[-1], prices[b], arm, args.new_tokens)  # warm-up: prices, prior
            runs = [run_batch(sched, drafter, g, prices[b], arm, args.new_tokens) for g in groups]
            total = {k: sum(r[k] for r in runs) for k in runs[0]}
            row[arm] = {"seconds": round(total["seconds"], 4), "steps": total["steps"],
                        "drafted_steps": total["drafted_steps"], "tokens": total["tokens"],
                        "mean_accepted_length": round(total["tokens"] / total["seq_steps"], 3)}
        for arm in ("per-token", "batch-completion"):
            row[f"{arm}_speedup"] = round(row["plain"]["seconds"] / row[arm]["seconds"], 3)
        rows.append(row)
        print(row)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": "cpu (a simulation: step prices from the file named in prices_from)",
            "date": datetime.date.today().isoformat(), "commit": commit(), "prices_from": args.prices,
            "texts": f"{args.split} greedy texts of the embedded target, {args.new_tokens} tokens",
            "command": "python bench/static_batch_sim.py " + " ".join(
                "TEXTS.json" if a == args.texts else a for a in sys.argv[1:]),
            "notes": __doc__.split("\n\n")[1].replace("\n", " "), "rows": rows}, indent=2) + "\n")
        plot(rows, Path(args.out).with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    """Makespan of each objective over plain decoding's, per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    for k, arm in enumerate(("per-token", "batch-completion")):
        ax.bar([x + 0.4 * k for x in xs], [r[f"{arm}_speedup"] for r in rows], 0.4, label=arm)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.2 for x in xs], [f"batch {r['batch']}" for r in rows])
    ax.set_ylim(0.9, max(1.05, 0.05 + max(r[f"{a}_speedup"] for r in rows for a in ("per-token", "batch-completion"))))
    ax.set_ylabel("plain makespan / arm's (modelled)")
    ax.set_title("static batch, n-gram + table, GPU step prices (simulated)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
