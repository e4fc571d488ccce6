"""Stochastic tree verification in one launch: every node's recursive rejection sampling and its bonus draw.

``verify.accept._stochastic_parallel`` decides, for every node row of a step's sampled trees at once, which
child the node accepts (SpecInfer's multi-candidate rejection sampling with Sequoia's without-replacement
residual) and the bonus token it would emit if the path ended there. In torch that is about twenty passes
over the ``[R, V]`` rows, each a launch: on an H200 a 16-node tree cost 1.3-1.6 ms at batch 1, as much as the
135M target's forward (bench/results/sampling_step.json). Here one program owns one node row and makes the
same decisions from the same draws (``u`` per sibling trial, ``race`` ~ Exp(1) per token): each rejection costs
one pass over the row for the new residual's normaliser, and the bonus one more pass, in registers.

The residual is never written out. With ``q`` the node's draft distribution, trial ``i`` rejecting token
``t_i`` turns the pair into ``p <- max(p - q, 0) / Z_i`` and ``q <- q[t_i := 0] / S_i`` (each kept as it was
where its mass is zero, as ``normalise`` falls back). Both are elementwise given the scalars ``Z_i``, ``S_i``
and ``t_i``, so a pass recomputes the chain of earlier rejections per element (at most ``K - 1`` of them, ``K``
the widest node's children). Point-mass trees (no ``q``) zero each rejected token of ``p`` and test the next
child against the mass left.

``residual_decisions_ref`` is the torch form, the CPU's path and the tests' reference (its bonus drawn by the
caller: an exponential race as here, or the CPU's inverse CDF).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TINY = torch.finfo(torch.float32).tiny


def normalise(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """x / sum(x), or ``fallback`` when x has no mass (no host sync).

    For the Sequoia residual max(p - q, 0), zero mass means p <= q everywhere, i.e. p == q, where the
    rejection that led here has probability zero: it can only come from float rounding, so keeping p is
    as good as any choice. For q with t zeroed, zero mass means q was a point mass at t and no sibling can
    follow; a drafter that still adds one hits the zero-probability check (``verify.accept``).
    """
    mass = x.sum(-1, keepdim=True)  # one vector, or each row of a matrix
    return torch.where(mass > 0, x / mass.clamp_min(TINY), fallback)


def residual_decisions_ref(p: torch.Tensor, q: torch.Tensor | None, kid: torch.Tensor, kid_tok: torch.Tensor,
                           u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p [R, V] processed target probabilities (need not sum to 1), q [R, V] draft probabilities or None (point
    masses), kid / kid_tok [R, K] each node's children (indices in its tree, -1 padded; tokens, 0 padded), u [R, K]
    uniforms -> each node's accepted child ([R] int64, -1 for none), a flag set where a tried token had no draft
    probability ([R] bool), and the final residual [R, V] its bonus is drawn from."""
    R, K = kid.shape
    if q is not None:  # p - q needs both on one scale
        p, q = normalise(p, fallback=p), normalise(q, fallback=q)
    child = torch.full((R,), -1, dtype=torch.int64, device=p.device)
    bad = torch.zeros(R, dtype=torch.bool, device=p.device)
    for j in range(K):
        t = kid_tok[:, j : j + 1]  # [R, 1]
        live = (kid[:, j] >= 0) & (child < 0)  # [R]: a child to try, none accepted yet
        p_t = p.gather(1, t)[:, 0]
        q_t = p.sum(-1) if q is None else q.gather(1, t)[:, 0]  # a point mass is one-hot(t) at p's scale
        bad = bad | (live & (q_t <= 0))
        ok = live & (u[:, j] * q_t < p_t)  # u < p_t / q_t
        child = torch.where(ok, kid[:, j], child)
        rejected = (live & ~ok)[:, None]  # [R, 1]
        if q is None:
            p = torch.where(rejected, p.scatter(1, t, 0.0), p)
        else:
            p = torch.where(rejected, normalise((p - q).clamp_min(0), fallback=p), p)
            q = torch.where(rejected, normalise(q.scatter(1, t, 0.0), fallback=q), q)
    return child, bad, p


@triton.jit
def _chain(v, w, offs, zd, sd, fz, fs, tt, n, KP: tl.constexpr):
    """The target and draft values ``v``, ``w`` at tokens ``offs`` after the row's first ``n`` rejections:
    level i applies ``max(v - w, 0) / zd[i]`` unless ``fz[i]`` (no mass: kept), then ``w[t_i := 0] / sd[i]``
    unless ``fs[i]``."""
    k = tl.arange(0, KP)
    for i in tl.static_range(KP):
        on = i < n
        z = tl.sum(tl.where(k == i, zd, 0.0), 0)
        s = tl.sum(tl.where(k == i, sd, 0.0), 0)
        keep_v = tl.sum(tl.where(k == i, fz, 0), 0) != 0
        keep_w = tl.sum(tl.where(k == i, fs, 0), 0) != 0
        t = tl.sum(tl.where(k == i, tt, 0), 0)
        v_new = tl.where(keep_v, v, tl.maximum(v - w, 0.0) / z)
        w_new = tl.where(keep_w, w, tl.where(offs == t, 0.0, w) / s)
        v = tl.where(on, v_new, v)
        w = tl.where(on, w_new, w)
    return v, w


@triton.jit
def _stochastic_accept_kernel(p_ptr, q_ptr, kid_ptr, tok_ptr, u_ptr, race_ptr, out_ptr, R, V,
                              stride_p, stride_q, stride_race,
                              K: tl.constexpr, KP: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    p_row = p_ptr + row.to(tl.int64) * stride_p
    q_row = q_ptr + row.to(tl.int64) * stride_q
    race_row = race_ptr + row.to(tl.int64) * stride_race
    offs = tl.arange(0, BLOCK)
    k = tl.arange(0, KP)
    # the row's masses: the normalisers of p and q (HAS_Q), or the point-mass test's running mass
    psum = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    qsum = psum
    for lo in range(0, V, BLOCK):
        m = lo + offs < V
        psum += tl.sum(tl.load(p_row + lo + offs, mask=m, other=0.0), 0)
        if HAS_Q:
            qsum += tl.sum(tl.load(q_row + lo + offs, mask=m, other=0.0), 0)
    pd = tl.where(psum > 0, tl.maximum(psum, 1.1754943508222875e-38), 1.0)  # normalise's fallback: as it was
    qd = tl.where(qsum > 0, tl.maximum(qsum, 1.1754943508222875e-38), 1.0)
    zd = tl.full([KP], 1.0, tl.float32)  # per rejection: Z_i (or 1), S_i (or 1), kept flags, the token
    sd = tl.full([KP], 1.0, tl.float32)
    fz = tl.zeros([KP], tl.int32)
    fs = tl.zeros([KP], tl.int32)
    tt = tl.zeros([KP], tl.int64)
    n = row * 0  # rejections so far (every trial before a live one was a rejection)
    child = (row * 0 - 1).to(tl.int64)
    bad = row * 0
    mass = psum  # point masses: p's mass left after zeroing the rejected tokens
    for j in tl.static_range(K):
        kid = tl.load(kid_ptr + row * K + j)
        t = tl.load(tok_ptr + row * K + j)
        live = (kid >= 0) & (child < 0)
        if HAS_Q:
            p_t, q_t = _chain(tl.load(p_row + t) / pd, tl.load(q_row + t) / qd, t, zd, sd, fz, fs, tt, n, KP)
        else:
            p_t = tl.load(p_row + t)
            q_t = mass
        bad = tl.where(live & (q_t <= 0), 1, bad)
        ok = live & (tl.load(u_ptr + row * K + j) * q_t < p_t)
        child = tl.where(ok, kid, child)
        rejected = live & (ok == 0)
        if rejected:
            if HAS_Q:  # the new residual's normalisers, one pass over the row
                zs = tl.zeros([BLOCK], tl.float32)
                ss = tl.zeros([BLOCK], tl.float32)
                for lo in range(0, V, BLOCK):
                    x = lo + offs
                    m = x < V
                    rv, rw = _chain(tl.load(p_row + x, mask=m, other=0.0) / pd,
                                    tl.load(q_row + x, mask=m, other=0.0) / qd, x, zd, sd, fz, fs, tt, n, KP)
                    zs += tl.maximum(rv - rw, 0.0)
                    ss += tl.where(x == t, 0.0, rw)
                z = tl.sum(zs, 0)
                s = tl.sum(ss, 0)
                zd = tl.where(k == n, tl.maximum(z, 1.1754943508222875e-38), zd)
                sd = tl.where(k == n, tl.maximum(s, 1.1754943508222875e-38), sd)
                fz = tl.where(k == n, (z <= 0).to(tl.int32), fz)
                fs = tl.where(k == n, (s <= 0).to(tl.int32), fs)
            else:
                mass = mass - p_t
            tt = tl.where(k == n, t.to(tl.int64), tt)
            n += 1
    # the bonus: an exponential race over the final residual (first index on ties, as torch's argmax)
    best = tl.full([BLOCK], -2.0, tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for lo in range(0, V, BLOCK):
        x = lo + offs
        m = x < V
        bv = tl.load(p_row + x, mask=m, other=0.0)
        if HAS_Q:
            bv, bw = _chain(bv / pd, tl.load(q_row + x, mask=m, other=0.0) / qd, x, zd, sd, fz, fs, tt, n, KP)
        else:
            for i in tl.static_range(KP):
                bv = tl.where((i < n) & (x == tl.sum(tl.where(k == i, tt, 0), 0)), 0.0, bv)
        e = tl.load(race_row + x, mask=m, other=1.0)
        score = tl.where(m, tl.where(bv > 0, bv / e, -1.0), -2.0)
        better = score > best
        best = tl.where(better, score, best)
        best_at = tl.where(better, x, best_at)
    top = tl.max(best, 0)
    bonus = tl.min(tl.where(best == top, best_at, V), 0)
    tl.store(out_ptr + row, child.to(tl.int64))
    tl.store(out_ptr + R + row, bonus.to(tl.int64))
    tl.store(out_ptr + 2 * R + row, bad.to(tl.int64))


def stochastic_accept(p: torch.Tensor, q: torch.Tensor | None, kid: torch.Tensor, kid_tok: torch.Tensor,
                      u: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """``residual_decisions_ref``'s decisions and each node's bonus, the argmax of ``p_i / race_i`` over its final
    residual (race [R, V] ~ Exp(1)), from one launch: int64 [3R] of accepted children, bonuses and flags. CUDA
    tensors, or CPU tensors under TRITON_INTERPRET=1."""
    R, V = p.shape
    K = kid.shape[1]
    if p.stride(-1) != 1 or race.stride(-1) != 1 or (q is not None and q.stride(-1) != 1):
        raise ValueError("stochastic_accept takes rows with unit stride")
    kid, kid_tok, u = kid.contiguous(), kid_tok.contiguous(), u.float().contiguous()
    out = torch.empty(3 * R, dtype=torch.int64, device=p.device)
    _stochastic_accept_kernel[(R,)](p, p if q is None else q, kid, kid_tok, u, race, out, R, V,
                                    p.stride(0), 0 if q is None else q.stride(0), race.stride(0),
                                    K=K, KP=triton.next_power_of_2(max(K, 1)), HAS_Q=q is not None, BLOCK=1024,
                                    num_warps=4)
    return out
