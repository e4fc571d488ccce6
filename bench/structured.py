"""Structured output on the embedded model: what grammar-aware speculation saves.

A JSON schema forces much of its document (braces, keys, separators), and forbids much of what a drafter
proposes. Forced chains verify the grammar's forced tokens as (part of) the tree (gateway/engine.py
``_forced_chain``); pruning drops the draft nodes the grammar forbids before the target scores them
(``_prune``). One process, greedy, the same prompts per arm: plain decoding, then the n-gram drafter and the
shipped draft with these off and on. Reports tokens per target step, verified nodes (the rows the target
scored), tokens/s, and whether each arm's tokens equal plain decoding's.

    python bench/structured.py [--max-tokens 96] [--batch 4] [--out bench/results/structured_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from gateway.llm import LLM, LoadConfig  # noqa: E402
from verify.grammar import compile_grammar  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["title", "author", "year", "genres", "summary"],
          "properties": {"title": {"type": "string", "maxLength": 40}, "author": {"type": "string", "maxLength": 30},
                         "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                         "genres": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
                         "summary": {"type": "string", "maxLength": 120}}}
PROMPTS = ["Describe a famous novel as JSON.", "Give me a book you would recommend, as JSON.",
           "A classic science fiction book, in JSON.", "Describe a children's book as JSON.",
           "A history book, as JSON.", "Describe a poetry collection as JSON.",
           "A mystery novel, in JSON.", "Describe a book about cooking as JSON."]
NGRAM = SpeculationParams(drafter="ngram", tree=(1, 1, 1, 1))
DRAFT = SpeculationParams(drafter="draft", tree=(2, 2, 2, 1))
# arm: (speculation, forced chains, pruning of forbidden nodes)
ARMS = {"plain": (SpeculationParams(enabled=False), True, True),
        "ngram": (NGRAM, False, False), "ngram+pruned": (NGRAM, False, True),
        "ngram+pruned+forced": (NGRAM, True, True),
        "draft": (DRAFT, False, False), "draft+pruned+forced": (DRAFT, True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured_cpu.json"))
    args = ap.parse_args()
    llm = LLM.load(LoadConfig(), log=lambda m: None)  # the shipped draft and the n-gram drafter
    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=compile_grammar("json", SCHEMA))
    llm.generate(PROMPTS[:2], sampling)  # warm-up: the grammar tokenizer, first-use costs
    rows, tokens_by_arm = [], {}
    for name, (spec, chains, pruning) in ARMS.items():
        llm.engine.config = replace(llm.engine.config, forced_chains=chains, grammar_pruning=pruning)
        gens, seconds = [], 0.0
        for lo in range(0, len(PROMPTS), args.batch):
            t0 = time.perf_counter()
            gens += llm.generate(PROMPTS[lo : lo + args.batch], sampling, spec)
            seconds += time.perf_counter() - t0
        tokens = sum(len(g.token_ids) for g in gens)
        steps = sum(g.stats.steps for g in gens)
        tokens_by_arm[name] = [g.token_ids for g in gens]
        valid = sum(_parses(g.text) for g in gens)
        rows.append({"arm": name, "tokens": tokens, "target_steps": steps, "tokens_per_step": round(tokens / steps, 3),
                     "verified_nodes": sum(g.stats.verified_nodes for g in gens),
                     "tokens_per_s": round(tokens / seconds, 1), "valid_json": valid,
                     "same_tokens_as_plain": tokens_by_arm[name] == tokens_by_arm["plain"]})
        print(rows[-1], flush=True)
    base = next(r for r in rows if r["arm"] == "ngram")
    forced = next(r for r in rows if r["arm"] == "ngram+pruned+forced")
    device = llm.engine.target.device
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    out = {"device": where,
           "date": datetime.date.today().isoformat(), "commit": provenance.commit(),
           "model": "smollm2-135m-instruct (its Q4_1 weights)", "prompts": len(PROMPTS), "batch": args.batch,
           "max_tokens": args.max_tokens, "schema": SCHEMA, "rows": rows,
           "forced_over_ngram_steps": round(base["target_steps"] / forced["target_steps"], 3),
           "forced_over_ngram_tok_s": round(forced["tokens_per_s"] / base["tokens_per_s"], 3),
           "notes": ["One process, one run per arm, greedy; steps are target forwards that emitted tokens (every "
                     "step counts: SpecStats.steps). The steps ratio does not depend on the device; tokens/s "
                     "does (on the CPU a verify step of several nodes costs more than a one-token step: "
                     "ARCHITECTURE.md, The step on the CPU)."]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k not in ("schema", "rows")}, indent=2))


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [r["arm"] for r in res["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    a.bar(arms, [r["tokens_per_step"] for r in res["rows"]])
    a.set_ylabel("tokens per target step")
    b.bar(arms, [r["tokens_per_s"] for r in res["rows"]])
    b.set_ylabel("tokens/s")
    fig.suptitle(f"JSON schema output, {res['model']}, {res['device']}, {res['date']}, {res['commit']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
