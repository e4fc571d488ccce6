"""Decode attention against the KV cache's memory layout: an experiment, not a report.

The cache is ``[num_blocks, P, Hkv, D]`` (token-major): a program of one KV head reads 256-byte rows
(D = 128, bf16) strided by ``Hkv * D``. Head-major ``[num_blocks, Hkv, P, D]`` makes one head's page
one contiguous ``P * D * 2``-byte run. The decode kernel takes strides, so a permuted view times the
head-major layout with the same code. Each (B, ctx) case is timed on both layouts over a sweep of
tile sizes, pipeline depths and split counts, beside SDPA over contiguous KV; every ratio is within
this run.

    python bench/kernels/attn_layout.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench.kernels.bench_attention import D, DEV, DT, H, HKV, copy_tbps, rel_err, sdpa, time_us  # noqa: E402
from kernels.paged_decode import paged_decode_attention, pick_num_splits  # noqa: E402


def caches(B: int, ctx: int, page: int, gen: torch.Generator):
    """The same random KV in both layouts, shuffled pages, and a contiguous copy for SDPA."""
    per_seq = math.ceil(ctx / page)
    nb = B * per_seq + 1
    k_tm = torch.randn(nb, page, HKV, D, device=DEV, dtype=DT, generator=gen)
    v_tm = torch.randn(nb, page, HKV, D, device=DEV, dtype=DT, generator=gen)
    k_hm = k_tm.transpose(1, 2).contiguous().transpose(1, 2)  # [nb, P, Hkv, D] view of [nb, Hkv, P, D] memory
    v_hm = v_tm.transpose(1, 2).contiguous().transpose(1, 2)
    bt = torch.randperm(nb, device=DEV, generator=gen)[: B * per_seq].reshape(B, per_seq).to(torch.int32)
    pos = torch.arange(ctx, device=DEV)
    blocks = bt[:, pos // page].long()
    k = k_tm[blocks, pos % page].transpose(1, 2).contiguous()  # [B, Hkv, S, D]
    v = v_tm[blocks, pos % page].transpose(1, 2).contiguous()
    return {"token_major": (k_tm, v_tm), "head_major": (k_hm, v_hm)}, bt, k, v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "copy_tbps": copy_tbps(), "rows": []}
    cb = res["copy_tbps"]
    for B, ctx in [(16, 4096), (1, 32768), (64, 2048), (1, 4096)]:
        for page in (16, 64):
            layouts, bt, k, v = caches(B, ctx, page, gen)
            q = torch.randn(B, H, D, device=DEV, dtype=DT, generator=gen)
            lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
            ref = sdpa(q[:, :, None], k, v)[:, :, 0]
            sdpa_us = time_us(lambda: sdpa(q[:, :, None], k, v))
            kv_bytes = 2 * B * ctx * HKV * D * 2
            for lay, (kc, vc) in layouts.items():
                times = {}
                for bn, st, nw, per_sm in [(64, 3, 4, 4), (32, 7, 4, 4), (64, 5, 4, 3), (128, 3, 8, 2), (128, 2, 4, 2)]:
                    fill = pick_num_splits(B * HKV, bt.shape[1] * page, DEV, per_sm)
                    for s in sorted({fill, min(128, 2 * fill)}):
                        fn = lambda s=s, bn=bn, st=st, nw=nw: paged_decode_attention(  # noqa: E731
                            q, kc, vc, bt, lens, D**-0.5, num_splits=s, block_n=bn, num_stages=st, num_warps=nw)
                        err = rel_err(fn(), ref)
                        if err > 1e-2:
                            raise SystemExit(f"{lay} B={B} ctx={ctx} P={page} s{s}_n{bn}: error {err}")
                        times[f"s{s}_n{bn}_st{st}_w{nw}"] = time_us(fn)
                name = min(times, key=times.get)
                row = dict(B=B, ctx=ctx, page=page, layout=lay, best=name, us=times[name], sdpa_us=sdpa_us,
                           tbps=kv_bytes / times[name] / 1e6, times=times)
                res["rows"].append(row)
                print(f"B={B:3d} ctx={ctx:6d} P={page:2d} {lay:11s} best {name:18s} {row['us']:7.1f} us "
                      f"{row['tbps']:5.2f} TB/s ({100 * row['tbps'] / cb:3.0f}%)  SDPA {sdpa_us:6.1f}  "
                      f"x{sdpa_us / row['us']:.2f}", flush=True)
            with open(os.path.join(args.out, "attn_layout.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
