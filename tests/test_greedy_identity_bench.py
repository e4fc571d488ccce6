"""bench/greedy_identity.py on the CPU: both kernel modes and plain repeats in one run, and its flip gaps read over
the text they belong to (the GPU run is what the figures come from)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import greedy_identity  # noqa: E402  (bench/)


def test_greedy_identity_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "identity.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "greedy_identity.py"), "--device", "cpu", "--small",
                           "--dtypes", "float32", "--modes", "default,invariant", "--batches", "1,2", "--prompts", "2",
                           "--max-tokens", "8", "--tree", "2,1", "--plain-repeats", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # per mode and batch size: one plain repeat, then the n-gram and self-draft arms
    assert [(r["mode"], r["batch"], r["drafter"]) for r in rows] == [
        (m, b, d) for m in ("default", "invariant") for b in (1, 2) for d in (None, "ngram", "self")]
    # float32 on the CPU: every arm and every repeat emits plain decoding's tokens
    assert all(r["identical"] == r["prompts"] == 2 and not r["flips"] for r in rows)


def test_divergences_read_each_gap_over_its_own_plain_text():
    seen = []

    def logits(j: int, plain: list[int]) -> torch.Tensor:
        seen.append((j, tuple(plain)))
        return torch.arange(10.0).expand(len(plain), 10)  # the logit of token t is t at every position

    plain = [[1, 2, 3], [4, 5]]
    flips = greedy_identity.divergences(plain, [[1, 7, 3], [4, 5]], logits, "spec")
    assert flips == [{"prompt": 0, "position": 1, "plain": 2, "spec": 7, "gap": -5.0}]
    assert seen == [(0, (1, 2, 3))]
    assert greedy_identity.divergences(plain, [[1, 2], [4, 5, 6]], logits, "spec") == [  # one output shorter
        {"prompt": 0, "position": 2, "plain": 3, "spec": None, "gap": None},
        {"prompt": 1, "position": 2, "plain": None, "spec": 6, "gap": None}]
