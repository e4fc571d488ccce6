"""bench/chain_ahead.py on the CPU: every arm timed at each batch size in one run, ratios from that run, the
chain arms' tokens compared (the GPU run is what the figures come from)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_chain_ahead_bench_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "chain_ahead.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chain_ahead.py"), "--device", "cpu",
                           "--target-layers", "1", "--batches", "1,3", "--tokens", "12", "--reps", "1", "--adaptive",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(r["batch"], r["arm"]): r for r in res["rows"]}
    arms = ("plain overlapped", "chain stepped", "chain ahead", "chain ahead adaptive")
    assert set(rows) == {(b, a) for b in (1, 3) for a in arms}
    for b in (1, 3):
        plain, stepped, ahead = (rows[b, a] for a in ("plain overlapped", "chain stepped", "chain ahead"))
        assert plain["mean_accepted_length"] == 1.0 and plain["tok_s_over_plain"] == 1.0
        assert stepped["steps_ahead"] == 0 and ahead["steps_ahead"] > 0  # only the chain-ahead arm went ahead
        assert abs(ahead["tok_s_over_chain_stepped"] - ahead["tok_s"] / stepped["tok_s"]) < 0.002
        # float32 on the CPU: both chain arms emit plain decoding's tokens, request for request
        assert ahead["requests_same_tokens_as_stepped"] == f"{b}/{b}"
        assert ahead["requests_same_tokens_as_plain"] == stepped["requests_same_tokens_as_plain"] == f"{b}/{b}"
        assert rows[b, "chain ahead adaptive"]["requests_same_tokens_as_plain"] == f"{b}/{b}"
