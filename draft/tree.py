"""The token tree: the contract between a drafter and the verifier.

Node 0 is the *root*: the sequence's pending token, sampled last step and not yet in any KV cache.
Every other node is a draft token whose parent is an earlier node (``parents[i] < i``), so nodes are
in topological order and a node's depth is its parent's depth plus one. The target scores every node
in one forward pass; the logits at node ``i`` give the distribution of ``i``'s children.

A chain is a tree of width one; a one-node tree (the root alone) is plain decoding.

Draft probabilities: ``draft_probs[i]`` is the draft's (processed) distribution over the children of
node ``i``, from which those children were *sampled without replacement* (stochastic verification
needs it). ``None`` means children were chosen deterministically (argmax / top-k / n-gram lookup): the
verifier then treats every child as proposed by a point mass, which is still lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_NODES = 64  # the ancestor mask is one int64 bit per node


@dataclass(slots=True)
class TokenTree:
    """One sequence's draft tree. ``tokens``, ``parents`` and ``depths`` are int64 host tensors (the engine
    and the verifier walk them in Python, so keeping them on the host costs no device syncs);
    ``draft_probs`` lives where the draft scored them."""

    tokens: torch.Tensor  # [N] token ids; tokens[0] is the root
    parents: torch.Tensor  # [N] parent node index; parents[0] == -1
    depths: torch.Tensor  # [N] depth; depths[0] == 0
    draft_probs: torch.Tensor | None = None  # [N, V] float32, the draft's distribution of each node's children
    lists: tuple[list[int], list[int], list[int]] | None = None  # host lists of the three; see ``host``

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if n < 1 or n > MAX_TREE_NODES:
            raise ValueError(f"a tree has 1..{MAX_TREE_NODES} nodes, got {n}")
        if self.parents.shape != (n,) or self.depths.shape != (n,):
            raise ValueError("tokens, parents and depths must all have shape [N]")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) as Python lists, shared: read them, never change them. The engine and
        the verifier walk every tree of every step in Python; a tree built from lists keeps them, so the
        per-step path converts nothing."""
        if self.lists is None:
            self.lists = (self.tokens.tolist(), self.parents.tolist(), self.depths.tolist())
        return self.lists

    @staticmethod
    def root_only(token: int, device: torch.device | str = "cpu") -> "TokenTree":
        """The one-node tree: plain decoding of the pending token."""
        t = torch.tensor([[token], [-1], [0]], dtype=torch.int64, device=device)  # one tensor: three rows
        return TokenTree(tokens=t[0], parents=t[1], depths=t[2], lists=([token], [-1], [0]))

    @staticmethod
    def from_lists(tokens: list[int], parents: list[int], device: torch.device | str = "cpu",
                   draft_probs: torch.Tensor | None = None) -> "TokenTree":
        """Build a tree from python lists, checking ``parents[i] < i`` and deriving depths."""
        if not tokens or parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        depths = [0]
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be an earlier node")
            depths.append(depths[p] + 1)
        t = torch.tensor([tokens, parents, depths], dtype=torch.int64, device=device)  # one tensor per tree
        return TokenTree(t[0], t[1], t[2], draft_probs, (list(tokens), list(parents), depths))

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True when j is i itself or an ancestor of i."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        parents = self.host()[1]
        for i in range(1, n):
            mask[i] |= mask[parents[i]]
        return mask

    def ancestor_bits(self) -> torch.Tensor:
        """[N] int64: bit j of entry i is set when node j is i or an ancestor of i (the kernels' format)."""
        return torch.tensor(self.ancestor_bit_list(), dtype=torch.int64, device=self.tokens.device)

    def ancestor_bit_list(self) -> list[int]:
        """``ancestor_bits`` as Python ints, computed on the host without tensor ops (the per-step path)."""
        bits: list[int] = []
        for i, p in enumerate(self.host()[1]):
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        # bit 63 is the int64 sign bit: the same two's-complement pattern the kernels read
        return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``, inclusive."""
        parents = self.host()[1]
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]


def mask_to_bits(mask: torch.Tensor) -> torch.Tensor:
    """[N, N] bool (N <= 64) -> [N] int64 bitmask, bit j = mask[:, j]."""
    n = mask.shape[-1]
    if n > MAX_TREE_NODES:
        raise ValueError(f"bitmask holds at most {MAX_TREE_NODES} nodes, got {n}")
    weights = torch.ones(n, dtype=torch.int64, device=mask.device) << torch.arange(n, device=mask.device)
    # int64 wraps at bit 63 exactly as a two's-complement bit pattern should
    return (mask.to(torch.int64) * weights).sum(-1)


def causal_bits(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] int64 lower-triangular bitmask: token i sees tokens 0..i (a chain / prefill chunk)."""
    return mask_to_bits(torch.ones(n, n, dtype=torch.bool, device=device).tril())
