"""Block ids a chunk at a time (``paged_decode._chunked_tiles``) against one lookup per tile, in one run.

With the block-table lookup inside the loop, Triton's pipeliner keeps one K/V buffer and waits on every
copy at each tile (sm_90 build: ``async_wait 0``); with the chunk's block ids in registers it double- or
triple-buffers (``bench/kernels/sass.py decode``). This times both on the issue's decode shapes after a
read and a write flush of L2, beside SDPA on the same KV made contiguous, and on 4-, 16- and 64-node trees
at B=16 / 4k. Every variant is checked against SDPA first.

    python bench/kernels/chunk_ab.py --out DIR --commit SHA
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench.kernels.bench_attention as BA  # noqa: E402
from bench.kernels.plotting import save_beside  # noqa: E402
from kernels.paged_decode import paged_decode_attention  # noqa: E402
from kernels.tree_attention import tree_attention  # noqa: E402

# (block_n, stages) of the chunked loop; every split count in SPLITS (None: the launcher's pick)
CHUNKED = [(64, 3), (64, 4), (128, 2), (128, 3), (32, 5)]
SPLITS = (None, 1, 2, 4, 8)


def check(fn, ref, name):
    err = BA.rel_err(fn(), ref)
    if err > 1e-2:
        raise SystemExit(f"{name}: error {err}")


def decode_case(B, ctx, page, gen):
    """One decode batch over shuffled pages: ``paged_decode_attention``'s arguments, the contiguous K/V
    SDPA reads, and SDPA's output."""
    kc, vc, bt, k, v = BA.paged_kv(B, ctx, page, gen)
    q = torch.randn(B, BA.H, BA.D, device=BA.DEV, dtype=BA.DT, generator=gen)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
    return (q, kc, vc, bt, lens, BA.D**-0.5), (q, k, v), BA.sdpa(q[:, :, None], k, v)[:, :, 0]


def checked(arms, ref, label):
    """``arms`` ({name: callable}), each checked against ``ref`` first."""
    for name, fn in arms.items():
        check(fn, ref, f"{label} {name}")
    return arms


def time_flushed(arms, dense):
    """``(flush, SDPA's us, {arm: us})`` after a read and after a write flush of L2; ``dense`` is SDPA's
    (q, k, v)."""
    q, k, v = dense
    out = []
    for flush in ("read", "write"):
        BA.FLUSH = flush
        sdpa_us = BA.time_us(lambda: BA.sdpa(q[:, :, None], k, v))
        out.append((flush, sdpa_us, {name: BA.time_us(fn) for name, fn in arms.items()}))
    return out


def tree_case(B, ctx, nodes, page, gen):
    """``tree_attention``'s arguments for a binary tree of ``nodes`` per sequence over ``ctx`` cached tokens,
    and SDPA's output with the tree's bool mask."""
    k_cache, v_cache, bt, k, v = BA.paged_kv(B, ctx + nodes, page, gen)
    bits, tree = BA.tree_bits(BA.binary_tree(nodes))
    q = torch.randn(B * nodes, BA.H, BA.D, device=BA.DEV, dtype=BA.DT, generator=gen)
    ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
    qs = torch.arange(B + 1, dtype=torch.int32, device=BA.DEV) * nodes
    mask_bits = torch.tensor(bits * B, dtype=torch.int64, device=BA.DEV)
    mask = torch.ones(nodes, ctx + nodes, dtype=torch.bool, device=BA.DEV)
    mask[:, ctx:] = tree.to(BA.DEV)
    q4 = q.view(B, nodes, BA.H, BA.D).transpose(1, 2)
    ref = BA.sdpa(q4, k, v, mask[None, None].expand(B, 1, -1, -1)).transpose(1, 2).reshape(B * nodes, BA.H, BA.D)
    return (q, k_cache, v_cache, bt, ctx_lens, qs, mask_bits, BA.D**-0.5), ref


def decode_rows(B, ctx, page, chunks, gen):
    args, dense, ref = decode_case(B, ctx, page, gen)
    kws = {"shipped": dict(chunk_tokens=0)}
    for c in chunks:
        kws[f"c{c}"] = dict(chunk_tokens=c)
        for s in SPLITS[1:] if B > 1 else (None,):
            for bn, st in CHUNKED:
                kws[f"c{c}_s{s}_n{bn}_st{st}"] = dict(chunk_tokens=c, num_splits=s, block_n=bn, num_stages=st)
    arms = checked({n: (lambda kw=kw: paged_decode_attention(*args, **kw)) for n, kw in kws.items()}, ref,
                   f"B={B} ctx={ctx} page={page}")
    kv_bytes = 2 * B * ctx * BA.HKV * BA.D * 2
    rows = []
    for flush, sdpa_us, times in time_flushed(arms, dense):
        chunked = {n: t for n, t in times.items() if n != "shipped"}
        best = min(chunked, key=chunked.get)
        row = {"B": B, "ctx": ctx, "page": page, "flush": flush, "sdpa_us": sdpa_us, "shipped_us": times["shipped"],
               **{f"c{c}_us": times[f"c{c}"] for c in chunks}, "best": best, "best_us": times[best],
               "best_tbps": kv_bytes / times[best] / 1e6, "times": times}
        rows.append(row)
        picks = "  ".join(f"c{c} {times[f'c{c}']:6.1f} (x{sdpa_us / times[f'c{c}']:.3f})" for c in chunks)
        print(f"decode B={B:2d} ctx={ctx:5d} p{page:2d} {flush:5s}: SDPA {sdpa_us:6.1f}  shipped {times['shipped']:6.1f} "
              f"(x{sdpa_us / times['shipped']:.3f})  {picks}  best {best} {times[best]:6.1f} "
              f"(x{sdpa_us / times[best]:.3f}, {kv_bytes / times[best] / 1e6:.2f} TB/s)", flush=True)
    return rows


def verify_rows(B, ctx, nodes, page, chunks, gen):
    args, ref = tree_case(B, ctx, nodes, page, gen)
    arms = {"shipped": lambda: tree_attention(*args, chunk_tokens=0)}
    for c in chunks:
        arms[f"c{c}"] = lambda c=c: tree_attention(*args, chunk_tokens=c)
        for bn, st in [(32, 7), (32, 5), (64, 3), (128, 2), (128, 3)]:
            arms[f"c{c}_n{bn}_st{st}"] = lambda c=c, bn=bn, st=st: tree_attention(*args, chunk_tokens=c, block_n=bn,
                                                                                   num_stages=st)
    checked(arms, ref, f"verify B={B} nodes={nodes}")
    BA.FLUSH = "write"
    times = {name: BA.time_us(fn) for name, fn in arms.items()}
    best = min(times, key=times.get)
    print(f"verify B={B} ctx={ctx} nodes={nodes:2d} p{page}: shipped {times['shipped']:6.1f}  "
          + "  ".join(f"c{c} {times[f'c{c}']:6.1f}" for c in chunks) + f"  best {best} {times[best]:6.1f}", flush=True)
    return {"B": B, "ctx": ctx, "nodes": nodes, "page": page, "flush": "write", "shipped_us": times["shipped"],
            **{f"c{c}_us": times[f"c{c}"] for c in chunks}, "best": best, "best_us": times[best], "times": times}


POLICY_DECODE = {"shipped": dict(chunk_tokens=0), "c_s1_n128_st3": dict(chunk_tokens=4096, num_splits=1, block_n=128,
                                                                             num_stages=3),
                 "c_s1_n64_st4": dict(chunk_tokens=4096, num_splits=1, block_n=64, num_stages=4),
                 "c_s1_n128_st2": dict(chunk_tokens=4096, num_splits=1, block_n=128, num_stages=2),
                 "c_s2_n128_st3": dict(chunk_tokens=4096, num_splits=2, block_n=128, num_stages=3),
                 "u_s1_n128_st3": dict(chunk_tokens=0, num_splits=1, block_n=128, num_stages=3)}


def policy_rows(gen):
    """Where one program per (sequence, KV head) with the chunked loop beats the split loop: batches
    around one wave of programs, three context lengths, read and write flush."""
    rows = []
    # (sequence, KV head) programs around one wave of 132 SMs; batches from the KV head count (8: B=8 ... 48)
    for n, ctx in [(64, 4096), (96, 4096), (128, 2048), (128, 4096), (128, 8192), (192, 4096), (256, 2048),
                   (256, 4096), (384, 2048)]:
        B = max(1, round(n / BA.HKV))
        args, dense, ref = decode_case(B, ctx, 16, gen)
        arms = checked({n: (lambda kw=kw: paged_decode_attention(*args, **kw)) for n, kw in POLICY_DECODE.items()},
                       ref, f"policy B={B} ctx={ctx}")
        for flush, sdpa_us, times in time_flushed(arms, dense):
            rows.append({"B": B, "ctx": ctx, "page": 16, "flush": flush, "sdpa_us": sdpa_us, "times": times})
            print(f"policy B={B:2d} ctx={ctx:5d} {flush:5s}: SDPA {sdpa_us:6.1f} "
                  + " ".join(f"{n} {t:6.1f}" for n, t in times.items()), flush=True)
    return rows


def small_rows(gen):
    """Small batches, where one program an SM needs many splits: the chunked loop at that split count (and
    half of it) against the split loop the launcher picks."""
    from kernels.paged_decode import _num_sms
    rows = []
    for B, ctx in [(1, 32768), (1, 4096), (2, 16384), (4, 8192)]:
        args, dense, ref = decode_case(B, ctx, 16, gen)
        w = max(1, _num_sms(BA.DEV) // (B * BA.HKV))
        kws = {"shipped": dict(chunk_tokens=0)}
        for s_ in sorted({w, max(1, w // 2)}):
            for bn, st in [(128, 3), (64, 4), (64, 3)]:
                kws[f"c_s{s_}_n{bn}_st{st}"] = dict(chunk_tokens=4096, num_splits=s_, block_n=bn, num_stages=st)
        arms = checked({n: (lambda kw=kw: paged_decode_attention(*args, **kw)) for n, kw in kws.items()}, ref,
                       f"small B={B} ctx={ctx}")
        kv_bytes = 2 * B * ctx * BA.HKV * BA.D * 2
        for flush, sdpa_us, times in time_flushed(arms, dense):
            best = min(times, key=times.get)
            rows.append({"B": B, "ctx": ctx, "page": 16, "flush": flush, "sdpa_us": sdpa_us, "times": times,
                         "best": best, "best_tbps": kv_bytes / times[best] / 1e6})
            print(f"small B={B} ctx={ctx:5d} {flush:5s}: SDPA {sdpa_us:6.1f} "
                  + " ".join(f"{n} {t:6.1f}" for n, t in times.items())
                  + f"  best {best} {kv_bytes / times[best] / 1e6:.2f} TB/s", flush=True)
    return rows


def tree_policy_rows(gen):
    """Large trees: the chunked prefix loop against the same tile unchunked."""
    rows = []
    for B, nodes in [(16, 32), (16, 64), (4, 64), (64, 16)]:
        ctx = 4096 if B <= 16 else 2048
        args, ref = tree_case(B, ctx, nodes, 16, gen)
        arms = {"shipped": dict(chunk_tokens=0)}
        for bn, st in [(128, 3), (128, 2), (64, 3), (64, 4)]:
            arms[f"u_n{bn}_st{st}"] = dict(chunk_tokens=0, block_n=bn, num_stages=st)
            arms[f"c_n{bn}_st{st}"] = dict(chunk_tokens=4096, block_n=bn, num_stages=st)
        fns = checked({n: (lambda kw=kw: tree_attention(*args, **kw)) for n, kw in arms.items()}, ref,
                      f"tree policy B={B} nodes={nodes}")
        BA.FLUSH = "write"
        times = {name: BA.time_us(fn) for name, fn in fns.items()}
        rows.append({"B": B, "ctx": ctx, "nodes": nodes, "page": 16, "flush": "write", "times": times})
        print(f"tree B={B:2d} nodes={nodes:2d}: " + " ".join(f"{n} {t:6.1f}" for n, t in times.items()), flush=True)
    return rows


def plot(path: str) -> str:
    """chunk_policy.json's (or chunk_small.json's) decode rows as speed relative to SDPA, one bar group per batch,
    beside it as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        res = json.load(f)
    rows = [r for r in res["decode"] if r["flush"] == "read"]

    def generic(row: dict) -> dict[str, float]:
        """A row's arms with its split counts named by order (sA, sB): chunk_small's splits follow the batch."""
        names: dict[str, str] = {}
        out = {}
        for arm, us in row["times"].items():
            split = re.search(r"_s(\d+)_", arm)
            if split:
                names.setdefault(split.group(1), "s" + "ABCD"[len(names) % 4])
                arm = arm.replace(f"_s{split.group(1)}_", f"_{names[split.group(1)]}_")
            out[arm] = us
        return out

    same = all(r["times"].keys() == rows[0]["times"].keys() for r in rows)
    times = [r["times"] if same else generic(r) for r in rows]
    arms = list(times[0])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        ax.bar([x + i * width for x in range(len(rows))], [r["sdpa_us"] / t[arm] for r, t in zip(rows, times)],
               width, label=arm)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([f"B={r['B']}\n{r['ctx'] // 1024}k" for r in rows])
    ax.axhline(0.95, color="k", lw=0.8, ls="--")
    ax.set_ylim(0.5, 1.05)
    ax.set_ylabel("speed / SDPA (contiguous KV)")
    ax.set_title(f"Paged decode, chunked block ids vs lookups per tile ({res['device']}, {res['commit']}, read flush, "
                 f"heads {res.get('heads', '32,8,128')})", fontsize=9)
    return save_beside(fig, ax, path, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--chunks", default="1024,4096")
    ap.add_argument("--pages", default="16,64")
    ap.add_argument("--plot", help="only draw this chunk_policy / chunk_small JSON's PNG beside it")
    ap.add_argument("--heads", default="32,8,128",
                    help="query heads, KV heads, head dim (SmolLM2-135M: 9,3,64; the launch rules hold at dim 128)")
    ap.add_argument("--small", action="store_true", help="instead: small batches (small_rows), into chunk_small.json")
    ap.add_argument("--policy", action="store_true",
                    help="instead: batches around one wave of programs (policy_rows) and large trees, into chunk_policy.json")
    args = ap.parse_args()
    BA.H, BA.HKV, BA.D = (int(x) for x in args.heads.split(","))
    if args.plot:
        print("wrote", plot(args.plot))
        return
    if args.small or args.policy:
        gen = torch.Generator(device=BA.DEV).manual_seed(0)
        res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
               "commit": args.commit, "torch": torch.__version__, "copy_tbps": BA.copy_tbps(), "heads": args.heads,
               "decode": small_rows(gen) if args.small else policy_rows(gen)}
        if args.policy:
            res["tree"] = tree_policy_rows(gen)
        with open(os.path.join(args.out, "chunk_small.json" if args.small else "chunk_policy.json"), "w") as f:
            json.dump(res, f, indent=1)
        print("copy TB/s", round(res["copy_tbps"], 3))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    gen = torch.Generator(device=BA.DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": args.commit,
           "torch": torch.__version__, "copy_tbps": BA.copy_tbps(), "chunks": chunks, "decode": [], "verify": []}
    path = os.path.join(args.out, "chunk_ab.json")
    for page in (int(p) for p in args.pages.split(",")):
        for B, ctx in [(16, 4096), (64, 2048), (1, 32768), (1, 4096)]:
            res["decode"] += decode_rows(B, ctx, page, chunks, gen)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
    for nodes in (4, 16, 64):
        res["verify"].append(verify_rows(16, 4096, nodes, 16, chunks, gen))
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print("copy TB/s", round(res["copy_tbps"], 3), "wrote", path)


if __name__ == "__main__":
    main()
