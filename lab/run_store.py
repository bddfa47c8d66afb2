"""A grid's finished runs kept on disk as they finish, so that an interrupted grid resumes.

``qsched experiment`` writes each run's record to ``OUT/.runs/`` the moment the run
ends. Run again with the same command after Ctrl-C, a killed process or a lost
session, it takes every run whose record is there and was made from the same job spec,
and runs only the rest. A run is a pure function of its spec (the determinism
contract), so a kept record is what the run would give again; the spec's fingerprint
is what decides, so a changed ``--set``, step count or policy config runs afresh. The
folder goes once ``results.json`` is written.

    store = RunStore(out / ".runs")
    record = store.load(key, seed, fingerprint)  # None: not run yet, or another spec
    store.save(key, seed, fingerprint, record_json)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Final

__all__ = ["RUNS_FOLDER", "RunStore", "fingerprint"]

RUNS_FOLDER: Final = ".runs"
_FORMAT: Final = 1  # bump when a record's fields change meaning


def fingerprint(document: dict[str, Any]) -> str:
    """A short digest of everything a run's outcome depends on (a JSON-able document)."""
    text = json.dumps({"format": _FORMAT, **document}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class RunStore:
    """Finished runs' records in one folder, one JSON file per (configuration, seed).

    Args:
        folder: where the records go (created on the first save).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str, seed: int) -> Path:
        # The configuration key holds JSON (quotes, braces): name the file by its digest.
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.folder / f"{digest}-seed{seed}.json"

    def load(self, key: str, seed: int, spec_fingerprint: str) -> dict[str, Any] | None:
        """The record of this run, if one was kept for the same spec; else None.

        A file that does not parse (a run cut off while it was written cannot leave one:
        records are renamed into place) or that belongs to another spec is ignored.
        """
        try:
            doc = json.loads(self._path(key, seed).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or doc.get("fingerprint") != spec_fingerprint:
            return None
        if doc.get("key") != key or doc.get("seed") != seed:
            return None
        record = doc.get("record")
        return record if isinstance(record, dict) else None

    def save(self, key: str, seed: int, spec_fingerprint: str, record: dict[str, Any]) -> None:
        """Keep one finished run's record (written whole, then renamed into place)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(key, seed)
        doc = {"key": key, "seed": seed, "fingerprint": spec_fingerprint, "record": record}
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(doc))
        os.replace(partial, path)

    def count(self) -> int:
        """How many records the folder holds (of any spec)."""
        return len(list(self.folder.glob("*-seed*.json"))) if self.folder.is_dir() else 0

    def clear(self) -> None:
        """Remove the folder: the grid's results are written."""
        shutil.rmtree(self.folder, ignore_errors=True)
