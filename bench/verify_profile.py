"""Where a small target's verify step spends more than its decode step, per kernel (lent GPU).

On the real pair (SmolLM2-135M INT4, bench/results/engine_real_h100_2485e10.json) a step that verifies a
one-level draft costs 1.28x a plain step at batch 1 and 1.54x at batch 16, so a drafter must keep 0.28 /
0.54 extra tokens a step just to break even. This bench splits that price on the device: random weights in
SmolLM2's shape (INT4 g32 with fractional zero points, the embedded GGUF's Q4_1 form), B sequences of
``--context`` cached tokens each verifying a binary tree of N nodes, replayed from a CUDA graph. For every
(B, N) it reports the step's wall time and, from torch.profiler over the replays, device time and launches
per kernel name; the table printed last is each kernel's microseconds against the N = 1 step of the same B.

    python bench/verify_profile.py --batches 1,16 --nodes 1,2,4,8 --out $OUT/verify_profile.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import provenance  # noqa: E402  (bench/, this script's own folder)
from engine import _sync, binary_tree, random_model  # noqa: E402  (bench/engine.py)
from target.batch import Segment, build_batch  # noqa: E402
from target.config import ModelConfig  # noqa: E402
from target.graphs import CudaGraphRunner  # noqa: E402
from target.model import Transformer  # noqa: E402

DEVICE = "cuda"  # --device cpu: a smoke run of the script itself (no kernel profile there)
KERNELS = True  # --no-kernels: no torch.profiler session (it slows every graph launch after it: main)
DUMP: Path | None = None  # --dump DIR: each captured graph as a DOT file, and its census in the row
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
               num_kv_heads=3, head_dim=64)


def smollm2_int4(group: int = 32, seed: int = 0) -> Transformer:
    """Random weights in SmolLM2-135M's shape, INT4 with fractional zero points (the factored path the
    embedded Q4_1 weights take), tied bf16 embedding / LM head."""
    cfg = ModelConfig(family="llama", rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                      eos_token_ids=(0,), tie_word_embeddings=True, **SMOLLM2)
    return random_model(cfg, True, seed, group, zeros=True, device=DEVICE)[0]


def verify_step(model: Transformer, B: int, nodes: int, context: int):
    """A replayable step: ``B`` sequences of ``context`` cached tokens, each verifying a binary tree of
    ``nodes`` nodes (N = 1: a plain decode step), the way the engine lays out a verify batch. Returns the step,
    its graph's replay and input load, and with ``--dump`` the graph's census (``graph_census``)."""
    cache = model.new_cache(B * (context // 16 + 8), 16)
    runner = CudaGraphRunner(model, cache, max_blocks=context // 16 + 8, buckets=(B, 2 * B), shared_logits=True)
    tables = [cache.new_table() for _ in range(B)]
    for t in tables:
        model.forward(build_batch([Segment(t, 0, list(range(context)), logits="none")], cache, DEVICE), cache)
    depths, bits = binary_tree(nodes)
    segs = [Segment(t, context, [7 + b] * nodes, positions=[context + d for d in depths],
                    mask_bits=bits if nodes > 1 else None, logits="all") for b, t in enumerate(tables)]
    batch = build_batch(segs, cache, DEVICE)
    if DEVICE != "cuda":
        return lambda: model.forward(batch, cache), (None, None), None
    run = lambda: runner.forward(batch, cache)  # noqa: E731
    runner.debug = DUMP is not None
    run()  # captures the graph
    g = runner._graphs[runner._key(batch, cache)]
    census = None
    if DUMP is not None:
        path = DUMP / f"graph_b{B}_n{nodes}.dot"
        g.graph.debug_dump(str(path))
        census = graph_census(path.read_text())
    load = lambda: g.load(batch, cache.scratch_block, cache.page_size)  # noqa: E731
    return run, (g.graph.replay, load), census


def graph_census(dot: str) -> dict:
    """What a CUDA graph's DOT dump (``CUDAGraph.debug_dump``) holds: its nodes by type (KERNEL, MEMCPY,
    MEMSET, HOST, ...), its edges by label (unlabelled: ``plain``), and how many nodes name each kernel."""
    nodes: dict[str, int] = {}
    edges: dict[str, int] = {}
    kernels: dict[str, int] = {}
    types = "KERNEL|MEMCPY|MEMSET|HOST|EMPTY|WAIT_EVENT|EVENT_RECORD|MEM_ALLOC|MEM_FREE|BATCH_MEM_OP|CONDITIONAL|GRAPH"
    for m in re.finditer(r'^"[^"]+"\s*\[(.*?)\]\s*;?\s*$', dot, re.M | re.S):
        body = m.group(1)
        kind = re.search(rf"\b({types})\b", body)
        key = kind.group(1) if kind else "?"
        nodes[key] = nodes.get(key, 0) + 1
        name = re.search(r"\b(\w*_kernel\w*)", body)
        if key == "KERNEL" and name:
            kernels[name.group(1)] = kernels.get(name.group(1), 0) + 1
    for m in re.finditer(r'^"[^"]+"\s*->\s*"[^"]+"(.*)$', dot, re.M):
        lab = re.search(r'label="([^"]*)"', m.group(1))
        key = lab.group(1) if lab and lab.group(1) else "plain"
        edges[key] = edges.get(key, 0) + 1
    return {"nodes": nodes, "edges": edges, "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def exposed(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Exposed time per kernel name: how far each kernel moved the stream's end, max(0, its end - the latest
    end of any kernel that started before it). Under PDL a kernel starts while the one ahead runs, so its own
    duration overstates what it costs; exposed times sum to the span from the first start to the last end,
    and an idle gap counts to the kernel after it."""
    out: dict[str, float] = {}
    spans = sorted(spans)
    last = spans[0][0] if spans else 0.0
    for start, end, name in spans:
        out[name] = out.get(name, 0.0) + max(0.0, end - last)
        last = max(last, end)
    return out


def _median_us(run, reps: int, synced: bool = True) -> float:
    """Median microseconds of ``run()``: to the end of its device work (``synced``), or until it returns."""
    times = []
    for _ in range(reps):
        _sync(DEVICE)
        t0 = time.perf_counter()
        run()
        if synced:
            _sync(DEVICE)
        times.append(time.perf_counter() - t0)
    _sync(DEVICE)
    return round(sorted(times)[reps // 2] * 1e6, 1)


def timing(run, parts: tuple, reps: int) -> dict:
    """Median synchronised wall time of one step (inputs copied in, graph replayed), the host time until that
    call returns, the host time of its two parts (the input copies, the replay's launch) and the synchronised
    wall of the replay alone. Call it before any ``kernel_profile`` in the process (see KERNELS)."""
    replay, load = parts
    for _ in range(5):
        run()
    walls = []
    for _ in range(reps):
        _sync(DEVICE)
        t0 = time.perf_counter()
        run()
        _sync(DEVICE)
        walls.append(time.perf_counter() - t0)
    out = {"wall_us": round(sorted(walls)[reps // 2] * 1e6, 1), "host_us": _median_us(run, reps, synced=False)}
    if replay is not None:
        out["load_host_us"] = _median_us(load, reps, synced=False)
        out["launch_host_us"] = _median_us(replay, reps, synced=False)
        out["replay_wall_us"] = _median_us(replay, reps)
    return out


def kernel_profile(run, reps: int) -> dict:
    """Per-kernel device time, exposed time and launches per step over ``reps`` back-to-back steps
    (torch.profiler; none on the CPU)."""
    if DEVICE != "cuda":
        return {"kernel_us": 0.0, "exposed_us": 0.0, "launches": 0, "kernels": {}}
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        _sync(DEVICE)
    per_name: dict[str, list[float]] = {}
    spans = []  # (start, end, name) of every kernel, in device microseconds
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            agg = per_name.setdefault(e.name[:60], [0.0, 0.0, 0.0])
            agg[0] += e.device_time_total / reps
            agg[1] += 1 / reps
            spans.append((e.time_range.start, e.time_range.end, e.name[:60]))
    for name, us in exposed(spans).items():
        per_name[name][2] = us / reps
    return {"kernel_us": round(sum(v[0] for v in per_name.values()), 1),
            "exposed_us": round(sum(v[2] for v in per_name.values()), 1),
            "launches": round(sum(v[1] for v in per_name.values())),
            "kernels": {k: {"us": round(v[0], 1), "exposed_us": round(v[2], 1), "per_step": round(v[1], 1)}
                        for k, v in sorted(per_name.items(), key=lambda kv: -kv[1][2])}}


def launch_probe(model: Transformer, context: int, reps: int) -> list[dict]:
    """Is a graph's launch cost tied to its capture order? Graphs of 1, 2 and 4 nodes at batch 1, each in its
    own runner, captured in that order: host time of a launch and synchronised wall of a replay for each;
    then again after the first graph is freed; then after a fresh 1-node graph is captured."""
    import gc

    steps: dict[str, tuple] = {}
    out: list[dict] = []

    def measure(phase: str) -> None:
        for name, (run, (replay, _)) in steps.items():
            row = {"phase": phase, "graph": name, "launch_host_us": _median_us(replay, reps, synced=False),
                   "replay_wall_us": _median_us(replay, reps)}
            out.append(row)
            print(f"{phase:28s} {name:10s} launch {row['launch_host_us']:7.1f} us  replay {row['replay_wall_us']:8.1f}",
                  flush=True)

    for n in (1, 2, 4):
        steps[f"{n} nodes"] = verify_step(model, 1, n, context)[:2]
    measure("captured 1, 2, 4")
    del steps["1 nodes"]
    gc.collect()
    _sync(DEVICE)
    measure("the first freed")
    steps["1 node (new)"] = verify_step(model, 1, 1, context)[:2]
    measure("a new 1-node graph captured")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--nodes", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_layers"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-kernels", action="store_true", help="time only: no per-kernel profile")
    ap.add_argument("--launch-probe", action="store_true", help="only the capture-order probe (launch_probe)")
    ap.add_argument("--dump", help="write each captured graph's DOT file here, and its census into its row")
    args = ap.parse_args()
    global DEVICE, DUMP, KERNELS
    DEVICE, KERNELS = args.device, not args.no_kernels
    if args.dump and DEVICE == "cuda":
        DUMP = Path(args.dump)
        DUMP.mkdir(parents=True, exist_ok=True)
    SMOLLM2["num_layers"] = args.layers
    model = smollm2_int4()
    res = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
           "commit": provenance.commit(), "torch": torch.__version__, "context": args.context, "rows": []}
    if args.launch_probe:
        if DEVICE != "cuda":
            raise SystemExit("--launch-probe times CUDA graph launches: it needs --device cuda")
        res["launch_probe"] = launch_probe(model, args.context, args.reps)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    # Every row is timed before the first profiler session: after one, each graph launch in the process cost
    # ~60 us of host time instead of ~7 on a lent H100, and replays ran slower (verify_load_h100.json).
    steps = []
    for B in map(int, args.batches.split(",")):
        for n in map(int, args.nodes.split(",")):
            run, parts, census = verify_step(model, B, n, args.context)
            row = {"batch": B, "nodes": n, **timing(run, parts, args.reps)}
            if census is not None:
                row["graph"] = census
                print(f"B={B} N={n} graph: {row['graph']['nodes']} edges {row['graph']['edges']}", flush=True)
            res["rows"].append(row)
            steps.append(run)
            print(f"B={B:3d} N={n:2d} wall {row['wall_us']:8.1f} us  host {row['host_us']:7.1f} (copies "
                  f"{row.get('load_host_us', 0):6.1f}, launch {row.get('launch_host_us', 0):6.1f})  replay alone "
                  f"{row.get('replay_wall_us', 0):8.1f}", flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    for row, run in zip(res["rows"], steps):
        row.update(kernel_profile(run, args.reps) if KERNELS else
                   {"kernel_us": 0.0, "exposed_us": 0.0, "launches": 0, "kernels": {}})
        print(f"B={row['batch']:3d} N={row['nodes']:2d} kernels {row['kernel_us']:8.1f} us  exposed "
              f"{row['exposed_us']:8.1f}  launches {row['launches']}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    if DEVICE == "cuda":  # the INT4 tuner's pick per (M, N, K, silu): which path each row count took
        from kernels import int4_matmul_triton as T
        res["int4_configs"] = {str(k[:3] + k[7:8]): str(v) for k, v in T._CONFIG_CACHE.items()}
        Path(args.out).write_text(json.dumps(res, indent=1))
    print("\nexposed kernel us per step (how far each moved the stream's end), and its change against N = 1")
    for B in sorted({r["batch"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["batch"] == B]
        names = sorted({k for r in rows for k in r["kernels"]},
                       key=lambda k: -max(r["kernels"].get(k, {"exposed_us": 0})["exposed_us"] for r in rows))
        print(f"B={B}: " + " ".join(f"N={r['nodes']:>8d}" for r in rows))
        for k in names[:14]:
            base = rows[0]["kernels"].get(k, {"exposed_us": 0.0})["exposed_us"]
            cells = [r["kernels"].get(k, {"exposed_us": 0.0})["exposed_us"] for r in rows]
            print(f"  {k[:44]:44s} " + " ".join(f"{c:7.1f}{'' if i == 0 else f'({c - base:+.0f})'}"
                                                for i, c in enumerate(cells)))
        print(f"  {'wall':44s} " + " ".join(f"{r['wall_us']:7.1f}" for r in rows))


if __name__ == "__main__":
    main()
