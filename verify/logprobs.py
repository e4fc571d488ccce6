"""Log-probabilities of emitted tokens, for requests that ask for them (OpenAI's ``logprobs``).

They are taken under the target's *raw* distribution -- log_softmax of its logits, before logit bias,
penalties, temperature, top-k and top-p -- as vLLM reports by default (``logprobs_mode="raw_logprobs"``).
That makes them a property of the model and the text alone: a speculative and a plain run of the same
greedy request report the same figures (up to rounding), because the tree row that scored an accepted
token holds the logits plain decoding computes at that position (row ``accepted_nodes[j]`` of a verified
tree scores the j-th token the step emits).

Costs one extra host copy in a step where some request asked, none in any other step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token's log-probability and its position's most likely tokens (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def __reduce__(self):  # positional: cheaper to send between processes than dataclasses' slots state
        return TokenLogprob, (self.token_id, self.logprob, self.top)


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [R, V] (any float dtype, any device); ``tokens[i]`` was emitted from row ``rows[i]``. Returns one
    ``TokenLogprob`` per token with the row's ``top`` most likely tokens, from one host copy."""
    if len(rows) != len(tokens):
        raise ValueError(f"{len(rows)} rows for {len(tokens)} tokens")
    if not rows:
        return []
    device = logits.device
    table = logprob_table(logits, torch.tensor(rows, device=device), torch.tensor(tokens, device=device), top)
    return parse_table(table.tolist(), tokens)  # the one host copy


def logprob_table(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """``token_logprobs``' device half: ``[n, 1 + 2 top]`` float64 on the logits' device, each token's
    log-probability under its row, then the row's ``top`` log-probabilities and their token ids (most likely
    first). ``rows`` and ``tokens``: ``[n]`` int64 on that device (an overlapped step's picks stay there)."""
    picked = logits.index_select(0, rows).float()  # [n, V]
    lse = torch.logsumexp(picked, dim=-1, keepdim=True)  # [n, 1]
    chosen = picked.gather(1, tokens[:, None]) - lse  # [n, 1]
    parts = [chosen.double()]
    if top:
        values, ids = picked.topk(min(top, picked.shape[-1]), dim=-1)  # [n, k], most likely first
        parts += [(values - lse).double(), ids.double()]  # ids < 2^53: exact in float64
    return torch.cat(parts, dim=1)


def parse_table(host: list[list[float]], tokens: list[int]) -> list[TokenLogprob]:
    """``logprob_table``'s rows, copied to the host, as ``TokenLogprob``s of ``tokens``."""
    k = (len(host[0]) - 1) // 2 if host else 0
    return [TokenLogprob(t, r[0], tuple(zip(map(int, r[1 + k :]), r[1 : 1 + k]))) for t, r in zip(tokens, host)]
