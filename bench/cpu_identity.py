"""Greedy speculative output against plain decoding on the CPU, embedded SmolLM2, with the INT4 projections on
the float32 copy and through torch's CPU INT4 kernel (``target.model.CPU_INT4``, bfloat16 activations).

Each arm loads the model once and generates MT-bench first turns greedily at batch 8, plain and with each
drafter; a prompt counts as identical when every token matches plain decoding's. Plain decoding of the first
prompts alone (batch 1) against the batch of 8 checks that a row's output does not depend on its neighbours.

    python bench/cpu_identity.py --out bench/results/cpu_identity.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import provenance  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from gateway.engine import EngineConfig  # noqa: E402
from gateway.llm import LLM, LoadConfig  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from target import model as target_model  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"
SPECS = {"ngram 2,2,1": SpeculationParams(drafter="ngram", tree=(2, 2, 1)),
         "draft 2,2,2,1": SpeculationParams(drafter="draft", tree=(2, 2, 2, 1)),
         "hybrid 2,2,1": SpeculationParams(drafter="hybrid", tree=(2, 2, 1))}


def arm(prompts: list[str], max_tokens: int) -> dict:
    llm = LLM.load(LoadConfig(device="cpu", draft="auto"),
                   EngineConfig(num_blocks=2048, page_size=16, scheduler=SchedulerConfig(max_running=len(prompts))),
                   log=lambda m: None)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = [g.token_ids for g in llm.generate(prompts, greedy, SpeculationParams(enabled=False))]
    out = {"plain_tokens": plain, "speculative": {}}
    for name, spec in SPECS.items():
        gens = llm.generate(prompts, greedy, spec)
        out["speculative"][name] = {"identical_prompts": sum(g.token_ids == p for g, p in zip(gens, plain)),
                                    "mean_accepted_length": round(sum(g.stats.mean_accepted_length for g in gens)
                                                                  / len(gens), 3)}
    alone = [llm.generate([p], greedy, SpeculationParams(enabled=False))[0].token_ids for p in prompts[:3]]
    out["batch1_vs_batch8_identical"] = sum(a == p for a, p in zip(alone, plain))
    return out


def plot(report: dict, path: Path) -> None:
    """Prompts whose speculative output matches plain decoding, per drafter, for each arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    names = list(SPECS)
    for i, (arm, res) in enumerate(report["arms"].items()):
        ax.bar([j + 0.4 * i for j in range(len(names))], [res["speculative"][n]["identical_prompts"] for n in names],
               width=0.4, label=arm)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names)
    ax.set_ylabel(f"prompts identical (of {report['prompts']})")
    ax.set_title(f"greedy speculative vs plain on the CPU, {report['commit']} ({report['date']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts-file", default=str(MT_BENCH))
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, help="only draw this results JSON's PNG beside it")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    prompts = [json.loads(line)["turns"][0] for line in open(args.prompts_file)][: args.prompts]
    arms = {}
    for name, on in (("float32", False), ("cpu_int4", True)):
        target_model.CPU_INT4 = on
        arms[name] = arm(prompts, args.max_tokens)
        print(name, {k: v for k, v in arms[name].items() if k != "plain_tokens"}, flush=True)
    f, i = arms["float32"]["plain_tokens"], arms["cpu_int4"]["plain_tokens"]
    same = sum(x == y for a, b in zip(f, i) for x, y in zip(a, b)) / sum(map(len, f))
    print("plain decoding, cpu_int4 vs float32, tokens at the same position that agree:", round(same, 4))
    if args.out:
        for a in arms.values():
            a.pop("plain_tokens")
        Path(args.out).write_text(json.dumps({
            "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
            "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "torch": torch.__version__,
            "prompts": len(prompts), "max_tokens": args.max_tokens, "batch": len(prompts), "arms": arms,
            "plain_token_agreement_int4_vs_float32": round(same, 4),
            "command": "python bench/cpu_identity.py " + " ".join(sys.argv[1:])}, indent=1) + "\n")
        plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
