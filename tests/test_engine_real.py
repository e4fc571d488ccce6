"""bench/engine.py --real on the CPU: the real-pair code path end to end on the embedded SmolLM2, a few tokens.

The GPU run is what the numbers come from; this keeps the script runnable between device sessions: every
arm timed, batch 1 as several one-prompt calls (the HF peers on the same calls), ratios from the same run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_real_pair_smoke_run_on_cpu(tmp_path):
    from target.embedded import default_model_dir

    try:
        default_model_dir()
    except RuntimeError as exc:  # no registry and no cached copy
        pytest.skip(f"the embedded model is not available: {exc}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in
                               ["Name three rivers.", "What is two plus two?", "Say hello in French."]))
    out = tmp_path / "engine_real.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), "--real", "embedded", "--device", "cpu",
                           "--batches", "1,2", "--new-tokens", "3", "--batch1-prompts", "2", "--repeats", "1",
                           "--arms", "ngram-alone,off-stepped,ngram-chain4,ngram-chain4-ahead,on-gain0.05", "--prompts-file", str(prompts), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["batch1_prompts"] == 2 and res["default_drafter"] == "ngram"
    one, two = res["real_pair"]
    assert (one["batch"], one["prompts_timed"], one["calls_timed"]) == (1, 2, 2)  # two one-prompt calls
    assert (two["batch"], two["prompts_timed"], two["calls_timed"]) == (2, 2, 1)
    for row in (one, two):
        assert row["spec_tok_s"] > 0 and row["nospec_tok_s"] > 0 and row["hf_static_tok_s"] > 0
        # one run: the ratio of the two rates, up to their rounding to 0.1 tokens/s (large on a loaded CPU's rates)
        on, off = row["spec_tok_s"], row["nospec_tok_s"]
        assert row["speedup"] == pytest.approx(on / off, abs=0.005 + on / off * (0.05 / on + 0.05 / off))
        assert set(row["drafter_arms"]) == {"ngram-alone", "off-stepped", "ngram-chain4", "ngram-chain4-ahead", "on-gain0.05"}
        assert all(arm["tok_s"] > 0 for arm in row["drafter_arms"].values())
        # float32 on the CPU: every arm's greedy tokens are speculation off's, sequence for sequence
        n = row["prompts_timed"]
        assert row["same_as_off"] == [n, n]
        assert all(arm["same_as_off"] == [n, n] for arm in row["drafter_arms"].values())
        assert set(row["first_use"]) >= {"on", "off", "ngram-alone", "off-stepped", "ngram-chain4", "ngram-chain4-ahead"}
        # on the CPU nothing is overlapped by default: every engine step ran one by one, but where the
        # chain-ahead arm turned EngineConfig.chain_ahead on
        assert all(c["engine_steps"] > 0 for c in row["first_use"].values())
        assert all(c["steps_ahead"] == 0 for arm, c in row["first_use"].items() if arm != "ngram-chain4-ahead")
    assert one["hf_assisted_tok_s"] > 0 and two["hf_assisted_tok_s"] is None  # assisted generation: batch 1 only
    if importlib.util.find_spec("matplotlib"):  # the bench extra: without it the script says so and draws nothing
        assert out.with_suffix(".png").is_file()
