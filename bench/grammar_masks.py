"""Host time of structured output's per-step work: the masks of one constrained sequence's verified tree.

``verify.grammar.tree_masks`` walks the tree depth-first through the request's llguidance matcher and writes
one bitmask row per node. This times it for trees of 1..32 nodes under a JSON schema, mid-document, with the
embedded model's tokenizer (49,152 tokens), and the one-off costs (grammar tokenizer, matcher).

    python bench/grammar_masks.py [--tokenizer DIR] [--out bench/results/grammar_masks_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from verify.grammar import GrammarTokenizer, compile_grammar, tree_masks  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
PREFIX = '{"name": "Alice Smith", "age": 42, "tags": ["a'


def tree(size: int, true_path: list[int], others: list[int]) -> tuple[list[int], list[int]]:
    """A chain along the true continuation, then siblings spread over its nodes: ``size`` nodes in all."""
    tokens, parents = [0], [-1]
    for t in true_path[: size - 1]:
        tokens.append(t)
        parents.append(len(tokens) - 2)
    chain = len(tokens)
    i = 0
    while len(tokens) < size:
        tokens.append(others[i % len(others)])
        parents.append(i % chain)
        i += 1
    return tokens, parents


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache" / "specgate" / "smollm2-135m-instruct"))
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_masks_cpu.json"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    t0 = time.perf_counter()
    gt = GrammarTokenizer(tok, len(tok))
    build_s = time.perf_counter() - t0
    grammar = compile_grammar("json", SCHEMA)
    t0 = time.perf_counter()
    m = gt.matcher(grammar)
    matcher_ms = (time.perf_counter() - t0) * 1e3
    ids = tok.encode(PREFIX + 'bc", "de"], "x": 1}', add_special_tokens=False)
    cut = len(tok.encode(PREFIX, add_special_tokens=False)) - 1
    assert m.consume_tokens(ids[:cut])
    others = [tok.encode(x, add_special_tokens=False)[0] for x in ["x", "1", ",", "]", "}", " ", "b", "\""]]
    rows = []
    for size in (1, 4, 8, 16, 32):
        tokens, parents = tree(size, ids[cut:], others)
        for _ in range(5):
            tree_masks(m, tokens, parents, gt.words)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            tree_masks(m, tokens, parents, gt.words)
        us = (time.perf_counter() - t0) / args.repeats * 1e6
        rows.append({"nodes": size, "us_per_tree": round(us, 1), "us_per_node": round(us / size, 2)})
    out = {"device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
           "date": datetime.date.today().isoformat(), "commit": provenance.commit(),
           "tokenizer": Path(args.tokenizer).name,
           "vocab": len(tok), "grammar_tokenizer_build_s": round(build_s, 3), "matcher_ms": round(matcher_ms, 3),
           "rows": rows,
           "notes": ["tree_masks of one constrained sequence mid-way through a JSON document (a chain along the "
                     "true continuation, then siblings), mean over --repeats calls; one process, one "
                     "run. The grammar tokenizer is built once per engine; a matcher once per request."]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(json.dumps(out, indent=2))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["nodes"] for r in res["rows"]], [r["us_per_tree"] for r in res["rows"]], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("us per tree (host)")
    ax.set_title(f"grammar masks, JSON schema, vocab {res['vocab']}", fontsize=9)
    fig.suptitle(f"{res['device']}, {res['date']}, {res['commit']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
