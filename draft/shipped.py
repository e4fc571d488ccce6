"""Draft models shipped in the repository, distilled with ``python -m draft.distill`` (see their README)."""

from __future__ import annotations

from pathlib import Path

WEIGHTS = Path(__file__).resolve().parent / "weights"
EMBEDDED_DRAFT = WEIGHTS / "smollm2-135m-instruct"  # for the embedded SmolLM2-135M-Instruct target


def embedded_draft() -> Path | None:
    """The shipped draft of the embedded target, or None when this install lacks it."""
    return EMBEDDED_DRAFT if (EMBEDDED_DRAFT / "config.json").is_file() else None
