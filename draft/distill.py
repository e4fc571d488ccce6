"""Train a small draft model for any target: ``python -m draft.distill --target DIR_OR_GGUF --out DIR``.

1. Sample continuations from the target itself through the engine's batched generation (speculation
   off, seeded) for the prompts in ``draft/data/distill_prompts.txt`` (or ``--prompts``).
2. Keep the target's top-k next-token distribution at every position of prompt + continuation.
   Every ``--val-every``-th prompt is held out: its sequences score the draft before and after training
   (KL and top-1 agreement with the target on the sampled tokens), recorded in ``distill.json``.
3. Train a few-layer student of the same family and hidden size by KL to it (DistillSpec); the
   student starts from evenly spread target layers and reuses the target's embedding and LM head
   frozen, so the checkpoint holds only its own layers (config flag ``specgate_shared_embeddings``;
   ``gateway/llm.py`` attaches the target's tensors when it loads the draft).

``--feature`` trains a feature draft instead (``draft/feature_drafter.py``, EAGLE-style): its input is
``fc([embedding, target feature])``, the teacher runs beside it on every batch, and the loss adds a
second, unrolled step on its own features (``distill_train.feature_loss``). One layer is the usual size.

This command module is the one place in ``draft/`` that calls the gateway's Python API (the engine owns
batched generation); tests/test_layering.py lists it as that exception.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from draft.dense_lm import draft_from_checkpoint, student_from_teacher, teacher_from_checkpoint
from draft.ngram import TABLE_FILE, NgramTable
from draft.vocab import continuation_counts, save_counts
from draft.distill_train import Tokens, evaluate, feature_loss, save_draft, teacher_targets, train
from draft.params import SpeculationParams
from gateway.engine import EngineConfig
from gateway.llm import LLM, LoadConfig, resolve_model_path
from gateway.scheduler import SchedulerConfig
from target.config import ModelConfig
from target.loader import LoadedCheckpoint, load_checkpoint
from verify.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parent / "data" / "distill_prompts.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m draft.distill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target HF directory or .gguf; 'embedded' = SmolLM2-135M-Instruct")
    ap.add_argument("--out", required=True, help="directory to write the draft into")
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--hidden", type=int, default=None, help="must equal the target's (embeddings are shared)")
    ap.add_argument("--intermediate", type=int, default=None, help="draft MLP width; default the target's")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    ap.add_argument("--top-k", type=int, default=64, help="teacher log-probs kept per position")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", nargs="+", default=[str(PROMPTS)], help="files of one instruction per line")
    ap.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--self-instruct", type=int, default=0,
                    help="also N prompts written by the target itself (its user turn, sampled at T=1, top-p 0.95)")
    ap.add_argument("--samples", type=int, default=1, help="sampled continuations per prompt")
    ap.add_argument("--corpus", default=None, help="JSON of sampled token ids: reused when it exists, else written")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens sampled per continuation")
    ap.add_argument("--temperature", default="0.9",
                    help="sampling temperature; a comma list cycles over the --samples (0 = greedy)")
    ap.add_argument("--device", default="cpu", help="where the target samples and the draft trains: cpu or cuda")
    ap.add_argument("--sample-batch", type=int, default=32, help="sequences the engine decodes at once")
    ap.add_argument("--sample-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the target's dtype while it samples (bfloat16 on CUDA is the served precision)")
    ap.add_argument("--teacher-batch", type=int, default=8, help="sequences per teacher forward (top-k targets)")
    ap.add_argument("--val-every", type=int, default=50,
                    help="hold out every N-th prompt's sequences for evaluation (0 = no held-out set)")
    ap.add_argument("--baseline", default=None,
                    help="an earlier draft of this target, scored on the same held-out set (val_*_baseline)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--feature", action="store_true", help="train a feature draft (EAGLE-style) instead of a small LM")
    ap.add_argument("--feature-reg", type=float, default=0.1, help="weight of the feature regression (--feature)")
    return ap.parse_args(argv)


def draft_config(target: ModelConfig, layers: int, hidden: int | None, intermediate: int | None) -> ModelConfig:
    if hidden is not None and hidden != target.hidden_size:
        raise ValueError(f"--hidden {hidden} != target hidden {target.hidden_size}: the draft reuses the target's "
                         "embedding and head, so it keeps their width (a projection is not implemented)")
    inter = intermediate or target.intermediate_size
    if not 1 <= layers <= target.num_layers or not 1 <= inter <= target.intermediate_size:
        raise ValueError(f"--layers must be in 1..{target.num_layers}, --intermediate in 1..{target.intermediate_size}")
    return replace(target, num_layers=layers, intermediate_size=inter)


@dataclass(slots=True)
class Corpus:
    """Sampled training text: ``sequences[i]`` is prompt ``prompt_index[i]``'s ids followed by one sampled
    continuation, whose first ``prompt_lens[i]`` ids are the prompt's."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    prompt_index: list[int]

    def to_json(self) -> str:
        return json.dumps({"sequences": self.sequences, "prompt_lens": self.prompt_lens,
                           "prompt_index": self.prompt_index})

    @staticmethod
    def from_json(text: str) -> "Corpus":
        raw = json.loads(text)
        if isinstance(raw, list):  # the earlier format: sequences alone (prompt lengths unknown)
            return Corpus(raw, [0] * len(raw), list(range(len(raw))))
        return Corpus(raw["sequences"], raw["prompt_lens"], raw["prompt_index"])

    def split(self, val_every: int) -> tuple[list[int], list[int]]:
        """Sequence indices for training and for evaluation: every ``val_every``-th prompt's samples are held
        out whole, so no held-out prompt is ever trained on (none when ``val_every`` is 0)."""
        held = [val_every > 0 and p % val_every == val_every - 1 for p in self.prompt_index]
        return [i for i, h in enumerate(held) if not h], [i for i, h in enumerate(held) if h]


def sample_corpus(target: str, prompts: list[str], samples: int, max_tokens: int, temperatures: list[float],
                  seed: int, device: str, batch: int = 32, dtype: str = "float32",
                  self_instruct: int = 0, quantize: str = "none") -> tuple[Corpus, list[str]]:
    """Prompt + sampled continuation token ids, ``samples`` per prompt, from the target (unquantized unless
    ``quantize`` says otherwise), and the prompts it answered: ``prompts`` then the ``self_instruct`` ones it
    wrote itself (``write_prompts``). Sample ``s`` uses ``temperatures[s % len(temperatures)]``; every request
    has its own seed."""
    ids_max = 512 + max_tokens  # a prompt longer than this is cut (see below)
    # A step may prefill a whole batch of prompts at once: sampling is throughput work, not latency work.
    engine_cfg = EngineConfig(num_blocks=batch * -(-ids_max // 16) + 64, page_size=16,
                              scheduler=SchedulerConfig(max_running=batch, max_waiting=max(256, batch),
                                                        max_step_tokens=max(1024, 64 * batch)))
    llm = LLM.load(LoadConfig(model=target, draft="none", quantize=quantize, device=device, dtype=dtype),
                   engine_cfg, log=lambda m: print(m, file=sys.stderr))
    if self_instruct:
        prompts = prompts + write_prompts(llm, self_instruct, seed, batch)
    ids = [llm.encode(p)[-512:] for p in prompts]
    chunk = batch  # one engine-full per call: the same batches, and progress
    corpus = Corpus([], [], [])
    for s in range(samples):
        for lo in tqdm(range(0, len(ids), chunk), desc=f"sample {s + 1}/{samples}", unit="batch"):
            sampling = [SamplingParams(temperature=temperatures[s % len(temperatures)], max_tokens=max_tokens,
                                       seed=(seed * 1000 + s) * 1_000_000 + i)
                        for i in range(lo, min(lo + chunk, len(ids)))]
            gens = llm.generate(ids[lo : lo + chunk], sampling, SpeculationParams(enabled=False))
            for j, (p, g) in enumerate(zip(ids[lo : lo + chunk], gens)):
                corpus.sequences.append(p + g.token_ids)
                corpus.prompt_lens.append(len(p))
                corpus.prompt_index.append(lo + j)
    return corpus, prompts


SELF_INSTRUCT_MARK = "\u2063"  # an invisible separator: where the user's words go in the rendered template


def write_prompts(llm: LLM, n: int, seed: int, batch: int, max_tokens: int = 96) -> list[str]:
    """Up to ``n`` distinct user requests written by the target: its chat template opened at a user turn
    and sampled (T=1, top-p 0.95, seeded per request) until the turn ends. A target answers the questions
    it imagines in its own style, so these widen the corpus beyond any shipped prompt list (self-instruct).
    Without a chat template the model continues its BOS alone."""
    tok, template = llm.loaded.checkpoint.tokenizer, llm.loaded.checkpoint.chat_template
    if template:
        text = tok.apply_chat_template([{"role": "user", "content": SELF_INSTRUCT_MARK}], tokenize=False,
                                       chat_template=template)
        opening = tok.encode(text[: text.index(SELF_INSTRUCT_MARK)], add_special_tokens=False)
    else:
        opening = [tok.bos_token_id if tok.bos_token_id is not None else 0]
    out: list[str] = []
    seen: set[str] = set()
    for lo in tqdm(range(0, n, batch), desc="self-instruct", unit="batch"):
        sampling = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed * 1_000_003 + i)
                    for i in range(lo, min(lo + batch, n))]
        for g in llm.generate([list(opening)] * len(sampling), sampling, SpeculationParams(enabled=False)):
            text = " ".join(g.text.split())  # one line: the prompt files' form
            if text and g.finish_reason == "stop" and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.val_every == 1 or args.val_every < 0:
        raise ValueError(f"--val-every must be 0 (no held-out set) or >= 2, got {args.val_every}: "
                         "1 would hold out every prompt")
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.target == "embedded":  # a portable name for the recorded command of the shipped draft
        args.target = str(resolve_model_path(LoadConfig()))
    lines = [l.strip() for f in args.prompts for l in Path(f).read_text().splitlines()]
    prompts = [l for l in lines if l][: args.max_prompts]
    ckpt: LoadedCheckpoint = load_checkpoint(args.target, torch.float32)
    if ckpt.quantized:
        raise ValueError(f"{args.target} is a quantized checkpoint: distil from its dense source")
    cfg = draft_config(ckpt.config, args.layers, args.hidden, args.intermediate)
    t0 = time.perf_counter()
    corpus_path = Path(args.corpus) if args.corpus else None
    if corpus_path is not None and corpus_path.is_file():
        corpus = Corpus.from_json(corpus_path.read_text())
    else:
        temps = [float(t) for t in str(args.temperature).split(",")]
        corpus, prompts = sample_corpus(args.target, prompts, args.samples, args.max_tokens, temps, args.seed,
                                        args.device, args.sample_batch, args.sample_dtype, args.self_instruct)
        if corpus_path is not None:
            corpus_path.write_text(corpus.to_json())
    t_sample = time.perf_counter() - t0
    seqs = corpus.sequences
    train_idx, val_idx = corpus.split(args.val_every)
    device = torch.device(args.device)
    teacher = teacher_from_checkpoint(ckpt.config, ckpt.weights).to(device)
    t1 = time.perf_counter()
    held: dict[str, float] = {}
    if args.feature:  # the teacher runs beside the student: its features would not fit in memory up front
        student = student_from_teacher(teacher, cfg, feature=True, seed=args.seed).to(device)
        tokens = [Tokens(torch.tensor(seqs[i], dtype=torch.long, device=device)) for i in train_idx]
        losses = train(student, tokens, args.steps, args.lr, args.batch_size, args.seed,
                       loss_fn=lambda st, b: feature_loss(st, teacher, b, args.top_k, args.feature_reg))
    else:
        starts = [max(0, n - 1) for n in corpus.prompt_lens]
        data = teacher_targets(teacher, seqs, args.top_k, args.teacher_batch, starts)
        student = student_from_teacher(teacher, cfg).to(device)
        del teacher
        val = [data[i] for i in val_idx]
        if val:
            held |= {f"val_{k}_init": v for k, v in evaluate(student, val, args.teacher_batch).items()}
            if args.baseline:
                base = draft_from_checkpoint(args.baseline, ckpt).to(device)
                held |= {f"val_{k}_baseline": v for k, v in evaluate(base, val, args.teacher_batch).items()}
                del base
        t1 = time.perf_counter()
        losses = train(student, [data[i] for i in train_idx], args.steps, args.lr, args.batch_size, args.seed)
        if val:
            held |= {f"val_{k}": v for k, v in evaluate(student, val, args.teacher_batch).items()}
    held = {k: round(v, 4) if isinstance(v, float) else v for k, v in held.items()}
    meta = {"command": "python -m draft.distill " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seed": args.seed, "target": Path(args.target).name, "prompts": len(set(corpus.prompt_index)),
            "self_instruct": args.self_instruct, "sequences": len(train_idx),
            "val_sequences": len(val_idx), **held,
            "tokens": sum(len(seqs[i]) for i in train_idx), "sample_seconds": round(t_sample, 1),
            "train_seconds": round(time.perf_counter() - t1, 1),
            "kl_first_10": round(sum(losses[:10]) / len(losses[:10]), 4),
            "kl_last_10": round(sum(losses[-10:]) / len(losses[-10:]), 4), "torch": torch.__version__,
            "kind": "feature" if args.feature else "lm"}  # feature: kl_* hold feature_loss (both steps, + reg)
    out = save_draft(student, ckpt.tokenizer, ckpt.chat_template, Path(args.out), meta)
    # the cut head's ranking (draft/vocab.py): the tokens of the target's own continuations it was trained on
    save_counts(out, continuation_counts(seqs, corpus.prompt_lens), f"{meta['command']} (its corpus)")
    # the n-gram drafter's table of the same continuations (draft/ngram.py), for the training sequences alone
    NgramTable.build([seqs[i][corpus.prompt_lens[i] :] for i in train_idx],
                     source=f"{meta['command']} (its corpus)").save(out / TABLE_FILE)
    print(json.dumps(meta), file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
