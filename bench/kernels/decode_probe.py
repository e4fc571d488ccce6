"""Two questions about decode attention's figures, answered in one run.

1. **Flush.** ``bench_attention.py`` zeroes 256 MB before each timed replay, as do_bench does. That
   leaves L2 full of dirty lines, which the timed kernel must write back while it reads: up to ~50 MB
   of extra traffic against the 134 MB of a B=1, 32k-token decode. Each case is timed, ours and SDPA's,
   after a write flush, a read flush (clean lines) and no flush.
2. **Splits at short contexts.** The 8B step's profile (bench/engine.py --profile) shows a decode at
   B=1 over 512 tokens costing ~6.6 us plus ~1.6 us of split merge, and a 16-node tree ~8.1 plus 2.7.
   Each split count from 1 up is timed at B=1 over short contexts, for both kernels.
3. **The small kernels of a decode step** alone (one token, 8B shapes, no flush): RoPE with the cache
   write showed ~4.3 us per layer in the profile, RMSNorm ~1.9 us.

    python bench/kernels/decode_probe.py --out DIR
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
from kernels.paged_decode import paged_decode_attention  # noqa: E402
from kernels.tree_attention import tree_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gen = torch.Generator(device=BA.DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "copy_tbps": BA.copy_tbps(), "flush": [], "splits": []}
    cb = res["copy_tbps"]
    D, HKV, H = BA.D, BA.HKV, BA.H
    for B, ctx in [(1, 32768), (16, 4096), (64, 2048), (1, 4096)]:
        layouts, bt, k, v = caches(B, ctx, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(B, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
        kv_bytes = 2 * B * ctx * HKV * D * 2
        for mode in ("write", "read", "none"):
            BA.FLUSH = mode
            ours = BA.time_us(lambda: paged_decode_attention(q, kc, vc, bt, lens, D**-0.5))
            sdpa = BA.time_us(lambda: BA.sdpa(q[:, :, None], k, v))
            row = dict(B=B, ctx=ctx, flush=mode, us=ours, sdpa_us=sdpa, tbps=kv_bytes / ours / 1e6,
                       sdpa_tbps=kv_bytes / sdpa / 1e6)
            res["flush"].append(row)
            print(f"B={B:3d} ctx={ctx:6d} flush={mode:5s} ours {ours:6.1f} us {row['tbps']:5.2f} TB/s "
                  f"({100 * row['tbps'] / cb:3.0f}%)  SDPA {sdpa:6.1f} us {row['sdpa_tbps']:5.2f} TB/s  "
                  f"x{sdpa / ours:.3f}", flush=True)
    BA.FLUSH = "write"
    for ctx in (256, 512, 1024, 2048):
        layouts, bt, _, _ = caches(1, ctx, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(1, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        lens = torch.full((1,), ctx, dtype=torch.int32, device=BA.DEV)
        times = {}
        for s in (1, 2, 3, 4, 6, 8, 16):
            if s * 64 > ctx * 2:
                continue
            for bn in (32, 64):
                times[f"s{s}_n{bn}"] = BA.time_us(lambda s=s, bn=bn: paged_decode_attention(
                    q, kc, vc, bt, lens, D**-0.5, num_splits=s, block_n=bn))
        auto = BA.time_us(lambda: paged_decode_attention(q, kc, vc, bt, lens, D**-0.5))
        best = min(times, key=times.get)
        res["splits"].append(dict(kernel="decode", ctx=ctx, auto_us=auto, best=best, best_us=times[best], times=times))
        print(f"decode B=1 ctx={ctx:5d} auto {auto:5.1f} us  best {best} {times[best]:5.1f} us  "
              + " ".join(f"{k}:{v:.1f}" for k, v in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
    nodes = 16
    bits, _ = BA.tree_bits(BA.binary_tree(nodes))
    for ctx in (256, 512, 1024, 2048):
        layouts, bt, _, _ = caches(1, ctx + nodes, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(nodes, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        targs = (q, kc, vc, bt, torch.tensor([ctx], dtype=torch.int32, device=BA.DEV),
                 torch.tensor([0, nodes], dtype=torch.int32, device=BA.DEV),
                 torch.tensor(bits, dtype=torch.int64, device=BA.DEV), D**-0.5)
        times = {}
        for s in (1, 2, 3, 4, 6, 8):
            for bn in (32, 64, 128):
                times[f"s{s}_n{bn}"] = BA.time_us(lambda s=s, bn=bn: tree_attention(*targs, num_splits=s, block_n=bn))
        auto = BA.time_us(lambda: tree_attention(*targs))
        best = min(times, key=times.get)
        res["splits"].append(dict(kernel="tree16", ctx=ctx, auto_us=auto, best=best, best_us=times[best], times=times))
        print(f"tree16 B=1 ctx={ctx:5d} auto {auto:5.1f} us  best {best} {times[best]:5.1f} us  "
              + " ".join(f"{k}:{v:.1f}" for k, v in sorted(times.items(), key=lambda kv: kv[1])), flush=True)
    from kernels.fused_norm_rope import rms_norm, rope_and_cache

    BA.FLUSH = "none"
    layouts, _, _, _ = caches(1, 1024, 16, gen)
    kc, vc = layouts["token_major"]
    qkv = torch.randn(1, (H + 2 * HKV) * D, device=BA.DEV, dtype=BA.DT, generator=gen)
    pos = torch.tensor([700], device=BA.DEV)
    slot = torch.tensor([700], device=BA.DEV)
    inv = torch.rand(D // 2, device=BA.DEV, generator=gen)
    xh = torch.randn(1, 4096, device=BA.DEV, dtype=BA.DT, generator=gen)
    nw = torch.ones(4096, device=BA.DEV, dtype=BA.DT)
    res["small"] = {"rope_and_cache_t1_us": BA.time_us(lambda: rope_and_cache(qkv, pos, inv, kc, vc, slot, H, HKV)),
                    "rms_norm_t1_us": BA.time_us(lambda: rms_norm(xh, nw, 1e-5)),
                    "empty_copy_t1_us": BA.time_us(lambda: xh.copy_(xh))}
    print("small kernels, one token:", {k: round(v, 2) for k, v in res["small"].items()}, flush=True)
    with open(os.path.join(args.out, "decode_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
