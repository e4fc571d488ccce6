"""The commit a benchmark result names.

``BENCH_COMMIT`` wins when set: the device tool copies the working tree, and its copy of ``.git`` can be
stale, so the caller names the tree it sent. Otherwise git is asked, in this repository.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit(describe: bool = False) -> str:
    """``BENCH_COMMIT``, else ``git rev-parse --short HEAD`` (``describe``: ``git describe --always --dirty``);
    "unknown" without git."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    cmd = ["git", "describe", "--always", "--dirty"] if describe else ["git", "rev-parse", "--short", "HEAD"]
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"
