"""`sedax analyze` on a Spark standalone cluster gives the outputs of local mode.

A master and two workers (1 core each) run as separate JVM processes on 127.0.0.1, started with `spark-class`
from the pyspark installation of this environment; the logs come from a live broker cluster (real processes,
a published workload and one topic move).  The same logs are analysed with `--master local[2]` and with
`--master spark://127.0.0.1:PORT`, both through the `sedax` command, and every CSV table and summary.md
must agree.

The workers' PATH starts with a `python3` (and `python`) that fails: PySpark's own default for the
executors' Python is the `python3` their PATH finds, so the cluster run only passes if `sedax analyze`
hands the executors its own interpreter (the job creates DataFrames from driver-side rows, which runs
Python tasks on the executors).
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from analysis.job import TABLES
from analysis.standalone import StandaloneSpark, free_port, stop_group

SEDAX = Path(sys.executable).with_name("sedax")
# Spark sums doubles per partition and then merges the partial sums in the order the shuffle delivers
# them, which depends on how the rows are split over tasks (two local threads vs two executors fetching
# each other's blocks): means and Pearson r may differ in the last bits, nothing else may.
RTOL = 1e-12
ATOL = 1e-12
# Bounds of the steps, for a 2-core machine shared with other work.
START_WITHIN = 120.0  # master and both workers ALIVE
ANALYZE_WITHIN = 600.0  # one `sedax analyze` run (95 s for the whole test on an idle machine)
LOG_INTERVAL = 0.25

pytestmark = pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning")


def _failing_pythons(where: Path) -> Path:
    """A directory with a `python3` and a `python` that fail, to put first on the workers' PATH."""
    where.mkdir()
    for name in ("python3", "python"):
        exe = where / name
        exe.write_text(f"#!/bin/sh\necho 'executor started {name} from PATH, not the driver Python' >&2\nexit 97\n")
        exe.chmod(0o755)
    return where


# ---- logs of a live broker cluster ----------------------------------------------------------------------


def _records(root: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(root.rglob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line being written
            if isinstance(rec, dict):
                out.append(rec)
    return out


async def _live_run(log_dir: Path, state_dir: Path) -> None:
    """4 brokers log snapshots while topics are published and one is moved, then leave."""
    from cluster import topics_per_broker, wait_for
    from conftest import FAST_ARGS

    from cli.cluster import LocalCluster
    from client.client import Client

    args = (*FAST_ARGS, "--log-dir", str(log_dir), "--log-interval", str(LOG_INTERVAL), "--log-run", "standalone")
    async with LocalCluster(4, seed=18, state_dir=state_dir, broker_args=args) as cluster:
        await cluster.wait_converged(60.0)
        coords = {bp.node_id: bp.coord for bp in cluster.nodes}
        topics = topics_per_broker(coords, 2, "sa")
        async with Client([bp.listen for bp in cluster.nodes]) as c:

            async def publish(rounds: int) -> None:
                futs = [await c.publish_nowait(t, b"x" * (100 * (1 + k % 5))) for k, t in enumerate(topics * rounds)]
                async with asyncio.timeout(60):
                    await asyncio.gather(*futs)

            def all_snapshotted(since: float) -> bool:
                seen = {
                    r["node"]
                    for r in _records(log_dir)
                    if r.get("type") == "snapshot" and r.get("ts", 0) > since and r.get("loads", {}).get("L1", 0) > 0
                }
                return seen >= set(coords)

            # Loads before and after a delegation (the moved-load table gets a move): topic 0 goes to the
            # coordinate of a broker that is not its home; then more is published.
            await publish(2)
            since = time.time()
            await wait_for(lambda: all_snapshotted(since), 60, "a snapshot of every broker after publishing")
            home = (await c.locate(topics[0])).primary.id
            await c.move(topics[0], next(xy for n, xy in coords.items() if n != home))
            await publish(2)
            since = time.time()
            await wait_for(lambda: all_snapshotted(since), 60, "a snapshot of every broker after the move")


@pytest.fixture(scope="module")
def live_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = tmp_path_factory.mktemp("live") / "logs"
    asyncio.run(_live_run(logs, tmp_path_factory.mktemp("brokers")))
    return logs


# ---- running `sedax analyze` and comparing its outputs ---------------------------------------------------


def _analyze(logs: Path, out: Path, master: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    err = out.with_suffix(".stderr").open("wb")
    try:
        return subprocess.Popen(
            [str(SEDAX), "analyze", str(logs), "--out", str(out), "--master", master, "--no-plots",
             "--no-ccdf-per-step"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,  # with its driver JVM, stoppable as one group
        )  # fmt: skip
    finally:
        err.close()


def _finish(proc: subprocess.Popen[bytes], out: Path) -> str:
    """Wait for an analyze run (at most ANALYZE_WITHIN s); its stdout.  Fails with its stderr if it failed."""
    try:
        stdout, _ = proc.communicate(timeout=ANALYZE_WITHIN)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise AssertionError(f"sedax analyze did not finish within {ANALYZE_WITHIN} s") from None
    stderr = out.with_suffix(".stderr").read_text(errors="replace")
    assert proc.returncode == 0, f"sedax analyze exited {proc.returncode}:\n{stderr[-4000:]}"
    return stdout.decode()


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL)


def _read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as fh:
        return list(csv.reader(fh))


def _compare_tables(local: Path, cluster: Path) -> int:
    """Assert every CSV table is the same, row by row; returns the number of rows compared."""
    names = sorted(p.name for p in (local / "csv").glob("*.csv"))
    assert names == sorted(p.name for p in (cluster / "csv").glob("*.csv"))
    assert names == sorted(f"{t}.csv" for t in TABLES if t != "ccdf_step")
    rows = 0
    for name in names:
        a, b = _read_csv(local / "csv" / name), _read_csv(cluster / "csv" / name)
        assert a[0] == b[0], name
        assert len(a) == len(b), (name, len(a), len(b))
        for i, (ra, rb) in enumerate(zip(a, b, strict=True)):
            assert len(ra) == len(rb) and all(_same(x, y) for x, y in zip(ra, rb, strict=True)), (name, i, ra, rb)
        rows += len(a) - 1
    for out in (local, cluster):
        parquet = sorted(p.name for p in (out / "parquet").iterdir())
        assert parquet == sorted(t for t in TABLES if t != "ccdf_step")
        for t in parquet:
            assert (out / "parquet" / t / "_SUCCESS").exists() and any((out / "parquet" / t).glob("part-*")), t
    return rows


def _summary_body(out: Path) -> list[str]:
    # The line after the title names the output directory and the run time; the rest is the analysis.
    lines = (out / "summary.md").read_text().splitlines()
    assert lines[1].startswith("Output: ")
    return lines[:1] + lines[2:]


# Two Spark applications and the three JVMs of the standalone cluster on two shared cores: ~95 s on an idle
# machine; 6 min and more under load averages of 15-60 from other work (one local run alone took over 7 min).
# The bounds are for a stuck run, not a measurement.
@pytest.mark.timeout(1500)
def test_standalone_cluster_outputs_equal_local_mode(live_logs: Path, tmp_path: Path) -> None:
    spark = StandaloneSpark(
        tmp_path, workers=2, cores=1, memory="1g", worker_path_prefix=_failing_pythons(tmp_path / "bin")
    )
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("PYSPARK_PYTHON", None)  # the command must choose the executors' Python itself
    started: list[subprocess.Popen[bytes]] = []
    left: list[int] = []
    try:
        spark.start()
        # Local mode runs while the standalone JVMs start.
        local = _analyze(live_logs, tmp_path / "local", "local[2]", env)
        started.append(local)
        local_out = _finish(local, tmp_path / "local")
        spark.wait_workers(START_WITHIN)
        run = _analyze(live_logs, tmp_path / "cluster", spark.url, env)
        started.append(run)
        cluster_out = _finish(run, tmp_path / "cluster")
        # The application ran on the cluster and finished there: the master lists it as completed, and
        # each worker started an executor for it that ran tasks.
        state = spark.wait_until(
            lambda s: any(a.get("name") == "sedax-analyze" for a in s.get("completedapps", [])),
            START_WITHIN,
            "the analysis listed as a completed application",
        )
        assert not state.get("activeapps")
        for work in spark.work_dirs:
            logs = list(work.glob("app-*/*/stderr"))
            assert logs, f"no executor ran on the worker of {work.name}"
            assert any("Finished task" in f.read_text(errors="replace") for f in logs), work.name
    finally:
        for proc in started:
            left += stop_group(proc)
        left += spark.stop()
    assert not left, f"processes left running: {left}"

    # The same result line (but for the output directory and the seconds) and the same tables.
    assert local_out.split("; wrote ")[0] == cluster_out.split("; wrote ")[0], (local_out, cluster_out)
    recs = [r for r in _records(live_logs) if r.get("schema") == 1]
    assert f"analysed {len(recs)} records" in cluster_out
    assert _compare_tables(tmp_path / "local", tmp_path / "cluster") > 0
    assert _summary_body(tmp_path / "local") == _summary_body(tmp_path / "cluster")
    moved = _read_csv(tmp_path / "cluster" / "csv" / "moved_load.csv")
    moves = moved[0].index("moves")
    assert sum(int(r[moves]) for r in moved[1:]) >= 1, "the live run's move is in the moved-load table"
    # The final step is the last one any broker logged (brokers leave one by one): its nodes are pooled.
    last = max(r["step"] for r in recs if r["type"] == "snapshot")
    at_last = {
        r["node"]: r for r in sorted(recs, key=lambda r: r["ts"]) if r["type"] == "snapshot" and r["step"] == last
    }
    loaded = sum(r["loads"]["L1"] for r in at_last.values()) > 0
    finals = _read_csv(tmp_path / "cluster" / "csv" / "quantiles_final.csv")[1:]
    assert [(r[0], int(r[1])) for r in finals] == ([(lv, len(at_last)) for lv in ("L1", "L2", "L3")] if loaded else [])


def test_cluster_sessions_use_the_drivers_python_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from analysis.job import executor_python

    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    assert executor_python() == sys.executable
    assert executor_python({"spark.pyspark.python": "/opt/py/bin/python3"}) == "/opt/py/bin/python3"
    monkeypatch.setenv("PYSPARK_PYTHON", "/env/python")
    assert executor_python() == "/env/python"
    assert executor_python({"spark.pyspark.python": "/conf/python"}) == "/conf/python"  # as spark-submit


def test_bad_conf_and_remote_out_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli import analysis as cli_analysis

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "b.jsonl").write_text(json.dumps({"schema": 1, "type": "event", "run": "r", "node": "n"}) + "\n")
    assert cli_analysis.main(["analyze", str(logs), "--out", str(tmp_path / "o"), "--conf", "spark.x"]) == 2
    assert "--conf takes KEY=VALUE" in capsys.readouterr().err
    assert cli_analysis.main(["analyze", str(logs), "--out", "hdfs://nn/out"]) == 2
    assert "--out must be a local directory" in capsys.readouterr().err


def _one_log(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "b.jsonl").write_text(json.dumps({"schema": 1, "type": "event", "run": "r", "node": "n"}) + "\n")
    return logs


def test_unreachable_master_is_one_line_before_spark_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli import analysis as cli_analysis

    logs, port = _one_log(tmp_path), free_port()  # nothing listens there
    assert (
        cli_analysis.main(["analyze", str(logs), "--out", str(tmp_path / "o"), "--master", f"spark://127.0.0.1:{port}"])
        == 1
    )
    err = capsys.readouterr().err
    assert err.startswith(f"sedax: error: cannot reach the Spark master at 127.0.0.1:{port}") and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
    assert cli_analysis.main(["analyze", str(logs), "--out", str(tmp_path / "o"), "--master", "spark://nohost"]) == 1
    assert "expected spark://HOST:PORT" in capsys.readouterr().err


def test_bad_master_url_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.run(
        [str(SEDAX), "analyze", str(_one_log(tmp_path)), "--out", str(tmp_path / "o"), "--master", "nonsense"],
        capture_output=True,
        text=True,
        timeout=ANALYZE_WITHIN,
        env=env,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sedax: error: Spark did not start on master 'nonsense': "), proc.stderr
