"""Tree-verification attention over a paged KV cache (also chunked prefill and ragged mixed batches).

Every new token of a forward (prefill-chunk tokens and tree nodes alike) attends to

* its sequence's paged prefix ``[0, context_len)`` with no mask, and
* its sequence's new tokens ``[context_len, context_len + n)`` through an ancestor bitmask.

The new tokens' K/V are already in the cache at slots ``context_len + i`` (the model writes them
before attention), so one gather over ``context_len + n`` slots covers both parts.

Mask format: ``mask_bits[t]`` (int64) has bit ``j`` set when token ``t`` sees new token ``j`` of its
own sequence. A value of 0 means *causal* (token ``i`` sees new tokens ``0..i``): prefill chunks use it
and may be longer than 64 tokens. ``mask_bits=None`` makes every sequence causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import dispatch, invariant, paged_decode
from kernels.paged_decode import (CPU_CHUNK_ELEMS, LOG2E, _chunked_tiles, _prefetched_tiles, _softmax_step,
                                  chunk_pages, cpu_chunks, gather_kv, merge_splits, paged_decode_attention,
                                  pick_num_splits)
from kernels.pdl import pdl_enter, pdl_meta

# Programs of the default configs resident per SM at D=128: 180 to 213 registers and 74 to 99 KB of
# shared memory each (ptxas -v, sm_90a); 128-row tiles (8 warps) fit only one, which measured the same.
TREE_PROGRAMS_PER_SM = 2
TREE_PREFETCH = False  # see tree_attention's ``prefetch``
TREE_CHUNK_TOKENS = paged_decode.DECODE_CHUNK_TOKENS  # see tree_attention's ``chunk_tokens``
# Query tiles of at least this many rows (tokens x query heads: 64-node trees at G = 4) stream their prefix
# through the chunked loop in (block_n, stages) steps, where TREE_CHUNK_TOKENS is on; smaller tiles keep
# their lookups. H100 (chunk_policy_h100.json): 64-node trees at B=16 231 -> 190 us, at B=4 95 -> 91;
# 16-node trees at B=64 (64-row tiles) lost, 208 -> 241.
TREE_CHUNK_ROWS, TREE_CHUNK_TILE = 128, (128, 3)


def _visible(n: int, bits: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """[n, n] bool intra-chunk visibility for one sequence's new tokens."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if bits is None:
        return causal
    j = torch.arange(n, device=device)
    from_bits = ((bits[:, None] >> j[None, :]) & 1).bool() if n <= 64 else causal
    return torch.where((bits == 0)[:, None], causal, from_bits)


def tree_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D] one layer
    v_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, cached tokens before this forward
    query_start: torch.Tensor,  # [B + 1] int32, cumulative new-token counts
    mask_bits: torch.Tensor | None,  # [T] int64, see module docstring
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """The spec and the CPU path: one sequence at a time, float32 softmax."""
    T, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts, ctxs = query_start.tolist(), context_lens.tolist()
    for b in range(len(ctxs)):
        s, e, ctx = starts[b], starts[b + 1], ctxs[b]
        n = e - s
        if n == 0:
            continue
        total = ctx + n
        pos = torch.arange(total, device=q.device)
        slots = block_tables[b, pos // P].long() * P + pos % P
        k = k_cache.reshape(-1, Hkv, D)[slots].float()  # [S, Hkv, D]
        v = v_cache.reshape(-1, Hkv, D)[slots].float()
        k = k.repeat_interleave(H // Hkv, dim=1)  # [S, H, D]
        v = v.repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q[s:e].float(), k) * scale  # [H, n, S]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
        mask[:, ctx:] = _visible(n, None if mask_bits is None else mask_bits[s:e], q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = torch.einsum("hts,shd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


# The CPU path batches sequences of at most this many new tokens (trees, decode tokens, short chunks); longer
# prefill chunks go one at a time (paged_decode.BATCHED_CPU = False: every sequence, through the reference).
CPU_TREE_MAX_NEW = 64


def tree_attention_batched(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D] one layer
    v_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    query_start: torch.Tensor,  # [B + 1] int32
    mask_bits: torch.Tensor | None,  # [T] int64
    scale: float,
    chunk_elems: int = CPU_CHUNK_ELEMS,
) -> torch.Tensor:  # [T, H, D]
    """``tree_attention_ref``'s maths with many sequences per call, the CPU's path. Sequences of at most
    ``CPU_TREE_MAX_NEW`` new tokens go in chunks: whole pages gathered up to the chunk's longest sequence,
    new tokens padded to its widest, and torch's fused attention under a mask built from the context
    lengths and ancestor bits (each KV head's query heads times new tokens are its query rows). Longer
    chunks (prefill) go through the reference one at a time. A chunk grows while its gathered K stays within
    ``chunk_elems`` elements.

    The chunks, their rows and masks depend on the batch alone, so every layer of a forward shares them
    (``_tree_plan``): a layer then gathers its pages and runs attention. Built per layer they were most of a
    small verify step's attention time (SmolLM2 on 2 cores, a 2-node tree: 431 against 167 us per layer for
    the decode path)."""
    H, D = q.shape[1:]
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    rest, chunks = _tree_plan(q.shape[0], H // Hkv, P, Hkv * D, context_lens, query_start, mask_bits, chunk_elems)
    for b, s, e in rest:
        out[s:e] = tree_attention_ref(q[s:e], k_cache, v_cache, block_tables[b:b + 1], context_lens[b:b + 1],
                                      query_start.new_tensor([0, e - s]), None if mask_bits is None else
                                      mask_bits[s:e], scale)
    for c in chunks:
        k, v = gather_kv(k_cache, v_cache, block_tables[c.seqs], c.nb)  # [b, Hkv, nb * P, D]
        b, n_max, G = c.rows.shape[0], c.rows.shape[1], H // Hkv
        qb = q[c.rows].float().view(b, n_max, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(b, Hkv, G * n_max, D)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=c.mask, scale=scale)  # [b, Hkv, G * n_max, D]
        o = o.view(b, Hkv, G, n_max, D).permute(0, 3, 1, 2, 4).reshape(b, n_max, H, D)
        out[c.out_rows] = o[c.real].to(q.dtype)
    return out


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One chunk of ``tree_attention_batched``'s short sequences: which they are and how their rows attend."""

    seqs: torch.Tensor  # [b] int64 batch index of each sequence
    nb: int  # pages gathered per sequence
    rows: torch.Tensor  # [b, n_max] int64 rows of q (padding rows repeat the sequence's first)
    real: torch.Tensor  # [b, n_max] bool: rows that are new tokens
    out_rows: torch.Tensor  # [R] int64 rows[real]
    mask: torch.Tensor  # [b, 1, G * n_max, nb * P] bool attention mask


# The last batch's plan: (key, plan). The key is the batch's contents, not its tensors' identities, so a batch
# whose tensors were written in place (graph-style buffers) or freed and reallocated is never mistaken.
# CPU_PLAN_CACHE = False builds the plan in every call (bench/cpu_decode.py --switch plan).
_PLAN: list = [None, None]
CPU_PLAN_CACHE = True


def _tree_plan(T: int, G: int, P: int, token_elems: int, context_lens: torch.Tensor, query_start: torch.Tensor,
               mask_bits: torch.Tensor | None, chunk_elems: int) -> tuple[list[tuple[int, int, int]], list[_Chunk]]:
    """The long sequences (batch index, first row, end row: through the reference) and the short ones'
    chunks, for this batch's lengths and ancestor bits; built once per batch and reused by every layer."""
    starts, ctxs = query_start.tolist(), context_lens.tolist()
    ns = [e - s for s, e in zip(starts, starts[1:])]
    small = [b for b, n in enumerate(ns) if 0 < n <= CPU_TREE_MAX_NEW]
    bits_key = tuple(mask_bits.tolist()) if mask_bits is not None and small else None  # one host copy a layer
    key = (T, G, P, token_elems, chunk_elems, tuple(starts), tuple(ctxs), bits_key, str(query_start.device))
    if _PLAN[0] == key and CPU_PLAN_CACHE:
        return _PLAN[1]
    rest = [(b, starts[b], starts[b + 1]) for b, n in enumerate(ns) if n > CPU_TREE_MAX_NEW]
    chunks = [_chunk_of(small[lo:hi], starts, ctxs, ns, mask_bits, G, P, S, query_start.device)
              for lo, hi, S in cpu_chunks([ctxs[b] + ns[b] for b in small], P, token_elems, chunk_elems)]
    _PLAN[:] = [key, (rest, chunks)]
    return rest, chunks


def _chunk_of(part: list[int], starts: list[int], ctxs: list[int], ns: list[int], mask_bits: torch.Tensor | None,
              G: int, P: int, S: int, dev: torch.device) -> _Chunk:
    """The chunk of sequences ``part`` (batch indices), each padded to ``S`` keys in whole pages."""
    nb = -(-S // P)
    n_list = [ns[b] for b in part]
    b, n_max = len(part), max(n_list)
    i = torch.arange(n_max, device=dev)
    n_t, ctx_t = torch.tensor(n_list, device=dev), torch.tensor([ctxs[x] for x in part], device=dev)
    real = i[None, :] < n_t[:, None]  # [b, n_max]: rows that are new tokens (the rest is padding)
    rows = torch.tensor([starts[x] for x in part], device=dev)[:, None] + torch.where(real, i[None, :], 0)
    j = torch.arange(nb * P, device=dev)[None, None, :] - ctx_t[:, None, None]  # [b, 1, S']: index among new
    causal = j <= i[None, :, None]  # [b, n_max, S']
    if mask_bits is None:
        sees_new = causal
    else:
        bits = torch.where(real, mask_bits[rows], 0)[:, :, None]  # [b, n_max, 1]
        from_bits = ((bits >> j.clamp(0, 63)) & 1).bool()
        sees_new = torch.where(bits == 0, causal, from_bits)
    mask = (j < 0) | ((j < n_t[:, None, None]) & sees_new)  # prefix, or a visible new token
    mask = mask | ~real[:, :, None] & (j == -ctx_t[:, None, None])  # padding rows see position 0 (no NaN)
    mask = mask[:, None, None].expand(b, 1, G, n_max, nb * P).reshape(b, 1, G * n_max, nb * P)
    return _Chunk(torch.tensor(part, device=dev), nb, rows, real, rows[real], mask)


@triton.jit
def _tree_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, start, ctx, kv_hi, tok, bits, qk_scale,
               stride_kb, stride_kp, offs_n, offs_d,
               PAGE: tl.constexpr, HAS_BITS: tl.constexpr, IS_MASKED: tl.constexpr):
    """One BLOCK_N-key step of the online softmax. Only tiles reaching past ``ctx`` (the new tokens, or
    the prefix's ragged end) pay for the ancestor mask; prefix tiles run unmasked."""
    pos = start + offs_n  # [BLOCK_N] key positions
    if IS_MASKED:
        valid = pos < kv_hi
        blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
    kv_ptrs = (blk * stride_kb + (pos % PAGE) * stride_kp + kv_head_off)[:, None] + offs_d[None, :]  # [BLOCK_N, D]
    if IS_MASKED:
        k = tl.load(k_ptr + kv_ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_ptrs)
        v = tl.load(v_ptr + kv_ptrs)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 domain
    if IS_MASKED:
        j = pos - ctx  # [BLOCK_N] index among the new tokens; negative inside the prefix
        sees_new = j[None, :] <= tok[:, None]  # causal
        if HAS_BITS:
            shift = tl.minimum(tl.maximum(j, 0), 63).to(tl.int64)
            from_bits = ((bits[:, None] >> shift[None, :]) & 1) != 0
            sees_new = tl.where(bits[:, None] == 0, sees_new, from_bits)
        s = tl.where((j[None, :] < 0) | (valid[None, :] & sees_new), s, float("-inf"))
    return _softmax_step(acc, l_i, m_i, s, v)


# Integers that change with the batch are not specialised on (Triton compiles a variant per value class: 1,
# a multiple of 16, other): each new variant is a compile of a second or more, a stall in the middle of
# serving. None of them feeds a vectorised address.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_btb", "stride_ls"])
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, qs_ptr, bits_ptr, o_ptr, lse_ptr,
    qk_scale, num_seqs, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_btb,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, IS_SPLIT: tl.constexpr,
    HAS_BITS: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, BT_CHUNK: tl.constexpr = 0,
    SPLIT_TILES: tl.constexpr = 0,
):
    pdl_enter(USE_PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Ragged tile scheduler (as in FlashAttention's varlen kernels): sequence b owns query tiles
    # [cum[b] - num_tiles[b], cum[b]), found by a cumsum over query_start on the device. The grid
    # has an upper bound of tiles, so it depends on shapes alone; spare programs exit here.
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_seqs
    q_lo = tl.load(qs_ptr + offs_b, mask=b_mask, other=0)
    n_vec = tl.load(qs_ptr + offs_b + 1, mask=b_mask, other=0) - q_lo  # [BLOCK_B] new tokens per sequence
    num_tiles = (n_vec + BLOCK_Q - 1) // BLOCK_Q
    cum = tl.cumsum(num_tiles, 0)
    b = tl.sum((cum <= tile).to(tl.int32), 0)
    if b >= num_seqs:
        return
    is_b = offs_b == b
    q_tile = tile - tl.sum(tl.where(is_b, cum - num_tiles, 0), 0)
    seq_start = tl.sum(tl.where(is_b, q_lo, 0), 0)
    n = tl.sum(tl.where(is_b, n_vec, 0), 0)
    ctx = tl.load(ctx_ptr + b)

    # Rows are (token, query head of this KV head) pairs: GQA packing, so each K/V tile is read once.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = q_tile * BLOCK_Q + offs_m // BLOCK_G  # [BLOCK_M] index among the sequence's new tokens
    g = offs_m % BLOCK_G
    row_mask = (tok < n) & (g < GROUP)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + (seq_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None], other=0.0)  # [BLOCK_M, D]
    if HAS_BITS:
        bits = tl.load(bits_ptr + seq_start + tok, mask=row_mask, other=0)  # [BLOCK_M] int64
        bits = tl.where(n > 64, 0, bits)  # a 64-bit mask cannot address longer chunks: causal, as the ref
        has_tree = tl.max((bits != 0).to(tl.int32), 0) > 0
    else:
        bits = tl.zeros([BLOCK_Q * BLOCK_G], tl.int64)
        has_tree = False
    # Causal tiles stop at their last token; a bitmask may point anywhere among the n new tokens.
    kv_hi = ctx + tl.where(has_tree, n, tl.minimum(n, (q_tile + 1) * BLOCK_Q))

    if SPLIT_TILES > 0:
        # Batch-invariant mode (kernels/invariant.py): splits at fixed positions, and every tile through the
        # masked code, so a row folds its keys in the same tiles and ops whatever its ctx / n split is.
        tiles_per_split = SPLIT_TILES
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_hi, BLOCK_N), num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, kv_hi)
    if SPLIT_TILES > 0:
        full_hi = lo
    else:
        full_hi = tl.maximum(lo, tl.minimum(hi, (ctx // BLOCK_N) * BLOCK_N))
    m_i = tl.full([BLOCK_Q * BLOCK_G], -1.0e30, tl.float32)  # finite: masked rows keep p = 0, not NaN
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    kv_head_off = kv_head * stride_kh
    if PREFETCH:  # the prefix's whole tiles, pipelined by hand (paged_decode._prefetched_tiles)
        acc, l_i, m_i = _prefetched_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, lo, full_hi, qk_scale,
                                          stride_kb, stride_kp, offs_n, offs_d, PAGE, BLOCK_N)
    elif BT_CHUNK > 0:  # the prefix's whole tiles, block ids read a chunk at a time (paged_decode._chunked_tiles)
        acc, l_i, m_i = _chunked_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, lo, full_hi, qk_scale,
                                       stride_kb, stride_kp, offs_n, offs_d, PAGE, BLOCK_N, BT_CHUNK)
    else:
        for start in range(lo, full_hi, BLOCK_N):
            acc, l_i, m_i = _tree_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, start, ctx, kv_hi, tok,
                                       bits, qk_scale, stride_kb, stride_kp, offs_n, offs_d, PAGE, HAS_BITS, False)
    for start in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _tree_tile(acc, l_i, m_i, q, k_ptr, v_ptr, bt_row, kv_head_off, start, ctx, kv_hi, tok,
                                   bits, qk_scale, stride_kb, stride_kp, offs_n, offs_d, PAGE, HAS_BITS, True)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    t = seq_start + tok
    o_ptrs = o_ptr + split * stride_os + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
    if IS_SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))  # log2 domain
        tl.store(lse_ptr + split * stride_ls + t * stride_lt + head, lse, mask=row_mask)


def tree_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, P, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    query_start: torch.Tensor,  # [B + 1] int32
    mask_bits: torch.Tensor | None,  # [T] int64
    scale: float,
    *,
    use_triton: bool | None = None,
    is_decode: bool = False,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Dispatch: the Triton kernel on CUDA (or when forced), the reference elsewhere (for decode batches, the
    batched CPU path of ``paged_decode_attention``). ``prefetch`` runs the
    prefix's whole tiles through the hand-pipelined loop of the decode kernel (then ``num_stages`` applies
    to nothing: 1); None takes ``TREE_PREFETCH``. ``chunk_tokens`` > 0 reads the prefix's block ids that
    many tokens at a time (the decode kernel's ``_chunked_tiles``), 0 never; None takes ``TREE_CHUNK_TOKENS``
    for query tiles of ``TREE_CHUNK_ROWS`` rows or more where the caller fixed no launch parameter.

    ``is_decode=True`` promises one new token per sequence (``query_start == arange(B + 1)``) and
    routes to the split-KV decode kernel; the promise is not checked (that would sync).
    """
    inv = invariant.enabled()
    if not dispatch.use_triton(q, use_triton):
        if inv:  # every row over its own keys in fixed tiles, as the kernels do (decode rows included)
            return invariant_attention_ref(q, k_cache, v_cache, block_tables, context_lens, query_start, mask_bits,
                                           scale)
        if is_decode:  # one token a sequence: the whole batch at once
            return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, use_triton=False,
                                          len_offset=1)
        cpu = tree_attention_batched if paged_decode.BATCHED_CPU else tree_attention_ref
        return cpu(q, k_cache, v_cache, block_tables, context_lens, query_start, mask_bits, scale)
    if is_decode and not inv:  # (batch-invariant decode rows take the tree kernel, as every other row)
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, use_triton=True,
                                      len_offset=1)
    (T, H, D), (_, P, Hkv, _), B = q.shape, k_cache.shape, context_lens.shape[0]
    if (H % Hkv or D & (D - 1) or D < 16 or q.stride(-1) != 1 or k_cache.stride() != v_cache.stride()
            or k_cache.stride(-1) != 1):
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, kv {tuple(k_cache.shape)}")
    out = torch.empty_like(q)
    if T == 0:
        return out
    G = H // Hkv
    block_g = triton.next_power_of_2(G)
    if inv:
        return _invariant_launch(q, k_cache, v_cache, block_tables, context_lens, query_start, mask_bits, scale, out,
                                 block_g)
    prefetch = TREE_PREFETCH if prefetch is None else prefetch
    # One query tile per tree (up to 128 rows); chunked prefill takes several.
    block_q = min(triton.next_power_of_2(-(-T // B)), max(1, 128 // block_g))
    block_q = max(block_q, -(-16 // block_g))  # tl.dot needs M >= 16
    num_slots = -(-T // block_q) + min(B, T)  # >= sum over sequences of ceil(n_b / block_q)
    # Measured on an H200 (bench/kernels/bench_attention.py): tiles of <= 32 rows stream 128-key steps;
    # 64- and 128-row tiles (trees of 16+ nodes, prefill) run 32-key steps 7 stages deep.
    # Timed on trees (at most 64 nodes: the mask's bits) at head dim 128 only; prefill chunks keep their steps.
    if (chunk_tokens is None and block_n is None and num_stages is None and not prefetch and TREE_CHUNK_TOKENS > 0
            and block_q * block_g >= TREE_CHUNK_ROWS and D == 128 and -(-T // B) <= 64):
        chunk, (block_n, num_stages) = TREE_CHUNK_TOKENS, TREE_CHUNK_TILE
    else:
        chunk = 0 if prefetch or chunk_tokens is None else chunk_tokens
    block_n = block_n or (128 if block_q * block_g <= 32 else 32)
    num_stages = num_stages or (2 if block_n == 128 else 7)
    busy_programs = max(B, -(-T // block_q)) * Hkv  # slots past the real tiles exit at once
    S = num_splits or pick_num_splits(busy_programs, block_tables.shape[1] * P, q.device, TREE_PROGRAMS_PER_SM)
    o_part = out.unsqueeze(0) if S == 1 else q.new_empty(S, T, H, D, dtype=torch.float32)  # [S, T, H, D]
    lse = q.new_empty(S, T, H, dtype=torch.float32)  # [S, T, H]
    _tree_attention_kernel[(num_slots, Hkv, S)](
        q, k_cache, v_cache, block_tables, context_lens, query_start, q if mask_bits is None else mask_bits,
        o_part, lse, scale * LOG2E, B, S,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=G, PAGE=P, HEAD_DIM=D, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=block_n,
        # BLOCK_B has a floor: one compiled variant for every batch up to 64 sequences
        BLOCK_B=max(64, triton.next_power_of_2(B)), IS_SPLIT=S > 1, HAS_BITS=mask_bits is not None, PREFETCH=prefetch,
        BT_CHUNK=chunk_pages(chunk, P, block_n),
        num_warps=num_warps or (4 if block_q * block_g <= 64 else 8), num_stages=1 if prefetch else num_stages,
        **pdl_meta(q.device))
    if S > 1:
        merge_splits(o_part, lse, out)
    return out


def invariant_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, P, Hkv, D] one layer
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32
    query_start: torch.Tensor,  # [B + 1] int32
    mask_bits: torch.Tensor | None,  # [T] int64
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """The CPU's batch-invariant path (kernels/invariant.py), ``tree_attention_ref``'s maths in the kernels' order:
    each row folds its own logical keys -- the prefix, then its ancestors by depth (a branch node reads its
    path's slots) -- in tiles of ``invariant.BLOCK_N`` positions aligned to position 0, one online-softmax step a
    tile, every product and sum taken per row over a fixed length (elementwise products and sums, no matrix
    multiply whose blocking could follow the batch). A row's result then depends on its own keys alone, whatever
    shares the call or how its sequence's tokens split into prefix and new."""
    T, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    G, N = H // Hkv, invariant.BLOCK_N
    k_flat, v_flat = k_cache.reshape(-1, Hkv, D), v_cache.reshape(-1, Hkv, D)
    out = torch.empty_like(q)
    starts, ctxs = query_start.tolist(), context_lens.tolist()
    bits_all = None if mask_bits is None else mask_bits.tolist()
    for b, ctx in enumerate(ctxs):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0:
            continue
        # ends[i]: row i's last logical position; nodes[i][k]: the new token at depth k of its path
        nodes = []
        for i in range(n):
            bits = 0 if bits_all is None or n > 64 else bits_all[s + i] & ((1 << 64) - 1)
            nodes.append([j for j in range(i + 1) if bits >> j & 1] if bits else list(range(i + 1)))
        last = [ctx + len(path) - 1 for path in nodes]
        ends = torch.tensor(last, device=dev)
        tree_pos = torch.zeros(n, n, dtype=torch.long, device=dev)  # [row, depth] -> position ctx + node
        for i, path in enumerate(nodes):
            tree_pos[i, : len(path)] = ctx + torch.tensor(path, device=dev)
        table = block_tables[b].long()
        qf = q[s:e].float().reshape(n, Hkv, G, 1, D)
        m_i = torch.full((n, Hkv, G), -1.0e30, device=dev)
        l_i = torch.zeros(n, Hkv, G, device=dev)
        acc = torch.zeros(n, Hkv, G, D, device=dev)
        for start in range(0, max(last) + 1, N):
            pos = start + torch.arange(N, device=dev)  # [N] logical positions
            valid = pos[None, :] <= ends[:, None]  # [n, N]
            depth = (pos - ctx).clamp(0, n - 1)
            at = torch.where(pos[None, :] < ctx, pos[None, :], tree_pos[:, depth])  # [n, N] cache positions
            at = torch.where(valid, at, 0)
            slot = table[at // P] * P + at % P
            k = torch.where(valid[..., None, None], k_flat[slot], 0).float()  # [n, N, Hkv, D]
            v = torch.where(valid[..., None, None], v_flat[slot], 0).float()
            k, v = k.permute(0, 2, 1, 3)[:, :, None], v.permute(0, 2, 1, 3)[:, :, None]  # [n, Hkv, 1, N, D]
            sc = (qf * k).sum(-1) * scale  # [n, Hkv, G, N]
            sc = torch.where(valid[:, None, None, :], sc, float("-inf"))
            m_new = torch.maximum(m_i, sc.amax(-1))
            alpha = torch.exp(m_i - m_new)
            p = torch.exp(sc - m_new[..., None])
            l_i = l_i * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + (p[..., None] * v).sum(-2)
            m_i = m_new
        out[s:e] = (acc / l_i[..., None]).reshape(n, H, D).to(q.dtype)
    return out


def _invariant_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, query_start: torch.Tensor, mask_bits: torch.Tensor | None,
                      scale: float, out: torch.Tensor, block_g: int) -> torch.Tensor:
    """Batch-invariant mode's one launch config (kernels/invariant.py): query tiles of ``invariant.QUERY_ROWS``
    rows (at least one token's query heads), ``invariant.BLOCK_N``-key tiles, splits every
    ``invariant.SPLIT_TOKENS`` positions -- as many as the block table's width holds, the ones past a row's
    length empty and weighted 0 -- merged at one fixed width."""
    (T, H, D), (_, P, Hkv, _), B = q.shape, k_cache.shape, context_lens.shape[0]
    block_q = max(1, invariant.QUERY_ROWS // block_g)
    S = -(-block_tables.shape[1] * P // invariant.SPLIT_TOKENS)
    if S > invariant.MAX_SPLITS:
        raise ValueError(f"batch-invariant attention covers {invariant.MAX_SPLITS * invariant.SPLIT_TOKENS} "
                         f"positions; the block table spans {block_tables.shape[1] * P}")
    o_part = out.unsqueeze(0) if S == 1 else q.new_empty(S, T, H, D, dtype=torch.float32)
    lse = q.new_empty(S, T, H, dtype=torch.float32)
    # both kernels' tensors and strides, and the tile shapes they must share (a branch row's tile is a tree tile's)
    tensors = (q, k_cache, v_cache, block_tables, context_lens, query_start, q if mask_bits is None else mask_bits,
               o_part, lse)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
               o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1))
    meta = dict(GROUP=H // Hkv, PAGE=P, HEAD_DIM=D, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=invariant.BLOCK_N,
                BLOCK_B=max(64, triton.next_power_of_2(B)), IS_SPLIT=S > 1,
                SPLIT_TILES=invariant.SPLIT_TOKENS // invariant.BLOCK_N, num_warps=4, num_stages=2,
                **pdl_meta(q.device))
    _tree_attention_kernel[(-(-T // block_q) + min(B, T), Hkv, S)](
        *tensors, scale * LOG2E, B, S, *strides, HAS_BITS=mask_bits is not None, PREFETCH=False, **meta)
    if mask_bits is not None:  # tree nodes off the slot-ordered chain: again, each over its own path
        _branch_rows_kernel[(T, Hkv, S)](*tensors, scale * LOG2E, B, *strides, **meta)
    if S > 1:
        merge_splits(o_part, lse, out, block_s=invariant.MAX_SPLITS)
    return out


# Batch-invariant trees. A node whose ancestors are not the new tokens before it (a branch: its bits are not
# 0..i) sees them at scattered slots, so in the tree kernel's tiles its keys sit in other lanes than plain
# decoding would put them in, and fold in another order. This kernel computes each such node again, alone in a
# query tile of the same shape, over its own path: logical position ctx + k holds its depth-k ancestor (the
# k-th set bit of its mask), read from that node's slot, so every key lands in the lane a plain decoding step
# at position ctx + depth would give it, through the same masked tile code (_softmax_step). The prefix is read
# once more per such node: trees cost more attention traffic in this mode.
@triton.jit(do_not_specialize=["num_seqs"])
def _branch_rows_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, qs_ptr, bits_ptr, o_ptr, lse_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_btb,
    stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, IS_SPLIT: tl.constexpr, SPLIT_TILES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)  # one new token a program
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_seqs
    starts = tl.load(qs_ptr + offs_b, mask=b_mask, other=0)
    b = tl.sum(((starts <= t) & b_mask).to(tl.int32), 0) - 1  # the last sequence starting at or before t
    seq_start = tl.load(qs_ptr + b)
    n = tl.load(qs_ptr + b + 1) - seq_start
    i = (t - seq_start).to(tl.int64)
    bits = tl.load(bits_ptr + t)
    chain = tl.where(i >= 63, -1, (tl.full([], 1, tl.int64) << tl.minimum(i + 1, 62)) - 1)  # ancestors 0..i
    if (t < tl.load(qs_ptr + num_seqs)) & (n <= 64) & (bits != 0) & (bits != chain):
        ctx = tl.load(ctx_ptr + b)
        offs64 = tl.arange(0, 64).to(tl.int64)
        set_bit = (bits >> offs64) & 1  # [64]: node j is on the path
        rank = tl.cumsum(set_bit, 0) - 1  # [64]: its depth, where it is
        kv_hi = ctx + tl.sum(set_bit, 0)  # logical positions 0 .. ctx + depth
        offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        g = offs_m % BLOCK_G
        row_mask = (offs_m // BLOCK_G == 0) & (g < GROUP)  # the tile's first token: this node's query heads
        head = kv_head * GROUP + g
        q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_mask[:, None],
                    other=0.0)  # [BLOCK_M, D]
        lo = split * SPLIT_TILES * BLOCK_N
        hi = tl.minimum(lo + SPLIT_TILES * BLOCK_N, kv_hi)
        m_i = tl.full([BLOCK_Q * BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b * stride_btb
        kv_head_off = kv_head * stride_kh
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n  # [BLOCK_N] logical positions
            valid = pos < kv_hi
            k_idx = (pos - ctx).to(tl.int64)  # depth along the path; negative in the prefix
            hit = (set_bit[None, :] == 1) & (rank[None, :] == k_idx[:, None])  # [BLOCK_N, 64]
            node = tl.sum(tl.where(hit, offs64[None, :], 0), 1)  # the path's node at that depth
            slot = tl.where(k_idx >= 0, ctx + node, pos)  # where its K/V were written
            blk = tl.load(bt_row + slot // PAGE, mask=valid, other=0).to(tl.int64)
            kv_ptrs = (blk * stride_kb + (slot % PAGE) * stride_kp + kv_head_off)[:, None] + offs_d[None, :]
            k = tl.load(k_ptr + kv_ptrs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + kv_ptrs, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = o_ptr + split * stride_os + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
        if IS_SPLIT:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))
            tl.store(lse_ptr + split * stride_ls + t * stride_lt + head, lse, mask=row_mask)
