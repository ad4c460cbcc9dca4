"""The services' span files as the trace shipper reads them: what is new in each since it last
shipped (whole lines only).

A file is ``<data_dir>/traces/<service>-<pid>.jsonl``, one span a line as `span_to_dict` writes
it. Where each file was shipped to is kept in ``.shipped.json`` beside them, written after each
accepted export, so a restarted shipper goes on where it stopped (a batch accepted just before a
kill may go twice; nothing is skipped). `up` writes that file before its services start, with
the files of earlier runs at their ends: only this run's spans are shipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

OFFSETS_FILE = ".shipped.json"


def mark_existing_as_shipped(directory: Path) -> None:
    """Before a run's services start: every span file already there counts as shipped."""
    directory.mkdir(parents=True, exist_ok=True)
    ends = {path.name: path.stat().st_size for path in directory.glob("*.jsonl")}
    _write_offsets(directory, ends)


@dataclass(frozen=True, slots=True)
class Chunk:
    """New whole lines of one file: from `start` up to `end` (bytes)."""

    name: str
    start: int
    end: int
    lines: list[bytes]


@dataclass
class SpanFiles:
    directory: Path
    offsets: dict[str, int] = field(default_factory=dict)

    @classmethod
    def open(cls, directory: Path) -> SpanFiles:
        try:
            loaded = json.loads((directory / OFFSETS_FILE).read_text())
            offsets = {str(k): int(v) for k, v in loaded.items()} if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            offsets = {}
        return cls(directory, offsets)

    def behind_bytes(self) -> int:
        """Bytes written to the files and not shipped yet."""
        return sum(max(0, size - self.offsets.get(name, 0)) for name, size in self._sizes())

    def new_lines(self, max_bytes: int) -> Iterator[Chunk]:
        """What each file holds past its offset, whole lines, `max_bytes` at most overall."""
        budget = max_bytes
        for name, size in self._sizes():
            start = self.offsets.get(name, 0)
            if start > size:  # truncated or replaced: from its start again
                start = 0
            if size <= start or budget <= 0:
                continue
            with (self.directory / name).open("rb") as file:
                file.seek(start)
                data = file.read(min(size - start, budget))
            whole = data.rfind(b"\n") + 1
            if whole == 0:
                continue  # a line still being written
            budget -= whole
            yield Chunk(name, start, start + whole, data[:whole].splitlines())

    def shipped(self, chunk: Chunk) -> None:
        self.offsets[chunk.name] = chunk.end
        _write_offsets(self.directory, self.offsets)

    def _sizes(self) -> list[tuple[str, int]]:
        found = []
        for path in sorted(self.directory.glob("*.jsonl")):
            try:
                found.append((path.name, path.stat().st_size))
            except FileNotFoundError:
                continue
        return found


def _write_offsets(directory: Path, offsets: dict[str, int]) -> None:
    temporary = directory / f"{OFFSETS_FILE}.tmp"
    temporary.write_text(json.dumps(offsets))
    os.replace(temporary, directory / OFFSETS_FILE)
