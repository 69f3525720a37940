"""`sedax analyze` end to end on generated logs, checked against numpy figures computed from the same lines.

One SparkSession (local[2]) and one analysis run serve the whole module: Spark start-up and JIT warm-up
dominate the cost of small inputs, so every check reads the outputs of that one run.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from analysis.synth import SynthStats, generate_logs
from cli import analysis as cli_analysis

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import SparkSession  # noqa: E402

from analysis.job import SHORT_RUN_SETTINGS, spark_session  # noqa: E402

LEVELS = ("L1", "L2", "L3")
PROBS = {"q05": 0.05, "q50": 0.5, "q95": 0.95}
# Spark and numpy sum the per-(run, step) L1 in different orders (partial sums vs pairwise), so the 100%
# unit, and with it every normalised load, can differ in the last bits: ~1e-16 relative per value.  The
# quantile arithmetic itself is numpy's (same formula), so 1e-12 relative is a generous bound that still
# catches any off-by-one rank (which moves a quantile by percent, not by 1e-12).
RTOL = 1e-12
# Pearson r: Spark's streaming co-moment update vs numpy's two-pass formula agree to ~1e-14 here.
CORR_TOL = 1e-9

pytestmark = pytest.mark.filterwarnings(
    # py4j leaves its gateway socket to the garbage collector when the JVM stops.
    "ignore:unclosed <socket.socket:ResourceWarning",
)


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    # The session `sedax analyze` starts for small inputs (these logs are a few MiB), with 4 shuffle partitions.
    with spark_session("local[2]", "1g", {"spark.sql.shuffle.partitions": "4"}, short_run=True) as session:
        yield session


EXTRA_LINES = [
    # One of each remaining bad kind, plus an exact duplicate of a valid snapshot (added below).
    json.dumps({"schema": 2, "type": "snapshot", "run": "sim-7-0", "node": "x", "step": 0}),
    json.dumps({"schema": 1, "type": "metric", "run": "sim-7-0", "node": "x"}),
]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SynthStats]]:
    root = tmp_path_factory.mktemp("logs")
    sim = generate_logs(
        root / "sim",
        nodes=25,
        steps=8,
        runs=3,
        seed=7,
        corrupt_lines=6,
        truncate_last=True,
        failures=2,
        moves_per_step=3,
    )
    broker = generate_logs(
        root / "cluster",
        nodes=12,
        steps=5,
        runs=1,
        seed=100,
        source="broker",
        corrupt_lines=1,
        truncate_last=True,
        moves_per_step=2,
    )
    # A rotated file in a nested directory holding the extra bad lines and a duplicate snapshot line, and a
    # file that is not *.jsonl (must be ignored).
    first = Path(sim.files[0]).read_text().splitlines()
    dup = next(line for line in first if '"type":"snapshot"' in line)
    nested = root / "sim" / "old"
    nested.mkdir()
    (nested / "sim-synth-7-0.1.jsonl").write_text("\n".join([*EXTRA_LINES, dup]) + "\n")
    (root / "sim" / "notes.txt").write_text("not a log\n{}\n")
    return root, [sim, broker]


@pytest.fixture(scope="module")
def out(spark: SparkSession, logs: tuple[Path, list[SynthStats]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root, _ = logs
    target = tmp_path_factory.mktemp("out")
    # Through the CLI entry point; the module's SparkSession is active, so the job reuses it.
    code = cli_analysis.main(
        ["analyze", str(root / "sim"), str(root / "cluster"), "--out", str(target), "--master", "local[2]"]
    )
    assert code == 0
    return target


# ---- the reference: a plain-Python reader and numpy ------------------------------------------------------


def classify(line: str) -> str:
    """Bad-line kind of a line as docs/logs.md and docs/analysis.md define it, or "ok"."""
    if not line.strip():
        return "malformed"
    try:
        rec = json.loads(line)
    except ValueError:
        return "malformed"
    if not isinstance(rec, dict):
        return "malformed"
    if any(k in rec and rec[k] is not None and not isinstance(rec[k], str) for k in ("type", "run", "node")):
        return "malformed"
    if "schema" in rec and not isinstance(rec["schema"], int | type(None)):
        return "malformed"  # a field of the wrong type makes the record unreadable with the schema
    if any(rec.get(k) is None for k in ("schema", "type", "run", "node")):
        return "missing_fields"
    if rec["schema"] != 1:
        return "unsupported_schema"
    if rec["type"] not in ("snapshot", "event"):
        return "unknown_type"
    return "ok"


class Reference:
    """Everything the checks need, from the *.jsonl files directly."""

    def __init__(self, root: Path) -> None:
        self.kinds: dict[str, int] = defaultdict(int)
        snaps: dict[tuple[str, int, str], dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.ts: dict[str, list[float]] = defaultdict(list)
        self.source: dict[str, str] = {}
        self.duplicates = 0
        for f in sorted(root.rglob("*.jsonl")):
            text = f.read_text()
            lines = text.split("\n")
            if text.endswith("\n"):
                lines = lines[:-1]
            for line in lines:
                kind = classify(line)
                self.kinds[kind] += 1
                if kind != "ok":
                    continue
                rec = json.loads(line)
                self.ts[rec["run"]].append(rec["ts"])
                self.source.setdefault(rec["run"], rec["source"])
                if rec["type"] == "event":
                    self.events.append(rec)
                    continue
                key = (rec["run"], rec["step"], rec["node"])
                if key in snaps:
                    self.duplicates += 1
                    if rec["ts"] < snaps[key]["ts"]:
                        continue
                snaps[key] = rec
        by_rs: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for (run, step, _), rec in sorted(snaps.items()):
            by_rs[(run, step)].append(rec)
        self.final = {run: max(s for r, s in by_rs if r == run) for run, _ in by_rs}
        # Normalised loads per (run, step): 100% = sum of L1 / number of nodes.
        self.norm: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        self.area: dict[tuple[str, int], np.ndarray] = {}
        for key, recs in by_rs.items():
            l1 = np.array([r["loads"]["L1"] for r in recs])
            unit = l1.sum() / len(l1)
            self.norm[key] = {lv: 100.0 * np.array([r["loads"][lv] for r in recs]) / unit for lv in LEVELS}
            self.area[key] = np.array([r["cell_area"] for r in recs])
        self.snaps = snaps

    def final_values(self, level: str) -> np.ndarray:
        return np.concatenate([self.norm[(run, step)][level] for run, step in sorted(self.final.items())])


@pytest.fixture(scope="module")
def ref(logs: tuple[Path, list[SynthStats]]) -> Reference:
    return Reference(logs[0])


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def summary_counts(out: Path) -> dict[str, int]:
    counts = {}
    for line in (out / "summary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[1].isdigit():
            counts[cells[0].removeprefix("– ")] = int(cells[1])
    return counts


# ---- checks ---------------------------------------------------------------------------------------------


def test_reference_agrees_with_generator(logs: tuple[Path, list[SynthStats]], ref: Reference) -> None:
    # The generator's own bookkeeping and the independent reader agree, so the reader is a fair reference.
    _, stats = logs
    written = sum(s.records for s in stats) + 1  # + the duplicate line
    bad = sum(s.bad_lines for s in stats) + len(EXTRA_LINES)
    assert ref.kinds["ok"] == written
    assert sum(v for k, v in ref.kinds.items() if k != "ok") == bad
    assert ref.duplicates == 1


def test_a_short_run_session_runs_its_jvm_with_the_short_run_settings(spark: SparkSession) -> None:
    # What the driver JVM was started with, asked of the JVM itself (not of the configuration handed to it).
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    args = set(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert {"-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"} <= args, args
    for key, value in SHORT_RUN_SETTINGS.items():  # (Spark adds its own options before the JVM's)
        assert value in (spark.sparkContext.getConf().get(key) or ""), key
    assert spark.conf.get("spark.sql.codegen.wholeStage") == "false"


def test_counts_records_and_bad_lines(out: Path, ref: Reference) -> None:
    counts = summary_counts(out)
    assert counts["valid records"] == ref.kinds["ok"]
    assert counts["events"] == len(ref.events)
    assert counts["snapshots"] == ref.kinds["ok"] - len(ref.events)
    for kind in ("malformed", "missing_fields", "unsupported_schema", "unknown_type"):
        assert counts[kind] == ref.kinds[kind], kind
    assert counts["unsupported_schema"] == 1 and counts["unknown_type"] == 1
    assert counts["malformed"] > 0 and counts["missing_fields"] > 0
    assert counts["bad lines (skipped)"] == sum(v for k, v in ref.kinds.items() if k != "ok")
    assert counts["lines read"] == sum(ref.kinds.values())
    assert counts["duplicate (run, step, node) snapshots (latest kept)"] == 1
    assert counts["runs"] == 4


def _close(a: float, b: float, rtol: float = RTOL) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)


def test_final_quantiles_match_numpy(out: Path, ref: Reference) -> None:
    rows = {r["level"]: r for r in read_csv(out / "csv" / "quantiles_final.csv")}
    assert sorted(rows) == list(LEVELS)
    for lv in LEVELS:
        vals = ref.final_values(lv)
        assert int(rows[lv]["n"]) == len(vals)
        for col, p in PROBS.items():
            assert _close(float(rows[lv][col]), float(np.quantile(vals, p))), (lv, col)
        assert _close(float(rows[lv]["mean"]), float(vals.mean()))
    # The normalisation: mean L1 is 100% (pooled: every run contributes a mean of exactly 100%).
    assert abs(float(rows["L1"]["mean"]) - 100.0) < 1e-9


def test_quantiles_over_time_match_numpy(out: Path, ref: Reference, spark: SparkSession) -> None:
    per_rs = spark.read.parquet(str(out / "parquet" / "quantiles_run_step")).collect()
    assert len(per_rs) == 3 * len(ref.norm)
    for r in per_rs:
        vals = ref.norm[(r["run"], r["step"])][r["level"]]
        assert r["n"] == len(vals)
        for col, p in PROBS.items():
            assert _close(r[col], float(np.quantile(vals, p))), (r["run"], r["step"], col)
        if r["level"] == "L1":
            assert abs(r["mean"] - 100.0) < 1e-9  # exactly 100% up to rounding, in every (run, step)
    pooled = read_csv(out / "csv" / "quantiles_step.csv")
    steps = sorted({s for _, s in ref.norm})
    assert len(pooled) == 3 * len(steps)
    for r in pooled:
        step = int(r["step"])
        vals = np.concatenate([v[r["level"]] for (_, s), v in sorted(ref.norm.items()) if s == step])
        for col, p in PROBS.items():
            assert _close(float(r[col]), float(np.quantile(vals, p))), (step, col)


def test_averaged_ccdf(out: Path, ref: Reference) -> None:
    rows = read_csv(out / "csv" / "ccdf_final.csv")
    runs = sorted(ref.final)
    for lv in LEVELS:
        mine = [(float(r["load"]), float(r["ccdf"])) for r in rows if r["level"] == lv]
        per_run = [ref.norm[(run, ref.final[run])][lv] for run in runs]
        assert len(mine) == len(np.unique(np.concatenate(per_run)))
        for x, c in mine:
            # The paper's averaged CCDF: the mean over runs of each run's fraction of nodes above x.
            expected = float(np.mean([np.mean(v > x) for v in per_run]))
            assert math.isclose(c, expected, abs_tol=1e-12), (lv, x)


def test_correlation_with_cell_area(out: Path, ref: Reference) -> None:
    rows = read_csv(out / "csv" / "correlation.csv")
    per_run = {r["run"]: r for r in rows if r["scope"] == "run"}
    assert sorted(per_run) == sorted(ref.final)
    for run, step in ref.final.items():
        area = ref.area[(run, step)]
        for lv in LEVELS:
            expected = float(np.corrcoef(ref.norm[(run, step)][lv], area)[0, 1])
            assert math.isclose(float(per_run[run][f"r_{lv}"]), expected, abs_tol=CORR_TOL), (run, lv)
    pooled = next(r for r in rows if r["scope"] == "pooled")
    area_pct = np.concatenate(
        [100.0 * ref.area[(run, s)] / ref.area[(run, s)].mean() for run, s in sorted(ref.final.items())]
    )
    for lv in LEVELS:
        expected = float(np.corrcoef(ref.final_values(lv), area_pct)[0, 1])
        assert math.isclose(float(pooled[f"r_{lv}"]), expected, abs_tol=CORR_TOL)
    # Load follows cell size (Table II): strongly for L1 with 10 topics per node.
    assert float(pooled["r_L1"]) > 0.5


def test_moved_load_eq13_eq14(out: Path, ref: Reference) -> None:
    rows = read_csv(out / "csv" / "moved_load.csv")
    for run in sorted(ref.ts):
        mine = sorted((r for r in rows if r["run"] == run), key=lambda r: int(r["bin"]))
        t_min, t_max = min(ref.ts[run]), max(ref.ts[run])
        t0 = 0.0 if ref.source[run] == "sim" else t_min
        duration = t_max - t0
        width = duration / 100
        n_bins = 100
        assert len(mine) == n_bins
        v = np.zeros(len(mine))
        for e in ref.events:
            if e["run"] == run and e["event"] in ("move", "delegation"):
                v[min(n_bins, max(1, math.ceil((e["ts"] - t0) / width))) - 1] += e["load"]
        assert v.sum() > 0
        w_bins = round(0.1 * duration / width)
        for i, r in enumerate(mine):
            assert math.isclose(float(r["v_ml"]), v[i], abs_tol=1e-9)
            assert math.isclose(float(r["v_ml_cum"]), v[: i + 1].sum(), abs_tol=1e-9)
            tau = i + 1
            # Eq. (14) written out: window of W bins, divided by min(τ, W) in time units.
            window_sum = v[max(0, tau - w_bins) : tau].sum()
            assert math.isclose(float(r["r_ml"]), window_sum / (min(tau, w_bins) * width), rel_tol=1e-9, abs_tol=1e-9)
    # The broker run is binned in seconds from its first record.
    broker_rows = [r for r in rows if r["source"] == "broker"]
    assert broker_rows and float(broker_rows[0]["bin_width"]) == pytest.approx(0.2)


def test_topic_tables(out: Path, ref: Reference) -> None:
    traffic = read_csv(out / "csv" / "topic_traffic.csv")
    # Reference: each node's latest snapshot counters, summed per (run, topic, metric).
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for (run, step, node), rec in ref.snaps.items():
        if "counters" in rec and ((run, node) not in latest or step > latest[(run, node)]["step"]):
            latest[(run, node)] = rec
    expected: dict[tuple[str, str, str], float] = defaultdict(float)
    for (run, _), rec in latest.items():
        for key, val in rec["counters"].items():
            if key.startswith("topic:"):
                _, topic, metric = key.split(":")
                expected[(run, topic, metric)] += val
    got = {(r["run"], r["topic"], r["metric"]): float(r["value"]) for r in traffic}
    assert got.keys() == expected.keys()
    for k, val in expected.items():
        assert math.isclose(got[k], val, rel_tol=1e-12), k
    topics = read_csv(out / "csv" / "topics_final.csv")
    run, step = sorted(ref.final.items())[0]
    sizes = {
        t["topic"]: t["size"] for (r, s, _), rec in ref.snaps.items() if (r, s) == (run, step) for t in rec["topics"]
    }
    mine = {t["topic"]: float(t["load"]) for t in topics if t["run"] == run}
    assert mine == pytest.approx(sizes)
    assert all(int(t["holders"]) <= 3 for t in topics)
    summary = (out / "summary.md").read_text()
    assert "bytes_published" in summary and "Largest topics" in summary


def test_outputs_and_plots(out: Path) -> None:
    for name in ("ccdf.png", "quantiles_over_time.png", "moved_load.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    for table in (
        "quantiles_final",
        "quantiles_run_step",
        "quantiles_step",
        "ccdf_final",
        "correlation",
        "correlation_run_step",
        "moved_load",
        "topics_final",
        "topic_traffic",
        "counters",
    ):
        assert (out / "csv" / f"{table}.csv").stat().st_size > 0
        assert any((out / "parquet" / table).glob("*.parquet")), table
    assert any((out / "parquet" / "ccdf_step").glob("*.parquet"))
    assert not list((out / "csv").glob(".*"))  # no temporary Spark directories left behind
    summary = (out / "summary.md").read_text()
    assert "| L1 |" in summary and "V_ML^cum" in summary and "r(L1)" in summary


def test_exact_quantiles_equal_numpy_bitwise(spark: SparkSession) -> None:
    from analysis.quantiles import exact_quantiles

    rng = np.random.default_rng(3)
    rows = []
    data: dict[int, list[float]] = {}
    for g in range(1, 9):  # group sizes 1..8, with ties
        vals = [float(x) for x in rng.integers(0, 5, size=g)] + [float(x) for x in rng.random(g)]
        data[g] = vals
        rows += [(g, v) for v in vals]
    probs = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
    result = exact_quantiles(spark.createDataFrame(rows, "g int, v double"), ["g"], "v", probs).collect()
    assert len(result) == len(data)
    from analysis.quantiles import quantile_column

    for r in result:
        for p in probs:
            assert r[quantile_column(p)] == float(np.quantile(data[r["g"]], p)), (r["g"], p)


# ---- logs of a live cluster ------------------------------------------------------------------------------

LIVE_INTERVAL = 0.25


def _records(root: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(root.rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            if classify(line) == "ok":
                out.append(json.loads(line))
    return out


def _snapshotted_since(root: Path, node: str, since: float) -> bool:
    return any(
        r["node"] == node and r["type"] == "snapshot" and r["ts"] > since and r["loads"]["L1"] > 0
        for r in _records(root)
    )


def _events(root: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in _records(root) if r["type"] == "event" and r["event"] == kind]


async def _live_run(log_dir: Path, state_dir: Path) -> tuple[str, set[str]]:
    """5 brokers publish, one is SIGKILLed, the rest heal and leave; returns the victim and its neighbours."""
    from cluster import topics_per_broker, wait_for
    from conftest import FAST_ARGS

    from cli.cluster import LocalCluster
    from client.client import Client

    args = (*FAST_ARGS, "--log-dir", str(log_dir), "--log-interval", str(LIVE_INTERVAL), "--log-run", "live")
    async with LocalCluster(5, seed=6, state_dir=state_dir, broker_args=args) as cluster:
        await cluster.wait_converged(60.0)
        topics = topics_per_broker({bp.node_id: bp.coord for bp in cluster.nodes}, 3, "live")
        async with Client([bp.listen for bp in cluster.nodes]) as c:
            futs = [await c.publish_nowait(t, b"x" * (100 * (1 + k % 7))) for k, t in enumerate(topics * 4)]
            async with asyncio.timeout(60):
                await asyncio.gather(*futs)
        done = time.time()
        for bp in cluster.nodes:
            await wait_for(lambda n=bp.node_id: _snapshotted_since(log_dir, n, done), 60, f"{bp.node_id} snapshot")
        victim = cluster.nodes[4].node_id
        neighbours = cluster.expected_neighbours()[victim]
        await cluster.kill(4)
        await wait_for(lambda: {e["node"] for e in _events(log_dir, "heal")} >= neighbours, 60, "heal events")
        healed = time.time()
        for bp in cluster.nodes[:4]:
            await wait_for(lambda n=bp.node_id: _snapshotted_since(log_dir, n, healed), 60, f"{bp.node_id} snapshot")
    return victim, neighbours


# Five broker processes and a Spark job of its own: on two loaded cores this needs more than the default bound.
@pytest.mark.timeout(600)
def test_live_cluster_logs_match_numpy(spark: SparkSession, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    victim, neighbours = asyncio.run(_live_run(logs, tmp_path / "cluster"))
    out = tmp_path / "out"
    assert (
        cli_analysis.main(
            ["analyze", str(logs), "--out", str(out), "--master", "local[2]", "--no-plots", "--no-ccdf-per-step"]
        )
        == 0
    )

    recs = _records(logs)
    events = [r for r in recs if r["type"] == "event"]
    kinds = defaultdict(list)
    for e in events:
        kinds[e["event"]].append(e)
    assert sorted(e["node"] for e in kinds["join"]) == ["n1", "n2", "n3", "n4"]
    assert sorted(e["node"] for e in kinds["leave"]) == ["n0", "n1", "n2", "n3"]  # the victim could not
    assert {e["node"] for e in kinds["failure"] if e["peer"] == victim} == neighbours
    assert kinds["heal"] and all(e["seconds"] > 0 for e in kinds["heal"]), kinds["heal"]
    counts = summary_counts(out)
    assert counts["events"] == len(events) and counts["valid records"] == len(recs)

    snaps: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in recs:
        key = (r["run"], r["step"], r["node"])
        if r["type"] == "snapshot" and (key not in snaps or r["ts"] >= snaps[key]["ts"]):
            snaps[key] = r
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for (_, step, _), r in sorted(snaps.items()):
        assert r["loads"]["L1"] == sum(t["size"] for t in r["topics"] if t["role"] == "primary")
        by_step[step].append(r)
    norm = {}
    for step, rs in by_step.items():
        l1 = np.array([r["loads"]["L1"] for r in rs])
        if l1.sum() > 0:
            norm[step] = {lv: 100.0 * np.array([r["loads"][lv] for r in rs]) / (l1.sum() / len(rs)) for lv in LEVELS}
    final = max(by_step)
    assert final in norm  # every broker is the primary of some topics from the first publish on
    rows = {r["level"]: r for r in read_csv(out / "csv" / "quantiles_final.csv")}
    for lv in LEVELS:
        vals = norm[final][lv]
        assert int(rows[lv]["n"]) == len(vals)
        for col, p in PROBS.items():
            assert _close(float(rows[lv][col]), float(np.quantile(vals, p))), (lv, col)
    per_rs = spark.read.parquet(str(out / "parquet" / "quantiles_run_step")).collect()
    assert len(per_rs) == 3 * len(norm) and len(norm) >= 2  # before the failure and after healing
    for r in per_rs:
        vals = norm[r["step"]][r["level"]]
        for col, p in PROBS.items():
            assert _close(r[col], float(np.quantile(vals, p))), (r["step"], r["level"], col)
