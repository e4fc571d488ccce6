"""Decoding on the CPU with one of its execution paths switched on and off: by default the batched attention
paths against the one-sequence-at-a-time reference, with ``--switch linear`` the projections' ``cpu_linear``
against ``F.linear``, with ``--switch linear_auto`` each weight shape's form timed on this machine
(``CPU_LINEAR = "auto"``, the default) against ``cpu_linear`` everywhere, with ``--switch invariant`` the
batch-invariant mode against the default, with ``--switch int4`` the INT4 projections through torch's CPU
INT4 kernel (``target.model.CPU_INT4``) against the float32 copy, with ``--switch plan`` the tree path's rows
and masks shared by a forward's layers (``tree_attention.CPU_PLAN_CACHE``) against built in every layer.

    python bench/cpu_decode.py [--switch attention|linear|linear_auto|invariant|int4|plan]
                               [--batches 1,8,32] [--max-tokens 64]
                               [--repeats 2] [--spec [--drafter draft] [--tree 2,2,2,1]]
                               [--out bench/results/cpu_decode.json]

Plain decoding by default; ``--spec`` drafts with ``--drafter`` (the shipped draft), tree ``--tree``, so the
target's steps verify trees (``tree_attention_batched``) and the draft's run its own decode and tree steps.

The embedded SmolLM2 target (its own Q4_1 weights, float32 activations) generates greedily, speculation off,
MT-bench first turns, at each batch size; the two arms (``kernels.paged_decode.BATCHED_CPU`` or
``target.model.CPU_LINEAR``) alternate within each repeat, and each is reported at its best repeat, so every
ratio is within one run.
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
from kernels import invariant, paged_decode, tree_attention  # noqa: E402
from target import model as target_model  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"
# --switch: (the arms' names, on first, and what switches them)
SWITCHES = {"attention": (("batched", "reference"), lambda on: setattr(paged_decode, "BATCHED_CPU", on)),
            "linear": (("cpu_linear", "f_linear"), lambda on: setattr(target_model, "CPU_LINEAR", on)),
            # each shape's form timed on this machine (the default) against cpu_linear everywhere
            "linear_auto": (("measured", "cpu_linear"),
                            lambda on: setattr(target_model, "CPU_LINEAR", "auto" if on else True)),
            # the batch-invariant mode (its projections' chunked form, invariant_attention_ref) against the default
            "invariant": (("invariant", "default"), lambda on: invariant.set_enabled(on)),
            # oneDNN's prepacked form among those time_cpu_forms measures, against the two others alone: main
            # measures both tables after load and this switch swaps them in
            "onednn": (("onednn", "two_forms"), None),
            # the INT4 projections through torch's CPU INT4 kernel (bfloat16 activations) or the float32 copy
            "int4": (("cpu_int4", "float32"), lambda on: setattr(target_model, "CPU_INT4", on)),
            # the tree path's rows and masks built once per forward and shared by its layers, or in every layer
            "plan": (("shared_plan", "per_layer"), lambda on: setattr(tree_attention, "CPU_PLAN_CACHE", on))}


def run(llm: LLM, prompts: list[str], max_tokens: int, spec: SpeculationParams) -> tuple[float, list[list[int]], float]:
    """Output tokens per second of one ``generate`` over ``prompts``, the tokens, and the mean accepted length."""
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
    ap.add_argument("--spec", action="store_true", help="draft with --drafter, tree --tree")
    ap.add_argument("--tree", default="2,2,2,1", help="with --spec: the tree's widths per depth")
    ap.add_argument("--drafter", default="draft", help="with --spec: draft (the shipped draft), hybrid, ngram")
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="attention")
    ap.add_argument("--out", default=None, help="default bench/results/cpu_decode.json, cpu_spec.json with --spec")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts_file)]
    ecfg = EngineConfig(num_blocks=2048, page_size=16, scheduler=SchedulerConfig(max_running=max(batches)))
    out = Path(args.out or HERE / "results" / ("cpu_spec.json" if args.spec else "cpu_decode.json"))
    tree = tuple(int(w) for w in args.tree.split(","))
    spec = SpeculationParams(drafter=args.drafter, tree=tree) if args.spec else SpeculationParams(enabled=False)
    (on, off), switch = SWITCHES[args.switch]
    if args.switch == "int4":
        target_model.CPU_INT4 = True  # the CPU INT4 form is built at load
    llm = LLM.load(LoadConfig(device="cpu", draft="auto" if args.spec else "none"), ecfg,
                   log=lambda msg: print(msg, file=sys.stderr))
    if args.switch == "onednn":
        switch = onednn_switch(llm)
    rows = []
    for b in batches:
        ps = [prompts[i % len(prompts)] for i in range(b)]
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     SpeculationParams(enabled=False))  # their prefill, untimed: both arms find it cached
        runs: dict[str, list[float]] = {on: [], off: []}
        tokens: dict[str, list[list[int]]] = {}
        accepted: dict[str, float] = {}
        for _ in range(args.repeats):
            for arm in (on, off):
                switch(arm == on)
                tok_s, tokens[arm], accepted[arm] = run(llm, ps, args.max_tokens, spec)
                runs[arm].append(tok_s)
        switch(args.switch != "invariant")  # the default: each switch's first arm, but the invariant mode's
        same = sum(x == y for a, b2 in zip(tokens[on], tokens[off]) for x, y in zip(a, b2))
        row = {"batch": b, f"{on}_tok_s": round(max(runs[on]), 2), f"{off}_tok_s": round(max(runs[off]), 2),
               "speedup": round(max(runs[on]) / max(runs[off]), 3),
               "token_agreement": round(same / sum(map(len, tokens[on])), 4),
               "mean_accepted_length": {a: round(m, 3) for a, m in accepted.items()},
               "runs_tok_s": {a: [round(t, 2) for t in r] for a, r in runs.items()}}
        rows.append(row)
        print(row, flush=True)
    res = {"switch": args.switch, "arms": [on, off],"device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
           "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "torch": torch.__version__,
           "model": "smollm2-135m-instruct (embedded, its own Q4_1 weights), float32 activations",
           "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
           "speculation": f"{args.drafter}, tree {args.tree}" if args.spec else "off",
           "note": ("Greedy, MT-bench first turns (prompt i of the batch is turn 1 of question "
                    "i). The arms alternate within each repeat; tok/s is the best repeat's output tokens over its "
                    "wall time, prefill excluded (each batch's prompts are prefilled once before timing).")}
    out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, out.with_suffix(".png"))


def onednn_switch(llm: LLM):
    """The measured form tables without and with oneDNN's (the packed copies stay on their Linears: the
    two-form table never names them), and a switch that puts one or the other in force."""
    from draft.model_drafter import ModelDrafter

    eng = llm.engine
    models = [eng.target] + [d.model for d in eng.drafters.values() if isinstance(d, ModelDrafter)]
    tables = {}
    for with_onednn in (False, True):
        target_model.CPU_ONEDNN = with_onednn
        target_model._CPU_FORMS.clear()
        print(f"forms {'with' if with_onednn else 'without'} oneDNN:", target_model.time_cpu_forms(models),
              file=sys.stderr)
        tables[with_onednn] = dict(target_model._CPU_FORMS)

    def switch(on: bool) -> None:
        target_model._CPU_FORMS.clear()
        target_model._CPU_FORMS.update(tables[on])

    return switch


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    on, off = res.get("arms", ["batched", "reference"])
    labels = {"reference": "one sequence at a time", "f_linear": "F.linear"}
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([x - 0.2 for x in xs], [r[f"{off}_tok_s"] for r in rows], width=0.4, label=labels.get(off, off))
    ax.bar([x + 0.2 for x in xs], [r[f"{on}_tok_s"] for r in rows], width=0.4, label=on)
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r[f"{on}_tok_s"], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    ax.set_title(f"CPU {res.get('switch', 'attention')} paths, speculation {res.get('speculation', 'off')}, {res['device']}, {res['date']}, "
                 f"{res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
