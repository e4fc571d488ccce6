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
"""

from __future__ import annotations

from array import array

from draft.base import DraftRequest
from draft.tree import TokenTree

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


class NgramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.name = name
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self._tokens: dict[str, _Tokens] = {}

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

    def propose(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        trees = []
        for r in reqs:
            conts = self.continuations(r.token_ids, len(r.widths), r.widths[0], r.seq_id) if r.widths else []
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

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        pass  # stateless

    def flush(self) -> None:
        pass

    def release(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)

