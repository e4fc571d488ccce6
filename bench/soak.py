"""Soak: thousands of mixed requests against a live gateway on a tiny random model, then the books.

    python bench/soak.py --requests 2000 --out bench/results/reliability.json

One uvicorn in this process serves a tiny random engine (the test suite's; a few ms a step) with a small
KV pool, so preemption happens. The driver mixes stream and non-stream, speculation on and off over
every drafter, clients that leave at random points, malformed bodies, and engine faults (a forward pass
that raises). Afterwards it checks what must hold whatever happened:
  - every request ended in exactly one terminal state, on the client (one outcome each) and on the server
    (``specgate_requests_total`` counted it exactly once);
  - every KV block is back in its pool, no admission slot is held, nothing hangs;
  - resident memory at the end is close to what it was once warm.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "tests", ROOT / "tests" / "gateway"):  # the tiny model lives with the tests
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from engine_util import tiny_engine  # noqa: E402
from gateway_util import MODEL, FaultyForward, LiveServer, make_app, make_tokenizer  # noqa: E402

HANG_S = 60.0  # no request here needs more than a few seconds
DRAFTERS = ["self", "ngram", "exact", "draft"]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def plan(i: int, rng: random.Random) -> dict[str, Any]:
    """What request ``i`` does: its body, and how its client behaves."""
    spec = rng.random() < 0.5
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(2, 32), "ignore_eos": rng.random() < 0.7,
                            "temperature": rng.choice([0, 0, 0.7, 1.0]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": f"soak request {i} " + "word " * rng.randint(0, 20)}]
    else:
        body["prompt"] = f"Hello {i} " * rng.randint(1, 8)
    if spec:
        body["speculation"] = {"enabled": True, "drafter": rng.choice(DRAFTERS)}
    else:
        body["speculation"] = {"enabled": False}
    roll = rng.random()
    action = "cancel" if roll < 0.12 else "invalid" if roll < 0.17 else "fault" if roll < 0.20 else "normal"
    if action == "invalid":
        body[rng.choice(["max_tokens", "temperature", "stop"])] = rng.choice([-1, "x", 1e308, [1, 2]])
    return {"body": body, "action": action, "keep_lines": rng.randrange(0, 12), "wait_s": rng.uniform(0.005, 0.2)}


async def one(http: httpx.AsyncClient, base: str, p: dict[str, Any], faults: FaultyForward) -> str:
    """Send one request; its single outcome: a status, "error_event", "cancelled" or "hang"."""
    body = p["body"]
    url = base + ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    if p["action"] == "fault":
        faults.arm(1)  # the next forward pass fails: whichever requests share that step end in "error"
    try:
        return await asyncio.wait_for(_exchange(http, url, body, p), HANG_S)
    except asyncio.TimeoutError:
        return "hang"


async def _exchange(http: httpx.AsyncClient, url: str, body: dict[str, Any], p: dict[str, Any]) -> str:
    cancel = p["action"] == "cancel"
    if not body["stream"]:
        try:
            r = await http.post(url, json=body, timeout=p["wait_s"] if cancel else HANG_S)
        except httpx.TimeoutException:
            return "cancelled"
        return str(r.status_code)
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code)
        last, n = "", 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if cancel and n >= p["keep_lines"]:
                return "cancelled"  # leaving the block drops the connection mid-stream
            last, n = (line if line != "data: [DONE]" else last), n + 1
        return "error_event" if '"error"' in last else "200"


def server_counts(metrics: str) -> int:
    return int(sum(float(v) for v in re.findall(r'^specgate_requests_total\{[^}]*\} (\S+)$', metrics, re.M)))


def leaked_blocks(engine) -> int:
    pools = [engine.cache.pool] + [d.cache.pool for d in engine.drafters.values() if hasattr(d, "cache")]
    return sum(p.num_blocks - p.num_free for p in pools)


async def drive(base: str, plans: list[dict[str, Any]], faults: FaultyForward, concurrency: int,
                on_warm) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    warm_at = max(1, len(plans) // 10)
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=HANG_S, limits=limits) as http:
        async def task(p):
            nonlocal done
            async with gate:
                out = await one(http, base, p, faults)
            done += 1
            if done == warm_at:
                on_warm()
            return out

        return await asyncio.gather(*(task(p) for p in plans))


def soak(requests: int, concurrency: int = 24, seed: int = 0, overlap: bool = False) -> dict[str, Any]:
    """``overlap``: the engine's plain steps launched ahead (gateway/overlap.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from threads, and they stall on a shared machine
    try:
        return _soak(requests, concurrency, seed, overlap)
    finally:
        torch.set_num_threads(threads)


def _soak(requests: int, concurrency: int, seed: int, overlap: bool) -> dict[str, Any]:
    tokenizer = make_tokenizer()
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=48, page_size=4)  # small: preemption happens
    engine.config = replace(engine.config, overlap=overlap)
    app = make_app(tokenizer, engine=engine)
    faults = FaultyForward(engine)
    rng = random.Random(seed)
    plans = [plan(i, rng) for i in range(requests)]
    rss: dict[str, float] = {}
    t0 = time.monotonic()
    with LiveServer(app) as live:
        outcomes = asyncio.run(drive(live.url, plans, faults, concurrency, lambda: rss.setdefault("start", rss_mb())))
        settle = time.monotonic() + 10
        gw = app.state.gateway
        while (leaked_blocks(engine) or engine.has_work() or gw.in_flight) and time.monotonic() < settle:
            time.sleep(0.05)
        counted = server_counts(httpx.get(live.url + "/metrics").text)
        rss["end"] = rss_mb()
        report = {
            "date": datetime.date.today().isoformat(), "commit": commit(), "requests": requests,
            "by_status": dict(sorted(Counter(outcomes).items())), "faults_injected": faults.fired,
            "steps_ahead": engine.num_ahead,
            "kv_blocks_leaked": leaked_blocks(engine), "hangs": outcomes.count("hang"),
            "rss_mb_start": rss["start"], "rss_mb_end": rss["end"],
            "server_terminal_states": counted, "admission_slots_leaked": gw.in_flight,
            "preemptions": engine.num_preemptions, "concurrency": concurrency,
            "duration_s": round(time.monotonic() - t0, 1),
            "notes": "rss_mb_start is taken once 10% of the requests are done (allocator warm); one process "
                     "holds server and clients; tiny random model (tests/engine_util.py), 48 KV blocks of 4",
        }
    return report


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out


def problems(report: dict[str, Any], rss_growth_mb: float = 64.0) -> list[str]:
    """What a healthy soak must not show."""
    out = []
    if report["kv_blocks_leaked"]:
        out.append(f"{report['kv_blocks_leaked']} KV blocks leaked")
    if report["hangs"]:
        out.append(f"{report['hangs']} requests hung")
    if report["admission_slots_leaked"]:
        out.append(f"{report['admission_slots_leaked']} admission slots held")
    if report["server_terminal_states"] != report["requests"]:
        out.append(f"server counted {report['server_terminal_states']} terminal states for {report['requests']}")
    if sum(report["by_status"].values()) != report["requests"]:
        out.append("a request has no single client outcome")
    if any(k.startswith("5") and k != "500" for k in report["by_status"]):
        out.append(f"unexpected 5xx: {report['by_status']}")
    if report["rss_mb_end"] - report["rss_mb_start"] > rss_growth_mb:
        out.append(f"RSS grew {report['rss_mb_start']} -> {report['rss_mb_end']} MB")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", action="store_true", help="plain steps launched ahead (EngineConfig.overlap)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "reliability.json"))
    args = p.parse_args()
    report = soak(args.requests, args.concurrency, args.seed, args.overlap)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    bad = problems(report)
    for line in bad:
        print("FAIL:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
