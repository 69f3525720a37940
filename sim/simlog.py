"""The simulator's records of the exported-metrics log schema (overlay/logschema.py, docs/logs.md).

The simulator writes what a broker cluster writes, in topic units, so `sedax analyze` reads both: one
`snapshot` per node per step and one `event` per delegation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from overlay.logschema import Record, base_record, event_record

if TYPE_CHECKING:
    from overlay.geometry import FloatArray
    from sim.experiments import MoveRecord, Overlay


def snapshot_records(
    run: str, step: int, ts: float, overlay: Overlay, loads: FloatArray, counters: FloatArray | None = None
) -> Iterator[Record]:
    """One `snapshot` record per node: loads is (3, nodes) in topic units; counters the moved load so far."""
    for v in range(len(overlay.points)):
        rec = base_record("snapshot", run, "sim", ts, step, str(v))
        rec.update(
            {
                "coord": [float(overlay.points[v, 0]), float(overlay.points[v, 1])],
                "loads": {"L1": float(loads[0, v]), "L2": float(loads[1, v]), "L3": float(loads[2, v])},
                "unit": "topic",
                "cell_area": float(overlay.cell_area[v]),
                "neighbours": [str(w) for w in overlay.neighbours[v]],
            }
        )
        if counters is not None:
            rec["counters"] = {"moved_load": float(counters[v])}
        yield rec


def move_record(run: str, ts: float, mv: MoveRecord) -> Record:
    """The `event` record of one delegation (Alg. 1) or move (Alg. 2); its load feeds V_ML, eq. (13)."""
    return event_record(
        run,
        "sim",
        ts,
        max(mv.step, 0),
        str(mv.node),
        mv.kind,
        topic=f"t{mv.topic}",
        load=mv.load,
        frm=mv.source,
        to=mv.target,
    )
