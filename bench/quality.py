"""INT4 (W4A16 RTN) against the dense model on the embedded SmolLM2: perplexity over a fixed text and
agreement of greedy tokens (teacher-forced top-1, and free-running common prefix).

    python bench/quality.py [--model DIR] [--out bench/results/int4_quality.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gateway.llm import LoadConfig, resolve_model_path
from target.batch import Segment, build_batch
from target.loader import load_checkpoint
from target.model import Transformer

HERE = Path(__file__).resolve().parent


def logits_over(model: Transformer, ids: list[int]) -> torch.Tensor:
    """[T, V] next-token logits for every position of ``ids`` in one prefill."""
    cache = model.new_cache(-(-len(ids) // 16) + 1, 16)
    batch = build_batch([Segment(cache.new_table(), 0, ids, logits="all")], cache, model.device)
    return model.forward(batch, cache)


def pydoc_text() -> str:
    """English prose shipped with CPython (``pydoc_data.topics``, PSF licence): every topic in sorted key order,
    joined by blank lines. Fixed for a given Python version (the topics change between releases)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def perplexity_ids(spec: str, encode: Callable[[str], list[int]],
                   max_tokens: int) -> tuple[list[int], str]:
    """The held-out token ids for ``spec`` (``pydoc``, or ``file:PATH``), cut to the first ``max_tokens``, and a
    description of where they came from. The whole text is tokenized before the cut, so the ids are a prefix of
    its tokenization."""
    if spec == "pydoc":
        text, name = pydoc_text(), f"pydoc_data.topics (Python {platform.python_version()})"
    elif spec.startswith("file:"):
        text, name = Path(spec.removeprefix("file:")).read_text(), spec.removeprefix("file:")
    else:
        raise ValueError(f"unknown perplexity text {spec!r}: 'pydoc' or 'file:PATH'")
    ids = encode(text)
    if spec == "pydoc" and len(ids) < max_tokens:
        raise ValueError(f"pydoc text has {len(ids)} tokens, fewer than the {max_tokens} asked for")
    return ids[:max_tokens], name


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Sliding windows over ``n`` tokens: ``(begin, end, first)`` runs ``ids[begin:end]`` and scores targets
    ``first .. end - 1`` (each predicted from the logits one position earlier). Every target 1 .. n - 1 is scored
    exactly once; after the first window each has at least ``window - stride`` tokens of left context. Windows
    must overlap (stride < window): a window's first scored target is predicted from the token before it."""
    if not 0 < stride < window:
        raise ValueError(f"need 0 < stride < window, got window {window}, stride {stride}")
    out, begin, first = [], 0, 1
    while first < n:
        end = min(begin + window, n)
        out.append((begin, end, first))
        begin, first = begin + stride, end
    return out


def windowed_log_probs(model: Transformer, ids: list[int], window: int = 1024, stride: int = 512,
                       logits: Callable[[list[int]], torch.Tensor] | None = None,
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per window of ``windows``: fp32 next-token log-probs ``[k, V]`` of its scored targets, and the targets
    ``[k]``. Each window is its own prefill from position 0: ``logits(ids)`` ``[T, V]`` (default
    ``logits_over(model, ids)``)."""
    logits = logits or (lambda w: logits_over(model, w))
    for begin, end, first in windows(len(ids), window, stride):
        lg = logits(ids[begin:end]).float()[first - 1 - begin : end - 1 - begin]
        yield lg.log_softmax(-1), torch.tensor(ids[first:end])


def windowed_nll(model: Transformer, ids: list[int], window: int = 1024, stride: int = 512) -> tuple[float, int]:
    """Summed negative log-likelihood (fp64 sum) of targets 1 .. len(ids) - 1 over sliding windows, and their
    count; perplexity is ``exp(nll / count)``."""
    nll, count = 0.0, 0
    for lp, tgt in windowed_log_probs(model, ids, window, stride):
        nll -= float(lp.gather(-1, tgt[:, None]).double().sum())
        count += len(tgt)
    return nll, count


def greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(-(-(len(ids) + n) // 16) + 1, 16)
    table = cache.new_table()
    out, ctx, feed = [], 0, list(ids)
    for _ in range(n):
        logits = model.forward(build_batch([Segment(table, ctx, feed)], cache, model.device), cache)
        ctx += len(feed)
        feed = [int(logits[-1].argmax())]
        out += feed
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "int4_quality.json"))
    ap.add_argument("--gen-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.manual_seed(0)
    ck = load_checkpoint(resolve_model_path(LoadConfig(model=args.model)), torch.float32)
    ids = ck.tokenizer.encode((HERE / "data" / "ppl_text.txt").read_text())
    prompts = [json.loads(l)["turns"][0] for l in (HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl").open()][:8] \
        if (HERE.parent.parent / "shared").exists() else ["Explain how a CPU cache works."]
    dense = Transformer.from_weights(ck.config, ck.weights, torch.float32)
    variants = {"dense_fp32": dense, "dense_bf16": Transformer.from_weights(ck.config, ck.weights, torch.bfloat16)}
    for g in (128, 64, 32):
        variants[f"int4_g{g}"] = dense.quantize(g)
    ref_logits = logits_over(dense, ids)
    ref_top1 = ref_logits[:-1].argmax(-1)
    enc = [ck.tokenizer.encode(ck.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                                 add_generation_prompt=True), add_special_tokens=False)
           for p in prompts]
    ref_gen = [greedy(dense, e, args.gen_tokens) for e in enc]
    rows = []
    for name, m in variants.items():
        lg = logits_over(m, ids).float()
        nll = torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:]))
        agree = float((lg[:-1].argmax(-1) == ref_top1).float().mean())
        gens = ref_gen if m is dense else [greedy(m, e, args.gen_tokens) for e in enc]
        prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(gens, ref_gen)]
        rows.append({"variant": name, "perplexity": round(math.exp(float(nll)), 4), "top1_agreement": round(agree, 4),
                     "greedy_common_prefix_mean": round(sum(prefix) / len(prefix), 2),
                     "greedy_identical_runs": sum(p == args.gen_tokens for p in prefix)})
        print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"date": datetime.date.today().isoformat(), "device": f"cpu ({platform.machine()})", "commit": commit,
           "model": ck.source, "text_tokens": len(ids), "gen_prompts": len(enc), "gen_tokens": args.gen_tokens,
           "note": "the embedded GGUF is itself Q4_1 (group 32); 'dense' is its dequantized float weights",
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
