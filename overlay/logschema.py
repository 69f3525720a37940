"""The exported-metrics log schema 1 (docs/logs.md): record builders and the rotating JSON-lines writer.

Brokers (broker/eventlog.py) and the simulator (sim/simlog.py) write the same records, and `sedax analyze`
(analysis/) reads both, so the layout and the rotation have one home here, below all three.  The record
builders are pure; `JsonlWriter` is the one piece of overlay/ that touches files: a plain synchronous
append-and-rotate with no sockets, no event loop and no clock, shared because a second copy in broker/ and sim/
would drift.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Final

SCHEMA: Final = 1
# docs/logs.md: rotate at 64 MiB and keep 5 files by default, the same limits the brokers use.
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
DEFAULT_KEEP: Final = 5

Record = dict[str, object]


def base_record(kind: str, run: str, source: str, ts: float, step: int, node: str) -> Record:
    """The fields every record has; kind is "snapshot" or "event", source "broker" or "sim"."""
    return {"schema": SCHEMA, "type": kind, "run": run, "source": source, "ts": ts, "step": step, "node": node}


def event_record(
    run: str,
    source: str,
    ts: float,
    step: int,
    node: str,
    event: str,
    *,
    topic: str | None = None,
    load: float | None = None,
    frm: tuple[float, float] | None = None,
    to: tuple[float, float] | None = None,
    peer: str | None = None,
    seconds: float | None = None,
) -> Record:
    """One `event` record; fields that do not apply to the event are null."""
    rec = base_record("event", run, source, ts, step, node)
    rec.update(
        {
            "event": event,
            "topic": topic,
            "load": load,
            "from": None if frm is None else [float(frm[0]), float(frm[1])],
            "to": None if to is None else [float(to[0]), float(to[1])],
            "peer": peer,
            "seconds": seconds,
        }
    )
    return rec


def encode_record(rec: Record | list[Record]) -> str:
    """One record as the JSON of one line (without its newline), or a list of records as one JSON array."""
    return json.dumps(rec, separators=(",", ":"), allow_nan=False)


class JsonlWriter:
    """Appends records to `<dir>/<name>.jsonl`, rotating to `.1.jsonl`, `.2.jsonl`, .. past max_bytes."""

    def __init__(
        self, directory: Path, name: str, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP
    ) -> None:
        if max_bytes < 1 or keep < 1:
            raise ValueError(f"max_bytes and keep must be positive, got {max_bytes}, {keep}")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.name = name
        self.max_bytes = max_bytes
        self.keep = keep
        self.path = directory / f"{name}.jsonl"
        self._fh = self.path.open("a", encoding="utf-8")
        self._size = self.path.stat().st_size

    def write(self, rec: Record) -> None:
        """Write one record as one line; rotate first if the line would pass the size limit."""
        self.write_line(encode_record(rec) + "\n")

    def write_line(self, line: str) -> None:
        """Write one record already encoded (`encode_record`, and its newline)."""
        data = line.encode("utf-8")
        if self._size > 0 and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._fh.write(line)
        self._size += len(data)

    def _rotate(self) -> None:
        self._fh.close()
        # shift x.(k).jsonl -> x.(k+1).jsonl from the oldest down; the one past `keep` files is dropped
        oldest = self.directory / f"{self.name}.{self.keep - 1}.jsonl"
        if oldest.exists():
            oldest.unlink()
        for k in range(self.keep - 2, 0, -1):
            src = self.directory / f"{self.name}.{k}.jsonl"
            if src.exists():
                os.replace(src, self.directory / f"{self.name}.{k + 1}.jsonl")
        if self.keep > 1:
            os.replace(self.path, self.directory / f"{self.name}.1.jsonl")
        else:
            self.path.unlink()
        self._fh = self.path.open("a", encoding="utf-8")
        self._size = 0

    def flush(self) -> None:
        """Hand what was written to the OS, so readers (and a crash) see whole records."""
        self._fh.flush()

    def close(self) -> None:
        """Flush and close the current file."""
        self._fh.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
