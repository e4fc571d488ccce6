"""Prompt-lookup (n-gram) drafting, simulated on the target's own greedy text: accepted length per step for
each drafter setting and tree, without the engine.

Greedy speculation emits plain decoding's tokens (float32 on the CPU: tests/, greedy_identity_cpu.json), so a
drafter's accepted length is a function of that text alone: at each step the drafter sees the prompt and the
output so far, proposes its tree, and the step keeps the longest branch prefix that equals the next output
tokens, plus the bonus token. This replays exactly that with ``draft.ngram.NgramDrafter`` itself, so
settings (n-gram sizes, window, trees) compare in seconds once the text is written. The adaptive budget is
left out of the plain rows (every step drafts the whole tree, as bench/drafters.py's fixed-tree rows); the
``_adaptive`` rows apply its acceptance rule to one request alone (``simulate``).

Settings are chosen on prompts the repo ships for distillation (every 50th of draft/data/distill_prompts.txt,
the distillation's held-out set); MT-bench first turns are scored only to report the chosen setting:

    python bench/ngram_sweep.py --out bench/results/ngram_sweep_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft.base import DraftRequest  # noqa: E402
from draft.ngram import NgramDrafter, NgramTable  # noqa: E402
from gateway.budget import AcceptanceEMA, BudgetConfig, adaptive_widths, probe_due  # noqa: E402
from provenance import commit  # noqa: E402

MT_BENCH = ROOT / ".cache" / "mt_bench.jsonl"
DISTILL = ROOT / "draft" / "data" / "distill_prompts.txt"
# (name, max_ngram, min_ngram, window)
SETTINGS = [("n3..1", 3, 1, 4096), ("n4..1", 4, 1, 4096), ("n5..1", 5, 1, 4096), ("n3..2", 3, 2, 4096),
            ("n4..2", 4, 2, 4096), ("n2..1", 2, 1, 4096)]
TREES = [(1, 1, 1, 1), (2, 2, 2, 1), (3, 3, 3, 2, 2, 1), (1, 1, 1, 1, 1, 1, 1, 1), (4, 4, 4, 4, 4, 4, 4, 4)]


def accepted_path(tokens: list[int], parents: list[int], future: list[int]) -> int:
    """Draft tokens kept: the deepest path from the root whose tokens are ``future``'s first ones."""
    children: dict[int, list[int]] = {}
    for node in range(1, len(tokens)):
        children.setdefault(parents[node], []).append(node)
    node, kept = 0, 0
    while kept < len(future):
        nxt = next((c for c in children.get(node, ()) if tokens[c] == future[kept]), None)
        if nxt is None:
            break
        node, kept = nxt, kept + 1
    return kept


def simulate(texts: list[tuple[list[int], int]], max_ngram: int, min_ngram: int, window: int,
             widths: tuple[int, ...], adaptive: bool = False, table: NgramTable | None = None,
             min_gain: float | None = None) -> dict:
    """Steps, emitted tokens and drafted nodes over every text (prompt + greedy output, prompt length).

    ``adaptive``: each step's tree is the template cut by the budget's acceptance rule, as the scheduler cuts a
    request alone (``gateway.budget``: per-request EMA from the fixed prior, depths while alpha ** d >=
    min_gain, a one-level probe every ``probe_every`` steps when none pays); cost-blind, so it shows what the
    acceptance rule keeps, not what a measured step price would add."""
    cfg = BudgetConfig() if min_gain is None else BudgetConfig(min_gain=min_gain)
    drafter = NgramDrafter("sim", max_ngram=max_ngram, min_ngram=min_ngram, window=window, table=table)
    steps = emitted = drafted = 0
    for k, (seq, P) in enumerate(texts):
        t = P  # the root is seq[t - 1]; seq[t:] is the output still to emit
        sid = str(k)
        ema, plain_run, step = AcceptanceEMA(), 0, 1  # the scheduler's count: its first plan was the prefill
        while t < len(seq):
            step += 1
            left = len(seq) - t
            w = widths
            if adaptive:
                w = adaptive_widths(widths, ema.alpha, cfg, probe_due(plain_run, step, cfg.probe_every))
            w = w[: max(0, min(len(w), left - 1))]  # as the scheduler: a step emits depth + 1 at most
            tree = drafter.propose([DraftRequest(sid, seq[:t], w, None, None)])[0] if w else None
            kept = depth = 0
            if tree is not None and tree.num_nodes > 1:
                tokens, parents, depths = tree.host()
                drafted += tree.num_nodes - 1
                kept, depth = accepted_path(tokens, parents, seq[t : t + len(w)]), max(depths)
            ema.update(kept, depth if depth else min(len(w), 1))  # an empty lookup is one failed level (engine)
            plain_run = 0 if depth else plain_run + 1
            steps += 1
            emitted += kept + 1
            t += kept + 1
        drafter.release(sid)
    return {"steps": steps, "tokens": emitted, "drafted": drafted,
            "mean_accepted_length": round(emitted / steps, 4) if steps else None,
            "kept_per_drafted": round((emitted - steps) / drafted, 4) if drafted else None}


def greedy_texts(prompts: list[str], max_tokens: int, batch: int) -> list[tuple[list[int], int]]:
    """The embedded target's greedy output for each prompt (chat template applied), plain decoding."""
    from draft.params import SpeculationParams
    from gateway.llm import LLM, LoadConfig
    from verify.sampling import SamplingParams

    llm = LLM.load(LoadConfig(draft="none"), log=lambda *a: None)
    out = []
    for lo in range(0, len(prompts), batch):
        ids = [llm.encode(p) for p in prompts[lo : lo + batch]]
        gens = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                            SpeculationParams(enabled=False))
        out += [(p + g.token_ids, len(p)) for p, g in zip(ids, gens)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--held-out", type=int, default=64, help="held-out distillation prompts to choose on")
    ap.add_argument("--mt-bench", type=int, default=80, help="MT-bench first turns to report on (0: none)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--texts", default=None, help="a JSON cache of the greedy texts (written if missing)")
    ap.add_argument("--min-gains", default="",
                    help="more adaptive rows for the default sizes (and the table), one per min_gain, e.g. 0.1,0.05")
    ap.add_argument("--table", default=None,
                    help="an ngram_table.json.gz (draft/ngram.py): rows for the default sizes with it too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cache = Path(args.texts) if args.texts else None
    if cache is not None and cache.exists():
        sets = json.loads(cache.read_text())
    else:
        lines = [ln.strip() for ln in DISTILL.read_text().splitlines() if ln.strip()]
        held = [p for i, p in enumerate(lines) if i % 50 == 49][: args.held_out]  # distill.py's --val-every 50
        mt = [json.loads(ln)["turns"][0] for ln in MT_BENCH.read_text().splitlines()][: args.mt_bench]
        t0 = time.perf_counter()
        sets = {"held_out": greedy_texts(held, args.max_tokens, args.batch),
                "mt_bench": greedy_texts(mt, args.max_tokens, args.batch) if mt else []}
        print(f"greedy texts in {time.perf_counter() - t0:.0f} s", flush=True)
        if cache is not None:
            cache.write_text(json.dumps(sets))
    rows = []
    table = NgramTable.load(Path(args.table)) if args.table else None
    settings = [(*s, None) for s in SETTINGS] + ([(SETTINGS[0][0] + "+table", *SETTINGS[0][1:], table)] if table else [])
    for name, hi, lo, window, tab in settings:
        for widths in TREES:
            row = {"setting": name, "max_ngram": hi, "min_ngram": lo, "window": window, "tree": list(widths)}
            for split, texts in sets.items():
                if texts:
                    row[split] = simulate(texts, hi, lo, window, widths, table=tab)
                    row[f"{split}_adaptive"] = simulate(texts, hi, lo, window, widths, adaptive=True, table=tab)
                    if name.startswith(SETTINGS[0][0]):  # the default sizes: the acceptance rule's threshold too
                        for g in filter(None, args.min_gains.split(",")):
                            row[f"{split}_adaptive_min_gain_{g}"] = simulate(texts, hi, lo, window, widths,
                                                                             adaptive=True, table=tab,
                                                                             min_gain=float(g))
            rows.append(row)
            print(name, widths, {s: (row[s]["mean_accepted_length"], row[f"{s}_adaptive"]["mean_accepted_length"])
                                 for s in sets if sets[s]}, flush=True)
    report = {"date": datetime.date.today().isoformat(), "commit": commit(), "device": "cpu (simulation)",
              "target": "smollm2-135m-instruct (embedded, float32 activations), greedy",
              "max_tokens": args.max_tokens, "held_out_prompts": len(sets["held_out"]),
              "mt_bench_prompts": len(sets["mt_bench"]), "command": "python bench/ngram_sweep.py " + " ".join(sys.argv[1:]),
              "table": {"path": args.table, "contexts": len(table.entries), "source": table.source} if table else None,
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        plot(report, Path(args.out).with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = [s for s in ("held_out", "mt_bench") if report[f"{s}_prompts"]]
    fig, axes = plt.subplots(1, len(splits), figsize=(6 * len(splits), 4), sharey=True, squeeze=False)
    trees = [",".join(map(str, t)) for t in TREES]
    for ax, split in zip(axes[0], splits):
        for name in dict.fromkeys(r["setting"] for r in report["rows"]):
            rows = [r for r in report["rows"] if r["setting"] == name]
            ax.plot(trees, [r[split]["mean_accepted_length"] for r in rows], marker="o", label=name)
        for name, color in ((SETTINGS[0][0], "black"), (SETTINGS[0][0] + "+table", "red")):
            rows = [r for r in report["rows"] if r["setting"] == name and f"{split}_adaptive" in r]
            if rows:  # the default sizes under the budget's acceptance rule
                ax.plot(trees, [r[f"{split}_adaptive"]["mean_accepted_length"] for r in rows], marker="s",
                        color=color, linestyle="--", label=f"{name}, adaptive")
        ax.set_title(f"{split} ({report[f'{split}_prompts']} prompts x {report['max_tokens']} tokens)")
        ax.set_xlabel("tree (widths per depth)")
        ax.tick_params(axis="x", rotation=20)
    axes[0][0].set_ylabel("tokens per target step")
    axes[0][0].legend(title="n-gram sizes", fontsize=8, ncol=2, loc="upper left")
    fig.suptitle(f"n-gram drafting on the target's greedy text, simulated ({report['date']}, "
                 f"{report['commit'].split()[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
