"""A/B of two versions of the attention kernels in one run (e.g. two commits).

Each arm is a folder holding copies of ``kernels/paged_decode.py`` and ``kernels/tree_attention.py``
(``git show REF:kernels/paged_decode.py > DIR/paged_decode.py``; in the tree kernel's copy, import from
``paged_decode`` instead of ``kernels.paged_decode``). Both arms run the same inputs: the issue's decode
cases, short single-sequence contexts (where the 8B step lives), and 16-node trees; each after a write
flush and a read flush of L2 (``bench_attention.FLUSH``). The arms' outputs are compared before timing.

    python bench/kernels/attn_ab.py --arm separate_merge=DIR_A --arm in_kernel_merge=DIR_B --out DIR

Its one use so far, ``bench/results/attn_merge_ab.json``: the split merge in a second launch (240d7cf)
against a merge by the last split to arrive, inside the kernel (f832fa0, reverted after this run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench.kernels.bench_attention as BA  # noqa: E402
from bench.kernels.attn_layout import caches  # noqa: E402

DECODE = [(1, 32768), (16, 4096), (64, 2048), (1, 4096), (1, 1024), (1, 512)]
TREE = [(1, 512), (1, 4096), (16, 2048)]  # (B, ctx), 16 nodes each


def load_arm(folder: str):
    """(paged_decode, tree_attention) modules from one arm's folder, under names of their own."""
    mods = []
    for name in ("paged_decode", "tree_attention"):
        spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # the tree copy imports `paged_decode`: this arm's
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", required=True, help="NAME=DIR, twice")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    arms = dict(a.split("=", 1) for a in args.arm)
    if len(arms) != 2:
        raise SystemExit("give two --arm NAME=DIR")
    mods = {name: load_arm(folder) for name, folder in arms.items()}
    (a_name, (PA, TA)), (b_name, (PB, TB)) = mods.items()

    gen = torch.Generator(device=BA.DEV).manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "copy_tbps": BA.copy_tbps(), "arms": arms, "decode": [],
           "tree": []}
    D, H = BA.D, BA.H
    for B, ctx in DECODE:
        layouts, bt, k, v = caches(B, ctx, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(B, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
        fns = {a_name: lambda: PA.paged_decode_attention(q, kc, vc, bt, lens, D**-0.5),
               b_name: lambda: PB.paged_decode_attention(q, kc, vc, bt, lens, D**-0.5)}
        diff = (fns[a_name]().float() - fns[b_name]().float()).abs().max().item()
        for mode in ("write", "read"):
            BA.FLUSH = mode
            row = {"B": B, "ctx": ctx, "flush": mode, "max_abs_diff": diff, "sdpa_us": BA.time_us(lambda: BA.sdpa(q[:, :, None], k, v))}
            row.update({f"{a}_us": BA.time_us(fn) for a, fn in fns.items()})
            res["decode"].append(row)
            a_us, b_us = row[f"{a_name}_us"], row[f"{b_name}_us"]
            print(f"decode B={B:3d} ctx={ctx:6d} {mode:5s}: {a_name} {a_us:6.1f}  {b_name} {b_us:6.1f} us"
                  f"  x{a_us / b_us:.3f}   SDPA/{b_name} {row['sdpa_us'] / b_us:.3f}  diff {diff:.1e}", flush=True)
    for B, ctx in TREE:
        n = 16
        layouts, bt, _, _ = caches(B, ctx + n, 16, gen)
        kc, vc = layouts["token_major"]
        q = torch.randn(B * n, H, D, device=BA.DEV, dtype=BA.DT, generator=gen)
        ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=BA.DEV)
        qs = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=BA.DEV)
        bits, _ = BA.tree_bits(BA.binary_tree(n))
        mask = torch.tensor(bits * B, dtype=torch.int64, device=BA.DEV)
        fns = {a_name: lambda: TA.tree_attention(q, kc, vc, bt, ctx_lens, qs, mask, D**-0.5),
               b_name: lambda: TB.tree_attention(q, kc, vc, bt, ctx_lens, qs, mask, D**-0.5)}
        diff = (fns[a_name]().float() - fns[b_name]().float()).abs().max().item()
        for mode in ("write", "read"):
            BA.FLUSH = mode
            row = {"B": B, "ctx": ctx, "nodes": n, "flush": mode, "max_abs_diff": diff}
            row.update({f"{a}_us": BA.time_us(fn) for a, fn in fns.items()})
            res["tree"].append(row)
            a_us, b_us = row[f"{a_name}_us"], row[f"{b_name}_us"]
            print(f"tree   B={B:3d} ctx={ctx:6d} {mode:5s}: {a_name} {a_us:6.1f}  {b_name} {b_us:6.1f} us"
                  f"  x{a_us / b_us:.3f}  diff {diff:.1e}", flush=True)
    with open(os.path.join(args.out, "attn_ab.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
