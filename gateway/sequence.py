"""A request inside the engine: plain Python state, owned and mutated by the engine thread only."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.budget import AcceptanceEMA
from target.blocks import BlockTable

if TYPE_CHECKING:  # the scheduler imports this module and stays free of torch
    from draft.params import SpeculationParams
    from verify.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"  # holds KV blocks: prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class SpecStats:
    """Per-request speculation figures, reported with every response. Mutated by the engine thread only
    (``record``); the runner hands copies to the event loop."""

    steps: int = 0  # target steps that emitted tokens for this request
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens the target kept (bonus tokens not counted)
    accepted_by_depth: list[int] = field(default_factory=list)  # accepted drafts at depth 1, 2, ...
    verified_nodes: int = 0  # tree nodes the target scored in decode steps, roots included
    accepted_by_rank: list[int] = field(default_factory=list)  # accepted drafts that were their parent's r-th child

    def __reduce__(self):
        # positional, not dataclasses' slots state: an engine process sends one per event (gateway/engine_proc.py)
        return SpecStats, (self.steps, self.drafted_tokens, self.accepted_tokens, self.accepted_by_depth,
                           self.verified_nodes, self.accepted_by_rank)

    def record(self, num_nodes: int, parents: list[int], nodes: list[int]) -> None:
        """One decode step: a tree of ``num_nodes`` nodes (``parents`` as in ``TokenTree``; may be empty when
        nothing was accepted) was verified and ``nodes`` (root first) is the accepted path."""
        self.steps += 1
        self.drafted_tokens += num_nodes - 1
        self.accepted_tokens += len(nodes) - 1
        self.verified_nodes += num_nodes
        for depth in range(1, len(nodes)):
            _bump(self.accepted_by_depth, depth - 1)
            _bump(self.accepted_by_rank, sibling_rank(parents, nodes[depth]))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step: accepted drafts plus the bonus token."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def kept_nodes(self) -> int:
        """Verified nodes that emitted a token: each step's root and its accepted drafts."""
        return self.accepted_tokens + self.steps

    @property
    def wasted_nodes(self) -> int:
        """Verified nodes whose scores were thrown away: rejected drafts and their subtrees."""
        return self.verified_nodes - self.kept_nodes

    @property
    def utilisation(self) -> float:
        """Kept ÷ verified nodes: 1.0 when nothing verified was wasted (plain decoding, or every draft kept)."""
        return self.kept_nodes / self.verified_nodes if self.verified_nodes else 0.0

    @property
    def steps_by_accepted_depth(self) -> list[int]:
        """Steps that accepted exactly 0, 1, 2, ... drafts (a histogram of the accepted depth per step)."""
        at_least = [self.steps, *self.accepted_by_depth]  # at_least[d]: steps that reached depth d
        return [at_least[d] - (at_least[d + 1] if d + 1 < len(at_least) else 0) for d in range(len(at_least))]

    def since(self, before: "SpecStats") -> "SpecStats":
        """The figures added after ``before`` (an earlier copy of these)."""
        return SpecStats(self.steps - before.steps, self.drafted_tokens - before.drafted_tokens,
                         self.accepted_tokens - before.accepted_tokens,
                         _minus(self.accepted_by_depth, before.accepted_by_depth),
                         self.verified_nodes - before.verified_nodes,
                         _minus(self.accepted_by_rank, before.accepted_by_rank))

    def add(self, other: "SpecStats") -> None:
        self.steps += other.steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.verified_nodes += other.verified_nodes
        for mine, theirs in ((self.accepted_by_depth, other.accepted_by_depth),
                             (self.accepted_by_rank, other.accepted_by_rank)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    def copy(self) -> "SpecStats":
        return SpecStats(self.steps, self.drafted_tokens, self.accepted_tokens, list(self.accepted_by_depth),
                         self.verified_nodes, list(self.accepted_by_rank))


def sibling_rank(parents: list[int], node: int) -> int:
    """The index of ``node`` among its parent's children, 0 = the first the drafter added. Children are in
    the order the drafter added them because every node's parent is an earlier node."""
    parent = parents[node]
    return sum(1 for p in parents[1:node] if p == parent)


def _minus(after: list[int], before: list[int]) -> list[int]:
    return [n - (before[i] if i < len(before) else 0) for i, n in enumerate(after)]


def _bump(counts: list[int], index: int) -> None:
    counts.extend([0] * (index + 1 - len(counts)))
    counts[index] += 1


@dataclass(slots=True)
class Sequence:
    """Token flow: the prompt's first ``len - 1`` tokens are prefilled; from then on the last token is the
    *pending* root of each step's tree, and ``num_cached == len(token_ids) - 1`` holds between steps."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    speculation: SpeculationParams
    generator: Any  # torch.Generator, the request's own randomness
    drafter: str | None  # the drafter's name; None = plain decoding
    priority: int = 0  # lower runs first; aging lifts waiting requests so none starves
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached: int = 0  # target tokens whose K/V are in the cache
    table: BlockTable | None = None  # the target cache's blocks, while RUNNING
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    acceptance: AcceptanceEMA = field(default_factory=AcceptanceEMA)  # live per-depth acceptance
    steps_without_draft: int = 0  # decode steps since the last drafted tree (adaptive fallback)
    # (tree template, may the budget cut it): fixed for the request's life; the engine's template_of fills it on
    # first use, since the scheduler asks for it every step for every decoding sequence
    template: tuple[tuple[int, ...], bool] | None = None
    # An adaptive request that named no drafter, under a gate that chooses drafters: ``drafter`` follows the
    # gate's choice step by step (Engine._follow_gate)
    follows_gate: bool = False
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request (its stop ids, EOS unless ignored)
    # A sibling with the same prompt (a choice of the same n > 1 request): this one is admitted only once
    # the leader's prompt is in the prefix cache, and then prefills only what the cache does not hold.
    prefix_leader: "Sequence | None" = None
    # With sampling.prompt_logprobs: entries for prompt tokens 1.. as prefill computes them (TokenLogprob),
    # handed out once with the first emitted token.
    prompt_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Prompt tokens the prefix cache held at the first admission (OpenAI's usage.prompt_tokens_details.cached_tokens);
    # None until admitted. A recompute after preemption does not change it: the count is what the client saved.
    cached_prompt_tokens: int | None = None
    matcher: Any = None  # with sampling.grammar: the llguidance parser state after the emitted tokens
    penalty: Any = None  # with a bias or penalties: verify.processing.PenaltyState, made at the first decode
    # tokens ``penalty`` counted on the device before they were emitted (an overlapped step's pending pick,
    # counted when the step after it was launched: gateway/overlap.py); emitting them does not count them again
    counted_ahead: int = 0
    verify_sampling: Any = None  # what acceptance sees: sampling, less what the step's processing applied

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        """``token_ids[-1]`` without building the list: the root of the sequence's next step."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return getattr(self.sampling, "prompt_logprobs", None) is not None

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.num_tokens - 1

    @property
    def waits_for_leader(self) -> bool:
        """The leader is still to prefill its prompt (waiting, preempted, or prefilling)."""
        leader = self.prefix_leader
        return leader is not None and leader.status != Status.FINISHED and (
            leader.status == Status.WAITING or leader.is_prefilling)

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.output_ids)
