"""bench/quant.py's results writer: a run adds its rows to a file measured the same way, each row stamped with
the date, commit and device it was measured at, and the file's hand-written note survives."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from quant import write  # noqa: E402


def args(out: Path, gptq_device: str | None) -> argparse.Namespace:
    return argparse.Namespace(gptq_device=gptq_device, tune_device=None, eval_device=None, arms="x", ppl_text="file",
                              prompts=8, max_tokens=64, draft_layers=20, calib_seqs=128, calib_len=256, out=str(out))


def test_merged_rows_keep_their_own_device_and_the_note_survives(tmp_path: Path) -> None:
    out, ck = tmp_path / "quant.json", SimpleNamespace(source="/models/smollm2")
    write(args(out, "cuda"), ck, [{"method": "dense_bf16", "perplexity": 10.0}], "text", 100, "aaa1111")
    first = json.loads(out.read_text())
    assert "GPTQ on cuda" in first["device"] and first["rows"][0]["device"] == first["device"]
    first["note"] = "written by hand"
    out.write_text(json.dumps(first))

    write(args(out, None), ck, [{"method": "rtn_g128", "perplexity": 13.0}], "text", 100, "bbb2222")
    merged = json.loads(out.read_text())
    rows = {r["method"]: r for r in merged["rows"]}
    assert set(rows) == {"dense_bf16", "rtn_g128"}
    assert rows["dense_bf16"]["commit"] == "aaa1111" and "GPTQ on cuda" in rows["dense_bf16"]["device"]
    assert rows["rtn_g128"]["commit"] == "bbb2222" and "GPTQ" not in rows["rtn_g128"]["device"]
    assert merged["device"] == "each row names its own"
    assert merged["note"] == "written by hand"
    assert rows["rtn_g128"]["perplexity_ratio_to_dense_bf16"] == 1.3


def test_a_file_measured_another_way_is_replaced(tmp_path: Path) -> None:
    out, ck = tmp_path / "quant.json", SimpleNamespace(source="/models/smollm2")
    write(args(out, None), ck, [{"method": "dense_bf16", "perplexity": 10.0}], "text", 100, "aaa1111")
    write(args(out, None), ck, [{"method": "rtn_g128", "perplexity": 13.0}], "other text", 100, "bbb2222")
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["rtn_g128"]
