"""Assemble bench/results/load_gpu.json from the parts ``bench/gpu_run.sh load`` writes.

The load stage runs ``bench/load.py`` against one server with the arms 'on' and 'off' mixed (low and high
concurrency, so each part fits the device's time limits), then against the same server with every request
speculating, then against a server with speculation off everywhere, the two one-mode runs over exactly the
mixed run's requests (``load.py --all-as``: its prompts, labels and order, every request sent one way). This joins the mixed server's levels, adds the single-arm runs beside each level, and
writes the issue's table (``rows``) and a plot:

    python bench/load_merge.py --mixed DIR/load_gpu_low.json DIR/load_gpu_high.json \\
        --on-only DIR/load_gpu_on_low.json DIR/load_gpu_on_high.json \\
        --off-only DIR/load_gpu_off_low.json DIR/load_gpu_off_high.json \\
        --stats DIR/load_stats.json --out bench/results/load_gpu

``server_ratio``: the speculating server's output tokens/s with every request speculating over the
speculation-off server's, same requests and concurrency -- the throughput a user gains by turning
speculation on (the issue's ratio). ``ratio`` / ``ratio_mean``: the arms of the mixed run, per request
(``load.ab_rows``).

``drafted_per_step_on`` / ``on_only_drafted_per_step``: draft nodes per request-step of the speculating
requests at that level, from the server's counters (reset before each level): the budget it chose at that load.

``--rounds``: the stage's rounds, each merged as above, as one report with every ratio per round and its
median (``combine_rounds``).

``off_arm_tpot_vs_off_only_server``: the off arm's p50 time per output token in the speculating server over
the same requests' figure in the off-only server -- the per-token penalty a speculation-off request pays for
sharing batches with speculating ones (the load issue allows 5%). Before 2026-12-07 the one-mode runs sent one
arm's requests: per level another slice of the shuffled prompt cycle than the mixed run's (at 1 and 4 streams 48
prompts once each where the mixed run sent 24 twice, the second copy meeting the prefix cache), so this ratio
compared different requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.budget import batch_bucket  # noqa: E402 -- the gate's own buckets (pure Python, no torch)
from load import GATE_KEY, ab_rows, plot  # noqa: E402


def _levels(parts: list[dict] | None) -> dict | None:
    """One server's single-arm runs as {"requests_per_level", "levels"}, its parts' levels in order."""
    if not parts:
        return None
    return {"requests_per_level": {str(lv["concurrency"]): p["requests_per_level"] for p in parts for lv in p["levels"]},
            "levels": [lv for p in parts for lv in p["levels"]]}


def _drafted_per_step(level: dict) -> float | None:
    """Draft nodes per request-step over the server's speculating arms at this level (``load.server_stats``):
    the tree budget the scheduler chose at that load. None for a level without server counters."""
    arms = [a for label, a in (level.get("server") or {}).items() if label.startswith("on/")]
    steps = sum(a["steps"] or 0 for a in arms)
    return round(sum(a["drafted_tokens"] or 0 for a in arms) / steps, 4) if steps else None


def _gate(level: dict) -> dict | None:
    """The speculation gate's state for this level's batch bucket by the level's end (``load.server_stats``):
    whether it let speculation run there and both arms' tokens/s; None without it."""
    gate = (level.get("server") or {}).get(GATE_KEY) or {}
    return gate.get(str(batch_bucket(level["concurrency"])))


def merge(mixed: list[dict], off_only: list[dict] | None, stats: dict | None, notes: list[str],
          on_only: list[dict] | None = None) -> dict:
    first = mixed[0]
    commits = {m["commit"] for m in mixed + (off_only or []) + (on_only or [])}
    if len(commits) > 1:
        raise SystemExit(f"the parts come from different commits: {sorted(commits)}")
    levels = [lv for m in mixed for lv in m["levels"]]
    report = {k: first[k] for k in ("date", "device", "model", "commit", "max_tokens", "temperature", "rate_per_s",
                                    "arms")}
    report["requests_per_level"] = {str(lv["concurrency"]): m["requests_per_level"] for m in mixed
                                    for lv in m["levels"]}
    report["levels"] = levels
    rows = ab_rows(levels)
    for row, level in zip(rows, levels):
        on = level["arms"]["on"]
        row["mean_accepted_length_on"] = on["mean_accepted_length"]
        row["p99_itl_ms_on"] = round(on["itl_s"]["p99"] * 1e3, 2) if on["itl_s"]["p99"] is not None else None
        row["p99_itl_ms_off"] = (round(level["arms"]["off"]["itl_s"]["p99"] * 1e3, 2)
                                 if level["arms"]["off"]["itl_s"]["p99"] is not None else None)
        row["drafted_per_step_on"] = _drafted_per_step(level)
        row["gate_at_level"] = _gate(level)
    off_server, on_server = _levels(off_only), _levels(on_only)
    if off_server is not None:
        report["off_only_server"] = off_server
        ref = {lv["concurrency"]: lv for lv in off_server["levels"]}
        for row in rows:
            lv = ref.get(row["concurrency"])
            if lv is None or not lv["arms"]["off"]["tpot_s"]["p50"]:
                continue
            r = lv["arms"]["off"]
            row["off_only_server_p50_tpot_ms"] = round(r["tpot_s"]["p50"] * 1e3, 2)
            row["off_only_server_tok_s"] = r["request_tokens_per_s"]["p50"]
            row["off_only_server_total_tok_s"] = lv["tokens_per_s"]
            if row["p50_tpot_ms_off"]:
                row["off_arm_tpot_vs_off_only_server"] = round(row["p50_tpot_ms_off"] / row["off_only_server_p50_tpot_ms"], 3)
    if on_server is not None:
        report["on_only_run"] = on_server
        ref = {lv["concurrency"]: lv for lv in on_server["levels"]}
        for row in rows:
            lv = ref.get(row["concurrency"])
            if lv is None:
                continue
            on = lv["arms"]["on"]
            row["on_only_total_tok_s"] = lv["tokens_per_s"]
            row["on_only_p50_tpot_ms"] = round(on["tpot_s"]["p50"] * 1e3, 2) if on["tpot_s"]["p50"] else None
            row["on_only_mean_accepted_length"] = on["mean_accepted_length"]
            row["on_only_drafted_per_step"] = _drafted_per_step(lv)
            off_total = row.get("off_only_server_total_tok_s")
            row["server_ratio"] = round(lv["tokens_per_s"] / off_total, 3) if off_total else None
    if stats is not None:
        report["server_stats"] = {name: {k: arm.get(k) for k in ("steps", "drafted_tokens", "accepted_tokens",
                                                                  "mean_accepted_length", "acceptance_by_depth")}
                                  for name, arm in stats.get("arms", {}).items()}
        # the engine's speculation gate after the mixed runs: per batch bucket, the arm it runs and both arms' tok/s
        report["speculation_gate"] = stats.get("speculation_gate")
    report["rows"] = rows
    report["notes"] = notes
    return report


# the table's ratios, each of which compares runs: taken per round, then their median
ROUND_KEYS = ("ratio", "server_ratio", "off_arm_tpot_vs_off_only_server", "tpot_ratio_off_over_on")


def combine_rounds(reports: list[dict]) -> dict:
    """Several rounds of the load stage (each ``merge``'s report, the servers' runs interleaved level by level
    in every round) as one report: the first round's whole, and in each row every ratio of ``ROUND_KEYS`` per
    round (``KEY_rounds``) and as their median (``KEY_median``). Two servers' runs minutes apart drift: at
    64 streams the on-only over off-only throughput read 1.198 at a95ac76 and 0.759 at c679601 on H100s, with
    the gate holding plain decoding in both, so a single pair of runs cannot carry a verdict."""
    if not reports:
        raise SystemExit("--rounds: no reports")
    commits = {r["commit"] for r in reports}
    if len(commits) > 1:
        raise SystemExit(f"the rounds come from different commits: {sorted(commits)}")
    levels = [[row["concurrency"] for row in r["rows"]] for r in reports]
    if any(lv != levels[0] for lv in levels):
        raise SystemExit(f"the rounds ran different concurrencies: {levels}")
    out = dict(reports[0])
    out["rows"] = [dict(row) for row in reports[0]["rows"]]
    for k, row in enumerate(out["rows"]):
        for key in ROUND_KEYS:
            vals = [r["rows"][k].get(key) for r in reports]
            if all(v is None for v in vals):
                continue
            row[f"{key}_rounds"] = vals
            row[f"{key}_median"] = round(statistics.median(v for v in vals if v is not None), 3)
    out["rounds"] = len(reports)
    out["round_levels"] = [r["levels"] for r in reports[1:]]  # the first round's are ``levels``
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixed", nargs="+", help="load.py reports of the on/off server, in order")
    ap.add_argument("--rounds", nargs="+", default=None,
                    help="instead: reports this command wrote for each round, combined (``combine_rounds``)")
    ap.add_argument("--off-only", nargs="*", default=[], help="load.py reports of the speculation-off server")
    ap.add_argument("--on-only", nargs="*", default=[], help="load.py reports of the speculating server, every request on")
    ap.add_argument("--stats", default=None, help="the mixed server's /v1/stats after the run (load.py resets them "
                                                  "before each level: the last level's counters)")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.png")
    args = ap.parse_args()
    read = lambda p: json.loads(Path(p).read_text()) if p else None  # noqa: E731
    if args.rounds:
        report = combine_rounds([read(p) for p in args.rounds])
        report["notes"] = report.get("notes", []) + args.note
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        plot(report, out.with_suffix(".png"))
        for row in report["rows"]:
            print({k: v for k, v in row.items() if k == "concurrency" or k.endswith("_median")})
        return
    if not args.mixed:
        ap.error("--mixed (or --rounds) is required")
    report = merge([read(p) for p in args.mixed], [read(p) for p in args.off_only], read(args.stats), args.note,
                   on_only=[read(p) for p in args.on_only])
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    for row in report["rows"]:
        print(row)


if __name__ == "__main__":
    main()
