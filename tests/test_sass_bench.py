"""bench/kernels/sass.py compiles the INT4 kernels for sm_90 on a host without a GPU (ptxas and cuobjdump come
with Triton's wheel). A kernel argument added without its entry in the tool's signature broke every case once;
compiling the first case of each path keeps the tool in step with the kernels. It runs as its own process:
the test session's TRITON_INTERPRET=1 turns kernels into interpreted functions, which do not compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sass(tmp_path, *args: str) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    subprocess.run([sys.executable, "bench/kernels/sass.py", "int4", "--out", str(out), *args],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    return {r["case"].split("_")[0]: r for r in json.loads(out.read_text())["rows"]}


def test_sass_compiles_each_int4_path_for_sm90(tmp_path):
    rows = _sass(tmp_path, "--only", "hgemv_m1_n512_k64", "mma_m16_n128", "mmat_m16_n128")
    assert sorted(rows) == ["hgemv", "mma", "mmat"]
    for row in rows.values():
        assert row["stack_bytes"] == 0  # the shipped configs do not spill
        assert 1.0 < row["insns_per_weight"] < 8.0, row
    assert rows["hgemv"]["mix"].get("HFMA2", 0) > 0  # packed fp16 FMAs
    assert rows["mma"]["mix"].get("HMMA", 0) > 0  # mma.sync at 16-row tiles
    assert rows["mmat"]["mix"].get("HGMMA", 0) > 0  # the swap-AB path runs on wgmma
    assert rows["hgemv"]["l2_prefetches_ptx"] == 0  # no lookahead compiled in by default
    ahead = _sass(tmp_path, "--lookahead", "--only", "hgemv_m1_n512_k64")["hgemv"]
    # SPECGATE_INT4_LOOKAHEAD's prefetches of the next weight (its words, its scales) after the main loop, which
    # they leave as it was, with no spill
    assert ahead["l2_prefetches_ptx"] == 2
    assert ahead["stack_bytes"] == 0 and ahead["loop_insns"] == rows["hgemv"]["loop_insns"]
