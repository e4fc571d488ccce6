"""Host time of the whole gateway under streaming load, with the model's forwards stubbed out.

``bench/host_step.py`` times the engine's Python alone. A served token costs more than that: the
runner's metrics, the hand-off to the event loop, detokenization, the SSE chunk and the socket write,
all under one GIL with the engine thread. This bench serves a tiny random engine whose forwards return
logits from a fixed rule (next token = 7 t + 1, past the tokenizer's specials) behind the real app and
uvicorn, opens N concurrent streams of ``--tokens`` tokens each (speculation off, ``ignore_eos``) and
reports tokens per second delivered (every stream's ``--tokens``, over the wall time) and SSE chunks per
second (a server that coalesces a stream's queued steps sends fewer chunks for the same tokens). Commits are compared in one run, as in host_step.py: each ref runs from its
own git worktree in its own server process; refs alternate within every repetition, and each figure
is the best repetition.

    python bench/gateway_host.py --refs 93ee9a6,HEAD --out bench/results/gateway_host_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from worktrees import short, worktrees  # bench/, this script's own directory

SERVER = r"""
import sys
import torch
torch.set_num_threads(1)
import uvicorn
from engine_util import tiny_engine
from gateway_util import make_app, make_tokenizer

tok = make_tokenizer()
V = len(tok)


def rule(batch, cache):
    rows = batch.logits_indices.shape[0]
    out = torch.zeros(rows, V)
    out[torch.arange(rows), (batch.tokens[batch.logits_indices] * 7 + 1) % (V - 10) + 10] = 5.0
    return out


if sys.argv[4] == "process":  # the engine in a process of its own (gateway/engine_proc.py)
    from gateway.engine_proc import ProcessRunner
    from gateway_host import stub_engine
    from gateway_util import make_process_app
    app = make_process_app(ProcessRunner(stub_engine))
else:
    engine = tiny_engine(vocab=V, num_blocks=8192, page_size=16, max_running=128)
    engine.target.forward = rule
    app = make_app(tok, engine=engine)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop=sys.argv[2], http=sys.argv[3])
"""


class _Rule:
    """The stub forward: logits that make token ``7 t + 1`` (past the specials) follow ``t``."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __call__(self, batch, cache):
        import torch

        rows = batch.logits_indices.shape[0]
        out = torch.zeros(rows, self.vocab)
        out[torch.arange(rows), (batch.tokens[batch.logits_indices] * 7 + 1) % (self.vocab - 10) + 10] = 5.0
        return out


def stub_engine():
    """SERVER's engine, built in an engine process (``--stacks .../process``): a factory it can import."""
    import torch
    from engine_util import tiny_engine
    from gateway_util import CHAT_TEMPLATE, MODEL, make_tokenizer

    torch.set_num_threads(1)
    tok = make_tokenizer()
    engine = tiny_engine(vocab=len(tok), num_blocks=8192, page_size=16, max_running=128)
    engine.target.forward = _Rule(len(tok))
    engine.tokenizer = tok
    return engine, {"tokenizer": tok, "chat_template": CHAT_TEMPLATE, "model_name": MODEL, "device": "cpu"}


async def stream_load(port: int, streams: int, tokens: int) -> tuple[float, float]:
    """Tokens and chunks per second over ``streams`` concurrent completions of ``tokens`` tokens."""
    import httpx

    async def one(client, i: int) -> int:
        body = {"model": "tiny", "prompt": f"Hello world {i}", "max_tokens": tokens, "stream": True,
                "ignore_eos": True, "temperature": 0, "speculation": {"enabled": False}}
        n = 0
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                n += line.startswith("data: ") and line != "data: [DONE]"
        return n

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + 4)) as client:
        await one(client, 0)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client, i) for i in range(streams)))
        secs = time.perf_counter() - t0
        return streams * tokens / secs, sum(counts) / secs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tree: Path, port: int, stack: str = "auto/auto") -> subprocess.Popen:
    """The stub server from ``tree`` on ``port``; ``stack``: uvicorn's event loop and HTTP protocol, and where the
    engine runs: "LOOP/HTTP" (a thread of the server) or "LOOP/HTTP/process" (a process of its own)."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'tests'}:{tree / 'tests' / 'gateway'}:{tree / 'bench'}"}
    loop, http, *where = stack.split("/")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), loop, http, where[0] if where else "thread"],
                            cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import httpx

    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server at {tree} exited: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server at {tree} never became ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", default="HEAD", help="commits to compare, comma-separated")
    ap.add_argument("--stacks", default="auto/auto",
                    help="uvicorn event loops and HTTP protocols to compare, LOOP/HTTP comma-separated "
                         "(asyncio/h11, uvloop/httptools; auto/auto takes what is installed); LOOP/HTTP/process "
                         "runs the engine in a process of its own (serve --engine-process)")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    refs, stacks, levels = args.refs.split(","), args.stacks.split(","), [int(s) for s in args.streams.split(",")]
    # an arm is a ref, or a ref and a server stack when stacks are compared
    arms = [(ref, stack) for ref in refs for stack in stacks]
    name = {arm: arm[0] if len(stacks) == 1 else f"{arm[0]}:{arm[1]}" for arm in arms}
    best: dict[str, dict[int, tuple[float, float]]] = {name[arm]: {} for arm in arms}  # (tokens/s, chunks/s)
    with worktrees(refs) as trees:
        for rep in range(args.reps):
            for ref, stack in arms:
                ref_name = name[ref, stack]
                port = free_port()
                proc = serve(trees[ref], port, stack)
                try:
                    for n in levels:
                        rate = asyncio.run(stream_load(port, n, args.tokens))
                        best[ref_name][n] = max(best[ref_name].get(n, (0.0, 0.0)), rate)
                        print(f"rep {rep} {ref_name} {n} streams: {rate[0]:.0f} tokens/s, {rate[1]:.0f} chunks/s",
                              flush=True)
                finally:
                    proc.kill()
                    proc.wait()
    names = [name[arm] for arm in arms]
    rows = [{"streams": n, **{f"tokens_per_s_{a}": round(best[a][n][0]) for a in names},
             **{f"chunks_per_s_{a}": round(best[a][n][1]) for a in names}} for n in levels]
    if len(names) == 2:
        for row in rows:
            first, last = (row[f"tokens_per_s_{a}"] for a in names)
            row["tokens_ratio_last_over_first"] = round(last / first, 2)
    for row in rows:
        print(row)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": f"cpu ({platform.machine()}, {os.cpu_count()} cpus; server, client and engine share them)",
            "date": datetime.date.today().isoformat(), "commit": short("HEAD"),
            "refs": {ref: short(ref) for ref in refs}, "stacks": stacks, "reps": args.reps,
            "tokens_per_stream": args.tokens, "command": "python bench/gateway_host.py " + " ".join(sys.argv[1:]),
            "notes": __doc__.split("\n\n", 1)[1].strip(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
