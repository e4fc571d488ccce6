"""CUDA graphs for decode, verify and draft steps.

A step whose segments each bring at most ``max_nodes`` new tokens -- plain decoding, tree verification,
a drafter's catch-up and frontier steps -- replays a graph captured for ``(B, N)``: ``B`` the batch
bucket, ``N`` the power of two that holds the longest segment. Each segment gets ``N`` rows: its own
tokens first, then padding that writes its K/V to the cache's scratch block (never handed out by the
pool), sees only its segment's first node, and is never seen by a real row (causal rows see earlier
rows only, tree rows only their ancestors). Padded segments up to ``B`` have context 0 and read the
scratch block. The graph computes logits for every row; the rows the batch asked for are gathered out.
Steps with a longer segment (prefill) run eagerly. Graphs share one memory pool and are captured on
first use.

Why this is safe to capture: every kernel in ``Transformer.forward`` sizes its grid from tensor shapes
alone (the attention kernels read lengths from device tensors), so a replay needs only copies into the
static inputs. Block tables are padded to ``max_blocks`` columns, the most a sequence can hold.
"""

from __future__ import annotations

import torch

from target.batch import ForwardBatch
from target.kv_cache import KVCache
from target.model import Transformer
from target.transfer import to_device

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class _Graph:
    """One captured forward at (B, N): its static inputs and its output(s)."""

    def __init__(self, B: int, N: int, max_blocks: int, device: torch.device, features: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        T = B * N
        i64 = dict(dtype=torch.int64, device=device)
        self.B, self.N = B, N
        self.tokens = torch.zeros(T, **i64)
        self.positions = torch.zeros(T, **i64)
        self.slot_mapping = torch.zeros(T, **i64)
        self.mask_bits = torch.zeros(T, **i64) if N > 1 else None
        self.block_tables = torch.zeros(B, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.batch = ForwardBatch(
            tokens=self.tokens, positions=self.positions, slot_mapping=self.slot_mapping,
            block_tables=self.block_tables, context_lens=self.context_lens,
            query_start=torch.arange(0, T + 1, N, dtype=torch.int32, device=device),
            mask_bits=self.mask_bits, logits_indices=torch.arange(T, **i64),
            logits_start=list(range(0, T + 1, N)), is_decode=N == 1, query_lens=(N,) * B)
        # A feature draft's second input, [T, hidden] (``Transformer.fc``); padding rows keep zeros.
        self.features = torch.zeros(T, features, device=device, dtype=dtype) if features else None
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None  # [T, V] float32
        self.hidden: torch.Tensor | None = None  # [T, hidden] when the runner returns features


class CudaGraphRunner:
    """``forward(batch, cache)`` with the contract of ``Transformer.forward`` (and ``forward_hidden``, when
    built with ``hidden=True``), replaying a graph whenever the step fits one. One runner per (model,
    cache): the graphs bake in the cache's tensors."""

    def __init__(self, model: Transformer, cache: KVCache, max_blocks: int, max_nodes: int = 64,
                 max_tokens: int = 1024, buckets: tuple[int, ...] = BATCH_BUCKETS, hidden: bool = False) -> None:
        if cache.k.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and its cache on a CUDA device")
        self.model, self.cache, self.max_blocks, self.max_nodes = model, cache, max_blocks, max_nodes
        self.max_tokens = max_tokens  # a graph's logits are [B * N, V] float32: bound what they pin
        self.buckets = tuple(sorted(buckets))
        self.device = cache.k.device
        self.hidden = hidden  # graphs also return every row's feature (forward_hidden)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0
        self.eager = 0

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
        rows, token_rows = self._load(g, batch, features)
        g.graph.replay()
        self.replays += 1
        hidden = None
        if want_hidden and g.hidden is not None:
            hidden = g.hidden[: batch.num_tokens] if token_rows is None else g.hidden.index_select(0, token_rows)
        if rows is None:  # every row, in order: no gather
            return g.out[: batch.num_tokens], hidden
        return g.out.index_select(0, rows), hidden  # [R, V]

    def capture(self, max_batch: int, max_nodes: int | None = None) -> int:
        """Capture now every (batch bucket, nodes) graph up to ``max_batch`` sequences and ``max_nodes``
        tokens each (powers of two), so that no request pays for a capture -- or for the INT4 kernels'
        first-use tuning, which the capture's warm-up runs -- on its first step. Returns the graphs held."""
        top = min(max_nodes or self.max_nodes, self.max_nodes)
        for B in self.buckets:
            N = 1
            while N < 2 * top and B * N <= self.max_tokens:  # up to the power of two that holds ``top``
                if (B, N) not in self._graphs:
                    self._graphs[B, N] = self._capture(B, N)
                N *= 2
            if B >= max_batch:
                break
        return len(self._graphs)

    def _key(self, batch: ForwardBatch, cache: KVCache) -> tuple[int, int] | None:
        lens = batch.query_lens
        if cache is not self.cache or not lens or batch.block_tables.shape[1] > self.max_blocks:
            return None
        longest = max(lens)
        if longest > self.max_nodes or len(batch.logits_rows) != batch.logits_indices.shape[0]:
            return None
        N = 1 << (longest - 1).bit_length()
        B = next((b for b in self.buckets if b >= len(lens)), None)
        return None if B is None or B * N > self.max_tokens else (B, N)

    def _load(self, g: _Graph, batch: ForwardBatch,
              features: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Copy the batch into the static inputs. Returns the graph rows of the batch's logits rows, or
        None when they are simply the first ``T`` rows (every segment full, every row wanted); and the
        graph rows of the batch's tokens, or None when they are the first ``T``."""
        T, B, N = batch.num_tokens, len(batch.query_lens), g.N
        scratch, P = self.cache.scratch_block, self.cache.page_size
        dense = all(n == N for n in batch.query_lens)
        if dense:
            g.tokens[:T].copy_(batch.tokens)
            g.positions[:T].copy_(batch.positions)
            g.slot_mapping[:T].copy_(batch.slot_mapping)
            if g.mask_bits is not None and batch.mask_bits is not None:
                g.mask_bits[:T].copy_(batch.mask_bits)
            elif g.mask_bits is not None:
                g.mask_bits[:T].zero_()  # 0 = causal
            if g.features is not None and features is not None:
                g.features[:T].copy_(features)
            pad_from = T
            idx = None
        else:
            dst = [i * N + j for i, n in enumerate(batch.query_lens) for j in range(n)]
            idx = to_device(torch.tensor(dst, dtype=torch.int64), self.device)
            g.tokens.zero_()
            g.positions.zero_()
            g.slot_mapping.fill_(scratch * P)
            g.tokens.index_copy_(0, idx, batch.tokens)
            g.positions.index_copy_(0, idx, batch.positions)
            g.slot_mapping.index_copy_(0, idx, batch.slot_mapping)
            if g.mask_bits is not None:
                g.mask_bits.fill_(1)  # padding sees its segment's first node only: finite, and unused
                bits = batch.mask_bits if batch.mask_bits is not None else torch.zeros_like(batch.tokens)
                g.mask_bits.index_copy_(0, idx, bits)  # 0 = causal
            if g.features is not None and features is not None:
                g.features.index_copy_(0, idx, features.to(g.features.dtype))
            pad_from = B * N
        g.context_lens[:B].copy_(batch.context_lens)
        cols = batch.block_tables.shape[1]
        g.block_tables[:B, :cols].copy_(batch.block_tables)
        g.block_tables[:B, cols:].fill_(scratch)
        if pad_from < g.B * N:  # dummy segments: context 0, rows writing to the scratch block
            g.tokens[pad_from:].zero_()
            g.positions[pad_from:].zero_()
            g.slot_mapping[pad_from:].fill_(scratch * P)
            if g.mask_bits is not None:
                g.mask_bits[pad_from:].fill_(1)
        g.context_lens[B:].zero_()
        g.block_tables[B:].fill_(scratch)
        if dense and batch.logits_rows == tuple(range(T)):
            return None, idx
        starts = [0]
        for n in batch.query_lens:
            starts.append(starts[-1] + n)
        seg = 0
        rows = []
        for r in batch.logits_rows:  # ascending: segments in order
            while r >= starts[seg + 1]:
                seg += 1
            rows.append(seg * N + r - starts[seg])
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device), idx

    def _capture(self, B: int, N: int) -> _Graph:
        fc = self.model.fc
        g = _Graph(B, N, self.max_blocks, self.device, 0 if fc is None else self.model.config.hidden_size,
                   self.model.dtype)
        scratch, P = self.cache.scratch_block, self.cache.page_size
        g.slot_mapping.fill_(scratch * P)
        g.block_tables.fill_(scratch)
        if g.mask_bits is not None:
            g.mask_bits.fill_(1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and autotune every kernel outside the capture
                self._run(g)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out, g.hidden = self._run(g)
        return g

    def _run(self, g: _Graph) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.hidden:
            return self.model.forward_hidden(g.batch, self.cache, g.features)
        return self.model.forward(g.batch, self.cache, g.features), None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)
