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


def adaptive_widths(template: tuple[int, ...], alpha: float, cfg: BudgetConfig,
                    probe: bool | Callable[[], bool] = False) -> tuple[int, ...]:
    """The template cut to the depths that pay at this acceptance, or a one-token probe when none does
    and ``probe`` (``probe_due``) says one is due. ``probe`` may be a function, asked only then: the
    scheduler runs this for every decoding sequence every step."""
    depth = 0
    while depth < len(template) and alpha ** (depth + 1) >= cfg.min_gain:
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


@dataclass(slots=True)
class _Block:
    """A speculation gate's running block at one batch bucket: its arm and what it has measured so far."""

    spec: bool
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class SpecGate:
    """Speculation's end-to-end A/B against plain decoding, per batch bucket: the check that no step price
    sees.

    ``StepCosts`` prices a draft level by the time of the steps that drafted. Some of what drafting costs
    shows in no such step: on a CUDA target plain steps run overlapped (gateway/overlap.py), a drafted step
    drains that pipeline, and the plain step after it starts a new one, paying its host work with the GPU
    idle; probes and lookups that keep nothing cost their steps too. On a lent H100 (SmolLM2-135M,
    ``engine_real_h100_2d5125e.json``) the default speculation ran at 0.85x of overlapped plain decoding at
    batch 1 under the depth caps alone. So the scheduler runs the two arms in blocks of ``block`` steps --
    speculation as the budget plans it, or every adaptive request plain with no probes -- measures each
    block's tokens per second, and runs the arm with the better EMA, the other one block in ``explore`` so
    that a change in either is seen. That share doubles, up to one block in ``max_explore``, until the losing
    arm's measured shortfall spread over it is at most ``overhead`` of the better arm's time (as probes are
    priced, ``probe_interval``): a loser by 15% is run one block in 16, by 50% one in 64. A bucket not yet
    measured inherits speculation's loss at a smaller one (``_inherited_loss``). Requests
    that fixed their own tree keep it in both arms: an A/B experiment's shape is not the gate's to change.

    The engine reports each step's decoding batch, emitted tokens and seconds (from the previous step's
    end: a plain step's overlapped host work counts once, where it ran). Each bucket runs its own block, fed
    by the steps at that bucket alone, so a batch size that wavers across a bucket's edge fills two blocks
    rather than cutting both short. Steps that also prefilled are not counted (a prompt's cost falls on
    whichever arm admitted it), nor steps where no decoding request speculates (both arms are the same step
    there)."""

    block: int = 32
    explore: int = 8
    decay: float = 0.7
    max_explore: int = 64
    overhead: float = 0.01
    _rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, spec?) -> EMA tokens / s
    _blocks: dict[int, int] = field(default_factory=dict)  # blocks completed per bucket
    _open: dict[int, _Block] = field(default_factory=dict)  # the running block per bucket
    _state: tuple | None = None  # ``state()`` until the next block completes (it is read after every step)

    def allows(self, batch: int) -> bool:
        """Whether adaptive requests may speculate in a step of ``batch`` decoding sequences (changes nothing)."""
        b = batch_bucket(batch)
        running = self._open.get(b)
        return running.spec if running is not None else self._arm(b)

    def observe(self, batch: int, tokens: int, seconds: float, counted: bool = True) -> None:
        """One engine step: ``batch`` decoding sequences, ``tokens`` emitted, ``seconds`` since the last step;
        ``counted`` False for a step the arms do not tell apart (see the class's docstring)."""
        if batch <= 0 or not counted:
            return
        b = batch_bucket(batch)
        running = self._open.get(b)
        if running is None:
            running = self._open[b] = _Block(self._arm(b))
        running.steps += 1
        running.tokens += tokens
        running.seconds += seconds
        if running.steps >= self.block:
            del self._open[b]
            if running.seconds > 0:
                key = (b, running.spec)
                rate = running.tokens / running.seconds
                old = self._rates.get(key)
                self._rates[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate
                self._blocks[b] = self._blocks.get(b, 0) + 1
                self._state = None

    def rate(self, batch: int, spec: bool) -> float | None:
        """The EMA of tokens per second of an arm at ``batch``'s bucket; None before its first block."""
        return self._rates.get((batch_bucket(batch), spec))

    def state(self) -> tuple[tuple[int, bool, int | None, int | None], ...]:
        """``summary`` as a tuple of (bucket, speculate, spec tokens/s, plain tokens/s), rates rounded to whole
        tokens: what the engine process sends the server when it changes (gateway/engine_proc.py)."""
        if self._state is None:
            self._state = tuple((int(b), v["speculate"], None if v["spec_tok_s"] is None else round(v["spec_tok_s"]),
                                 None if v["plain_tok_s"] is None else round(v["plain_tok_s"]))
                                for b, v in self.summary().items())
        return self._state

    def summary(self) -> dict[str, dict[str, float | bool | None]]:
        """Per bucket: each arm's tokens per second and the arm the gate prefers."""
        out: dict[str, dict[str, float | bool | None]] = {}
        for b in sorted({b for b, _ in self._rates}):
            on, off = self._rates.get((b, True)), self._rates.get((b, False))
            out[str(b)] = {"spec_tok_s": None if on is None else round(on, 1),
                           "plain_tok_s": None if off is None else round(off, 1), "speculate": self._better(b)}
        return out

    def _better(self, b: int) -> bool:
        on, off = self._rates.get((b, True)), self._rates.get((b, False))
        if on is None and self._inherited_loss(b) is not None:
            return False  # speculation lost at a smaller batch: plain first, speculation explored (``_arm``)
        if on is None or off is None:
            return on is None  # an arm never measured is measured next: speculation first
        return on >= off

    def _inherited_loss(self, b: int) -> float | None:
        """Speculation's shortfall against plain decoding (a share of plain's rate) at the largest smaller
        bucket that measured both arms, where speculation lost there; None otherwise. A larger batch leaves
        speculation less to gain (its verify rows cost more as the step turns compute-bound), so a bucket
        not yet measured starts from that verdict: plain decoding first, speculation explored one block in
        as many as the inherited loss allows, rather than a block of losing speculation first and then one
        in ``explore`` until its own rates say otherwise. Each new bucket of a server whose speculation
        loses thus stops paying that learning cost (on the lent H100 at d32cf22 the gate ran plain at every
        bucket, ``engine_real_h100_d32cf22.json``). Its own measurements replace the verdict."""
        c = b >> 1
        while c and not ((c, True) in self._rates and (c, False) in self._rates):
            c >>= 1
        if not c:
            return None
        on, off = self._rates[(c, True)], self._rates[(c, False)]
        return 1.0 - on / off if on < off else None

    def interval(self, batch: int) -> int:
        """One block in this many runs the losing arm at ``batch``'s bucket (see the class's docstring); a bucket
        that has not measured speculation yet but inherits a loss (``_inherited_loss``) explores it as often as
        that loss allows."""
        b = batch_bucket(batch)
        on, off = self._rates.get((b, True)), self._rates.get((b, False))
        if not (on and off):
            loss = self._inherited_loss(b) if on is None else None
            return self.explore if loss is None else doubled_interval(self.explore, self.max_explore, loss,
                                                                      self.overhead)
        return doubled_interval(self.explore, self.max_explore, 1.0 - min(on, off) / max(on, off), self.overhead)

    def _arm(self, b: int) -> bool:
        """The next block's arm at bucket ``b``: the better one, the other every ``interval``-th block."""
        better = self._better(b)
        k = self.interval(b)
        explore = self._blocks.get(b, 0) % k == k - 1
        measurable = (b, not better) in self._rates or (not better and self._inherited_loss(b) is not None)
        return not better if explore and measurable else better
