"""Structured output (verify/grammar.py) through the engine and the HTTP routes: every token the target emits
keeps the output inside the grammar, under speculation exactly as without, whatever the drafter proposed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from draft.params import SpeculationParams
from engine_util import run_all, tiny_engine
from gateway_util import MODEL, pool_is_full, run_app as run
from verify.grammar import GrammarTokenizer, allowed_nodes, apply_masks, compile_grammar, tree_masks
from verify.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
SPECS = {"off": SpeculationParams(enabled=False), "draft": SpeculationParams(drafter="draft", tree=(2, 2, 1)),
         "ngram": SpeculationParams(drafter="ngram", tree=(1, 1, 1)),
         "exact": SpeculationParams(drafter="exact", tree=(2, 1, 1))}


@pytest.fixture(scope="module")
def grammar_tok(tokenizer) -> GrammarTokenizer:
    return GrammarTokenizer(tokenizer, len(tokenizer))


def allowed(masks: torch.Tensor, vocab: int) -> list[set[int]]:
    logits = torch.zeros(masks.shape[0], vocab)
    apply_masks(logits, list(range(masks.shape[0])), masks)
    return [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]


def test_tree_masks_follow_each_path_and_leave_the_matcher_as_it_was(tokenizer, grammar_tok) -> None:
    """A tree under the choice grammar "cat" | "car" | "dog": each node's row allows what may follow its path;
    a forbidden node's subtree gets its parent's row; the matcher is where it started."""
    m = grammar_tok.matcher(compile_grammar("choice", ["cat", "car", "dog"]))
    t = {c: tokenizer.convert_tokens_to_ids(c) for c in ["c", "a", "t", "r", "d", "o", "x", "g", "at", "ar"]}
    eos = tokenizer.eos_token_id
    # root -> c -> a -> {t, r};  root -> x (forbidden) -> o
    tokens = [0, t["c"], t["a"], t["t"], t["r"], t["x"], t["o"]]
    parents = [-1, 0, 1, 2, 2, 0, 5]
    rows = allowed(tree_masks(m, tokens, parents, grammar_tok.words), len(tokenizer))
    assert {t["c"], t["d"]} <= rows[0] and t["a"] not in rows[0]
    assert rows[1] == {t["a"], t["at"], t["ar"]} and rows[2] == {t["t"], t["r"]}  # "at", "ar": merged tokens
    assert rows[3] == rows[4] == {eos}  # "cat", "car": complete, only the end may follow
    assert rows[5] == rows[6] == rows[0]  # "x" is forbidden at the root: its subtree copies the root's row
    assert m.validate_tokens([t["d"], t["o"], t["g"]]) == 3


def test_bad_grammars_name_the_problem() -> None:
    for kind, spec, words in (("regex", "(ab", "invalid regex"), ("json", "{not json", "not valid JSON"),
                              ("choice", [], "non-empty"), ("json", [1], "must be an object"),
                              ("grammar", "start: (", "invalid grammar"), ("yaml", "x", "unknown grammar kind")):
        with pytest.raises(ValueError, match=words):
            compile_grammar(kind, spec)


def sampled_or_greedy(temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=3, max_tokens=40, ignore_eos=True,
                          grammar=compile_grammar("json", SCHEMA))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_output_parses_and_speculation_changes_nothing(tokenizer, temperature: float) -> None:
    """A random tiny model, constrained by a JSON schema, writes JSON that validates: greedy and sampled
    (seeded), with every drafter; greedy speculative output equals plain output token for token. (Sampled
    runs draw differently with a tree than without; their distribution is verify's chi-square tests' job.)"""
    sampling = sampled_or_greedy(temperature)
    prompts = [[5, 9, 2, 5, 9, 2], [40, 41, 7, 7, 7], [3]]
    outs = {}
    for name, spec in SPECS.items():
        engine = tiny_engine(vocab=len(tokenizer))
        engine.tokenizer = tokenizer
        outs[name] = run_all(engine, [(str(i), p, sampling, spec) for i, p in enumerate(prompts)])
        assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    if temperature == 0:
        assert all(o == outs["off"] for o in outs.values())
    for out in outs.values():
        for tokens in out.values():
            doc = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
            assert set(doc) == {"name", "age"} and isinstance(doc["age"], int) and 0 <= doc["age"] <= 99
            assert isinstance(doc["name"], str) and len(doc["name"]) <= 6


def test_a_complete_grammar_ends_the_request_with_stop(tokenizer) -> None:
    engine = tiny_engine(vocab=len(tokenizer))
    engine.tokenizer = tokenizer
    sampling = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                              grammar=compile_grammar("choice", ["yes", "no"]))
    engine.add("a", [1, 2, 3], sampling, SPECS["draft"])
    tokens, reason = [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert text in ("yes", "no") and reason == "stop"


def test_an_engine_without_a_tokenizer_refuses_a_grammar() -> None:
    engine = tiny_engine()
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add("a", [1, 2], SamplingParams(grammar=compile_grammar("regex", "[ab]+")))
    assert not engine.has_work()


def test_structured_output_over_http(tokenizer) -> None:
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 40,
            "ignore_eos": True}

    async def go(client, app):
        out = {}
        out["schema"] = (await client.post("/v1/chat/completions", json=chat | {"response_format": schema_fmt})).json()
        out["object"] = (await client.post("/v1/chat/completions", json=chat | {
            "response_format": {"type": "json_object"}, "ignore_eos": False, "max_tokens": 60})).json()
        out["regex"] = (await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 12, "structured_outputs": {"regex": "[a-e]{3,5}"}})).json()
        out["choice_stream"] = (await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 12, "stream": True,
            "structured_outputs": {"choice": ["alpha", "beta"]}})).text
        out["bad"] = [(await client.post("/v1/chat/completions", json=chat | body)).json()["error"] for body in (
            {"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}},
            {"structured_outputs": {"regex": "(a"}}, {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}})]
        out["freed"] = pool_is_full(app.state.gateway.engine)
        return out

    out = run(tokenizer, go)
    doc = json.loads(out["schema"]["choices"][0]["message"]["content"])
    assert set(doc) == {"name", "age"}
    assert isinstance(json.loads(out["object"]["choices"][0]["message"]["content"]), dict)
    assert out["object"]["choices"][0]["finish_reason"] == "stop"
    text = out["regex"]["choices"][0]["text"]
    assert 3 <= len(text) <= 5 and set(text) <= set("abcde")
    chunks = [json.loads(b[len("data: "):]) for b in out["choice_stream"].split("\n\n") if b.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) in ("alpha", "beta")
    params = [e["param"] for e in out["bad"]]
    assert params == ["response_format", "response_format.json_schema", "structured_outputs.regex",
                      "structured_outputs", "structured_outputs"]
    assert "invalid regex" in out["bad"][2]["message"]
    assert out["freed"]


def test_forced_tokens_are_verified_as_a_chain(tokenizer) -> None:
    """Long property names are forced by the schema: with forced chains a speculating request verifies them
    several tokens a step, and its output is the plain run's; without them it takes more steps."""
    schema = {"type": "object", "properties": {"a_rather_long_property_name": {"type": "integer", "maximum": 9},
                                               "another_quite_long_name": {"type": "boolean"}},
              "required": ["a_rather_long_property_name", "another_quite_long_name"], "additionalProperties": False}
    sampling = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, grammar=compile_grammar("json", schema))
    runs = {}
    for name, spec, chains in (("off", SPECS["off"], True), ("ngram", SPECS["ngram"], True),
                               ("ngram-no-chains", SPECS["ngram"], False)):
        engine = tiny_engine(vocab=len(tokenizer))
        engine.config = replace(engine.config, forced_chains=chains)
        engine.tokenizer = tokenizer
        engine.add("a", [5, 9, 2], sampling, spec)
        tokens, stats = [], None
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
                stats = out.stats
        runs[name] = (tokens, stats)
    assert runs["ngram"][0] == runs["off"][0] == runs["ngram-no-chains"][0]
    assert json.loads(tokenizer.decode(runs["off"][0]))["another_quite_long_name"] in (True, False)
    chained, plain = runs["ngram"][1], runs["ngram-no-chains"][1]
    assert chained.steps < plain.steps and chained.mean_accepted_length > 1.5


def test_allowed_nodes_drop_forbidden_subtrees(tokenizer, grammar_tok) -> None:
    m = grammar_tok.matcher(compile_grammar("choice", ["cat", "car", "dog"]))
    t = {c: tokenizer.convert_tokens_to_ids(c) for c in ["c", "a", "t", "x", "o", "d"]}
    tokens = [0, t["c"], t["x"], t["a"], t["t"], t["o"], t["d"], t["o"]]
    parents = [-1, 0, 0, 1, 3, 2, 0, 6]  # c-a-t, x-o (x forbidden), d-o
    assert allowed_nodes(m, tokens, parents) == [0, 1, 3, 4, 6, 7]
    assert m.validate_tokens([t["c"], t["a"], t["t"]]) == 3  # the matcher is where it was


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_greedy_trees_lose_their_forbidden_nodes_and_nothing_else(tokenizer, drafter: str) -> None:
    """Pruning forbidden nodes leaves the output as it was and verifies fewer nodes."""
    sampling = sampled_or_greedy(0.0)
    prompts = [[5, 9, 2, 5, 9, 2], [40, 41, 7, 7, 7]]
    runs = {}
    for prune in (True, False):
        engine = tiny_engine(vocab=len(tokenizer))
        engine.config = replace(engine.config, grammar_pruning=prune)
        engine.tokenizer = tokenizer
        outs, nodes = {}, 0
        for i, p in enumerate(prompts):
            engine.add(str(i), p, sampling, SPECS[drafter])
        while engine.has_work():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    nodes += out.stats.verified_nodes
        runs[prune] = (outs, nodes)
        assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] < runs[False][1]
