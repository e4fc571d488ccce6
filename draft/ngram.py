"""Prompt n-gram lookup (prompt-lookup decoding): draft the tokens that followed the latest earlier
occurrence of the sequence's last n tokens. No model, no KV cache; candidates are deterministic.

The tree: the first ``widths[0]`` distinct continuations (most recent match first, longest n first) as
branches of a trie, each at most ``len(widths)`` tokens deep.

Lookup cost: each sequence keeps an index from every n-gram (min..max n) to the positions where it
starts, extended by the new tokens of each step, so a lookup reads only the matches instead of scanning
the window (a scan of a 4k-token window is milliseconds of Python per sequence per step). Results are
the scan's, match for match (tests/draft/test_ngram.py checks it against one).
"""

from __future__ import annotations

from draft.base import DraftRequest
from draft.tree import TokenTree


class _Index:
    """n-gram -> start positions (ascending) over one sequence's tokens ``[0, size)``."""

    def __init__(self) -> None:
        self.starts: dict[tuple[int, ...], list[int]] = {}
        self.size = 0
        self.last = -1  # the token at size - 1, to notice a different sequence under a reused id

    def extend(self, ids: list[int], min_n: int, max_n: int) -> None:
        for end in range(self.size + 1, len(ids) + 1):  # every n-gram ending at a new token
            for n in range(min_n, min(max_n, end) + 1):
                self.starts.setdefault(tuple(ids[end - n : end]), []).append(end - n)
        self.size, self.last = len(ids), ids[-1] if ids else -1


class NgramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.name = name
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window
        self._index: dict[str, _Index] = {}

    def continuations(self, ids: list[int], depth: int, branches: int, seq_id: str | None = None) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of ``ids``, each up to ``depth`` tokens. With a
        ``seq_id`` the sequence's index is kept and extended between calls (``release`` drops it)."""
        index = self._index.get(seq_id) if seq_id is not None else None
        if index is None or index.size > len(ids) or (index.size and ids[index.size - 1] != index.last):
            index = _Index()
            if seq_id is not None:
                self._index[seq_id] = index
        index.extend(ids, self.min_ngram, self.max_ngram)
        found: list[list[int]] = []
        lo = max(0, len(ids) - self.window)  # matches must lie inside the window
        for n in range(min(self.max_ngram, len(ids) - lo - 1), self.min_ngram - 1, -1):
            starts = index.starts.get(tuple(ids[-n:]), [])
            for start in reversed(starts):  # most recent earlier occurrence first
                if start >= len(ids) - n:
                    continue  # the key itself
                if start < lo:
                    break
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
        self._index.pop(seq_id, None)

