"""Prompt n-gram lookup (prompt-lookup decoding): draft the tokens that followed the latest earlier
occurrence of the sequence's last n tokens. No model, no KV cache; candidates are deterministic.

The tree: the first ``widths[0]`` distinct continuations (most recent match first, longest n first) as
branches of a trie, each at most ``len(widths)`` tokens deep.

Lookup cost: each sequence keeps its tokens as a byte string (4 bytes a token, extended by the new tokens
of each step), and a lookup is ``bytes.rfind`` of the last n tokens' bytes, from the newest match back:
C-speed search over at most the window, and nothing to maintain per token. (A Python scan of a 4k-token
window was milliseconds per sequence per step; a dict index of every n-gram, built on a sequence's first
lookup, made the first draft step over 16 fresh prompts take 6 ms on the H200 against a plain step's 1.8
-- bench/results/engine_real_04c440b.json. On the CPU the search makes later lookups dearer than the
index's, 0.45 against 0.12 ms a step for 16 sequences of 2000 tokens -- bench/results/host_micro_cpu.json.)
Results are the scan's, match for match (tests/draft/test_ngram.py checks it against one).

A lookup in the sequence's own text finds nothing on most steps of a chat answer. ``NgramTable`` is a second
source for those steps: next-token counts after every 1..3-gram of the target's own text on the distillation
prompts, frozen to the most frequent few (a static n-gram language model of the target, shipped beside a
draft as ``ngram_table.json.gz``). Where the sequence's own text leaves branches of the first level free,
the table's next tokens fill them, each grown by the table's top token per level (after REST, He et al. 2023,
"REST: Retrieval-Based Speculative Decoding", which drafts from a datastore of text instead of a model).
"""

from __future__ import annotations

import gzip
import json
from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from draft.base import DraftRequest
from draft.tree import TokenTree
from kernels.ngram_lookup import ngram_lookup, pack_table

TABLE_FILE = "ngram_table.json.gz"

_WIDTH = array("i").itemsize  # bytes per token in the byte string


class _Tokens:
    """One sequence's tokens ``[0, size)`` as native 32-bit integers in a byte string."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.size = 0
        self.last = -1  # the token at size - 1, to notice a different sequence under a reused id

    def extend(self, ids: list[int]) -> None:
        self.buf += array("i", ids[self.size :]).tobytes()
        self.size, self.last = len(ids), ids[-1] if ids else -1


class NgramTable:
    """The most frequent next tokens after each n-gram (``min_n <= n <= max_n``) of a corpus, most frequent first
    (ties: the smaller id). A lookup backs off from the longest context the table holds to the shortest."""

    def __init__(self, entries: dict[tuple[int, ...], tuple[int, ...]], min_n: int, max_n: int,
                 source: str = "") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram table sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.entries, self.min_n, self.max_n, self.source = entries, min_n, max_n, source

    @classmethod
    def build(cls, texts: Iterable[list[int]], min_n: int = 1, max_n: int = 3, keep: int = 3,
              min_count: int = 2, source: str = "") -> NgramTable:
        """``keep`` next tokens per context, each seen at least ``min_count`` times after it: a continuation seen
        once is mostly noise (and most of the table's size)."""
        counts: dict[tuple[int, ...], Counter] = {}
        for ids in texts:
            for n in range(min_n, max_n + 1):
                for i in range(n, len(ids)):
                    counts.setdefault(tuple(ids[i - n : i]), Counter())[ids[i]] += 1
        entries = {}
        for ctx, c in counts.items():
            top = sorted((kv for kv in c.items() if kv[1] >= min_count), key=lambda kv: (-kv[1], kv[0]))[:keep]
            if top:
                entries[ctx] = tuple(t for t, _ in top)
        return cls(entries, min_n, max_n, source)

    def next_tokens(self, ids: list[int]) -> tuple[int, ...]:
        """The next tokens after the longest suffix of ``ids`` the table holds; () when it holds none."""
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            found = self.entries.get(tuple(ids[-n:]))
            if found:
                return found
        return ()

    def save(self, path: Path) -> Path:
        """Gzipped JSON: sizes, source, and [context, next tokens] pairs."""
        doc = {"min_n": self.min_n, "max_n": self.max_n, "source": self.source,
               "entries": [[list(c), list(v)] for c, v in self.entries.items()]}
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        return Path(path)

    @classmethod
    def load(cls, path: Path) -> NgramTable:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
        return cls({tuple(c): tuple(v) for c, v in doc["entries"]}, doc["min_n"], doc["max_n"], doc["source"])

    @classmethod
    def find(cls, directory: str | Path | None) -> NgramTable | None:
        """The table a draft directory holds, or None."""
        path = Path(directory) / TABLE_FILE if directory else None
        return cls.load(path) if path is not None and path.is_file() else None

    def max_token(self) -> int:
        return max((max(*c, *v) for c, v in self.entries.items()), default=-1)


class NgramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1, window: int = 4096,
                 table: NgramTable | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.name = name
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self.table = table
        self._tokens: dict[str, _Tokens] = {}
        self._device_tables: dict[torch.device, tuple | None] = {}  # the table packed for lookup_on_device

    def continuations(self, ids: list[int], depth: int, branches: int, seq_id: str | None = None) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of ``ids``, each up to ``depth`` tokens. With a
        ``seq_id`` the sequence's index is kept and extended between calls (``release`` drops it)."""
        tokens = self._tokens.get(seq_id) if seq_id is not None else None
        if tokens is None or tokens.size > len(ids) or (tokens.size and ids[tokens.size - 1] != tokens.last):
            tokens = _Tokens()
            if seq_id is not None:
                self._tokens[seq_id] = tokens
        tokens.extend(ids)
        buf, L = tokens.buf, len(ids)
        found: list[list[int]] = []
        lo = max(0, L - self.window)  # matches must lie inside the window
        for n in range(min(self.max_ngram, L - lo - 1), self.min_ngram - 1, -1):
            key = buf[(L - n) * _WIDTH :]
            end = (L - 1) * _WIDTH  # a match ends at or before the last token: the key itself is never one
            while True:
                at = buf.rfind(key, lo * _WIDTH, end)
                if at < 0:
                    break
                end = at + len(key) - 1  # next: the newest match starting before this one
                if at % _WIDTH:
                    continue  # straddles two tokens
                start = at // _WIDTH
                cont = ids[start + n : start + n + depth]
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == branches:
                        return found
        return found

    def lookup_on_device(self, hist: torch.Tensor, lens: torch.Tensor, span: int, depth: int) -> torch.Tensor:
        """[B, depth] drafts for rows of token ids on the device: each row's first continuation as ``propose``
        finds it for a chain (``continuations``, else ``table_continuations``), 0 past its end
        (kernels/ngram_lookup.py). ``lens`` holds each row's length, at most ``span``."""
        return ngram_lookup(hist, lens, span, depth, self.max_ngram, self.min_ngram, self.window,
                            self.device_table(hist.device))

    def device_table(self, device: torch.device) -> tuple | None:
        """The table as the device lookup reads it, packed and copied once per device; None without a table
        or where it cannot be packed (contexts over 3 tokens: the device then drafts from the rows alone)."""
        if self.table is None:
            return None
        if device not in self._device_tables:
            packed = pack_table(self.table.entries)
            self._device_tables[device] = None if packed is None else (
                packed[0].to(device), packed[1].to(device), self.table.min_n, self.table.max_n, packed[2])
        return self._device_tables[device]

    def propose(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        trees = []
        for r in reqs:
            conts = self.continuations(r.token_ids, len(r.widths), r.widths[0], r.seq_id) if r.widths else []
            if self.table is not None and r.widths and len(conts) < r.widths[0]:
                conts += self.table_continuations(r.token_ids, len(r.widths), r.widths[0] - len(conts), conts)
            tokens, parents = [r.token_ids[-1]], [-1]
            children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node: shared prefixes merge
            for cont in conts:
                node = 0
                for tok in cont:
                    if len(tokens) >= 1 + sum(r.widths):
                        break
                    if (node, tok) not in children:
                        children[(node, tok)] = len(tokens)
                        tokens.append(tok)
                        parents.append(node)
                    node = children[(node, tok)]
            trees.append(TokenTree.from_lists(tokens, parents))
        return trees

    def table_continuations(self, ids: list[int], depth: int, branches: int,
                            taken: list[list[int]] = ()) -> list[list[int]]:
        """Up to ``branches`` continuations from the table whose first token no continuation in ``taken`` starts
        with: one per next token the table gives after ``ids``, each grown by the table's top token per level."""
        firsts = {c[0] for c in taken}
        out = []
        for tok in self.table.next_tokens(ids):
            if len(out) == branches:
                break
            if tok in firsts:
                continue
            cont = [tok]
            while len(cont) < depth:
                nxt = self.table.next_tokens(ids[-self.table.max_n :] + cont)
                if not nxt:
                    break
                cont.append(nxt[0])
            out.append(cont)
        return out

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        pass  # stateless

    def flush(self) -> None:
        pass

    def release(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)

