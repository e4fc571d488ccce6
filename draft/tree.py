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
_ROOT_PARENTS, _ROOT_DEPTHS = [-1], [0]  # every one-node tree's: host lists are read, never changed


@dataclass(slots=True)
class TokenTree:
    """One sequence's draft tree. The engine and the verifier walk every tree of every step in Python, so
    a tree is its host lists (``host``); ``tokens``, ``parents`` and ``depths`` are int64 tensors built
    from them on first use (stochastic verification and tests read them; a plain decode's one-node tree
    never does, which saves a tensor per sequence per step). ``draft_probs`` lives where the draft
    scored them."""

    lists: tuple[list[int], list[int], list[int]] | None  # tokens, parents, depths; tokens[0] is the root
    draft_probs: torch.Tensor | None = None  # [N, V] float32, the draft's distribution of each node's children
    device: torch.device | str = "cpu"  # where ``tokens`` / ``parents`` / ``depths`` are built
    _rows: torch.Tensor | None = None  # [3, N] int64, built lazily
    pending: DeviceNodes | None = None  # a deferred tree's nodes, still on the device (``deferred``)

    def __post_init__(self) -> None:
        n = self.num_nodes
        if n < 1 or n > MAX_TREE_NODES:
            raise ValueError(f"a tree has 1..{MAX_TREE_NODES} nodes, got {n}")
        if self.lists is not None and (len(self.lists[1]) != n or len(self.lists[2]) != n):
            raise ValueError("tokens, parents and depths must all have N entries")

    @property
    def num_nodes(self) -> int:
        return len(self.host_depths)

    @property
    def host_depths(self) -> list[int]:
        """Every node's depth as a list, shared: a deferred tree's too, known from its template."""
        return self.lists[2] if self.lists is not None else self.pending.depths

    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) as Python lists, shared: read them, never change them."""
        if self.lists is None:
            raise RuntimeError("a deferred tree's nodes are on the device until the step's host copy resolves it")
        return self.lists

    @staticmethod
    def deferred(root: int, depths: list[int], rows: torch.Tensor, bits: torch.Tensor) -> "TokenTree":
        """A tree grown on the device whose tokens and parents the host has not read: the target's batch takes
        them from the device, and the step's one host copy (``verify.accept.accept_batch``) brings them back
        with the target's verdict and calls ``resolve``. ``depths``: every node's depth, known from the
        template the tree was grown to; ``rows`` ``[2, N - 1]`` int64: tokens and parents of nodes 1..N-1;
        ``bits`` ``[N - 1]`` int64: their ancestor bits (``ancestor_bits``' format)."""
        return TokenTree(None, pending=DeviceNodes(root, depths, rows, bits))

    def resolve(self, tokens: list[int], parents: list[int]) -> None:
        """Fill a deferred tree's host lists from its device nodes' tokens and parents, read back from its rows
        (its host tail, if any, follows them)."""
        p = self.pending
        if p is None or len(tokens) != p.rows.shape[1] or len(parents) != len(tokens):
            raise ValueError("resolve takes the tokens and parents of a deferred tree's device nodes")
        self.lists = ([p.root, *tokens, *p.tail[0]], [-1, *parents, *p.tail[1]], p.depths)
        self.pending = None

    def with_chains(self, chains: list[list[int]]) -> "TokenTree":
        """A deferred tree with each chain (a continuation of the root) appended as a branch of its own, after
        the device nodes: on the host, known before the target scores the tree. Unlike ``graft_chains`` the
        chain is not merged into the device nodes (they are not read yet), so a chain's first token may repeat
        a device child of the root; greedy verification takes the deeper of such twins (``verify.accept``)."""
        p = self.pending
        if p is None or p.tail[0]:
            raise ValueError("with_chains extends a deferred tree that has no host nodes yet")
        tokens: list[int] = []
        parents: list[int] = []
        depths = list(p.depths)
        for chain in chains:
            parent = 0
            for tok in chain:
                if len(depths) >= MAX_TREE_NODES:
                    break
                tokens.append(tok)
                parents.append(parent)
                depths.append(depths[parent] + 1)
                parent = len(depths) - 1
        return TokenTree(None, pending=DeviceNodes(p.root, depths, p.rows, p.bits, (tokens, parents)))

    def _tensor(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = torch.tensor(self.lists, dtype=torch.int64, device=self.device)  # one tensor per tree
        return self._rows

    @property
    def tokens(self) -> torch.Tensor:  # [N] token ids
        return self._tensor()[0]

    @property
    def parents(self) -> torch.Tensor:  # [N] parent node index; parents[0] == -1
        return self._tensor()[1]

    @property
    def depths(self) -> torch.Tensor:  # [N] depth; depths[0] == 0
        return self._tensor()[2]

    @staticmethod
    def root_only(token: int, device: torch.device | str = "cpu") -> "TokenTree":
        """The one-node tree: plain decoding of the pending token (its parents and depths lists shared)."""
        return TokenTree(([token], _ROOT_PARENTS, _ROOT_DEPTHS), device=device)

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
        return TokenTree((list(tokens), list(parents), depths), draft_probs, device)

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True when j is i itself or an ancestor of i."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        parents = self.host()[1]
        for i in range(1, n):
            mask[i] |= mask[parents[i]]
        return mask

    def ancestor_bits(self) -> torch.Tensor:
        """[N] int64: bit j of entry i is set when node j is i or an ancestor of i (the kernels' format)."""
        return torch.tensor(self.ancestor_bit_list(), dtype=torch.int64, device=self.device)

    def ancestor_bit_list(self) -> list[int]:
        """``ancestor_bits`` as Python ints, computed on the host without tensor ops (the per-step path)."""
        bits: list[int] = []
        for i, p in enumerate(self.host()[1]):
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        return as_int64(bits)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``, inclusive."""
        parents = self.host()[1]
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]


@dataclass(slots=True)
class DeviceNodes:
    """What a deferred tree holds until it is resolved (``TokenTree.deferred``): the root, ``M`` device nodes
    (nodes 1..M) and any host nodes after them (``TokenTree.with_chains``)."""

    root: int
    depths: list[int]  # every node's, the root's 0 first
    rows: torch.Tensor  # [2, M] int64 on the device: tokens and parents of nodes 1..M
    bits: torch.Tensor  # [M] int64 on the device: their ancestor bits
    tail: tuple[list[int], list[int]] = ((), ())  # tokens and parents of nodes M+1.., on the host

    def tail_bits(self) -> list[int]:
        """The host nodes' ancestor bits (their ancestors are the root and earlier host nodes)."""
        first = 1 + self.rows.shape[1]
        bits = {0: 1}
        for node, parent in enumerate(self.tail[1], start=first):
            bits[node] = bits[parent] | (1 << node)
        return as_int64([bits[node] for node in range(first, first + len(self.tail[1]))])


def as_int64(bits: list[int]) -> list[int]:
    """Ancestor bits as int64 values: bit 63 is the sign bit, the same two's-complement pattern the kernels read."""
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def template_depths(widths: tuple[int, ...]) -> list[int]:
    """Each node's depth in a tree grown level by level to ``widths`` (BFS order), the root's first."""
    return [0] + [d + 1 for d, w in enumerate(widths) for _ in range(w)]


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


def graft_chains(tree: TokenTree, chains: list[list[int]]) -> TokenTree:
    """``tree`` with each chain of tokens (a continuation of the root) merged in as a trie: where a chain's
    token is already a child the walk follows it, where it is new a node is appended after the tree's own
    nodes (so they keep their indices). The tree itself when nothing new was added."""
    tokens, parents = list(tree.host()[0]), list(tree.host()[1])  # copies: grafts append to them
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0}
    grafted = False
    for chain in chains:
        node = 0
        for tok in chain:
            if (node, tok) not in child_of:
                if len(tokens) >= MAX_TREE_NODES:
                    break
                child_of[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                grafted = True
            node = child_of[(node, tok)]
    return TokenTree.from_lists(tokens, parents) if grafted else tree


def cut_widths(widths: tuple[int, ...], nodes: int) -> tuple[int, ...]:
    """``widths`` with ``nodes`` fewer nodes, taken from the deepest level first."""
    w = list(widths)
    while nodes > 0 and w:
        take = min(nodes, w[-1])
        w[-1] -= take
        nodes -= take
        if w[-1] == 0:
            w.pop()
    return tuple(w)
