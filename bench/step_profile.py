"""Where one engine step's time goes: plain decoding against speculation, phase by phase.

    python bench/step_profile.py [--real MODEL --draft DIR] [--batches 1,16] [--out bench/results/step_profile.json]

Without ``--real`` the target is SmolLM2-135M's shape with random weights (INT4 g128) and the draft the
shipped draft's shape (3 layers): nothing to load, and the step costs are the real pair's, since they
do not depend on the weights. Trees are fixed per request (``SpeculationParams.tree``), so the adaptive
budget does not cut them even when random weights accept nothing.

Two passes per arm:
1. untimed phases: wall time per step, as the engine runs it (the GPU runs ahead of the host);
2. timed phases: every phase wrapped in ``torch.cuda.synchronize()``, so each figure is host time plus
   the device work it launched. The sum exceeds pass 1 by the overlap the syncs remove.
3. counted phases (``--count-ops``): the torch ops dispatched, Triton kernels launched and CUDA graphs
   replayed per step, by innermost phase. Each costs the host a launch (several microseconds each on a lent
   H100's host), so a step whose host work outlasts its device work is priced by these counts.

``--host-trees`` adds, after each tree arm, the same tree with its nodes copied to the host before the
target's batch is built (``EngineConfig.defer_trees=False``): pass 1's A/B of deferred trees.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import provenance  # noqa: E402  (bench/, this script's own folder)
import draft.model_drafter as model_drafter_mod  # noqa: E402
import draft.tree_loop as tree_loop  # noqa: E402
import gateway.engine as engine_mod  # noqa: E402
from draft.model_drafter import ModelDrafter  # noqa: E402
from draft.ngram import NgramDrafter  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from draft.tree import TokenTree  # noqa: E402
from gateway.budget import BudgetConfig  # noqa: E402
from gateway.engine import Engine, EngineConfig  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from target.config import ModelConfig  # noqa: E402
from target.loader import expected_weights  # noqa: E402
from target.model import Transformer  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

SMOLLM2 = dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, eos_token_ids=(2,))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_model(layers: int, device: str, dtype: torch.dtype, seed: int) -> Transformer:
    cfg = ModelConfig(**(SMOLLM2 | {"num_layers": layers}))
    g = torch.Generator().manual_seed(seed)
    w = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * s[-1] ** -0.5)
         for n, s in expected_weights(cfg).items()}
    return Transformer.from_weights(cfg, w, dtype, device)


class PhaseTimer:
    """Wraps callables so that each call is timed between two device syncs, by phase name; with ``synced``
    False it only keeps the stack of phases entered (``current``), for ``OpCounter``."""

    def __init__(self, synced: bool = True) -> None:
        self.total: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []
        self.synced = synced
        self.stack: list[str] = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "(between phases)"

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            if self.synced:
                sync()
            self.stack.append(name)
            t0 = time.perf_counter()
            try:
                out = fn(*a, **kw)
                if self.synced:
                    sync()
            finally:
                self.stack.pop()
            self.total[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        self._undo.append((owner, attr, owner.__dict__.get(attr) if hasattr(owner, "__dict__") else None))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, old in reversed(self._undo):
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._undo.clear()


class OpCounter(TorchDispatchMode):
    """Counts, by the timer's innermost phase, torch ops dispatched (views included: each is a call into
    torch's dispatcher from Python), Triton kernel launches and CUDA graph replays."""

    def __init__(self, timer: PhaseTimer) -> None:
        super().__init__()
        self.timer = timer
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._undo: list[tuple[object, str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.timer.current]["torch ops"] += 1
        return func(*args, **(kwargs or {}))

    def _patch(self, owner: type, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        def counted(*a, **kw):
            self.counts[self.timer.current][label] += 1
            return fn(*a, **kw)

        self._undo.append((owner, attr, fn))
        setattr(owner, attr, counted)

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._patch(JITFunction, "run", "triton launches")
        self._patch(torch.cuda.CUDAGraph, "replay", "graph replays")
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()
        return super().__exit__(*exc)


def run_steps(engine: Engine, batch: int, spec: SpeculationParams, tokens: int, prompt: list[int],
              temperature: float = 0.0) -> tuple[int, int, float]:
    for i in range(batch):  # seeded when sampled: every pass of an arm draws the same tokens
        sampling = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=i)
        engine.add(f"r{i}", prompt[i:] + prompt[:i], sampling, spec)
    steps = emitted = 0
    sync()
    t0 = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            emitted += len(out.new_token_ids)
            if out.error:
                raise RuntimeError(out.error)
        steps += 1
    sync()
    return steps, emitted, time.perf_counter() - t0


class ChainDrafter:
    """Drafts a chain of token 5 to the request's depth, at no cost: the engine's price of verifying host-built
    one-node-wide trees (what the n-gram drafter's lookups hand it), apart from any drafter's own time."""

    name = "chain"

    def propose(self, reqs: list) -> list[TokenTree]:
        return [TokenTree.from_lists([r.token_ids[-1]] + [5] * len(r.widths), list(range(-1, len(r.widths))))
                for r in reqs]

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        pass

    def flush(self) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass


def profile_arm(engine: Engine, batch: int, spec: SpeculationParams, tokens: int, prompt: list[int],
                defer: bool = True, count_ops: bool = False, overlap: bool = False, temperature: float = 0.0) -> dict:
    """``defer``: greedy trees stay on the device until the acceptance's host copy (EngineConfig.defer_trees).
    ``count_ops``: a third pass counting launches by phase (``OpCounter``). ``overlap``: plain steps launched
    before the last one's tokens are read (EngineConfig.overlap; the synced pass serialises it again)."""
    engine.config = replace(engine.config, defer_trees=defer, overlap=overlap)
    # Two warm-up passes as long as the timed ones. Every pass sends the same prompts, so the first one
    # prefills them whole and every later one finds 12 of their blocks in the prefix cache and prefills the
    # rest: a prefill of another length, which the first timed pass met cold after a single warm-up pass
    # (H100: the first arm, plain greedy decoding, read 2.005 ms a step at 4f4efbb and 1.835 at 19d8eb2,
    # against 1.2 in its synced pass and 1.06 for the plain T=0.7 arm after it; most likely the INT4
    # tuner timing its candidates for that prefill's row bucket inside the timed pass).
    for _ in range(2):
        run_steps(engine, batch, spec, tokens, prompt, temperature)
    ahead, wait = engine.num_ahead, engine.wait_s
    steps, emitted, secs = run_steps(engine, batch, spec, tokens, prompt, temperature)
    row = {"steps": steps, "tokens": emitted, "ms_per_step": round(1e3 * secs / steps, 3),
           "tok_s": round(emitted / secs, 1), "tokens_per_step": round(emitted / steps, 3),
           # overlapped steps, and the host's wait on their picks (near zero: the host bounds the step)
           "steps_ahead": engine.num_ahead - ahead, "wait_ms_per_step": round(1e3 * (engine.wait_s - wait) / steps, 3)}
    timer = wrap_phases(engine, PhaseTimer())
    try:
        steps2, _, secs2 = run_steps(engine, batch, spec, tokens, prompt, temperature)
    finally:
        timer.restore()
    row["synced_ms_per_step"] = round(1e3 * secs2 / steps2, 3)
    row["phases_ms_per_step"] = {k: round(1e3 * v / steps2, 3) for k, v in timer.total.items()}
    row["phase_calls_per_step"] = {k: round(v / steps2, 2) for k, v in timer.calls.items()}
    if count_ops:
        timer = wrap_phases(engine, PhaseTimer(synced=False))
        counter = OpCounter(timer)
        try:
            with counter:
                steps3, _, _ = run_steps(engine, batch, spec, tokens, prompt, temperature)
        finally:
            timer.restore()
        row["launches_per_step"] = {phase: {k: round(v / steps3, 2) for k, v in c.items()}
                                    for phase, c in counter.counts.items()}
        row["launches_per_step_total"] = {k: round(sum(c[k] for c in counter.counts.values()) / steps3, 2)
                                          for k in ("torch ops", "triton launches", "graph replays")}
    return row


def wrap_phases(engine: Engine, timer: PhaseTimer) -> PhaseTimer:
    timer.wrap(engine, "_propose", "propose (all drafting)")
    for name, d in engine.drafters.items():
        inner = getattr(d, "draft", d)
        if isinstance(inner, ModelDrafter) and "draft forward" not in timer.calls:
            timer.wrap(inner, "_forward", "  draft forward")
            timer.wrap(inner, "_catch_up", "  draft catch-up (batch + forward)")
            timer.wrap(inner.loop, "grow", "  draft tree loop (one host copy)")
            timer.wrap(inner.loop, "grow_on_device", "  draft tree loop (no host copy)")
            timer.wrap(inner.loop, "grow_sampled", "  draft sampled tree loop (one host copy)")
            timer.wrap(inner, "flush", "  draft flush (KV compaction)")
    timer.wrap(model_drafter_mod, "expand_all", "  draft top-k + host copy")
    timer.wrap(model_drafter_mod, "build_batch", "  draft build_batch")
    timer.wrap(engine_mod, "build_batch", "target build_batch")
    if engine.graphs is not None:
        timer.wrap(engine.graphs, "forward", "target forward")
    else:
        timer.wrap(engine.target, "forward", "target forward")
    timer.wrap(engine_mod, "accept_batch", "accept (one host copy)")
    timer.wrap(engine, "_commit", "commit (per sequence)")
    timer.wrap(engine.cache, "compact", "KV compaction")
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine, "_emit", "emit")
    return timer


def forward_times(engine: Engine, drafter: ModelDrafter | None) -> dict:
    """Graph-replay time of one forward at (batch 1, N tokens) for the target and the draft."""
    from target.batch import Segment, build_batch

    out = {}
    for label, model, cache, runner in [("target", engine.target, engine.cache, engine.graphs)] + (
            [("draft", drafter.model, drafter.cache, drafter.graphs)] if drafter else []):
        table = cache.new_table()
        try:
            for n in (1, 4, 8, 16, 32):
                seg = Segment(table, 256, list(range(5, 5 + n)), logits="all")
                table.ensure(256)
                batch = build_batch([seg], cache, model.device)
                fwd = runner.forward if runner is not None else model.forward
                for _ in range(3):
                    fwd(batch, cache)
                sync()
                t0 = time.perf_counter()
                for _ in range(50):
                    fwd(batch, cache)
                sync()
                out[f"{label}_n{n}_ms"] = round(1e3 * (time.perf_counter() - t0) / 50, 4)
                table.truncate(256)
        finally:
            table.release()
    return out


def plot(res: dict, path: Path) -> None:
    """One bar per (batch, arm): the synced phases stacked, ms per step; a dot at the unsynced step time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    phases = [p for p in dict.fromkeys(k for r in rows for k in r["phases_ms_per_step"])
              if not p.startswith("  draft") or "catch-up" in p or "tree loop" in p]  # nested phases overlap
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"b{r['batch']} {r['arm']}" for r in rows]
    bottom = [0.0] * len(rows)
    for p in phases:
        if p == "propose (all drafting)":
            continue  # drawn as its parts, catch-up and tree loop
        vals = [r["phases_ms_per_step"].get(p, 0.0) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=p.strip())
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(labels, [r["ms_per_step"] for r in rows], "ko", label="step, unsynced")
    ax.set_ylabel("ms per step")
    ax.set_title(f"Step phases, synced ({res['device']}, {res['commit']})")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", help="only draw this results JSON's PNG beside it")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--trees", default="1/1,1,1,1/2,2,2,1")
    ap.add_argument("--chain-trees", default="",
                    help="depths for ChainDrafter arms, e.g. 1/2: one-node-wide host trees, no drafting cost")
    ap.add_argument("--draft-layers", type=int, default=3)
    ap.add_argument("--target-layers", type=int, default=30)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--host-trees", action="store_true",
                    help="also run every tree with its nodes copied to the host before the target's batch (A/B)")
    ap.add_argument("--overlap", action="store_true",
                    help="also 'off overlap' and 'ngram overlap' arms: plain decoding and adaptive n-gram speculation "
                         "with EngineConfig.overlap")
    ap.add_argument("--sampled", action="store_true",
                    help="each tree also sampled at T=0.7, with an 'off T=0.7' arm: the stochastic path's price")
    ap.add_argument("--count-ops", action="store_true",
                    help="a third pass per arm: torch ops, Triton launches and graph replays per step, by phase")
    ap.add_argument("--out", default=str(HERE / "results" / "step_profile.json"))
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = random_model(args.target_layers, args.device, dtype, 0).quantize(128)
    draft_model = random_model(args.draft_layers, args.device, dtype, 1)
    ecfg = EngineConfig(num_blocks=2048, page_size=16, cuda_graphs=not args.no_graphs,
                        scheduler=SchedulerConfig(max_running=64, max_waiting=512, max_model_len=2048,
                                                  budget=BudgetConfig(max_verify_tokens=1024)))
    drafter = ModelDrafter("draft", draft_model, 2048, 16, graphs=not args.no_graphs, max_model_len=2048)
    engine = Engine(target, {"draft": drafter, "ngram": NgramDrafter(), "chain": ChainDrafter()}, ecfg)
    commit = provenance.commit()
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "commit": commit, "tokens": args.tokens,
           "forward": forward_times(engine, drafter), "rows": []}
    log(json.dumps(res["forward"]))
    prompt = [(i * 7919) % 40000 + 100 for i in range(200)]
    arms = [("off", SpeculationParams(enabled=False), True, 0.0)]
    if args.sampled:
        arms.append(("off T=0.7", SpeculationParams(enabled=False), True, 0.7))
    if args.overlap:
        arms.append(("off overlap", SpeculationParams(enabled=False), "overlap", 0.0))
        # speculation on with the n-gram drafter, as the server's default: what speculating requests cost the
        # overlapped plain steps the budget and the gate leave them
        arms.append(("ngram overlap", SpeculationParams(drafter="ngram"), "overlap", 0.0))
    for t in args.trees.split("/"):
        spec = SpeculationParams(drafter="draft", tree=tuple(int(x) for x in t.split(",")))
        arms.append((f"draft {t}", spec, True, 0.0))
        if args.host_trees:  # the same tree copied to the host before the target's batch is built
            arms.append((f"draft {t} host", spec, False, 0.0))
        if args.sampled:  # the same tree drafted and verified at T=0.7 (seeded requests)
            arms.append((f"draft {t} T=0.7", spec, True, 0.7))
            if args.device == "cuda":  # and with the sampled loop replayed as one graph of its own
                arms.append((f"draft {t} T=0.7 graph", spec, True, 0.7))
    for d in filter(None, args.chain_trees.split("/")):
        arms.append((f"chain {d}", SpeculationParams(drafter="chain", tree=(1,) * int(d)), True, 0.0))
    for b in (int(x) for x in args.batches.split(",")):
        for name, spec, defer, temperature in arms:
            tree_loop.SAMPLED_GRAPHS = name.endswith(" graph")  # the plain T=0.7 arm: the eager loop
            row = {"batch": b, "arm": name} | profile_arm(engine, b, spec, args.tokens, prompt, bool(defer),
                                                          args.count_ops, defer == "overlap", temperature)
            res["rows"].append(row)
            log(json.dumps(row))
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    try:
        plot(res, Path(args.out).with_suffix(".png"))
    except ImportError:
        log("matplotlib is not installed: no plot")
    print(f"{'batch':>5} {'arm':<16} {'ms/step':>8} {'synced':>8}  phases (ms/step, synced)")
    for r in res["rows"]:
        ph = ", ".join(f"{k.strip()} {v}" for k, v in r["phases_ms_per_step"].items())
        print(f"{r['batch']:>5} {r['arm']:<16} {r['ms_per_step']:>8} {r['synced_ms_per_step']:>8}  {ph}")
        if "launches_per_step" in r:
            print("      launches a step:", r["launches_per_step_total"], "by phase:",
                  {k.strip(): dict(v) for k, v in r["launches_per_step"].items()})


if __name__ == "__main__":
    main()
