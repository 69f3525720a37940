"""Synthetic metrics logs in the schema of docs/logs.md, for tests and the analysis benchmark.

The simulator (`sim/`) and the brokers write the real logs; this generator writes logs with the same
shape and realistic content so the analysis can be tested and benchmarked without them: N nodes at random
coordinates in the unit square, topics at random coordinates with growing sizes, node loads L1/L2/L3 from
the topics' N1/N2/N3 (eqs. 1, 2, 4), Voronoi cell areas, Delaunay neighbours, move/delegation events, node
failures, and optionally corrupt or truncated lines (which readers must count and skip).

Records are formatted with f-strings rather than `json.dumps` in compact mode: the benchmark writes 10^7 of
them and `json.dumps` of nested dicts is about three times slower.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import numpy as np
from scipy.spatial import cKDTree

from overlay.geometry import delaunay_neighbours, polygon_area, voronoi_cells

Source = Literal["sim", "broker"]

# Broker snapshot interval used for the `ts` of synthetic broker logs (seconds); any positive value works,
# the analysis bins broker time by its own bin width.
BROKER_INTERVAL_S: Final = 5.0
# Start of synthetic broker time (epoch seconds); sim logs use τ in [0, 1], the paper's period D = 1.
BROKER_EPOCH: Final = 1_700_000_000.0

# The kinds of bad lines the generator can inject; tests check the analysis counts each of them.
CORRUPT_KINDS: Final = ("garbage", "missing_run", "missing_node", "wrong_type", "json_array", "blank")


@dataclass
class SynthStats:
    """What a generator call wrote: used by tests as ground truth and by the benchmark for its record count."""

    files: list[str] = field(default_factory=list)
    snapshots: int = 0
    events: int = 0
    moves: int = 0
    corrupt: int = 0
    truncated: int = 0
    bytes: int = 0

    @property
    def records(self) -> int:
        """Valid records written (snapshots plus events)."""
        return self.snapshots + self.events

    @property
    def bad_lines(self) -> int:
        """Lines a reader must skip: injected corrupt lines plus truncated last lines."""
        return self.corrupt + self.truncated


def _fmt(x: float) -> str:
    # repr round-trips doubles exactly, so the test's numpy figures and Spark see the same numbers.
    return repr(float(x))


class _Run:
    """One run's evolving state: static node set (minus failures), topics with growth and moves."""

    def __init__(self, rng: np.random.Generator, nodes: int, topics_per_node: int) -> None:
        self.rng = rng
        self.ids = [f"n{i:05d}" for i in range(nodes)]
        self.points = rng.random((nodes, 2))
        n_topics = max(1, nodes * topics_per_node)
        self.homes = rng.random((n_topics, 2))
        self.coords = self.homes.copy()
        # Sec. VIII-A: every topic starts at size 1 and grows as exp(λ_t τ), λ_t spread over [0, ln 10].
        self.rates = np.linspace(0.0, math.log(10.0), n_topics)
        rng.shuffle(self.rates)
        self.delegated = np.zeros(n_topics, dtype=bool)
        self.alive = np.ones(nodes, dtype=bool)
        self._rebuild()

    def _rebuild(self) -> None:
        # Loads, cells and neighbours depend only on the live node set and the topic coordinates.
        self.live = np.flatnonzero(self.alive)
        pts = self.points[self.live]
        self.tree = cKDTree(pts)
        k = min(3, len(pts))
        _, idx = self.tree.query(self.coords, k=k)
        self.triples = np.asarray(idx).reshape(len(self.coords), k)
        self.areas = [polygon_area(c) for c in voronoi_cells(pts)]
        nb = delaunay_neighbours(pts)
        self.neighbours = [sorted(self.ids[self.live[j]] for j in s) for s in nb]

    def move(self, t: int, to: np.ndarray) -> None:
        self.coords[t] = to
        k = self.triples.shape[1]
        _, idx = self.tree.query(to, k=k)
        self.triples[t] = np.asarray(idx).reshape(k)

    def fail(self, node: int) -> None:
        self.alive[node] = False
        self._rebuild()

    def loads(self, tau: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Sizes L_T(t, τ) and node loads L1, L2, L3 (eqs. 1, 2, 4) indexed by live-node position."""
        sizes = np.exp(self.rates * tau)
        n = len(self.live)
        cols: list[np.ndarray] = [
            np.bincount(self.triples[:, j], weights=sizes, minlength=n) for j in range(self.triples.shape[1])
        ]
        while len(cols) < 3:
            cols.append(np.zeros(n))
        l1 = cols[0]
        l2 = l1 + cols[1]
        l3 = l2 + cols[2]
        return sizes, l1, l2, l3


def generate_logs(
    out_dir: str | Path,
    *,
    nodes: int = 20,
    steps: int = 10,
    runs: int = 2,
    seed: int = 1,
    topics_per_node: int = 10,
    moves_per_step: int = 2,
    failures: int = 0,
    source: Source = "sim",
    corrupt_lines: int = 0,
    truncate_last: bool = False,
    compact: bool = False,
    cell_area: bool = True,
) -> SynthStats:
    """Write synthetic JSON-lines logs below out_dir and return what was written.

    Args:
        out_dir: directory to write to (created if needed).
        nodes: nodes per run.
        steps: snapshot steps per run (step numbers 0..steps-1).
        runs: independent runs (different coordinates and topics).
        seed: base seed; run r uses seed + r.
        topics_per_node: topics per node on average.
        moves_per_step: topic moves per step (the first move of a topic is a `delegation`, later ones `move`).
        failures: nodes that fail halfway through each run (a neighbour logs a `failure` event with the
            failed node as peer; the failed node writes no snapshot afterwards).
        source: "sim" writes one file per run with `ts` = τ in [0, 1]; "broker" writes one file per node
            with `ts` in epoch seconds, one snapshot every BROKER_INTERVAL_S.
        corrupt_lines: bad lines to inject per file (kinds cycle through CORRUPT_KINDS).
        truncate_last: cut the last line of every file in half (a crash mid-write).
        compact: leave out the optional `topics`, `neighbours` and `counters` to make records small.
        cell_area: write `cell_area` (otherwise null).

    Returns:
        Counts of records, moves, injected bad lines and bytes, and the file names.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stats = SynthStats()
    for r in range(runs):
        rng = np.random.default_rng(seed + r)
        run_id = f"{source}-{seed}-{r}"
        st = _Run(rng, nodes, topics_per_node)
        fail_step = steps // 2
        n_fail = min(failures, max(nodes - 4, 0))
        failing: list[int] = [int(v) for v in rng.choice(nodes, size=n_fail, replace=False)] if n_fail else []
        lines: dict[str, list[str]] = {}

        def emit(node_id: str, line: str, lines: dict[str, list[str]] = lines) -> None:
            key = "sim" if source == "sim" else node_id
            lines.setdefault(key, []).append(line)

        # Per-node cumulative per-topic counters [bytes, messages], as a broker would keep them.
        handled: list[dict[int, list[float]]] = [{} for _ in range(nodes)]
        for step in range(steps):
            tau = step / max(steps - 1, 1) if source == "sim" else BROKER_EPOCH + step * BROKER_INTERVAL_S
            growth_tau = step / max(steps - 1, 1)
            if step == fail_step:
                for f in failing:
                    reporter = st.neighbours[int(np.searchsorted(st.live, f))][0]
                    st.fail(int(f))
                    emit(reporter, _event(source, run_id, tau, step, reporter, "failure", peer=st.ids[f]))
                    stats.events += 1
            sizes, l1, l2, l3 = st.loads(growth_tau)
            for _ in range(moves_per_step):
                t = int(rng.integers(len(st.homes)))
                frm = st.coords[t].copy()
                to = rng.random(2)
                kind = "move" if st.delegated[t] else "delegation"
                st.delegated[t] = True
                owner = st.ids[st.live[st.triples[t, 0]]]
                st.move(t, to)
                emit(
                    owner,
                    _event(source, run_id, tau, step, owner, kind, topic=f"t{t}", load=float(sizes[t]), frm=frm, to=to),
                )
                stats.events += 1
                stats.moves += 1
            if moves_per_step:
                sizes, l1, l2, l3 = st.loads(growth_tau)
            held: list[list[tuple[int, int]]] = [[] for _ in st.live]
            if not compact:
                for t, tr in enumerate(st.triples):
                    for j, v in enumerate(tr):
                        held[v].append((t, j))
            for pos, node in enumerate(st.live):
                nid = st.ids[node]
                x, y = st.points[node]
                area = _fmt(st.areas[pos]) if cell_area else "null"
                rec = (
                    f'{{"schema":1,"type":"snapshot","run":"{run_id}","source":"{source}","ts":{_fmt(tau)},'
                    f'"step":{step},"node":"{nid}","coord":[{_fmt(x)},{_fmt(y)}],'
                    f'"loads":{{"L1":{_fmt(l1[pos])},"L2":{_fmt(l2[pos])},"L3":{_fmt(l3[pos])}}},'
                    f'"unit":"{"topic" if source == "sim" else "bytes"}","cell_area":{area}'
                )
                if not compact:
                    roles = ("primary", "secondary", "tertiary")
                    topics = [{"topic": f"t{t}", "role": roles[j], "size": float(sizes[t])} for t, j in held[pos]]
                    acc = handled[node]
                    for t, j in held[pos]:
                        if j == 0:  # the primary N1 receives the publications (100 bytes per topic unit)
                            c = acc.setdefault(t, [0.0, 0.0])
                            c[0] += float(sizes[t]) * 100.0
                            c[1] += 1.0
                    counters = {"messages_published": sum(c[1] for c in acc.values())}
                    for t in sorted(acc):
                        counters[f"topic:t{t}:bytes_published"] = acc[t][0]
                        counters[f"topic:t{t}:messages_published"] = acc[t][1]
                    rec += (
                        f',"neighbours":{json.dumps(st.neighbours[pos])},"topics":{json.dumps(topics)},'
                        f'"counters":{json.dumps(counters)}'
                    )
                emit(nid, rec + "}")
                stats.snapshots += 1
        for key in sorted(lines):
            name = f"sim-synth-{seed}-{r}.jsonl" if source == "sim" else f"broker-{key}.jsonl"
            path = (out / run_id / name) if source == "broker" else (out / name)
            path.parent.mkdir(parents=True, exist_ok=True)
            body = lines[key]
            for i in range(corrupt_lines):
                kind = CORRUPT_KINDS[i % len(CORRUPT_KINDS)]
                body.insert(int(rng.integers(len(body) + 1)), _corrupt(kind, run_id))
                stats.corrupt += 1
            text = "\n".join(body) + "\n"
            if truncate_last and body:
                # Drop the newline and the second half of the last record: what a crash mid-write leaves.
                last = body[-1]
                text = "\n".join(body[:-1]) + "\n" + last[: len(last) // 2]
                stats.truncated += 1
                if last.startswith('{"schema":1,"type":"snapshot"'):
                    stats.snapshots -= 1
                elif last.startswith('{"schema":1,"type":"event"'):
                    stats.events -= 1
                    stats.moves -= int('"event":"move"' in last or '"event":"delegation"' in last)
                else:
                    stats.corrupt -= 1  # the truncated line was already a corrupt one
            data = text.encode()
            path.write_bytes(data)
            stats.bytes += len(data)
            stats.files.append(str(path))
    return stats


def _event(
    source: Source,
    run_id: str,
    ts: float,
    step: int,
    node: str,
    kind: str,
    *,
    topic: str | None = None,
    load: float | None = None,
    frm: np.ndarray | None = None,
    to: np.ndarray | None = None,
    peer: str | None = None,
) -> str:
    rec = {
        "schema": 1,
        "type": "event",
        "run": run_id,
        "source": source,
        "ts": ts,
        "step": step,
        "node": node,
        "event": kind,
        "topic": topic,
        "load": load,
        "from": None if frm is None else [float(frm[0]), float(frm[1])],
        "to": None if to is None else [float(to[0]), float(to[1])],
        "peer": peer,
        "seconds": None,
    }
    return json.dumps(rec, separators=(",", ":"))


def _corrupt(kind: str, run_id: str) -> str:
    match kind:
        case "garbage":
            return '{"schema":1,"type":"snap'
        case "missing_run":
            return '{"schema":1,"type":"snapshot","node":"x","step":0,"loads":{"L1":1,"L2":1,"L3":1}}'
        case "missing_node":
            return json.dumps({"schema": 1, "type": "event", "run": run_id, "event": "join"})
        case "wrong_type":
            return json.dumps({"schema": "one", "type": "snapshot", "run": run_id, "node": "x"})
        case "json_array":
            return "[1, 2, 3]"
        case "blank":
            return ""
    raise ValueError(f"unknown corrupt kind {kind!r}")
