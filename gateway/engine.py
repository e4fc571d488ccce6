"""The engine: one speculative step over every running sequence.

    plan = schedule(); trees = propose(plan); logits = target.forward(prefills + trees)
    results = accept_batch(trees, logits); commit(results)

On CUDA, a step whose segments hold at most 64 new tokens each replays a captured CUDA graph
(target/graphs.py). Every request without penalties is verified from one host copy for the whole
batch (verify/accept.py ``accept_batch``).

Single-threaded by design: ``add``, ``abort`` and ``step`` are called from one thread (the engine
thread in the server, the caller in ``LLM.generate``). ``gateway/runner.py`` adds the thread-safe
handoff. Every exit path of a sequence -- finished, aborted, failed, preempted -- goes through
``_release`` so its target and draft KV blocks return to their pools.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from draft.base import DraftRequest, Drafter
from draft.params import SpeculationParams
from draft.tree import MAX_TREE_NODES, TokenTree, cut_widths, graft_chains
from gateway import chain_ahead, overlap
from gateway.budget import drafter_set
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.sequence import Sequence, SpecStats, Status
from target.batch import Segment, build_batch
from target.graphs import CudaGraphRunner
from target.kv_cache import KVCache
from target.transfer import to_device
from target.model import Transformer, batch_invariant
from verify import processing
from verify.accept import AcceptResult, accept_batch
from verify.grammar import GrammarTokenizer, allowed_nodes, apply_masks, tree_masks
from verify.logprobs import TokenLogprob, token_logprobs
from verify.processing import PenaltyState, process_rows, stripped
from verify.sampling import SamplingParams, make_generator


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP 429)."""


@dataclass(slots=True)
class RequestOutput:
    """One event for one request: tokens emitted this step, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stats: SpecStats
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., with the first token, when asked
    stop_token: bool = False  # it ended at a stop token (EOS or stop_token_ids), the last of new_token_ids
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the request was admitted


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_blocks: int = 512
    page_size: int = 16
    scheduler: SchedulerConfig = SchedulerConfig()
    default_drafter: str | None = None  # used when a request names none; None = plain decoding
    default_tree: tuple[int, ...] = (2, 2, 2, 1)
    cuda_graphs: bool = True  # replay captured graphs for decode / verify / draft steps on CUDA
    capture_at_start: bool = False  # capture (and tune) every graph when the engine is built, not on first use
    forced_chains: bool = True  # a grammar's forced tokens become the speculating sequence's tree (_forced_chain)
    grammar_pruning: bool = True  # greedy constrained trees lose the nodes their grammar forbids (_prune)
    # Greedy trees grown on the device stay there until the acceptance's host copy; None: on CUDA only (on the
    # CPU the tensor ops run as they are issued, so deferring saves no wait and only adds its few extra ops).
    defer_trees: bool | None = None
    # Plain decoding steps launched before the last one's tokens reach the host (gateway/overlap.py): outputs
    # come one step later, and the host's work between steps runs while the GPU computes the next. None: on for
    # a one-process CUDA target (on the CPU a launch runs the whole forward before it returns, so there is
    # nothing to overlap; a tensor-parallel target's steps have not been run overlapped on GPUs).
    overlap: bool | None = None
    # Greedy n-gram chains drafted and verified with each step launched before the last one's tokens reach the
    # host (gateway/chain_ahead.py). Off: under the budget's adaptive depths the gate measured n-gram chains below
    # plain decoding on an H100, though fixed four-token chains ran 1.15-1.27x of it at batch 1 (ARCHITECTURE.md).
    chain_ahead: bool = False
    # Batch-invariant kernels (kernels/invariant.py): a row's logits do not depend on the rows beside it, so greedy
    # output with speculation equals plain decoding's token for token, and repeats whatever the batch (sampled output
    # too, where its drafting does: no speculation, or a fixed tree).
    # Slower: MMA tiles at M = 1, no tuning, branch nodes' attention again over their own paths. None: as
    # SPECGATE_BATCH_INVARIANT sets it (off by default).
    batch_invariant: bool | None = None


class Engine:
    def __init__(self, target: Transformer, drafters: dict[str, Drafter], config: EngineConfig,
                 eos_token_ids: tuple[int, ...] = (), tokenizer: Any = None) -> None:
        if config.default_drafter is not None and config.default_drafter not in drafters:
            raise ValueError(f"default drafter {config.default_drafter!r} is not loaded: have {sorted(drafters)}")
        config = replace(config, batch_invariant=batch_invariant(config.batch_invariant))  # the mode in force
        if config.batch_invariant:
            self._check_invariant(target)
        self.target = target
        self.drafters = drafters
        self.config = config
        self.eos_token_ids = eos_token_ids or target.config.eos_token_ids
        self.tokenizer = tokenizer  # Hugging Face; only structured output reads it (the grammar walks its tokens)
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self.cache: KVCache = target.new_cache(config.num_blocks, config.page_size)
        self.max_model_len = min(config.scheduler.max_model_len, target.config.max_position_embeddings)
        self.scheduler = Scheduler(replace(config.scheduler, max_model_len=self.max_model_len), self.cache.pool)
        # Feature drafters (EAGLE-style) are fed the target's feature at every verified position: the
        # target's forward then also returns every row's final-normed hidden state.
        self._feature_drafters = {n for n, d in drafters.items() if getattr(d, "wants_features", False)}
        if self._feature_drafters and not hasattr(target, "forward_hidden"):
            raise ValueError(f"drafters {sorted(self._feature_drafters)} read the target's features, which this "
                             "target does not return (a tensor-parallel target): load another drafter")
        self.graphs: CudaGraphRunner | None = None
        if config.cuda_graphs and isinstance(target, Transformer) and target.device.type == "cuda":
            max_blocks = -(-(self.max_model_len + MAX_TREE_NODES) // config.page_size)
            # Trees never exceed the verify cap; longer segments are prefill chunks and run eagerly.
            max_nodes = min(MAX_TREE_NODES, config.scheduler.budget.max_verify_tokens)
            # one logits buffer for every graph: the step reads its logits before the next target forward
            self.graphs = CudaGraphRunner(target, self.cache, max_blocks, max_nodes=max_nodes,
                                          hidden=bool(self._feature_drafters), shared_logits=True)
        if config.capture_at_start:
            self.capture_graphs()
        choosable = sorted(set(drafters) - self._feature_drafters)
        for name in config.scheduler.budget.gate_drafters or ():
            if name not in choosable:
                raise ValueError(f"the speculation gate cannot choose drafter {name!r}: it chooses among loaded "
                                 f"drafters that read no target features, here {choosable}")
        chain_ahead.prepare(self)
        self.scheduler.chains = partial(chain_ahead.could_run, self)  # False unless chain_ahead is on
        self._seqs: dict[str, Sequence] = {}
        # this step's sequences whose verified tree is not their drafter's own (a grammar-forced chain grafted in,
        # forbidden nodes dropped): the drafter's tree, each verified node's index in it (-1: not the
        # drafter's), and whether the step was forced
        self._own: dict[str, tuple[TokenTree, list[int], bool]] = {}
        self._forced_step = False
        # a launched step not yet resolved: plain (gateway/overlap.py) or a chain (gateway/chain_ahead.py)
        self._inflight: overlap.InFlight | chain_ahead.ChainInFlight | None = None
        self.num_ahead = 0  # steps launched before the step ahead of them was resolved
        # seconds the host waited on an overlapped step's picks: near zero while the host, not the GPU, bounds the step
        self.wait_s = 0.0
        self._ahead_t: float | None = None  # when the last step of an unbroken overlapped run was resolved
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_prefill_chunks = 0  # prompt chunks run so far (a step that ran one is no decode step's time)
        self._step_end: float | None = None  # when the last step() returned with work left

    @property
    def _defer_trees(self) -> bool:
        """``EngineConfig.defer_trees``, its default (None) resolved by the target's device."""
        defer = self.config.defer_trees
        return torch.device(self.target.device).type == "cuda" if defer is None else defer

    @property
    def overlaps(self) -> bool:
        """``EngineConfig.overlap``, its default (None) resolved by the target."""
        if self.config.overlap is not None:
            return self.config.overlap
        return isinstance(self.target, Transformer) and torch.device(self.target.device).type == "cuda"

    def draft_caches(self) -> list[KVCache]:
        """The model drafters' KV caches, each once (the hybrid drafters share their model drafter's)."""
        caches = (getattr(d, "cache", None) for d in self.drafters.values())
        return list({id(c): c for c in caches if isinstance(c, KVCache)}.values())

    def capture_graphs(self) -> int:
        """Capture the target's and the model drafters' graphs for every batch bucket up to max_running
        and every tree size up to the global verify cap. Returns how many graphs were captured."""
        if self.graphs is None:
            return 0
        sched = self.config.scheduler
        n = self.graphs.capture(sched.max_running)
        tree = self.config.default_tree
        for drafter in self.drafters.values():
            runner = getattr(drafter, "graphs", None)
            if runner is not None:
                n += runner.capture(sched.max_running)  # catch-up steps: up to its max_nodes tokens each
            loop = getattr(drafter, "loop", None)
            if loop is not None:  # the greedy tree loop, for the default tree and every depth the budget cuts it to
                held = 0
                for depth in range(1, len(tree) + 1):
                    held = loop.capture(sched.max_running, tree[:depth])
                n += held
        # The KV compaction runs outside the graphs: Triton builds (or loads) its kernel for each cache's
        # strides on first use, which was inside a timed step on the H200 (engine_real_a5ef89b.json: a 4.96 ms
        # step compiled _compact_kv_kernel). A move of each cache's scratch slot onto itself builds it now.
        for cache in [self.cache, *self.draft_caches()]:
            slot = cache.scratch_block * cache.page_size
            cache.compact_slots([slot], [slot])
        return n

    @property
    def batch_invariant(self) -> bool:
        """Whether this engine's kernels run batch-invariant (``EngineConfig.batch_invariant``, as resolved)."""
        return bool(self.config.batch_invariant)

    @staticmethod
    def _check_invariant(target: Transformer) -> None:
        """What batch-invariant mode cannot keep invariant, refused by name: a sharded target (its all-reduce chunks
        the rows by the batch's size)."""
        if not isinstance(target, Transformer):
            raise ValueError("batch-invariant mode needs a one-process target: a tensor-parallel target's all-reduce "
                             "sums each row in an order that follows the batch's size")

    # --- requests -------------------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
            speculation: SpeculationParams = SpeculationParams(), priority: int = 0,
            prefix_of: str | None = None) -> Sequence:
        """Validate and queue a request. Raises ValueError naming the bad field, QueueFull when full.

        ``prefix_of``: a live request with the same prompt (another choice of an n > 1 request). This one
        then waits for that one's prompt to enter the prefix cache and prefills only the rest, instead of
        computing the same prompt again beside it. Ignored when that request is gone or its prompt differs."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        V = self.target.config.vocab_size
        if any(not 0 <= t < V for t in prompt_ids):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {V})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; the context holds {self.max_model_len}, "
                             "leaving no room to generate")
        if -(-len(prompt_ids) // self.config.page_size) > self.config.num_blocks:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens cannot fit in the KV pool")
        drafter = speculation.drafter or self.config.default_drafter if speculation.enabled else None
        if drafter is not None and drafter not in self.drafters:
            raise ValueError(f"unknown drafter {drafter!r}: available are {sorted(self.drafters)}")
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= V:  # pairs are sorted by id
            raise ValueError(f"logit_bias names token {sampling.logit_bias[-1][0]}, outside the vocabulary [0, {V})")
        if sampling.allowed_token_ids and sampling.allowed_token_ids[-1] >= V:  # sorted
            raise ValueError(f"allowed_token_ids names token {sampling.allowed_token_ids[-1]}, outside the "
                             f"vocabulary [0, {V})")
        if sampling.allowed_token_ids and sampling.grammar is not None:
            raise ValueError("allowed_token_ids cannot be combined with structured output or a tool call: the "
                             "grammar may need a token the list leaves out")
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting")
        if sampling.min_tokens and sampling.grammar is not None:
            raise ValueError("min_tokens cannot be combined with structured output or a tool call: a grammar may "
                             "allow nothing but the end of the output before min_tokens")
        stops = frozenset(sampling.stop_token_ids) | frozenset(() if sampling.ignore_eos else self.eos_token_ids)
        if sampling.min_tokens and sampling.allowed_token_ids and stops.issuperset(sampling.allowed_token_ids):
            raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens holds back: no token "
                             "could be emitted")
        matcher = self._matcher(sampling.grammar) if sampling.grammar is not None else None
        seq = Sequence(request_id, list(prompt_ids), sampling, speculation,
                       make_generator(sampling, self.target.device), drafter, priority, stop_ids=stops)
        seq.matcher = matcher
        seq.verify_sampling = stripped(sampling) if sampling.custom_logits else sampling
        gate = self.scheduler.gate
        seq.follows_gate = (drafter is not None and not speculation.drafter and gate is not None and bool(gate.drafters)
                            and speculation.tree is None and speculation.max_nodes is None)
        leader = self._seqs.get(prefix_of) if prefix_of is not None else None
        if leader is not None and leader.prompt_ids == seq.prompt_ids:
            seq.prefix_leader = leader
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort")

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    @property
    def healthy(self) -> bool:
        """False once the target can run no more steps (a tensor-parallel rank died): every later step fails
        its requests at once, so /health should say so and the server be restarted."""
        return getattr(self.target, "healthy", True)  # a one-process Transformer cannot lose a rank

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. A failure fails only the sequences in this step; the pools stay whole. With
        ``EngineConfig.overlap``, a plain step's outputs come with the next call (gateway/overlap.py)."""
        start = time.perf_counter()
        gate = self.scheduler.gate
        # the batch the step plans with (the gate's bucket and arm are that batch's), before it ends any request
        decoding = [s for s in self.scheduler.running if not s.is_prefilling] if gate is not None else []
        # a step whose sequences changed drafter pays the new drafter's catch-up on their whole text: a cost of
        # the switch, not of the arm, so the gate does not count it (as it does not count prefill steps)
        switched = gate is not None and bool(gate.drafters) and self._follow_gate(gate.drafter(len(decoding)), decoding)
        chunks, launched = self.num_prefill_chunks, self.num_ahead
        outputs = self._step()
        end = time.perf_counter()
        if gate is not None:  # speculation's end-to-end A/B (gateway/budget.py SpecGate): the time since the
            # last step ended, so the host work between steps counts where it ran
            counted = (not switched and self.num_prefill_chunks == chunks and any(s.drafter for s in decoding)
                       and not self.scheduler.roots_fill_cap(len(decoding)))
            gate.observe(len(decoding), sum(len(o.new_token_ids) for o in outputs),
                         end - (start if self._step_end is None else self._step_end), counted,
                         ahead=self.num_ahead > launched)
        self._step_end = end if self.has_work() else None  # idle time between requests is nobody's step
        return outputs

    def _follow_gate(self, choice: str | None, decoding: list[Sequence]) -> bool:
        """This step's drafter for the adaptive requests that named none, as the speculation gate chose it
        (``SpecGate.drafters``; None: its plain arm, where they keep their drafter and draft nothing). A
        sequence whose drafter changes leaves the old one's state (its draft K/V freed: the new drafter catches
        up from the sequence's tokens, as after a preemption) and starts its acceptance estimate from the new
        drafter's. A step still pending for it (an overlapped plain step, a chain step) commits to the new
        drafter, which holds nothing of the sequence yet and keeps nothing of that commit. Whether any changed."""
        if choice is None:
            return False
        switched = False
        for seq in decoding:
            if seq.follows_gate and seq.drafter != choice:
                self.drafters[seq.drafter].release(seq.request_id)
                seq.drafter = choice
                seq.acceptance = self.scheduler.priors.start(choice)
                seq.template = None
                switched = True
        return switched

    def _step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._step_ahead()
        plan = self.scheduler.schedule(self._template_of)
        self.num_preemptions += len(plan.preempted)
        for seq in plan.preempted:
            self._release_draft(seq)
        ended = [self._finish(s, "length", error=None) for s in plan.exhausted]  # the KV pool cannot hold more
        if plan.empty:
            return ended
        seqs = [s for s, _ in plan.prefills] + [s for s, _ in plan.decodes]
        ahead = overlap.from_plan(self, plan) if self.overlaps else None
        chain = chain_ahead.from_plan(self, plan) if ahead is None else None
        if ahead is not None or chain is not None:
            try:
                self._inflight = (overlap.launch(self, ahead, None) if chain is None else
                                  chain_ahead.launch(self, chain))
            except Exception as exc:  # noqa: BLE001 -- as below
                return ended + [self._finish(s, "error", error=f"{type(exc).__name__}: {exc}") for s in seqs]
            return ended
        t0 = time.perf_counter()
        try:
            outputs = self._run(plan)
        except Exception as exc:  # noqa: BLE001 -- one bad step must not take the server down
            return [self._finish(s, "error", error=f"{type(exc).__name__}: {exc}") for s in seqs]
        # the acceptance's host copy ended the step: this is its full time (a step with forced chains ran no
        # drafter for them, so it does not price its depth)
        if not plan.prefills and not self._forced_step:
            depth = max(len(w) for _, w in plan.decodes)
            kinds = drafter_set(s.drafter for s, w in plan.decodes if w)
            self.scheduler.costs.observe(len(plan.decodes), depth, time.perf_counter() - t0, kinds)
        self.num_steps += 1
        return ended + outputs

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch the step after the pending one -- plain (gateway/overlap.py) or a chain (gateway/chain_ahead.py)
        -- where it can be planned now, then resolve the pending one; else resolve it and plan normally."""
        prev, self._inflight = self._inflight, None
        chain = isinstance(prev, chain_ahead.ChainInFlight)
        if chain:
            nxt = chain_ahead.continues(self, prev)
            seqs = [] if nxt is None else nxt.run.seqs + [s for s, _ in nxt.prefills]
        else:
            nxt = overlap.plan_ahead(self, prev)
            seqs = [] if nxt is None else nxt.ahead + nxt.host + [s for s, _ in nxt.prefills]
        failed: Exception | None = None
        if nxt is not None:
            try:
                self._inflight = chain_ahead.launch(self, nxt) if chain else overlap.launch(self, nxt, prev)
                self.num_ahead += 1
            except Exception as exc:  # noqa: BLE001 -- fails this step's sequences, once prev's tokens are theirs
                failed = exc
        outputs = chain_ahead.resolve(self, prev, successor=self._inflight) if chain else overlap.resolve(self, prev)
        # In an unbroken run of overlapped steps one step's time is the span between two resolutions: the
        # plain step's price the budget weighs drafts against (a draft level also breaks the run), or a chain's.
        now = time.perf_counter()
        if self._ahead_t is not None and not prev.prefilled:
            if chain:
                self.scheduler.costs.observe(len(prev.run.seqs), prev.run.K, now - self._ahead_t,
                                             chain_ahead.kinds(prev.run))
            else:
                self.scheduler.costs.observe(len(prev.seqs), 0, now - self._ahead_t)
        self._ahead_t = now if self._inflight is not None else None
        if failed is not None:
            outputs += [self._finish(s, "error", error=f"{type(failed).__name__}: {failed}")
                        for s in seqs if s.status is Status.RUNNING]
        if self._inflight is None and self.scheduler.has_work():
            outputs += self._step()  # prev is committed: plan as usual
        return outputs

    def _run(self, plan) -> list[RequestOutput]:
        trees = self._propose(plan.decodes)
        segments = [Segment(s.table, s.num_cached, s.token_ids[s.num_cached : s.num_cached + n],
                            logits="all" if self._scores_prompt(s) else "none") for s, n in plan.prefills]
        for (seq, _), tree in zip(plan.decodes, trees):
            ctx = seq.num_cached
            if tree.pending is not None:  # grown on the device: the batch takes those nodes from there
                p = tree.pending
                pad = [0] * p.rows.shape[1]
                segments.append(Segment(seq.table, ctx, [p.root, *pad, *p.tail[0]],
                                        positions=[ctx + d for d in p.depths], mask_bits=[1, *pad, *p.tail_bits()],
                                        logits="all", device_nodes=(1, p.rows[0], p.bits)))
                continue
            tokens, _, depths = tree.host()
            if len(tokens) == 1:  # plain decoding: causal defaults, no mask
                segments.append(Segment(seq.table, ctx, tokens, logits="all"))
                continue
            segments.append(Segment(seq.table, ctx, tokens, positions=[ctx + d for d in depths],
                                    mask_bits=tree.ancestor_bit_list(), logits="all"))
        batch = build_batch(segments, self.cache, self.target.device)
        runner = self.graphs if self.graphs is not None else self.target
        hidden = None
        if self._feature_drafters and any(s.drafter in self._feature_drafters
                                           for s, _ in plan.prefills + plan.decodes):
            logits, hidden = runner.forward_hidden(batch, self.cache)  # hidden: [T, hidden], every row
        else:
            logits = runner.forward(batch, self.cache)  # [R, V] float32, on the device
        first = len(plan.prefills)
        decoding = [seq for seq, _ in plan.decodes]
        raw = logits  # logprobs are the model's, before bias, penalties and any grammar
        starts = batch.logits_start[first:]
        batched = logits.is_cuda or processing.BATCHED_CPU  # bias and penalties for the whole step at once
        if batched and any(seq.sampling.custom_logits for seq in decoding):
            logits = self._process(logits, starts, decoding, trees)
        if any(seq.sampling.min_tokens > len(seq.output_ids) for seq in decoding):
            logits = self._hold_stops(logits, starts, decoding, trees)
        if any(seq.matcher is not None for seq in decoding):
            logits = self._constrain(logits, starts, decoding, trees)
        if batched:
            results = accept_batch(trees, logits, starts, [s.verify_sampling for s in decoding],
                                   [s.generator for s in decoding], [(None, None)] * len(decoding))
        else:  # each biased or penalised sequence processed and verified alone (verify/processing.py says why)
            results = accept_batch(trees, logits, starts, [s.sampling for s in decoding],
                                   [s.generator for s in decoding],
                                   [self._penalty_state(s, logits.device) for s in decoding])
        if hidden is not None:
            self._feed_features(plan, batch.query_lens, results, hidden)
        logprobs = self._logprobs(raw, batch.logits_start[first:], decoding, results)
        self._prompt_logprobs(raw, batch.logits_start, plan.prefills)
        self._advance_prefills(plan.prefills)
        return self._settle(decoding, trees, results, [len(w) for _, w in plan.decodes], logprobs)

    def _advance_prefills(self, prefills: list[tuple[Sequence, int]]) -> None:
        """Each prefilled chunk's tokens are cached (a chunk yields no token); full prompt blocks enter the
        prefix cache."""
        self.num_prefill_chunks += len(prefills)
        for seq, n in prefills:
            seq.num_cached += n
            seq.table.register_prefix(seq.token_ids, seq.num_cached)

    def _settle(self, decoding: list[Sequence], trees: list[TokenTree], results: list[AcceptResult],
                offered: list[int], logprobs: dict[int, list[TokenLogprob]], keep: int = 1) -> list[RequestOutput]:
        """The end of a step for its decoding sequences: each accepted path committed (``offered``: the draft
        levels each was given), the drafters flushed, the tokens emitted (``logprobs`` by index), the K/V
        compacted and the tables trimmed past each next root's slot (``keep`` slots from it: a chain step
        launched ahead writes its whole chain there). ``_run``'s, and an overlapped step's at its resolution
        (gateway/overlap.py, gateway/chain_ahead.py)."""
        moves: list[tuple[int, int]] = []
        for seq, tree, result, n in zip(decoding, trees, results, offered):
            moves += self._commit(seq, tree, result, n)
        for drafter in self.drafters.values():
            drafter.flush()  # before _emit: a finished sequence releases its draft blocks
        outputs = [self._emit(seq, result, logprobs.get(k)) for k, (seq, result) in enumerate(zip(decoding, results))]
        if moves:
            src, dst = zip(*moves)
            self.cache.compact_slots(list(src), list(dst))
        for seq in decoding:
            if seq.table is not None:  # blocks past the next root's slot go back only after compaction read them
                seq.table.truncate(seq.num_cached + keep)
        return outputs

    def _feed_features(self, plan, query_lens: tuple[int, ...], results: list[AcceptResult],
                       hidden: torch.Tensor) -> None:
        """Hand each feature drafter the target's features of the positions this step verified: every token
        of a prefill chunk, and the root and accepted nodes of a tree (one gather for the whole step)."""
        rows: list[torch.Tensor] = []  # host index pieces: each prefill chunk's rows, then every tree's
        spans: list[tuple[Sequence, int, int]] = []  # (sequence, first position, rows)
        start = 0
        for (seq, n), q in zip(plan.prefills, query_lens):
            if seq.drafter in self._feature_drafters:
                rows.append(torch.arange(start, start + n))
                spans.append((seq, seq.num_cached, n))
            start += q
        tree_rows: list[int] = []
        for (seq, _), q, result in zip(plan.decodes, query_lens[len(plan.prefills):], results):
            if seq.drafter in self._feature_drafters:
                tree_rows += [start + node for node in result.accepted_nodes]
                spans.append((seq, seq.num_cached, len(result.accepted_nodes)))
            start += q
        if tree_rows:
            rows.append(torch.tensor(tree_rows, dtype=torch.int64))
        if not rows:
            return
        # a copy, not views: under a graph replay ``hidden`` is a static buffer the next step overwrites
        picked = hidden.index_select(0, to_device(torch.cat(rows), hidden.device))
        lo = 0
        for seq, pos, n in spans:
            self.drafters[seq.drafter].observe(seq.request_id, pos, picked[lo : lo + n])
            lo += n

    @staticmethod
    def _logprobs(logits: torch.Tensor, starts: list[int], decoding: list[Sequence],
                  results: list[AcceptResult]) -> dict[int, list[TokenLogprob]]:
        """The emitted tokens' log-probabilities of every decoding sequence that asked (by index in
        ``decoding``), in one gather and one host copy for the step."""
        asked = [k for k, seq in enumerate(decoding) if seq.sampling.logprobs is not None]
        if not asked:
            return {}
        rows = [starts[k] + node for k in asked for node in results[k].accepted_nodes]
        tokens = [t for k in asked for t in results[k].tokens]
        entries = token_logprobs(logits, rows, tokens, max(decoding[k].sampling.logprobs for k in asked))
        out, lo = {}, 0
        for k in asked:
            n, top = len(results[k].tokens), decoding[k].sampling.logprobs
            out[k] = [TokenLogprob(e.token_id, e.logprob, e.top[:top]) for e in entries[lo : lo + n]]
            lo += n
        return out

    def _matcher(self, grammar: str) -> Any:
        """A parser state for a new request's grammar (the grammar tokenizer is built on first use)."""
        if self._grammar_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the target's tokenizer, which this engine was not given")
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.target.config.vocab_size)
        return self._grammar_tokenizer.matcher(grammar)

    def _constrain(self, logits: torch.Tensor, starts: list[int], decoding: list[Sequence],
                   trees: list[TokenTree]) -> torch.Tensor:
        """A copy of ``logits`` whose constrained sequences' tree rows allow only what their grammar allows
        after each node's path (verify/grammar.py); one host-to-device copy of the masks for the step."""
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        for k, seq in enumerate(decoding):
            if seq.matcher is None:
                continue
            tokens, parents, _ = trees[k].host()
            masks.append(tree_masks(seq.matcher, tokens, parents, self._grammar_tokenizer.words))
            rows += range(starts[k], starts[k + 1])
        out = logits.clone()
        apply_masks(out, rows, torch.cat(masks))
        return out

    @staticmethod
    def _hold_stops(logits: torch.Tensor, starts: list[int], decoding: list[Sequence],
                    trees: list[TokenTree], pending: list[int] | None = None) -> torch.Tensor:
        """A copy of ``logits`` in which no stop token can be chosen at a tree row that predicts an output token
        before ``min_tokens`` (vLLM's min_tokens): the row of a node at depth d predicts output token
        ``len(output_ids) + d``. Acceptance, greedy or sampled, then never keeps a stop token there, and a drafted
        one is rejected like any token the target would not produce. One host-to-device copy for the step.
        ``pending[k]``: tokens of sequence k picked but not yet emitted (an overlapped step's: gateway/overlap.py)."""
        rows: list[int] = []
        cols: list[int] = []
        for k, seq in enumerate(decoding):
            # nodes shallower than this may not stop
            short = seq.sampling.min_tokens - len(seq.output_ids) - (pending[k] if pending else 0)
            if short <= 0 or not seq.stop_ids:
                continue
            stops = sorted(seq.stop_ids)
            for node, depth in enumerate(trees[k].host_depths):
                if depth < short:
                    rows += [starts[k] + node] * len(stops)
                    cols += stops
        if not rows:
            return logits
        out = logits.clone()
        index = to_device(torch.tensor([rows, cols], dtype=torch.int64), logits.device)
        out[index[0], index[1]] = float("-inf")
        return out

    @staticmethod
    def _scores_prompt(seq: Sequence) -> bool:
        """The prefill chunk needs logits: prompt logprobs asked for and not all computed yet (a preempted
        sequence recomputes its prompt and output; only prompt positions count, each once)."""
        return seq.wants_prompt_logprobs and len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, starts: list[int], prefills: list[tuple[Sequence, int]]) -> None:
        """Append the prompt logprobs this step's prefill chunks computed: row i of a chunk at ``num_cached``
        scores token ``num_cached + i + 1``. One gather and one host copy for the step."""
        rows, tokens, owners = [], [], []
        for k, (seq, n) in enumerate(prefills):
            if starts[k + 1] == starts[k]:  # no logits asked for this chunk
                continue
            lo = len(seq.prompt_logprobs) + 1  # the first prompt token still to score
            hi = min(seq.num_cached + n, len(seq.prompt_ids) - 1)  # the last this chunk scores
            if lo <= seq.num_cached:  # positions before the chunk were never scored: none can be now
                continue
            for pos in range(lo, hi + 1):
                rows.append(starts[k] + pos - seq.num_cached - 1)
                tokens.append(seq.token_ids[pos])
                owners.append(seq)
        if not rows:
            return
        top = max(seq.sampling.prompt_logprobs for seq in owners)
        for seq, e in zip(owners, token_logprobs(logits, rows, tokens, top)):
            seq.prompt_logprobs.append(TokenLogprob(e.token_id, e.logprob, e.top[: seq.sampling.prompt_logprobs]))

    def _template_of(self, seq: Sequence) -> tuple[tuple[int, ...], bool]:
        """The tree template, and whether the adaptive budget may cut it: a tree or node budget the
        request set itself is kept (A/B experiments need the shape they asked for)."""
        if seq.template is None:
            spec = seq.speculation
            seq.template = ((), False) if not seq.drafter else (
                spec.widths(self.config.default_tree), spec.tree is None and spec.max_nodes is None)
        return seq.template

    def _propose(self, decodes: list[tuple[Sequence, tuple[int, ...]]]) -> list[TokenTree]:
        """Each decoding sequence's tree from its drafter; a root alone for plain decoding. A speculating
        sequence whose grammar forces its next tokens also verifies that chain (``_forced_chain``)."""
        trees: list[TokenTree | None] = [None] * len(decodes)
        by_drafter: dict[str, list[int]] = {}
        forced: dict[int, list[int]] = {}
        asked: dict[int, tuple[int, ...]] = {}  # the levels each speculating sequence asks its drafter for
        for i, (seq, widths) in enumerate(decodes):
            if seq.drafter and widths:
                chain = self._forced_chain(seq, widths) if self.config.forced_chains else []
                asked[i] = widths
                if chain:
                    forced[i] = chain
                    # greedy: the drafter's tree, cut to leave the chain its nodes, with the chain grafted in (as
                    # the hybrid drafter grafts a lookup); sampled: the chain alone (a sampled tree's children
                    # come from one distribution). With no levels asked, the drafter's state follows the step as
                    # after a lookup-first chain (draft/hybrid.py), and its next proposal catches up.
                    asked[i] = cut_widths(widths, len(chain)) if seq.sampling.is_greedy else ()
                by_drafter.setdefault(seq.drafter, []).append(i)
            else:
                trees[i] = TokenTree.root_only(seq.last_token)
        defer = self._defer_trees
        for name, idx in by_drafter.items():
            # A tree that nothing reads on the host before the target scores it (no grammar, no forced chain, no
            # bias or penalties) may stay on the device until the acceptance's host copy: then a speculative
            # step copies to the host once, as a plain step does.
            reqs = [DraftRequest(decodes[i][0].request_id, decodes[i][0].token_ids, asked[i], decodes[i][0].sampling,
                                 decodes[i][0].generator, defer=defer and i not in forced
                                 and decodes[i][0].matcher is None and not decodes[i][0].sampling.custom_logits)
                    for i in idx]
            for i, tree in zip(idx, self.drafters[name].propose(reqs)):
                trees[i] = tree
        self._own.clear()
        self._forced_step = bool(forced)
        for i, chain in forced.items():
            seq, own = decodes[i][0], trees[i]
            trees[i] = graft_chains(own, [chain]) if asked[i] else TokenTree.from_lists(
                [seq.last_token, *chain], list(range(-1, len(chain))))
            index = list(range(own.num_nodes)) if asked[i] else [0]  # grafted nodes come after the drafter's
            self._own[seq.request_id] = (own, index + [-1] * (trees[i].num_nodes - len(index)), True)
        for i, (seq, _) in enumerate(decodes):
            if (self.config.grammar_pruning and seq.matcher is not None and seq.sampling.is_greedy
                    and trees[i].num_nodes > 1):
                trees[i] = self._prune(seq, trees[i])
        return trees  # type: ignore[return-value]

    def _prune(self, seq: Sequence, tree: TokenTree) -> TokenTree:
        """A greedy constrained sequence's tree without the nodes its grammar forbids (verify/grammar.py)."""
        tokens, parents, _ = tree.host()
        keep = allowed_nodes(seq.matcher, tokens, parents)
        if len(keep) == len(tokens):
            return tree
        at = {old: new for new, old in enumerate(keep)}
        own, index, forced = self._own.get(seq.request_id, (tree, list(range(len(tokens))), False))
        self._own[seq.request_id] = (own, [index[k] for k in keep], forced)
        return TokenTree.from_lists([tokens[k] for k in keep], [-1] + [at[parents[k]] for k in keep[1:]])

    @staticmethod
    def _forced_chain(seq: Sequence, widths: tuple[int, ...]) -> list[int]:
        """The tokens the sequence's grammar forces next (llguidance's fast-forward tokens), at most as many as
        its tree budget holds: a chain the target verifies like any draft. Under the grammar's mask each is the
        only token its row allows, so verification keeps it (greedy or sampled) unless the target's own
        tokenization of the forced text differs, where the chain stops and the target's token wins -- lossless
        either way, with no draft forward (the idea of SGLang's jump-forward decoding, kept verified)."""
        if seq.matcher is None:
            return []
        return list(seq.matcher.compute_ff_tokens())[: sum(widths)]

    def _penalty_state(self, seq: Sequence, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-sequence path's penalty inputs: the prompt's tokens and the counts of tokens generated before
        the step's root (``accept`` counts the root and each row's path itself)."""
        if not seq.sampling.use_penalties:
            return None, None
        state = self._penalties_of(seq, device)
        before_root = state.counts.clone()
        before_root[seq.last_token] -= 1  # the root: the last output, or on the first step the prompt's last
        return state.prompt, before_root

    def _penalties_of(self, seq: Sequence, device: torch.device) -> PenaltyState:
        if seq.penalty is None:
            seq.penalty = PenaltyState.new(seq.sampling, seq.prompt_ids, seq.output_ids, self.target.config.vocab_size,
                                           device)
        return seq.penalty

    def _process(self, logits: torch.Tensor, starts: list[int], decoding: list[Sequence],
                 trees: list[TokenTree]) -> torch.Tensor:
        """A copy of ``logits`` with every biased or penalised sequence's tree rows processed in one batched pass
        (verify/processing.py); acceptance then verifies them in the batched groups."""
        ks = [k for k, seq in enumerate(decoding) if seq.sampling.custom_logits]
        return process_rows(logits, [(starts[k], starts[k + 1]) for k in ks], [decoding[k].sampling for k in ks],
                            [self._penalties_of(decoding[k], logits.device) for k in ks], [trees[k] for k in ks])

    def _commit(self, seq: Sequence, tree: TokenTree, result: AcceptResult, offered: int) -> list[tuple[int, int]]:
        """Advance the sequence past the accepted path; return the target's KV moves (src, dst). ``offered``:
        the draft levels the scheduler gave it this step."""
        nodes = result.accepted_nodes
        if tree.num_nodes == 1 and seq.request_id not in self._own:  # plain decoding: its one node kept in place
            seq.num_cached += 1
            if seq.drafter:
                self.drafters[seq.drafter].commit(seq.request_id, tree, nodes)
            self.scheduler.observe_step(seq, 0, 0, offered)
            seq.stats.record(1, [], nodes)
            return []
        ctx = seq.num_cached
        slots = seq.table.slots(ctx, ctx + tree.num_nodes)
        moves = [(slots[n], slots[d]) for d, n in enumerate(nodes) if n != d]
        seq.num_cached = ctx + len(nodes)
        _, parents, depths = tree.host()
        own = self._own.pop(seq.request_id, None)
        if own is None:
            if seq.drafter:
                self.drafters[seq.drafter].commit(seq.request_id, tree, nodes)
        else:  # the drafter keeps the path's nodes that are its own, up to the first that is not
            own_tree, index, forced = own
            path = [index[n] for n in nodes]
            self.drafters[seq.drafter].commit(seq.request_id, own_tree, path[: path.index(-1) if -1 in path else None])
            if forced:  # a forced chain says nothing of the drafter: no acceptance is observed
                seq.stats.record(tree.num_nodes, parents if len(nodes) > 1 else [], nodes)
                return moves
        self.scheduler.observe_step(seq, len(nodes) - 1, max(depths), offered)
        seq.stats.record(tree.num_nodes, parents if len(nodes) > 1 else [], nodes)  # ranks among siblings need the parents
        return moves

    def _emit(self, seq: Sequence, result: AcceptResult, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """Append the step's tokens, cut at a stop token or at max_tokens, finish when either hits."""
        new = result.tokens
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        keep, reason = len(new), None
        if not seq.stop_ids.isdisjoint(new):  # the scan below runs only on a hit
            keep, reason = next(i for i, t in enumerate(new) if t in seq.stop_ids) + 1, "stop"
        allowed = seq.sampling.max_tokens - len(seq.output_ids)
        if keep > allowed or (keep == allowed and reason is None):
            keep, reason = allowed, "length"
        new = new[:keep]
        error = None
        if seq.matcher is not None:  # the grammar sees each kept token; a stop token ends the output anyway
            for i, t in enumerate(new):
                if t in seq.stop_ids:
                    break
                if not seq.matcher.consume_token(t):  # cannot happen: every token came from a masked row
                    error = f"grammar: {seq.matcher.get_error()}"
                    break
                if seq.matcher.is_stopped():  # complete, admitting nothing more: the output ends here, as it
                    keep, reason = i + 1, "stop"  # would have in plain decoding (a chain may carry more)
                    break
            new = new[:keep]
        seq.output_ids += new
        if seq.penalty is not None:
            seq.penalty.emit(new[seq.counted_ahead :])
        seq.counted_ahead = 0
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if error is not None:
            out = self._finish(seq, "error", error=error)
            out.new_token_ids = new
            return out
        if reason is None:
            out = self._output(seq, new)
        else:
            out = self._finish(seq, reason)
            out.new_token_ids = new
            out.stop_token = reason == "stop" and bool(new) and new[-1] in seq.stop_ids  # not a grammar's end
        out.logprobs = None if logprobs is None else logprobs[:keep]
        if seq.wants_prompt_logprobs and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        return out

    # --- exits ----------------------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.scheduler.remove(seq)
        if seq.table is not None:
            seq.table.release()
            seq.table = None
        self._release_draft(seq)
        self._seqs.pop(seq.request_id, None)
        out = self._output(seq, [])
        out.finished, out.finish_reason, out.error = True, reason, error
        return out

    def _release_draft(self, seq: Sequence) -> None:
        for drafter in self.drafters.values():
            drafter.release(seq.request_id)

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(seq.request_id, new, False, None, seq.stats, None, len(seq.prompt_ids), len(seq.output_ids),
                             cached_tokens=seq.cached_prompt_tokens or 0)
