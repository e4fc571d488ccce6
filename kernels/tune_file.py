"""Tuned kernel picks kept on disk: a restarted server, or a second one on the same GPU, takes the picks a
first one timed instead of timing them again.

Two reasons. Start-up: the INT4 launcher builds and times a dozen-odd candidates for each (M bucket, shape)
on its first eager call, and the chained tuner captures a graph of up to 256 launches for each. And A/B runs
across processes: where candidates time within noise of each other, each process picks its own, so two
servers of one build could run different kernels. With a file, both run the first one's picks.

A pick is reused only under the same fingerprint (the caller's: GPU, library versions, the kernels' source,
their switches) and only while the stored config is still among the shape's candidates (the caller checks).
The file holds one section per fingerprint, ``{"version": 1, "sections": {fingerprint: {"written": unix time,
"picks": {key: fields}}}}``; it keeps the ``MAX_SECTIONS`` most recently written (every edit of the kernels'
source is a new fingerprint). Each write merges this process's picks into what is on disk and renames a
temporary file over it, so a reader never sees half a file; two processes writing at once may lose one's
newest picks (timed again at the next start), never the file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger("specgate.tune")
VERSION = 1
MAX_SECTIONS = 16


class TuneFile:
    """One fingerprint's section of a tune file, read at first use."""

    def __init__(self, path: str | os.PathLike, fingerprint: str):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self._picks: dict[str, list] | None = None
        self._writable = True

    def _read_sections(self) -> dict[str, dict]:
        """Every section on disk; a missing file is empty, an unreadable one is logged and taken as empty."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("tune file %s not read (%s: %s); its picks are timed again", self.path, type(e).__name__, e)
            return {}
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("sections"), dict):
            log.warning("tune file %s is not a version %d tune file; its picks are timed again", self.path, VERSION)
            return {}
        return {fp: sec for fp, sec in data["sections"].items()
                if isinstance(sec, dict) and isinstance(sec.get("picks"), dict)}

    def _section_picks(self) -> dict[str, list]:
        return dict(self._read_sections().get(self.fingerprint, {}).get("picks", {}))

    def get(self, key: str) -> list | None:
        """The stored fields of ``key``'s pick under this fingerprint, or None."""
        if self._picks is None:
            self._picks = self._section_picks()
        fields = self._picks.get(key)
        return fields if isinstance(fields, list) else None

    def put(self, key: str, fields: list) -> None:
        """Store a pick: merged into the file as it is on disk now, then renamed over it. A file that cannot be
        written (a read-only cache) is logged once; the picks then live for this process only."""
        if self._picks is None:
            self._picks = self._section_picks()
        self._picks[key] = list(fields)
        if not self._writable:
            return
        sections = self._read_sections()
        picks = {**sections.get(self.fingerprint, {}).get("picks", {}), **self._picks}
        sections[self.fingerprint] = {"written": time.time(), "picks": picks}
        written = {fp: w if isinstance(w := sec.get("written"), (int, float)) else 0 for fp, sec in sections.items()}
        newest = sorted(sections, key=written.__getitem__, reverse=True)[:MAX_SECTIONS]
        sections = {fp: sections[fp] for fp in newest}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"version": VERSION, "sections": sections}, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            self._writable = False
            log.warning("tune file %s not written (%s: %s); tuned picks are kept for this process only",
                        self.path, type(e).__name__, e)
