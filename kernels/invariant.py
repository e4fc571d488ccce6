"""Batch-invariant mode: every row of a forward gets the same bits whatever else shares its launch.

Greedy speculative decoding keeps exactly the target's argmax path, so its output equals plain decoding's as
far as the target's logits do. On the GPU in bfloat16 they do not by default: a verify step scores M > 1 rows
where a plain step scores one, and the kernels the launchers pick for different M (a GEMV against an MMA
tile, split-K factors tuned per M, cuBLAS's algorithms, split-KV plans sized to the batch, decode against
tree attention) round a row differently, so near-ties flip (ARCHITECTURE.md, "Token flow of one sequence").

With the mode on, each kernel whose result could depend on its neighbours runs one fixed configuration,
chosen from the weight's or the sequence's own shape and never from the batch (the idea of batch-invariant
kernels: He and Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025; SGLang's and vLLM's
deterministic modes):

* INT4 matmuls: the MMA path at 16-row tiles, one split-K factor per weight shape, the serial (ordered)
  fix-up; no GEMV, no swap-AB, no atomics (``int4_matmul_triton.invariant_config``).
* Dense matmuls (the LM head, any bf16 projection): ``kernels.dense_matmul``, 16-row tiles, no split-K,
  instead of cuBLAS.
* Attention: decode rows go through the tree kernel too, at 16-row query tiles; keys are read in tiles
  aligned to position 0 and split at fixed positions (``SPLIT_TOKENS``), every tile through the same masked
  code, and the splits merge at a fixed width. A row at position p then folds the same keys in the same
  tiles whether it is a plain decode row, a chain node or a prefill row.
* RMSNorm, RoPE and the cache write, the gated activation: one program per row already.
* The CPU (the reference paths): attention through ``tree_attention.invariant_attention_ref``, the kernels'
  tiling in elementwise torch ops; its float32 projections already give a row the same bits at any row count.

A tree's branch nodes (ancestors not the new tokens before them) see those ancestors at scattered cache
slots, so the tree kernel computes them again over their own paths (``tree_attention._branch_rows_kernel``),
keys in the lanes plain decoding would use. Sampled requests stay exact in distribution either way; with the
mode on they also repeat bit for bit under a seed whatever the batch, where their drafting does (no
speculation, or a fixed tree). A tensor-parallel target cannot run it (its all-reduce sums rows in chunks
sized by the batch).

The mode costs speed: MMA tiles at M = 1 instead of the GEMV, no tuning, branch nodes' prefixes read again
(1.38x / 1.46x / 1.98x the default verify step at 1 / 16 / 64 nodes at Llama-3-8B's shape on an H100,
bench/results/engine_ab_invariant_h100_c679601.json). ``SPECGATE_BATCH_INVARIANT=1`` or ``--batch-invariant``
turns it on for the process; launches read it when they run (a CUDA graph keeps the kernels it was captured
with, so the engine sets it before any capture).
"""

from __future__ import annotations

import os

FROM_ENV = os.environ.get("SPECGATE_BATCH_INVARIANT", "0") == "1"
_enabled = FROM_ENV

# Attention splits its keys at multiples of this many positions (a row's splits depend on its length alone)
# and merges at most MAX_SPLITS of them at one fixed width.
SPLIT_TOKENS = 512
MAX_SPLITS = 64
BLOCK_N = 64  # keys per attention tile
QUERY_ROWS = 16  # rows of a query tile (tokens x query heads of one KV head), and of a matmul tile


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)
