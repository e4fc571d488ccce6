"""Paged decode and tree attention with K/V prefetched a tile ahead into registers (``prefetch=True``),
against the pipeliner's loop (and SDPA for decode).

The pipelined decode loop (``kernels/paged_decode.py``) leaves K/V loads to Triton's pipeliner, which
spends its stages on the block-table lookup that feeds each address: the sm_90 SASS waits on every
outstanding copy at the top of each tile, so a program has no copy in flight while it computes, and
only the other programs on the SM hide the latency. The prefetch loop runs with ``num_stages=1`` (no
pipeliner) and does the pipelining by hand, the way a CUDA decode kernel would: each trip issues plain
loads of the *next* tile's K and V into registers (their block-table entries were loaded a trip
earlier still) before it computes on the current tile, so the copies stay in flight through the dots
and the softmax.

    python bench/kernels/prefetch_probe.py --out DIR     # CUDA: correctness, then the timing tables

(tests/kernels/test_paged_decode.py and test_tree_attention.py run both loops under the interpreter.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from kernels.tree_attention import tree_attention  # noqa: E402


RP_TILES = [(32, 4), (32, 8), (64, 4), (64, 8), (128, 8)]  # (block_n, warps); 128 at 4 warps spills


def decode_rp(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits: int, block_n: int = 64,
              num_warps: int = 8) -> torch.Tensor:
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, use_triton=True,
                                  num_splits=num_splits, block_n=block_n, num_warps=num_warps, prefetch=True)


def check(device: str, dtype: torch.dtype) -> float:
    """Worst relative error against the reference over ragged lengths, pages 16 and 64, several splits."""
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for page, lens, H, Hkv, D in [(16, [1, 17, 100, 333], 8, 2, 64), (64, [64, 65, 200, 5], 4, 4, 32),
                                  (16, [48, 7], 32, 8, 128)]:
        B, nb = len(lens), -(-max(lens) // page) + 1
        k_cache = torch.randn(B * nb + 1, page, Hkv, D, generator=gen, device=device).to(dtype)
        v_cache = torch.randn(B * nb + 1, page, Hkv, D, generator=gen, device=device).to(dtype)
        bt = torch.randperm(B * nb, generator=gen, device=device).view(B, nb).to(torch.int32)
        q = torch.randn(B, H, D, generator=gen, device=device).to(dtype)
        sl = torch.tensor(lens, dtype=torch.int32, device=device)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, D**-0.5).float()
        for S in (1, 2, 3):
            for bn in (16, 32, 64):
                out = decode_rp(q, k_cache, v_cache, bt, sl, D**-0.5, S, bn).float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                if not err < 2e-2:
                    raise SystemExit(f"page {page} lens {lens} S={S} bn={bn}: error {err}")
                worst = max(worst, err)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import bench.kernels.bench_attention as BA
    from bench.kernels.attn_layout import caches

    print(f"check: max rel err {check('cuda', torch.bfloat16):.2e}", flush=True)
    gen = torch.Generator(device=BA.DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "copy_tbps": BA.copy_tbps(), "rows": []}
    D, H = BA.D, BA.H
    for B, ctx, page in [(16, 4096, 16), (16, 4096, 64), (64, 2048, 16), (1, 32768, 16), (1, 4096, 16)]:
        layouts, bt, k, v = caches(B, ctx, page, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(B, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
        ref = BA.sdpa(q[:, :, None], k, v)[:, :, 0]
        fns = {"shipped": lambda: paged_decode_attention(q, kc, vc, bt, lens, D**-0.5, prefetch=False)}
        split_opts = (1, 2, 4, 8) if B >= 16 else (16, 32, 64) if ctx >= 16384 else (8, 16, 32)
        for s in split_opts:
            for bn, nw in RP_TILES:
                fns[f"rp_s{s}_n{bn}_w{nw}"] = lambda s=s, bn=bn, nw=nw: decode_rp(q, kc, vc, bt, lens, D**-0.5, s, bn, nw)
        for name, fn in fns.items():
            err = BA.rel_err(fn(), ref)
            if err > 1e-2:
                raise SystemExit(f"B={B} ctx={ctx} {name}: error {err}")
        kv_bytes = 2 * B * ctx * BA.HKV * D * 2
        for mode in ("read", "write"):
            BA.FLUSH = mode
            sdpa_us = BA.time_us(lambda: BA.sdpa(q[:, :, None], k, v))
            times = {name: BA.time_us(fn) for name, fn in fns.items()}
            variants = {n: t for n, t in times.items() if n != "shipped"}
            best = min(variants, key=variants.get)
            row = {"B": B, "ctx": ctx, "page": page, "flush": mode, "sdpa_us": sdpa_us, "shipped_us": times["shipped"],
                   "best": best, "best_us": times[best], "times": times}
            res["rows"].append(row)
            print(f"B={B:3d} ctx={ctx:6d} p{page:2d} {mode:5s}: SDPA {sdpa_us:6.1f}  shipped {times['shipped']:6.1f} "
                  f"(x{sdpa_us / times['shipped']:.3f})  best {best} {times[best]:6.1f} (x{sdpa_us / times[best]:.3f}, "
                  f"{100 * kv_bytes / times[best] / 1e6 / res['copy_tbps']:.0f}% copy)", flush=True)
        with open(os.path.join(args.out, "prefetch_probe.json"), "w") as f:
            json.dump(res, f, indent=1)
    res["tree"] = []
    n = 16
    bits, _ = BA.tree_bits(BA.binary_tree(n))
    for B, ctx in [(1, 4096), (16, 2048), (1, 512)]:
        layouts, bt, _, _ = caches(B, ctx + n, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(B * n, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
        qs = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=BA.DEV)
        mask = torch.tensor(bits * B, dtype=torch.int64, device=BA.DEV)
        fns = {"shipped": lambda: tree_attention(q, kc, vc, bt, ctx_lens, qs, mask, D**-0.5, prefetch=False)}
        for bn, nw in [(32, 4), (32, 8), (64, 4), (64, 8)]:
            fns[f"rp_n{bn}_w{nw}"] = lambda bn=bn, nw=nw: tree_attention(q, kc, vc, bt, ctx_lens, qs, mask, D**-0.5,
                                                                         block_n=bn, num_warps=nw, prefetch=True)
        ref = fns["shipped"]().float()
        for name, fn in fns.items():
            err = BA.rel_err(fn(), ref)
            if err > 1e-2:
                raise SystemExit(f"tree B={B} ctx={ctx} {name}: error {err}")
        for mode in ("read", "write"):
            BA.FLUSH = mode
            times = {name: BA.time_us(fn) for name, fn in fns.items()}
            variants = {k_: t for k_, t in times.items() if k_ != "shipped"}
            best = min(variants, key=variants.get)
            res["tree"].append({"B": B, "ctx": ctx, "nodes": n, "flush": mode, "shipped_us": times["shipped"],
                                "best": best, "best_us": times[best], "times": times})
            print(f"tree{n} B={B:3d} ctx={ctx:6d} {mode:5s}: shipped {times['shipped']:6.1f}  best {best} "
                  f"{times[best]:6.1f} (x{times['shipped'] / times[best]:.3f})", flush=True)
        with open(os.path.join(args.out, "prefetch_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()