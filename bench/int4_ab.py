"""Two settings of one INT4 launcher flag in one process (kernels/int4_matmul_triton.py), SmolLM2-135M's shape:

* ``--flag ROPE=0,1`` (the default): RoPE and the KV-cache write as their own launch per layer, or in the qkv
  projection's epilogue (``_rope_store``);
* ``--flag TUNE=cold,chain``: the tuner timing each candidate alone after an L2-evicting read, or as a graphed
  forward runs it (``_time_chain``), with its extra unsplit and narrow candidates for short K.

Random INT4 weights (bench/verify_profile.py's model and steps): for each batch B and tree size N a verify step
is captured into a CUDA graph under each arm, its logits compared with the other arm's on the same inputs, and
its synchronised wall time taken; the arms alternate over ``--rounds`` rounds (the first round pays the Triton
builds and the tuner; each arm keeps its own tuned configs), and each figure is the arm's best round. Writes
the JSON as it goes.

    python bench/int4_ab.py --flag TUNE=cold,chain --batches 1,16 --nodes 1,4 --rounds 2 --out $OUT/tune_ab.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import provenance  # noqa: E402  (bench/, this script's own folder)
import verify_profile as vp  # noqa: E402
from kernels import int4_matmul_triton as T  # noqa: E402


def parse_flag(spec: str) -> tuple[str, list]:
    """``NAME=A,B`` -> the module attribute and its two settings; 0 / 1 are booleans for a boolean flag."""
    name, _, values = spec.partition("=")
    arms = values.split(",")
    if not hasattr(T, name) or len(arms) != 2 or len(set(arms)) != 2:
        raise SystemExit(f"--flag wants NAME=A,B with NAME a flag of kernels/int4_matmul_triton.py and two "
                         f"settings, got {spec!r}")
    if isinstance(getattr(T, name), bool):
        if set(arms) != {"0", "1"}:
            raise SystemExit(f"{name} is a boolean flag: its settings are 0 and 1, got {spec!r}")
        return name, [a == "1" for a in arms]
    return name, arms


def plot(res: dict, out: Path) -> None:
    """Each shape's best verify step under both arms, and their ratio (none without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["summary"]
    a, b = res["arms"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.bar([i - 0.2 for i in x], [r["a_us"] for r in rows], 0.4, label=f"{res['flag']}={a}")
    ax.bar([i + 0.2 for i in x], [r["b_us"] for r in rows], 0.4, label=f"{res['flag']}={b}")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['b_over_a']:.3f}x", (i + 0.2, r["b_us"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"B={r['batch']} N={r['nodes']}" for r in rows])
    ax.set_ylabel("us per verify step (best round)")
    ax.set_title(f"SPECGATE_INT4_{res['flag']}, SmolLM2 shape, {res['device']}, {res['commit']}, {res['date']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flag", default="ROPE=0,1", help="NAME=A,B: the flag and its two settings")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--nodes", default="1,4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=vp.SMOLLM2["num_layers"])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    flag, arms = parse_flag(args.flag)
    vp.DEVICE = args.device
    vp.SMOLLM2["num_layers"] = args.layers
    model = vp.smollm2_int4()
    res = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "date": datetime.date.today().isoformat(), "commit": args.commit or provenance.commit(),
           "torch": torch.__version__, "flag": flag, "arms": arms, "context": args.context, "rows": [],
           "check": []}
    shapes = [(int(b), int(n)) for b in args.batches.split(",") for n in args.nodes.split(",")]
    tuned = {arm: {} for arm in arms}  # each arm's own tuned configs, kept across rounds
    for r in range(args.rounds):
        logits = {}
        for arm in arms:
            setattr(T, flag, arm)
            T._CONFIG_CACHE.clear()
            T._CONFIG_CACHE.update(tuned[arm])
            for B, n in shapes:
                run, parts, _ = vp.verify_step(model, B, n, args.context)
                logits[(arm, B, n)] = run().float().clone()
                t = vp.timing(run, parts, args.reps) if args.device == "cuda" else {"wall_us": vp._median_us(run, 3)}
                res["rows"].append({"round": r, "arm": arm, "batch": B, "nodes": n, "wall_us": t["wall_us"]})
                print(f"round {r} {flag}={arm} B={B:3d} N={n:2d} wall {t['wall_us']:8.1f} us", flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
            tuned[arm] = dict(T._CONFIG_CACHE)
        for B, n in shapes:  # the same inputs under both arms: the same logits, to rounding
            a, b = logits[(arms[0], B, n)], logits[(arms[1], B, n)]
            res["check"].append({"round": r, "batch": B, "nodes": n,
                                 "max_rel_diff": round(((a - b).abs().max() / a.abs().max()).item(), 6),
                                 "argmax_agree": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4)})
    best = {}
    for row in res["rows"]:
        key = (row["arm"], row["batch"], row["nodes"])
        best[key] = min(best.get(key, float("inf")), row["wall_us"])
    a, b = arms
    res["summary"] = [{"batch": B, "nodes": n, "a_us": best[(a, B, n)], "b_us": best[(b, B, n)],
                       "b_over_a": round(best[(b, B, n)] / best[(a, B, n)], 4)} for B, n in shapes]
    res["int4_configs"] = {str(arm): {str(k[:3] + k[7:9]): str(v) for k, v in tuned[arm].items()} for arm in arms}
    Path(args.out).write_text(json.dumps(res, indent=1))
    plot(res, Path(args.out).with_suffix(".png"))
    print(f"\n{flag}: best round per arm (us per verify step)   check: max relative logit difference, argmax "
          "agreement")
    for s, c in zip(res["summary"], res["check"][-len(shapes):]):
        print(f"B={s['batch']:3d} N={s['nodes']:2d}  {a} {s['a_us']:8.1f}  {b} {s['b_us']:8.1f}  {b}/{a} "
              f"{s['b_over_a']:.4f}   {c['max_rel_diff']:.2e} {c['argmax_agree']:.3f}")


if __name__ == "__main__":
    main()
