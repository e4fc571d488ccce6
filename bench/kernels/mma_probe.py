"""A/B of the INT4 MMA path's scale handling, in one run on one GPU.

Arm ``vector`` loads each K tile's scales and zero points as [BLOCK_N] vectors a trip ahead; they
arrive in a blocked layout and cross shared memory (two barriers per trip) to reach the accumulator's.
Arm ``dot`` (``SCALE_DOT``) lets them ride the dot pipeline as a [16, BLOCK_N] tile and brings them over
with two one-hot dots (see ``_int4_matmul_kernel``). Every MMA candidate of the tuner is timed in both
arms, and again with one more pipeline stage, on Llama-3-8B's four layer shapes, with CUDA graphs over
rotating weight copies (``bench_int4_matmul.graph_time_us``). Before timing, the ``dot`` arm passes
bench_int4_matmul's correctness cases (bf16 and fp16, every group size, zero points or none).

    python bench/kernels/mma_probe.py --out DIR [--ms 2,16,32,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench.kernels.bench_int4_matmul as B  # noqa: E402
from kernels import int4_matmul_triton as T  # noqa: E402

ARMS = {"vector": False, "dot": True}


def configs(M: int, K: int, N: int, sms: int, extra_stage: bool) -> list[T.KernelConfig]:
    base = [c for c in T._candidates(M, N, K, False, sms) if c.kind == "mma"]
    more = [dataclasses.replace(c, num_stages=c.num_stages + 1) for c in base] if extra_stage else []
    return base + more


def set_arm(scale_dot: bool) -> None:
    os.environ["SPECGATE_INT4_SCALE_DOT"] = "1" if scale_dot else "0"  # spawned compile workers too
    T.SCALE_DOT = scale_dot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default="2,16,32,64")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--no-extra-stage", action="store_true")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "commit": os.environ.get("BENCH_COMMIT", "unknown"), "torch": torch.__version__, "rows": []}
    jobs = [(M, K, N, c, torch.bfloat16) for M in ms for K, N in B.SHAPES
            for c in configs(M, K, N, sms, not args.no_extra_stage)]
    for arm, flag in ARMS.items():
        set_arm(flag)
        specs = B.correctness_specs() if flag else []
        res[f"failures_{arm}"] = B.precompile_and_check(jobs, specs, args.workers)
    res["copy_tbps"] = B.copy_tbps()
    weights = {}
    for K, N in B.SHAPES:
        copies = max(2, math.ceil(B.ROTATE_BYTES / (K * N // 2)))
        weights[(K, N)] = [B.rand_weight(N, K, torch.bfloat16) for _ in range(copies)]
    for M in ms:
        row = {"M": M, "shapes": {}}
        for K, N in B.SHAPES:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ws = weights[(K, N)]
            r = B.ref(x, ws[0])
            per = {arm: {} for arm in ARMS}
            for cfg in configs(M, K, N, sms, not args.no_extra_stage):
                for arm, flag in ARMS.items():  # interleaved: drift hits both arms alike
                    set_arm(flag)
                    fns = [lambda w=w, c=cfg: T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, B.G, config=c)
                           for w in ws]
                    try:
                        t, out = B.graph_time_us(fns)
                    except Exception as e:  # noqa: BLE001
                        print(f"  fail {arm} {cfg}: {str(e)[:200]}", flush=True)
                        continue
                    err = B.rel_err(out, r)
                    if not err < 1e-2:
                        print(f"  WRONG {arm} M={M} {K}x{N} {cfg}: {err:.2e}", flush=True)
                        continue
                    per[arm][str(cfg)] = round(t, 2)
            best = {arm: min(p.items(), key=lambda kv: kv[1]) for arm, p in per.items() if p}
            row["shapes"][f"{K}x{N}"] = {"best": {a: {"us": b[1], "config": b[0]} for a, b in best.items()},
                                         "all": per}
            print(f"M={M:3d} {K:5d}x{N:5d}: " + "  ".join(f"{a} {b[1]:6.2f} us" for a, b in best.items())
                  + "   " + "  |  ".join(f"{a}: {b[0]}" for a, b in best.items()), flush=True)
        for arm in ARMS:
            row[f"{arm}_us_per_layer"] = sum(s["best"][arm]["us"] for s in row["shapes"].values())
        res["rows"].append(row)
        with open(os.path.join(args.out, "mma_probe.json"), "w") as f:
            json.dump(res, f, indent=1)
    print(f"\ncopy {res['copy_tbps']:.2f} TB/s; failures {[res[f'failures_{a}'] for a in ARMS]}")
    print(f"{'M':>4} {'vector':>9} {'dot':>9} {'ratio':>6}   (us per layer, best config of each arm)")
    for row in res["rows"]:
        v, d = row["vector_us_per_layer"], row["dot_us_per_layer"]
        print(f"{row['M']:4d} {v:9.1f} {d:9.1f} {v / d:6.3f}")


if __name__ == "__main__":
    main()
