"""Draft models shipped in the repository, distilled with ``python -m draft.distill`` (see their README), and the
n-gram drafter's table of the embedded target's own text (``python -m draft.vocab --write table``)."""

from __future__ import annotations

from pathlib import Path

from draft.ngram import TABLE_FILE

WEIGHTS = Path(__file__).resolve().parent / "weights"
EMBEDDED_DRAFT = WEIGHTS / "smollm2-135m-instruct"  # for the embedded SmolLM2-135M-Instruct target
EMBEDDED_NGRAM = WEIGHTS / "smollm2-135m-instruct-ngram"  # its TABLE_FILE (draft/ngram.py)


def embedded_draft() -> Path | None:
    """The shipped draft of the embedded target, or None when this install lacks it."""
    return EMBEDDED_DRAFT if (EMBEDDED_DRAFT / "config.json").is_file() else None


def embedded_ngram_dir() -> Path | None:
    """The directory of the embedded target's shipped n-gram table, or None when this install lacks it."""
    return EMBEDDED_NGRAM if (EMBEDDED_NGRAM / TABLE_FILE).is_file() else None
