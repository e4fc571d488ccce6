"""CUDA graphs for decode, verify and draft steps.

A decode step (one new token per sequence) replays a graph captured for ``B``, the batch bucket that
holds its sequences. Any other step whose segments each bring at most ``max_nodes`` new tokens -- tree
verification, a drafter's catch-up and frontier steps -- replays a graph of ``T`` rows for at most ``B``
segments, laid out ragged: each segment's rows sit back to back, as the batch packs them, and the rows
past the batch's ``T`` tokens form one dummy segment (context 0, K/V written to the cache's scratch block,
never handed out by the pool) after the real ones; segments past it have no rows. The attention kernels
read every segment's offsets and lengths from device tensors (``tree_attention``'s ragged tile scheduler),
so one graph serves any split of ``T`` rows into segments. Steps with a longer segment (prefill) run
eagerly. Graphs share one memory pool and are captured on first use or up front (``capture``).

Ragged, not one padded tile a segment: a batch of 16 sequences where one drafts a 4-node tree is 19 rows,
which replay in 24 rows here; padding each segment to the longest (the layout before) replayed 64, and the
INT4 matmul's time grows with its rows past the knee (bench/results/int4_matmul_h100.json: 76.8 us a layer
at M=16, 101.9 at 32, 130.0 at 64). With per-request trees from the adaptive budget, mixed batches are the
common case, and a speculation-off request riding in one paid for every padded row.

Why this is safe to capture: every kernel in ``Transformer.forward`` sizes its grid from tensor shapes
alone (the attention kernels read lengths from device tensors), so a replay needs only copies into the
static inputs. Block tables are padded to ``max_blocks`` columns, the most a sequence can hold.
"""

from __future__ import annotations

import os

import torch

from kernels.graph_inputs import load_inputs, load_reference
from target.batch import ForwardBatch
from target.kv_cache import KVCache
from target.model import Transformer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def graph_shape(query_lens: tuple[int, ...], num_tokens: int, buckets: tuple[int, ...], max_nodes: int,
                max_tokens: int) -> tuple[int, int, bool] | None:
    """The graph ``(B, T, decode)`` a step replays, or None to run it eagerly. Decode steps take
    ``(bucket >= B, same, True)``. Other steps take the fewest rows ``T = b * 2**k`` (k >= 0, at most
    ``b * next_pow2(max_nodes)`` and ``max_tokens``) that hold their tokens, in a bucket ``b`` with a segment to
    spare for the padding rows (none needed when the rows fit exactly); the smaller bucket on a tie."""
    if not query_lens:
        return None
    B, longest = len(query_lens), max(query_lens)
    if longest > max_nodes:
        return None
    if longest == 1:
        b = next((b for b in buckets if b >= B), None)
        return None if b is None or b > max_tokens else (b, b, True)
    top = 1 << (max_nodes - 1).bit_length()
    best: tuple[int, int] | None = None  # (T, b)
    for b in buckets:
        if b < B or (best is not None and b > best[0]):
            continue
        t = b
        while t < num_tokens:
            t *= 2
        if t > min(max_tokens, b * top) or (t > num_tokens and b == B):
            continue  # past this bucket's graphs, or padding rows with no segment to hold them
        if best is None or (t, b) < best:
            best = (t, b)
    return None if best is None else (best[1], best[0], False)


# SPECGATE_GRAPH_LOAD=ops: a replay's inputs copied in as torch ops (11-15 launches) instead of one kernel (A/B).
ONE_LAUNCH = os.environ.get("SPECGATE_GRAPH_LOAD", "kernel") != "ops"


class _Graph:
    """One captured forward: ``T`` rows in at most ``B`` segments (``decode``: one row each), its static
    inputs and its output(s)."""

    def __init__(self, B: int, T: int, decode: bool, max_blocks: int, device: torch.device, features: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        self.B, self.T, self.decode = B, T, decode
        self.tokens = torch.zeros(T, **i64)
        self.positions = torch.zeros(T, **i64)
        self.slot_mapping = torch.zeros(T, **i64)
        self.mask_bits = None if decode else torch.zeros(T, **i64)
        self.block_tables = torch.zeros(B, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=device)
        # decode: segment i is row i; otherwise loaded per replay (the dummy segment takes the rows left)
        self.query_start = (torch.arange(B + 1, dtype=torch.int32, device=device) if decode else
                            torch.full((B + 1,), T, dtype=torch.int32, device=device))
        self.batch = ForwardBatch(
            tokens=self.tokens, positions=self.positions, slot_mapping=self.slot_mapping,
            block_tables=self.block_tables, context_lens=self.context_lens, query_start=self.query_start,
            mask_bits=self.mask_bits, logits_indices=torch.arange(T, **i64),
            logits_start=list(range(T + 1)), is_decode=decode, query_lens=(1,) * T)
        # A feature draft's second input, [T, hidden] (``Transformer.fc``); padding rows keep zeros.
        self.features = torch.zeros(T, features, device=device, dtype=dtype) if features else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # [T, V] float32
        self.hidden: torch.Tensor | None = None  # [T, hidden] when the runner returns features

    def load(self, batch: ForwardBatch, scratch: int, page_size: int,
             features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Copy ``batch`` into the static inputs: its rows first, as packed, then the padding rows (the
        dummy segment after its ``B`` real ones). Returns the graph rows of the batch's logits rows, or None
        when they are the first ``T`` rows in order."""
        T = batch.num_tokens
        if self.tokens.is_cuda and ONE_LAUNCH:
            load_inputs(self, batch, scratch, page_size)
        else:
            load_reference(self, batch, scratch, page_size)
        if self.features is not None:
            if features is not None:
                self.features[:T].copy_(features.to(self.features.dtype))
            self.features[T:].zero_()
        if batch.logits_rows == tuple(range(T)):
            return None
        return batch.logits_indices  # the batch's rows are the graph's first T: the same indices


class CudaGraphRunner:
    """``forward(batch, cache)`` with the contract of ``Transformer.forward`` (and ``forward_hidden``, when
    built with ``hidden=True``), replaying a graph whenever the step fits one. One runner per (model,
    cache): the graphs bake in the cache's tensors."""

    def __init__(self, model: Transformer, cache: KVCache, max_blocks: int, max_nodes: int = 64,
                 max_tokens: int = 1024, buckets: tuple[int, ...] = BATCH_BUCKETS, hidden: bool = False,
                 shared_logits: bool = False) -> None:
        self.model, self.cache, self.max_blocks, self.max_nodes = model, cache, max_blocks, max_nodes
        # Every graph writes its logits into one [max_tokens, V] buffer instead of holding its own [T, V]: with
        # the buckets up to 64 sequences and 64 nodes captured, the target's graphs hold 12,576 rows of float32
        # logits, 6.45 GB at a 128k vocabulary (10,937 rows before the ragged layout). A replay of any graph then overwrites the last one's logits,
        # which suits a caller that reads them before its next forward (the engine's target). The default keeps
        # one buffer a graph: a drafter runs several forwards a step, not audited for a read of one forward's
        # logits after a later one.
        self.shared_logits = shared_logits
        self._logits: torch.Tensor | None = None
        self.max_tokens = max_tokens  # a graph's logits are [T, V] float32: bound what they pin
        self.buckets = tuple(sorted(buckets))
        self.shape_buckets = self.buckets  # the buckets steps choose among (``capture`` narrows them)
        self.device = cache.k.device
        self.hidden = hidden  # graphs also return every row's feature (forward_hidden)
        self.pool = None  # the graphs' shared memory pool, made by the first capture
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}  # (B, T, decode)
        self.replays = 0
        self.eager = 0
        self.debug = False  # capture in CUDA's debug mode, so that ``graph.debug_dump(path)`` can write a DOT file

    def forward(self, batch: ForwardBatch, cache: KVCache, features: torch.Tensor | None = None) -> torch.Tensor:
        return self._forward(batch, cache, features, False)[0]

    def forward_hidden(self, batch: ForwardBatch, cache: KVCache,
                       features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.hidden:
            raise ValueError("this runner was built without hidden=True")
        logits, hidden = self._forward(batch, cache, features, True)
        return logits, hidden  # type: ignore[return-value]

    def _forward(self, batch: ForwardBatch, cache: KVCache, features: torch.Tensor | None,
                 want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits, and the rows' features when ``want_hidden`` (a graph of a ``hidden`` runner computes them
        either way). Graph outputs are views of static buffers: the next replay overwrites them."""
        key = self._key(batch, cache)
        if key is None:
            self.eager += 1
            if want_hidden:
                return self.model.forward_hidden(batch, cache, features)
            return self.model.forward(batch, cache, features), None
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        rows = g.load(batch, self.cache.scratch_block, self.cache.page_size, features)
        g.graph.replay()
        self.replays += 1
        T = batch.num_tokens
        hidden = g.hidden[:T] if want_hidden and g.hidden is not None else None
        if rows is None:  # every row, in order: no gather
            return g.out[:T], hidden
        return g.out.index_select(0, rows), hidden  # [R, V]

    def capture(self, max_batch: int, max_nodes: int | None = None) -> int:
        """Capture now every graph a step of up to ``max_batch`` sequences and ``max_nodes`` tokens each can
        replay (``graph_shape``): decode graphs for the buckets up to the one holding ``max_batch``, ragged
        graphs of ``b * 2**k`` rows for the buckets up to the one past it (its spare segment holds padding
        rows), so that no request pays for a capture -- or for the INT4 kernels' first-use tuning, which the
        capture's warm-up runs -- on its first step. Steps choose among these buckets from now on (a larger
        bucket's graph could hold some row counts in fewer rows, and would be captured mid-serving).
        Returns the graphs held."""
        top = 1 << (min(max_nodes or self.max_nodes, self.max_nodes) - 1).bit_length()
        decode_top = next((b for b in self.buckets if b >= max_batch), self.buckets[-1])
        tree_top = next((b for b in self.buckets if b > max_batch), self.buckets[-1])
        self.shape_buckets = tuple(b for b in self.buckets if b <= tree_top)
        for b in self.shape_buckets:
            if b <= min(decode_top, self.max_tokens) and (b, b, True) not in self._graphs:
                self._graphs[b, b, True] = self._capture(b, b, True)
            t = b
            while t <= min(self.max_tokens, b * top):
                if (b, t, False) not in self._graphs:
                    self._graphs[b, t, False] = self._capture(b, t, False)
                t *= 2
        return len(self._graphs)

    def _key(self, batch: ForwardBatch, cache: KVCache) -> tuple[int, int, bool] | None:
        if cache is not self.cache or batch.block_tables.shape[1] > self.max_blocks:
            return None
        if len(batch.logits_rows) != batch.logits_indices.shape[0]:
            return None
        return graph_shape(batch.query_lens, batch.num_tokens, self.shape_buckets, self.max_nodes, self.max_tokens)

    def _capture(self, B: int, T: int, decode: bool) -> _Graph:
        if self.shared_logits and self._logits is None:  # on the current stream, before any graph's warm-up
            head = self.model.lm_head.weight
            self._logits = torch.empty(self.max_tokens, head.shape[0], dtype=torch.float32, device=self.device)
        fc = self.model.fc
        g = _Graph(B, T, decode, self.max_blocks, self.device, 0 if fc is None else self.model.config.hidden_size,
                   self.model.dtype)
        scratch, P = self.cache.scratch_block, self.cache.page_size
        g.slot_mapping.fill_(scratch * P)
        g.block_tables.fill_(scratch)
        if g.mask_bits is not None:
            g.mask_bits.fill_(1)
            g.query_start.zero_()  # the warm-up and the capture: one dummy segment of every row
            g.query_start[1:].fill_(T)
        self._record(g)
        return g

    def _record(self, g: _Graph) -> None:
        """Capture ``g``'s forward into ``g.graph`` (its outputs into ``g.out`` / ``g.hidden``)."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its cache on a CUDA device")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g.graph = torch.cuda.CUDAGraph(keep_graph=True) if self.debug else torch.cuda.CUDAGraph()
        if self.debug:  # the captured graph kept (instantiated on its first replay) for debug_dump
            g.graph.enable_debug_mode()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune every kernel outside the capture
                self._run(g)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out, g.hidden = self._run(g)

    def _run(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self._logits[: g.T] if self._logits is not None else None
        if self.hidden:
            return self.model.forward_hidden(g.batch, self.cache, g.features, logits_out=out)
        return self.model.forward(g.batch, self.cache, g.features, logits_out=out), None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)
