"""`python -m gateway serve`: config files under flags, and the real command on a tiny model directory,
stopped by SIGINT or SIGTERM while a stream is open: the stream ends in protocol, new requests are refused."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from engine_util import random_weights, tiny_config
from gateway.cli import main, serve_options
from gateway.serve import apply_config, read_config
from gateway_util import CHAT_TEMPLATE
from target.loader import LoadedCheckpoint, save_hf_dir

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]):
    args = serve_options().parse_args(argv)
    args.func, args.command = None, "serve"
    return apply_config(args, serve_options(), argv)


@pytest.mark.parametrize("name, text", [
    ("c.json", '{"port": 9001, "num-blocks": 64, "tree": [2, 1], "api_key": "k"}'),
    ("c.toml", 'port = 9001\nnum-blocks = 64\ntree = [2, 1]\napi_key = "k"\n'),
])
def test_config_file_sets_defaults_and_flags_win(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    args = parse(["--config", str(path), "--num-blocks", "32"])
    assert (args.port, args.num_blocks, args.tree, args.api_key, args.host) == (9001, 32, (2, 1), "k", "127.0.0.1")


def test_config_file_with_an_unknown_option_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"prot": 1}')
    with pytest.raises(ValueError, match="unknown option 'prot'"):
        read_config(str(path), serve_options())
    assert main(["serve", "--config", str(path)]) == 2
    assert "unknown option 'prot'" in capsys.readouterr().err


@pytest.fixture
def model_dir(tmp_path: Path, tokenizer) -> Path:
    cfg = tiny_config(vocab=len(tokenizer), eos_token_ids=(2,))
    ckpt = LoadedCheckpoint(cfg, random_weights(cfg), tokenizer, CHAT_TEMPLATE, "tiny")
    return save_hf_dir(ckpt, tmp_path / "tiny-llama")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("engine", ["--engine-thread", "--engine-process"])
def test_serve_command_drains_on_signal_with_a_stream_open(model_dir: Path, sig: signal.Signals, engine: str) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", str(model_dir), "--quantize", "none",
           "--port", str(port), "--num-blocks", "64", "--log-level", "warning", engine]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, proc)
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                          json=body | {"max_tokens": 500, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(lines)
            proc.send_signal(sig)  # shutdown must end the open stream, not wait for it
            late = late_request(url + "/v1/chat/completions", body)
            rest = [line for line in lines if line]
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    # the open stream was ended by the server, in protocol: an error event, then [DONE]
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2], rest[-2:]
    assert late in ("refused", 503), late  # never served by a server that is going away


def late_request(url: str, body: dict) -> int | str:
    """A request sent after the signal: 503 while uvicorn still holds its socket, refused once it closed it."""
    time.sleep(0.2)  # let the signal land
    try:
        return httpx.post(url, json=body, timeout=10).status_code
    except httpx.TransportError:
        return "refused"


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


@pytest.mark.parametrize("flags, overlap, gate", [([], None, True), (["--no-overlap", "--no-spec-gate"], False, False),
                                                  (["--overlap"], True, True)])
def test_overlap_and_gate_flags_reach_the_engine_config(flags: list[str], overlap, gate: bool) -> None:
    """By default the engine decides the overlap by its target (None) and runs the speculation gate."""
    from gateway.cli import engine_config

    cfg = engine_config(serve_options().parse_args(flags))
    assert cfg.overlap is overlap and cfg.scheduler.budget.gate is gate


@pytest.mark.parametrize("flags, drafters", [([], None), (["--gate-drafters", "draft, ngram"], ("draft", "ngram")),
                                             (["--gate-drafters", "none"], ())])
def test_gate_drafters_flag_reaches_the_budget(flags: list[str], drafters) -> None:
    """None leaves the choice to the loader (a loaded draft model, then n-grams); none turns it off."""
    from gateway.cli import engine_config

    assert engine_config(serve_options().parse_args(flags)).scheduler.budget.gate_drafters == drafters


def test_gate_drafters_flag_refuses_an_empty_list() -> None:
    with pytest.raises(SystemExit):
        serve_options().parse_args(["--gate-drafters", ","])


def test_a_config_file_turns_the_overlap_and_the_gate_off(tmp_path: Path) -> None:
    from gateway.cli import engine_config

    path = tmp_path / "c.toml"
    path.write_text("overlap = false\nspec-gate = false\n")
    cfg = engine_config(parse(["--config", str(path)]))
    assert cfg.overlap is False and cfg.scheduler.budget.gate is False


def test_loader_lets_the_gate_choose_drafters_on_the_cpu_only() -> None:
    """``default_gate_drafters``: with a draft model loaded, the CPU gate picks among it and n-grams; CUDA targets
    keep the default drafter against plain decoding (the draft arm cost the H100 default 0.709x at batch 16);
    a feature draft is never a gate arm, and without a model only the default drafter is run."""
    from draft.ngram import NgramDrafter
    from gateway.llm import default_gate_drafters

    class Model:  # a model drafter, as far as the choice looks
        wants_features = False

    class Feature:
        wants_features = True

    ngram = NgramDrafter()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_gate_drafters({"ngram": ngram, "draft": Model()}, "ngram", cpu) == ("draft", "ngram")
    assert default_gate_drafters({"ngram": ngram, "draft": Model()}, "ngram", cuda) == ()
    assert default_gate_drafters({"ngram": ngram, "draft": Feature()}, "draft", cpu) == ()
    assert default_gate_drafters({"ngram": ngram}, "ngram", cpu) == ()
