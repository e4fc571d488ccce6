"""Per-request logit processing for a whole step at once: logit bias and repetition penalties over every tree
row of every sequence that has them, in one batched pass on the device, before acceptance.

``verify.sampling.apply_penalties`` defines what each row gets (vLLM's order: bias, then repetition,
frequency and presence penalties). A tree row i must see the tokens generated before the step's root plus
the path root..i (``tree_path_counts``), since that path is the context the row predicts from. Done one
sequence at a time inside acceptance, that cost every such request a host sync per decision and a
vocabulary-sized host count per step; here each sequence keeps its output counts on the device, updated by
the tokens it emits (``PenaltyState.emit``), and the step's processed rows replace the raw ones, after which
the sequence is verified in the batched groups like any other (with its penalty knobs stripped:
``stripped``).

On the CPU the engine keeps the per-sequence path: there every vocabulary-wide pass is arithmetic, not a
launch, and the batched pass made more of them. With penalties on every request over a 49,152-token
vocabulary, time per step (forwards stubbed, one thread) went from 33 to 63 ms at 64 plain streams and from
76 to 178 ms at 16 streams of 2,2,2,1 trees (bench/results/host_step_penalties_cpu.json). On the GPU, where
those passes are cheap and each host sync is not, it is unmeasured. ``BATCHED_CPU = True`` takes this path
on the CPU too (the tests do, to cover it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from draft.tree import TokenTree
from verify.sampling import SamplingParams, allowed_mask, penalise, tree_path_counts

BATCHED_CPU = False  # see the module's docstring


@dataclass(slots=True)
class PenaltyState:
    """One sequence's device-side inputs: counts of every token it has emitted, which tokens its prompt holds,
    and its dense logit bias."""

    counts: torch.Tensor  # [V] int32
    prompt: torch.Tensor  # [V] bool
    bias: torch.Tensor | None  # [V] float32

    @staticmethod
    def new(params: SamplingParams, prompt_ids: list[int], output_ids: list[int], vocab: int,
            device: torch.device) -> "PenaltyState":
        counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        if output_ids:
            counts.index_add_(0, torch.tensor(output_ids, device=device), torch.ones(len(output_ids), dtype=torch.int32,
                                                                                    device=device))
        prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt[torch.tensor(prompt_ids, device=device)] = True
        bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            bias = torch.zeros(vocab, device=device)
            bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
        if params.allowed_token_ids:  # -inf off the allowed tokens, on top of any bias
            mask = allowed_mask(params.allowed_token_ids, vocab, device)
            bias = mask if bias is None else bias + mask
        return PenaltyState(counts, prompt, bias)

    def emit(self, tokens: list[int]) -> None:
        """Count tokens the sequence emitted (nothing is read back to the host; the ids' small copy to the
        device is from pageable memory, which on CUDA waits for the stream: see target/transfer.py)."""
        if tokens:
            self.counts.index_add_(0, torch.tensor(tokens, device=self.counts.device),
                                   torch.ones(len(tokens), dtype=torch.int32, device=self.counts.device))


def process_rows(logits: torch.Tensor, spans: list[tuple[int, int]], params: list[SamplingParams],
                 states: list[PenaltyState], trees: list[TokenTree]) -> torch.Tensor:
    """A copy of ``logits`` [R, V] with each sequence's rows ``spans[j]`` (its tree's nodes, root first)
    processed by its ``params``; the other rows as they were."""
    out = logits.clone()
    V, dev = logits.shape[-1], logits.device
    index, counts, seq_of = [], [], []
    for j, ((lo, hi), tree, state) in enumerate(zip(spans, trees, states)):
        index += range(lo, hi)
        seq_of += [j] * (hi - lo)
        if hi - lo == 1:  # a root alone: its context is everything emitted (the root is the last of it)
            counts.append(state.counts[None])
        else:  # the root is counted by the path: take it out of the emitted counts once
            root = int(tree.host()[0][0])
            path = tree_path_counts(tree, V).to(dev, torch.int32)  # [N, V], root included
            base = state.counts.clone()
            base[root] -= 1
            counts.append(base[None] + path)
    rows = torch.tensor(index, device=dev)
    per_seq = torch.tensor(seq_of, device=dev)
    c = torch.cat(counts)  # [n, V] int32
    x = logits.index_select(0, rows).float()  # [n, V]
    biases = [s.bias for s in states]
    if any(b is not None for b in biases):
        table = torch.stack([b if b is not None else torch.zeros(V, device=dev) for b in biases])  # [S, V]
        x = x + table.index_select(0, per_seq)
    knobs = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                         device=dev).index_select(0, per_seq)  # [n, 3]
    prompt = torch.stack([s.prompt for s in states]).index_select(0, per_seq)  # [n, V]
    out[rows] = penalise(x, c, prompt, knobs[:, :1], knobs[:, 1:2], knobs[:, 2:])  # neutral knobs leave x as is
    return out


def stripped(params: SamplingParams) -> SamplingParams:
    """``params`` without bias and penalties: what acceptance sees once ``process_rows`` has applied them."""
    return replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=(),
                   allowed_token_ids=())
