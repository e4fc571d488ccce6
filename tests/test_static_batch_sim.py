"""bench/static_batch_sim.py: a static batch replayed through the real scheduler with modelled step prices."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from draft.ngram import NgramDrafter  # noqa: E402
from gateway.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from static_batch_sim import run_batch  # noqa: E402
from target.blocks import BlockPool  # noqa: E402

PRICES = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.15, 4: 1.2}  # cheap levels: speculation pays wherever lookups match


def _run(texts, arm, new_tokens=40):
    sched = Scheduler(SchedulerConfig(max_running=len(texts), max_step_tokens=4096), BlockPool(1024, 16))
    return run_batch(sched, NgramDrafter(), texts, PRICES, arm, new_tokens)


def test_plain_decoding_takes_a_step_a_token_and_the_longest_text_sets_the_steps():
    texts = [([1, 2, 3] + list(range(10, 50)), 3), ([4, 5] + list(range(60, 80)), 2)]  # 40 and 20 tokens to emit
    r = _run(texts, "plain")
    assert r == {"steps": 40, "seconds": 40.0, "tokens": 60, "drafted_steps": 0, "seq_steps": 60}


def test_a_repeating_text_is_drafted_and_kept_and_every_arm_emits_the_same_tokens():
    loop = [7, 8, 9, 10, 11] * 12
    alone = [(loop, 10)]  # 50 tokens to emit, 40 asked for: a cycle the lookup finds after one turn
    plain, per_token, whole = _run(alone, "plain"), _run(alone, "per-token"), _run(alone, "batch-completion")
    assert plain["tokens"] == per_token["tokens"] == whole["tokens"] == 40
    assert per_token["drafted_steps"] > 0 and per_token["steps"] < plain["steps"] and per_token["seconds"] < 40.0
    assert whole == per_token  # one request: it is the batch's end, so both objectives agree
    pair = alone + [([3, 4, 5, 6] + [20 + i % 7 for i in range(40)], 4)]
    assert _run(pair, "per-token")["tokens"] == _run(pair, "batch-completion")["tokens"] == 80
