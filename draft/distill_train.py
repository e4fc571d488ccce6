"""Distillation maths: the teacher's top-k next-token distribution per position, a KL loss to it, the
training loop, and writing the draft checkpoint. No sampling here: ``draft/distill.py`` feeds text in.

Forward KL to the target's own samples is the on-policy recipe of DistillSpec (Zhou et al., 2023): a
draft is judged only by how often the target accepts its tokens, and acceptance is highest where the
draft matches the target's distribution on the target's own continuations.

Approximation: the teacher distribution is kept as its top-k log-probabilities per position (k=64 holds
nearly all the mass of a 135M chat model at T=1), renormalised over those k tokens. The loss
``sum_k p_k (log p_k - log q_k)`` uses the student's full-vocabulary ``log q``, so it is >= 0 and is the
exact KL when the teacher's tail mass is zero.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from draft.dense_lm import DenseLM
from target.loader import FEATURE_DRAFT_KEY, SHARED_EMBEDDINGS_KEY, save_tokenizer

MAX_SHARD_BYTES = 15 * 2**20  # the device returns files of at most 16 MiB


@dataclass(slots=True)
class TeacherTargets:
    """One training sequence with the teacher's top-k next-token distribution at every position."""

    tokens: torch.Tensor  # [T] int64
    logp: torch.Tensor  # [T, k] float16, renormalised over the k tokens
    index: torch.Tensor  # [T, k] int32 vocabulary ids, most likely first
    start: int = 0  # first position whose next token is a sampled one (prompt length - 1): where evaluation scores


def pad(seqs: list[torch.Tensor], value: int | float = 0) -> torch.Tensor:
    """Right-pad 1-D or 2-D tensors along dim 0 into ``[B, T_max, ...]``."""
    return torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=value)


@torch.no_grad()
def teacher_targets(teacher: DenseLM, seqs: list[list[int]], k: int, batch_size: int = 8,
                    starts: list[int] | None = None) -> list[TeacherTargets]:
    """Run the teacher once over every sequence and keep its top-k log-probabilities per position (on the
    teacher's device). ``starts[i]``: sequence i's first continuation-predicting position (``TeacherTargets.start``)."""
    device = teacher.embed.device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a batch: less padding
    out: list[TeacherTargets | None] = [None] * len(seqs)
    for lo in tqdm(range(0, len(order), batch_size), desc="teacher top-k", unit="batch"):
        idx = order[lo : lo + batch_size]
        toks = [torch.tensor(seqs[i], dtype=torch.long, device=device) for i in idx]
        with _autocast(device):
            logp = teacher(pad(toks)).log_softmax(-1)  # [B, T, V]
        top, top_i = _top_k(logp, k)  # [B, T, k]
        for b, i in enumerate(idx):
            n = len(seqs[i])
            out[i] = TeacherTargets(toks[b], top[b, :n].half(), top_i[b, :n].int(), starts[i] if starts else 0)
    return out  # type: ignore[return-value]


@torch.no_grad()
def evaluate(student: DenseLM, data: list[TeacherTargets], batch_size: int = 8) -> dict[str, float]:
    """Held-out fidelity over the positions that predict sampled tokens (``start`` on): the mean top-k KL, and
    ``top1``, how often the student's argmax is the teacher's -- a greedy chain draft's acceptance rate per
    token when the draft is fed the target's own text."""
    was_training = student.training
    student.eval()
    kl_sum, hits, count = 0.0, 0, 0
    for lo in range(0, len(data), batch_size):
        batch = data[lo : lo + batch_size]
        tokens = pad([b.tokens for b in batch])  # [B, T]
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)[None, :]
        mask = torch.stack([(pos[0] >= b.start) & (pos[0] < len(b.tokens)) for b in batch]).float()  # [B, T]
        with _autocast(tokens.device):
            logits = student(tokens)  # [B, T, V]
        p_log = pad([b.logp.float() for b in batch], -math.inf)  # [B, T, k]
        index = pad([b.index.long() for b in batch])  # [B, T, k]
        n = mask.sum()
        if n == 0:
            continue
        kl_sum += float(_kl(p_log, index, logits, mask) * n)
        hits += int(((logits.argmax(-1) == index[..., 0]).float() * mask).sum())
        count += int(n)
    student.train(was_training)
    return {"kl": kl_sum / max(count, 1), "top1": hits / max(count, 1), "positions": count}


def kl_loss(student: DenseLM, batch: list[TeacherTargets]) -> torch.Tensor:
    """Mean over real (unpadded) positions of KL(teacher top-k || student); scalar, differentiable."""
    tokens = pad([b.tokens for b in batch])  # [B, T]
    p_log = pad([b.logp.float() for b in batch], -math.inf)  # [B, T, k]
    index = pad([b.index.long() for b in batch])  # [B, T, k]
    mask = pad([torch.ones(len(b.tokens), device=tokens.device) for b in batch])  # [B, T]
    with _autocast(tokens.device):
        logits = student(tokens)  # [B, T, V] float32
    return _kl(p_log, index, logits, mask)  # padded rows' teacher mass is zero


def _top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probabilities per position, renormalised over those k, and their token ids."""
    top, index = logp.topk(k, dim=-1)
    return top - top.logsumexp(-1, keepdim=True), index


@dataclass(slots=True)
class Tokens:
    """One training sequence for a feature draft: the teacher runs alongside, so only its ids are kept."""

    tokens: torch.Tensor  # [T] int64


def _kl(p_log: torch.Tensor, index: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean KL(teacher top-k || student) over positions: ``p_log``/``index`` [B, T, k], ``logits`` [B, T, V]."""
    q_log = logits.log_softmax(-1).gather(-1, index)
    p = p_log.exp()
    kl = (p * (p_log.nan_to_num(neginf=0.0) - q_log)).sum(-1)
    return (kl * mask).sum() / mask.sum()


def feature_loss(student: DenseLM, teacher: DenseLM, batch: list[Tokens], k: int, reg: float = 0.1) -> torch.Tensor:
    """A feature draft's loss on one batch (EAGLE's objective, with a second unrolled step as in EAGLE-3's
    training-time test). Row ``p`` of the student reads token ``x_p`` and the teacher's feature ``f_{p-1}``
    and is scored against the teacher's next-token distribution at ``p`` (top-k KL) and, with weight ``reg``,
    against ``f_p`` itself (smooth L1). The second step reads the student's own first-step feature at
    ``p - 1`` instead of the teacher's: what it sees at tree depth 2 and beyond."""
    tokens = pad([b.tokens for b in batch])  # [B, T]
    mask = pad([torch.ones(len(b.tokens), device=tokens.device) for b in batch])[:, 1:]  # [B, T - 1]
    with torch.no_grad(), _autocast(tokens.device):
        t_logits, t_feat = teacher.forward_hidden(tokens)
        top, index = _top_k(t_logits.float().log_softmax(-1), k)
    t_feat = t_feat.float()
    x, f_in, f_out = tokens[:, 1:], t_feat[:, :-1], t_feat[:, 1:]
    p_log, index = top[:, 1:], index[:, 1:]
    loss = torch.zeros((), device=tokens.device)
    for step in range(2):
        with _autocast(tokens.device):
            logits, h = student.forward_hidden(x, f_in)
        h = h.float()
        reg_l = (F.smooth_l1_loss(h, f_out, reduction="none").mean(-1) * mask).sum() / mask.sum()
        loss = loss + _kl(p_log, index, logits, mask) + reg * reg_l
        f_in = torch.cat((f_in[:, :1], h[:, :-1]), dim=1)  # step 2: the student's own features
    return loss / 2


def _autocast(device: torch.device):
    """bf16 matmuls on CUDA (fp32 master weights, fp32 logits); exact fp32 on CPU, where tests run."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def train(student: DenseLM, data: list[TeacherTargets] | list[Tokens], steps: int, lr: float, batch_size: int,
          seed: int, warmup: int = 10, loss_fn=kl_loss) -> list[float]:
    """AdamW with linear warmup and cosine decay over random length-bucketed batches; returns step losses.
    ``loss_fn(student, batch)``: ``kl_loss`` on teacher targets, or a ``feature_loss`` closure on ``Tokens``."""
    gen = torch.Generator().manual_seed(seed)
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses: list[float] = []
    student.train()
    bar = tqdm(range(steps), desc="distill", unit="step")
    for _ in bar:
        pick = batches[int(torch.randint(len(batches), (1,), generator=gen))]
        loss = loss_fn(student, [data[i] for i in pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(kl=f"{losses[-1]:.3f}")
    student.eval()
    return losses


def save_draft(student: DenseLM, tokenizer: Any, chat_template: str | None, out: Path,
               meta: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json (flagged as sharing the target's embedding / head), safetensors shards of at most
    ``MAX_SHARD_BYTES`` with an index when there is more than one, tokenizer files and ``meta``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = student.config.to_hf() | {SHARED_EMBEDDINGS_KEY: True, "torch_dtype": str(dtype).removeprefix("torch.")}
    if student.feature:
        cfg[FEATURE_DRAFT_KEY] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in student.hf_weights().items():
        t = t.to(dtype).contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {t: n for n, s in zip(names, shards) for t in s}
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=2) + "\n")
    save_tokenizer(tokenizer, chat_template, out)
    (out / "distill.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out
