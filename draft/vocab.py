"""A draft head over the target's most frequent tokens (FR-Spec).

A draft shares the target's LM head, and at a small model's width that head is most of the draft: SmolLM2's
49,152 x 576 head holds twice the weights of the shipped draft's three layers, and every tree level reads
it. FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling") drafts over the K most frequent tokens only: the head is cut to K rows, and a token
outside them is never proposed. The target still scores every token, so output is unchanged; only
acceptance can fall, when the target's next token lies outside the K.

Frequencies come from the target's own text: ``token_counts.json`` beside the draft's weights counts the
tokens of the target's continuations of the distillation prompts (``draft.distill`` writes it from its
corpus; ``python -m draft.vocab`` samples one for an existing draft, and with ``--write table`` the n-gram
drafter's table of the same text instead, ``draft.ngram.NgramTable``). Tokens are ranked by count, then by
id: a BPE vocabulary's ids follow its merge order, so among tokens never seen the earlier merges, the more
frequent ones in the tokenizer's own corpus, come first. The target's end-of-turn tokens always make the cut.

    python -m draft.vocab --target embedded --out DRAFT_DIR [--num-prompts 768 --max-tokens 128 ...]
    python -m draft.vocab --target embedded --out draft/weights/smollm2-135m-instruct-ngram --write table \
        --prompts draft/data/distill_prompts.txt --skip-every 50 --num-prompts 0 --samples 1 --temperature 0 \
        --quantize int4
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from draft.ngram import TABLE_FILE, NgramTable

COUNTS_FILE = "token_counts.json"
# Tokens a draft with counts keeps by default (gateway.llm.LoadConfig.draft_vocab). With the shipped draft on a
# 2-core CPU (bench/results/draft_head_cpu_b1.json, _b8.json) 8,192 of 49,152 kept the mean accepted length
# within 0.5% at T = 0 and 1.3% at T = 0.7, and cut the draft's forward from 0.26-0.31 of the target's to
# 0.10-0.17 (draft tokens/s +29% to +44%); 4,096 lost 3% at T = 0 and was slower than 8,192.
DEFAULT_HEAD_VOCAB = 8192


def full_vocab(logits: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """A cut head's logits ``[..., K]`` over the whole vocabulary ``[..., vocab_size]``: column j is token
    ``ids[j]``, every other token -inf (zero draft probability). ``ids`` None: ``logits`` as they are."""
    if ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, ids, logits)


def rank_tokens(counts: Mapping[int, int], vocab_size: int, keep: Iterable[int] = ()) -> list[int]:
    """Every token id once: ``keep`` first, then by count (highest first), then by id."""
    out = list(dict.fromkeys(t for t in keep if 0 <= t < vocab_size))
    seen = set(out)
    for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if 0 <= t < vocab_size and c > 0 and t not in seen:
            seen.add(t)
            out.append(t)
    out.extend(t for t in range(vocab_size) if t not in seen)
    return out


def head_vocab(counts: Mapping[int, int], vocab_size: int, k: int, keep: Iterable[int] = ()) -> torch.Tensor:
    """The ids ``[k]`` int64, ascending, of a head cut to the ``k`` best-ranked tokens (``rank_tokens``)."""
    if not 1 <= k <= vocab_size:
        raise ValueError(f"a draft head of {k} tokens: it must hold 1..{vocab_size} (the vocabulary)")
    return torch.tensor(sorted(rank_tokens(counts, vocab_size, keep)[:k]), dtype=torch.int64)


def save_counts(directory: Path, counts: Mapping[int, int], source: str) -> Path:
    path = Path(directory) / COUNTS_FILE
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    path.write_text(json.dumps({"source": source, "tokens": sum(counts.values()),
                                "counts": {str(t): c for t, c in ordered}}, indent=0) + "\n")
    return path


def load_counts(directory: Path) -> dict[int, int] | None:
    """The draft's token counts, or None when it has none (its head then cannot be cut)."""
    path = Path(directory) / COUNTS_FILE
    if not path.is_file():
        return None
    return {int(t): int(c) for t, c in json.loads(path.read_text())["counts"].items()}


def continuation_counts(sequences: list[list[int]], prompt_lens: list[int]) -> collections.Counter:
    """Token counts of the continuations alone: the draft proposes the target's text, never the prompt."""
    return collections.Counter(t for s, n in zip(sequences, prompt_lens) for t in s[n:])


def spread(items: list, n: int) -> list:
    """``n`` items evenly spaced over ``items`` (all of them when ``n`` is 0 or too many)."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def main(argv: list[str] | None = None) -> Path:
    from draft.distill import sample_corpus
    from gateway.llm import LoadConfig, resolve_model_path

    root = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description="Sample the target's token counts for a draft's cut head (FR-Spec), "
                                             "or the n-gram drafter's table of its text (--write table).")
    ap.add_argument("--target", required=True, help="the target's HF directory or .gguf ('embedded': the default model)")
    ap.add_argument("--out", required=True, help=f"the draft's directory: {COUNTS_FILE} or {TABLE_FILE} goes there")
    ap.add_argument("--prompts", nargs="+", default=[str(root / "data" / "distill_prompts.txt"),
                                                      str(root / "data" / "distill_prompts_mix.txt")])
    ap.add_argument("--num-prompts", type=int, default=768, help="spread evenly over the prompt files (0: all)")
    ap.add_argument("--samples", type=int, default=2, help="continuations per prompt")
    ap.add_argument("--temperature", default="0,0.7", help="sample s uses the s-th (cycled)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", choices=["counts", "table"], default="counts",
                    help=f"counts: {COUNTS_FILE} (the cut head's ranking); table: the n-gram drafter's {TABLE_FILE}")
    ap.add_argument("--skip-every", type=int, default=0,
                    help="leave out every N-th line of each prompt file (50: draft.distill's held-out prompts)")
    ap.add_argument("--quantize", choices=["none", "int4"], default="none",
                    help="the target sampled: unquantized (as draft.distill's teacher) or INT4 as served (for the "
                         "embedded target, its own Q4_1 weights)")
    ap.add_argument("--table-sizes", default="1,3", help="the table's shortest and longest contexts, in tokens")
    ap.add_argument("--table-min-count", type=int, default=2, help="a next token seen fewer times is left out")
    ap.add_argument("--table-keep", type=int, default=3, help="next tokens kept per context")
    args = ap.parse_args(argv)
    if args.skip_every < 0:
        raise ValueError(f"--skip-every must be >= 0, got {args.skip_every}")
    out = Path(args.out)
    if args.write == "counts" and not (out / "config.json").is_file():
        raise ValueError(f"{out} holds no draft (no config.json)")
    out.mkdir(parents=True, exist_ok=True)
    if args.target != "embedded":
        target = args.target
    else:  # as served under int4: the embedded model's own Q4_1 weights (LoadConfig with no model)
        target = None if args.quantize == "int4" else str(resolve_model_path(LoadConfig()))
    lines = []
    for f in args.prompts:
        file_lines = [line.strip() for line in Path(f).read_text().splitlines()]
        lines += [line for i, line in enumerate(file_lines) if not (args.skip_every and i % args.skip_every
                                                                     == args.skip_every - 1)]
    prompts = spread([line for line in lines if line], args.num_prompts)
    t0 = time.perf_counter()
    temps = [float(t) for t in args.temperature.split(",")]
    corpus, _ = sample_corpus(target, prompts, args.samples, args.max_tokens, temps, args.seed, args.device,
                              args.batch, quantize=args.quantize)
    command = "python -m draft.vocab " + " ".join(argv if argv is not None else sys.argv[1:])
    source = f"{command} ({len(prompts)} prompts, {time.perf_counter() - t0:.0f} s)"
    if args.write == "table":
        lo, hi = (int(v) for v in args.table_sizes.split(","))
        texts = [s[n:] for s, n in zip(corpus.sequences, corpus.prompt_lens)]
        table = NgramTable.build(texts, lo, hi, args.table_keep, args.table_min_count, source)
        path = table.save(out / TABLE_FILE)
        print(f"{sum(map(len, texts))} tokens, {len(table.entries)} contexts -> {path}", file=sys.stderr)
        return path
    counts = continuation_counts(corpus.sequences, corpus.prompt_lens)
    path = save_counts(out, counts, source)
    print(f"{sum(counts.values())} tokens, {len(counts)} distinct -> {path}", file=sys.stderr)
    return path


if __name__ == "__main__":
    main()
