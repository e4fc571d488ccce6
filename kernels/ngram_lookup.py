"""Prompt-lookup drafting on the device: for each row of token ids, the tokens that followed the newest
earlier occurrence of its last n tokens.

Row ``b`` holds ``lens[b]`` tokens (the rest of the row is stale). For n from ``max_n`` down to ``min_n``,
the first n with a match wins: the newest start ``s`` with ``row[s : s + n] == row[L - n : L]``,
``s >= L - window`` and ``s + n <= L - 1`` (a match ends before the last token, so the key never matches
itself). The draft is ``row[s + n : s + n + K]``, cut at
the row's end; places with no draft hold token 0. That is ``draft.ngram.NgramDrafter.continuations``' first
continuation, as the host finds it with ``bytes.rfind``.

A row with no match can draft from an n-gram table instead (``draft.ngram.NgramTable``, the REST-style
static table shipped beside a draft): the top next token after the longest suffix of the row the table holds,
then after that suffix grown by the token, level by level until the table holds no suffix (the rest: 0). On the
device the table is an open-addressing hash table (``pack_table``: each context packed into one int64 key,
linear probing at a load factor of at most 1/2): a level loads every context size's whole probe window at
once, so a chain of K levels costs K rounds of loads, not a search's dependent chain per size and level.
That is ``NgramDrafter.table_continuations``' first continuation.

The overlapped chain steps (gateway/chain_ahead.py) draft here, between two launches, with nothing read on
the host. The reference takes ~35 torch ops a call (each a launch on CUDA); the kernel is one launch: one
program a row, scanning its window in blocks for every n at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOKEN_BITS = 20  # a packed table key: n, then n tokens of TOKEN_BITS each (n <= 3: 62 bits)
TABLE_MAX_N = 3
_BITS = tl.constexpr(TOKEN_BITS)


def pack_key(ctx: tuple[int, ...] | list[int]) -> int:
    """The int64 key of a table context of 1..TABLE_MAX_N tokens, each below 2**TOKEN_BITS."""
    key = len(ctx)
    for t in ctx:
        key = (key << TOKEN_BITS) | t
    return key


def table_hash(key):
    """The slot hash of packed keys: Python ints, int64 tensors and Triton values alike (no product reaches
    2**63, so nothing wraps)."""
    m = (1 << TOKEN_BITS) - 1
    f = (key & m) ^ (((key >> 20) & m) * 7919) ^ (((key >> 40) & m) * 104729) ^ ((key >> 60) * 1299709)
    f = f ^ (f >> 13)
    f = (f & 0xFFFFFFF) * 0x5BD1E995
    return f ^ (f >> 15)


MAX_PROBES = 64


def pack_table(entries: dict[tuple[int, ...], tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(keys [S] int64, next [S] int64, probes): each context's key in its slot (-1: an empty slot) and its top
    next token, S a power of two at least twice the contexts, every key within ``probes`` slots of its hash;
    None where a context is longer than TABLE_MAX_N or a token does not fit TOKEN_BITS (the device then drafts
    no table)."""
    if any(len(c) > TABLE_MAX_N or max(*c, *v) >= 1 << TOKEN_BITS for c, v in entries.items() if v):
        return None
    pairs = [(pack_key(c), v[0]) for c, v in entries.items() if v]
    size = max(2, 1 << (2 * len(pairs) - 1).bit_length())
    while True:
        keys, nxt, probes = [-1] * size, [0] * size, 1
        for k, v in pairs:
            i = table_hash(k) & (size - 1)
            d = 0
            while keys[(i + d) & (size - 1)] != -1:
                d += 1
            keys[(i + d) & (size - 1)], nxt[(i + d) & (size - 1)] = k, v
            probes = max(probes, d + 1)
        if probes <= MAX_PROBES:
            return torch.tensor(keys, dtype=torch.int64), torch.tensor(nxt, dtype=torch.int64), probes
        size *= 2  # a cluster too long for one window of loads: spread the keys thinner


def ngram_lookup_ref(hist: torch.Tensor, lens: torch.Tensor, span: int, K: int, max_n: int, min_n: int,
                     window: int, table: tuple | None = None) -> torch.Tensor:
    """[B, K] int64 drafts (see the module's docstring). ``hist`` [B, cap] int64, ``lens`` [B] int64;
    ``span`` bounds every row's length (the columns scanned); ``table``: (keys, next, min_n, max_n, probes):
    ``pack_table``'s and the table's sizes, for the rows with no match."""
    B = hist.shape[0]
    view = hist[:, :span]
    lo = (lens - window).clamp(min=0)
    start = torch.full((B,), -1, dtype=torch.int64, device=hist.device)  # where the continuation begins
    for n in range(max_n, min_n - 1, -1):
        if span < n:
            continue
        key = hist.gather(1, ((lens - n).clamp(min=0))[:, None] + torch.arange(n, device=hist.device))  # [B, n]
        hit = (view.unfold(1, n, 1) == key[:, None, :]).all(-1)  # [B, span - n + 1]: a match starting at s
        s = torch.arange(hit.shape[1], device=hist.device)
        hit &= (s[None, :] + n <= (lens - 1)[:, None]) & (s[None, :] >= lo[:, None])
        found = torch.where(hit, s[None, :], -1).amax(1)
        take = (start < 0) & (found >= 0)
        start = torch.where(take, found + n, start)
    at = start[:, None] + torch.arange(K, device=hist.device)  # [B, K]
    ok = (start >= 0)[:, None] & (at < lens[:, None])
    drafts = hist.gather(1, at.clamp(min=0, max=hist.shape[1] - 1))
    drafts = torch.where(ok, drafts, torch.zeros_like(drafts))
    if table is not None and table[0].numel():
        drafts = torch.where((start >= 0)[:, None], drafts, _table_chains_ref(hist, lens, K, *table))
    return drafts


def _table_chains_ref(hist: torch.Tensor, lens: torch.Tensor, K: int, keys: torch.Tensor, nxt: torch.Tensor,
                      min_n: int, max_n: int, probes: int) -> torch.Tensor:
    """[B, K]: each row's table chain (see the module's docstring), 0 past where it stops."""
    B, dev = hist.shape[0], hist.device
    at = lens[:, None] - max_n + torch.arange(max_n, device=dev)  # the last max_n tokens, oldest first
    ctx = torch.where(at >= 0, hist.gather(1, at.clamp(min=0)), -1)  # -1: before the row's start
    live = torch.ones(B, dtype=torch.bool, device=dev)
    out = torch.zeros(B, K, dtype=torch.int64, device=dev)
    window = torch.arange(probes, device=dev)
    for level in range(K):
        tok = torch.full((B,), -1, dtype=torch.int64, device=dev)
        for n in range(max_n, min_n - 1, -1):
            key = torch.full((B,), n, dtype=torch.int64, device=dev)
            for j in range(max_n - n, max_n):
                key = (key << TOKEN_BITS) | ctx[:, j].clamp(min=0)
            slots = (table_hash(key)[:, None] + window) & (keys.numel() - 1)  # [B, probes]
            hit = keys[slots] == key[:, None]
            found = torch.where(hit, nxt[slots], -1).amax(1)
            take = (tok < 0) & (ctx[:, max_n - n] >= 0) & (found >= 0)
            tok = torch.where(take, found, tok)
        live &= tok >= 0
        out[:, level] = torch.where(live, tok, 0)
        ctx = torch.cat([ctx[:, 1:], tok[:, None]], 1)
    return out


@triton.jit
def _table_hash(key):
    """``table_hash`` in the kernel (a jitted function cannot be called from the host, nor read its globals)."""
    f = (key & 0xFFFFF) ^ (((key >> 20) & 0xFFFFF) * 7919) ^ (((key >> 40) & 0xFFFFF) * 104729) ^ ((key >> 60) * 1299709)
    f = f ^ (f >> 13)
    f = (f & 0xFFFFFFF) * 0x5BD1E995
    return f ^ (f >> 15)


@triton.jit
def _table_next(keys_ptr, nxt_ptr, mask, c0, c1, c2, avail, TMIN_N: tl.constexpr, TMAX_N: tl.constexpr,
                NP: tl.constexpr, PROBES: tl.constexpr, PP: tl.constexpr):
    """The table's top next token after the context ending ``c0 c1 c2`` (``c2`` the newest; ``avail`` tokens
    of it exist), longest suffix first; -1 where it holds none. One lane per context size, each loading its
    whole probe window at once."""
    n = TMAX_N - tl.arange(0, NP)  # [NP]: the context sizes, longest first
    key = n.to(tl.int64)
    key = tl.where(n >= 3, (key << _BITS) | c0, key)
    key = tl.where(n >= 2, (key << _BITS) | c1, key)
    key = (key << _BITS) | c2
    ok = (n >= TMIN_N) & (avail >= n)
    p = tl.arange(0, PP)
    slots = (_table_hash(key)[:, None] + p[None, :]) & mask  # [NP, PP]
    use = ok[:, None] & (p[None, :] < PROBES)
    hit = use & (tl.load(keys_ptr + slots, mask=use, other=-1) == key[:, None])
    found = tl.max(tl.where(hit, tl.load(nxt_ptr + slots, mask=hit, other=-1), -1), 1)  # [NP]
    best = tl.max(tl.where(found >= 0, n, 0), 0)  # the longest size that holds the context
    return tl.max(tl.where((found >= 0) & (n == best), found, -1), 0).to(tl.int32)


# The window and the row stride are fixed per run, but lens change every step: nothing here is specialised
# on a value that moves, nor on the table's size (a new variant would compile mid-serving).
@triton.jit(do_not_specialize=["stride", "out_stride", "window", "mask"])
def _ngram_lookup_kernel(hist_ptr, lens_ptr, out_ptr, stride, out_stride, window, keys_ptr, nxt_ptr, mask,
                         K: tl.constexpr, KP: tl.constexpr, MAX_N: tl.constexpr, MIN_N: tl.constexpr,
                         BLOCK: tl.constexpr, TABLE: tl.constexpr, TMIN_N: tl.constexpr, TMAX_N: tl.constexpr,
                         NP: tl.constexpr, PROBES: tl.constexpr, PP: tl.constexpr):
    b = tl.program_id(0)
    row = hist_ptr + b.to(tl.int64) * stride
    L = tl.load(lens_ptr + b).to(tl.int32)  # positions inside a row: 32 bits (the row's base is 64)
    lo = tl.maximum(L - window, 0)
    start = L * 0 - 1  # int32, as the loop carries it
    for n in tl.static_range(MAX_N, MIN_N - 1, -1):
        last = L - 1 - n  # the newest start a match may have
        best = L * 0 - 1
        for s0 in range(lo, last + 1, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            hit = s <= last
            for j in tl.static_range(n):
                key = tl.load(row + L - n + j)
                hit = hit & (tl.load(row + s + j, mask=s <= last, other=-1) == key)
            best = tl.maximum(best, tl.max(tl.where(hit, s, -1), 0))
        take = (start < 0) & (best >= 0)
        start = tl.where(take, best + n, start)
    i = tl.arange(0, KP)
    at = start + i
    ok = (start >= 0) & (i < K) & (at < L)
    drafts = tl.load(row + at, mask=ok, other=0)
    if TABLE:
        if start < 0:  # no match in the row: its table chain
            c0 = tl.load(row + L - 3, mask=L >= 3, other=0)
            c1 = tl.load(row + L - 2, mask=L >= 2, other=0)
            c2 = tl.load(row + L - 1, mask=L >= 1, other=0)
            live = L >= 0
            for level in tl.static_range(K):
                tok = _table_next(keys_ptr, nxt_ptr, mask, c0, c1, c2, L + level, TMIN_N, TMAX_N, NP, PROBES, PP)
                live = live & (tok >= 0)
                drafts = tl.where((i == level) & live, tok.to(tl.int64), drafts)
                c0 = c1
                c1 = c2
                c2 = tok.to(tl.int64)
    tl.store(out_ptr + b.to(tl.int64) * out_stride + i, drafts, mask=i < K)


def ngram_lookup(hist: torch.Tensor, lens: torch.Tensor, span: int, K: int, max_n: int, min_n: int, window: int,
                 table: tuple | None = None, *, use_triton: bool | None = None, block: int = 512) -> torch.Tensor:
    """Dispatch: the kernel on CUDA (or when forced: CPU tensors need TRITON_INTERPRET=1), the reference
    elsewhere. Same contract as ``ngram_lookup_ref``."""
    if table is not None and not 1 <= table[2] <= table[3] <= TABLE_MAX_N:
        raise ValueError(f"a device table needs 1 <= min_n <= max_n <= {TABLE_MAX_N}, got {table[2]}, {table[3]}")
    if not (hist.is_cuda if use_triton is None else use_triton):
        return ngram_lookup_ref(hist, lens, span, K, max_n, min_n, window, table)
    if hist.dim() != 2 or hist.stride(1) != 1 or hist.dtype != torch.int64 or lens.shape != hist.shape[:1]:
        raise ValueError(f"hist must be [B, cap] int64 with unit column stride and lens [B], got "
                         f"{tuple(hist.shape)} {hist.dtype}, {tuple(lens.shape)}")
    if not 1 <= min_n <= max_n or K < 1:
        raise ValueError(f"need 1 <= min_n <= max_n and K >= 1, got {min_n}, {max_n}, {K}")
    B = hist.shape[0]
    out = torch.empty(B, K, dtype=torch.int64, device=hist.device)
    keys, nxt, t_min, t_max, probes = table if table is not None and table[0].numel() else (lens, lens, 1, 1, 1)
    if B:
        _ngram_lookup_kernel[(B,)](hist, lens, out, hist.stride(0), out.stride(0), window, keys, nxt, keys.numel() - 1,
                                   K=K, KP=triton.next_power_of_2(K), MAX_N=max_n, MIN_N=min_n, BLOCK=block,
                                   TABLE=keys is not lens, TMIN_N=t_min, TMAX_N=t_max,
                                   NP=triton.next_power_of_2(t_max - t_min + 1), PROBES=probes,
                                   PP=triton.next_power_of_2(probes), num_warps=4)
    return out
