"""Host time of one engine step, with the target's and the draft's forwards stubbed out.

At high concurrency a step on the GPU waits on the host, not the GPU (bench/results/load_gpu.json). This
bench times the engine's Python alone: tiny random models whose forwards return logits from a fixed rule
(next token = 7 t + 1 mod V), so the draft always agrees with the target and every tree is accepted whole.
It compares commits in one run:

    python bench/host_step.py --refs 1a0cfb2,HEAD --out bench/results/host_step_cpu.json

Each ref is checked out into a temporary git worktree and measured in its own process; the refs alternate
within every repetition and each figure is the minimum over repetitions. On the CPU the greedy tree loop
runs its tensor ops eagerly, so speculative rows include work that a CUDA graph replay does on the GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# "adaptive": requests with no tree of their own, under the server's default verify cap of 64 tokens, so the
# scheduler trims 48 trees a step to fit 16 draft nodes (cost-blind here: step times do not steer it).
# "+penalties": repetition, frequency and presence penalties on every request, over SmolLM2's vocabulary size
# (their per-step work scales with it).
# "idle ngram": every request speculates with the n-gram drafter, whose lookups the target never confirms (its
# next token depends on the position too), so the budget soon leaves them plain but for probes: what speculating
# requests cost the host in a batch where speculation does not pay.
# "overlapped": plain steps launched ahead of the last one's resolution (EngineConfig.overlap, the default on a
# CUDA target): the host work a GPU step hides while the host keeps up, and bounds where it does not.
# "plain overlapped 2k": the same with 2,000-token prompts: every step packs each sequence's block-table row
# (126 blocks of 16), which the short prompts above hide.
# "gated ngram overlapped": n-gram requests in a batch where the speculation gate (gateway/budget.py SpecGate)
# holds its plain arm -- the server's state whenever speculation does not pay (every batch size of the
# H100's real pair, bench/results/engine_real_h100_d32cf22.json) -- against "plain overlapped".
# "cost-cut ngram overlapped": n-gram requests whose lookups the target confirms, so their acceptance keeps
# trees, in a batch whose measured step costs (set ruinous for every draft depth) cut them all: the plan runs
# plain, and the overlapped step's test (Scheduler.plans_plain) decides whether the next step goes ahead. 32
# streams: at 64 the roots alone fill the default verify cap, and every step is plain whatever the test.
# "chain": n-gram requests with a fixed four-token chain whose lookups the target confirms (its next token
# depends on the last alone, so a sequence soon repeats itself), stepped one by one; "chain ahead": the same
# with EngineConfig.chain_ahead (gateway/chain_ahead.py), the device lookup being its torch reference here;
# "idle ngram chain ahead": the same chains where the target confirms no lookup (as "idle ngram"), the H100's
# 64 MT-bench streams, where every chain-ahead step ran plain (engine_real_h100_a95ac76.json).
CONFIGS = [("plain", 16), ("plain", 64), ("tree 2,2,2,1", 16), ("adaptive", 48), ("plain+penalties", 64),
           ("tree 2,2,2,1+penalties", 16), ("idle ngram", 64), ("plain overlapped", 64), ("plain overlapped 2k", 64),
           ("gated ngram overlapped", 64), ("cost-cut ngram overlapped", 32), ("chain", 1), ("chain ahead", 1),
           ("chain", 16), ("chain ahead", 16), ("chain ahead", 64), ("idle ngram chain ahead", 64)]
VOCAB = 512
PENALTY_VOCAB = 49152


def measure(steps: int, only: set[str] | None = None) -> dict[str, float]:
    """Seconds per step for every config, in this process (the ref's code is first on sys.path)."""
    from dataclasses import replace

    import torch

    from draft.params import SpeculationParams
    from gateway.budget import BudgetConfig, SpecGate
    from engine_util import tiny_engine
    from gateway.engine import Engine
    from verify.sampling import SamplingParams

    torch.set_num_threads(1)

    result = {}
    for config, streams in CONFIGS:
        if only is not None and config not in only:
            continue
        arm, _, penalties = config.partition("+")
        V = PENALTY_VOCAB if penalties else VOCAB

        def rule(batch, cache, V=V, shift=3 if "ngram" in arm and not arm.startswith("cost-cut") else 0):
            rows = batch.logits_indices.shape[0]
            out = torch.zeros(rows, V)
            at = batch.logits_indices
            out[torch.arange(rows), (batch.tokens[at] * 7 + batch.positions[at] * shift + 1) % V] = 5.0
            return out

        long = arm.endswith(" 2k")
        ahead = arm in ("chain ahead", "idle ngram chain ahead")
        roomy = long or arm.startswith("chain") or ahead  # 2,000-token prompts; chains that emit up to 5 tokens a step
        arm = arm.removesuffix(" 2k")
        engine = tiny_engine(num_blocks=16384 if long else 8192, page_size=16, max_running=64, vocab=V,
                             tree=(2, 2, 2, 1), max_position_embeddings=4096 if roomy else 512)
        if roomy:  # tiny_engine's scheduler holds 512 tokens
            engine = Engine(engine.target, engine.drafters,
                            replace(engine.config, scheduler=replace(engine.config.scheduler, max_model_len=4096,
                                                                     max_step_tokens=4096),
                                    chain_ahead=ahead))
        if arm.endswith(" overlapped"):
            engine.config = replace(engine.config, overlap=True)
        gated = arm.startswith("gated")
        if gated:  # a gate (it needs the cost-aware budget), held on its plain arm for this config
            engine.scheduler.config = replace(engine.scheduler.config, budget=BudgetConfig(cost_aware=True))
            engine.scheduler.gate = SpecGate()
            allows, SpecGate.allows = SpecGate.allows, lambda self, batch: False
        cost_cut = arm.startswith("cost-cut")
        if cost_cut:  # the cost-aware budget without a gate: the costs alone cut the trees
            engine.scheduler.config = replace(engine.scheduler.config, budget=BudgetConfig(cost_aware=True, gate=False))
            engine.scheduler.gate = None
        engine.target.forward = rule
        engine.drafters["draft"].model.forward = rule
        named = {"plain": SpeculationParams(enabled=False), "plain overlapped": SpeculationParams(enabled=False),
                 "adaptive": SpeculationParams(),
                 "idle ngram": SpeculationParams(drafter="ngram"),
                 "gated ngram overlapped": SpeculationParams(drafter="ngram"),
                 "cost-cut ngram overlapped": SpeculationParams(drafter="ngram"),
                 "chain": SpeculationParams(drafter="ngram", tree=(1, 1, 1, 1)),
                 "chain ahead": SpeculationParams(drafter="ngram", tree=(1, 1, 1, 1)),
                 "idle ngram chain ahead": SpeculationParams(drafter="ngram", tree=(1, 1, 1, 1))}
        spec = named.get(arm, SpeculationParams(drafter="draft", tree=(2, 2, 2, 1)))
        if arm == "adaptive":
            sched = engine.scheduler
            sched.config = replace(sched.config, budget=BudgetConfig(max_verify_tokens=64, cost_aware=False))
        sampling = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
        if penalties:
            sampling = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True, repetition_penalty=1.1,
                                      frequency_penalty=0.2, presence_penalty=0.1)
        for i in range(streams):
            engine.add(str(i), [(13 * i + j) % V for j in range(2000 if long else 40)], sampling, spec)
        # prefill and first drafts (idle: until the budget gives up; long: 128,000 prompt tokens, 4,096 a step)
        for _ in range(40 if long else 30 if "ngram" in arm else 5):
            engine.step()
        if cost_cut:  # every draft depth measured ruinous, fresh for the timed steps (StepCosts.reprobe)
            for depth in range(1, 5):
                for _ in range(2):
                    engine.scheduler.costs.observe(streams, depth, 1.0, ("ngram",))
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        result[f"{config}, {streams} streams"] = (time.perf_counter() - t0) / steps
        if gated:
            SpecGate.allows = allows
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refs", default="HEAD", help="commits to compare, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=None, help="only these configs, comma-separated (default: all)")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process, one ref
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.steps, None if args.configs is None else set(args.configs.split(",")))))
        return
    from worktrees import short, worktrees  # bench/, this script's own directory

    refs = args.refs.split(",")
    best: dict[str, dict[str, float]] = {ref: {} for ref in refs}
    with worktrees(refs) as trees:
        for _ in range(args.reps):
            for ref in refs:
                env_path = f"{trees[ref]}:{trees[ref] / 'tests'}"
                only = [] if args.configs is None else ["--configs", args.configs]
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", "--steps",
                                      str(args.steps), *only], check=True, capture_output=True, text=True,
                                     cwd=trees[ref], env={**os.environ, "PYTHONPATH": env_path})
                for name, sec in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    best[ref][name] = min(best[ref].get(name, sec), sec)
    rows = [{"config": name, **{f"ms_{ref}": round(best[ref][name] * 1e3, 3) for ref in refs}} for name in best[refs[0]]]
    if len(refs) == 2:
        for row in rows:
            row["ratio_first_over_last"] = round(row[f"ms_{refs[0]}"] / row[f"ms_{refs[1]}"], 2)
    for row in rows:
        print(row)
    if args.out:
        head = short("HEAD")
        resolved = {ref: short(ref) for ref in refs}
        Path(args.out).write_text(json.dumps({
            "device": f"cpu ({platform.machine()}, 1 thread per process)", "date": datetime.date.today().isoformat(),
            "commit": head, "refs": resolved, "reps": args.reps, "steps": args.steps,
            "command": "python bench/host_step.py " + " ".join(sys.argv[1:]),
            "notes": __doc__.split("\n\n", 1)[1].strip(), "rows": rows}, indent=2) + "\n")
        plot(rows, refs, resolved, Path(args.out).with_suffix(".png"))


def plot(rows: list[dict], refs: list[str], resolved: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(refs)
    for k, ref in enumerate(refs):
        ax.bar([i + k * w for i in range(len(rows))], [r[f"ms_{ref}"] for r in rows], w, label=resolved[ref])
    ax.set_xticks([i + w * (len(refs) - 1) / 2 for i in range(len(rows))], [r["config"] for r in rows])
    ax.set_ylabel("host ms per engine step (forwards stubbed)")
    ax.set_title("bench/host_step.py: the engine's Python per step, CPU, min over repetitions")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
