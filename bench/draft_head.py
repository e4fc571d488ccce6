"""What cutting the draft's head to its target's most frequent tokens (FR-Spec, draft/vocab.py) buys: the
draft's forward cost against the target's, mean accepted length and end-to-end tokens/s, for each head size,
beside the plain and n-gram arms, in one process on MT-bench first turns (held out: the draft and its token
counts come from draft/data's prompt lists).

    python bench/draft_head.py [--ks 0,16384,8192,4096] [--batch 8] [--prompts 16] [--max-tokens 64]
                               [--device cpu] [--out bench/results/draft_head_cpu.json]

K = 0 is the whole head. Every arm shares the loaded draft's weights and the engine; each cut arm is the
shipped draft with its own cut head and KV cache. Arm ``draft-host`` is the whole-head draft with its trees
grown level by level from the host instead of in the device loops (``draft/tree_loop.py``). The arms
alternate within each of ``--repeats`` rounds, and tokens/s is the best round's (each generation's prefill
included, as a client sees it).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from bench.drafters import forward_seconds  # noqa: E402
from draft.hybrid import HybridDrafter  # noqa: E402
from draft.model_drafter import ModelDrafter  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from gateway.budget import BudgetConfig  # noqa: E402
from gateway.engine import EngineConfig  # noqa: E402
from gateway.llm import LLM, LoadConfig, draft_head_vocab, resolve_draft  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="0,16384,8192,4096", help="head sizes; 0 = the whole vocabulary")
    ap.add_argument("--prompts-file", default=str(MT_BENCH))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tree", default="2,2,2,1")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                    help="also each head as the hybrid drafter (its tree plus a prompt-lookup branch)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_head_cpu.json"))
    args = ap.parse_args()
    tree = tuple(int(x) for x in args.tree.split(","))
    qs = [json.loads(line)["turns"][0] for line in open(args.prompts_file)][: args.prompts]
    most = args.batch * (1 + sum(tree))
    # whole fixed trees: every depth kept (min_gain 0) and the verify cap above a batch of whole trees
    ecfg = EngineConfig(scheduler=SchedulerConfig(max_step_tokens=max(1024, most), budget=BudgetConfig(
        min_gain=0.0, max_verify_tokens=max(64, most))))
    llm = LLM.load(LoadConfig(device=args.device, dtype=args.dtype, draft="auto", draft_vocab=0), ecfg,
                   log=lambda m: print(m, file=sys.stderr))
    engine = llm.engine
    base = engine.drafters["draft"]
    V = base.model.config.vocab_size
    arms: dict[str, int] = {}
    for k in (int(x) for x in args.ks.split(",")):
        name = "draft" if k in (0, V) else f"draft-k{k}"
        if name != "draft":  # the loader's own cut (raises when the shipped draft has no token counts)
            ids = draft_head_vocab(resolve_draft(LoadConfig()), llm.loaded.checkpoint, k)
            engine.drafters[name] = ModelDrafter(name, base.model, ecfg.num_blocks, ecfg.page_size,
                                                 ecfg.cuda_graphs, ecfg.scheduler.max_model_len, ids)
        arms[name] = k or V
        if args.hybrid:
            engine.drafters["hybrid" + name[5:]] = HybridDrafter("hybrid" + name[5:], engine.drafters[name])
            arms["hybrid" + name[5:]] = k or V
    engine.capture_graphs()
    cuda = engine.target.device.type == "cuda"
    target_s = forward_seconds(engine.target, batch=args.batch, graphs=cuda)
    cost = {name: round(forward_seconds(engine.drafters[name].model, batch=args.batch, graphs=cuda) / target_s, 4)
            for name in arms if name.startswith("draft")}
    print({"target_forward_ms": round(target_s * 1e3, 2), "draft_cost_ratio": cost}, flush=True)
    for i in range(0, len(qs), args.batch):  # untimed: every prompt's prefill shapes meet their kernels once
        llm.generate(qs[i : i + args.batch], SamplingParams(temperature=0, max_tokens=2), SpeculationParams(enabled=False))
    specs = {"off": SpeculationParams(enabled=False), "ngram": SpeculationParams(drafter="ngram", tree=tree)}
    specs |= {name: SpeculationParams(drafter=name, tree=tree) for name in arms}
    # the whole-head draft with its trees grown level by level from the host (the builder the device loops
    # replaced), against the same draft's device loops: the loops' gain within one run
    specs["draft-host"] = SpeculationParams(drafter="draft", tree=tree)
    temps = [float(t) for t in args.temperatures.split(",")]
    runs: dict[tuple[str, float], list[float]] = {}
    stats: dict[tuple[str, float], tuple[int, int]] = {}
    outputs: dict[tuple[str, float], list[list[int]]] = {}
    for _ in range(args.repeats):
        for temp in temps:
            sampling = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0)
            for name, spec in specs.items():
                base.device_loop = name != "draft-host"
                t0 = time.perf_counter()
                gens = [g for i in range(0, len(qs), args.batch)
                        for g in llm.generate(qs[i : i + args.batch], sampling, spec)]
                runs.setdefault((name, temp), []).append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0))
                stats[(name, temp)] = (sum(g.stats.steps for g in gens), sum(g.stats.accepted_tokens for g in gens))
                outputs[(name, temp)] = [g.token_ids for g in gens]
                print(name, temp, round(runs[(name, temp)][-1], 2), flush=True)
    rows = []
    for (name, temp), tok_s in runs.items():
        steps, acc = stats[(name, temp)]
        best = max(tok_s)
        head = "draft" if name == "draft-host" else name  # the model arm whose head and cost it shares
        rows.append({"drafter": name, "head_tokens": arms.get(head), "temperature": temp,
                     "tree": [] if name == "off" else list(tree),
                     "mean_accepted_length": round((acc + steps) / steps, 4),
                     "draft_cost_ratio": cost.get(head) or cost.get("draft" + head[6:]) if head in arms else None,
                     "tokens_per_s": round(best, 2), "runs_tok_s": [round(x, 2) for x in tok_s],
                     "speedup_vs_off": round(best / max(runs[("off", temp)]), 3),
                     "identical_to_off": None if temp > 0 else sum(
                         a == b for a, b in zip(outputs[(name, temp)], outputs[("off", temp)]))})
        print(rows[-1], flush=True)
    dev = ("cuda " + torch.cuda.get_device_name()) if cuda else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    res = {"date": datetime.date.today().isoformat(), "device": dev, "commit": provenance.commit(),
           "torch": torch.__version__, "model": "smollm2-135m-instruct (embedded, its own Q4_1 weights)",
           "draft": "shipped (draft/weights), token counts from its token_counts.json", "vocab": V,
           "prompts": len(qs), "batch": args.batch, "max_tokens": args.max_tokens, "repeats": args.repeats,
           "target_forward_ms": round(target_s * 1e3, 3), "rows": rows,
           "note": ("draft_cost_ratio: median decode forward (batch as given, 1 token each after 128 cached) of the "
                    "draft with that head over the target's" + (", both replayed from CUDA graphs" if cuda else "")
                    + ". tokens_per_s: the best round's output tokens over wall time (prefill included); ratios are "
                    "within this run. identical_to_off: prompts whose greedy output equals the plain arm's "
                    "(T>0: not compared).")}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    """Tokens/s per arm and temperature, with mean accepted length on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["drafter"] for r in res["rows"]))
    temps = sorted({r["temperature"] for r in res["rows"]})
    fig, ax = plt.subplots(figsize=(9, 3.8))
    w = 0.8 / len(temps)
    for j, t in enumerate(temps):
        by = {r["drafter"]: r for r in res["rows"] if r["temperature"] == t}
        xs = [i + j * w for i in range(len(names))]
        bars = ax.bar(xs, [by[n]["tokens_per_s"] for n in names], w, label=f"T={t}")
        for b, n in zip(bars, names):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{by[n]['mean_accepted_length']:.2f}",
                    ha="center", va="bottom", fontsize=6)
    ax.set_xticks([i + w * (len(temps) - 1) / 2 for i in range(len(names))], names, fontsize=7, rotation=20)
    ax.set_ylabel("tokens / s (label: accepted length)")
    ax.set_title(f"Draft head cut (FR-Spec), batch {res['batch']}, {res['device']}, {res['date']}, "
                 f"{res['commit'].split()[0]}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
