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
    """Per-request speculation figures, reported with every response."""

    steps: int = 0  # target steps that emitted tokens for this request
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens the target kept (bonus tokens not counted)
    accepted_by_depth: list[int] = field(default_factory=list)  # accepted drafts at depth 1, 2, ...

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target step: accepted drafts plus the bonus token."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0


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

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.num_tokens - 1

    @property
    def remaining_tokens(self) -> int:
        return self.sampling.max_tokens - len(self.output_ids)
