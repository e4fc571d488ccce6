"""A model draft's tree with prompt-lookup branches grafted on, for greedy requests.

Chat models at temperature 0 repeat themselves and their prompt: there an n-gram lookup proposes long
runs that a small draft model is unsure of, while the model covers the text the lookup has never seen
(on SmolLM2 and MT-bench: n-gram chain 2.27 tokens per step, the distilled model's tree 1.82,
bench/results/drafts.json). The hybrid tree is the model's tree plus up to one n-gram continuation of
the tree's depth, merged into it as a trie: where the continuation's token is already a child, the walk
follows it; where it is new, a node is appended after the model's nodes.

Only greedy requests get grafts. Greedy verification accepts a child if it is the target's argmax, so a
mix of model and lookup children stays lossless. Stochastic verification needs every child of a node
drawn from one distribution (``TokenTree.draft_probs``), so sampled requests keep the model's tree.

The budget holds: a request's widths allow ``sum(widths)`` draft nodes (the scheduler counted them
against the step's verify cap), so when the lookup finds a continuation of ``c`` tokens the model's
tree is cut by ``c`` nodes, deepest level first, and the merged tree never exceeds the budget.

``lookup_first`` (the drafter "lookup-first"): a greedy request whose lookup finds a continuation as deep
as its tree drafts that chain alone, and the model does not run for it this step. When every request of a
step is served so, the step costs the target's verify and a host lookup: no draft forward at all. The
model's cache lags meanwhile and catches up on its next proposal. This trades the model's second opinion
on repetitive text for the draft's whole cost, which on a launch-bound target is larger than the verify.

The model drafter's KV state covers only its own nodes: ``commit`` hands it the model's tree and the
accepted path cut at the first grafted node; the accepted tokens past the cut are uncached for the
model and its next catch-up feeds them.

A model tree still on the device (``TokenTree.deferred``: the engine reads it once, with the acceptance)
cannot be merged with: the chain is appended after it as a branch of its own (``TokenTree.with_chains``),
and greedy verification takes the deeper of a node's twin children.
"""

from __future__ import annotations

from dataclasses import replace

from draft.base import DraftRequest
from draft.model_drafter import ModelDrafter
from draft.ngram import NgramDrafter
from draft.tree import TokenTree, cut_widths, graft_chains


class HybridDrafter:
    def __init__(self, name: str, draft: ModelDrafter, lookup: NgramDrafter | None = None,
                 lookup_first: bool = False) -> None:
        self.name = name
        self.draft = draft
        self.lookup = lookup or NgramDrafter(name=f"{name}-lookup")
        self.lookup_first = lookup_first
        self._model_trees: dict[str, TokenTree] = {}
        self.lookup_only = 0  # requests drafted by the lookup alone (lookup_first), for benchmarks

    def propose(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        conts = [self.lookup.continuations(r.token_ids, len(r.widths), 1, r.seq_id)
                 if r.widths and r.sampling.is_greedy else [] for r in reqs]
        asks = []
        for r, c in zip(reqs, conts):
            if self.lookup_first and c and len(c[0]) == len(r.widths):
                asks.append(replace(r, widths=()))  # the chain alone: the model gives a root-only tree
                self.lookup_only += 1
            else:
                asks.append(replace(r, widths=cut_widths(r.widths, sum(map(len, c)))))
        trees = []
        for r, c, tree in zip(reqs, conts, self.draft.propose(asks)):
            self._model_trees[r.seq_id] = tree
            if not c:
                trees.append(tree)
            elif tree.pending is not None:  # still on the device: the chain rides after it, unmerged
                trees.append(tree.with_chains(c))
            else:
                trees.append(graft_chains(tree, c))
        return trees

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        own = self._model_trees.pop(seq_id, None)
        if own is None:
            return
        if own.pending is not None:  # the model's deferred tree: its nodes lead the verified tree's, resolved
            tokens, parents, _ = tree.host()
            own.resolve(tokens[1 : own.num_nodes], parents[1 : own.num_nodes])
        cut = next((i for i, n in enumerate(accepted_nodes) if n >= own.num_nodes), len(accepted_nodes))
        self.draft.commit(seq_id, own, accepted_nodes[:cut])

    @property
    def wants_features(self) -> bool:
        return getattr(self.draft, "wants_features", False)

    def observe(self, seq_id: str, pos: int, features) -> None:
        self.draft.observe(seq_id, pos, features)  # a feature draft's target features (FeatureDrafter)

    def flush(self) -> None:
        self.draft.flush()

    def release(self, seq_id: str) -> None:
        self._model_trees.pop(seq_id, None)
        self.lookup.release(seq_id)
        self.draft.release(seq_id)
