"""The engine on the GPU, measured in one run against its floor and against HF transformers.

    python bench/engine.py [--synthetic] [--real MODEL] [--draft DIR] [--out bench/results/engine.json]

1. Synthetic large pair (random weights, nothing to download): the target has Llama-3-8B's shape in
   INT4 g128, the draft Llama-3.2-1B's shape in bf16 and again in INT4 g128. Step times are CUDA-graph replays through
   ``target/graphs.py`` (the engine's path), input copies included; the floor is the INT4 weights plus
   the bf16 lm_head read once at the copy bandwidth measured here. HF transformers generates on the same
   8B shape in bf16 with a static cache, and our engine decodes plainly on the INT4 target.
2. Real pair: ``--real`` (SmolLM2-135M-Instruct GGUF or HF dir) with ``--draft``, batch 1/4/16/64, speculation
   on and off, greedy, MT-bench first turns; HF static-cache generate and HF assisted generation
   (``assistant_model``, batch 1 only: HF supports no more) on the same pair in bf16.

Every ratio in the output is taken within this one run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import provenance  # noqa: E402  (bench/, this script's own folder)
from drafters import NGRAM_ALONE, select_arm  # noqa: E402  (the ngram-alone arm, as bench/drafters.py runs it)
from bench.kernels.bench_int4_matmul import copy_tbps  # noqa: E402  (the same probe as the kernel bench)
from draft.params import SpeculationParams  # noqa: E402
from gateway.budget import SpecGate  # noqa: E402
from gateway.engine import Engine, EngineConfig  # noqa: E402
from gateway.llm import LLM, LoadConfig, resolve_draft, resolve_model_path  # noqa: E402
from gateway.scheduler import SchedulerConfig  # noqa: E402
from kernels import invariant  # noqa: E402
from kernels.int4_matmul import Int4Weight  # noqa: E402
from target.batch import Segment, build_batch  # noqa: E402
from target.config import ModelConfig  # noqa: E402
from target.graphs import CudaGraphRunner  # noqa: E402
from target.model import Layer, Linear, Transformer, int4_linear  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402

MT_BENCH = HERE.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl"
# The default drafter with the budget aimed at tokens per second over the batch, as a server's (LLM.generate's
# batch_completion off): against "on", the batch-end objective's A/B within one run.
PER_TOKEN = "per-token"
# plain decoding / the default speculation stepped one by one (EngineConfig.overlap off), where "on" and "off"
# run as the engine does by default (on CUDA each plain step launched before the last one's tokens reach the
# host): their "speedup" is over that "off"
STEPPED_ARMS = {"off-stepped": SpeculationParams(enabled=False), "on-stepped": SpeculationParams()}
# Speculation at steady state: a request that fixes its tree keeps it whatever the gate's arm or the budget's
# depth caps (gateway/budget.py SpecGate), so these arms time speculative steps as such -- what each step costs
# against an overlapped plain one, and what it accepts -- where the default arm runs whatever the gate picked.
FIXED_ARMS = {"ngram-chain4": SpeculationParams(drafter="ngram", tree=(1, 1, 1, 1)),
              "draft-2221": SpeculationParams(drafter="draft", tree=(2, 2, 2, 1))}
# EngineConfig.chain_ahead on (gateway/chain_ahead.py): the n-gram chain's drafted steps overlapped, at steady
# state, and the default speculation under the gate with them
AHEAD_ARMS = {"ngram-chain4-ahead": SpeculationParams(drafter="ngram", tree=(1, 1, 1, 1)),
              "on-ahead": SpeculationParams()}
# The default speculation with the budget's acceptance cut at another BudgetConfig.min_gain ("on-gain0.2": the
# default before 2026-12-07), the default's A/B within one run
GAIN_ARM = "on-gain"
# The default speculation under a gate that chooses no drafter (the default before 1645c02: requests draft with the
# default drafter, n-grams for the embedded pair, and the gate runs that against plain decoding), its own gate
# fresh for the arm, within one run of the default's
GATE_NGRAM = "on-gate-ngram"
# The default speculation with EngineConfig.chain_ahead on under a fresh gate of the default's drafters: the gate
# measures n-grams as overlapped chains, from the arm's first step (its learning cost inside the timed calls)
AHEAD_FRESH = "on-ahead-fresh"
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 intermediate_size=14336, tie_word_embeddings=False)
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                  intermediate_size=8192, tie_word_embeddings=True)
NODES = (1, 2, 4, 8, 16, 32, 64)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_config(shape: dict) -> ModelConfig:
    return ModelConfig(family="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                       eos_token_ids=(0,), **shape)


def random_model(cfg: ModelConfig, int4: bool, seed: int = 0, group: int = 128, zeros: bool = False,
                 device: str = "cuda") -> tuple[Transformer, int]:
    """A model of ``cfg``'s shape with random weights on ``device``, and the bytes a decode step must read.
    ``zeros``: INT4 weights get fractional zero points (GGUF Q4_1's form: the kernels' factored path)."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf = dict(dtype=torch.bfloat16, device=device)
    hid, D, H, Hkv, I = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    nbytes = 0

    def lin(n: int, k: int) -> Linear:
        nonlocal nbytes
        if not int4:
            w = torch.randn(n, k, generator=g, **bf) * k**-0.5
            nbytes += w.numel() * 2
            return Linear(w)
        q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, dtype=torch.int32, device=device)
        s = torch.rand(k // group, n, generator=g, **bf) * (0.2 * k**-0.5)
        z = torch.rand(k // group, n, generator=g, **bf) * 15 if zeros else None
        nbytes += q.numel() * 4 + s.numel() * (4 if zeros else 2)
        return int4_linear(Int4Weight(q, s, z, group))

    layers = [Layer(input_norm=torch.ones(hid, **bf), qkv=lin((H + 2 * Hkv) * D, hid), o=lin(hid, H * D),
                    post_norm=torch.ones(hid, **bf), gate_up=lin(2 * I, hid), down=lin(hid, I))
              for _ in range(cfg.num_layers)]
    embed = torch.randn(cfg.vocab_size, hid, generator=g, **bf) * 0.02
    head = embed if cfg.tie_word_embeddings else torch.randn(cfg.vocab_size, hid, generator=g, **bf) * 0.02
    nbytes += head.numel() * 2
    return Transformer(cfg, embed, layers, torch.ones(hid, **bf), Linear(head), torch.bfloat16), nbytes


def tree_step(model: Transformer, nodes: int, context: int = 512):
    """A replayable step of one sequence with a tree of ``nodes`` (a binary tree's bitmask) over
    ``context`` cached tokens: a callable that replays the graph, input copies included."""
    cache = model.new_cache(context // 16 + 8, 16)
    # bucket 2: a tree of a count that is no power of two pads into a spare segment (target/graphs.py)
    runner = CudaGraphRunner(model, cache, max_blocks=context // 16 + 8, buckets=(1, 2))
    table = cache.new_table()
    model.forward(build_batch([Segment(table, 0, list(range(context)), logits="none")], cache, "cuda"), cache)
    depths, bits = binary_tree(nodes)
    batch = build_batch([Segment(table, context, [7] * nodes, positions=[context + d for d in depths],
                                 mask_bits=bits if nodes > 1 else None, logits="all")], cache, "cuda")
    return lambda: runner.forward(batch, cache)


def binary_tree(nodes: int) -> tuple[list[int], list[int]]:
    """Depths and ancestor bits (int64, the target's mask format) of a binary tree of ``nodes`` nodes."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    depths, bits = [0], [1]
    for i in range(1, nodes):
        depths.append(depths[parents[i]] + 1)
        bits.append(bits[parents[i]] | (1 << i))
    return depths, [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # two's complement for node 63


def step_ms(model: Transformer, nodes: list[int], context: int = 512, reps: int = 40) -> dict[int, float]:
    """Median wall time of one replayed step (``tree_step``) per tree size, synchronised before and after.
    Sizes are timed round-robin, so drift over the run (clocks, a neighbour) hits every size alike and
    the ratios between them hold (verify-16 against M=1 moved by up to 8% between back-to-back runs
    when each size was timed in one stretch)."""
    return replay_ms({n: tree_step(model, n, context) for n in nodes}, reps)


def replay_ms(runs: dict, reps: int = 40) -> dict:
    """Median wall time in ms of each replayable ``runs[key]()``, synchronised before and after, timed
    round-robin after three warm-up rounds."""
    times: dict = {key: [] for key in runs}
    for i in range(reps + 3):
        for key, run in runs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            if i >= 3:
                times[key].append(time.perf_counter() - t0)
    return {key: sorted(t)[reps // 2] * 1e3 for key, t in times.items()}


def kernel_profile(model: Transformer, nodes: int, reps: int = 10, top: int = 12) -> dict:
    """Where a replayed step's device time goes: per kernel name, microseconds per step and launches
    per step (torch.profiler over ``reps`` graph replays), the sum of kernel time, and the step's
    wall time in the same window; their difference is time the GPU sat idle between kernels."""
    from torch.profiler import ProfilerActivity, profile

    run = tree_step(model, nodes)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
    per_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            agg = per_name.setdefault(e.name[:80], [0.0, 0])
            agg[0] += e.device_time_total / reps
            agg[1] += 1 / reps
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    busy = sum(v[0] for _, v in rows)
    return {"nodes": nodes, "wall_us": round(wall * 1e6, 1), "kernel_us": round(busy, 1),
            "launches": round(sum(v[1] for _, v in rows)),
            "kernels": [{"name": k, "us": round(v[0], 1), "per_step": round(v[1], 1)} for k, v in rows[:top]]}


def engine_tok_s(model: Transformer, new_tokens: int = 128) -> float:
    """Plain decoding through the Engine, batch 1: tokens per second after the first token."""
    eng = Engine(model, {}, EngineConfig(num_blocks=64, page_size=16, scheduler=SchedulerConfig(max_model_len=1024)))
    s = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for rid in ("warm", "timed"):
        eng.add(rid, list(range(100, 132)), s, SpeculationParams(enabled=False))
        t0, first, n = 0.0, None, 0
        while eng.has_work():
            for out in eng.step():
                n += len(out.new_token_ids)
                if first is None and out.new_token_ids:
                    torch.cuda.synchronize()
                    first, t0 = n, time.perf_counter()
        torch.cuda.synchronize()
    return (n - first) / (time.perf_counter() - t0)


def hf_static_tok_s(hf_model, input_ids: torch.Tensor, new_tokens: int) -> float:
    """HF generate with a static cache, greedy: tokens per second over the whole call (batch included)."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    # the warm-up has the timed call's exact shapes: a static cache sized for another length would
    # make the timed call set up (or compile) again
    hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw)
    torch.cuda.synchronize()
    return (out.shape[1] - input_ids.shape[1]) * input_ids.shape[0] / (time.perf_counter() - t0)


def synthetic(res: dict, verify_only: bool = False, profile: bool = False) -> None:
    target, tbytes = random_model(model_config(LLAMA3_8B), int4=True)
    res["floor_ms"] = round(tbytes / (res["copy_tbps"] * 1e12) * 1e3, 3)
    res["target_bytes"] = tbytes
    verify = {str(n): round(ms, 3) for n, ms in step_ms(target, NODES).items()}
    res["step_ms_m1"], res["verify_ms"] = verify["1"], verify
    log(f"8B INT4: floor {res['floor_ms']} ms, step {verify}")
    from kernels import int4_matmul_triton as T

    # the INT4 config the tuner chose per (M bucket, N, K, silu): a bad pick shows here first
    res["int4_configs"] = {str(k[:3] + k[7:8]): str(v) for k, v in T._CONFIG_CACHE.items()}
    for k, v in res["int4_configs"].items():
        log(f"  int4 {k}: {v}")
    if not verify_only:
        timed_peers(res, target)
    if profile:  # last: after a torch.profiler session every graph launch in the process costs more (verify_profile)
        res["kernel_profile"] = [kernel_profile(target, n) for n in (1, 16)]
        for p in res["kernel_profile"]:
            log(f"N={p['nodes']}: wall {p['wall_us']} us, kernels {p['kernel_us']} us, {p['launches']} launches")
            for k in p["kernels"]:
                log(f"  {k['us']:8.1f} us  x{k['per_step']:<5} {k['name']}")


def timed_peers(res: dict, target: Transformer) -> None:
    """The 8B target's plain decoding in the engine, the 1B draft's step, the projection, and HF's static-cache
    generate on the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    res["engine_nospec_8b_tok_s"] = round(engine_tok_s(target), 1)
    verify = res["verify_ms"]
    draft, _ = random_model(model_config(LLAMA32_1B), int4=False, seed=1)
    res["draft_step_ms"] = round(step_ms(draft, [1])[1], 3)
    res["draft_to_target_step"] = round(res["draft_step_ms"] / res["step_ms_m1"], 3)
    del draft
    gc.collect()
    torch.cuda.empty_cache()
    # The same draft quantized as the target is (INT4 g128 layers, its tied bf16 embedding as the head): a
    # draft for an INT4 target is served the same way, and its layers' weights are 4x smaller. The bf16
    # figure stays the schema's draft_step_ms; this one is the draft a deployment would run.
    draft, dbytes = random_model(model_config(LLAMA32_1B), int4=True, seed=1)
    res["draft_int4_step_ms"] = round(step_ms(draft, [1])[1], 3)
    res["draft_int4_floor_ms"] = round(dbytes / (res["copy_tbps"] * 1e12) * 1e3, 3)
    res["draft_int4_to_target_step"] = round(res["draft_int4_step_ms"] / res["step_ms_m1"], 3)
    log(f"1B draft step: bf16 {res['draft_step_ms']} ms, INT4 {res['draft_int4_step_ms']} ms "
        f"(floor {res['draft_int4_floor_ms']}), {res['draft_int4_to_target_step']} of the target's")
    del draft
    gc.collect()
    torch.cuda.empty_cache()
    # projected speculative tokens/s: L tokens per (verify of a 16-node tree + 4 draft levels)
    cycle = verify["16"] + 4 * res["draft_step_ms"]
    res["projected_tok_s"] = {str(L): round(L / cycle * 1e3, 1) for L in range(1, 7)}
    cycle = verify["16"] + 4 * res["draft_int4_step_ms"]
    res["projected_tok_s_int4_draft"] = {str(L): round(L / cycle * 1e3, 1) for L in range(1, 7)}
    c = LLAMA3_8B
    hf_cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_layers"],
                         num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"],
                         intermediate_size=c["intermediate_size"], max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(100, 1000, (1, 32), device="cuda")
    res["hf_static_8b_tok_s"] = round(hf_static_tok_s(hf, ids, 128), 1)
    res["engine_vs_hf_static_8b"] = round(res["engine_nospec_8b_tok_s"] / res["hf_static_8b_tok_s"], 2)
    log(f"8B: engine {res['engine_nospec_8b_tok_s']} tok/s, HF static {res['hf_static_8b_tok_s']} tok/s")
    del hf
    gc.collect()
    torch.cuda.empty_cache()


_TRITON_COMPILED: list[str] = []  # every kernel Triton compiled since the hook went in, in order


def _count_compile(**kw) -> bool:
    """Triton's JIT cache hook: called before each compile (a new specialisation of a kernel: new constexprs,
    an int argument turning 1 or divisible by 16, a pointer's 16-byte alignment changing), which takes a few
    hundred milliseconds on the host. Records the kernel's name; returns False: compile as usual."""
    _TRITON_COMPILED.append(str(kw.get("repr", "?")).split("[")[0])
    return False


def first_use_counts(llm: LLM) -> dict[str, int]:
    """Counters of the work a timed call should not do: eager forwards (a step no graph holds), graphs
    captured so far (a capture mid-call stalls every stream), INT4 configs chosen so far (each new M bucket
    is timed once, eagerly, or taken from the tune file), Triton kernels compiled so far. Their change across a timed call says which of
    these it paid for."""
    import triton
    from kernels import int4_matmul_triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and knobs.runtime.jit_cache_hook is None:
        knobs.runtime.jit_cache_hook = _count_compile
    out = {"int4_configs_tuned": len(int4_matmul_triton._CONFIG_CACHE), "triton_compiles": len(_TRITON_COMPILED)}
    runners = {"target": llm.engine.graphs} | {name: getattr(d, "graphs", None) for name, d in llm.engine.drafters.items()}
    for name, runner in runners.items():
        if runner is not None:
            out[f"{name}_eager"] = runner.eager
            out[f"{name}_graphs"] = len(runner._graphs)
    for name, d in llm.engine.drafters.items():
        loop = getattr(d, "loop", None)
        if loop is not None and getattr(loop, "_graphs", None) is not None:
            out[f"{name}_loop_graphs"] = len(loop._graphs)
    return out


def generate_tok_s(llm: LLM, groups: list[list[str]], sampling: SamplingParams, spec: SpeculationParams,
                   counts: dict | None = None, batch_completion: bool = True,
                   tokens: list | None = None) -> tuple[float, float]:
    """Tokens per second and mean accepted length of one ``generate`` per group of prompts, one after another
    (tokens over their summed time; ``batch_completion``: generate's budget objective); ``counts`` (if given)
    receives the change of ``first_use_counts`` across it (zero counters left out), and ``steps_by_depth``:
    for each draft depth the decode-only steps took, [steps, mean ms per step, longest step's ms]; ``tokens``
    (if given) each sequence's generated token ids."""
    before = first_use_counts(llm) if counts is not None else {}
    eng = llm.engine
    steps_before = (eng.num_steps, eng.num_ahead, eng.wait_s)
    blocks_before = eng.scheduler.gate.completed_blocks if eng.scheduler.gate is not None else 0
    sched = llm.engine.scheduler
    costs = sched.costs
    by_depth: dict[int, list[float]] = {}  # decode-only steps of the call: draft depth -> step seconds

    class Recording:  # StepCosts (slots: no attribute to patch), recording what the engine observes
        def __getattr__(self, name):
            return getattr(costs, name)

        def observe(self, batch, depth, seconds, drafters=()):
            by_depth.setdefault(depth, []).append(seconds)
            costs.observe(batch, depth, seconds, drafters)

    sched.costs = Recording()
    gens, secs = [], 0.0
    try:
        for prompts in groups:
            t0 = time.perf_counter()
            gens += llm.generate(prompts, sampling, spec, batch_completion=batch_completion)
            secs += time.perf_counter() - t0
    finally:
        sched.costs = costs
    if counts is not None:
        after = first_use_counts(llm)
        counts.update({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
        if "triton_compiles" in counts:  # which kernels: the fix is theirs
            counts["triton_compiled"] = _TRITON_COMPILED[before["triton_compiles"]:]
        # where the call's time went: steps and mean step time per draft depth
        counts["steps_by_depth"] = {str(d): [len(v), round(1e3 * sum(v) / len(v), 3), round(1e3 * max(v), 3)]
                                    for d, v in sorted(by_depth.items())}
        # the engine's steps in the call and how many were launched ahead of the last one's resolution
        # (overlapped, gateway/overlap.py): the rest ran one by one
        counts["engine_steps"] = eng.num_steps - steps_before[0]
        counts["steps_ahead"] = eng.num_ahead - steps_before[1]
        # the host's wait on overlapped steps' picks: a call whose steps wait near nothing is bound by the host
        counts["wait_ms"] = round(1e3 * (eng.wait_s - steps_before[2]), 1)
        if sched.gate is not None:  # the speculation gate's arms after the call, per bucket (SpecGate.summary)
            counts["gate"] = sched.gate.summary()
            # and the blocks the call completed: each one's bucket, arm, overlapped steps and rate
            added = sched.gate.completed_blocks - blocks_before
            counts["gate_blocks"] = sched.gate.history(last=added) if added else []
    if tokens is not None:
        tokens += [list(g.token_ids) for g in gens]
    steps = sum(g.stats.steps for g in gens)
    acc = sum(g.stats.accepted_tokens for g in gens)
    return sum(len(g.token_ids) for g in gens) / secs, (acc + steps) / max(steps, 1)


def hf_pair(model_dir: Path, draft_dir: Path | None, device: str = "cuda"):
    """The target, and the draft as a standalone HF model (our draft shares the target's embedding)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from safetensors.torch import load_file

    tok = AutoTokenizer.from_pretrained(model_dir)
    tgt = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to(device).eval()
    if draft_dir is None:
        return tok, tgt, None
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("specgate")}
    dm = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    sd = {}
    for f in sorted(draft_dir.glob("model*.safetensors")):
        sd |= load_file(str(f))
    sd["model.embed_tokens.weight"] = tgt.model.embed_tokens.weight.detach().cpu()
    missing, unexpected = dm.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    dm.tie_weights()
    return tok, tgt, dm.to(device).eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def real(res: dict, model: str | None, draft: str, new_tokens: int, batches: list[int], prompts_file: str,
         arms: list[str] = (), repeats: int = 2, batch1_prompts: int = 4, device: str = "cuda",
         peers: bool = True) -> None:
    """The real pair at each batch size: speculation on (the engine's default drafter) and off, then each
    drafter of ``arms`` alone (``drafter_arms``: tokens/s and mean accepted length), each after a warm-up
    with the same drafter, so the step-cost model has measured its depths at this batch size.

    Batch 1 runs ``batch1_prompts`` prompts one after another in every arm (HF's peers too): one prompt's
    acceptance decided a whole arm before (engine_real_h100_2485e10.json: one arm's two runs of one prompt
    read 1293 and 971 tok/s). Larger batches take one prompt a sequence. ``device`` "cpu": float32, no HF
    peers' graphs (a smoke run of this code path; tests/test_engine_real.py)."""
    model = None if model == "embedded" else model
    asked, draft = draft, resolve_draft(LoadConfig(model=model, draft=draft))
    prompts = [json.loads(l)["turns"][0] for l in open(prompts_file)]
    # graphs are captured for every batch bucket up to the largest batch timed, no further
    ecfg = EngineConfig(num_blocks=4096, page_size=16,
                        scheduler=SchedulerConfig(max_running=max(batches), max_waiting=512))
    # "auto" reaches the loader as such: it picks the default drafter for the embedded pair
    llm = LLM.load(LoadConfig(model=model, draft=asked, device=device,
                              dtype="bfloat16" if device == "cuda" else "float32"), ecfg, log=log)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    res["graphs_captured_at_start"] = llm.engine.capture_graphs()  # no capture or kernel tuning in a timed call
    res["capture_s"] = round(time.perf_counter() - t0, 1)
    rows = []
    res["batch1_prompts"] = batch1_prompts
    for b in batches:
        groups = ([[prompts[i % len(prompts)]] for i in range(batch1_prompts)] if b == 1 else
                  [[prompts[i % len(prompts)] for i in range(b)]])
        ps = [p for g in groups for p in g]
        # Warm-up at this batch size on other prompts: the step-cost model measures each draft depth here
        # once, as a server in steady state already has.
        warm = [prompts[-1 - (i % 16)] for i in range(b)]
        warm_sampling = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        llm.generate(warm, warm_sampling)
        # The timed prompts' own prefill, untimed: every arm then finds them in the prefix cache alike. Without
        # it the first timed arm alone paid their prefill, and the INT4 kernels' first-use tuning at its new M.
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), SpeculationParams(enabled=False))
        # And the draft's prefill of them, untimed, once: a draft cache is freed with its request, so every arm
        # still pays its own draft prefill (as a server does per request), but none pays the Triton compiles
        # of a prompt length's first eager forward (at 33ea0e8 two steps of one arm took 0.6 s so).
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     SpeculationParams(drafter="draft", tree=(1,)) if "draft" in llm.engine.drafters
                     else SpeculationParams(enabled=False))
        # Each arm is timed ``repeats`` times, on and off alternating, and reported at its best: a one-off
        # cost (a compile, a capture) then shows in ``runs`` and ``first_use`` without deciding the ratio.
        # ``first_use`` holds each arm's first timed run's counters; ``later_runs`` the repeats' (a slow
        # repeat must be explainable too).
        first_use: dict[str, dict] = {"on": {}, "off": {}}
        later: dict[str, list[dict]] = {}

        def record(arm: str, rep: int) -> dict:
            if rep == 0:
                return first_use.setdefault(arm, {})
            later.setdefault(arm, []).append({})
            return later[arm][-1]

        runs: dict[str, list] = {"on": [], "off": []}
        # Each arm's first run's tokens, against speculation off's: greedy output must not change with the drafter
        # (on the GPU in bf16 a near-tie can still flip with the batch's shape: bench/greedy_identity.py)
        outputs: dict[str, list] = {}

        def same_as_off(arm: str) -> list[int]:
            """[sequences identical to speculation off's, sequences]"""
            return [sum(a == b for a, b in zip(outputs[arm], outputs["off"])), len(outputs["off"])]

        for rep in range(repeats):
            for arm, spec in (("on", SpeculationParams()), ("off", SpeculationParams(enabled=False))):
                runs[arm].append(generate_tok_s(llm, groups, greedy, spec, record(arm, rep),
                                                tokens=outputs.setdefault(arm, []) if rep == 0 else None))
        (on, mal), (off, _) = max(runs["on"]), max(runs["off"])
        row = {"batch": b, "spec_tok_s": round(on, 1), "nospec_tok_s": round(off, 1),
               "speedup": round(on / off, 3), "mean_accepted_length": round(mal, 3),
               "same_as_off": same_as_off("on"),
               "hf_static_tok_s": None, "hf_assisted_tok_s": None, "drafter_arms": {}, "first_use": first_use,
               "runs_tok_s": {k: [round(t, 1) for t, _ in v] for k, v in runs.items()}, "later_runs": later}
        table = llm.engine.drafters["ngram"].table
        for name in [a for a in arms if (a in llm.engine.drafters or a in (NGRAM_ALONE, PER_TOKEN, *STEPPED_ARMS, *FIXED_ARMS,
                                                                                     *AHEAD_ARMS, GATE_NGRAM, AHEAD_FRESH)
                                            or a.startswith(GAIN_ARM))
                     and a != llm.engine.config.default_drafter]:
            default_config, sched_config = llm.engine.config, llm.engine.scheduler.config
            default_gate = llm.engine.scheduler.gate
            reselect = False  # the arm picked the drafter: the default's is put back after it
            if name in (GATE_NGRAM, AHEAD_FRESH):
                if default_gate is None:
                    continue
                spec = SpeculationParams()
                llm.engine.scheduler.gate = SpecGate(default_gate.block, default_gate.explore,
                                                     () if name == GATE_NGRAM else default_gate.drafters)
                llm.engine.config = replace(llm.engine.config, chain_ahead=name == AHEAD_FRESH)
            elif name.startswith(GAIN_ARM):
                spec = SpeculationParams()
                llm.engine.scheduler.config = replace(sched_config, budget=replace(
                    sched_config.budget, min_gain=float(name[len(GAIN_ARM):])))
            elif name in STEPPED_ARMS:
                spec = STEPPED_ARMS[name]
                llm.engine.config = replace(llm.engine.config, overlap=False)
            elif name in FIXED_ARMS:
                spec = FIXED_ARMS[name]
                if spec.drafter not in llm.engine.drafters:
                    continue
            elif name in AHEAD_ARMS:
                spec = AHEAD_ARMS[name]
                llm.engine.config = replace(llm.engine.config, chain_ahead=True)
            else:
                spec = SpeculationParams() if name == PER_TOKEN else SpeculationParams(drafter=select_arm(llm, name, table))
                reselect = True
            llm.generate(warm, warm_sampling, spec)
            arm_runs = [generate_tok_s(llm, groups, greedy, spec, record(name, rep), batch_completion=name != PER_TOKEN,
                                       tokens=outputs.setdefault(name, []) if rep == 0 else None)
                        for rep in range(repeats)]
            llm.engine.config, llm.engine.scheduler.config = default_config, sched_config
            llm.engine.scheduler.gate = default_gate
            if reselect:
                select_arm(llm, "ngram", table)
            tok_s, arm_mal = max(arm_runs)
            row["drafter_arms"][name] = {"tok_s": round(tok_s, 1), "speedup": round(tok_s / off, 3),
                                         "mean_accepted_length": round(arm_mal, 3),
                                         "same_as_off": same_as_off(name),
                                         "runs_tok_s": [round(t, 1) for t, _ in arm_runs]}
        row["groups"] = groups  # the prompts, as timed
        rows.append(row)
        log(str(rows[-1]))
    res["real_model"] = Path(resolve_model_path(LoadConfig(model=model))).name
    res["real_draft"] = Path(draft).name
    res["default_drafter"] = llm.engine.config.default_drafter
    res["graph_replays"] = llm.engine.graphs.replays if llm.engine.graphs else 0
    if device == "cuda":  # were the INT4 kernels timed in this process, or taken from an earlier one's tune file?
        from kernels import int4_matmul_triton as T
        res["int4_tune_file"] = None if T._TUNE_PATH is None else str(T._TUNE_PATH)
        res["int4_picks"] = dict(T.PICKS)
    model_dir = resolve_model_path(LoadConfig(model=model))
    draft_dir = Path(draft) if Path(draft).is_dir() else None
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if not peers:  # --no-peers: the engine's arms alone
        for row in rows:
            groups = row.pop("groups")
            row["prompts_timed"], row["calls_timed"] = sum(map(len, groups)), len(groups)
        res["real_pair"] = rows
        return
    tok, tgt, dm = hf_pair(model_dir, draft_dir, device)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def hf_tok_s(groups: list[list[str]], **extra) -> float:
        """HF generate over the row's groups, one after another, each timed after an untimed call on it. A
        static cache is built per prompt shape: with one untimed call on the first group alone, batch 1's
        four one-prompt calls ran at 12.8 tok/s on the H100 (engine_real_h100_6601fae.json; three new
        shapes, presumably each set up or compiled anew -- not verified), while the engine's arms run warm."""
        tokens, secs = 0, 0.0
        for group in groups:
            enc = tok(group, return_tensors="pt", padding=True).to(device)
            tgt.generate(**enc, **kw, **extra)
            _sync(device)
            t0 = time.perf_counter()
            out = tgt.generate(**enc, **kw, **extra)
            _sync(device)
            secs += time.perf_counter() - t0
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * len(group)
        return round(tokens / secs, 1)

    for row in rows:
        row["hf_static_tok_s"] = hf_tok_s(row["groups"], cache_implementation="static")
        if dm is not None and row["batch"] == 1:
            row["hf_assisted_tok_s"] = hf_tok_s(row["groups"], assistant_model=dm)
            row["engine_vs_hf_assisted"] = round(row["spec_tok_s"] / row["hf_assisted_tok_s"], 2)
        row["engine_spec_vs_hf_static"] = round(row["spec_tok_s"] / row["hf_static_tok_s"], 2)
        groups = row.pop("groups")
        row["prompts_timed"], row["calls_timed"] = sum(map(len, groups)), len(groups)
        log(str(row))
    res["real_pair"] = rows


def plot(res: dict, path: Path) -> None:
    """Left: step time per tree size against the floor (8B shape). Right: the real pair's tokens/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    panels = [k for k in ("verify_ms", "real_pair") if res.get(k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    ax_of = dict(zip(panels, axes[0]))
    if "verify_ms" in ax_of:
        ax = ax_of["verify_ms"]
        nodes = [int(n) for n in res["verify_ms"]]
        ax.plot(nodes, list(res["verify_ms"].values()), "o-", label="verify step (CUDA graph)")
        if "before_fusion" in res:
            ax.plot(nodes, list(res["before_fusion"]["verify_ms"].values()), "o--", alpha=0.6,
                    label="before fused RMSNorm / RoPE+KV (earlier run)")
        if "synthetic_previous" in res:
            prev = res["synthetic_previous"]
            ax.plot(nodes, [prev["verify_ms"][str(n)] for n in nodes], "s--", alpha=0.6,
                    label=f"{prev['commit']} ({prev['date']} run)")
        ax.axhline(res["floor_ms"], color="k", ls=":", label=f"floor {res['floor_ms']} ms (INT4 + lm_head at copy BW)")
        if "draft_step_ms" in res:  # absent from --verify-only runs
            ax.axhline(res["draft_step_ms"], color="g", ls="--", label=f"1B-shape draft step {res['draft_step_ms']} ms")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes verified (one sequence)")
        ax.set_ylabel("ms per step")
        ax.set_title(f"Llama-3-8B shape, INT4 g128 — {res['device'].split(' (')[0]}")
        ax.legend(fontsize=8)
    if "real_pair" in ax_of:
        ax = ax_of["real_pair"]
        rows = res["real_pair"]
        x = range(len(rows))
        w = 0.2
        for k, (key, label) in enumerate([("spec_tok_s", "engine, speculation on"), ("nospec_tok_s", "engine, off"),
                                          ("hf_static_tok_s", "HF static cache"), ("hf_assisted_tok_s", "HF assisted")]):
            ax.bar([i + (k - 1.5) * w for i in x], [r.get(key) or 0 for r in rows], w, label=label)
        ax.set_xticks(list(x), [f"batch {r['batch']}" for r in rows])
        for i, r in enumerate(rows):  # the ratio the issue asks about, over each batch's bars
            ax.annotate(f"on/off {r['speedup']:.2f}x", (i, max(r["spec_tok_s"], r["nospec_tok_s"])), ha="center",
                        xytext=(0, 4), textcoords="offset points", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("generated tokens / s")
        drafter = res.get("default_drafter") or "distilled draft"
        ax.set_title(f"SmolLM2-135M, default drafter {drafter} (greedy) — {res.get('commit', '')}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--real", default=None, help="target for the real pair: GGUF, HF dir or 'embedded'")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--prompts-file", default=str(MT_BENCH))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=2, help="--real: timed calls per arm (the best is reported)")
    ap.add_argument("--arms", default=f"ngram,ngram-alone,{PER_TOKEN},off-stepped,on-stepped,hybrid,lookup-first,draft",
                    help="--real: drafters also timed alone at each batch size ('' for none)")
    ap.add_argument("--no-peers", dest="peers", action="store_false",
                    help="--real: skip HF transformers' generate (static cache, assisted)")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="--real: prompts timed one after another at batch 1")
    ap.add_argument("--device", default="cuda", help="--real: 'cpu' for a smoke run (float32)")
    ap.add_argument("--out", default=str(HERE / "results" / "engine.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT's PNG from OUT's JSON")
    ap.add_argument("--verify-only", action="store_true", help="--synthetic: the target's step times alone")
    ap.add_argument("--profile", action="store_true", help="--synthetic: per-kernel device time of the N=1 and N=16 steps")
    args = ap.parse_args()
    if args.plot_only:
        return plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
    commit = provenance.commit()
    on_gpu = args.device == "cuda"
    res: dict = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "date": datetime.date.today().isoformat(),
                 "commit": commit, "torch": torch.__version__, "copy_tbps": round(copy_tbps(), 3) if on_gpu else None,
                 # SPECGATE_BATCH_INVARIANT=1 runs every arm with batch-invariant kernels (kernels/invariant.py)
                 "batch_invariant": invariant.enabled()}
    if args.synthetic:
        synthetic(res, args.verify_only, args.profile)
    if args.real:
        real(res, args.real, args.draft, args.new_tokens, [int(b) for b in args.batches.split(",")], args.prompts_file,
             [a for a in args.arms.split(",") if a], args.repeats, args.batch1_prompts, args.device, args.peers)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    plot(res, Path(args.out).with_suffix(".png"))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
