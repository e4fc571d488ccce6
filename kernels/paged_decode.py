"""Paged decode attention: one new token per sequence over a paged KV cache.

Split-KV with a log-sum-exp merge (FlashDecoding; vLLM's paged attention v2): program
``(b, kv_head, split)`` walks one slice of sequence ``b``'s pages with an online softmax and writes a
partial output and its log-sum-exp; ``_merge_splits_kernel`` combines the slices. The
``G = H / Hkv`` query heads of a KV head share one tile (GQA packing as in FlashInfer's and vLLM's decode
kernels), so each K/V page is read once per KV head.

The grid depends on shapes alone: ``num_splits`` comes from ``B``, ``Hkv`` and the block table's width,
and each program derives its slice from ``seq_lens`` on the device. Calls therefore capture into CUDA
graphs and never sync with the host.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import dispatch
from kernels.pdl import pdl_enter, pdl_meta

MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 128  # below this a split's fixed cost (Q load, partial write) outweighs its share
# ...except when that leaves a short context in few splits: one sequence over 256 to 1024 tokens runs
# fastest in up to 16 splits of 32-64 tokens (bench/kernels/decode_probe.py, H200: 512 tokens 13.0 us
# with 5 splits of 64-token tiles, 10.9 us with 16 of 32).
_SHORT_SPLITS, _SHORT_SPLIT_TOKENS = 16, 32
# Programs of the default config (block_n=64, num_stages=3, D=128) resident per SM: 107 registers and
# 39 KB of shared memory each (ptxas -v, sm_90a). Triton's pipeliner spends stages on the block-table
# lookup that feeds each K/V address, so only one K/V tile per program is in flight below 5 stages;
# deeper pipelines (num_stages 5 and 7) cost occupancy and measured slower on an H200.
DECODE_PROGRAMS_PER_SM = 4
DECODE_PREFETCH = False  # the hand-pipelined loop (_prefetched_tiles); see bench/kernels/prefetch_probe.py
# Block ids read this many tokens' pages at a time into registers (_chunked_tiles), 0 = one lookup per tile
# inside the loop. With the lookup out of the loop the pipeliner double-buffers K/V (sm_90 build: two
# 64x128 buffers each and async_wait 2, against one and async_wait 0); the buffers cost shared memory, so
# fewer programs fit on an SM.
# The launcher's default uses it only where one program an SM can be had from the batch's (sequence, KV
# head) pairs in one or two splits (``wave_splits``): there each program streams its share through
# WAVE_TILE (block_n, stages), 128 KB of shared memory, and an unsplit batch needs no merge launch.
# Elsewhere the split loop keeps its lookups. H100, one run (bench/results/chunk_policy_h100.json, read
# flush, bf16, 32/8 heads): B=8 / 4k 56.3 -> 54.6 us (2 splits), B=12 79.6 -> 75.3, B=16 / 2k 61.0 -> 53.1,
# 4k 104.5 -> 96.4, 8k 193.6 -> 185.5; past one wave it loses (B=24 142.8 -> 146.4, B=48 139.6 -> 145.2).
# At head dim 64 (SmolLM2: 9 / 3 heads) a program's buffers take half the shared memory, and the chunked loop,
# unsplit, also wins past one wave: batches of at least one (sequence, KV head) pair an SM, 2k-8k tokens,
# H100, one run (bench/results/chunk_policy_smollm2_h100.json, read / write flush): B=43 / 2k 33.2 -> 31.6 /
# 41.5 -> 39.7 us, 4k 57.0 -> 55.4 / 67.1 -> 65.4, 8k even; B=64 / 4k 83.2 -> 80.0 / 92.1 -> 91.2; B=85 / 2k
# 56.6 -> 55.1 / 66.2 -> 64.9, 4k 103.8 -> 102.2 / 114.0 -> 112.1; B=128 / 2k 81.8 -> 79.5 / 90.8 -> 89.6. Under
# one wave it does not (B=21 / 4k 32.6 -> 41.3 unsplit), so smaller batches keep the split loop.
# SPECGATE_ATTN_CHUNK sets it (and tree_attention's TREE_CHUNK_TOKENS) for A/B runs; 0 turns it off.
DECODE_CHUNK_TOKENS = int(os.environ.get("SPECGATE_ATTN_CHUNK", "4096"))
WAVE_FILL = 0.7  # the least share of the SMs the programs must cover
WAVE_TILE = (128, 3)
WIDE_MIN_TOKENS = 2048  # head dim 64: the shortest block table (tokens) the unsplit chunked loop was timed at
CHUNKED_PROGRAMS_PER_SM = 3  # block_n=64, 3 stages: 153 registers and 70 KB of shared memory (ptxas, sm_90a)
PREFETCH_WARPS = 8
# The merge stays a launch of its own. Two forms of it inside the decode kernel, by the last split of each
# (sequence, KV head) to finish, measured slower than the launch they saved: reading the partials one after
# another (H200, bench/results/attn_merge_ab.json) and sixteen at a time (H100, M=1 8B step 3.07 against
# 2.90 ms, bench/results/pdl_merge_ab_h100.json).
LOG2E = 1.4426950408889634


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D] one layer
    v_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, includes the current token (already in the cache)
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """The spec and the CPU path: one sequence at a time, float32 softmax."""
    B, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[b, pos // P].long() * P + pos % P
        k = k_cache.reshape(-1, Hkv, D)[slots].float().repeat_interleave(H // Hkv, dim=1)  # [S, H, D]
        v = v_cache.reshape(-1, Hkv, D)[slots].float().repeat_interleave(H // Hkv, dim=1)
        probs = (torch.einsum("hd,shd->hs", q[b].float(), k) * scale).softmax(-1)  # [H, S]
        out[b] = torch.einsum("hs,shd->hd", probs, v).to(q.dtype)
    return out


# The CPU batches its attention (``paged_decode_attention_batched``, ``tree_attention_batched``) in chunks
# of up to this many padded K elements (256 MB of float32 K and as much V). BATCHED_CPU = False: one sequence
# at a time, through the references (the spec).
BATCHED_CPU = True
CPU_CHUNK_ELEMS = 1 << 26


def cpu_chunks(lengths: list[int], page: int, token_elems: int, budget: int):
    """``(lo, hi, S)`` spans of consecutive sequences, ``S`` the longest of ``lengths[lo:hi]``: a span grows
    while its sequences padded to whole pages of ``S`` hold at most ``budget`` elements (``token_elems`` a
    token); one sequence alone may exceed it."""
    lo = 0
    while lo < len(lengths):
        hi, S = lo + 1, lengths[lo]
        while hi < len(lengths) and (hi + 1 - lo) * -(-max(S, lengths[hi]) // page) * page * token_elems <= budget:
            S, hi = max(S, lengths[hi]), hi + 1
        yield lo, hi, S
        lo = hi


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``nb`` pages of each row of ``block_tables`` ([b, max_blocks]) from the K and V caches
    ([num_blocks, P, Hkv, D]), each as float32 ``[b, Hkv, nb * P, D]`` (a view of one gather), the page ids
    computed once. Entries past a sequence's last page may hold anything (-1, stale ids): any page will do
    there, since the caller masks those positions."""
    pages = _pages(k_cache, block_tables, nb)
    return _gather(k_cache, pages), _gather(v_cache, pages)


def _pages(cache: torch.Tensor, block_tables: torch.Tensor, nb: int) -> torch.Tensor:
    return block_tables[:, :nb].long().clamp(0, cache.shape[0] - 1)  # [b, nb]


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    (b, nb), (_, P, Hkv, D) = pages.shape, cache.shape
    return cache[pages].float().view(b, nb * P, Hkv, D).transpose(1, 2)


def paged_decode_attention_batched(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D] one layer
    v_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, includes the current token (already in the cache)
    scale: float,
    chunk_elems: int = CPU_CHUNK_ELEMS,
) -> torch.Tensor:  # [B, H, D]
    """``paged_decode_attention_ref``'s maths for many sequences per step, the CPU's decode path. Each chunk
    of the batch gathers whole pages (not token by token) up to its longest sequence, ``[b, Hkv, S, D]`` as a
    view, and runs torch's fused attention with each KV head's query heads as its query rows; positions past
    a sequence's end are masked out. A chunk grows while its gathered K stays within ``chunk_elems``
    elements. float32 throughout, as the reference."""
    B, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    out = torch.empty_like(q)
    for lo, hi, S in cpu_chunks(seq_lens.tolist(), P, Hkv * D, chunk_elems):
        b, nb = hi - lo, -(-S // P)
        k, v = gather_kv(k_cache, v_cache, block_tables[lo:hi], nb)
        valid = torch.arange(nb * P, device=q.device)[None, :] < seq_lens[lo:hi, None]  # [b, nb * P]
        o = F.scaled_dot_product_attention(q[lo:hi].float().view(b, Hkv, G, D), k, v,
                                           attn_mask=valid[:, None, None, :], scale=scale)  # [b, Hkv, G, D]
        out[lo:hi] = o.reshape(b, H, D).to(q.dtype)
    return out


@triton.jit
def _softmax_step(acc, l_i, m_i, s, v):
    """One online-softmax update (FlashAttention): fold log2-domain scores s [G, N] and values v [N, D]
    into the running max m_i [G], normaliser l_i [G] and accumulator acc [G, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _decode_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, start, seq_len, qk_scale,
                 stride_kb, stride_kp, offs_n, offs_d,
                 PAGE: tl.constexpr, IS_TAIL: tl.constexpr):
    """One BLOCK_N-token step of the online softmax; only the tail tile pays for bounds masks."""
    pos = start + offs_n  # [BLOCK_N] token positions
    if IS_TAIL:
        valid = pos < seq_len
        blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
    kv_off = blk * stride_kb + (pos % PAGE) * stride_kp + kv_head_off  # [BLOCK_N]
    kv_ptrs = kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, D]
    if IS_TAIL:
        k = tl.load(k_ptr + kv_ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_ptrs)
        v = tl.load(v_ptr + kv_ptrs)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N] fp32, log2 domain
    if IS_TAIL:
        s = tl.where(valid[None, :], s, float("-inf"))
    return _softmax_step(acc, l_i, m_i, s, v)


@triton.jit
def _tile_offsets(bt_row, start, hi, kv_head_off, stride_kb, stride_kp, offs_n, PAGE: tl.constexpr):
    """[BLOCK_N] element offsets of the K/V rows of the tile at ``start``; rows at or past ``hi`` point at
    block 0 (their loads are masked). One block-table entry per token: one per page, broadcast by a
    reshape, broke the K/V loads' 16-byte vectors in the sm_90 build (``bench/kernels/sass.py decode``)."""
    pos = start + offs_n
    blk = tl.load(bt_row + pos // PAGE, mask=pos < hi, other=0).to(tl.int64)
    return blk * stride_kb + (pos % PAGE) * stride_kp + kv_head_off


@triton.jit
def _prefetched_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, lo, hi, qk_scale, stride_kb, stride_kp,
                      offs_n, offs_d, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys ``[lo, hi)`` with the pipelining done by hand (launch with ``num_stages=1``): each trip issues
    plain loads of the next tile's K and V into registers, and the block-table entries of the tile after
    that, before it computes on the current tile, so a copy is in flight through the dots and the softmax.
    Triton's own pipeliner spends its stages on the block-table lookup that feeds each address: its loop
    waits on every outstanding copy at the top of each tile (sm_90 SASS)."""
    n_tiles = (tl.maximum(hi, lo) - lo + BLOCK_N - 1) // BLOCK_N
    off = _tile_offsets(bt_row, lo, hi, kv_head_off, stride_kb, stride_kp, offs_n, PAGE)
    ok = (lo + offs_n < hi)[:, None]
    k = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok, other=0.0)
    v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=ok, other=0.0)
    off = _tile_offsets(bt_row, lo + BLOCK_N, hi, kv_head_off, stride_kb, stride_kp, offs_n, PAGE)
    for t in range(0, n_tiles):
        start = lo + t * BLOCK_N
        ok_next = (start + BLOCK_N + offs_n < hi)[:, None]
        k_next = tl.load(k_ptr + off[:, None] + offs_d[None, :], mask=ok_next, other=0.0)
        v_next = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=ok_next, other=0.0)
        off = _tile_offsets(bt_row, start + 2 * BLOCK_N, hi, kv_head_off, stride_kb, stride_kp, offs_n, PAGE)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N] fp32, log2 domain
        s = tl.where((start + offs_n < hi)[None, :], s, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v)
        k, v = k_next, v_next
    return acc, l_i, m_i


@triton.jit
def _chunked_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, lo, full_hi, qk_scale, stride_kb, stride_kp,
                   offs_n, offs_d, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BT_CHUNK: tl.constexpr):
    """The whole tiles ``[lo, full_hi)`` with their block ids read BT_CHUNK pages at a time into registers:
    each tile's K/V addresses come from those registers (``tl.gather``), not from a load inside the loop,
    so Triton's pipeliner can keep several K/V tiles in flight instead of waiting on every copy at each
    tile's block-table lookup. Chunks sit on multiples of their length, which whole tiles divide; ``lo``
    sits on a tile, not necessarily on a page or a chunk."""
    CHUNK: tl.constexpr = BT_CHUNK * PAGE
    offs_p = tl.arange(0, BT_CHUNK)
    for c in range(lo // CHUNK, tl.cdiv(full_hi, CHUNK)):
        base = c * CHUNK
        pages = tl.load(bt_row + base // PAGE + offs_p, mask=base + offs_p * PAGE < full_hi, other=0)  # [BT_CHUNK]
        for start in range(tl.maximum(lo, base), tl.minimum(base + CHUNK, full_hi), BLOCK_N):
            rel = start - base + offs_n  # [BLOCK_N] token offsets in the chunk
            # in range for every real tile; the pipeliner also computes addresses for tiles past the loop's
            # end (their loads predicated off), and an index out of range there faults in the gather
            blk = tl.gather(pages, (rel // PAGE) % BT_CHUNK, 0).to(tl.int64)
            kv_ptrs = (blk * stride_kb + (rel % PAGE) * stride_kp + kv_head_off)[:, None] + offs_d[None, :]
            k = tl.load(k_ptr + kv_ptrs)
            v = tl.load(v_ptr + kv_ptrs)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_btb", "stride_ls", "num_splits"])  # batch-dependent: see tree_attention
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_btb,
    stride_os, stride_ob, stride_oh,
    stride_ls, stride_lb,
    num_splits,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr, LEN_OFFSET: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, BT_CHUNK: tl.constexpr = 0,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_g  # [BLOCK_G]; rows >= GROUP are padding for tl.dot's M >= 16
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]

    # This split's slice, in whole tiles, from the device-side length (no host sync).
    seq_len = tl.load(seq_lens_ptr + b) + LEN_OFFSET
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    full_hi = tl.maximum(lo, tl.minimum(hi, (seq_len // BLOCK_N) * BLOCK_N))

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: a fully masked row keeps p = 0, not NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    kv_head_off = kv_head * stride_kh
    if PREFETCH:
        acc, l_i, m_i = _prefetched_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, lo, hi, qk_scale,
                                          stride_kb, stride_kp, offs_n, offs_d, PAGE, BLOCK_N)
    else:
        if BT_CHUNK > 0:
            acc, l_i, m_i = _chunked_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, lo, full_hi, qk_scale,
                                           stride_kb, stride_kp, offs_n, offs_d, PAGE, BLOCK_N, BT_CHUNK)
        else:
            for start in range(lo, full_hi, BLOCK_N):
                acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, start, seq_len,
                                             qk_scale, stride_kb, stride_kp, offs_n, offs_d, PAGE, False)
        for start in range(full_hi, hi, BLOCK_N):
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, start, seq_len,
                                         qk_scale, stride_kb, stride_kp, offs_n, offs_d, PAGE, True)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = o_ptr + split * stride_os + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])
    if IS_SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))  # log2 domain
        tl.store(lse_ptr + split * stride_ls + b * stride_lb + head, lse, mask=g_mask)


@triton.jit(do_not_specialize=["stride_ls", "num_splits"])
def _merge_splits_kernel(
    o_part_ptr, lse_ptr, out_ptr,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_ot, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out[t, h] = sum_s w_s * o_part[s, t, h] with w = softmax over splits of their log-sum-exps."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]; empty splits carry -inf and weigh 0
    o = tl.load(o_part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                mask=s_mask[:, None], other=0.0)  # [BLOCK_S, D] fp32
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def merge_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, block_s: int | None = None) -> None:
    """Merge ``o_part`` [S, T, H, D] fp32 and ``lse`` [S, T, H] (log2) into ``out`` [T, H, D]. ``block_s``: the
    splits' tile width (at least S), fixed by batch-invariant callers so the sums' order never depends on S."""
    S, T, H, D = o_part.shape
    _merge_splits_kernel[(T, H)](
        o_part, lse, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), S, HEAD_DIM=D, BLOCK_S=block_s or triton.next_power_of_2(S),
        **pdl_meta(out.device))


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def pick_num_splits(num_programs: int, max_len: int, device: torch.device, programs_per_sm: int,
                    short_splits: int = 1) -> int:
    """Splits from shapes only: at most one full wave of resident programs (a partial second wave
    leaves SMs idle), none shorter than _MIN_SPLIT_TOKENS -- or than _SHORT_SPLIT_TOKENS while there are
    at most ``short_splits``."""
    fill = programs_per_sm * _num_sms(device) // num_programs
    by_len = max(max_len // _MIN_SPLIT_TOKENS, min(short_splits, max_len // _SHORT_SPLIT_TOKENS))
    return max(1, min(MAX_SPLITS, fill, by_len))


def chunk_pages(chunk_tokens: int, page: int, block_n: int) -> int:
    """Pages per block-id chunk for ``chunk_tokens`` (0: no chunks): a power of two (``tl.arange``) covering
    whole tiles, so no tile straddles two chunks; 0 where pages are not a power of two."""
    if chunk_tokens <= 0 or page & (page - 1):
        return 0
    return triton.next_power_of_2(max(chunk_tokens, block_n, page) // page)


def decode_plan(programs: int, max_blocks: int, page: int, device: torch.device, num_splits: int | None = None,
                block_n: int | None = None, num_stages: int | None = None, prefetch: bool = False,
                chunk_tokens: int | None = None, head_dim: int = 128) -> tuple[int, int, int, int]:
    """``(splits, block_n, num_stages, chunk pages)`` of a decode launch over ``programs`` (sequence, KV head)
    pairs and block tables ``max_blocks`` wide; the arguments the caller fixed stay as given. The chunked
    loop's rules are the timed ones: at head dim 128 one wave in one or two splits (``wave_splits``), at
    head dim 64 unsplit from a pair an SM and 2k tokens; other head dims keep the split loop."""
    auto = num_splits is None and block_n is None and num_stages is None and chunk_tokens is None
    chunked_splits = 0  # the chunked loop's splits where a rule picks it
    if auto and not prefetch and DECODE_CHUNK_TOKENS > 0:
        if head_dim == 128:
            chunked_splits = wave_splits(programs, device)
        elif head_dim == 64 and programs >= _num_sms(device) and max_blocks * page >= WIDE_MIN_TOKENS:
            chunked_splits = 1
    if chunked_splits:
        chunk, num_splits, (block_n, num_stages) = DECODE_CHUNK_TOKENS, chunked_splits, WAVE_TILE
    else:
        chunk = 0 if prefetch or chunk_tokens is None else chunk_tokens
    max_len = max_blocks * page
    per_sm = CHUNKED_PROGRAMS_PER_SM if chunk else DECODE_PROGRAMS_PER_SM
    S = num_splits or pick_num_splits(programs, max_len, device, per_sm, _SHORT_SPLITS)
    block_n = block_n or (32 if max_len // S < 64 else 64)  # short splits: half tiles, twice the programs busy
    return S, block_n, num_stages or 3, chunk_pages(chunk, page, block_n)


def wave_splits(num_programs: int, device: torch.device) -> int:
    """Splits (1 or 2) that give ``num_programs`` (sequence, KV head) pairs one program an SM over at least
    ``WAVE_FILL`` of the SMs; 0 where none do."""
    sms = _num_sms(device)
    splits = max(1, sms // num_programs)
    return splits if splits <= 2 and WAVE_FILL * sms <= num_programs * splits <= sms else 0


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    *,
    use_triton: bool | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    len_offset: int = 0,
    prefetch: bool | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:  # [B, H, D]
    """Dispatch: the Triton kernel on CUDA (or when forced), elsewhere the batched torch path (or with
    ``BATCHED_CPU`` off the one-sequence-at-a-time reference). Sequence ``b``
    attends to ``seq_lens[b] + len_offset`` tokens: the model passes its context lengths and 1, which
    saves a launch per layer for the addition. ``prefetch`` picks the hand-pipelined loop
    (``_prefetched_tiles``, ``num_stages`` ignored) or Triton's pipeliner; None takes ``DECODE_PREFETCH``.
    ``chunk_tokens`` > 0 has the pipelined loop read its block ids that many tokens at a time
    (``_chunked_tiles``), 0 never; None takes ``DECODE_CHUNK_TOKENS`` where ``decode_plan``'s rules pick the
    chunked loop and the caller fixed no launch parameter."""
    if not dispatch.use_triton(q, use_triton):
        cpu = paged_decode_attention_batched if BATCHED_CPU else paged_decode_attention_ref
        return cpu(q, k_cache, v_cache, block_tables, seq_lens + len_offset, scale)
    B, H, D = q.shape
    _, P, Hkv, _ = k_cache.shape
    if (H % Hkv or D & (D - 1) or D < 16 or q.stride(-1) != 1 or k_cache.stride() != v_cache.stride()
            or k_cache.stride(-1) != 1):
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, kv {tuple(k_cache.shape)}")
    G = H // Hkv
    prefetch = DECODE_PREFETCH if prefetch is None else prefetch
    S, block_n, num_stages, bt_chunk = decode_plan(B * Hkv, block_tables.shape[1], P, q.device, num_splits, block_n,
                                                   num_stages, prefetch, chunk_tokens, D)
    out = torch.empty_like(q)
    o_part = out.unsqueeze(0) if S == 1 else q.new_empty(S, B, H, D, dtype=torch.float32)  # [S, B, H, D]
    lse = q.new_empty(S, B, H, dtype=torch.float32)  # [S, B, H]
    _paged_decode_kernel[(B, Hkv, S)](
        q, k_cache, v_cache, block_tables, seq_lens, o_part, lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1), S,
        GROUP=G, PAGE=P, HEAD_DIM=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        IS_SPLIT=S > 1, LEN_OFFSET=len_offset, PREFETCH=prefetch, BT_CHUNK=bt_chunk,
        num_warps=num_warps or (PREFETCH_WARPS if prefetch else 4), num_stages=1 if prefetch else num_stages,
        **pdl_meta(q.device))
    if S > 1:
        merge_splits(o_part, lse, out)
    return out
