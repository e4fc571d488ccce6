"""bench/verify_profile.py: the exposed-time attribution, and a CPU smoke run of the script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from verify_profile import exposed  # noqa: E402


def test_exposed_time_under_overlap_and_gaps():
    spans = [
        (0.0, 10.0, "a"),  # alone: 10
        (8.0, 15.0, "b"),  # starts early (PDL), ends 5 past a: 5
        (9.0, 12.0, "c"),  # hidden inside b: 0
        (20.0, 24.0, "a"),  # after a 5 us gap: the gap counts to it, 9
        (23.0, 30.0, "b"),  # 6
    ]
    out = exposed(spans)
    assert out == {"a": 19.0, "b": 11.0, "c": 0.0}
    assert sum(out.values()) == 30.0  # the span from the first start to the last end
    assert exposed(list(reversed(spans))) == out  # order of the events does not matter
    assert exposed([]) == {}


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "vp.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "verify_profile.py"), "--device", "cpu", "--layers", "1",
                    "--batches", "1,2", "--nodes", "1,2", "--reps", "2", "--context", "32", "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["nodes"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["wall_us"] > 0 and r["host_us"] > 0 for r in rows)


def test_graph_census_counts_nodes_edges_and_kernels():
    from verify_profile import graph_census

    dot = "\n".join([
        "digraph dot {",
        'subgraph cluster_1 {',
        'label="graph_1" graph[style="dashed"];',
        '"graph_1_node_0"[style="solid" shape="record" label="{KERNEL\\n| {ID | 0}\\n| {name | _int4_gemv_kernel}}"];',
        '"graph_1_node_1"[style="solid" shape="record" label="{',
        'KERNEL',
        '| {name | _int4_gemv_kernel}}"];',
        '"graph_1_node_2"[style="solid" shape="record" label="{MEMCPY\\n| {kind | HtoD}}"];',
        '"graph_1_node_3"[style="solid" shape="record" label="{KERNEL\\n| {name | _rms_norm_kernel_0d1}}"];',
        '"graph_1_node_0" -> "graph_1_node_1";',
        '"graph_1_node_1" -> "graph_1_node_2" [label="programmatic"];',
        '"graph_1_node_2" -> "graph_1_node_3";',
        "}", "}"])
    out = graph_census(dot)
    assert out["nodes"] == {"KERNEL": 3, "MEMCPY": 1}
    assert out["edges"] == {"plain": 2, "programmatic": 1}
    assert out["kernels"] == {"_int4_gemv_kernel": 2, "_rms_norm_kernel_0d1": 1}


def test_int4_ab_cpu_smoke_run(tmp_path):
    """bench/int4_ab.py on the CPU (the reference path under both arms): every row timed, both arms' logits
    equal, a summary per shape; each flag arm is set on the launcher module in turn."""
    out = tmp_path / "ab.json"
    for flag, arms in (("ROPE=0,1", [False, True]), ("TUNE=cold,chain", ["cold", "chain"])):
        subprocess.run([sys.executable, str(ROOT / "bench" / "int4_ab.py"), "--device", "cpu", "--layers", "1",
                        "--flag", flag, "--batches", "1,2", "--nodes", "1,2", "--rounds", "1", "--context", "32",
                        "--out", str(out)], check=True, capture_output=True, cwd=ROOT)
        res = json.loads(out.read_text())
        assert res["flag"] == flag.split("=")[0] and res["arms"] == arms
        assert [(r["arm"], r["batch"], r["nodes"]) for r in res["rows"]] == [
            (arm, b, n) for arm in arms for b in (1, 2) for n in (1, 2)]
        assert all(c["max_rel_diff"] == 0 and c["argmax_agree"] == 1 for c in res["check"])
        assert len(res["summary"]) == 4 and all(s["a_us"] > 0 and s["b_us"] > 0 for s in res["summary"])


def test_int4_ab_refuses_a_bad_flag(tmp_path):
    """An unknown flag, one setting, or a boolean flag given other settings than 0 / 1: a message naming it."""
    for flag in ("NOPE=0,1", "ROPE=1", "ROPE=on,off"):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "int4_ab.py"), "--device", "cpu", "--flag", flag,
                            "--out", str(tmp_path / "x.json")], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode != 0 and flag in r.stderr
