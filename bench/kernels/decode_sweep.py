"""Decode attention's launch configs against SDPA at the issue's cases, in one run.

For each (B, ctx): every split count and tile config below, timed after a write and a read flush of L2
(``bench_attention.FLUSH``), beside SDPA on the same KV made contiguous. Answers whether the default pick
(``pick_num_splits`` with 64-token tiles, 3 stages, 4 warps) leaves speed on the table, above all at
B=16 / 4k, where the issue asks for 0.95x SDPA. Split count 1 means no merge launch at all.

    python bench/kernels/decode_sweep.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench.kernels.bench_attention as BA  # noqa: E402
from bench.kernels.attn_layout import caches  # noqa: E402
from kernels.paged_decode import DECODE_PROGRAMS_PER_SM, paged_decode_attention, pick_num_splits  # noqa: E402

TILES = [(64, 3, 4), (64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 2, 8), (128, 3, 8)]  # (block_n, stages, warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gen = torch.Generator(device=BA.DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "copy_tbps": BA.copy_tbps(), "rows": []}
    D, H = BA.D, BA.H
    for B, ctx in [(16, 4096), (64, 2048), (1, 32768)]:
        layouts, bt, k, v = caches(B, ctx, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(B, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
        ref = BA.sdpa(q[:, :, None], k, v)[:, :, 0]
        default = pick_num_splits(B * BA.HKV, bt.shape[1] * 16, BA.DEV, DECODE_PROGRAMS_PER_SM, 16)
        splits = sorted({1, 2, 4, 8, default} if B > 1 else {default // 2, default, 2 * default})
        kv_bytes = 2 * B * ctx * BA.HKV * D * 2
        for mode in ("read", "write"):
            BA.FLUSH = mode
            sdpa_us = BA.time_us(lambda: BA.sdpa(q[:, :, None], k, v))
            times = {}
            for s in splits:
                for bn, st, nw in TILES:
                    fn = lambda s=s, bn=bn, st=st, nw=nw: paged_decode_attention(  # noqa: E731
                        q, kc, vc, bt, lens, D**-0.5, num_splits=s, block_n=bn, num_stages=st, num_warps=nw)
                    err = BA.rel_err(fn(), ref)
                    if err > 1e-2:
                        raise SystemExit(f"B={B} ctx={ctx} s{s}_n{bn}_st{st}_w{nw}: error {err}")
                    times[f"s{s}_n{bn}_st{st}_w{nw}"] = BA.time_us(fn)
            default_name = f"s{default}_n{32 if bt.shape[1] * 16 // default < 64 else 64}_st3_w4"
            best = min(times, key=times.get)
            row = {"B": B, "ctx": ctx, "flush": mode, "sdpa_us": sdpa_us, "default": default_name,
                   "default_us": times.get(default_name), "best": best, "best_us": times[best], "times": times}
            res["rows"].append(row)
            print(f"B={B:3d} ctx={ctx:6d} {mode:5s}: SDPA {sdpa_us:6.1f}  default {default_name} "
                  f"{row['default_us'] or float('nan'):6.1f} (x{sdpa_us / (row['default_us'] or float('nan')):.3f})  "
                  f"best {best} {times[best]:6.1f} (x{sdpa_us / times[best]:.3f}, "
                  f"{100 * kv_bytes / times[best] / 1e6 / res['copy_tbps']:.0f}% copy)", flush=True)
        with open(os.path.join(args.out, "decode_sweep.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
