"""``LLM.generate``'s budget objective: the time the last output ends (``batch_completion``), on only while
the call runs; greedy outputs are the same under either objective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draft.params import SpeculationParams
from engine_util import tiny_engine
from gateway.llm import LLM, Loaded
from verify.sampling import SamplingParams


def test_generate_aims_at_the_batchs_end_only_while_it_runs(tokenizer) -> None:
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=64)
    llm = LLM(Loaded(engine, SimpleNamespace(tokenizer=tokenizer, chat_template=None), "tiny"), chat=False)
    sched = engine.scheduler
    seen: list[bool] = []
    schedule = sched.schedule

    def spy(template_of):
        seen.append(sched.batch_completion)
        return schedule(template_of)

    sched.schedule = spy
    prompts = [[40, 41, 42, 43], [50, 60, 70], [7, 8]]
    sampling = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 20, 12)]
    whole = llm.generate(prompts, sampling, SpeculationParams())
    assert seen and all(seen) and not sched.batch_completion
    seen.clear()
    per_token = llm.generate(prompts, sampling, SpeculationParams(), batch_completion=False)
    assert seen and not any(seen)
    assert [g.token_ids for g in whole] == [g.token_ids for g in per_token]
    assert [len(g.token_ids) for g in whole] == [6, 20, 12]

    def broken(template_of):
        raise RuntimeError("scheduler failed")

    sched.schedule = broken
    with pytest.raises(RuntimeError):
        llm.generate(prompts[:1], sampling[:1])
    assert not sched.batch_completion  # restored on the way out
