"""Per-request sampling: parameters, logit processing and draws.

Every function here is pure: it reads its tensors, returns new ones and draws randomness only from the
``torch.Generator`` it is handed, so a seeded request reproduces token for token.

Processing order (vLLM's): logit bias and penalties on raw logits, then temperature, min-p, top-k, top-p,
softmax.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from draft.tree import TokenTree


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling knobs (OpenAI names). Validates itself; ``ValueError`` names the field."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (after temperature); 0 = off
    seed: int | None = None  # None = a fresh random seed per request
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF/vLLM: divides positive / multiplies negative logits of seen tokens
    max_tokens: int = 16
    # vLLM's min_tokens: the stop tokens (EOS unless ignored, and stop_token_ids) cannot end the output before it
    # holds this many tokens; the gateway also ignores stop strings until then.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's logit_bias: (token id, bias) pairs added to the raw logits; a dict {id: bias} is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's allowed_token_ids: only these tokens can be emitted (every other logit is -inf after the bias);
    # empty = every token. Sorted, without repeats.
    allowed_token_ids: tuple[int, ...] = ()
    # Log-probabilities of each emitted token under the target's raw distribution, plus this many most likely
    # alternatives per position; None = none.
    logprobs: int | None = None
    # The same for every prompt token after the first (vLLM's prompt_logprobs; OpenAI's echo with logprobs).
    # A request with them computes its whole prompt: the prefix cache holds K/V, not logits.
    prompt_logprobs: int | None = None
    # Structured output: an llguidance grammar (verify/grammar.py compile_grammar) every emitted token must keep
    # the output inside; None = unconstrained.
    grammar: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # accept a list
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        checks = (
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an int >= 1"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"an int in [0, max_tokens = {self.max_tokens}]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an int or None"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "ints >= 0"),
            ("logit_bias", all(isinstance(t, int) and t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias),
             "token ids >= 0 with biases in [-100, 100]"),
            ("allowed_token_ids", all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids), "ints >= 0"),
            ("logprobs", _top_ok(self.logprobs), f"None or an int in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", _top_ok(self.prompt_logprobs), f"None or an int in [0, {MAX_LOGPROBS}]"),
        )
        for name, ok, rule in checks:
            if not ok:  # NaN fails every comparison above, so it lands here too
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def use_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def custom_logits(self) -> bool:
        """Penalties, a logit bias or allowed tokens: this request's logits need processing of their own before
        temperature (per tree path, for penalties), so the verifier decides it alone instead of in a batched
        group."""
        return bool(self.logit_bias) or bool(self.allowed_token_ids) or self.use_penalties


MAX_LOGPROBS = 20  # alternatives per position (vLLM's default max_logprobs; OpenAI's top_logprobs allows 20)


def _top_ok(top: Any) -> bool:
    return top is None or (type(top) is int and 0 <= top <= MAX_LOGPROBS)


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (id, bias) pairs, from a dict or pairs; the same id twice keeps the last."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        merged = {t: float(b) for t, b in items}
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    return tuple(sorted(merged.items()))


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded from ``params.seed``, or from fresh OS entropy when it is None."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_mask: torch.Tensor | None,
                    output_counts: torch.Tensor | None, path_counts: torch.Tensor | None = None) -> torch.Tensor:
    """Add the logit bias, then penalise repeated tokens (vLLM's order). Returns new float32 logits, or
    ``logits`` itself when there is no bias and every penalty is neutral.

    logits: [N, V]. prompt_mask: [V] bool, tokens in the prompt (None = none). output_counts: [V] int, counts
    of tokens already generated (None = none). path_counts: [N, V] int, extra per-row counts (the tree path
    of each node, see ``tree_path_counts``), added to ``output_counts``.
    Presence/frequency act on generated tokens only (OpenAI); repetition acts on prompt or generated tokens.
    """
    if not params.custom_logits:
        return logits
    out = logits.float()  # [N, V]
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        V = out.shape[-1]
        if max(ids) >= V:
            raise ValueError(f"logit_bias names token {max(ids)}, outside the vocabulary [0, {V})")
        out = out.index_add(-1, torch.tensor(ids, device=out.device),
                            torch.tensor(bias, device=out.device).expand(*out.shape[:-1], len(ids)))
    if params.allowed_token_ids:
        out = out + allowed_mask(params.allowed_token_ids, out.shape[-1], out.device)
    if not params.use_penalties:
        return out
    counts = torch.zeros(1, logits.shape[-1], dtype=torch.int64, device=logits.device)  # [1, V]
    if output_counts is not None:
        counts = counts + output_counts
    if path_counts is not None:
        counts = counts + path_counts  # [N, V]
    return penalise(out, counts, prompt_mask, params.repetition_penalty, params.frequency_penalty,
                    params.presence_penalty)


@functools.lru_cache(maxsize=16)
def allowed_mask(allowed: tuple[int, ...], vocab: int, device: torch.device | str) -> torch.Tensor:
    """[V] float32: 0 at the allowed token ids, -inf elsewhere (added to logits, it leaves only those). Cached:
    the per-sequence path asks for it every step; callers read it, never write it."""
    if allowed[-1] >= vocab:  # sorted
        raise ValueError(f"allowed_token_ids names token {allowed[-1]}, outside the vocabulary [0, {vocab})")
    mask = torch.full((vocab,), float("-inf"), device=device)
    mask[torch.tensor(allowed, device=device)] = 0.0
    return mask


def penalise(out: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor | None,
             repetition: float | torch.Tensor, frequency: float | torch.Tensor,
             presence: float | torch.Tensor) -> torch.Tensor:
    """The three penalties on float32 logits ``out`` [N, V], given each row's output counts [N or 1, V] and
    the prompt's tokens ([V] or [N, V] bool, or None). The knobs are numbers (one request: neutral ones are
    skipped) or [N, 1] tensors (a row each: verify/processing.py); both give the same values."""
    is_output = counts > 0  # [N or 1, V]
    if not _neutral(repetition, 1.0):
        is_seen = is_output if prompt_mask is None else is_output | prompt_mask
        out = torch.where(is_seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if not _neutral(frequency, 0.0):
        out = out - frequency * counts
    if not _neutral(presence, 0.0):
        out = out - presence * is_output
    return out


def _neutral(knob: float | torch.Tensor, value: float) -> bool:
    return not isinstance(knob, torch.Tensor) and knob == value


def tree_path_counts(tree: TokenTree, vocab_size: int) -> torch.Tensor:
    """[N, V] int64: counts[i, t] = how often token t occurs on the path root..i (both ends included).

    The logits at node i predict i's children, whose context ends with exactly that path, so row i is what
    node i's penalties must see on top of the tokens generated before the root.
    """
    on_path = tree.ancestor_mask().to(torch.float32)  # [N, N]
    one_hot = torch.nn.functional.one_hot(tree.tokens, vocab_size).to(torch.float32)  # [N, V]
    return (on_path @ one_hot).to(torch.int64)  # [N, V]; exact, counts are at most 64


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, softmax. logits: [N, V] (or [V]) -> probs, same shape, float32.

    Greedy params give the one-hot argmax. Min-p keeps the tokens whose probability is at least ``min_p``
    times the most likely one's (compared in log space: ``logit >= max + log(min_p)``). Top-k keeps ties with
    the k-th logit (so possibly more than k tokens); top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches ``top_p``. Each always keeps the most likely token.
    """
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    scaled = logits.float() / params.temperature  # [N, V]
    if params.min_p > 0:
        floor = scaled.max(dim=-1, keepdim=True).values + math.log(params.min_p)  # [N, 1]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1:
        scaled = _top_p(scaled, params.top_p)
    return torch.softmax(scaled, dim=-1)


def process_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 filtered: bool = True) -> torch.Tensor:
    """``process_logits`` with each leading row's own knobs, in device ops alone (capturable): logits [B, ..., V],
    temperature [B] (> 0), top_k [B] int64 (0 = off), top_p [B] (1 = off) -> probs, same shape, float32.
    Row b gives what ``process_logits(logits[b], SamplingParams(temperature[b], top_k[b], top_p[b]))`` gives
    (sampled rows only). ``filtered=False`` skips the sort when no row has top-k or top-p. No min-p: the draft's
    device tree loop proposes from this, and a draft distribution need not match the target's processing
    (verification is exact for any draft distribution; min-p is applied where it matters, to the target)."""
    shape = (-1,) + (1,) * (logits.dim() - 1)
    scaled = logits.float() / temperature.view(shape)
    if not filtered:
        return torch.softmax(scaled, dim=-1)
    V = logits.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).view(shape).expand(*scaled.shape[:-1], 1)
    kth = ordered.gather(-1, k - 1)  # ties with the k-th are kept, as torch.topk's k-th value keeps them
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # the nucleus is taken over what top-k kept
    probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = (mass_before >= top_p.view(shape)) & (top_p < 1).view(shape)
    drop = torch.zeros_like(drop).scatter(-1, order, drop) | (scaled < kth)
    return torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the nucleus. logits: [N, V] float32."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [N, V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly earlier tokens
    drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row: probs [V] -> [] or [N, V] -> [N], int64. Rows need not be normalised, but each
    needs some mass. ``sample_rows`` makes the same draws for rows that each have their own generator.

    Two exact draws, by where the cost lies. On CUDA, launches dominate: an exponential race, one fill of
    ``generator`` for the whole block (``race_argmax``). On the CPU, arithmetic does: one float64 uniform
    per row against the row's running sum (``inverse_cdf``), where the race would draw V numbers a row.
    """
    rows = probs.reshape(-1, probs.shape[-1])  # [N, V]
    if rows.is_cuda:
        out = race_argmax(rows, torch.empty(rows.shape, device=rows.device).exponential_(generator=generator))
    else:
        out = inverse_cdf(rows, torch.rand(rows.shape[0], generator=generator, dtype=torch.float64))
    return out.reshape(probs.shape[:-1])


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Row i drawn with ``generators[i]``: probs [N, V] -> [N] int64, each row the draw ``sample(probs[i],
    generators[i])`` makes. One small draw per generator, then one pass over every row: a batch of plain
    sampled decodes costs a launch per request, not a softmax and a multinomial each."""
    if probs.is_cuda:
        race = torch.empty(probs.shape, device=probs.device)  # [N, V]
        for row, generator in zip(race, generators):
            row.exponential_(generator=generator)
        return race_argmax(probs, race)
    return inverse_cdf(probs, torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]))


def race_scores(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """probs, race [N, V] (race ~ Exp(1) i.i.d.) -> [N, V] scores ``p_i / E_i``, -1 where ``p_i`` is 0: their
    argmax is a draw from p, their descending order successive draws without replacement (the exponential
    race; the Gumbel-max / Gumbel-top-k trick in another form). An exponential of exactly 0 makes a token
    with mass win (a valid draw) and never lets a zero-probability token win through 0 / 0."""
    return torch.where(probs > 0, probs / race, -1.0)


def race_argmax(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """One draw per row by ``race_scores`` (the bonus draw of ``verify.accept._stochastic_parallel`` too).
    Rows need some mass."""
    return race_scores(probs, race).argmax(-1)


def draws_without_replacement(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [..., V] (>= 0), u [..., k] float64 in [0, 1) -> ([..., k] int64, [..., k] bool): k successive
    draws without replacement, in draw order, each by ``inverse_cdf`` over what the earlier draws left; and
    whether each draw found mass left (False past the support, where its index means nothing). Draws in the
    order the exponential race's top-k ranks tokens (``race_scores``), from k uniforms a row instead of V
    exponentials: the CPU's form, where the race's V draws a row are the cost."""
    V, k = probs.shape[-1], u.shape[-1]
    rows = probs.reshape(-1, V).to(torch.float64, copy=True)  # [M, V]
    us = u.reshape(-1, k)
    out = torch.empty(rows.shape[0], k, dtype=torch.int64)
    ok = torch.empty(rows.shape[0], k, dtype=torch.bool)
    for j in range(k):
        ok[:, j] = rows.sum(-1) > 0
        out[:, j] = inverse_cdf(rows, us[:, j]).clamp_max(V - 1)  # an empty row draws V: past the end
        rows.scatter_(1, out[:, j : j + 1], 0.0)
    return out.view(u.shape), ok.view(u.shape)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (>= 0), u [N] float64 in [0, 1) -> [N]: the first index whose running sum exceeds ``u``
    times the row's total, so a zero-probability token is never drawn."""
    cdf = probs.to(torch.float64).cumsum(-1)  # [N, V]; float64: 49k float32 terms would drift by ~1e-3
    total = cdf[:, -1:]  # [N, 1]
    # u * total can round up to the total itself, past every token; the largest double below it cannot.
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [N, 1]
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)  # [N]
