"""Is greedy speculative output token-identical to plain decoding on this device, and where it is not, were the
flips near-ties? One run per dtype, through the engine: plain decoding against each drafter with a fixed tree.
By default the target is a random INT4 model of SmolLM2-135M's shape (no download) with the n-gram drafter
and the self-draft; ``--embedded`` takes the embedded SmolLM2 (its own Q4_1 weights) with the n-gram drafter
and the shipped draft, on MT-bench first turns.

    python bench/greedy_identity.py [--device cuda] [--dtypes bfloat16,float32] [--batches 1,8] [--embedded]
                                    [--prompts 16] [--max-tokens 96] [--out bench/results/greedy_identity.json]

Speculation keeps the target's argmax at every position, so in exact arithmetic the outputs are equal. A verify
step scores a tree of M > 1 rows where plain decoding scores one, and the kernels pick other reduction orders for
other M (split-K, tensor cores, tree attention): the logits differ in their last bits. In float32 that moves an
argmax only where two logits tie to ~1e-6; in bfloat16 activations, where they tie to ~1e-2. For each first
divergence the script reports the gap between the two tokens' logits, scored in float32 over the plain arm's
prefix (``target.qtune.sequence_logits``), beside the median gap between the top two logits over all plain
positions: flips at gaps far below that median are rounding, a flip at a wide gap would be a bug.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from draft.model_drafter import ModelDrafter  # noqa: E402
from draft.ngram import NgramDrafter  # noqa: E402
from draft.params import SpeculationParams  # noqa: E402
from gateway.budget import BudgetConfig  # noqa: E402
from gateway.engine import Engine, EngineConfig  # noqa: E402
from gateway.llm import LLM, LoadConfig  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from target.config import ModelConfig  # noqa: E402
from target.loader import expected_weights  # noqa: E402
from target.model import Transformer  # noqa: E402
from target.qtune import sequence_logits  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def random_target(shape: dict, dtype: torch.dtype, device: str, group: int, seed: int = 0) -> Transformer:
    """INT4 (RTN, ``group``) with random weights. Embeddings at 0.5 and projections at 1/sqrt(K) give logits
    with top-two gaps of the order of a trained model's."""
    cfg = ModelConfig(family="llama", rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=2048,
                      eos_token_ids=(), **shape)
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, s in expected_weights(cfg).items():
        if name.endswith("norm.weight"):
            w[name] = 1.0 + 0.1 * torch.randn(s, generator=g)
        else:
            w[name] = torch.randn(s, generator=g) * (0.5 if "embed" in name or "lm_head" in name else s[-1] ** -0.5)
    return Transformer.from_weights(cfg, w, dtype, device).quantize(group)


class Float32Head:
    """An LM head multiplied and returned in float32 (a float32 copy of its weight): logits no longer round
    to the model dtype, so only the hidden states' rounding can flip a near-tie (``--head-fp32``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.w32, self.b32 = weight.float(), None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.w32, self.b32)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def divergences(plain: list[list[int]], other: list[list[int]], logits, name: str) -> list[dict]:
    """Each prompt's first position where ``other``'s output leaves plain decoding's: both tokens (``other``'s
    under ``name``) and the float32 logit gap between them over plain decoding's prefix (``logits(j, plain[j])``)."""
    out = []
    for j, (p, o) in enumerate(zip(plain, other)):
        i = first_divergence(p, o)
        if i is None:
            continue
        a, b = (p[i] if i < len(p) else None), (o[i] if i < len(o) else None)  # one output may end there
        lg = None if a is None or b is None else logits(j, p)[i]
        gap = None if lg is None else round(float(lg[a] - lg[b]), 5)
        out.append({"prompt": j, "position": i, "plain": a, name: b, "gap": gap})
    return out


def run(engine: Engine, prompts: list[list[int]], batch: int, max_tokens: int, spec: SpeculationParams):
    """Greedy outputs of ``prompts`` in batches of ``batch``, engine steps, and output tokens per second."""
    out, steps, t0 = [], 0, time.perf_counter()
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(0, len(prompts), batch):
        ids = [f"r{j}" for j in range(i, min(i + batch, len(prompts)))]
        toks: dict[str, list[int]] = {r: [] for r in ids}
        for r, p in zip(ids, prompts[i : i + batch]):
            engine.add(r, p, sampling, spec)
        while engine.has_work():
            steps += 1
            for o in engine.step():
                assert o.error is None, o.error
                toks[o.request_id] += o.new_token_ids
        out += [toks[r] for r in ids]
    return out, steps, round(sum(map(len, out)) / (time.perf_counter() - t0), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--tree", default="2,2,2,1")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="a 4-layer, 64-wide model (a CPU smoke run)")
    ap.add_argument("--plain-repeats", type=int, default=0,
                    help="run plain decoding this many more times per batch size and record where a repeat's output "
                         "differs from the first run's (a determinism check: a race would show here)")
    ap.add_argument("--modes", default="default",
                    help="kernel modes, each its own rows in this run: default, invariant (EngineConfig.batch_invariant:"
                         " batch-invariant kernels)")
    ap.add_argument("--embedded", action="store_true", help="the embedded SmolLM2 and its shipped draft")
    ap.add_argument("--head-fp32", action="store_true",
                    help="the target's LM head in float32 (Float32Head): what rounding the logits costs")
    ap.add_argument("--prompts-file", default=str(ROOT.parent / "shared" / "data" / "mt_bench_questions.jsonl"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "greedy_identity.json"))
    args = ap.parse_args()
    shape = dict(SMOLLM2)
    if args.small:
        shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    tree = tuple(int(x) for x in args.tree.split(","))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, shape["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (args.prompts,), generator=g)]
    if args.embedded:
        shape = {}
        turns = [json.loads(line)["turns"][0] for line in open(args.prompts_file)][: args.prompts]
    rows: list[dict] = []
    dev = (f"cuda {torch.cuda.get_device_name()}" if args.device == "cuda"
           else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")

    def save() -> None:  # after every row: a run stopped at its time limit keeps what it measured
        res = {"date": datetime.date.today().isoformat(), "device": dev, "commit": provenance.commit(),
               "torch": torch.__version__,
               "model": "embedded SmolLM2-135M-Instruct (its Q4_1 weights), shipped draft, MT-bench first turns"
               if args.embedded else f"random INT4 (RTN g{args.group}) of shape {shape}",
               "max_tokens": args.max_tokens, "head_fp32": args.head_fp32, "rows": rows,
               "note": ("identical: prompts whose greedy output with that drafter equals plain decoding's, token for "
                        "token. flips: each other prompt's first differing position and the float32 logit gap there "
                        "between plain decoding's token and the speculative one (prefix: plain decoding's). "
                        "median_top2_gap: the median top-1 minus top-2 logit over every plain position, for scale. "
                        "mode invariant: EngineConfig.batch_invariant (kernels/invariant.py). tok_s / plain_tok_s: the "
                        "arm's and plain decoding's output tokens per second over the arm's calls (Python, graphs, "
                        "no warm-up beyond one 8-token plain call per batch size).")}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
        plot(res, Path(args.out).with_suffix(".png"))

    for dname, mode in ((d, m) for d in args.dtypes.split(",") for m in args.modes.split(",")):
        if mode not in ("default", "invariant"):
            raise SystemExit(f"--modes: unknown mode {mode!r} (default, invariant)")
        dtype = getattr(torch, dname)
        widest = max(int(b) for b in args.batches.split(","))
        most = widest * (1 + sum(tree))
        ecfg = EngineConfig(num_blocks=2048, page_size=16, scheduler=SchedulerConfig(
            max_running=widest, max_model_len=1024, max_step_tokens=max(1024, most),
            budget=BudgetConfig(min_gain=0.0, max_verify_tokens=max(64, most), cost_aware=False)),
            batch_invariant=mode == "invariant")
        if args.embedded:
            llm = LLM.load(LoadConfig(device=args.device, dtype=dname, draft="auto", draft_vocab=0), ecfg,
                           log=lambda m: None)
            engine, target = llm.engine, llm.engine.target
            drafters = {name: engine.drafters[name] for name in ("ngram", "draft")}
            prompts = [llm.encode(t) for t in turns]
        else:
            target = random_target(shape, dtype, args.device, args.group)
            drafters = {"ngram": NgramDrafter(),
                        "self": ModelDrafter("self", target.truncated(shape["num_layers"] * 4 // 5),
                                             ecfg.num_blocks, ecfg.page_size)}
            engine = Engine(target, drafters, ecfg)
        if args.head_fp32:
            target.lm_head = Float32Head(target.lm_head.weight, target.lm_head.bias)
        engine.capture_graphs()
        # keyed by the plain output too: each batch size decodes its own plain output (near-ties flip between them),
        # and a gap read over another batch size's text is no gap at all (before 2026-12-07 the key was the prompt
        # alone, so every row after the first batch size's held such gaps)
        gap_cache: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

        def logits(j: int, plain: list[int]) -> torch.Tensor:  # float32 logits over prompt j + its plain output
            key = (j, tuple(plain))
            if key not in gap_cache:
                ids = torch.tensor([prompts[j] + plain], device=args.device)
                gap_cache[key] = sequence_logits(target, ids)[0, len(prompts[j]) - 1 :].float().cpu()
            return gap_cache[key]

        for b in (int(x) for x in args.batches.split(",")):
            run(engine, prompts[:b], b, 8, SpeculationParams(enabled=False))  # first-use costs stay out of the rates
            plain, plain_steps, plain_tok_s = run(engine, prompts, b, args.max_tokens, SpeculationParams(enabled=False))
            top2 = [float(v[0] - v[1]) for j in range(len(prompts)) for v in logits(j, plain[j]).topk(2).values]
            for rep in range(args.plain_repeats):
                again, _, again_tok_s = run(engine, prompts, b, args.max_tokens, SpeculationParams(enabled=False))
                diffs = divergences(plain, again, logits, "repeat")
                rows.append({"dtype": dname, "mode": mode, "batch": b, "drafter": None, "plain_repeat": rep + 1,
                             "identical": len(prompts) - len(diffs), "prompts": len(prompts), "tok_s": again_tok_s,
                             "plain_tok_s": plain_tok_s, "median_top2_gap": round(statistics.median(top2), 4),
                             "flips": diffs})
                print({k: v for k, v in rows[-1].items() if k != "flips"}, [(f["position"], f["gap"]) for f in diffs],
                      flush=True)
                save()
            for name in drafters:
                spec, steps, tok_s = run(engine, prompts, b, args.max_tokens,
                                         SpeculationParams(drafter=name, tree=tree))
                flips = divergences(plain, spec, logits, "spec")
                rows.append({"dtype": dname, "mode": mode, "batch": b, "drafter": name, "tree": list(tree),
                             "identical": len(prompts) - len(flips), "prompts": len(prompts),
                             "engine_steps": steps, "plain_engine_steps": plain_steps, "tok_s": tok_s,
                             "plain_tok_s": plain_tok_s,
                             "median_top2_gap": round(statistics.median(top2), 4), "flips": flips})
                print({k: v for k, v in rows[-1].items() if k != "flips"},
                      [(f["position"], f["gap"]) for f in flips], flush=True)
                save()
    save()


def plot(res: dict, path: Path) -> None:
    """Left: prompts identical to plain decoding per (dtype, batch, drafter). Right: each flip's float32 logit
    gap beside the median top-two gap."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    labels = [f"{short.get(r['dtype'], r['dtype'])}{' inv' if r.get('mode') == 'invariant' else ''} b{r['batch']} "
              f"{r['drafter'] or 'plain again'}" for r in rows]
    a.bar(range(len(rows)), [r["identical"] / r["prompts"] for r in rows], color="tab:green")
    a.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    a.set_ylim(0, 1.05)
    a.set_ylabel("prompts identical to plain decoding")
    for i, r in enumerate(rows):
        gaps = [abs(f["gap"]) for f in r["flips"] if f["gap"] is not None]
        b.scatter([i] * len(gaps), gaps, s=12, color="tab:red")
        b.scatter([i], [r["median_top2_gap"]], marker="_", s=300, color="k")
    b.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    b.set_ylabel("|logit gap| at each first flip\n(bar: median top-2 gap)", fontsize=8)
    fig.suptitle(f"Greedy speculative vs plain decoding: {res['model'][:60]}, {res['device']}, {res['date']}, "
                 f"{res['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
