"""Where an M = 1 INT4 GEMV's time goes beyond its bytes, on Llama-3-8B's four layer shapes, in one run.

Each shape's shipped kernel (the tuner's hgemv pick) is timed beside probes that share its grid, tiles,
split and tiles in flight but leave parts out, so the differences price each part:

* ``empty``: the grid launches and stores one word a program (launch, ramp-up and drain of the grid);
* ``stream``: loads the split's weight words and group scales and reduces them with one add a word,
  one partial row a program, no fix-up (the memory side of the grid alone);
* ``stream+fixup``: the same and the serial split-K fix-up (partials, counter, last arriver's sum);
* ``stream+x``: the same as ``stream`` and hgemv's x pass (the split's max |x|, the scaled pairs and
  tile sums into the program's scratch rows, a barrier, the pairs read back a tile ahead);
* ``hgemv-nofix``: the shipped kernel with every split storing its own partial row (no fix-up);
* ``hgemv``: the shipped kernel;
* ``hgemv-fix32`` / ``hgemv-atomic``: the shipped kernel with its fix-up changed: one 32-row round of
  partials (``SPECGATE_INT4_FIX_ROWS=32``), or partials summed by L2 reductions into one row
  (``SPECGATE_INT4_FIX_ATOMIC=1``); the three hgemv arms are timed twice, alternated, and keep their best;
* ``stream_grid``: ``stream`` again on other grids (128-512 columns a program, 1-8 splits, two tiles in
  flight), to see what the memory side alone costs with fewer splits.

Timing as ``bench_int4_matmul``: CUDA graphs over rotating weight copies, launches back to back (PDL
as shipped), L2 cold for every call's weights. ``copy`` is the copy bandwidth of the same run and
``floor_us`` each shape's bytes (words and scales) at it.

    python bench/kernels/gemv_probe.py --out DIR [--commit SHA]
    python bench/kernels/gemv_probe.py --plot bench/results/gemv_probe_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench.kernels.bench_int4_matmul as B  # noqa: E402
from kernels import int4_matmul_triton as T  # noqa: E402
from kernels.pdl import pdl_ok  # noqa: E402
from bench.kernels.plotting import save_beside  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, qw_ptr, scales_ptr, y_ptr, part_ptr, count_ptr, scr_ptr, N, K_ITERS, split_k,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPTH: tl.constexpr, EMPTY: tl.constexpr,
                  X_PASS: tl.constexpr, FIXUP: tl.constexpr, FIX_R: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if EMPTY:
        tl.store(y_ptr + pid_k * tl.num_programs(0) + pid_n, pid_n.to(tl.float32))
    else:
        BLOCK_K8: tl.constexpr = BLOCK_K // 8
        R8 = K_ITERS * BLOCK_K8
        k_lo = pid_k * K_ITERS * BLOCK_K
        cols, n_mask = T._tile_columns(pid_n, N, BLOCK_N, False)
        offs_k8 = tl.arange(0, BLOCK_K8)
        q_ptrs = qw_ptr + (k_lo // 8 + offs_k8)[:, None] * N + cols[None, :]
        q_a, s_a, z_a = T._hgemv_tile(q_ptrs, scales_ptr, scales_ptr, cols, k_lo, 0, n_mask, N, K_ITERS, 128,
                                      BLOCK_K, False)
        if DEPTH > 1:
            q_b, s_b, z_b = T._hgemv_tile(q_ptrs, scales_ptr, scales_ptr, cols, k_lo, 1, n_mask, N, K_ITERS, 128,
                                          BLOCK_K, False)
        scr = scr_ptr + (pid_k * tl.num_programs(0) + pid_n) * (R8 * 4 + K_ITERS)
        if X_PASS:  # hgemv's step 1, as shipped
            T._hgemv_x_pass(x_ptr, scr, k_lo, R8, K_ITERS, BLOCK_K8, 128)
        x_ptrs = scr + 4 * offs_k8[:, None]
        sum_ptr = scr + R8 * 4
        if X_PASS:
            x_a = T._hgemv_pairs(x_ptrs, sum_ptr, 0, K_ITERS, BLOCK_K8)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for i in range(K_ITERS):
            q, s = q_a, s_a
            if DEPTH > 1:
                q_a, s_a = q_b, s_b
                q_b, s_b, z_b = T._hgemv_tile(q_ptrs, scales_ptr, scales_ptr, cols, k_lo, i + 2, n_mask, N, K_ITERS,
                                              128, BLOCK_K, False)
            else:
                q_a, s_a, z_a = T._hgemv_tile(q_ptrs, scales_ptr, scales_ptr, cols, k_lo, i + 1, n_mask, N, K_ITERS,
                                              128, BLOCK_K, False)
            t = tl.sum(q, axis=0).to(tl.float32)  # one add a word: the loads stay, the decode goes
            if X_PASS:
                x04, x15, x26, x37, xsum = x_a
                x_a = T._hgemv_pairs(x_ptrs, sum_ptr, i + 1, K_ITERS, BLOCK_K8)
                t += xsum + tl.sum(x04 + x15 + x26 + x37, axis=0).to(tl.float32)
            acc += s * t
        offs_m = tl.arange(0, 1)
        if FIXUP:
            T._finish(acc[None, :], pid_n, pid_n, pid_k, split_k, offs_m, cols, n_mask, 1, N, y_ptr, y_ptr, y_ptr,
                      part_ptr, count_ptr, N, N, False, False, False, True, 1, BLOCK_N, FIX_R)
        else:
            tl.store(part_ptr + pid_k * N + cols, acc, mask=n_mask)


def probe_fn(kind: str, cfg: T.KernelConfig, x, w, y, part, counts, scratch):
    N = w.qweight.shape[1]
    K = x.shape[1]
    k_iters = K // cfg.block_k // cfg.split_k
    flags = {"empty": (1, 0, 0), "stream": (0, 0, 0), "stream+fixup": (0, 0, 1), "stream+x": (0, 1, 0)}[kind]
    grid = (triton.cdiv(N, cfg.block_n), cfg.split_k)
    fix_r = T.kernel_for(cfg, True, 128, True)[1]["FIX_R"]  # the shipped hgemv's rows per fix-up round
    return lambda: _probe_kernel[grid](x, w.qweight, w.scales, y, part, counts, scratch, N, k_iters, cfg.split_k,
                                       BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DEPTH=cfg.num_stages, EMPTY=flags[0],
                                       X_PASS=flags[1], FIXUP=flags[2], FIX_R=fix_r, num_warps=cfg.num_warps,
                                       num_stages=1)


def plot(path: str) -> str:
    """gemv_probe.json's arms per shape as grouped bars, each shape's copy-rate floor as a line, PNG beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        res = json.load(f)
    rows = res["rows"]
    arms = list(rows[0]["us"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        ax.bar([x + i * width for x in range(len(rows))], [r["us"][arm] for r in rows], width, label=arm)
    for x, r in enumerate(rows):
        ax.hlines(r["floor_us"], x - width / 2, x + 0.8 - width / 2, color="k", lw=1.2,
                  label="bytes at the copy rate" if x == 0 else None)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([f"{r['K']}x{r['N']}" for r in rows])
    ax.set_ylabel("us per call (CUDA graph, back to back)")
    ax.set_title(f"M = 1 INT4 GEMV by part ({res['device']}, {res['commit']}, copy {res['copy_tbps']:.2f} TB/s)",
                 fontsize=9)
    return save_beside(fig, ax, path, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT", "unknown"))
    ap.add_argument("--plot", help="only draw this gemv_probe JSON's PNG beside it")
    args = ap.parse_args()
    if args.plot:
        print("wrote", plot(args.plot))
        return
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": args.commit,
           "torch": torch.__version__, "pdl": pdl_ok(dev), "copy_tbps": B.copy_tbps(), "rows": []}
    print(f"{res['device']}  copy {res['copy_tbps']:.2f} TB/s  pdl {res['pdl']}", flush=True)
    arms = ["empty", "stream", "stream+fixup", "stream+x", "hgemv-nofix"]
    # the probes price the serial fix-up (hgemv's own launch with FIX_ATOMIC off); atomic sums are an arm
    T.FIX_ATOMIC = False
    fix_arms = {"hgemv": {}, "hgemv-fix32": {"FIX_ROWS": 32}, "hgemv-atomic": {"FIX_ATOMIC": True}}
    for K, N in B.SHAPES:
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ws = [B.rand_weight(N, K, torch.bfloat16) for _ in range(max(2, math.ceil(B.ROTATE_BYTES / (K * N // 2))))]
        y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
        T.int4_matmul_triton(x, ws[0].qweight, ws[0].scales, ws[0].zeros, B.G, whole_zeros=True)  # tunes
        key = (1, N, K, B.G, x.dtype, True, True, False, x.device)
        cfg = T._CONFIG_CACHE[key]
        if cfg.kind != "hgemv":
            print(f"{K}x{N}: tuner picked {cfg}, not hgemv; skipped", flush=True)
            continue
        grid_n = triton.cdiv(N, cfg.block_n)
        k_iters = K // cfg.block_k // cfg.split_k
        part = torch.empty(cfg.split_k, 1, N, device=dev, dtype=torch.float32)
        counts = torch.zeros(grid_n, device=dev, dtype=torch.int32)
        scratch = torch.empty(grid_n * cfg.split_k * (k_iters * cfg.block_k // 2 + k_iters), device=dev,
                              dtype=torch.int32)
        yf = torch.empty(cfg.split_k * grid_n + N, device=dev, dtype=torch.float32)
        nbytes = K * N // 2 + (K // B.G) * N * 2
        row = {"K": K, "N": N, "config": str(cfg), "bytes": nbytes,
               "floor_us": nbytes / res["copy_tbps"] / 1e6, "us": {}}
        for arm in arms:
            if arm == "hgemv-nofix":
                def nofix(w):  # the shipped launch with each split storing its own rows (USE_SPLIT off)
                    kernel, extra = T.kernel_for(cfg, True, B.G, True, pdl=pdl_ok(dev), whole_zeros=True)
                    return lambda: kernel[(grid_n, cfg.split_k)](
                        x, w.qweight, w.scales, w.zeros, y, y, y, part, counts, scratch, 1, N, K, K, N, N,
                        cfg.split_k, k_iters, G=B.G, HAS_ZEROS=True, HAS_BIAS=False, HAS_RES=False, SILU=False,
                        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_SPLIT=False, num_warps=cfg.num_warps,
                        num_stages=1, **extra, **({"launch_pdl": True} if extra.get("USE_PDL") else {}))
                fns = [nofix(w) for w in ws]
            else:
                fns = [probe_fn(arm, cfg, x, w, yf if arm == "empty" else y, part, counts, scratch) for w in ws]
            row["us"][arm] = B.graph_time_us(fns)[0]
        row["reps"] = {arm: [] for arm in fix_arms}
        outs = {}
        for _ in range(2):
            for arm, knobs in fix_arms.items():
                saved = {k: getattr(T, k) for k in knobs}
                for k, v in knobs.items():
                    setattr(T, k, v)
                try:  # the knobs are read when a launch is recorded into the graph
                    fns = [lambda w=w: T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, B.G, config=cfg, out=y,
                                                            whole_zeros=True) for w in ws]
                    t, outs[arm] = B.graph_time_us(fns)
                    row["reps"][arm].append(t)
                finally:
                    for k, v in saved.items():
                        setattr(T, k, v)
        for arm in fix_arms:
            row["us"][arm] = min(row["reps"][arm])
        # each arm's output after its graph's replays against the shipped arm's: a counter or sum row left
        # dirty by one launch would show in the next (fp32 sums in another order differ in the last bits)
        ref = outs["hgemv"].float()
        row["max_rel_diff"] = {arm: float((o.float() - ref).abs().max() / ref.abs().max()) for arm, o in outs.items()}
        # the memory side alone on other grids: fewer splits (a shorter fix-up, or none) against more
        # programs in flight
        row["stream_grid"] = {}
        for bn in (128, 256, 512):
            for split in sorted({1, 2, 4, 8, cfg.split_k}):
                if N % bn or (K // 128) % split:
                    continue
                c = T.KernelConfig("hgemv", 1, bn, 128, split, 4, 2)
                fns = [probe_fn("stream", c, x, w, y, part if split <= cfg.split_k else
                                torch.empty(split, 1, N, device=dev), counts, scratch) for w in ws]
                row["stream_grid"][f"n{bn}_s{split}"] = B.graph_time_us(fns)[0]
        best = min(row["stream_grid"].items(), key=lambda kv: kv[1])
        res["rows"].append(row)
        print(f"{K:>5}x{N:<5} floor {row['floor_us']:5.1f}  "
              + "  ".join(f"{a} {row['us'][a]:5.1f}" for a in arms + list(fix_arms))
              + f"   {cfg.block_n}x{cfg.block_k} split {cfg.split_k} depth {cfg.num_stages}"
              + f"   best stream grid {best[0]} {best[1]:5.1f}", flush=True)
    arms += list(fix_arms)
    tot = {a: sum(r["us"][a] for r in res["rows"]) for a in arms}
    res["sum_us"] = tot
    print("sum   floor {:5.1f}  ".format(sum(r["floor_us"] for r in res["rows"]))
          + "  ".join(f"{a} {tot[a]:5.1f}" for a in arms), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
