"""Train a small draft model for any target: ``python -m draft.distill --target DIR_OR_GGUF --out DIR``.

1. Sample continuations from the target itself through the engine's batched generation (speculation
   off, seeded) for the prompts in ``draft/data/distill_prompts.txt``.
2. Keep the target's top-k next-token distribution at every position of prompt + continuation.
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
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from draft.dense_lm import student_from_teacher, teacher_from_checkpoint
from draft.distill_train import Tokens, feature_loss, save_draft, teacher_targets, train
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
    ap.add_argument("--prompts", default=str(PROMPTS), help="one instruction per line")
    ap.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--samples", type=int, default=1, help="sampled continuations per prompt")
    ap.add_argument("--corpus", default=None, help="JSON of sampled token ids: reused when it exists, else written")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens sampled per continuation")
    ap.add_argument("--temperature", default="0.9",
                    help="sampling temperature; a comma list cycles over the --samples (0 = greedy)")
    ap.add_argument("--device", default="cpu", help="where the target samples and the draft trains: cpu or cuda")
    ap.add_argument("--sample-batch", type=int, default=32, help="sequences the engine decodes at once")
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


def sample_corpus(target: str, prompts: list[str], samples: int, max_tokens: int, temperatures: list[float],
                  seed: int, device: str, batch: int = 32) -> list[list[int]]:
    """Prompt + sampled continuation token ids, ``samples`` per prompt, from the unquantized target.
    Sample ``s`` uses ``temperatures[s % len(temperatures)]``."""
    ids_max = 512 + max_tokens  # a prompt longer than this is cut (see below)
    engine_cfg = EngineConfig(num_blocks=batch * -(-ids_max // 16) + 64, page_size=16,
                              scheduler=SchedulerConfig(max_running=batch, max_waiting=max(256, batch)))
    llm = LLM.load(LoadConfig(model=target, draft="none", quantize="none", device=device, dtype="float32"),
                   engine_cfg, log=lambda m: print(m, file=sys.stderr))
    ids = [llm.encode(p)[-512:] for p in prompts]
    chunk = batch  # one engine-full per call: the same batches, and progress
    seqs: list[list[int]] = []
    for s in range(samples):
        sampling = SamplingParams(temperature=temperatures[s % len(temperatures)], max_tokens=max_tokens,
                                  seed=seed * 1000 + s)
        for lo in tqdm(range(0, len(ids), chunk), desc=f"sample {s + 1}/{samples}", unit="batch"):
            gens = llm.generate(ids[lo : lo + chunk], sampling, SpeculationParams(enabled=False))
            seqs += [p + g.token_ids for p, g in zip(ids[lo : lo + chunk], gens)]
    return seqs


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.target == "embedded":  # a portable name for the recorded command of the shipped draft
        args.target = str(resolve_model_path(LoadConfig()))
    prompts = [l.strip() for l in Path(args.prompts).read_text().splitlines() if l.strip()][: args.max_prompts]
    ckpt: LoadedCheckpoint = load_checkpoint(args.target, torch.float32)
    if ckpt.quantized:
        raise ValueError(f"{args.target} is a quantized checkpoint: distil from its dense source")
    cfg = draft_config(ckpt.config, args.layers, args.hidden, args.intermediate)
    t0 = time.perf_counter()
    corpus = Path(args.corpus) if args.corpus else None
    if corpus is not None and corpus.is_file():
        seqs = json.loads(corpus.read_text())
    else:
        temps = [float(t) for t in str(args.temperature).split(",")]
        seqs = sample_corpus(args.target, prompts, args.samples, args.max_tokens, temps, args.seed, args.device,
                             args.sample_batch)
        if corpus is not None:
            corpus.write_text(json.dumps(seqs))
    t_sample = time.perf_counter() - t0
    device = torch.device(args.device)
    teacher = teacher_from_checkpoint(ckpt.config, ckpt.weights).to(device)
    t1 = time.perf_counter()
    if args.feature:  # the teacher runs beside the student: its features would not fit in memory up front
        student = student_from_teacher(teacher, cfg, feature=True, seed=args.seed).to(device)
        tokens = [Tokens(torch.tensor(s, dtype=torch.long, device=device)) for s in seqs]
        losses = train(student, tokens, args.steps, args.lr, args.batch_size, args.seed,
                       loss_fn=lambda st, b: feature_loss(st, teacher, b, args.top_k, args.feature_reg))
    else:
        data = teacher_targets(teacher, seqs, args.top_k)
        student = student_from_teacher(teacher, cfg).to(device)
        del teacher
        t1 = time.perf_counter()
        losses = train(student, data, args.steps, args.lr, args.batch_size, args.seed)
    meta = {"command": "python -m draft.distill " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seed": args.seed, "target": Path(args.target).name, "sequences": len(seqs),
            "tokens": sum(len(s) for s in seqs), "sample_seconds": round(t_sample, 1),
            "train_seconds": round(time.perf_counter() - t1, 1),
            "kl_first_10": round(sum(losses[:10]) / len(losses[:10]), 4),
            "kl_last_10": round(sum(losses[-10:]) / len(losses[-10:]), 4), "torch": torch.__version__,
            "kind": "feature" if args.feature else "lm"}  # feature: kl_* hold feature_loss (both steps, + reg)
    out = save_draft(student, ckpt.tokenizer, ckpt.chat_template, Path(args.out), meta)
    print(json.dumps(meta), file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
