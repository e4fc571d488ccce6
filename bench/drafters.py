"""Mean accepted length and tokens/s of each drafter on the embedded model, MT-bench first turns.

    python bench/drafters.py [--prompts 8] [--max-tokens 64] [--batch 1] [--out bench/results/drafters.json]

Every arm runs in this one process on the same prompts; tokens/s ratios are taken within the run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from draft.params import SpeculationParams
from gateway.llm import LLM, LoadConfig
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
    ap.add_argument("--arms", default="off,self,ngram")
    ap.add_argument("--tree", default="2,2,2,1")
    ap.add_argument("--out", default=str(HERE / "results" / "drafters.json"))
    args = ap.parse_args()
    tree = tuple(int(x) for x in args.tree.split(","))
    qs = [json.loads(l)["turns"][0] for l in open(args.prompts_file)][: args.prompts]
    llm = LLM.load(LoadConfig(model=args.model, quantize=args.quantize), log=lambda m: None)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(qs[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    rows, ref = [], None
    for arm in args.arms.split(","):
        spec = SpeculationParams(enabled=False) if arm == "off" else SpeculationParams(drafter=arm, tree=tree)
        t0, gens = time.perf_counter(), []
        for i in range(0, len(qs), args.batch):
            gens += llm.generate(qs[i : i + args.batch], greedy, spec)
        secs = time.perf_counter() - t0
        toks = sum(len(g.token_ids) for g in gens)
        steps = sum(g.stats.steps for g in gens)
        acc = sum(g.stats.accepted_tokens for g in gens)
        ref = ref or [g.token_ids for g in gens]
        rows.append({"arm": arm, "tree": None if arm == "off" else list(tree), "tokens": toks, "steps": steps,
                     "drafted_tokens": sum(g.stats.drafted_tokens for g in gens), "accepted_tokens": acc,
                     "mean_accepted_length": round((acc + steps) / steps, 4), "seconds": round(secs, 2),
                     "tokens_per_s": round(toks / secs, 2),
                     "identical_to_first_arm": sum(g.token_ids == r for g, r in zip(gens, ref))})
        print(rows[-1], flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_first_arm"] = round(r["tokens_per_s"] / base, 3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dev = "cuda " + torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    Path(args.out).write_text(json.dumps({
        "date": datetime.date.today().isoformat(), "device": dev, "commit": commit, "quantize": args.quantize,
        "prompts": len(qs), "max_tokens": args.max_tokens, "batch": args.batch, "temperature": 0,
        "self_draft_layers": llm.engine.drafters["self"].model.num_layers, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
