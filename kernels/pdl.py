"""Programmatic dependent launch (PDL) for the kernels of a forward, on sm_90 and newer.

A launch with ``launch_pdl=True`` may start before the kernel ahead of it on the stream has finished: once
every program of that kernel has called ``gdc_launch_dependents`` (or exited). The new kernel runs what
reads no earlier output -- the INT4 GEMV issues its first weight tiles -- and ``gdc_wait`` then blocks until
the kernel ahead has finished and its writes are visible. Every kernel of the chain waits before it touches
an activation, so each also finishes after every kernel before it: the order the stream gives is kept.

Only a kernel ahead that signals lets its follower start early. A GEMV after an RMSNorm, a rope or an
attention kernel that did not signal starts at their end, as without PDL, and its weight prefetch overlaps
nothing; so the small kernels of a layer signal as soon as they start (their followers then wait on the
SM in ``gdc_wait``; at most one wave of them, since the signal waits for every program of the kernel
ahead to have started).

``SPECGATE_PDL=0`` turns it off for every kernel (``SPECGATE_INT4_PDL`` is its old name), and
``SPECGATE_PDL=int4`` keeps it for the INT4 kernels alone, as before the small kernels had it: the A/B arms.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

_MODE = os.environ.get("SPECGATE_PDL", os.environ.get("SPECGATE_INT4_PDL", "1"))
ENABLED = _MODE != "0"  # the INT4 kernels (pdl_ok)
SMALL = _MODE not in ("0", "int4")  # the small kernels too (pdl_meta)
_DEVICES: dict[torch.device, bool] = {}


def pdl_ok(device: torch.device) -> bool:
    """PDL for launches on ``device``: CUDA on sm_90 or newer, and not switched off."""
    if not (ENABLED and device.type == "cuda"):
        return False
    if device not in _DEVICES:
        _DEVICES[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _DEVICES[device]


def pdl_meta(device: torch.device) -> dict:
    """A small kernel's launch meta-parameters: its ``USE_PDL`` constexpr, and ``launch_pdl`` where it is on."""
    on = SMALL and pdl_ok(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """A small kernel's first statement: wait for the kernel ahead, then let the next one start."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
