"""Prompt-lookup drafting on the device: for each row of token ids, the tokens that followed the newest
earlier occurrence of its last n tokens.

Row ``b`` holds ``lens[b]`` tokens (the rest of the row is stale). For n from ``max_n`` down to ``min_n``,
the first n with a match wins: the newest start ``s`` with ``row[s : s + n] == row[L - n : L]``,
``s >= L - window`` and ``s + n <= L - 1`` (a match ends before the last token, so the key never matches
itself). The draft is ``row[s + n : s + n + K]``, cut at
the row's end; places with no draft hold token 0. That is ``draft.ngram.NgramDrafter.continuations``' first
continuation, as the host finds it with ``bytes.rfind``.

The overlapped chain steps (gateway/chain_ahead.py) draft here, between two launches, with nothing read on
the host. The reference takes ~35 torch ops a call (each a launch on CUDA); the kernel is one launch: one
program a row, scanning its window in blocks for every n at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def ngram_lookup_ref(hist: torch.Tensor, lens: torch.Tensor, span: int, K: int, max_n: int, min_n: int,
                     window: int) -> torch.Tensor:
    """[B, K] int64 drafts (see the module's docstring). ``hist`` [B, cap] int64, ``lens`` [B] int64;
    ``span`` bounds every row's length (the columns scanned)."""
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
    return torch.where(ok, drafts, torch.zeros_like(drafts))


# The window and the row stride are fixed per run, but lens change every step: nothing here is specialised
# on a value that moves (a new variant would compile mid-serving).
@triton.jit(do_not_specialize=["stride", "out_stride", "window"])
def _ngram_lookup_kernel(hist_ptr, lens_ptr, out_ptr, stride, out_stride, window,
                         K: tl.constexpr, KP: tl.constexpr, MAX_N: tl.constexpr, MIN_N: tl.constexpr,
                         BLOCK: tl.constexpr):
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
    tl.store(out_ptr + b.to(tl.int64) * out_stride + i, drafts, mask=i < K)


def ngram_lookup(hist: torch.Tensor, lens: torch.Tensor, span: int, K: int, max_n: int, min_n: int, window: int,
                 *, use_triton: bool | None = None, block: int = 512) -> torch.Tensor:
    """Dispatch: the kernel on CUDA (or when forced: CPU tensors need TRITON_INTERPRET=1), the reference
    elsewhere. Same contract as ``ngram_lookup_ref``."""
    if not (hist.is_cuda if use_triton is None else use_triton):
        return ngram_lookup_ref(hist, lens, span, K, max_n, min_n, window)
    if hist.dim() != 2 or hist.stride(1) != 1 or hist.dtype != torch.int64 or lens.shape != hist.shape[:1]:
        raise ValueError(f"hist must be [B, cap] int64 with unit column stride and lens [B], got "
                         f"{tuple(hist.shape)} {hist.dtype}, {tuple(lens.shape)}")
    if not 1 <= min_n <= max_n or K < 1:
        raise ValueError(f"need 1 <= min_n <= max_n and K >= 1, got {min_n}, {max_n}, {K}")
    B = hist.shape[0]
    out = torch.empty(B, K, dtype=torch.int64, device=hist.device)
    if B:
        _ngram_lookup_kernel[(B,)](hist, lens, out, hist.stride(0), out.stride(0), window,
                                   K=K, KP=triton.next_power_of_2(K), MAX_N=max_n, MIN_N=min_n, BLOCK=block,
                                   num_warps=4)
    return out
