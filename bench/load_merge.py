"""Assemble bench/results/load_gpu.json from the parts ``bench/gpu_run.sh load`` writes.

The load stage runs ``bench/load.py`` twice against one server with the arms 'on' and 'off' mixed (low and
high concurrency, so each part fits the device's time limits), then once against a server with speculation
off everywhere. This joins the mixed server's levels, adds the off-only server's figures beside each level,
and writes the issue's table (``rows``) and a plot:

    python bench/load_merge.py --mixed DIR/load_gpu_low.json DIR/load_gpu_high.json \\
        --off-only DIR/load_gpu_off_only.json --stats DIR/load_stats.json --out bench/results/load_gpu

``off_arm_tpot_vs_off_only_server``: the off arm's p50 time per output token in the speculating server over
the same figure in the off-only server -- the per-token penalty a speculation-off request pays for sharing
batches with speculating ones (the load issue allows 5%).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from load import ab_rows, plot


def merge(mixed: list[dict], off_only: dict | None, stats: dict | None, notes: list[str]) -> dict:
    first = mixed[0]
    commits = {m["commit"] for m in mixed} | ({off_only["commit"]} if off_only else set())
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
    if off_only is not None:
        report["off_only_server"] = {"requests_per_level": off_only["requests_per_level"], "levels": off_only["levels"]}
        ref = {lv["concurrency"]: lv["arms"]["off"] for lv in off_only["levels"]}
        for row in rows:
            r = ref.get(row["concurrency"])
            if r is None or not r["tpot_s"]["p50"]:
                continue
            row["off_only_server_p50_tpot_ms"] = round(r["tpot_s"]["p50"] * 1e3, 2)
            row["off_only_server_tok_s"] = r["request_tokens_per_s"]["p50"]
            if row["p50_tpot_ms_off"]:
                row["off_arm_tpot_vs_off_only_server"] = round(row["p50_tpot_ms_off"] / row["off_only_server_p50_tpot_ms"], 3)
    if stats is not None:
        report["server_stats"] = {name: {k: arm.get(k) for k in ("steps", "drafted_tokens", "accepted_tokens",
                                                                  "mean_accepted_length", "acceptance_by_depth")}
                                  for name, arm in stats.get("arms", {}).items()}
    report["rows"] = rows
    report["notes"] = notes
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixed", nargs="+", required=True, help="load.py reports of the on/off server, in order")
    ap.add_argument("--off-only", default=None, help="load.py report of the speculation-off server")
    ap.add_argument("--stats", default=None, help="the mixed server's /v1/stats after the run")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.png")
    args = ap.parse_args()
    read = lambda p: json.loads(Path(p).read_text()) if p else None  # noqa: E731
    report = merge([read(p) for p in args.mixed], read(args.off_only), read(args.stats), args.note)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    for row in report["rows"]:
        print(row)


if __name__ == "__main__":
    main()
