"""W4A16 matmul on Llama-3-8B's four layer shapes: ours vs torch's int4 kernel vs bf16 cuBLAS.

Runs on one CUDA GPU (torch 2.11 / 2.13, Triton 3.6). One call: compile every candidate config in
parallel, check correctness in bf16 and fp16 against the fp32 reference, then time with CUDA graphs
over rotating weight copies (each layer's weights are cold in L2, as in a real forward) and write
``int4_matmul.json``. No matplotlib here: ``plot_int4_matmul.py`` draws the PNG from the JSON.

    python bench/kernels/bench_int4_matmul.py --out bench/results --commit <sha>
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from kernels import int4_matmul_triton as T  # noqa: E402
from kernels import pdl as pdl_mod  # noqa: E402
from kernels.int4_matmul import Int4Weight, int4_matmul, int4_matmul_ref, quantize_rtn  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
G = 128
ROTATE_BYTES = 256 << 20  # weight copies per shape: every call reads its weights from HBM, not L2


def rand_weight(N: int, K: int, dtype: torch.dtype, device: str = "cuda") -> Int4Weight:
    """Random codes, scales and integer zero points (quantizing a random matrix costs minutes here)."""
    q = torch.randint(-(2**31), 2**31 - 1, (K // 8, N), dtype=torch.int32, device=device)
    s = (torch.rand(K // G, N, device=device) * 0.02 + 0.005).to(dtype)
    z = torch.randint(0, 16, (K // G, N), device=device).to(dtype)
    return Int4Weight(q, s, z, G)


def ref(x: torch.Tensor, w: Int4Weight, bias=None, residual=None) -> torch.Tensor:
    w32 = Int4Weight(w.qweight, w.scales.float(), None if w.zeros is None else w.zeros.float(), w.group_size)
    return int4_matmul_ref(x.float(), w32, None if bias is None else bias.float(),
                           None if residual is None else residual.float())


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    if y.isnan().any():
        return float("nan")
    return ((y.float() - r).norm() / r.norm()).item()


def sweep_jobs(ms: list[int]) -> list[tuple[int, int, int, T.KernelConfig]]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [(M, K, N, cfg) for M in ms for K, N in SHAPES for cfg in T._candidates(M, N, K, False, sms)]


def _compile_worker(jobs):
    """Run each (M, K, N, config) once: fills Triton's on-disk cache for the main process."""
    torch.cuda.set_device(0)
    errors = []
    for M, K, N, cfg, dtype in jobs:
        try:
            w = rand_weight(N, K, dtype)
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=cfg, whole_zeros=True)
        except Exception as e:  # noqa: BLE001 - report, keep compiling the rest
            errors.append(f"{M} {K}x{N} {cfg}: {type(e).__name__}: {str(e)[:300]}")
    torch.cuda.synchronize()
    return errors


def _worker(task) -> tuple[list[str], list[str]]:
    jobs, specs, pdl = task
    pdl_mod.ENABLED = pdl
    return _compile_worker(jobs), _correct_worker(specs)


def precompile_and_check(jobs, specs, workers: int) -> int:
    """Both phases compile, so they share one pool: 12 CPU cores instead of one."""
    t0 = time.time()
    tasks = [(jobs[i::workers], specs[i::workers], pdl_mod.ENABLED) for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_worker, tasks)
    errors = [e for p in parts for e in p[0]]
    lines = [ln for p in parts for ln in p[1]]
    print(f"compiled {len(jobs)} launches, checked {len(specs)} cases in {time.time() - t0:.0f} s", flush=True)
    for e in errors[:10]:
        print("  COMPILE ERROR", e, flush=True)
    for ln in lines:
        print(" ", ln, flush=True)
    return len(errors) + sum(ln.startswith("FAIL") for ln in lines)


def check_asm_order() -> bool:
    """The packed-pair asm puts word 0's code in the low half; check on a bare tensor (elementwise)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(q_ptr, o_ptr, J: tl.constexpr):
        offs = tl.arange(0, 16)[:, None] * 128 + tl.arange(0, 128)[None, :]
        tl.store(o_ptr + offs, T._codes_plus_magic(tl.load(q_ptr + offs), J, tl.bfloat16, True))

    q = torch.randint(-(2**31), 2**31 - 1, (16, 128), dtype=torch.int32, device="cuda")
    ok = True
    for j in range(8):
        o = torch.empty(16, 128, dtype=torch.bfloat16, device="cuda")
        k[(1,)](q, o, j)
        want = (((q.long() >> (4 * j)) & 0xF) + 128).to(torch.bfloat16)
        ok &= torch.equal(o, want)
    return ok


def correctness_specs() -> list[tuple]:
    """(dtype, M, N, K, G, zero points, mode): every path, both 16-bit dtypes, edge and real shapes."""
    bf, fp = torch.bfloat16, torch.float16
    specs = [(bf, M, N, K, 128, True, "configs") for M, K, N in [(1, 4096, 4096), (2, 4096, 28672), (4, 14336, 4096),
                                                                  (16, 4096, 6144), (64, 14336, 4096),
                                                                  (128, 4096, 4096), (256, 4096, 4096)]]
    for dt in (bf, fp):
        specs += [(dt, 3, 1000, 576, 64, True, "dispatch"), (dt, 17, 300, 4096, 32, True, "dispatch"),
                  (dt, 2, 4096, 4096, 128, False, "dispatch"), (dt, 40, 4096, 4096, 128, True, "dispatch"),
                  (dt, 1, 2048, 4096, 128, True, "silu"), (dt, 33, 2048, 4096, 128, True, "silu"),
                  (dt, 16, 4096, 4096, 128, True, "residual"), (dt, 300, 4096, 4096, 128, True, "dispatch")]
    specs += [(bf, 8, 4096, 4096, 128, True, "autotune"), (bf, 1, 4096, 4096, 128, True, "outlier"),
              (bf, 1, 4096, 14336, 128, False, "outlier"), (fp, 1, 4096, 4096, 32, True, "outlier")]
    return specs


def _correct_worker(specs) -> list[str]:
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for dtype, M, N, K, g, zp, mode in specs:
        T.set_autotune(mode == "autotune")
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
        w = quantize_rtn(torch.randn(N, K, device="cuda"), g, zp, dtype=dtype)
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        if mode == "outlier":  # one huge activation beside ordinary ones: hgemv's fp16 scaling must hold both
            x[:, 7] = 3e4 if dtype == torch.bfloat16 else 2e3  # (fp16: y must stay in range)
        bias = torch.randn(N, device="cuda", dtype=dtype)
        try:
            if mode == "silu":
                gate, up = ref(x, w).chunk(2, dim=-1)
                errs = {"silu": rel_err(T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, g, silu=True),
                                        F.silu(gate) * up)}
            elif mode == "residual":
                res = torch.randn(M, N, device="cuda", dtype=dtype)
                errs = {"residual": rel_err(int4_matmul(x, w, bias, residual=res), ref(x, w, bias, res))}
            else:
                r = ref(x, w, bias)
                errs = {"dispatch": rel_err(int4_matmul(x, w, bias), r)}
                if mode == "configs":
                    for cfg in T._candidates(M, N, K, False, sms):
                        errs[str(cfg)] = rel_err(T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, g, bias=bias,
                                                                      config=cfg, whole_zeros=True), r)
        except Exception as e:  # noqa: BLE001
            errs = {"exception": float("nan")}
            out.append(f"FAIL {dtype} M={M} N={N} K={K} G={g} zp={zp} {mode}: {type(e).__name__} {str(e)[:300]}")
        worst = max(math.inf if math.isnan(e) else e for e in errs.values())
        bad = [k for k, e in errs.items() if not e < tol]
        out.append(f"{'FAIL' if bad else 'ok  '} {str(dtype)[6:]} M={M} N={N} K={K} G={g} zp={zp} {mode}: "
                   f"worst rel err {worst:.1e} over {len(errs)}" + (f" bad: {bad}" if bad else ""))
    torch.cuda.synchronize()
    return out


def graph_time_us(fns: list, reps: int = 20) -> tuple[float, torch.Tensor]:
    """Capture one call per weight copy in a CUDA graph, replay, time with events. Also returns the
    first call's output as left by the last replay (checks that split-K counters reset)."""
    for fn in fns:  # warm: compile, allocate, tune
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn() for fn in fns]
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (reps * len(fns)))
    out = outs[0].clone() if isinstance(outs[0], torch.Tensor) else None
    del g, outs
    return sorted(times)[1], out


def copy_tbps() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return 2 * a.numel() / sorted(ts)[len(ts) // 2] / 1e12


def int4pack_weight(w: Int4Weight, inner_k_tiles: int = 8):
    """Our codes -> torch's tinygemm format: W = (q - 8) * scale + zero', zero' = (8 - z) * scale."""
    codes = ((w.qweight.long()[:, None, :] >> (4 * torch.arange(8, device="cuda")[None, :, None])) & 0xF)
    codes = codes.reshape(-1, w.qweight.shape[1]).T.contiguous()  # [N, K]
    packed_u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # torch >= 2.5 takes [N, K / 2] uint8
    packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, inner_k_tiles)
    s = w.scales.to(torch.bfloat16)
    zp = ((8 - w.zeros.float()) * w.scales.float()).to(torch.bfloat16)
    return packed, torch.stack([s, zp], dim=2).contiguous()  # [K / G, N, 2]


def timing(dtype: torch.dtype, results: dict, ms: list[int]) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights, dense, packs = {}, {}, {}
    for K, N in SHAPES:
        nbytes = K * N // 2
        copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
        weights[(K, N)] = [rand_weight(N, K, dtype) for _ in range(copies)]
        num_dense = max(1, math.ceil(ROTATE_BYTES / (2 * N * K)))
        dense[(K, N)] = [torch.randn(N, K, device="cuda", dtype=dtype) for _ in range(num_dense)]
        try:
            packs[(K, N)] = [int4pack_weight(w) for w in weights[(K, N)]]
        except Exception as e:  # noqa: BLE001
            packs[(K, N)] = None
            results.setdefault("errors", []).append(f"int4pack convert {K}x{N}: {e}")
    # torch's int4 kernel: correctness once
    if packs[SHAPES[1]] is not None:
        K, N = SHAPES[1]
        x = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
        p, sz = packs[(K, N)][0]
        y = torch.ops.aten._weight_int4pack_mm(x, p, G, sz)
        results["int4pack_rel_err"] = rel_err(y, ref(x, weights[(K, N)][0]))
        print(f"int4pack rel err vs ref: {results['int4pack_rel_err']:.2e}", flush=True)
    rows = []
    for M in ms:
        row = {"M": M, "shapes": {}}
        tot = {"ours": 0.0, "int4pack": 0.0, "cublas": 0.0, "dequant_cublas": 0.0}
        nbytes = 0
        for K, N in SHAPES:
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            ws = weights[(K, N)]
            per = {}
            r = ref(x, ws[0])
            for cfg in T._candidates(M, N, K, False, sms):
                fns = [lambda w=w, c=cfg: T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=c,
                                                               whole_zeros=True)  # rand_weight's zero points
                       for w in ws]
                try:
                    per[cfg], out = graph_time_us(fns)
                    e = rel_err(out, r)
                    results["graph_max_rel_err"] = max(results.get("graph_max_rel_err", 0.0), e)
                    if not e < 1e-2:
                        print(f"  WRONG after graph replay: M={M} {K}x{N} {cfg}: {e:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  time fail {cfg}: {e}", flush=True)
            if not per:
                continue
            best = min(per, key=per.get)
            fns = [lambda w=w: T.dequantize_triton(w.qweight, w.scales, w.zeros, G, dtype) for w in ws[:4]]
            dq = graph_time_us(fns)[0]
            cb = graph_time_us([lambda d=d: F.linear(x, d) for d in dense[(K, N)]])[0]
            i4 = float("nan")
            if packs[(K, N)] is not None and dtype == torch.bfloat16:
                try:
                    i4 = graph_time_us([lambda p=p: torch.ops.aten._weight_int4pack_mm(x, p[0], G, p[1])
                                        for p in packs[(K, N)]])[0]
                except Exception as e:  # noqa: BLE001
                    results.setdefault("errors", []).append(f"int4pack mm M={M} {K}x{N}: {str(e)[:200]}")
            row["shapes"][f"{K}x{N}"] = {
                "us": per[best], "config": str(best), "dequant_us": dq, "cublas_us": cb, "int4pack_us": i4,
                "all": {str(c): round(t, 2) for c, t in sorted(per.items(), key=lambda kv: kv[1])},
            }
            tot["ours"] += per[best]
            tot["int4pack"] += i4
            tot["cublas"] += cb
            tot["dequant_cublas"] += dq + cb
            nbytes += K * N // 2 + 2 * (K // G) * N * 2 + M * K * 2 + M * N * 2
            print(f"M={M:4d} {K:5d}x{N:5d}: ours {per[best]:7.2f} us {best}  dequant {dq:6.1f}  cublas {cb:6.1f}"
                  f"  int4pack {i4:6.1f}", flush=True)
        row.update(us_per_layer=tot["ours"], tbps=nbytes / tot["ours"] / 1e6, int4pack_us_per_layer=tot["int4pack"],
                   cublas_us_per_layer=tot["cublas"], dequant_cublas_us_per_layer=tot["dequant_cublas"])
        row["pct_copy"] = 100 * row["tbps"] / results["copy_tbps"]
        rows.append(row)
        results["rows"] = rows
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT", "unknown"))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="rows M to time (a subset for quick runs)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    results = {"device": props.name, "date": datetime.date.today().isoformat(), "commit": args.commit,
               "torch": torch.__version__, "sms": props.multi_processor_count}
    print(results, flush=True)
    ms = [int(m) for m in args.ms.split(",")]
    pdl_mod.ENABLED = results["pdl"] = not args.no_pdl
    jobs = [(M, K, N, cfg, torch.bfloat16) for M, K, N, cfg in sweep_jobs(ms)]
    specs = [] if args.skip_correctness else correctness_specs()
    results["failures"] = precompile_and_check(jobs, specs, args.workers)
    results["asm_pair_order_ok"] = check_asm_order()
    print("asm pair order ok:", results["asm_pair_order_ok"], "failures:", results["failures"], flush=True)
    results["copy_tbps"] = copy_tbps()
    print(f"copy: {results['copy_tbps']:.2f} TB/s", flush=True)
    path = os.path.join(args.out, "int4_matmul.json")
    try:
        timing(torch.bfloat16, results, ms)
    finally:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    if "rows" not in results:
        return
    print("max rel err after graph replay:", results.get("graph_max_rel_err"))
    print(f"\n{'M':>4} {'us/layer':>9} {'TB/s':>6} {'%copy':>6} {'int4pack':>9} {'cuBLAS':>8} {'dq+cuBLAS':>10}")
    for r in results["rows"]:
        print(f"{r['M']:4d} {r['us_per_layer']:9.1f} {r['tbps']:6.2f} {r['pct_copy']:6.1f} "
              f"{r['int4pack_us_per_layer']:9.1f} {r['cublas_us_per_layer']:8.1f} "
              f"{r['dequant_cublas_us_per_layer']:10.1f}")
    for r in results["rows"]:
        print(r["M"], {k: v["config"] for k, v in r["shapes"].items()})
    print("wrote", path)


if __name__ == "__main__":
    main()
