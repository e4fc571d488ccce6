"""Prompt n-gram lookup (prompt-lookup decoding): draft the tokens that followed the latest earlier
occurrence of the sequence's last n tokens. No model, no KV cache; candidates are deterministic.

The tree: the first ``widths[0]`` distinct continuations (most recent match first, longest n first) as
branches of a trie, each at most ``len(widths)`` tokens deep.
"""

from __future__ import annotations

from draft.base import DraftRequest
from draft.tree import TokenTree


class NgramDrafter:
    def __init__(self, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1, window: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max, got {min_ngram}, {max_ngram}")
        self.name = name
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def continuations(self, ids: list[int], depth: int, branches: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations of ``ids``, each up to ``depth`` tokens."""
        found: list[list[int]] = []
        hist = ids[-self.window :]
        for n in range(min(self.max_ngram, len(hist) - 1), self.min_ngram - 1, -1):
            key = hist[-n:]
            for start in range(len(hist) - n - 1, -1, -1):  # most recent earlier occurrence first
                if hist[start : start + n] == key:
                    cont = hist[start + n : start + n + depth]
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) == branches:
                            return found
        return found

    def propose(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        trees = []
        for r in reqs:
            conts = self.continuations(r.token_ids, len(r.widths), r.widths[0]) if r.widths else []
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

    def release(self, seq_id: str) -> None:
        pass

