"""Adaptive speculation: how many tree nodes each sequence gets this step. Plain Python, no torch.

Model: the draft's token at depth ``d`` is accepted, given its parent was, with probability ``alpha``
(the chain model of Leviathan et al. and the depth-wise acceptance of Sequoia). Depth ``d`` then adds
``alpha ** d`` expected tokens. A sequence keeps the template's depths whose expected gain is at least
``min_gain``; when even depth 1 falls short it decodes plainly, probing one draft token now and then so
it returns to speculation when the draft starts agreeing again. Probes fall on every ``interval``-th step
of the scheduler, for all due sequences at once: a draft level delays the whole batch, so probes spread
over different steps would put one on nearly every step of a large batch. The interval starts at
``probe_every`` and grows with what a probe costs here (``probe_interval``).

Speculation must also pay for its own time. A draft level costs a draft forward whatever it yields,
and on a small target or a large batch that can exceed what it saves. ``StepCosts`` measures this
engine's own step times per (batch bucket, draft depth, drafters in the step) and the scheduler caps
the adaptive requests' depth at the one that maximises expected tokens per second -- depth 0 (plain
decoding) included -- so speculation turns itself down where it does not pay, with no operator table.
The drafters are part of the key because a level's price is theirs: an n-gram level costs a host
lookup, a model level a draft forward, and one shared figure would price the free drafter out (or the
model in). A depth not measured yet, or not for ``reprobe`` steps, is tried when it could pay even at the
price of the shallower depths (``StepCosts.best_depth``); a figure's first observation (graph capture,
kernel tuning) is dropped.

The global cap keeps the verified tokens of a step (roots + draft nodes) at the INT4 matmul's knee:
past it the target's step cost grows with every node (bench/results/int4_matmul.json on the H200: 92 us
per layer at M=16, 116 at 32, 192 at 64), so the marginal node costs more than it can return.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass(slots=True)
class AcceptanceEMA:
    """Exponentially weighted successes / trials of the per-depth acceptance; prior alpha = 0.5."""

    successes: float = 1.0
    trials: float = 2.0
    decay: float = 0.8

    def update(self, accepted: int, depth: int) -> None:
        """A step that drafted ``depth`` levels and kept ``accepted`` of them: ``accepted`` successes,
        plus one failure when the path stopped short of the tree's depth."""
        if depth <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < depth else 0)

    @property
    def alpha(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0


@dataclass(slots=True)
class DrafterPriors:
    """Each drafter's acceptance over every request it drafted for (a slow EMA): a new request starts from
    its drafter's figure instead of the fixed prior of 0.5, with that prior's weight (two trials), so its own
    steps take over within a few drafts. On the H200 at 33ea0e8 the n-gram drafter kept almost nothing on
    MT-bench at batch 16 (1.01 tokens a step), yet new requests, starting at 0.5, were drafted four levels
    deep (engine_real.json: six depth-4 steps of 128, each 1.5x a plain step)."""

    decay: float = 0.98
    min_trials: float = 8.0  # fewer observed trials than this: the fixed prior
    _seen: dict[str, AcceptanceEMA] = field(default_factory=dict)

    def observe(self, drafter: str, accepted: int, depth: int) -> None:
        ema = self._seen.get(drafter)
        if ema is None:
            ema = self._seen[drafter] = AcceptanceEMA(successes=0.0, trials=0.0, decay=self.decay)
        ema.update(accepted, depth)

    def start(self, drafter: str | None) -> AcceptanceEMA:
        """A new request's acceptance estimate."""
        fresh = AcceptanceEMA()
        ema = self._seen.get(drafter) if drafter else None
        if ema is not None and ema.trials >= self.min_trials:
            fresh.successes = ema.alpha * fresh.trials
        return fresh


@dataclass(frozen=True, slots=True)
class BudgetConfig:
    max_verify_tokens: int = 64  # roots + draft nodes verified per step, over the whole batch
    min_gain: float = 0.2  # keep depth d while alpha ** d >= min_gain
    probe_every: int = 8  # plain-decode steps between one-level probes, at the least
    probe_overhead: float = 0.03  # probes may cost plain decoding this share of its time (see probe_interval)
    max_probe_every: int = 128  # the longest interval between probes, however dear they are
    cost_aware: bool = True  # cap draft depth by measured step time (StepCosts); False: acceptance alone
    reprobe: int = 256  # steps after which a depth's step time is measured again
    # A step that holds a request with speculation off costs it that step's time per token: such a step may
    # cost at most this share more than a plain step (the load issue's bound for A/B arms in one server).
    # None: no bound.
    plain_penalty: float | None = 0.05
    # ``SpecGate``: speculation's end-to-end A/B against plain decoding per batch bucket, in blocks of
    # ``gate_block`` steps, the losing arm run one block in ``gate_explore``. Off: the depth caps alone.
    gate: bool = True
    gate_block: int = 32
    gate_explore: int = 8
    # With the gate on, the drafters it chooses among for adaptive requests that name none, each an arm of
    # its own, in order of preference (``SpecGate.drafters``); empty: each request keeps the engine's default.
    # None: as the loader picks (gateway/llm.py: a loaded draft model and n-grams), else empty.
    gate_drafters: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_verify_tokens < 1:
            raise ValueError(f"max_verify_tokens must be >= 1, got {self.max_verify_tokens}")
        if not 0 <= self.min_gain <= 1:
            raise ValueError(f"min_gain must be in [0, 1], got {self.min_gain}")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every, got {self.probe_every} and "
                             f"{self.max_probe_every}")
        if self.probe_overhead <= 0:
            raise ValueError(f"probe_overhead must be > 0, got {self.probe_overhead}")
        if self.plain_penalty is not None and self.plain_penalty < 0:
            raise ValueError(f"plain_penalty must be >= 0 or None, got {self.plain_penalty}")
        if self.gate_block < 1 or self.gate_explore < 2:
            raise ValueError(f"need gate_block >= 1 and gate_explore >= 2, got {self.gate_block} and "
                             f"{self.gate_explore}")


def probe_interval(plain_s: float | None, probe_s: float | None, cfg: BudgetConfig) -> int:
    """Steps between probes, given a plain step's and a one-level step's measured seconds: ``probe_every``
    doubled until a probe's extra time spread over the interval is at most ``probe_overhead`` of a plain
    step (or ``max_probe_every`` is reached). A probe that mostly fails is pure cost: on the H200 a model
    draft's one-level step took 2.5x a plain step of SmolLM2 at batch 1, and a probe every 8 steps cost
    the default arm 12% (bench/results/engine_real_871c0a3.json). Unmeasured: ``probe_every``. Doubling keeps
    every interval a multiple of the shorter ones, so probe steps of different drafters coincide."""
    if plain_s is None or probe_s is None or plain_s <= 0:
        return cfg.probe_every
    return doubled_interval(cfg.probe_every, cfg.max_probe_every, max(probe_s / plain_s - 1.0, 0.0), cfg.probe_overhead)


def doubled_interval(k: int, cap: int, extra: float, overhead: float) -> int:
    """``k`` doubled until ``extra`` (a dear step's cost, as a share of a plain one) spread over the interval is
    at most ``overhead``, or ``cap`` is reached: the probes' interval and the speculation gate's exploring one."""
    while k < cap and extra / k > overhead:
        k *= 2
    return min(k, cap)


def probe_due(steps_without_draft: int, step: int, interval: int) -> bool:
    """Whether a sequence decoding plainly drafts one level at scheduler step ``step``: on the steps that
    are multiples of its probe ``interval``, once it has gone that many steps without drafting."""
    return step % interval == 0 and steps_without_draft + 1 >= interval


def drafter_set(names) -> tuple[str, ...]:
    """``StepCosts``' drafters key: the distinct drafter names given, sorted (None dropped)."""
    return tuple(sorted({n for n in names if n}))


AHEAD = "(ahead)"  # not a drafter's name: marks the step costs of overlapped chain runs (gateway/chain_ahead.py)


def ahead_kinds(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """``StepCosts``' key for an overlapped chain step of these drafters: priced apart from a tree step taken one
    by one, whose host work between steps the GPU waits out (a chain step's is hidden behind the step ahead)."""
    return (*kinds, AHEAD) if kinds else kinds


def adaptive_widths(template: tuple[int, ...], alpha: float, cfg: BudgetConfig,
                    probe: bool | Callable[[], bool] = False, min_gain: float | None = None) -> tuple[int, ...]:
    """The template cut to the depths that pay at this acceptance, or a one-token probe when none does
    and ``probe`` (``probe_due``) says one is due. ``probe`` may be a function, asked only then: the
    scheduler runs this for every decoding sequence every step. ``min_gain``: in place of the config's."""
    gain = cfg.min_gain if min_gain is None else min_gain
    depth = 0
    while depth < len(template) and alpha ** (depth + 1) >= gain:
        depth += 1
    if depth == 0 and template and (probe() if callable(probe) else probe):
        return (1,)
    return template[:depth]


def cap_total(widths: list[tuple[int, ...]], alphas: list[float], cap: int) -> list[tuple[int, ...]]:
    """Trim trees until ``sum(1 + nodes) <= cap``: the deepest level of the least promising tree first
    (lowest ``alpha ** depth``, the expected gain of that level; the first such tree on ties). Roots are
    never cut. A heap of the live trees: a large batch trims hundreds of levels a step, and a scan of
    every tree per level (with the depth cap's per-step sums) cost the H200's host about 1.6 ms a step at
    batch 64 -- spec-on ran at 0.70x of spec-off with every step plain, 0.98x with the heap."""
    out = [list(w) for w in widths]
    total = sum(1 + sum(w) for w in out)
    heap = [(alphas[i] ** len(w), i) for i, w in enumerate(out) if w]
    heapq.heapify(heap)
    while total > cap and heap:
        _, i = heapq.heappop(heap)
        w = out[i]
        excess = total - cap
        if w[-1] > excess:  # narrowing the last level is enough
            w[-1] -= excess
            total -= excess
            break
        total -= w.pop()
        if w:
            heapq.heappush(heap, (alphas[i] ** len(w), i))
    return [tuple(w) for w in out]


def expected_tokens(alpha: float, depth: int) -> float:
    """Tokens a step emits in expectation with ``depth`` draft levels: the bonus plus alpha ** d per level."""
    return sum(alpha**d for d in range(depth + 1))


def batch_bucket(n: int) -> int:
    """Power-of-two bucket of a batch size: step times are shared within one."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(slots=True)
class StepCosts:
    """EMA of measured step seconds per (batch bucket, draft depth, drafters): what a draft level costs here.
    ``drafters`` names the drafters whose trees the step verified (sorted); plain steps (depth 0) have none,
    so every drafter's cap compares against one shared plain-decoding figure."""

    decay: float = 0.8
    reprobe: int = 256
    steps: int = 0
    _seen: dict[tuple[int, int, tuple[str, ...]], tuple[float | None, int]] = field(default_factory=dict)

    @staticmethod
    def _key(batch: int, depth: int, drafters: tuple[str, ...]) -> tuple[int, int, tuple[str, ...]]:
        return batch_bucket(batch), depth, drafters if depth > 0 else ()

    def observe(self, batch: int, depth: int, seconds: float, drafters: tuple[str, ...] = ()) -> None:
        """One decode-only step of ``batch`` sequences whose deepest tree had ``depth`` levels."""
        self.steps += 1
        key = self._key(batch, depth, drafters)
        old = self._seen.get(key)
        if old is None:  # the first step at a shape pays for graph capture and tuning: not a figure
            self._seen[key] = (None, self.steps)
            return
        stale = old[0] is None or self.steps - old[1] > self.reprobe  # a re-measure replaces an old figure
        ema = seconds if stale else self.decay * old[0] + (1 - self.decay) * seconds
        self._seen[key] = (ema, self.steps)

    def seconds(self, batch: int, depth: int, drafters: tuple[str, ...] = ()) -> float | None:
        seen = self._seen.get(self._key(batch, depth, drafters))
        return None if seen is None else seen[0]

    def best_depth(self, batch: int, gains: list[float], floor: int = 0, drafters: tuple[str, ...] = (),
                   max_ratio: float | None = None) -> int:
        """The depth cap in ``floor..len(gains) - 1`` with the most expected tokens per second, where
        ``gains[c]`` is the step's expected tokens with the cap at ``c``.

        A depth with no fresh figure (never measured, or not for ``reprobe`` steps) is priced at the dearest
        fresh figure of a shallower depth: drafting deeper never makes a step cheaper, so that price can only
        flatter it. It is tried only when, flattered so, it still beats the best measured depth, and the
        shallowest such depth first: its figure then bounds the deeper ones. Trying every depth, deepest
        first, spent whole steps on four-level trees that could not pay (a fresh engine, or a batch bucket
        met for the first time); this way a drafter that does not pay costs one measured level per
        ``reprobe`` steps.

        ``max_ratio``: only depths whose step costs at most ``max_ratio`` times a plain step's (measured, or
        for an untried depth its lower bound) -- the batch holds requests that do not speculate and pay
        whatever the step costs. Depths up to ``floor`` (trees requests fixed themselves) are kept."""
        best, best_rate = floor, -1.0
        plain = self._fresh(batch, 0, drafters) if max_ratio is not None else None
        limit = None if plain is None else plain * max_ratio
        bound = 0.0  # the dearest fresh figure so far: a lower bound on any deeper step's time
        untried: list[tuple[int, float]] = []  # (depth, its cost lower bound)
        for c in range(len(gains)):
            cost = self._fresh(batch, c, drafters)
            if cost is not None:
                bound = max(bound, cost)
            if c < floor:
                continue
            if limit is not None and c > floor and bound > limit:
                break  # this depth, and every deeper one, costs the plain requests too much
            if cost is None:
                untried.append((c, bound))
                continue
            rate = gains[c] / cost
            if rate > best_rate:
                best, best_rate = c, rate
        for c, low in untried:  # shallowest first
            if low <= 0 or gains[c] / low > best_rate:
                return c
        return best

    def within(self, batch: int, depth: int, drafters: tuple[str, ...], max_ratio: float | None) -> bool:
        """Whether a step of ``depth`` levels costs at most ``max_ratio`` times a plain step, by fresh
        figures; True when either is unmeasured (or stale: the step re-measures it) or there is no bound."""
        if max_ratio is None:
            return True
        plain, cost = self._fresh(batch, 0, ()), self._fresh(batch, depth, drafters)
        return plain is None or cost is None or cost <= plain * max_ratio

    def _fresh(self, batch: int, depth: int, drafters: tuple[str, ...]) -> float | None:
        """The depth's step seconds, if measured within the last ``reprobe`` steps."""
        seen = self._seen.get(self._key(batch, depth, drafters))
        if seen is None or seen[0] is None or self.steps - seen[1] > self.reprobe:
            return None
        return seen[0]


PLAIN = "plain"  # the gate's plain-decoding arm
SPEC = "spec"  # its speculating arm where it chooses no drafter: each request drafts with its own


@dataclass(slots=True)
class _Block:
    """A speculation gate's running block at one batch bucket: its arm and what it has measured so far."""

    arm: str
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ahead: int = 0  # steps that launched the next one before resolving their own (overlapped)
    bucket: int = 0


@dataclass(slots=True)
class SpecGate:
    """Speculation's end-to-end A/B against plain decoding, per batch bucket: the check that no step price
    sees.

    ``StepCosts`` prices a draft level by the time of the steps that drafted. Some of what drafting costs
    shows in no such step: on a CUDA target plain steps run overlapped (gateway/overlap.py), a drafted step
    drains that pipeline, and the plain step after it starts a new one, paying its host work with the GPU
    idle; probes and lookups that keep nothing cost their steps too. On a lent H100 (SmolLM2-135M,
    ``engine_real_h100_2d5125e.json``) the default speculation ran at 0.85x of overlapped plain decoding at
    batch 1 under the depth caps alone. So the scheduler runs the arms in blocks of ``block`` steps --
    speculation as the budget plans it, or every adaptive request plain with no probes -- measures each
    block's tokens per second, and runs the arm with the better EMA, each other one a block in ``explore`` so
    that a change in any is seen. Once an arm has run ``confirm`` blocks that share doubles, up to one block in
    ``max_explore``, until the losing arm's measured shortfall spread over it is at most ``overhead`` of the
    better arm's time (as probes are priced, ``probe_interval``): a loser by 15% is run one block in 16, by 50%
    one in 64. A bucket not yet measured inherits an arm's loss at a smaller one (``_inherited_loss``). Requests
    that fixed their own tree keep it in every arm: an A/B experiment's shape is not the gate's to change.

    With ``drafters`` the gate also picks the drafter: each one is a speculating arm of its own (in order of
    preference: the first is measured first), run for the adaptive requests that named no drafter
    (``Engine._follow_gate``). A drafter that pays on one machine need not on another: in this project's CPU
    run the embedded pair's distilled draft paid 1.326x at batch 1 where n-grams paid 1.106x
    (``engine_real_cpu_gate_drafters.json``), while on a lent H100 the draft ran at 0.92-0.98x of plain decoding
    (``engine_real_h100_2d5125e.json``) and neither paid; there, exploring the draft cost the default 0.709x of
    speculation off at batch 16 (``engine_real_h100_fa9f052.json``), so the loader leaves CUDA targets without
    ``drafters`` (``gateway/llm.py default_gate_drafters``). Without ``drafters`` the speculating arm is ``SPEC``:
    every request drafts with its own drafter.

    The engine reports each step's decoding batch, emitted tokens and seconds (from the previous step's
    end: a plain step's overlapped host work counts once, where it ran). Each bucket runs its own block, fed
    by the steps at that bucket alone, so a batch size that wavers across a bucket's edge fills two blocks
    rather than cutting both short. Steps that also prefilled are not counted (a prompt's cost falls on
    whichever arm admitted it), nor steps where no decoding request speculates (every arm is the same step
    there)."""

    block: int = 32
    explore: int = 8
    drafters: tuple[str, ...] = ()
    decay: float = 0.7
    max_explore: int = 64
    overhead: float = 0.01
    confirm: int = 3  # an arm measured in fewer blocks than this comes back every ``explore`` blocks
    _rates: dict[tuple[int, str], float] = field(default_factory=dict)  # (bucket, arm) -> EMA tokens / s
    _sums: dict[tuple[int, str], float] = field(default_factory=dict)  # the EMA before its start correction
    _counts: dict[tuple[int, str], int] = field(default_factory=dict)  # blocks measured per (bucket, arm)
    _blocks: dict[int, int] = field(default_factory=dict)  # blocks completed per bucket
    _last: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, arm) -> the last block it ran
    _open: dict[int, _Block] = field(default_factory=dict)  # the running block per bucket
    _state: tuple | None = None  # ``state()`` until the next block completes (it is read after every step)
    # the last HISTORY completed blocks, oldest first (``history``): what each arm's rate was made of
    _history: deque = field(default_factory=lambda: deque(maxlen=SpecGate.HISTORY))
    HISTORY = 256

    def __post_init__(self) -> None:
        self.drafters = tuple(self.drafters)
        if len(set(self.drafters)) != len(self.drafters) or {PLAIN, SPEC} & set(self.drafters):
            raise ValueError(f"the gate's drafters must be distinct drafter names, got {list(self.drafters)}")

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms in order of preference: the speculating ones, then ``PLAIN``."""
        return (*(self.drafters or (SPEC,)), PLAIN)

    def arm(self, batch: int) -> str:
        """The arm of a step of ``batch`` decoding sequences: its bucket's running block's, else the next
        block's (changes nothing)."""
        b = batch_bucket(batch)
        running = self._open.get(b)
        return running.arm if running is not None else self._arm(b)

    def allows(self, batch: int) -> bool:
        """Whether adaptive requests may speculate in a step of ``batch`` decoding sequences (changes nothing)."""
        return self.arm(batch) != PLAIN

    def drafter(self, batch: int) -> str | None:
        """The drafter adaptive requests that named none draft with in a step of ``batch`` decoding sequences;
        None where the gate chooses none (no ``drafters``, or the plain arm)."""
        arm = self.arm(batch)
        return arm if arm in self.drafters else None

    def observe(self, batch: int, tokens: int, seconds: float, counted: bool = True, ahead: bool = False) -> None:
        """One engine step: ``batch`` decoding sequences, ``tokens`` emitted, ``seconds`` since the last step;
        ``counted`` False for a step the arms do not tell apart (see the class's docstring); ``ahead``: the step
        launched the next one before resolving its own (an overlapped step; recorded in ``history``)."""
        if batch <= 0 or not counted:
            return
        b = batch_bucket(batch)
        running = self._open.get(b)
        if running is None:
            running = self._open[b] = _Block(self._arm(b), bucket=b)
        running.steps += 1
        running.tokens += tokens
        running.seconds += seconds
        running.ahead += ahead
        if running.steps >= self.block:
            del self._open[b]
            self._history.append(running)
            n = self._blocks.get(b, 0)
            self._last[(b, running.arm)] = n
            self._blocks[b] = n + 1
            if running.seconds > 0:
                key = (b, running.arm)
                rate = running.tokens / running.seconds
                # an EMA corrected for its start at zero (as Adam corrects its moments): after n blocks the first
                # weighs decay ** (n - 1) * (1 - decay) / (1 - decay ** n), 0.41 after two blocks, not 0.7 -- a
                # first block is the least typical (the acceptance estimate restarting, the step costs exploring)
                n = self._counts.get(key, 0) + 1
                self._sums[key] = self.decay * self._sums.get(key, 0.0) + (1 - self.decay) * rate
                self._counts[key] = n
                self._rates[key] = self._sums[key] / (1 - self.decay ** n)
            self._state = None

    def rate(self, batch: int, arm: bool | str) -> float | None:
        """The EMA of tokens per second of ``arm`` at ``batch``'s bucket; None before its first block. True: the
        best speculating arm's; False: plain decoding's."""
        b = batch_bucket(batch)
        if arm is True:
            return self._best_spec(b)[1]
        return self._rates.get((b, PLAIN if arm is False else arm))

    def state(self) -> tuple[tuple[int, bool, int | None, int | None, str | None], ...]:
        """``summary`` as a tuple of (bucket, speculate, spec tokens/s, plain tokens/s, drafter), rates rounded
        to whole tokens: what the engine process sends the server when it changes (gateway/engine_proc.py)."""
        if self._state is None:
            self._state = tuple((int(b), v["speculate"], None if v["spec_tok_s"] is None else round(v["spec_tok_s"]),
                                 None if v["plain_tok_s"] is None else round(v["plain_tok_s"]), v.get("drafter"))
                                for b, v in self.summary().items())
        return self._state

    @property
    def completed_blocks(self) -> int:
        """Blocks completed so far over every bucket (``history`` keeps the last ``HISTORY`` of them)."""
        return sum(self._blocks.values())

    def history(self, last: int | None = None) -> list[dict]:
        """The completed blocks, oldest first (the last ``last``; at most ``HISTORY`` are kept): each one's bucket,
        arm, steps, overlapped steps, tokens, seconds and tokens per second -- what the arms' rates were made of
        (a plain block whose steps were not overlapped reads slower than plain decoding runs)."""
        blocks = list(self._history)[-last:] if last else list(self._history)
        return [{"bucket": k.bucket, "arm": k.arm, "steps": k.steps, "ahead": k.ahead, "tokens": k.tokens,
                 "seconds": round(k.seconds, 6), "tok_s": round(k.tokens / k.seconds, 1) if k.seconds > 0 else None}
                for k in blocks]

    def summary(self) -> dict[str, dict]:
        """Per bucket: the best speculating arm's and plain decoding's tokens per second and whether the gate
        prefers speculation; with ``drafters``, also the drafter it prefers and every arm's rate."""
        out: dict[str, dict] = {}
        for b in sorted({b for b, _ in self._rates}):
            name, on = self._best_spec(b)
            off = self._rates.get((b, PLAIN))
            better = self._better(b)
            out[str(b)] = {"spec_tok_s": None if on is None else round(on, 1),
                           "plain_tok_s": None if off is None else round(off, 1), "speculate": better != PLAIN}
            if self.drafters:
                out[str(b)]["drafter"] = better if better != PLAIN else name
                out[str(b)]["arms"] = {a: round(self._rates[(b, a)], 1) for a in self.arms if (b, a) in self._rates}
        return out

    def _best_spec(self, b: int) -> tuple[str | None, float | None]:
        """The speculating arm with the best rate at bucket ``b``, and that rate; (None, None) where none ran."""
        rated = [(self._rates[(b, a)], -i, a) for i, a in enumerate(self.arms[:-1]) if (b, a) in self._rates]
        if not rated:
            return None, None
        rate, _, name = max(rated)
        return name, rate

    def _untried(self, b: int, arm: str) -> bool:
        """Whether ``arm`` has not run at bucket ``b`` and inherits no loss there: it runs next, as the better."""
        return (b, arm) not in self._rates and (arm == PLAIN or self._inherited_loss(b, arm) is None)

    def _better(self, b: int) -> str:
        """The arm bucket ``b`` runs when it explores nothing: the first untried arm (in order of preference),
        else the best measured one (a tie goes to the preferred)."""
        rated = []
        for i, a in enumerate(self.arms):
            if self._untried(b, a):
                return a
            if (b, a) in self._rates:
                rated.append((self._rates[(b, a)], -i, a))
        return max(rated)[2]

    def _inherited_loss(self, b: int, arm: str) -> float | None:
        """Speculating ``arm``'s shortfall against plain decoding (a share of plain's rate) at the largest
        smaller bucket that measured both, where the arm lost there; None otherwise. A larger batch leaves
        speculation less to gain (its verify rows cost more as the step turns compute-bound), so a bucket
        not yet measured starts from that verdict: plain decoding first, the arm explored one block in
        as many as the inherited loss allows, rather than a block of losing speculation first and then one
        in ``explore`` until its own rates say otherwise. Each new bucket of a server whose speculation
        loses thus stops paying that learning cost (on the lent H100 at d32cf22 the gate ran plain at every
        bucket, ``engine_real_h100_d32cf22.json``). Its own measurements replace the verdict."""
        c = b >> 1
        while c and not ((c, arm) in self._rates and (c, PLAIN) in self._rates):
            c >>= 1
        if not c:
            return None
        on, off = self._rates[(c, arm)], self._rates[(c, PLAIN)]
        return 1.0 - on / off if on < off else None

    def interval(self, batch: int, arm: str | None = None) -> int:
        """One block in this many runs ``arm`` at ``batch``'s bucket where another arm is better (see the
        class's docstring): from its measured shortfall against the best arm, or from the loss it inherits
        where it has not run there; ``explore`` otherwise. None: the shortest over the arms not better."""
        b = batch_bucket(batch)
        if arm is None:
            better = self._better(b)
            return min((self.interval(b, a) for a in self.arms if a != better), default=self.explore)
        rate = self._rates.get((b, arm))
        if rate is None:
            loss = self._inherited_loss(b, arm) if arm != PLAIN else None
            return self.explore if loss is None else doubled_interval(self.explore, self.max_explore, loss,
                                                                      self.overhead)
        if self._counts[(b, arm)] < self.confirm:  # one block's figure is not yet a verdict
            return self.explore
        best = max(self._rates.get((b, a), 0.0) for a in self.arms)
        return doubled_interval(self.explore, self.max_explore, 1.0 - rate / best, self.overhead)

    def _arm(self, b: int) -> str:
        """The next block's arm at bucket ``b``: the better one, or an arm that has gone its ``interval`` of
        blocks without running there (measured, or inheriting a loss), the most overdue first."""
        better = self._better(b)
        n = self._blocks.get(b, 0)
        due = []
        for i, a in enumerate(self.arms):
            if a == better or self._untried(b, a):
                continue
            late = n - self._last.get((b, a), -1) - self.interval(b, a)
            if late >= 0:
                due.append((late, -i, a))
        return max(due)[2] if due else better

