"""HTTP load generator for A/B latency runs against one `python -m gateway serve`.

    python bench/load.py [--url http://127.0.0.1:8000] [--prompts-file PATH] [--concurrency 1,4]
        [--requests 16] [--rate inf] [--max-tokens 64] [--arm NAME=JSON ...] [--all-as JSON] [--out bench/results/load]

Each concurrency level sends ``--requests`` streaming chat completions whose arrivals are a Poisson
process of ``--rate`` requests/s (inf = all at once), with at most ``concurrency`` in flight. The arms
(``--arm off='{"enabled": false}'``: the request's ``speculation`` field) are mixed in one run: every
prompt goes once to every arm, in shuffled order, so the arms share the server's batches. ``--all-as JSON``
sends every one of those requests with one speculation field, labels kept: a one-mode server's run over
exactly a mixed run's requests, to compare an arm's latency request set for request set.

Per arm and level: TTFT, inter-token latency per token (a speculative chunk carries several tokens,
counted from ``stream_options.continuous_usage_stats``, so the gap is divided among them), TPOT,
end-to-end latency (p50 / p90 / p99), throughput, and the server's mean accepted length.
Writes ``OUT.json`` and ``OUT.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing
import os
import platform
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import provenance

HERE = Path(__file__).resolve().parent
MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"
DEFAULT_ARMS = ['off={"enabled": false}', 'on={"enabled": true}']
METRICS = ("ttft_s", "itl_s", "tpot_s", "e2e_s")


@dataclass(slots=True)
class Result:
    arm: str
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one entry per token after the first chunk
    tpot_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    mean_accepted_length: float | None = None


async def one_request(client: httpx.AsyncClient, prompt: str, arm: str, spec: dict, max_tokens: int,
                      model: str) -> Result:
    """One streaming chat completion; timestamps every chunk on arrival."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "speculation": spec,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    res, t0 = Result(arm), time.perf_counter()
    seen, t_first, t_prev, first_tokens = 0, None, None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now, chunk = time.perf_counter(), json.loads(line[len("data: "):])
            if "error" in chunk:
                res.error = chunk["error"]["message"]
                return res
            usage = chunk.get("usage") or {}
            new = usage.get("completion_tokens", seen) - seen
            if new > 0:
                if t_first is None:
                    t_first, first_tokens, res.ttft_s = now, new, now - t0
                else:
                    res.itl_s += [(now - t_prev) / new] * new
                t_prev, seen = now, seen + new
            if not chunk["choices"]:  # the final usage chunk
                res.mean_accepted_length = usage.get("speculation", {}).get("mean_accepted_length")
    res.e2e_s, res.tokens, res.ok = time.perf_counter() - t0, seen, True
    if seen > first_tokens:
        res.tpot_s = (t_prev - t_first) / (seen - first_tokens)
    return res


async def run_level(url: str, headers: dict, jobs: list[tuple[str, str, dict]], concurrency: int, rate: float,
                    max_tokens: int, model: str, seed: int) -> tuple[list[Result], float]:
    """All jobs (prompt, arm, spec) with Poisson arrivals and at most ``concurrency`` in flight."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:

        async def job(delay: float, prompt: str, arm: str, spec: dict) -> Result:
            await asyncio.sleep(delay)
            async with gate:
                try:
                    return await one_request(client, prompt, arm, spec, max_tokens, model)
                except httpx.HTTPError as exc:
                    return Result(arm, error=f"{type(exc).__name__}: {exc}")

        delays, t = [], 0.0
        for _ in jobs:
            delays.append(t)
            t += rng.expovariate(rate) if rate != float("inf") else 0.0
        start = time.perf_counter()
        results = await asyncio.gather(*(job(d, *j) for d, j in zip(delays, jobs)))
        return list(results), time.perf_counter() - start


def _client_process(url: str, headers: dict, jobs: list[tuple[str, str, dict]], concurrency: int, rate: float,
                    max_tokens: int, model: str, seed: int,
                    start_at: float) -> tuple[list[Result], float, float, float]:
    """One client process's share of a level (``--procs``): its results, CPU seconds, and start and end times
    (time.time()). It starts at ``start_at`` so that the processes' shares overlap as one level."""
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, t0 = time.process_time(), time.time()
    results, _ = asyncio.run(run_level(url, headers, jobs, concurrency, rate, max_tokens, model, seed))
    return results, time.process_time() - cpu0, t0, time.time()


def _client_ready() -> float:
    """Nothing: a first task that makes the pool start its processes (each imports this module) before a level."""
    return time.time()


async def run_level_procs(pool: ProcessPoolExecutor, procs: int, url: str, headers: dict,
                          jobs: list[tuple[str, str, dict]], concurrency: int, rate: float, max_tokens: int,
                          model: str, seed: int) -> tuple[list[Result], float, list[float]]:
    """A level split over ``procs`` client processes: jobs dealt round-robin, the concurrency and the arrival
    rate divided among them. One asyncio client parsing every SSE chunk saturated a core at ~10k tokens/s
    (client_cpu_share 0.95-0.97 at concurrency 64 on the H100 host, load_gpu_h100.json), so above that the
    level measured the client. Returns the results, the wall time and each process's CPU share."""
    n = max(1, min(procs, concurrency, len(jobs)))
    shares = [jobs[i::n] for i in range(n)]
    concs = [concurrency // n + (i < concurrency % n) for i in range(n)]
    loop, start_at = asyncio.get_running_loop(), time.time() + 0.5  # every process running before the first send
    parts = await asyncio.gather(*(
        loop.run_in_executor(pool, _client_process, url, headers, share, conc, rate / n, max_tokens, model,
                             seed + i, start_at)
        for i, (share, conc) in enumerate(zip(shares, concs))))
    wall = max(end for *_, end in parts) - min(start for _, _, start, _ in parts)
    return [r for res, *_ in parts for r in res], wall, [round(cpu / wall, 3) for _, cpu, _, _ in parts]


SERVER_FIELDS = ("steps", "drafted_tokens", "accepted_tokens", "verified_nodes", "mean_accepted_length")
GATE_KEY = "speculation_gate"  # beside the arm labels in a level's "server" (labels hold slashes, this does not)


async def server_stats(url: str, headers: dict, reset: bool = False) -> dict | None:
    """The server's per-arm counters since the last reset (``/v1/stats``), keyed by its arm labels
    (speculation/drafter/tree), with ``drafted_per_step``: draft nodes per request-step, the budget the
    scheduler gave that arm at this load. ``reset``: start the counters afresh (this clears the server's
    dashboard figures too). None when the server has no stats route."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as c:
        if reset:
            r = await c.post("/v1/stats/reset")
            return None if r.status_code != 200 else {}
        r = await c.get("/v1/stats")
        if r.status_code != 200:
            return None
    stats = r.json()
    out = {}
    for label, arm in stats.get("arms", {}).items():
        row = {k: arm.get(k) for k in SERVER_FIELDS}
        row["drafted_per_step"] = round(arm["drafted_tokens"] / arm["steps"], 4) if arm.get("steps") else None
        out[label] = row
    # the speculation gate's verdict and both arms' rates per batch bucket (not reset with the counters: what
    # it had learned by the end of this level)
    out[GATE_KEY] = stats.get("speculation_gate")
    return out


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    v = sorted(values)

    def pick(q: float) -> float:  # nearest rank, no interpolation: honest for small samples
        return round(v[max(0, math.ceil(q * len(v) - 1e-9) - 1)], 5)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": round(sum(v) / len(v), 5), "n": len(v)}


def summarize(results: list[Result], arm: str, wall_s: float) -> dict:
    """One arm of one level. Arms share the server's batches, so throughput is given per request (tokens over
    its end-to-end time) and as the arm's share of the level's tokens/s."""
    mine = [r for r in results if r.arm == arm]
    ok = [r for r in mine if r.ok]
    tokens = sum(r.tokens for r in ok)
    lengths = [r.mean_accepted_length for r in ok if r.mean_accepted_length is not None]
    return {
        "requests": len(mine), "errors": len(mine) - len(ok),
        "first_error": next((r.error for r in mine if r.error), None),
        "tokens": tokens, "share_tokens_per_s": round(tokens / wall_s, 3),  # this arm's part of the level's
        "request_tokens_per_s": percentiles([r.tokens / r.e2e_s for r in ok]),  # what one client sees
        "request_rates": [round(r.tokens / r.e2e_s, 3) for r in ok],  # each request's, for ab_rows' interval
        "mean_accepted_length": round(sum(lengths) / len(lengths), 4) if lengths else None,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
    }


def load_prompts(path: str, n: int, seed: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    random.Random(seed).shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(n)]


def parse_arms(specs: list[str]) -> dict[str, dict]:
    arms = {}
    for spec in specs:
        name, _, body = spec.partition("=")
        if not name or not body:
            raise SystemExit(f"--arm must be NAME=JSON, like on='{{\"enabled\": true}}'; got {spec!r}")
        arms[name] = json.loads(body)
    return arms


def git_commit() -> str:
    return provenance.commit(describe=True)


async def bench(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    arms = parse_arms(args.arm or DEFAULT_ARMS)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=30) as c:
        health = (await c.get("/health")).json()
        if health.get("status") != "ready":
            raise SystemExit(f"server not ready: {health}")
    all_as = None if args.all_as is None else json.loads(args.all_as)
    per_arm = max(1, args.requests // len(arms))
    prompts = load_prompts(args.prompts_file, per_arm * len(args.concurrency) + 1, args.seed)
    warm = [(prompts[-1], name, spec if all_as is None else all_as) for name, spec in arms.items()]  # not measured
    await run_level(args.url, headers, warm, len(warm), float("inf"), 8, health["model"], args.seed)
    levels, load_before = [], os.getloadavg()[0]
    # spawned, not forked: a fork from inside the running event loop would copy it into the children
    pool = ProcessPoolExecutor(args.procs, mp_context=multiprocessing.get_context("spawn")) if args.procs > 1 else None
    if pool is not None:  # start (and import in) every process now, not inside the first level's timing
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(pool, _client_ready) for _ in range(args.procs)))
    for k, conc in enumerate(args.concurrency):
        if args.server_stats:
            await server_stats(args.url, headers, reset=True)
        chunk = prompts[k * per_arm : (k + 1) * per_arm]
        jobs = [(p, name, spec) for p in chunk for name, spec in arms.items()]
        random.Random(args.seed + k).shuffle(jobs)
        if all_as is not None:  # the mixed run's jobs, in its order, each sent with one speculation field
            jobs = [(p, name, all_as) for p, name, _ in jobs]
        cpu0 = time.process_time()
        if pool is not None and conc > 1:
            results, wall, cpu_shares = await run_level_procs(pool, args.procs, args.url, headers, jobs, conc,
                                                              args.rate, args.max_tokens, health["model"],
                                                              args.seed + k)
        else:
            results, wall = await run_level(args.url, headers, jobs, conc, args.rate, args.max_tokens,
                                            health["model"], args.seed + k)
            cpu_shares = [round((time.process_time() - cpu0) / wall, 3)]
        row = {"concurrency": conc, "wall_s": round(wall, 3), "client_procs": len(cpu_shares),
               # the busiest client process's CPU time over the level's wall time: near 1, a client (its event
               # loop parsing every chunk) may be what limits the level, not the server
               "client_cpu_share": max(cpu_shares),
               "host_load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # host 1-min load before/after, this server included
               "tokens_per_s": round(sum(r.tokens for r in results if r.ok) / wall, 3),
               "arms": {name: summarize(results, name, wall) for name in arms}}
        if args.server_stats:  # what the server chose at this load: per arm, its drafts per request-step
            row["server"] = await server_stats(args.url, headers)
        levels.append(row)
        load_before = os.getloadavg()[0]
        print(f"concurrency {conc}: {len(results)} requests in {wall:.1f}s, {row['tokens_per_s']} tok/s, "
              f"client CPU {row['client_cpu_share']:.0%} (busiest of {len(cpu_shares)})")
    if pool is not None:
        pool.shutdown()
    report = {"date": datetime.date.today().isoformat(), "device": health.get("device"), "model": health["model"],
            "client": f"{platform.machine()}, {os.cpu_count()} cpus", "commit": git_commit(), "url": args.url,
            "requests_per_level": per_arm * len(arms),
            "rate_per_s": args.rate if args.rate != float("inf") else "inf", "max_tokens": args.max_tokens,
            "temperature": 0, "arms": arms, "levels": levels}
    if all_as is not None:
        report["all_as"] = all_as
    if {"on", "off"} <= set(arms):
        report["rows"] = ab_rows(levels)
    return report


def ratio_interval(on: list[float], off: list[float], draws: int = 2000, seed: int = 0) -> list[float] | None:
    """A 95% interval for p50(on) / p50(off): each arm's requests resampled with replacement, ``draws``
    times (percentile bootstrap, seeded). With 8 requests an arm, one run's ratio alone says little: the
    H200 read 1.037 and 0.936 for the same level in two runs (load_gpu.json, load_gpu_871c0a3.json)."""
    if not on or not off:
        return None
    rng = random.Random(seed)

    def p50(v: list[float]) -> float:
        v = sorted(v)
        return v[max(0, math.ceil(0.5 * len(v)) - 1)]  # the nearest rank, as ``percentiles``

    ratios = sorted(p50(rng.choices(on, k=len(on))) / p50(rng.choices(off, k=len(off))) for _ in range(draws))
    return [round(ratios[int(0.025 * draws)], 3), round(ratios[int(0.975 * draws) - 1], 3)]


def ab_rows(levels: list[dict]) -> list[dict]:
    """The on/off table per level: one client's tokens/s (p50 over requests of tokens / end-to-end time;
    the arms share batches, so their ratio is speculation's gain at that load, first-token waits included),
    p50 time per output token and its off/on ratio (the decode speed-up alone, which a few first-token
    stalls cannot sway at small request counts), p99 time to first token. ``ratio_ci95``: a bootstrap interval
    for ``ratio`` over the arms' requests (``ratio_interval``), so that a level's verdict says whether its
    requests settle it. ``ratio_mean`` is the same
    ratio over mean rates: when a level queues for admission, the rates split into requests that waited
    and requests that did not, and the p50 can fall on either side in either arm (the H200 at a5ef89b:
    0.485 at concurrency 64 by p50, 0.95 by means, equal TPOT -- load_gpu_a5ef89b.json)."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 2)

    rows = []
    for level in levels:
        on, off = level["arms"]["on"], level["arms"]["off"]
        a, b = on["request_tokens_per_s"]["p50"], off["request_tokens_per_s"]["p50"]
        rows.append({"concurrency": level["concurrency"], "spec_tok_s": a, "nospec_tok_s": b,
                     "ratio": round(a / b, 3) if a and b else None,
                     # None for files written before the requests' rates were kept
                     "ratio_ci95": ratio_interval(on.get("request_rates", []), off.get("request_rates", [])),
                     "ratio_mean": (round(on["request_tokens_per_s"]["mean"] / off["request_tokens_per_s"]["mean"], 3)
                                    if on["request_tokens_per_s"]["mean"] and off["request_tokens_per_s"]["mean"] else None),
                     "p50_tpot_ms_on": ms(on["tpot_s"]["p50"]), "p50_tpot_ms_off": ms(off["tpot_s"]["p50"]),
                     "tpot_ratio_off_over_on": (round(off["tpot_s"]["p50"] / on["tpot_s"]["p50"], 3)
                                                if on["tpot_s"]["p50"] and off["tpot_s"]["p50"] else None),
                     "p99_ttft_ms_on": ms(on["ttft_s"]["p99"]), "p99_ttft_ms_off": ms(off["ttft_s"]["p99"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompts-file", default=str(MT_BENCH), help="MT-bench style JSONL (first turns are used)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--requests", type=int, default=16, help="per concurrency level, split evenly over the arms")
    ap.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrival rate, requests/s")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arm", action="append", help='NAME=JSON speculation field, e.g. on=\'{"max_nodes": 4}\'')
    ap.add_argument("--all-as", default=None, metavar="JSON",
                    help="send every request this speculation field instead of its arm's, keeping the arms' labels, "
                         "prompts and order: a one-mode server's run over exactly a mixed run's requests (the off "
                         "arm's per-token latency is compared request set for request set)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-server-stats", dest="server_stats", action="store_false",
                    help="leave the server's /v1/stats alone (by default they are reset before each level and read "
                         "after it: the budget the server chose at that load)")
    ap.add_argument("--procs", type=int, default=1,
                    help="client processes per level (at most its concurrency): one asyncio client saturates a core "
                         "near 10k streamed tokens/s")
    ap.add_argument("--out", default=str(HERE / "results" / "load"), help="writes OUT.json and OUT.png")
    args = ap.parse_args()
    report = asyncio.run(bench(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    plot(report, out.with_suffix(".png"))


def print_table(report: dict) -> None:
    print(f"{'conc':>4} {'arm':>8} {'req':>4} {'req tok/s':>9} {'acc.len':>7}  "
          + "  ".join(f"{m[:-2] + ' p50/p90/p99':>24}" for m in METRICS))
    for level in report["levels"]:
        for name, s in level["arms"].items():
            cells = ["/".join("-" if s[m][q] is None else f"{s[m][q]:.3f}" for q in ("p50", "p90", "p99"))
                     for m in METRICS]
            acc = "-" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}"
            rate = s["request_tokens_per_s"]["p50"] or 0.0
            print(f"{level['concurrency']:>4} {name:>8} {s['requests']:>4} {rate:>9.2f} {acc:>7}  "
                  + "  ".join(f"{c:>24}" for c in cells))
    for row in report.get("rows", []):
        print(f"{row['concurrency']:>4} on/off p50 ratio {row['ratio']}, 95% interval {row['ratio_ci95']}")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    conc = [lv["concurrency"] for lv in report["levels"]]
    arms = list(report["arms"])
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    titles = {"ttft_s": "TTFT (s)", "itl_s": "inter-token latency per token (s)", "tpot_s": "TPOT (s)",
              "e2e_s": "end-to-end latency (s)"}
    for ax, metric in zip(axes.flat, METRICS):
        for i, arm in enumerate(arms):
            for q, style in (("p50", "-"), ("p90", "--")):  # p99 is in the JSON; at small n it is the max
                ys = [lv["arms"][arm][metric][q] for lv in report["levels"]]
                ax.plot(conc, ys, style, color=f"C{i}", marker="o", label=f"{arm} {q}")
        ax.set_title(titles[metric])
    for i, arm in enumerate(arms):
        rates = [lv["arms"][arm]["request_tokens_per_s"]["p50"] for lv in report["levels"]]
        axes.flat[4].plot(conc, rates, "-", color=f"C{i}", marker="o", label=arm)
        lengths = [lv["arms"][arm]["mean_accepted_length"] for lv in report["levels"]]
        axes.flat[5].plot(conc, lengths, "-", color=f"C{i}", marker="o", label=arm)
    axes.flat[4].plot(conc, [lv["tokens_per_s"] for lv in report["levels"]], "-", color="k", marker="s",
                      label="server total")
    axes.flat[4].set_title("tokens/s: per request p50, and server total")
    axes.flat[5].set_title("mean accepted length (tokens/step)")
    for ax in axes.flat:
        ax.set_xlabel("concurrency")
        ax.set_xticks(conc)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    axes.flat[4].legend(fontsize=8)
    fig.suptitle(f"bench/load.py: {report['model']} on {report['device']}, max_tokens {report['max_tokens']}, "
                 f"rate {report['rate_per_s']}/s, commit {report['commit']} ({report['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
