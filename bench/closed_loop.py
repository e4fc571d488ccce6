"""Closed-loop load on one in-process engine, without HTTP: a server's step rate at one concurrency, by phase.

    python bench/closed_loop.py --device cuda --dtype bfloat16 --capture-graphs --num-blocks 4096 \
        --max-running 64 --concurrency 64 --requests 256 --phases off,on,mixed,off --profile --out OUT.json

bench/load.py measures a server through HTTP and SSE; this drives ``Engine.step`` directly, keeping
``--concurrency`` requests in flight (a finished one is replaced at once by the next prompt of the cycle), so
a difference between phases is the engine's own. Phases run one after another on one engine, as a server
meets them: ``off`` (every request speculation-off), ``on`` (every request the default adaptive
speculation), ``mixed`` (the two alternating, as bench/load.py's A/B arms). Each phase reports its tokens per
second, steps, how many steps ran overlapped (launched before the last one's tokens reached the host), the
speculation gate's state, and each arm's median time per output token (a request's span from its first token
to its last over its tokens after the first, as bench/load.py's TPOT). With ``--profile`` each phase runs once
more under cProfile, which names the functions with the most time of their own: where the host's time per
step goes in that phase.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "bench"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from load import MT_BENCH, load_prompts, percentiles  # noqa: E402  (bench/)
from draft.params import SpeculationParams  # noqa: E402
from gateway import cli  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

PHASES = ("off", "on", "mixed")


def run_phase(llm, prompts: list[list[int]], phase: str, concurrency: int, requests: int, max_tokens: int,
              profile: bool, top: int) -> dict:
    """``requests`` requests through the engine, ``concurrency`` at a time; the phase's figures."""
    eng = llm.engine
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    on, off = SpeculationParams(), SpeculationParams(enabled=False)
    steps0, ahead0, pre0 = eng.num_steps, eng.num_ahead, eng.num_prefill_chunks
    sent = tokens = 0
    live: set[str] = set()
    arm_of: dict[str, str] = {}
    first: dict[str, float] = {}  # a request's first token's time
    count: dict[str, int] = {}
    tpot: dict[str, list[float]] = {"on": [], "off": []}  # per request: (last - first token time) / (tokens - 1)

    def submit() -> None:
        nonlocal sent
        arm = "off" if phase == "off" else "on" if phase == "on" else ("on" if sent % 2 == 0 else "off")
        rid = f"{phase}-{sent}"
        eng.add(rid, prompts[sent % len(prompts)], sampling, on if arm == "on" else off)
        live.add(rid)
        arm_of[rid] = arm
        sent += 1

    prof = cProfile.Profile() if profile else None
    calls = 0
    wait0 = eng.wait_s
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    while sent < min(concurrency, requests):
        submit()
    while live:
        calls += 1
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            rid, n = out.request_id, len(out.new_token_ids)
            tokens += n
            if n:
                first.setdefault(rid, now)
                count[rid] = count.get(rid, 0) + n
            if out.finished:
                if count.get(rid, 0) > 1:
                    tpot[arm_of[rid]].append((now - first[rid]) / (count[rid] - 1))
                live.discard(out.request_id)
                if out.error is not None:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                if sent < requests:
                    submit()
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    # Where a step call's wall time went, to tell a drift apart: the engine thread's CPU time (its Python and
    # launches, and a CUDA wait where the driver spins) and the engine's measured waits on the device
    # (Engine.wait_s); what neither covers is time the thread was not running.
    cpu, wait = time.thread_time() - cpu0, eng.wait_s - wait0
    row = {"phase": phase, "requests": requests, "tokens": tokens, "seconds": round(wall, 3),
           "tok_s": round(tokens / wall, 1), "step_calls": calls, "ms_per_step_call": round(1e3 * wall / calls, 3),
           "thread_cpu_ms_per_step_call": round(1e3 * cpu / calls, 3), "wait_ms_per_step_call": round(1e3 * wait / calls, 3),
           "steps_run": eng.num_steps - steps0, "steps_overlapped": eng.num_ahead - ahead0,
           "prefill_chunks": eng.num_prefill_chunks - pre0}
    for arm, xs in tpot.items():
        if xs:  # bench/load.py's percentiles (nearest rank)
            pct = percentiles(xs)
            row[f"p50_tpot_ms_{arm}"] = round(1e3 * pct["p50"], 3)
            row[f"p90_tpot_ms_{arm}"] = round(1e3 * pct["p90"], 3)
    gate = eng.scheduler.gate
    if gate is not None:
        row["gate"] = {str(b): v for b, v in gate.summary().items()}
    if prof is not None:
        st = pstats.Stats(prof, stream=io.StringIO())
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append((tt, ct, nc, f"{Path(file).name}:{line}({fn})"))
        rows.sort(reverse=True)
        row["top_tottime_us_per_call"] = [
            {"fn": name, "tottime_us_per_step_call": round(1e6 * tt / calls, 1),
             "cumtime_us_per_step_call": round(1e6 * ct / calls, 1), "calls_per_step_call": round(nc / calls, 2)}
            for tt, ct, nc, name in rows[:top]]
    return row


def against_off(rows: list[dict]) -> list[dict]:
    """Each unprofiled ``on`` or ``mixed`` phase against the ``off`` phases beside it (the nearest before and
    after, averaged: phases drift): the on phase's throughput over theirs, and the mixed phase's off arm's p50
    time per token over theirs -- the load issue's per-token penalty (at most 5%), inside one engine."""
    timed = [r for r in rows if not r["profiled"]]
    out = []
    for k, row in enumerate(timed):
        if row["phase"] == "off":
            continue
        before = next((r for r in reversed(timed[:k]) if r["phase"] == "off"), None)
        after = next((r for r in timed[k + 1:] if r["phase"] == "off"), None)
        ref = [r for r in (before, after) if r is not None]
        if not ref:
            continue
        item = {"phase": row["phase"], "index": k,
                "tok_s_over_off": round(row["tok_s"] / (sum(r["tok_s"] for r in ref) / len(ref)), 3)}
        if "p50_tpot_ms_off" in row:
            item["off_arm_tpot_over_off"] = round(
                row["p50_tpot_ms_off"] / (sum(r["p50_tpot_ms_off"] for r in ref) / len(ref)), 3)
        out.append(item)
    return out


def random_smollm2(args: argparse.Namespace):
    """SmolLM2-135M's shape with random weights, INT4 g128 (bench/step_profile.py's model), the server's engine
    configuration (the model flags) and the n-gram drafter as the default: no checkpoint to carry to the device.
    Prompts are encoded as bytes (a random model has no tokenizer worth the name)."""
    import torch

    from draft.ngram import NgramDrafter
    from gateway.engine import Engine
    from step_profile import random_model  # noqa: E402  (bench/)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target = random_model(30, device, dtype, 0).quantize(128)
    ecfg = replace(cli.engine_config(args), default_drafter="ngram")
    engine = Engine(target, {"ngram": NgramDrafter()}, ecfg)
    return SimpleNamespace(engine=engine, encode=lambda text: list(text.encode("utf-8"))[:1024] or [1])


def stub_forwards(eng) -> None:
    """The target's and the draft models' forwards replaced by a rule (bench/host_step.py's): logits that pick
    ``(7 t + 3 p + 1) mod V`` after token t at position p, so the step costs the host's work alone and n-gram
    lookups, which follow the text, are seldom confirmed (speculation does not pay, as on the GPU)."""
    import torch

    def rule_of(V: int):  # V: the model's logits width (a draft's head may be cut to its frequent tokens)
        def rule(batch, cache, *rest, **kw):
            rows = batch.logits_indices.shape[0]
            out = torch.zeros(rows, V)
            at = batch.logits_indices
            out[torch.arange(rows), (batch.tokens[at] * 7 + batch.positions[at] * 3 + 1) % V] = 5.0
            return out
        return rule

    eng.target.forward = rule_of(eng.target.config.vocab_size)
    eng.graphs = None
    for d in eng.drafters.values():
        model = getattr(d, "model", None)
        if model is not None:
            model.forward = rule_of(getattr(model, "logits_width", model.config.vocab_size))


def plot(report: dict, path: Path) -> None:
    """Each timed phase's tokens per second and its arms' p50 time per token, in run order."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if not r["profiled"]]
    labels = [f"{k}: {r['phase']}" for k, r in enumerate(rows)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.bar(range(len(rows)), [r["tok_s"] for r in rows], color="tab:blue")
    a.set_ylabel("output tokens / s")
    for arm, dx, color in (("off", -0.2, "tab:gray"), ("on", 0.2, "tab:orange")):
        ks = [k for k, r in enumerate(rows) if f"p50_tpot_ms_{arm}" in r]
        b.bar([k + dx for k in ks], [rows[k][f"p50_tpot_ms_{arm}"] for k in ks], width=0.4, color=color,
              label=f"{arm} arm")
    b.set_ylabel("p50 ms per output token")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.set_xticks(range(len(rows)), labels, fontsize=8, rotation=30, ha="right")
    fig.suptitle(f"bench/closed_loop.py: {report['device']}, {report['commit']}, {report['concurrency']} streams, "
                 f"{report['requests']} requests a phase", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/closed_loop.py", description=__doc__.split("\n\n")[0])
    cli.add_model_args(ap)
    ap.add_argument("--prompts-file", default=None, help="JSONL of MT-bench questions (bench/load.py's format)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256, help="requests per phase")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--phases", default="off,on,mixed,off", help=f"comma-separated, each one of {PHASES}")
    ap.add_argument("--warmup", type=int, default=64, help="requests of the mixed phase, untimed, first")
    ap.add_argument("--profile", action="store_true", help="then each phase again under cProfile: where its host time goes")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--random-smollm2", action="store_true",
                    help="SmolLM2-135M's shape with random INT4 weights and the n-gram drafter instead of --model")
    ap.add_argument("--stub-forward", action="store_true",
                    help="forwards replaced by a fixed rule: the engine's host work alone (CPU; see stub_forwards)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    phases = args.phases.split(",")
    for p in phases:
        if p not in PHASES:
            raise SystemExit(f"--phases: {p!r} is none of {PHASES}")
    llm = random_smollm2(args) if args.random_smollm2 else cli.load(args)
    if args.stub_forward:
        stub_forwards(llm.engine)
    texts = load_prompts(args.prompts_file or str(MT_BENCH), max(args.requests, 64), 0)
    prompts = [llm.encode(t) for t in texts]
    if args.warmup:
        run_phase(llm, prompts, "mixed", args.concurrency, args.warmup, args.max_tokens, False, args.top)
    rows = []
    # the rates come from unprofiled passes; with --profile each distinct phase then runs once more under cProfile
    passes = [(p, False) for p in phases] + ([(p, True) for p in dict.fromkeys(phases)] if args.profile else [])
    for p, prof in passes:
        row = run_phase(llm, prompts, p, args.concurrency, args.requests, args.max_tokens, prof, args.top)
        row["profiled"] = prof
        rows.append(row)
        tp = "  ".join(f"p50 TPOT {a} {row[f'p50_tpot_ms_{a}']:.3f} ms" for a in ("on", "off") if f"p50_tpot_ms_{a}" in row)
        print(f"{p:6s}{' (profiled)' if prof else ''} {row['tok_s']:9.1f} tok/s  {tp}  {row['ms_per_step_call']:.3f} ms/step call "
              f"(thread CPU {row['thread_cpu_ms_per_step_call']:.3f}, waits {row['wait_ms_per_step_call']:.3f})  "
              f"steps {row['steps_run']} overlapped {row['steps_overlapped']} prefill chunks {row['prefill_chunks']}",
              flush=True)
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    report = {"date": datetime.date.today().isoformat(), "device": device, "commit": args.commit,
              "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
              "draft": "ngram (random SmolLM2 shape)" if args.random_smollm2 else args.draft, "argv": sys.argv[1:], "rows": rows,
              "against_off": against_off(rows)}
    for item in report["against_off"]:
        print(f"{item['phase']:6s} (phase {item['index']}) over the off phases beside it: tokens/s "
              f"{item['tok_s_over_off']}" + (f", off arm's p50 TPOT {item['off_arm_tpot_over_off']}"
                                              if "off_arm_tpot_over_off" in item else ""))
    if args.profile:
        for row in (r for r in rows if r["profiled"]):
            print(f"--- {row['phase']}: top functions by own time, us per step call")
            for r in row["top_tottime_us_per_call"][:15]:
                print(f"  {r['tottime_us_per_step_call']:8.1f} {r['cumtime_us_per_step_call']:9.1f} "
                      f"{r['calls_per_step_call']:7.2f}  {r['fn']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        plot(report, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
