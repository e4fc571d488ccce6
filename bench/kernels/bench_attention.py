"""Paged decode, tree-verification and KV-compaction kernels against copy bandwidth and their peers.

One run: check each kernel against SDPA on the bench shapes, time the shipped defaults (``us``) and a
sweep of block sizes, pipeline depths and split counts (``best``, ``best_us``, ``variants``), and
write ``<out>/attention.json``. Setup: bf16, 32 query / 8 KV heads, D=128.
Peers: SDPA over contiguous KV (with and without a bool mask) and flex_attention (compiled), which
gets a wall-clock budget because every new shape recompiles.

    python bench/kernels/bench_attention.py --out DIR --commit SHA [--flex-budget-s 150]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kernels.compact_kv import compact_kv, compact_kv_ref  # noqa: E402
from kernels.paged_decode import decode_plan, paged_decode_attention, pick_num_splits  # noqa: E402
from kernels.tree_attention import tree_attention  # noqa: E402

H, HKV, D = 32, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")


_FLUSH: list[torch.Tensor] = []
# How L2 is flushed before each timed call: "write" zeroes 256 MB (do_bench's way), which leaves L2 full
# of dirty lines that the timed kernel then pays to write back; "read" reads 256 MB, leaving clean
# lines, as the weight reads before attention in a forward do; "none" keeps L2 warm.
FLUSH = "write"


def flush_l2() -> None:
    if FLUSH == "none":
        return
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device=DEV))
    if FLUSH == "write":
        _FLUSH[0].zero_()
    else:
        _FLUSH[0].max()


def time_us(fn, reps: int = 60) -> float:
    """Median device time of one call replayed from a CUDA graph, L2 flushed (``FLUSH``) before each replay.

    Graphs are how the engine runs these kernels, and replay keeps the launchers' Python cost (two
    Triton launches here, against one C++ call for SDPA) out of the number; ``eager_us`` shows it.
    Falls back to do_bench when a callable cannot be captured.
    """
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - reported and timed eagerly instead
        print("graph capture failed, timing eagerly:", repr(e)[:120])
        torch.cuda.synchronize()
        return eager_us(fn)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for _ in range(3):
        run()
    for start, end in events:
        flush_l2()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[reps // 2] * 1e3


def eager_us(fn) -> float:
    """Median of event-timed eager calls, L2 flushed before each (do_bench): includes launch gaps."""
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def paged_kv(B: int, seq_len: int, page: int, gen: torch.Generator):
    """Random bf16 KV for B sequences of seq_len tokens in shuffled pages, plus dense copies for SDPA."""
    blocks_per_seq = math.ceil(seq_len / page)
    num_blocks = B * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, page, HKV, D, device=DEV, dtype=DT, generator=gen)
    v_cache = torch.randn(num_blocks, page, HKV, D, device=DEV, dtype=DT, generator=gen)
    perm = torch.randperm(num_blocks, device=DEV, generator=gen)[: B * blocks_per_seq]
    block_tables = perm.reshape(B, blocks_per_seq).to(torch.int32)
    pos = torch.arange(seq_len, device=DEV)
    blocks = block_tables[:, pos // page].long()  # [B, S]
    k = k_cache[blocks, pos % page].transpose(1, 2).contiguous()  # [B, Hkv, S, D]
    v = v_cache[blocks, pos % page].transpose(1, 2).contiguous()
    return k_cache, v_cache, block_tables, k, v


def sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Flex:
    """Compiled flex_attention under a wall-clock budget (compiles count against it)."""

    def __init__(self, budget_s: float):
        self.budget_s, self.spent_s, self.fn = budget_s, 0.0, None
        import torch._dynamo
        for knob in ("recompile_limit", "cache_size_limit"):  # one compile per bench shape
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 256)
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            self.fn, self.create_block_mask = torch.compile(flex_attention, dynamic=False), create_block_mask
        except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
            print("flex unavailable:", repr(e)[:200])

    def time(self, q, k, v, mask_mod=None) -> float | None:
        if self.fn is None or self.spent_s > self.budget_s:
            return None
        t0 = time.time()
        try:
            bm = None
            if mask_mod is not None:
                bm = self.create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=DEV)
            run = lambda: self.fn(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
            run()
            us = time_us(run)
        except Exception as e:  # noqa: BLE001
            print("flex failed:", repr(e)[:300])
            us = None
        self.spent_s += time.time() - t0
        return us


def copy_tbps() -> float:
    """Device-to-device copy, bytes read plus written; the better of graph-replayed and eager timing."""
    src = torch.randn(1 << 30, device=DEV, dtype=DT)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(20):  # let the clocks ramp before the ceiling is read
        dst.copy_(src)
    us = min(time_us(lambda: dst.copy_(src)), eager_us(lambda: dst.copy_(src)))
    return 2 * src.numel() * 2 / us / 1e6


def best(variants: dict[str, callable]) -> tuple[str, float, dict[str, float]]:
    times = {name: time_us(fn) for name, fn in variants.items()}
    name = min(times, key=times.get)
    return name, times[name], times


def bench_decode(B, ctx, page, flex, gen, log, flex_jobs):
    k_cache, v_cache, bt, k, v = paged_kv(B, ctx, page, gen)
    q = torch.randn(B, H, D, device=DEV, dtype=DT, generator=gen)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    scale = D**-0.5
    err = rel_err(paged_decode_attention(q, k_cache, v_cache, bt, lens, scale), sdpa(q[:, :, None], k, v)[:, :, 0])
    plan = decode_plan(B * HKV, bt.shape[1], page, DEV)  # (splits, block_n, stages, chunk pages)
    variants = {}
    # (block_n, num_stages, programs resident per SM by ptxas -v): one wave of programs, and twice that.
    for bn, stages, per_sm in [(32, 7, 4), (64, 5, 3), (32, 5, 5), (64, 3, 4)]:
        fill = pick_num_splits(B * HKV, bt.shape[1] * page, DEV, per_sm)
        for splits in sorted({fill, min(64, 2 * fill)}):
            variants[f"s{splits}_n{bn}_st{stages}"] = (
                lambda s=splits, bn=bn, st=stages: paged_decode_attention(
                    q, k_cache, v_cache, bt, lens, scale, num_splits=s, block_n=bn, num_stages=st))
    # one program per (sequence, KV head), block ids a chunk at a time (paged_decode._chunked_tiles)
    for bn, stages in [(128, 3), (64, 4)]:
        variants[f"s1_n{bn}_st{stages}_chunked"] = (
            lambda bn=bn, st=stages: paged_decode_attention(q, k_cache, v_cache, bt, lens, scale, num_splits=1,
                                                            block_n=bn, num_stages=st, chunk_tokens=4096))
    name, best_us, times = best(variants)
    us = time_us(lambda: paged_decode_attention(q, k_cache, v_cache, bt, lens, scale))  # shipped defaults
    ctx_lens = lens - 1  # the same work through the tree kernel: one new token per sequence
    qs = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    tree_n1_us = time_us(lambda: tree_attention(q, k_cache, v_cache, bt, ctx_lens, qs, None, scale))
    q4 = q[:, :, None]  # [B, H, 1, D]
    sdpa_us = time_us(lambda: sdpa(q4, k, v))
    kv_bytes = 2 * B * ctx * HKV * D * 2
    # the same two after a read flush: clean lines, as the weight reads before attention in a forward leave
    # them (the write flush's dirty lines are written back during the timed kernel)
    global FLUSH
    flush, FLUSH = FLUSH, "read"
    us_read = time_us(lambda: paged_decode_attention(q, k_cache, v_cache, bt, lens, scale))
    sdpa_read_us = time_us(lambda: sdpa(q4, k, v))
    FLUSH = flush
    row = dict(B=B, ctx=ctx, page=page, us=us, tbps=kv_bytes / us / 1e6, sdpa_us=sdpa_us, flex_us=None,
               us_read=us_read, tbps_read=kv_bytes / us_read / 1e6, sdpa_read_us=sdpa_read_us,
               best_us=best_us, best=name, auto_splits=plan[0],
               plan=f"s{plan[0]}_n{plan[1]}_st{plan[2]}" + ("_chunked" if plan[3] else ""), tree_n1_us=tree_n1_us, err=err,
               eager_us=eager_us(lambda: paged_decode_attention(q, k_cache, v_cache, bt, lens, scale)))
    log["decode_variants"].append(dict(B=B, ctx=ctx, page=page, times=times))
    flex_jobs.append((row, lambda: flex.time(q4, k, v)))
    return row


def binary_tree(n: int) -> list[int]:
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def tree_bits(parents: list[int]) -> tuple[list[int], torch.Tensor]:
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    bits = [sum(1 << j for j in range(n) if mask[i, j]) for i in range(n)]
    return [b - 2**64 if b >= 2**63 else b for b in bits], mask


def bench_verify(B, ctx, nodes, page, flex, gen, log, flex_jobs):
    k_cache, v_cache, bt, k, v = paged_kv(B, ctx + nodes, page, gen)
    bits, tree = tree_bits(binary_tree(nodes))
    q = torch.randn(B * nodes, H, D, device=DEV, dtype=DT, generator=gen)  # [T, H, D]
    ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    qs = torch.arange(B + 1, dtype=torch.int32, device=DEV) * nodes
    mask_bits = torch.tensor(bits * B, dtype=torch.int64, device=DEV)
    scale = D**-0.5
    args = (q, k_cache, v_cache, bt, ctx_lens, qs, mask_bits, scale)
    mask = torch.ones(nodes, ctx + nodes, dtype=torch.bool, device=DEV)
    mask[:, ctx:] = tree.to(DEV)
    q4 = q.view(B, nodes, H, D).transpose(1, 2)  # [B, H, N, D]
    dense = sdpa(q4, k, v, mask[None, None].expand(B, 1, -1, -1)).transpose(1, 2).reshape(B * nodes, H, D)
    err = rel_err(tree_attention(*args), dense)
    variants = {}
    for splits in (None, 2, 3, 4, 6, 8):
        for bn, warps, stages in [(64, None, 2), (64, None, 3), (32, None, 7), (32, None, 5), (128, None, 2)]:
            variants[f"s{splits}_n{bn}_w{warps}_st{stages}"] = (
                lambda s=splits, bn=bn, w=warps, st=stages: tree_attention(
                    *args, num_splits=s, block_n=bn, num_warps=w, num_stages=st))
    name, best_us, times = best(variants)
    us = time_us(lambda: tree_attention(*args))  # shipped defaults
    lens = ctx_lens + nodes
    qd = q.view(B, nodes, H, D)[:, 0].contiguous()
    decode_us = time_us(lambda: paged_decode_attention(qd, k_cache, v_cache, bt, lens, scale))
    bmask = mask[None, None].expand(B, 1, -1, -1)
    sdpa_mask_us = time_us(lambda: sdpa(q4, k, v, bmask))
    sdpa_nomask_us = time_us(lambda: sdpa(q4, k, v))
    tree_dev = tree.to(DEV)
    mask_mod = lambda b, h, qi, kv: (kv < ctx) | tree_dev[qi, (kv - ctx).clamp(0, nodes - 1)]  # noqa: E731
    log["verify_variants"].append(dict(B=B, ctx=ctx, nodes=nodes, times=times))
    row = dict(B=B, ctx=ctx, nodes=nodes, page=page, us=us, decode_us=decode_us, sdpa_nomask_us=sdpa_nomask_us,
               sdpa_mask_us=sdpa_mask_us, flex_us=None, best_us=best_us, best=name, err=err,
               eager_us=eager_us(lambda: tree_attention(*args)))
    flex_jobs.append((row, lambda: flex.time(q4, k, v, mask_mod)))
    return row


def bench_compact(B, nodes, gen, log):
    L, page, ctx = 32, 16, 4000
    blocks_per_seq = math.ceil((ctx + nodes) / page)
    k_cache = torch.randn(L, B * blocks_per_seq, page, HKV, D, device=DEV, dtype=DT, generator=gen)
    v_cache = torch.randn_like(k_cache)
    bt = torch.randperm(B * blocks_per_seq, device="cpu").reshape(B, blocks_per_seq)
    path = [0, 1, 3, 7, 15][: int(math.log2(nodes)) + 1]  # root-to-leaf of a binary tree: 3 real moves at 16
    src, dst = [], []
    for b in range(B):
        for depth, node in enumerate(path):
            for pos, out in ((ctx + node, src), (ctx + depth, dst)):
                out.append(int(bt[b, pos // page]) * page + pos % page)
    src_t = torch.tensor(src, dtype=torch.int64, device=DEV)
    dst_t = torch.tensor(dst, dtype=torch.int64, device=DEV)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    compact_kv_ref(want_k, want_v, src_t, dst_t)
    compact_kv(k_cache, v_cache, src_t, dst_t)
    ok = torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    variants = {f"m{bm}_c{bc}": (lambda bm=bm, bc=bc: compact_kv(k_cache, v_cache, src_t, dst_t, block_m=bm,
                                                                   block_c=bc))
                for bm, bc in [(32, 128), (16, 64), (32, 256), (64, 64)]}
    name, best_us, times = best(variants)
    log["compact_variants"].append(dict(B=B, nodes=nodes, times=times))
    return dict(nodes=nodes, B=B, moves=len(src), us=times["m32_c128"], best_us=best_us, best=name, ok=ok,
                eager_us=eager_us(lambda: compact_kv(k_cache, v_cache, src_t, dst_t)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--flex-budget-s", type=float, default=150.0)
    ap.add_argument("--pages", default="16,64")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    flex = Flex(args.flex_budget_s)
    log = {"decode_variants": [], "verify_variants": [], "compact_variants": []}
    res = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=args.commit,
               torch=torch.__version__, copy_tbps=copy_tbps(), decode=[], verify=[], compact=[])
    path = os.path.join(args.out, "attention.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res | {"variants": log}, f, indent=1)

    for B, nodes in [(1, 16), (16, 16)]:
        res["compact"].append(bench_compact(B, nodes, gen, log))
    save()
    flex_jobs: list = []
    for nodes in [16, 4, 8, 32, 64]:  # the headline case first: flex compiles run in this order
        res["verify"].append(bench_verify(16, 4096, nodes, 16, flex, gen, log, flex_jobs))
        save()
    res["verify"].sort(key=lambda r: r["nodes"])
    for page in [int(p) for p in args.pages.split(",")]:
        for B, ctx in [(16, 4096), (1, 32768), (64, 2048), (1, 4096)]:
            res["decode"].append(bench_decode(B, ctx, page, flex, gen, log, flex_jobs))
            save()
    def flex_priority(item) -> int:  # the target rows first: compiles are slow and run under a budget
        row = item[0]
        key = (row.get("nodes"), row.get("B"), row.get("ctx"))
        order = [(16, 16, 4096), (None, 16, 4096), (None, 1, 32768), (4, 16, 4096), (8, 16, 4096)]
        return order.index(key) if key in order else len(order)

    for row, job in sorted(flex_jobs, key=flex_priority):
        if row["page"] == 16:
            row["flex_us"] = job()
            save()
    res["decode"].sort(key=lambda r: (r["page"], r["B"] * r["ctx"], r["B"]))
    save()
    report(res)


def report(res: dict) -> None:
    cb = res["copy_tbps"]
    print(f"\n{res['device']}  copy {cb:.2f} TB/s  torch {res['torch']}")
    print("decode  B    ctx  P     us   TB/s  %copy  sdpa_us  xSDPA  flex_us  tree_n1  eager  best  err"
          "  | read flush: us  TB/s  xSDPA")
    for r in res["decode"]:
        fx = f"{r['flex_us']:8.1f}" if r["flex_us"] else "       -"
        rd = (f"  | {r['us_read']:6.1f} {r['tbps_read']:5.2f} {r['sdpa_read_us'] / r['us_read']:5.2f}x"
              if "us_read" in r else "")
        print(f"      {r['B']:3d} {r['ctx']:6d} {r['page']:2d} {r['us']:6.1f} {r['tbps']:6.2f} {100 * r['tbps'] / cb:5.0f}%"
              f" {r['sdpa_us']:8.1f} {r['sdpa_us'] / r['us']:5.2f}x {fx} {r['tree_n1_us']:8.1f} {r['eager_us']:6.1f}"
              f"  {r['best']} {r['err']:.1e}{rd}")
    print("verify  N     us  decode  /dec  sdpa_nm  x   sdpa_m   x    flex_us  eager  best  err")
    for r in res["verify"]:
        fx = f"{r['flex_us']:8.1f}" if r["flex_us"] else "       -"
        print(f"      {r['nodes']:3d} {r['us']:6.1f} {r['decode_us']:6.1f} {r['us'] / r['decode_us']:5.2f}"
              f" {r['sdpa_nomask_us']:7.1f} {r['sdpa_nomask_us'] / r['us']:4.1f} {r['sdpa_mask_us']:8.1f}"
              f" {r['sdpa_mask_us'] / r['us']:4.1f} {fx} {r['eager_us']:6.1f}  {r['best']} {r['err']:.1e}")
    for r in res["compact"]:
        print(f"compact B={r['B']} nodes={r['nodes']} moves={r['moves']}: {r['us']:.1f} us "
              f"(eager {r['eager_us']:.1f}) {r['best']} ok={r['ok']}")


if __name__ == "__main__":
    main()
