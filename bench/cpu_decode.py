"""Decoding on the CPU with the batched attention paths against the one-sequence-at-a-time reference.

    python bench/cpu_decode.py [--batches 1,8,32] [--max-tokens 64] [--repeats 2] [--spec]
                               [--out bench/results/cpu_decode.json]

Plain decoding by default; ``--spec`` drafts with the shipped draft, tree 2,2,2,1, so the target's steps
verify trees (``tree_attention_batched``) and the draft's run its own decode and tree steps.

The embedded SmolLM2 target (its own Q4_1 weights, float32 activations) generates greedily, speculation off,
MT-bench first turns, at each batch size; the two attention paths (``kernels.paged_decode.BATCHED_CPU``)
alternate within each repeat, and each is reported at its best repeat, so every ratio is within one run.
``token_agreement``: the share of generated tokens the two paths agree on (float sums in another order can
flip a near tie, after which a sequence's continuations differ).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import provenance  # noqa: E402  (bench/, this script's own folder)
from draft.params import SpeculationParams  # noqa: E402
from gateway.engine import EngineConfig  # noqa: E402
from gateway.llm import LLM, LoadConfig  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from kernels import paged_decode  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"
ARMS = {"batched": True, "reference": False}


def run(llm: LLM, prompts: list[str], max_tokens: int, batched: bool,
        spec: SpeculationParams) -> tuple[float, list[list[int]], float]:
    """Output tokens per second of one ``generate`` over ``prompts``, the tokens, and the mean accepted length."""
    paged_decode.BATCHED_CPU = batched
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    gens = llm.generate(prompts, greedy, spec)
    secs = time.perf_counter() - t0
    steps = sum(g.stats.steps for g in gens)
    accepted = (sum(g.stats.accepted_tokens for g in gens) + steps) / max(steps, 1)
    return sum(len(g.token_ids) for g in gens) / secs, [g.token_ids for g in gens], accepted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts-file", default=str(MT_BENCH))
    ap.add_argument("--spec", action="store_true", help="draft with the shipped draft, tree 2,2,2,1")
    ap.add_argument("--out", default=None, help="default bench/results/cpu_decode.json, cpu_spec.json with --spec")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts_file)]
    ecfg = EngineConfig(num_blocks=2048, page_size=16, scheduler=SchedulerConfig(max_running=max(batches)))
    out = Path(args.out or HERE / "results" / ("cpu_spec.json" if args.spec else "cpu_decode.json"))
    spec = SpeculationParams(drafter="draft", tree=(2, 2, 2, 1)) if args.spec else SpeculationParams(enabled=False)
    llm = LLM.load(LoadConfig(device="cpu", draft="auto" if args.spec else "none"), ecfg,
                   log=lambda msg: print(msg, file=sys.stderr))
    rows = []
    for b in batches:
        ps = [prompts[i % len(prompts)] for i in range(b)]
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     SpeculationParams(enabled=False))  # their prefill, untimed: both arms find it cached
        runs: dict[str, list[float]] = {a: [] for a in ARMS}
        tokens: dict[str, list[list[int]]] = {}
        accepted: dict[str, float] = {}
        for _ in range(args.repeats):
            for arm, batched in ARMS.items():
                tok_s, tokens[arm], accepted[arm] = run(llm, ps, args.max_tokens, batched, spec)
                runs[arm].append(tok_s)
        same = sum(x == y for a, b2 in zip(tokens["batched"], tokens["reference"]) for x, y in zip(a, b2))
        row = {"batch": b, "batched_tok_s": round(max(runs["batched"]), 2),
               "reference_tok_s": round(max(runs["reference"]), 2),
               "speedup": round(max(runs["batched"]) / max(runs["reference"]), 3),
               "token_agreement": round(same / sum(map(len, tokens["batched"])), 4),
               "mean_accepted_length": {a: round(m, 3) for a, m in accepted.items()},
               "runs_tok_s": {a: [round(t, 2) for t in r] for a, r in runs.items()}}
        rows.append(row)
        print(row, flush=True)
    paged_decode.BATCHED_CPU = True
    res = {"device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
           "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "torch": torch.__version__,
           "model": "smollm2-135m-instruct (embedded, its own Q4_1 weights), float32 activations",
           "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
           "speculation": "shipped draft, tree 2,2,2,1" if args.spec else "off",
           "note": ("Greedy, MT-bench first turns (prompt i of the batch is turn 1 of question "
                    "i). The arms alternate within each repeat; tok/s is the best repeat's output tokens over its "
                    "wall time, prefill excluded (each batch's prompts are prefilled once before timing).")}
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([x - 0.2 for x in xs], [r["reference_tok_s"] for r in rows], width=0.4, label="one sequence at a time")
    ax.bar([x + 0.2 for x in xs], [r["batched_tok_s"] for r in rows], width=0.4, label="batched")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["batched_tok_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    ax.set_title(f"CPU attention paths, speculation {res.get('speculation', 'off')}, {res['device']}, {res['date']}, "
                 f"{res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
