"""Commits side by side in one run: each ref checked out into its own temporary git worktree.

``bench/host_step.py`` and ``bench/gateway_host.py`` run every ref's code in its own process from its
worktree, alternating refs within each repetition, so their ratios are taken within one run.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def short(ref: str) -> str:
    """The short commit id ``ref`` names."""
    return git("rev-parse", "--short", ref)


@contextlib.contextmanager
def worktrees(refs: list[str]) -> Iterator[dict[str, Path]]:
    """A detached worktree per ref, removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, Path] = {}
        try:
            for ref in refs:
                tree = Path(tmp) / ref.replace("/", "_")
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True,
                               capture_output=True)
                trees[ref] = tree
            yield trees
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
