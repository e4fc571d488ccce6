"""Overlapped n-gram chains (EngineConfig.chain_ahead) against the same chains stepped one by one, and against
overlapped plain decoding, in one run.

    python bench/chain_ahead.py [--batches 1,16] [--depth 4] [--profile] [--out bench/results/chain_ahead.json]

The target is SmolLM2-135M's shape with random weights (INT4 g128, bench/step_profile.py's): a step's cost
does not depend on the weights, but what a lookup finds does, so acceptance here is the random model's, not
the real pair's. The figures to read are each arm's milliseconds per engine step and the chain arms' ratio
at the same tokens per step: the host time an overlapped chain step hides. Every request is greedy with a
fixed chain (``SpeculationParams.tree``), so neither the budget nor the gate changes the shape, and its prompt
repeats a phrase, so lookups find continuations from the first step. Arms alternate within each repetition;
each reports its best repetition.

``--profile`` (CUDA) adds, after every timed row, one run of each arm under torch.profiler: per engine step its
wall, its kernels' device time, how long the device was busy (the union of kernel spans) and idle, and its
launches, with the kernels that moved the stream's end most (``verify_profile.exposed``). A step whose device
busy time is near its wall is device-bound; one with idle time is waiting on the host.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import provenance  # noqa: E402  (bench/, this script's own folder)
from draft.ngram import NgramDrafter  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from gateway.budget import BudgetConfig, SpecGate  # noqa: E402
from gateway.engine import Engine, EngineConfig  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from step_profile import random_model  # noqa: E402
from verify_profile import exposed  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

ARMS = ("plain overlapped", "chain stepped", "chain ahead")
# ``--adaptive``: n-gram chains overlapped at the depths the budget plans (no tree in the request; the measured
# step costs cut them: Scheduler.chain_depths), under a speculation gate of the arm's own
ADAPTIVE = "chain ahead adaptive"
_GATES: dict[str, SpecGate] = {}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_arm(engine: Engine, arm: str, batch: int, depth: int, tokens: int, prompts: list[list[int]]) -> dict:
    """One timed generation of ``batch`` requests under ``arm``; its figures and the tokens it emitted."""
    engine.config = replace(engine.config, overlap=True, chain_ahead=arm in ("chain ahead", ADAPTIVE))
    spec = SpeculationParams(enabled=False) if arm.startswith("plain") else SpeculationParams(
        drafter="ngram", tree=None if arm == ADAPTIVE else (1,) * depth)
    shared = engine.scheduler.gate  # the fixed arms' steps feed one gate; the adaptive arm keeps its own
    if arm == ADAPTIVE and shared is not None:
        engine.scheduler.gate = _GATES.setdefault(arm, SpecGate(shared.block, shared.explore))
    greedy = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    stats = {}
    for i in range(batch):
        engine.add(f"{arm}-{i}", prompts[i], greedy, spec)
        out[f"{arm}-{i}"] = []
    # the prompts' prefill first, untimed: every arm then times decode steps alone
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps0, ahead0, wait0 = engine.num_steps, engine.num_ahead, engine.wait_s
    emitted0 = sum(len(v) for v in out.values())
    t0 = time.perf_counter()
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            stats[o.request_id] = o.stats
    seconds = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    emitted = sum(len(v) for v in out.values()) - emitted0
    verify_steps = sum(s.steps for s in stats.values())
    accepted = sum(s.accepted_tokens for s in stats.values())
    engine.scheduler.gate = shared
    return {"tok_s": emitted / seconds, "ms_per_step": 1e3 * seconds / max(steps, 1),
            "tokens_per_step": emitted / max(steps, 1), "steps_ahead": engine.num_ahead - ahead0, "steps": steps,
            # the host's wait on a step launched ahead: near 0 where the host bounds the step, near the step's
            # device time less the host's where the device does
            "wait_ms_per_step": 1e3 * (engine.wait_s - wait0) / max(steps, 1),
            "mean_accepted_length": (accepted + verify_steps) / max(verify_steps, 1),
            "tokens": [out[f"{arm}-{i}"] for i in range(batch)]}


def profile_arm(engine: Engine, arm: str, batch: int, depth: int, tokens: int, prompts: list[list[int]],
                top: int = 14) -> dict:
    """``run_arm`` under torch.profiler (CUDA activity only): per engine step, device figures as the module's
    docstring lists them. Prefill steps fall inside the session too; they are a few of ``tokens`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = run_arm(engine, arm, batch, depth, tokens, prompts)
        torch.cuda.synchronize()
    spans, per_name = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            name = e.name[:70]
            agg = per_name.setdefault(name, [0.0, 0, 0.0])
            agg[0] += e.device_time_total
            agg[1] += 1
            spans.append((e.time_range.start, e.time_range.end, name))
    busy, end = 0.0, None
    for start, stop, _ in sorted(spans):
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    for name, us in exposed(spans).items():
        per_name[name][2] = us
    steps = max(r["steps"], 1)
    span = (max(s[1] for s in spans) - min(s[0] for s in spans)) if spans else 0.0
    kernels = sorted(per_name.items(), key=lambda kv: -kv[1][2])[:top]
    return {"batch": batch, "arm": arm, "steps": r["steps"], "profiled_ms_per_step": round(r["ms_per_step"], 4),
            "kernel_us_per_step": round(sum(v[0] for v in per_name.values()) / steps, 1),
            "busy_us_per_step": round(busy / steps, 1), "idle_us_per_step": round((span - busy) / steps, 1),
            "launches_per_step": round(sum(v[1] for v in per_name.values()) / steps, 1),
            "kernels": {k: {"us_per_step": round(v[0] / steps, 1), "exposed_us_per_step": round(v[2] / steps, 1),
                            "per_step": round(v[1] / steps, 2)} for k, v in kernels}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--depth", type=int, default=4, help="draft tokens in each chain")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--target-layers", type=int, default=30)
    ap.add_argument("--out", default=str(HERE / "results" / "chain_ahead.json"))
    ap.add_argument("--adaptive", action="store_true", help=f"add the arm {ADAPTIVE!r} (see ADAPTIVE)")
    ap.add_argument("--profile", action="store_true", help="CUDA: a torch.profiler run of each arm (see the docstring)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="activations (default: bfloat16 on CUDA, float32 on the CPU)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if args.device == "cuda" else torch.float32
    target = random_model(args.target_layers, args.device, dtype, 0).quantize(128)
    batches = [int(b) for b in args.batches.split(",")]
    arms = ARMS + ((ADAPTIVE,) if args.adaptive else ())
    ecfg = EngineConfig(num_blocks=4096, page_size=16,
                        scheduler=SchedulerConfig(max_running=max(batches), max_waiting=512, max_model_len=2048,
                                                  budget=BudgetConfig(max_verify_tokens=1024)))
    engine = Engine(target, {"ngram": NgramDrafter()}, ecfg)
    if args.device == "cuda":
        log(f"graphs captured: {engine.capture_graphs()}")
    g = torch.Generator().manual_seed(0)
    phrases = [torch.randint(100, 40000, (5 + i % 7,), generator=g).tolist() for i in range(max(batches))]
    prompts = [p * (60 // len(p)) for p in phrases]
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "date": datetime.date.today().isoformat(), "commit": provenance.commit(), "torch": torch.__version__,
           "depth": args.depth, "tokens": args.tokens, "reps": args.reps, "notes": __doc__.split("\n\n")[2].strip(),
           "rows": []}
    for batch in batches:
        for arm in arms:  # warm-up: kernels built and tuned for every row count the arms use
            run_arm(engine, arm, batch, args.depth, 16, prompts)
        best: dict[str, dict] = {}
        for _ in range(args.reps):
            for arm in arms:
                r = run_arm(engine, arm, batch, args.depth, args.tokens, prompts)
                if arm not in best or r["tok_s"] > best[arm]["tok_s"]:
                    best[arm] = r
        def same(a: str, b: str) -> str:
            return f"{sum(x == y for x, y in zip(best[a]['tokens'], best[b]['tokens']))}/{batch}"

        rows = {}
        for arm in arms:
            row = rows[arm] = {"batch": batch, "arm": arm, **{k: (round(v, 4) if isinstance(v, float) else v)
                                                             for k, v in best[arm].items() if k != "tokens"}}
            row["tok_s_over_plain"] = round(best[arm]["tok_s"] / best["plain overlapped"]["tok_s"], 3)
            row["tok_s_over_chain_stepped"] = round(best[arm]["tok_s"] / best["chain stepped"]["tok_s"], 3)
            res["rows"].append(row)
        # greedy in every arm: a request whose tokens differ met a near-tie that two arms' computations rounded
        # apart (different row counts, or a causal chain segment against a masked tree), or a defect. Both chain
        # arms against plain decoding tell the two apart: numerics flip the stepped chains about as often.
        rows["chain ahead"]["requests_same_tokens_as_stepped"] = same("chain ahead", "chain stepped")
        for arm in arms[1:]:
            rows[arm]["requests_same_tokens_as_plain"] = same(arm, "plain overlapped")
        for row in rows.values():
            log(json.dumps(row))
    # last: after a profiler session every graph launch in the process costs more (verify_profile's note)
    if args.profile and args.device == "cuda":
        res["profile"] = []
        for batch in batches:
            for arm in arms:
                res["profile"].append(profile_arm(engine, arm, batch, args.depth, min(args.tokens, 64), prompts))
                log(json.dumps({k: v for k, v in res["profile"][-1].items() if k != "kernels"}))
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in res["rows"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    arms = list(dict.fromkeys(r["arm"] for r in res["rows"]))
    w = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        rows = {r["batch"]: r for r in res["rows"] if r["arm"] == arm}
        xs = [i + k * w for i in range(len(batches))]
        axes[0].bar(xs, [rows[b]["tok_s"] for b in batches], w, label=arm)
        axes[1].bar(xs, [rows[b]["ms_per_step"] for b in batches], w, label=arm)
    for ax, label in zip(axes, ("generated tokens / s", "ms per engine step")):
        ax.set_xticks([i + w for i in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"n-gram chains of {res['depth']} overlapped vs stepped — {res['device']}, {res['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
