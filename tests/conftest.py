"""Test-wide setup: Triton's interpreter on CPU (compiled kernels where CUDA exists).

``triton.jit`` picks interpreter or compiler when a kernel module is imported, so the variable must be
set before any ``kernels.*`` import; pytest loads this file before the test modules beside it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.runtime.interpreter as _interp  # noqa: E402


def _patch_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them into Python ints with
    ``int(array)``, which NumPy >= 2.4 refuses; every ``range(lo, hi)`` with a runtime bound then fails.
    Re-register ``__index__`` through ``.item()``."""
    patch_tensor = getattr(_interp, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_scalar_index_fixed", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._scalar_index_fixed = True
    _interp._patch_lang_tensor = patched


_patch_scalar_index()
