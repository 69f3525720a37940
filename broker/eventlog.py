"""The broker's exported metrics log (`--log-dir`; schema 1 in docs/logs.md).

One `snapshot` per interval (coordinate, loads, neighbours, Voronoi cell area, topics with roles and sizes,
cumulative counters) and one `event` per happening (join, leave, failure, heal, takeover, and delegation or
move once the pub/sub layer reports them through `Broker.event`).  Records are built and written with the
simulator's `base_record`/`event_record`/`JsonlWriter`, so both sources share one layout and one rotation.

Snapshots are taken at whole multiples of the interval since the Unix epoch and `step` is that multiple, so
all brokers of a cluster (same interval, clocks of one machine or NTP-synchronised) write the same step at
the same moment and one step is one picture of the overlay.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final

from overlay.geometry import polygon_area, voronoi_cell
from overlay.logschema import JsonlWriter, Record, base_record, encode_record, event_record

if TYPE_CHECKING:
    from broker.config import BrokerConfig
    from broker.stats import Observed

SOURCE: Final = "broker"
# Topics a snapshot encodes per turn of the event loop (`_with_topics`): ~2 ms each.
TOPICS_SLICE: Final = 2000
# Write failures (disk full, directory removed) are logged once per this many so they cannot flood stderr.
ERROR_LOG_EVERY: Final = 100
_FILE_SAFE = re.compile(r"[^A-Za-z0-9._-]")

log = logging.getLogger("sedax.eventlog")


class EventLog:
    """Writes one broker's records to `<log_dir>/broker-<node id>.jsonl` (rotated by size)."""

    def __init__(self, config: BrokerConfig, node_id: str) -> None:
        """Open (append to) the log file; OSError if the directory cannot be created or written."""
        assert config.log_dir is not None
        self.run = config.log_run
        self.node = node_id
        self.interval = config.log_interval
        self.writer = JsonlWriter(
            Path(config.log_dir), f"broker-{_FILE_SAFE.sub('_', node_id)}", config.log_max_bytes, config.log_keep
        )
        self.errors = 0

    @property
    def path(self) -> Path:
        """The current file."""
        return self.writer.path

    def step_at(self, ts: float) -> int:
        """The snapshot step that wall-clock time ts falls into."""
        return math.floor(ts / self.interval)

    def write(self, rec: Record) -> None:
        """Append one record and flush it; a failing disk is logged, never raised into the broker."""
        self.write_line(encode_record(rec) + "\n")

    def write_line(self, line: str) -> None:
        """Append one record already encoded, and flush it (as `write`)."""
        try:
            self.writer.write_line(line)
            self.writer.flush()
        except (OSError, ValueError) as exc:
            self.errors += 1
            if self.errors % ERROR_LOG_EVERY == 1:
                log.warning("cannot write the metrics log %s (%d failures so far): %s", self.path, self.errors, exc)

    def event(
        self,
        kind: str,
        *,
        topic: str | None = None,
        load: float | None = None,
        frm: tuple[float, float] | None = None,
        to: tuple[float, float] | None = None,
        peer: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """Write one `event` record stamped now."""
        ts = time.time()
        self.write(
            event_record(
                self.run,
                SOURCE,
                ts,
                self.step_at(ts),
                self.node,
                kind,
                topic=topic,
                load=load,
                frm=frm,
                to=to,
                peer=peer,
                seconds=seconds,
            )
        )

    async def snapshots(self, broker: Observed) -> None:
        """Write a snapshot of broker at every interval boundary, until cancelled."""
        last: int | None = None
        while True:
            now = time.time()
            step = self.step_at(now)
            if step == last:
                # Timers may fire a little early; sleep on to the boundary of the next step.
                await asyncio.sleep(max((step + 1) * self.interval - now, 0.001))
                continue
            if last is not None:
                rec = base_record("snapshot", self.run, SOURCE, now, step, self.node)
                rec.update(snapshot_fields(broker))
                self.write_line(await _with_topics(rec, await broker.topic_rows()))
            last = step
            await asyncio.sleep(max((step + 1) * self.interval - time.time(), 0.001))

    def close(self) -> None:
        """Flush and close the file."""
        try:
            self.writer.close()
        except OSError as exc:
            log.warning("closing the metrics log %s failed: %s", self.path, exc)


def snapshot_fields(b: Observed) -> Record:
    """The snapshot fields of docs/logs.md from the broker's current state (loads in bytes), but for `topics`
    (`_with_topics`)."""
    peers = sorted(b.gauges().neighbours, key=lambda n: n.id)
    # The cell of v among its Delaunay neighbours is its cell in the whole diagram (only they bound it).
    cell = voronoi_cell(b.info.coord, (n.coord for n in peers), b.config.space)
    return {
        "coord": [b.info.coord[0], b.info.coord[1]],
        "loads": {level: float(v) for level, v in b.loads().items()},
        "unit": "bytes",
        "cell_area": polygon_area(cell),
        "neighbours": [n.id for n in peers],
        "counters": {k: float(v) for k, v in b.counter_values().items()},
    }


async def _with_topics(rec: Record, rows: list[tuple[str, str, int]]) -> str:
    """The line of snapshot rec with its `topics` (topic, role, size in bytes), encoded TOPICS_SLICE at a time
    with the event loop free in between: at 100,000 topics a snapshot is ~7 MB of JSON, and encoding it at once
    held the broker's loop for ~0.15 s at every interval."""
    head = encode_record(rec)
    parts = []
    for start in range(0, len(rows), TOPICS_SLICE):
        if start:
            await asyncio.sleep(0)
        chunk = [
            {"topic": t, "role": role, "size": float(size)} for t, role, size in rows[start : start + TOPICS_SLICE]
        ]
        parts.append(encode_record(chunk)[1:-1])  # (the array's items)
    return f'{head[:-1]},"topics":[{",".join(parts)}]}}\n'
