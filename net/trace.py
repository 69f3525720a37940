"""Trace mode: where a message's time goes, stage by stage, across every process it passes (benchmarks only).

`SEDAX_TRACE=DIR` in a process's environment (read once, at import) switches it on.  A benchmark then puts
`stamp(t)` at the start of a payload: the magic bytes `MAGIC` and the publisher's `time.perf_counter()` (the
machine's CLOCK_MONOTONIC, one clock for every process of the machine).  Every trace point a payload passes —
the client's write, a broker forwarding a routed frame, a broker originating or receiving a routed message,
a broker writing to a client — looks for stamps in the bytes at hand and records (publish time, stage, now).
At exit the process writes its records to DIR/trace-PID.jsonl, one JSON array [t0, stage, now] a line; the
benchmark (benchmarks/bench_latency.py) joins the records of all processes by t0, which identifies a message,
and reports each stage's share.  Records, not histograms: a join per message gives the time *between* two
stages of the same message, which per-stage histograms of the time since publish cannot.

Off (the default), a trace point costs one test of the module constant `ENABLED`; nothing else is done or
allocated.  On, it costs a `bytes.find` per frame plus a tuple per stamped message.  GC pauses of a traced
process are recorded too (stage "gc<generation>", t0 = the pause's start), because they are one candidate
for the latency tail.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Final

_DIR: Final = os.environ.get("SEDAX_TRACE", "")
ENABLED: Final = bool(_DIR) and _DIR != "0"
# 0xc1 is the one byte msgpack never uses as a type, so a stamp is found in payloads, not mistaken in headers.
MAGIC: Final = b"\xc1SDT"
_T: Final = struct.Struct("<d")
STAMP_SIZE: Final = len(MAGIC) + _T.size
# A traced process keeps at most this many records (~100 B each), so a forgotten SEDAX_TRACE cannot grow a
# long-running broker without bound.
MAX_RECORDS: Final = 2_000_000

_records: list[tuple[float, str, float]] = []
_gc_start = 0.0


def stamp(t: float) -> bytes:
    """The trace stamp to put at the start of a payload published at perf_counter() time t."""
    return MAGIC + _T.pack(t)


def mark(stage: str, data: bytes | bytearray | memoryview) -> None:
    """Record stage for every stamped payload in data (call only when ENABLED)."""
    now = time.perf_counter()
    buf = bytes(data) if isinstance(data, memoryview) else data
    i = buf.find(MAGIC)
    while i >= 0 and len(_records) < MAX_RECORDS:
        if i + STAMP_SIZE > len(buf):
            return
        (t0,) = _T.unpack_from(buf, i + len(MAGIC))
        _records.append((t0, stage, now))
        i = buf.find(MAGIC, i + STAMP_SIZE)


def records() -> list[tuple[float, str, float]]:
    """This process's records so far (tests and in-process benchmarks)."""
    return list(_records)


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    global _gc_start
    if phase == "start":
        _gc_start = time.perf_counter()
    elif len(_records) < MAX_RECORDS:
        _records.append((_gc_start, f"gc{info.get('generation', '?')}", time.perf_counter()))


def dump(path: Path | None = None) -> Path | None:
    """Write the records to path (default DIR/trace-PID.jsonl); the path, or None when tracing is off."""
    if not ENABLED:
        return None
    out = path or Path(_DIR) / f"trace-{os.getpid()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for rec in _records:
            f.write(json.dumps(rec) + "\n")
    return out


if ENABLED:
    gc.callbacks.append(_on_gc)
    atexit.register(dump)
