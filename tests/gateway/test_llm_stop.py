"""``LLM.generate`` with stop strings: the text is cut as the server cuts it, the token ids end with the token
that completed the match, and the request's blocks go back at once."""

from __future__ import annotations

from types import SimpleNamespace

from draft.params import SpeculationParams
from engine_util import tiny_engine
from gateway.llm import LLM, Loaded
from verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _llm(tokenizer) -> LLM:
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=64)
    return LLM(Loaded(engine, SimpleNamespace(tokenizer=tokenizer, chat_template=None), "tiny"), chat=False)


def test_stop_strings_cut_text_and_tokens_under_every_drafter(tokenizer) -> None:
    llm = _llm(tokenizer)
    prompts = [[40, 41, 42, 43], [50, 60, 70]]
    free = llm.generate(prompts, GREEDY, SpeculationParams(enabled=False))
    # a stop string: two characters from the middle of the first output, whole tokens' text
    first = free[0]
    pieces = [tokenizer.decode([t]) for t in first.token_ids]
    k = next(i for i in range(3, len(pieces)) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    stop = pieces[k]
    for spec in (SpeculationParams(enabled=False), SpeculationParams(drafter="exact", tree=(2, 2, 1)),
                 SpeculationParams(drafter="draft", tree=(2, 1))):
        got = llm.generate(prompts, GREEDY, spec, stop=[stop])
        assert got[0].text == first.text[: first.text.index(stop)]
        assert got[0].token_ids == first.token_ids[: k + 1] and got[0].finish_reason == "stop"
        kept = llm.generate(prompts, GREEDY, spec, stop=stop, include_stop=True)[0]
        assert kept.text == first.text[: first.text.index(stop) + len(stop)]
        held = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=24),
                                      GREEDY], spec, stop=[stop])[0]
        assert held.token_ids == first.token_ids and held.finish_reason == "length"
        assert llm.engine.cache.pool.num_free == llm.engine.cache.pool.num_blocks
    assert llm.generate(prompts, GREEDY)[1].token_ids == free[1].token_ids  # no stop: the whole output


def test_a_stop_tokens_text_is_not_the_outputs(tokenizer) -> None:
    llm = _llm(tokenizer)
    free = llm.generate([[40, 41, 42, 43]], GREEDY)[0]
    k = next(i for i in range(2, len(free.token_ids)) if free.token_ids[i] not in free.token_ids[:i]
             and tokenizer.decode([free.token_ids[i]]).strip())
    stop = free.token_ids[k]
    ended = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    for stops in ((), ("never-seen",)):  # the plain decode of the ids, and the stop-string assembler
        got = llm.generate([[40, 41, 42, 43]], ended, stop=stops)[0]
        assert got.token_ids == free.token_ids[: k + 1] and got.finish_reason == "stop"
        assert got.text == tokenizer.decode(free.token_ids[:k], skip_special_tokens=True)
