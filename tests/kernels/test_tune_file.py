"""Tuned INT4 picks kept on disk (kernels/tune_file.py and the launcher's use of it)."""

import dataclasses
import json
import logging

import pytest
import torch

from gateway.llm import LoadConfig, tune_file_path
from kernels import int4_matmul_triton as T
from kernels.int4_matmul import int4_matmul
from kernels import tune_file
from kernels.tune_file import TuneFile
from test_int4_matmul import TOL, _ref, _rel_err, _weight, _x  # (tests/kernels/)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PICK = ["hgemv", 1, 512, 64, 8, 4, 1]


def test_a_pick_survives_into_a_new_reader_of_the_same_fingerprint_only(tmp_path):
    path = tmp_path / "cache" / "int4_tune.json"  # the folder is made on the first write
    TuneFile(path, "gpu A").put("M1 N960 K576", PICK)
    assert TuneFile(path, "gpu A").get("M1 N960 K576") == PICK
    assert TuneFile(path, "gpu A").get("M2 N960 K576") is None
    assert TuneFile(path, "gpu B").get("M1 N960 K576") is None


def test_writers_merge_into_the_file_on_disk(tmp_path):
    """Two processes' files (each read before the other wrote) and two fingerprints: every pick is kept."""
    path = tmp_path / "int4_tune.json"
    first, second, other = TuneFile(path, "gpu A"), TuneFile(path, "gpu A"), TuneFile(path, "gpu B")
    assert first.get("k1") is None and second.get("k2") is None  # both read the empty file
    first.put("k1", PICK)
    second.put("k2", PICK[:-1] + [2])
    other.put("k1", PICK[:-2] + [8, 3])
    sections = json.loads(path.read_text())["sections"]
    assert {fp: sec["picks"] for fp, sec in sections.items()} == {
        "gpu A": {"k1": PICK, "k2": PICK[:-1] + [2]}, "gpu B": {"k1": PICK[:-2] + [8, 3]}}
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_the_file_keeps_the_most_recently_written_fingerprints(tmp_path, monkeypatch):
    """Every edit of the kernels' source is a new fingerprint: the file keeps the MAX_SECTIONS newest sections."""
    path = tmp_path / "int4_tune.json"
    clock = iter(range(100, 200))
    monkeypatch.setattr(tune_file.time, "time", lambda: next(clock))
    for i in range(tune_file.MAX_SECTIONS):
        TuneFile(path, f"source {i}").put("k1", PICK)
    TuneFile(path, "source 0").put("k2", PICK)  # written again: the newest now
    for i in range(tune_file.MAX_SECTIONS, tune_file.MAX_SECTIONS + 2):  # two more push out the two oldest
        TuneFile(path, f"source {i}").put("k1", PICK)
    kept = json.loads(path.read_text())["sections"]
    assert len(kept) == tune_file.MAX_SECTIONS
    assert "source 0" in kept and "source 1" not in kept and "source 2" not in kept and "source 3" in kept
    assert TuneFile(path, "source 0").get("k1") == PICK  # its older picks stayed with it


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "sections": {}}), json.dumps([1, 2])])
def test_an_unreadable_file_is_retuned_and_then_rewritten(tmp_path, caplog, content):
    path = tmp_path / "int4_tune.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="specgate.tune"):
        assert TuneFile(path, "gpu A").get("k1") is None
    assert "timed again" in caplog.text
    TuneFile(path, "gpu A").put("k1", PICK)
    assert TuneFile(path, "gpu A").get("k1") == PICK


def test_an_unwritable_file_keeps_the_picks_for_this_process(tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    tune = TuneFile(blocker / "int4_tune.json", "gpu A")  # its folder would have to be a file's child
    with caplog.at_level(logging.WARNING, logger="specgate.tune"):
        tune.put("k1", PICK)
        tune.put("k2", PICK)
    assert caplog.text.count("not written") == 1
    assert tune.get("k1") == PICK and tune.get("k2") == PICK


def test_the_launcher_takes_a_stored_pick_only_while_it_is_a_candidate(tmp_path, monkeypatch):
    monkeypatch.setattr(T, "tune_fingerprint", lambda device: "test gpu")
    T.use_tune_file(tmp_path / "int4_tune.json")
    try:
        key = (1, 960, 576, 32, torch.bfloat16, True, False, False, 0, torch.device("cpu"))
        cands = T._candidates(1, 960, 576, False, 132, 32)
        pick = cands[-1]
        assert T._stored_pick(key, cands, key[-1]) is None
        T._tune_file(key[-1]).put(T._key_name(key), list(dataclasses.astuple(pick)))
        T.use_tune_file(tmp_path / "int4_tune.json")  # a new process: the file is read afresh
        assert T._stored_pick(key, cands, key[-1]) == pick
        assert T._stored_pick(key, cands[:-1], key[-1]) is None  # no longer offered: timed again
        T._tune_file(key[-1]).put(T._key_name(key), ["hgemv", 1])  # not a config's fields
        assert T._stored_pick(key, cands, key[-1]) is None
        assert T._key_name(key) == "M1 N960 K576 G32 bfloat16 zeros=1 whole=0 silu=0 head_dim=0"
    finally:
        T.use_tune_file(None)
    assert T._tune_file(key[-1]) is None


def test_tune_file_paths(tmp_path):
    assert tune_file_path(LoadConfig(int4_tune_file="none")) is None
    assert tune_file_path(LoadConfig(cache_dir=str(tmp_path))) == tmp_path / "int4_tune.json"
    assert tune_file_path(LoadConfig(int4_tune_file=str(tmp_path / "t.json"))) == tmp_path / "t.json"


@gpu
def test_gpu_a_second_process_runs_the_first_ones_picks_without_timing(tmp_path, monkeypatch):
    """Tuned once with a tune file; then, as in a restarted process (an empty in-memory cache), the same shapes
    take the stored picks with timing unavailable, eagerly and inside a graph capture; a changed INT4 switch
    is another fingerprint."""
    monkeypatch.setattr(T, "_CONFIG_CACHE", {})
    T.use_tune_file(tmp_path / "int4_tune.json")
    try:
        w = _weight(960, 576, 32, True, torch.bfloat16, seed=5)
        for M in (1, 4):
            int4_matmul(_x(M, 576, torch.bfloat16), w)
        tuned = dict(T._CONFIG_CACHE)
        assert len(tuned) == 2

        def no_timing(*args, **kwargs):
            raise AssertionError("timed again")

        monkeypatch.setattr(T, "_CONFIG_CACHE", {})
        monkeypatch.setattr(T, "_time_configs", no_timing)
        monkeypatch.setattr(T, "_time_chain", no_timing)
        T.use_tune_file(tmp_path / "int4_tune.json")
        x = _x(4, 576, torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # first met inside a capture: the stored pick, not the untuned default
            y = int4_matmul(x, w)
        graph.replay()
        assert _rel_err(y, _ref(x, w)) < TOL[torch.bfloat16]
        y1 = int4_matmul(_x(1, 576, torch.bfloat16), w)
        assert _rel_err(y1, _ref(_x(1, 576, torch.bfloat16), w)) < TOL[torch.bfloat16]
        assert T._CONFIG_CACHE == tuned
        assert T.PICKS["stored"] >= 2
        before = T.tune_fingerprint(x.device)
        monkeypatch.setenv("SPECGATE_INT4_FIX_ROWS", "8")
        assert T.tune_fingerprint(x.device) != before
    finally:
        T.use_tune_file(None)


def test_with_the_tuner_off_a_pick_timed_before_is_not_taken(monkeypatch):
    """set_autotune(False) means the first candidate, even for a key an earlier (tuned) call cached: a CUDA test
    comparing two arms with the tuner off once took picks timed by the tests before it, and failed only then."""
    x = torch.randn(1, 256)
    cands = T._candidates(1, 512, 256, False, T._num_sms(x), 64, T._is_16bit(x), 0)
    timed = cands[-1]
    assert timed != cands[0]
    key = ("a key an earlier call tuned",)
    monkeypatch.setitem(T._CONFIG_CACHE, key, timed)
    assert T._pick(x, 512, 64, key, False, run=None) == timed
    monkeypatch.setattr(T, "_autotune", False)
    assert T._pick(x, 512, 64, key, False, run=None) == cands[0]
