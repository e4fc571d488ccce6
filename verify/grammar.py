"""Structured output: a grammar (JSON schema, regex, choice list, Lark) constrains every token the target emits.

The grammar engine is llguidance (the Earley parser with a token trie that vLLM and SGLang also use): it
computes, for a parser state, the bitmask of tokens that keep the output inside the grammar. Under speculation
the target verifies a tree, so each tree node needs the mask of the state *after its own path*: ``tree_masks``
walks the tree depth-first, consuming each node's token into the request's matcher and rolling it back on the
way up. The masks go onto the node's rows of the target's logits (disallowed tokens to -inf) before acceptance,
so greedy verification follows the constrained argmax and sampled verification the constrained distribution:
the output is exactly what constrained plain decoding would give, whatever the drafter proposed. A draft
token the grammar forbids has probability zero under its parent's masked row and is never accepted; its
subtree's rows get its parent's mask (any valid mask serves: rows that cannot be accepted are never read).

For greedy requests the engine first drops the forbidden nodes from the tree (``allowed_nodes``): they could
never be accepted, and a verified node costs the target a row. Sampled trees keep them: their children are
successive draws from one draft distribution, and leaving some out would change what the multi-candidate
verification's residuals are taken against.

Logprobs stay the raw ones (see verify/logprobs.py): they describe the model, not the constraint.
llguidance is imported only when a request carries a grammar.
"""

from __future__ import annotations

import json
from typing import Any

import torch

GRAMMAR_KINDS = ("json", "regex", "choice", "grammar")
# JSON is written with json.dumps' separators and no other whitespace, unless the schema's "x-guidance" says
# otherwise: free whitespace lets a model pad indefinitely (seen here: a tiny model spent a 40-token budget on
# spaces after "{"), a known failure of JSON mode with small models.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compile_grammar(kind: str, spec: Any) -> str:
    """A grammar for llguidance from vLLM's structured-output forms: ``json`` (a JSON schema, as a dict or
    text), ``regex``, ``choice`` (a list of strings) or ``grammar`` (Lark or GBNF). Raises ValueError naming
    what is wrong; the grammar is checked, not only translated."""
    ll = _llguidance()
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("a JSON schema must be an object")
        grammar = ll.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_STYLE)
    elif kind == "regex":
        if not isinstance(spec, str) or not spec:
            raise ValueError("regex must be a non-empty string")
        grammar = ll.LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ValueError("choice must be a non-empty array of non-empty strings")
        grammar = ll.grammar_from("choice", json.dumps(spec))
    elif kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("grammar must be a non-empty Lark or GBNF string")
        grammar = ll.grammar_from("grammar", spec)
    else:
        raise ValueError(f"unknown grammar kind {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")
    error = ll.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"invalid {kind}: {error.splitlines()[0]}")
    return grammar


class GrammarTokenizer:
    """The tokenizer llguidance walks, built once per engine from the target's Hugging Face tokenizer (0.47 s
    for SmolLM2's on this CPU: bench/results/grammar_masks_cpu.json), its vocabulary padded to the logits'
    width."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        ll = _llguidance()
        import llguidance.hf

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of one mask row
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self._matcher = ll.LLMatcher

    def matcher(self, grammar: str) -> Any:
        """A fresh parser state for one request. Raises ValueError when the grammar does not compile."""
        m = self._matcher(self.ll, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"the grammar does not compile: {m.get_error().splitlines()[0]}")
        return m


def tree_masks(matcher: Any, tokens: list[int], parents: list[int], words: int) -> torch.Tensor:
    """[N, words] int32 bitmasks, row i the tokens allowed after node i's path (root = the matcher's state).
    Leaves the matcher where it started."""
    out = torch.empty(len(tokens), words, dtype=torch.int32)

    def admitted(i: int) -> None:
        matcher.unsafe_compute_mask_ptr(out[i].data_ptr(), words * 4)

    def forbidden(i: int, ancestor: int) -> None:  # never accepted, so its row is never read: any valid row serves
        out[i] = out[ancestor]

    _walk(matcher, tokens, parents, admitted, forbidden)
    return out


def allowed_nodes(matcher: Any, tokens: list[int], parents: list[int]) -> list[int]:
    """The nodes whose whole path the grammar admits, in node order (the root always; a forbidden node takes
    its subtree with it). Leaves the matcher where it started."""
    keep: list[int] = []
    _walk(matcher, tokens, parents, keep.append, lambda i, ancestor: None)
    return sorted(keep)


def _walk(matcher: Any, tokens: list[int], parents: list[int], admitted, forbidden) -> None:
    """Depth-first over the tree with the matcher in each node's state: ``admitted(i)`` for every node whose path
    the grammar admits (parents before children), ``forbidden(i, ancestor)`` for every node of a forbidden
    subtree, with its nearest admitted ancestor. Each token is consumed on the way down, rolled back on the way
    up."""
    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].append(i)

    def visit(i: int) -> None:
        admitted(i)
        for c in children[i]:
            if matcher.try_consume_tokens([tokens[c]]) == 1:
                visit(c)
                matcher.rollback(1)
            else:
                stack = [c]
                while stack:
                    j = stack.pop()
                    forbidden(j, i)
                    stack += children[j]

    visit(0)


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set disallowed tokens of ``logits[rows]`` to -inf in place. masks: [len(rows), words] int32 (host)."""
    V = logits.shape[-1]
    bits = masks.to(logits.device, non_blocking=True)  # [n, words]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :V].bool()  # [n, V]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover -- a dependency; only a bare environment lacks it
        raise ValueError("structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance
