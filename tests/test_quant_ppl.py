"""bench/quality.py's held-out text and sliding-window perplexity (what bench/quant.py scores), on a tiny random
model (CPU, seconds)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pydoc_data.topics import topics

from engine_util import random_weights, tiny_config
from target.model import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from quality import logits_over, perplexity_ids, pydoc_text, windowed_log_probs, windowed_nll, windows  # noqa: E402


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    cfg = tiny_config(hidden_size=128, intermediate_size=256, layers=2, head_dim=32, max_position_embeddings=256)
    return Transformer.from_weights(cfg, random_weights(cfg, seed=3, scale=0.5))


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("n,window,stride", [(2, 2, 1), (10, 4, 3), (100, 32, 16), (101, 32, 16), (97, 30, 7),
                                             (16384, 1024, 512), (50, 64, 32)])
def test_windows_score_every_target_once(n: int, window: int, stride: int) -> None:
    spans = windows(n, window, stride)
    targets = [t for _, end, first in spans for t in range(first, end)]
    assert targets == list(range(1, n))  # each target once, in order
    for i, (begin, end, first) in enumerate(spans):
        assert 0 <= begin < first <= end <= n and end - begin <= window
        if i:  # later windows give every scored target at least window - stride tokens before it
            assert first - begin >= window - stride
    if n <= window:
        assert spans == [(0, n, 1)]
    assert len(windows(16384, 1024, 512)) == 31


def test_bad_windows() -> None:
    for window, stride in ((4, 5), (4, 4), (4, 0), (1, 1)):
        with pytest.raises(ValueError, match="stride"):
            windows(10, window, stride)


def test_one_window_is_the_full_prefill(tiny: Transformer) -> None:
    """A window covering the text scores exactly what one full-sequence prefill does."""
    ids = random_ids(77, seed=1)
    full = logits_over(tiny, ids).float()[:-1]
    (lp, tgt), = list(windowed_log_probs(tiny, ids, window=128, stride=64))
    assert torch.equal(lp, full.log_softmax(-1)) and tgt.tolist() == ids[1:]
    nll, count = windowed_nll(tiny, ids, window=128, stride=64)
    assert count == 76
    assert math.isclose(nll, float(F.cross_entropy(full, torch.tensor(ids[1:]), reduction="sum")), rel_tol=1e-5)


def test_sliding_windows_give_each_target_its_documented_context(tiny: Transformer) -> None:
    """Target t >= window is predicted from ids[begin:t] with begin = ((t - window) // stride + 1) * stride (the
    window that first reaches it); earlier targets from ids[:t]. Checked token by token against separate prefills."""
    ids, window, stride = random_ids(90, seed=2), 32, 16
    rows = torch.cat([lp for lp, _ in windowed_log_probs(tiny, ids, window, stride)])
    assert rows.shape == (89, 64)
    for t in range(1, 90):
        begin = 0 if t < window else ((t - window) // stride + 1) * stride
        assert t - begin >= min(t, window - stride)
        expect = logits_over(tiny, ids[begin:t])[-1].float().log_softmax(-1)
        torch.testing.assert_close(rows[t - 1], expect, atol=1e-4, rtol=1e-4)
    # context was really cut: the last target's log-probs differ from a full-context prefill
    full = logits_over(tiny, ids)[-2].float().log_softmax(-1)
    assert (rows[-1] - full).abs().max() > 1e-2
    nll, count = windowed_nll(tiny, ids, window, stride)
    assert count == 89
    assert math.isclose(nll, -float(rows.gather(-1, torch.tensor(ids[1:])[:, None]).sum()), rel_tol=1e-5)


def test_pydoc_text_is_deterministic_and_cut() -> None:
    text = pydoc_text()
    first = min(topics)
    assert text.startswith(topics[first]) and text == "\n\n".join(topics[k] for k in sorted(topics))
    assert len(text) > 100_000  # hundreds of thousands of characters in every recent CPython
    ids, name = perplexity_ids("pydoc", utf8, 16384)
    assert len(ids) == 16384 and name.startswith("pydoc_data.topics (Python ")
    assert ids == perplexity_ids("pydoc", utf8, 16384)[0]
    assert ids == utf8(text)[:16384]  # a prefix of the whole text's tokenization
    assert perplexity_ids("pydoc", utf8, 100)[0] == ids[:100]
    with pytest.raises(ValueError, match="fewer than"):
        perplexity_ids("pydoc", utf8, len(utf8(text)) + 1)


def test_file_text_and_bad_spec(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("held out")
    assert perplexity_ids(f"file:{path}", utf8, 100) == (utf8("held out"), str(path))
    assert perplexity_ids(f"file:{path}", utf8, 4)[0] == utf8("held")
    with pytest.raises(ValueError, match="unknown perplexity text"):
        perplexity_ids("wiki", utf8, 10)
