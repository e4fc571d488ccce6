"""Mean accepted length and tokens/s of each drafter on the embedded model, MT-bench first turns.

    python bench/drafters.py [--prompts 8] [--max-tokens 64] [--batch 1] [--out bench/results/drafters.json]
    python bench/drafters.py --sweep [--arms draft,self,ngram] [--temperatures 0,0.7] [--trees 1,1,1,1/2,2,2,1]

Every arm runs in this one process on the same prompts; tokens/s ratios are taken within the run. Arm
"draft" is the distilled draft shipped for the embedded model (``LoadConfig.draft="auto"``). ``--sweep``
writes bench/results/drafts.json: mean accepted length per drafter x tree x temperature with fixed trees
(the adaptive depth budget off), and each model drafter's forward cost relative to the target's.
MT-bench is evaluation only: the draft was distilled on draft/data/distill_prompts.txt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

import provenance
from draft.params import SpeculationParams
from gateway.budget import BudgetConfig
from gateway.engine import EngineConfig
from gateway.llm import LLM, LoadConfig
from gateway.scheduler import SchedulerConfig
from target.batch import Segment, build_batch
from target.graphs import CudaGraphRunner
from target.model import Transformer
from verify.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts-file", default=str(MT_BENCH))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--arms", default="off,self,ngram",
                    help="off, a drafter, or ngram-alone (the n-gram drafter without its table of the target's text)")
    ap.add_argument("--tree", default="2,2,2,1",
                    help="widths per depth, kept whole; auto: the engine's default template, cut by the adaptive budget")
    ap.add_argument("--out", default=str(HERE / "results" / "drafters.json"))
    ap.add_argument("--sweep", action="store_true", help="drafter x tree x temperature table -> drafts.json")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--trees", default="1,1,1,1/2,2,2,1")
    ap.add_argument("--draft", default="auto", help="draft model directory for arm 'draft' (auto = the shipped one)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the draft's head cut to K tokens (LoadConfig.draft_vocab; 0: whole; default: the draft's own)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--whole-trees", action=argparse.BooleanOptionalAction, default=True,
                    help="--sweep: lift the global verify cap so every tree is verified whole")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT's PNG from OUT's JSON (a --sweep file)")
    args = ap.parse_args()
    if args.plot_only:
        return plot_sweep(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
    if args.sweep:
        return sweep(args, [json.loads(l)["turns"][0] for l in open(args.prompts_file)][: args.prompts])
    tree = None if args.tree == "auto" else tuple(int(x) for x in args.tree.split(","))
    qs = [json.loads(l)["turns"][0] for l in open(args.prompts_file)][: args.prompts]
    llm = LLM.load(LoadConfig(model=args.model, quantize=args.quantize), log=lambda m: None)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(qs[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    rows, ref = [], None
    table = llm.engine.drafters["ngram"].table
    for arm in args.arms.split(","):
        drafter = select_arm(llm, arm, table)
        spec = (SpeculationParams(enabled=False) if arm == "off" else SpeculationParams(drafter=drafter)
                if tree is None else SpeculationParams(drafter=drafter, tree=tree))
        t0, gens = time.perf_counter(), []
        for i in range(0, len(qs), args.batch):
            gens += llm.generate(qs[i : i + args.batch], greedy, spec)
        secs = time.perf_counter() - t0
        toks = sum(len(g.token_ids) for g in gens)
        steps = sum(g.stats.steps for g in gens)
        acc = sum(g.stats.accepted_tokens for g in gens)
        ref = ref or [g.token_ids for g in gens]
        rows.append({"arm": arm, "tree": None if arm == "off" else list(tree) if tree else "adaptive", "tokens": toks,
                     "steps": steps,
                     "drafted_tokens": sum(g.stats.drafted_tokens for g in gens), "accepted_tokens": acc,
                     "mean_accepted_length": round((acc + steps) / steps, 4), "seconds": round(secs, 2),
                     "tokens_per_s": round(toks / secs, 2),
                     "identical_to_first_arm": sum(g.token_ids == r for g, r in zip(gens, ref))})
        print(rows[-1], flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_first_arm"] = round(r["tokens_per_s"] / base, 3)
    commit = provenance.commit()
    dev = "cuda " + torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    Path(args.out).write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": dev, "commit": commit, "quantize": args.quantize,
        "prompts": len(qs), "max_tokens": args.max_tokens, "batch": args.batch, "temperature": 0,
        "self_draft_layers": llm.engine.drafters["self"].model.num_layers, "rows": rows}, indent=2))


NGRAM_ALONE = "ngram-alone"  # the n-gram drafter without its table of the target's text (draft/ngram.py)


def select_arm(llm: LLM, arm: str, table) -> str:
    """The registered drafter an arm runs, with the n-gram drafter's ``table`` put back or, for
    ``ngram-alone``, taken away (the arm shares the drafter's name, so its step prices and prior too)."""
    llm.engine.drafters["ngram"].table = None if arm == NGRAM_ALONE else table
    return "ngram" if arm == NGRAM_ALONE else arm


def forward_seconds(model: Transformer, context: int = 128, batch: int = 1, reps: int = 20,
                    graphs: bool = False, pipelined: bool = False) -> float:
    """Median seconds of one decode forward (one new token per sequence after ``context`` cached tokens),
    eager or replayed from a CUDA graph (``graphs``, CUDA only). Each forward is timed alone, from a
    synchronised start to its synchronised end (host work, copies and the sync's latency included);
    with ``pipelined`` it is the mean of ``reps`` forwards launched back to back and synchronised once:
    the device's time per forward, as inside the draft's tree loop (one graph for every level)."""
    cache = model.new_cache(batch * (context // 16 + 2), 16)
    tables = [cache.new_table() for _ in range(batch)]
    prompt = list(range(1000, 1000 + context))
    def feats(n: int):  # a feature draft's second input (draft/feature_drafter.py); its values cost nothing
        return None if model.fc is None else torch.zeros(n, model.config.hidden_size, dtype=model.dtype,
                                                         device=model.device)

    model.forward(build_batch([Segment(t, 0, prompt) for t in tables], cache, model.device), cache, feats(batch * context))
    run = CudaGraphRunner(model, cache, context // 16 + 2).forward if graphs else model.forward
    step_feats = feats(batch)

    def forward(b, c):
        return run(b, c, step_feats)
    cuda = model.device.type == "cuda"
    if pipelined:
        segs = [Segment(t, context, [42]) for t in tables]
        batch_ = build_batch(segs, cache, model.device)  # the same token rewritten in place each time
        forward(batch_, cache)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            forward(batch_, cache)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps
    times = []
    for _ in range(reps + 2):
        segs = [Segment(t, context, [42]) for t in tables]
        batch_ = build_batch(segs, cache, model.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward(batch_, cache)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for t in tables:
            t.truncate(context)
    return sorted(times[2:])[reps // 2]


def sweep(args: argparse.Namespace, qs: list[str]) -> None:
    """Mean accepted length per drafter x tree x temperature, plus draft/target forward cost -> drafts.json."""
    # Keep every tree whole: every depth (min_gain 0) and every node. The engine's global verify cap (64
    # tokens a step over the batch) would otherwise cut a batch of 8 trees of 15 nodes to about 8 nodes
    # each, so every template above that size measured a cut tree (drafts.json before this rule).
    most = args.batch * (1 + max(sum(int(x) for x in t.split(",")) for t in args.trees.split("/")))
    fixed = EngineConfig(scheduler=SchedulerConfig(max_step_tokens=max(1024, most), budget=BudgetConfig(
        min_gain=0.0, max_verify_tokens=max(64, most) if args.whole_trees else 64)))
    llm = LLM.load(LoadConfig(model=args.model, quantize=args.quantize, draft=args.draft, device=args.device,
                              dtype=args.dtype, draft_vocab=args.draft_vocab), fixed, log=lambda m: None)
    cuda = llm.engine.target.device.type == "cuda"
    llm.engine.capture_graphs()  # on CUDA: no capture or kernel tuning inside the measured generations
    target_s = forward_seconds(llm.engine.target)
    target_g = forward_seconds(llm.engine.target, graphs=True) if cuda else None
    target_p = forward_seconds(llm.engine.target, graphs=True, pipelined=True, reps=50) if cuda else None
    rows, off_tok_s = [], {}
    for i in range(0, len(qs), args.batch):  # untimed: every prompt's prefill shapes meet their kernels once
        llm.generate(qs[i : i + args.batch], SamplingParams(temperature=0, max_tokens=2), SpeculationParams(enabled=False))
    for temp in (float(t) for t in args.temperatures.split(",")):  # the plain arm: tokens/s to compare against
        sampling = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0)
        t0 = time.perf_counter()
        gens = [g for i in range(0, len(qs), args.batch)
                for g in llm.generate(qs[i : i + args.batch], sampling, SpeculationParams(enabled=False))]
        off_tok_s[temp] = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)
        rows.append({"drafter": "off", "tree": [], "temperature": temp, "mean_accepted_length": 1.0,
                     "tokens_per_s": round(off_tok_s[temp], 1)})
        print(rows[-1], flush=True)
    table = llm.engine.drafters["ngram"].table
    for arm in args.arms.split(","):
        registered = select_arm(llm, arm, table)
        drafter = llm.engine.drafters[registered]
        model = getattr(getattr(drafter, "draft", drafter), "model", None)  # a hybrid costs its draft model
        cost = None if model is None else round(forward_seconds(model) / target_s, 4)
        cost_g = None if model is None or not cuda else round(forward_seconds(model, graphs=True) / target_g, 4)
        cost_p = None if model is None or not cuda else round(
            forward_seconds(model, graphs=True, pipelined=True, reps=50) / target_p, 4)
        for tree_s in args.trees.split("/"):
            tree = tuple(int(x) for x in tree_s.split(","))
            for temp in (float(t) for t in args.temperatures.split(",")):
                sampling = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=0)
                spec = SpeculationParams(drafter=registered, tree=tree)
                lookup_only = getattr(drafter, "lookup_only", 0)
                t0 = time.perf_counter()
                gens = [g for i in range(0, len(qs), args.batch) for g in llm.generate(qs[i : i + args.batch], sampling, spec)]
                tok_s = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)
                steps, acc = sum(g.stats.steps for g in gens), sum(g.stats.accepted_tokens for g in gens)
                name = "feature" if getattr(model, "fc", None) is not None else "distilled"
                rows.append({"drafter": {"draft": name}.get(arm, arm), "tree": list(tree), "temperature": temp,
                             "mean_accepted_length": round((acc + steps) / steps, 4), "draft_cost_ratio": cost,
                             "draft_cost_ratio_graphs": cost_g, "draft_cost_ratio_pipelined": cost_p,
                             "tokens_per_s": round(tok_s, 1), "speedup_vs_off": round(tok_s / off_tok_s[temp], 3)})
                if getattr(drafter, "lookup_first", False):  # request-steps the model sat out
                    rows[-1]["lookup_only_share"] = round((drafter.lookup_only - lookup_only) / steps, 4)
                print(rows[-1], flush=True)
    commit = provenance.commit()
    dev = "cuda " + torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    Path(args.out).write_text(json.dumps({
        "device": dev, "date": datetime.date.today().isoformat(), "dtype": args.dtype, "draft": Path(args.draft).name,
        "commit": commit, "quantize": args.quantize, "prompts": len(qs), "max_tokens": args.max_tokens,
        "batch": args.batch, "target_forward_ms": round(target_s * 1e3, 3),
        "target_forward_ms_graphs": None if target_g is None else round(target_g * 1e3, 3),
        "target_forward_ms_pipelined": None if target_p is None else round(target_p * 1e3, 3),
        "self_draft_layers": llm.engine.drafters["self"].model.num_layers,
        "draft_head_tokens": getattr(llm.engine.drafters.get("draft"), "model", llm.engine.target).logits_width,
        "notes": "draft_cost_ratio: median decode forward (1 token, 128 cached) of the drafter / of the target, "
                 "both eager, each forward synchronised alone; _graphs: both replayed from CUDA graphs; _pipelined: "
                 "graphs, 50 forwards back to back per sync (device time per forward); null for ngram (no model "
                 "forward). Whole fixed trees (adaptive depth budget off, verify cap lifted). Seed 0 at T>0. "
                 "tokens_per_s: the generations' output tokens over their wall time, batch as given; "
                 "speedup_vs_off against the plain arm at the same temperature, same run.",
        "rows": rows}, indent=2) + "\n")


def _tree_label(widths: tuple[int, ...]) -> str:
    """2x2x2x1, or 8^7 for a template of equal widths."""
    if len(widths) > 2 and len(set(widths)) == 1:
        return f"{widths[0]}^{len(widths)}"
    return "x".join(map(str, widths))


def plot_sweep(res: dict, path: Path) -> None:
    """Mean accepted length per drafter x tree, one bar group per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["drafter"] != "off"]
    labels = sorted({(r["drafter"], tuple(r["tree"])) for r in rows}, key=str)
    temps = sorted({r["temperature"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4))
    w = 0.8 / len(temps)
    for k, t in enumerate(temps):
        vals = {(r["drafter"], tuple(r["tree"])): r["mean_accepted_length"] for r in rows if r["temperature"] == t}
        ax.bar([i + k * w for i in range(len(labels))], [vals.get(l, 0) for l in labels], w, label=f"T={t}")
    ax.axhline(2.5, color="k", ls=":", label="target at T=0 (2.5)")
    ax.axhline(2.0, color="tab:orange", ls=":", label="target at T=0.7 (2.0)")
    ax.set_xticks([i + w * (len(temps) - 1) / 2 for i in range(len(labels))],
                  [f"{d}\n{_tree_label(t)}" for d, t in labels], fontsize=8)
    ax.set_ylabel("mean accepted length (tokens / step)")
    ax.set_title(f"Drafters on MT-bench first turns, {res['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
