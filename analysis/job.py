"""The PySpark analysis of SeDAX metrics logs (docs/logs.md): load distributions, correlations, moved load.

`run_analysis` reads every `*.jsonl` below the given directories with a partitioned text read and parses it
with an explicit schema (`from_json`), so nothing but aggregated tables ever reaches the driver.  Bad lines
(not JSON, wrong field types, missing `schema`/`type`/`run`/`node`) are counted by kind and skipped.

Outputs under `out` (see docs/analysis.md):

* `parquet/<table>/` and `csv/<table>.csv`: the tables listed in `TABLES`;
* `ccdf.png`, `quantiles_over_time.png`, `moved_load.png`;
* `summary.md`.

Normalisation (Sec. VII-A, VIII-A): in each (run, step), 100% is the sum of L1 over the nodes of that
(run, step) divided by their number, and L1, L2 and L3 are all expressed in that unit (so mean L2 is 200%).
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlparse

import numpy as np
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from analysis.quantiles import DEFAULT_PROBS, averaged_ccdf, exact_quantiles, quantile_column
from overlay.dynamics import moved_load_rate

LEVELS: Final = ("L1", "L2", "L3")
SCHEMA_VERSION: Final = 1
REQUIRED: Final = ("schema", "type", "run", "node")
MOVE_EVENTS: Final = ("move", "delegation")
# Per-topic counters are named `topic:<topic>:<metric>` (e.g. `topic:news/a:bytes_published`); the topic may
# itself contain colons, the metric may not.
TOPIC_COUNTER: Final = r"^topic:(.+):([^:]+)$"

# Eq. (14): the paper's window is W = D / 10 of the experiment period D.
WINDOW_FRACTION: Final = 0.1
# Default time bins per run for V_ML: 100 bins puts 10 bins in the window W = D/10, and for a sim run with
# D = 1 and Δτ = 0.01 one bin is one simulator step.
DEFAULT_BINS: Final = 100
# Top-N topics listed in summary.md.
DEFAULT_TOP: Final = 10
# Shuffle partitions for local masters: Spark's default 200 makes the many small aggregations here pay
# scheduling overhead; a few per core is plenty for local data.  Cluster masters keep Spark's setting.
LOCAL_SHUFFLE_PARTITIONS: Final = 8
# Input split size for local masters.  Each split becomes one block of the persisted records; with Spark's
# 128 MiB default a 10^7-record run died reading such a block back from disk into a 1 GiB heap
# (OutOfMemoryError in BlockManager.maybeCacheDiskBytesInMemory).  32 MiB splits keep blocks small.
LOCAL_MAX_PARTITION_BYTES: Final = 32 * 1024 * 1024
# Driver memory when this module starts the session: small by default, since the job only keeps
# aggregated tables on the driver and shares the machine with other work.
DEFAULT_DRIVER_MEMORY: Final = "1g"
# The Python executors start for the job's few Python tasks (creating DataFrames from driver-side rows).
PYTHON_CONF: Final = "spark.pyspark.python"
# Settings for cluster masters (anything not local[...]); `conf` given to `spark_session` overrides them.
# The persisted snapshot table comes out of a shuffle; by default Spark keeps a cached plan at
# spark.sql.shuffle.partitions (200) partitions, and every one of the ~15 queries over it then runs 200
# tasks: on a 2-core standalone cluster that was 2800 of the job's 3000 tasks for 140 records.  Letting
# adaptive execution coalesce the cached plan's partitions sizes them by the data instead.
CLUSTER_DEFAULTS: Final = {"spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true"}

# Inputs up to this size are analysed in JVMs set up for a short life.  The job is ~90 small Spark jobs, and
# on a few MiB of logs its time is the JVM's own: compiling hot methods twice (C1, then C2) and compiling
# every query stage to bytecode.  The settings cut a quarter of the run time on small inputs and cost 12 %
# at 205 MB (docs/analysis.md, "Settings for small inputs"), so larger inputs keep Spark's defaults.
SHORT_RUN_BYTES: Final = 64 * 1024 * 1024
_SHORT_JVM: Final = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
SHORT_RUN_SETTINGS: Final = {
    "spark.driver.extraJavaOptions": _SHORT_JVM,
    "spark.executor.extraJavaOptions": _SHORT_JVM,
    "spark.sql.codegen.wholeStage": "false",
}

_CORRUPT = "_corrupt_record"

LOG_SCHEMA: Final = T.StructType(
    [
        T.StructField("schema", T.LongType()),
        T.StructField("type", T.StringType()),
        T.StructField("run", T.StringType()),
        T.StructField("source", T.StringType()),
        T.StructField("ts", T.DoubleType()),
        T.StructField("step", T.LongType()),
        T.StructField("node", T.StringType()),
        T.StructField(
            "loads",
            T.StructType([T.StructField(lv, T.DoubleType()) for lv in LEVELS]),
        ),
        T.StructField("unit", T.StringType()),
        T.StructField("cell_area", T.DoubleType()),
        T.StructField(
            "topics",
            T.ArrayType(
                T.StructType(
                    [
                        T.StructField("topic", T.StringType()),
                        T.StructField("role", T.StringType()),
                        T.StructField("size", T.DoubleType()),
                    ]
                )
            ),
        ),
        T.StructField("counters", T.MapType(T.StringType(), T.DoubleType())),
        T.StructField("event", T.StringType()),
        T.StructField("topic", T.StringType()),
        T.StructField("load", T.DoubleType()),
        T.StructField("peer", T.StringType()),
        T.StructField("seconds", T.DoubleType()),
        T.StructField(_CORRUPT, T.StringType()),
    ]
)
"""Explicit read schema: only the fields the job uses (coordinates and neighbours are for `sedax viz`)."""

# Bad-line kinds reported in the summary.
MALFORMED: Final = "malformed"  # not JSON, not a JSON object, or a field of the wrong type
MISSING_FIELDS: Final = "missing_fields"  # valid JSON without schema/type/run/node
UNSUPPORTED_SCHEMA: Final = "unsupported_schema"  # schema != 1
UNKNOWN_TYPE: Final = "unknown_type"  # type not snapshot/event
BAD_KINDS: Final = (MALFORMED, MISSING_FIELDS, UNSUPPORTED_SCHEMA, UNKNOWN_TYPE)

TABLES: Final = {
    "quantiles_final": "q5/mean/q95 of normalised L1/L2/L3 pooled over runs at each run's final step",
    "quantiles_run_step": "the same per (run, step)",
    "quantiles_step": "the same per step, pooled over the runs that have the step",
    "ccdf_final": "averaged CCDF of normalised loads at each run's final step",
    "ccdf_step": "averaged CCDF per step (Parquet only: it is as large as the snapshot data)",
    "correlation": "Pearson r of normalised load with cell area at the final step, per run and pooled",
    "correlation_run_step": "Pearson r per (run, step)",
    "moved_load": "V_ML, V_ML^cum and R_ML per run and time bin (eqs. 13-14)",
    "topics_final": "topics held at each run's final step: load L_T, holders, stored size",
    "topic_traffic": "per-topic counters (`topic:<topic>:<metric>`) summed over nodes' latest snapshots",
    "counters": "other counters summed over nodes' latest snapshots, per run",
}


class AnalysisInputError(ValueError):
    """The input paths are unusable: a directory is missing or holds no `*.jsonl` file."""


class AnalysisOutputError(RuntimeError):
    """The driver cannot see what the executors wrote under `out` (not a shared directory)."""


class SparkStartError(RuntimeError):
    """Spark did not start on the given master (a malformed master URL, an unknown property value, ...)."""


@dataclass
class Summary:
    """What `run_analysis` found: counts, headline figures and where the outputs are."""

    out: str
    lines: int = 0
    records: int = 0
    snapshots: int = 0
    events: int = 0
    bad_lines: dict[str, int] = field(default_factory=dict)
    incomplete_snapshots: int = 0
    duplicate_snapshots: int = 0
    zero_load_steps: int = 0
    runs: list[str] = field(default_factory=list)
    final_quantiles: list[dict[str, Any]] = field(default_factory=list)
    correlations: list[dict[str, Any]] = field(default_factory=list)
    moved: list[dict[str, Any]] = field(default_factory=list)
    top_topics: list[dict[str, Any]] = field(default_factory=list)
    top_traffic: list[dict[str, Any]] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    seconds: float = 0.0
    has_extras: bool = False  # some snapshot carries `topics` or `counters`

    @property
    def bad_total(self) -> int:
        """All skipped lines."""
        return sum(self.bad_lines.values())


# ---- session and input ----------------------------------------------------------------------------------


def _is_local(path: str) -> bool:
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def _local_path(path: str) -> Path:
    return Path(urlparse(path).path if path.startswith("file:") else path)


def spark_path(path: str | Path) -> str:
    """How Spark must be given a path: local paths absolute with an explicit `file:` scheme, others unchanged.

    A path without a scheme is resolved against the cluster's default filesystem (HDFS on YARN) and a
    relative one against that filesystem's working directory, while the driver checks the inputs and writes
    its own outputs on the local filesystem: spelling the path out makes every executor use the same one.
    """
    if isinstance(path, str) and not _is_local(path):
        return path
    posix = _local_path(str(path)).resolve().as_posix()
    return "file:" + (posix if posix.startswith("/") else "/" + posix)


def check_inputs(paths: Sequence[str]) -> int | None:
    """Fail early with a clear message for missing directories or directories without `*.jsonl` files; returns the
    total size of those files (what Spark reads), or None if a path is not local (its size is unknown here).

    Only local paths are checked; other filesystems (hdfs://, s3a://) are left to Spark.
    """
    if not paths:
        raise AnalysisInputError("no log directory given")
    found = False
    total: int | None = 0
    for p in paths:
        if not _is_local(p):
            found, total = True, None
            continue
        local = _local_path(p)
        if not local.exists():
            raise AnalysisInputError(f"log directory not found: {p}")
        logs = [local] if local.is_file() and local.name.endswith(".jsonl") else local.rglob("*.jsonl")
        for f in logs:
            found = True
            if total is not None:
                try:
                    total += f.stat().st_size
                except OSError:  # a file removed meanwhile: Spark will not read it either
                    continue
    if not found:
        raise AnalysisInputError(f"no *.jsonl logs found below {', '.join(paths)}")
    return total


def check_output(out: str) -> Path:
    """The local directory `out` names; AnalysisInputError for another filesystem.

    The driver writes the plots, summary.md and the small tables itself, so `out` must be a local path
    (on a cluster, one the executors see at the same path: docs/analysis.md).
    """
    if not _is_local(out):
        raise AnalysisInputError(
            f"--out must be a local directory (on a cluster one every executor sees at the same path), got {out}"
        )
    return _local_path(out)


def executor_python(conf: Mapping[str, str] | None = None) -> str:
    """The Python executors run: `spark.pyspark.python` in conf, else $PYSPARK_PYTHON, else this interpreter.

    Same precedence as spark-submit.  PySpark's own fallback is whatever `python3` the executor's PATH
    finds, which on a worker need not be the driver's Python version (PySpark refuses a different minor
    version); this interpreter is right wherever the workers have it at the same path (a shared or identical
    installation, the same container image), and the two settings cover the other clusters.
    """
    return (conf or {}).get(PYTHON_CONF) or os.environ.get("PYSPARK_PYTHON") or sys.executable or "python3"


def is_local_master(master: str) -> bool:
    """True for Spark's local masters (`local`, `local[N]`, `local[*]`, `local[N,F]`)."""
    return master == "local" or master.startswith("local[")


@contextmanager
def spark_session(
    master: str | None = None,
    driver_memory: str = DEFAULT_DRIVER_MEMORY,
    conf: Mapping[str, str] | None = None,
    short_run: bool = False,
) -> Iterator[SparkSession]:
    """Yield the active SparkSession, or start one (and stop it afterwards) on `master` (default local[*]).

    `short_run` adds SHORT_RUN_SETTINGS (for small inputs).  `conf` (Spark properties) is applied last, so it
    overrides every setting made here.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    m = master or "local[*]"
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": driver_memory,
        "spark.sql.session.timeZone": "UTC",
    }
    if is_local_master(m):
        settings["spark.sql.shuffle.partitions"] = str(LOCAL_SHUFFLE_PARTITIONS)
        settings["spark.sql.files.maxPartitionBytes"] = str(LOCAL_MAX_PARTITION_BYTES)
    else:
        settings.update(CLUSTER_DEFAULTS)
    if short_run:
        settings.update(SHORT_RUN_SETTINGS)
    settings.update(conf or {})
    python = executor_python(settings)
    settings[PYTHON_CONF] = python
    builder = SparkSession.builder.master(m).appName("sedax-analyze")
    for key, value in settings.items():
        builder = builder.config(key, value)
    # PySpark takes the executors' Python from the environment when the context starts, not from its
    # configuration (spark-submit copies spark.pyspark.python there; a plain `python` driver does not).
    previous = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # py4j and PySpark raise many types; the first line names the problem
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise SparkStartError(f"Spark did not start on master {m!r}: {first}") from exc
    finally:
        if previous is None:
            del os.environ["PYSPARK_PYTHON"]
        else:
            os.environ["PYSPARK_PYTHON"] = previous
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


def read_logs(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """Parse every `*.jsonl` line below paths; adds `_status` ("ok" or a bad-line kind)."""
    raw = (
        spark.read.option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "*.jsonl")
        .text([spark_path(p) for p in paths])
    )
    opts = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT}
    parsed = raw.select(F.trim("value").alias("_line"), F.from_json("value", LOG_SCHEMA, opts).alias("r"))
    missing = F.lit(False)
    for name in REQUIRED:
        missing = missing | F.col(f"r.{name}").isNull()
    status = (
        F.when((F.col("_line") == "") | F.col(f"r.{_CORRUPT}").isNotNull(), F.lit(MALFORMED))
        .when(missing, F.lit(MISSING_FIELDS))
        .when(F.col("r.schema") != SCHEMA_VERSION, F.lit(UNSUPPORTED_SCHEMA))
        .when(~F.col("r.type").isin("snapshot", "event"), F.lit(UNKNOWN_TYPE))
        .otherwise(F.lit("ok"))
    )
    cols = [f"r.{f.name}" for f in LOG_SCHEMA.fields if f.name != _CORRUPT]
    return parsed.select(status.alias("_status"), *cols)


# ---- output helpers -------------------------------------------------------------------------------------


def _written(df: DataFrame, target: Path) -> DataFrame:
    """Write df as Parquet to target and read it back; AnalysisOutputError if the driver cannot see it.

    Executors write the part files and the driver commits them: if `out` is not one directory for both, the
    driver finds its own empty commit (Spark writes a part file even for an empty table).
    """
    df.write.mode("overwrite").parquet(spark_path(target))
    if next(target.glob("part-*"), None) is None:
        raise AnalysisOutputError(
            f"the executors' output is not visible in {target}: --out must be a directory the driver and every "
            "executor see at the same path (a shared filesystem)"
        )
    return df.sparkSession.read.parquet(spark_path(target))


def _save_big(
    df: DataFrame, out: Path, name: str, order: Sequence[str | Column] = (), csv_too: bool = True
) -> DataFrame:
    """Write a table that may be large from the executors: Parquet, then one CSV file from that Parquet.

    Rows are sorted by `order` in both.  Returns the table read back from Parquet, so callers derive small
    results from it without recomputing the lineage.
    """
    saved = _written(df.orderBy(*order) if order else df, out / "parquet" / name)
    if csv_too:
        tmp = out / "csv" / f".{name}.tmp"
        # Reading the Parquet back packs its part files into tasks largest first, so the single CSV
        # partition is sorted again; within one partition that needs no shuffle.
        one = saved.coalesce(1)
        if order:
            one = one.sortWithinPartitions(*order)
        one.write.mode("overwrite").option("header", "true").csv(spark_path(tmp))
        parts = sorted(tmp.glob("part-*.csv"))
        dest = out / "csv" / f"{name}.csv"
        if parts:
            shutil.move(str(parts[0]), dest)
        else:  # Spark writes no part file for an empty DataFrame
            dest.write_text(",".join(saved.columns) + "\n")
        shutil.rmtree(tmp, ignore_errors=True)
    return saved


def _save_small(df: DataFrame, out: Path, name: str) -> list[dict[str, Any]]:
    """Collect an aggregated (small) table once and write it as Parquet and CSV from the driver.

    One Spark job for the aggregation instead of one per output format; returns the rows.
    """
    rows = [r.asDict() for r in df.collect()]
    _write_rows(df.sparkSession, rows, df.schema, out, name)
    return rows


def _write_rows(spark: SparkSession, rows: list[dict[str, Any]], schema: T.StructType, out: Path, name: str) -> None:
    """Write rows computed on the driver (small, already aggregated) in both formats."""
    names = [f.name for f in schema.fields]
    tuples = [tuple(r[n] for n in names) for r in rows]
    _written(spark.createDataFrame(tuples, schema).coalesce(1), out / "parquet" / name)
    with (out / "csv" / f"{name}.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(names)
        w.writerows(["" if v is None else v for v in t] for t in tuples)


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict() for r in df.collect()]


# ---- the job --------------------------------------------------------------------------------------------


def run_analysis(
    paths: list[str],
    out: str,
    master: str | None = None,
    *,
    bin_width: float | None = None,
    top: int = DEFAULT_TOP,
    ccdf_per_step: bool = True,
    plots: bool = True,
    driver_memory: str = DEFAULT_DRIVER_MEMORY,
    conf: Mapping[str, str] | None = None,
) -> Summary:
    """Analyse metrics logs and write tables, plots and summary.md under `out`.

    Args:
        paths: directories (or files) to read; every `*.jsonl` below them is read.
        out: local output directory; with a cluster master, one the driver and every executor see at the
            same path (the executors write the large tables, the driver the rest).
        master: Spark master URL; default local[*].  An already active SparkSession is reused as it is.
        bin_width: time bin for V_ML/R_ML in the runs' time unit (seconds for broker logs, τ for sim logs);
            default: the run's duration D / 100.
        top: number of topics listed per metric in summary.md.
        ccdf_per_step: also write the per-step CCDF table (as large as the snapshot data).
        plots: write the PNG plots (needs matplotlib).
        driver_memory: spark.driver.memory when a session is started here.
        conf: Spark properties for a session started here (they override this module's settings); the
            executors' Python is `spark.pyspark.python`, else $PYSPARK_PYTHON, else this interpreter.

    Returns:
        The Summary, also rendered to `out/summary.md`.

    Raises:
        AnalysisInputError: a path is missing, no `*.jsonl` file is found, or `out` is not local.
        AnalysisOutputError: the driver does not see the tables the executors wrote under `out`.
    """
    size = check_inputs(paths)
    given = check_output(out)
    started = time.monotonic()
    out_dir = given.resolve()
    (out_dir / "csv").mkdir(parents=True, exist_ok=True)
    summary = Summary(out=str(given))
    short_run = size is not None and size <= SHORT_RUN_BYTES
    with spark_session(master, driver_memory, conf, short_run=short_run) as spark:
        _analyse(spark, paths, out_dir, summary, bin_width, top, ccdf_per_step)
        summary.seconds = time.monotonic() - started
    if plots:
        from analysis.plots import write_plots

        summary.plots = write_plots(out_dir)
    (out_dir / "summary.md").write_text(render_summary(summary))
    return summary


def _analyse(
    spark: SparkSession,
    paths: Sequence[str],
    out: Path,
    summary: Summary,
    bin_width: float | None,
    top: int,
    ccdf_per_step: bool,
) -> None:
    parsed = read_logs(spark, paths)
    # One JSON parse for everything but the topic tables: a flat projection of the parsed lines is kept on
    # memory and disk.  Flat columns matter: with the nested `topics`/`counters` in the cache, the snapshot
    # stage took ~60 s on 10^6 records; from this flat cache the same de-duplication took ~5 s.
    records = parsed.select(
        "_status",
        "type",
        "run",
        "source",
        "ts",
        "step",
        "node",
        *[F.col(f"loads.{lv}").alias(lv) for lv in LEVELS],
        "cell_area",
        "event",
        "load",
        (F.col("topics").isNotNull() | F.col("counters").isNotNull()).alias("_extras"),
    ).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        _count_lines(records, summary)
        snaps = _snapshots(records, summary)
        try:
            _load_tables(snaps, out, summary, ccdf_per_step)
            _correlations(snaps, out, summary)
            # Topic tables need the nested fields: a second parse, skipped when no snapshot has them.
            _topics(parsed, snaps, out, summary, top)
        finally:
            snaps.unpersist()
        _moved_load(spark, records, out, summary, bin_width)
    finally:
        records.unpersist()


def _usable_snapshot() -> Column:
    usable = (F.col("type") == "snapshot") & F.col("step").isNotNull()
    for lv in LEVELS:
        usable = usable & F.col(lv).isNotNull()
    return usable


def _count_lines(records: DataFrame, summary: Summary) -> None:
    # One job for all counts: lines by status, type, run and whether a snapshot is usable.
    counts = records.groupBy("_status", "type", "run", _usable_snapshot().alias("usable"), "_extras").count().collect()
    summary.bad_lines = dict.fromkeys(BAD_KINDS, 0)
    runs: set[str] = set()
    for row in counts:
        n = int(row["count"])
        summary.lines += n
        if row["_status"] != "ok":
            summary.bad_lines[row["_status"]] += n
            continue
        summary.records += n
        runs.add(row["run"])
        if row["type"] == "snapshot":
            summary.snapshots += n
            summary.incomplete_snapshots += 0 if row["usable"] else n
            summary.has_extras = summary.has_extras or bool(row["_extras"])
        else:
            summary.events += n
    summary.runs = sorted(runs)


def _snapshots(records: DataFrame, summary: Summary) -> DataFrame:
    """One normalised row per (run, step, node): the latest record wins if a node logged a step twice."""
    usable = records.where((F.col("_status") == "ok") & _usable_snapshot())
    latest = F.max_by(
        F.struct(
            *[F.col(lv) for lv in LEVELS],
            F.col("cell_area"),
        ),
        F.coalesce(F.col("ts"), F.lit(0.0)),
    )
    dedup = usable.groupBy("run", "step", "node").agg(latest.alias("s"), F.count(F.lit(1)).alias("_dup"))
    # Per (run, step): node count, mean L1 (the 100% unit) and mean cell area (for pooled correlations).
    per_step = dedup.groupBy("run", "step").agg(
        F.count(F.lit(1)).alias("nodes"),
        (F.sum("s.L1") / F.count(F.lit(1))).alias("unit"),
        F.mean("s.cell_area").alias("mean_area"),
    )
    final_step = dedup.groupBy("run").agg(F.max("step").alias("final_step"))
    norm = (
        dedup.join(F.broadcast(per_step), ["run", "step"])
        .join(F.broadcast(final_step), "run")
        .select(
            "run",
            "step",
            "node",
            "nodes",
            (F.col("step") == F.col("final_step")).alias("final"),
            F.col("unit"),
            F.col("_dup"),
            # Guarded divisions: Spark's ANSI mode fails the whole job on x / 0, and a (run, step) without
            # topic load (a live cluster before its first publish) has unit 0; such rows are dropped below.
            *[_ratio(F.lit(100.0) * F.col(f"s.{lv}"), F.col("unit")).alias(lv) for lv in LEVELS],
            F.col("s.cell_area").alias("cell_area"),
            _ratio(F.lit(100.0) * F.col("s.cell_area"), F.col("mean_area")).alias("area_pct"),
        )
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    stats = norm.agg(
        F.sum(F.col("_dup") - 1).alias("dups"),
        F.countDistinct(F.when(F.col("unit") <= 0, F.struct("run", "step"))).alias("zero"),
    ).first()
    summary.duplicate_snapshots = int(stats["dups"] or 0) if stats else 0
    summary.zero_load_steps = int(stats["zero"] or 0) if stats else 0
    # A (run, step) without topic load has no 100% unit; its rows are left out of the load tables.
    return norm.where(F.col("unit") > 0)


def _ratio(num: Column, den: Column) -> Column:
    """num / den, or null where den is not positive."""
    return F.when(den > 0, num / den)


def _long(snaps: DataFrame) -> DataFrame:
    stack = "stack(3, 'L1', L1, 'L2', L2, 'L3', L3) as (level, load)"
    return snaps.select("run", "step", "node", "nodes", "final", F.expr(stack))


def _load_tables(snaps: DataFrame, out: Path, summary: Summary, ccdf_per_step: bool) -> None:
    long = _long(snaps)
    final = long.where("final")
    summary.final_quantiles = _save_small(
        exact_quantiles(final, ["level"], "load").orderBy("level"), out, "quantiles_final"
    )
    _save_big(
        exact_quantiles(long, ["run", "step", "level"], "load"), out, "quantiles_run_step", ["run", "step", "level"]
    )
    _save_small(exact_quantiles(long, ["step", "level"], "load").orderBy("step", "level"), out, "quantiles_step")
    # Averaged CCDF: weight 1/nodes gives every run the same weight (averaged_ccdf normalises per group).
    weighted = long.withColumn("w", F.lit(1.0) / F.col("nodes"))
    _save_big(averaged_ccdf(weighted.where("final"), ["level"], "load", "w"), out, "ccdf_final", ["level", "load"])
    if ccdf_per_step:
        _save_big(averaged_ccdf(weighted, ["step", "level"], "load", "w"), out, "ccdf_step", csv_too=False)


def _correlations(snaps: DataFrame, out: Path, summary: Summary) -> None:
    with_area = snaps.where(F.col("cell_area").isNotNull())
    corr_aggs = [F.count(F.lit(1)).alias("n")] + [F.corr(lv, "cell_area").alias(f"r_{lv}") for lv in LEVELS]
    _save_big(with_area.groupBy("run", "step").agg(*corr_aggs), out, "correlation_run_step", ["run", "step"])
    final = with_area.where("final")
    per_run = final.groupBy("run").agg(*corr_aggs).select(F.lit("run").alias("scope"), "*")
    # Pooled over runs, area in % of its (run, step) mean so runs with different extents are comparable.
    pooled_aggs = [F.count(F.lit(1)).alias("n")] + [F.corr(lv, "area_pct").alias(f"r_{lv}") for lv in LEVELS]
    pooled = final.agg(*pooled_aggs).select(
        F.lit("pooled").alias("scope"), F.lit(None).cast("string").alias("run"), "*"
    )
    table = pooled.unionByName(per_run).orderBy(F.col("scope").desc(), "run")
    summary.correlations = [r for r in _save_small(table, out, "correlation") if r["n"]]


def _topics(parsed: DataFrame, snaps: DataFrame, out: Path, summary: Summary, top: int) -> None:
    # A literal false filter lets Spark's optimizer replace the scan with an empty relation: when no snapshot
    # has topics or counters, the (empty) tables are written without parsing the logs again.
    ok = parsed.where(
        F.lit(summary.has_extras)
        & (F.col("_status") == "ok")
        & (F.col("type") == "snapshot")
        & F.col("step").isNotNull()
        & (F.col("topics").isNotNull() | F.col("counters").isNotNull())
    )
    final_steps = snaps.groupBy("run").agg(F.max("step").alias("step"))
    held = (
        ok.where(F.col("topics").isNotNull())
        .join(F.broadcast(final_steps), ["run", "step"])
        .select("run", "node", F.explode("topics").alias("t"))
        .select("run", "node", "t.topic", "t.role", "t.size")
    )
    topics = _save_big(
        held.groupBy("run", "topic").agg(
            # Every holder stores the whole topic, so L_T is the size any holder reports (the largest if
            # snapshots disagree mid-update); stored is the total over N1..N3.
            F.max("size").alias("load"),
            F.countDistinct("node").alias("holders"),
            F.sum("size").alias("stored"),
            F.concat_ws(",", F.array_sort(F.collect_set("role"))).alias("roles"),
        ),
        out,
        "topics_final",
        [F.col("load").desc(), "run", "topic"],
    )
    summary.top_topics = _rows(
        topics.groupBy("topic")
        .agg(F.mean("load").alias("mean_load"), F.count(F.lit(1)).alias("runs"))
        .orderBy(F.col("mean_load").desc(), "topic")
        .limit(top)
    )
    # Counters are cumulative per node: each node's latest snapshot holds its totals.
    latest = (
        ok.where(F.col("counters").isNotNull())
        .groupBy("run", "node")
        .agg(F.max_by("counters", F.struct("step", F.coalesce("ts", F.lit(0.0)))).alias("c"))
        .select("run", "node", F.explode("c").alias("key", "value"))
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    try:
        traffic = _save_big(
            latest.where(F.col("key").rlike(TOPIC_COUNTER))
            .select(
                "run",
                F.regexp_extract("key", TOPIC_COUNTER, 1).alias("topic"),
                F.regexp_extract("key", TOPIC_COUNTER, 2).alias("metric"),
                "value",
            )
            .groupBy("run", "topic", "metric")
            .agg(F.sum("value").alias("value"), F.count(F.lit(1)).alias("nodes")),
            out,
            "topic_traffic",
            ["metric", F.col("value").desc(), "run", "topic"],
        )
        ranked = traffic.groupBy("metric", "topic").agg(F.sum("value").alias("value"))
        w = Window.partitionBy("metric").orderBy(F.col("value").desc(), "topic")
        summary.top_traffic = _rows(
            ranked.withColumn("rank", F.row_number().over(w)).where(F.col("rank") <= top).orderBy("metric", "rank")
        )
        _save_small(
            latest.where(~F.col("key").rlike(TOPIC_COUNTER))
            .groupBy("run", F.col("key").alias("counter"))
            .agg(F.sum("value").alias("value"), F.count(F.lit(1)).alias("nodes"))
            .orderBy("run", "counter"),
            out,
            "counters",
        )
    finally:
        latest.unpersist()


MOVED_SCHEMA: Final = T.StructType(
    [
        T.StructField("run", T.StringType()),
        T.StructField("source", T.StringType()),
        T.StructField("bin", T.LongType()),
        T.StructField("t_end", T.DoubleType()),
        T.StructField("moves", T.LongType()),
        T.StructField("v_ml", T.DoubleType()),
        T.StructField("v_ml_cum", T.DoubleType()),
        T.StructField("r_ml", T.DoubleType()),
        T.StructField("bin_width", T.DoubleType()),
        T.StructField("window", T.DoubleType()),
    ]
)


def run_clock(source: str | None, t_min: float, t_max: float) -> tuple[float, float]:
    """(t0, D) of a run: sim time τ starts at 0, broker time at the run's first record."""
    t0 = min(0.0, t_min) if source == "sim" else t_min
    return t0, max(t_max - t0, 0.0)


def _moved_load(spark: SparkSession, records: DataFrame, out: Path, summary: Summary, bin_width: float | None) -> None:
    ok = records.where((F.col("_status") == "ok") & F.col("ts").isNotNull())
    runs = ok.groupBy("run").agg(
        F.min("ts").alias("t_min"),
        F.max("ts").alias("t_max"),
        F.first("source", ignorenulls=True).alias("source"),
    )
    clocks: dict[str, tuple[str | None, float, float, float, int]] = {}
    for r in runs.collect():
        t0, dur = run_clock(r["source"], float(r["t_min"]), float(r["t_max"]))
        width = bin_width if bin_width else (dur / DEFAULT_BINS if dur > 0 else 1.0)
        # The last record (at t0 + D) closes the last bin; the relative slack keeps D / (D / 100) from
        # rounding up to a 101st bin.
        n_bins = max(1, math.ceil(dur / width * (1.0 - 1e-12)))
        clocks[r["run"]] = (r["source"], t0, dur, width, n_bins)
    if not clocks:
        _write_rows(spark, [], MOVED_SCHEMA, out, "moved_load")
        return
    clock_df = spark.createDataFrame(
        [(k, v[1], v[3], v[4]) for k, v in clocks.items()], "run string, t0 double, width double, n_bins long"
    )
    moves = ok.where(F.col("type") == "event").where(F.col("event").isin(*MOVE_EVENTS) & F.col("load").isNotNull())
    raw_bin = F.ceil((F.col("ts") - F.col("t0")) / F.col("width"))
    binned = (
        moves.join(F.broadcast(clock_df), "run")
        .select("run", "load", F.least(F.col("n_bins"), F.greatest(F.lit(1), raw_bin)).alias("bin"))
        .groupBy("run", "bin")
        .agg(F.sum("load").alias("v"), F.count(F.lit(1)).alias("moves"))
    )
    per_run: dict[str, dict[int, tuple[float, int]]] = {}
    for r in binned.collect():
        per_run.setdefault(r["run"], {})[int(r["bin"])] = (float(r["v"]), int(r["moves"]))
    rows: list[dict[str, Any]] = []
    for run in sorted(clocks):
        source, t0, dur, width, n_bins = clocks[run]
        bins = per_run.get(run, {})
        v = np.zeros(n_bins)
        m = np.zeros(n_bins, dtype=np.int64)
        for b, (vol, cnt) in bins.items():
            v[b - 1], m[b - 1] = vol, cnt
        window = WINDOW_FRACTION * dur if dur > 0 else width
        w_bins = max(1, round(window / width))
        # Eq. (14) counts the window in time units; moved_load_rate divides by bins, so scale by the width.
        rate = moved_load_rate(v.tolist(), w_bins) / width
        cum = np.cumsum(v)
        for i in range(n_bins):
            rows.append(
                {
                    "run": run,
                    "source": source,
                    "bin": i + 1,
                    "t_end": (i + 1) * width,
                    "moves": int(m[i]),
                    "v_ml": float(v[i]),
                    "v_ml_cum": float(cum[i]),
                    "r_ml": float(rate[i]),
                    "bin_width": width,
                    "window": w_bins * width,
                }
            )
        summary.moved.append(
            {
                "run": run,
                "source": source,
                "moves": int(m.sum()),
                "v_ml_cum": float(cum[-1]),
                "r_ml_max": float(rate.max()),
                "duration": dur,
                "bin_width": width,
                "window": w_bins * width,
            }
        )
    _write_rows(spark, rows, MOVED_SCHEMA, out, "moved_load")


# ---- summary.md -----------------------------------------------------------------------------------------


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.1f}%" if pct else f"{x:.4g}"
    return str(x)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_summary(s: Summary) -> str:
    """summary.md: record counts, final quantiles, correlations, moved load and top topics."""
    parts = ["# SeDAX log analysis\n", f"Output: `{s.out}`; {s.seconds:.1f} s.\n"]
    parts.append("## Input\n")
    rows = [
        ["lines read", str(s.lines)],
        ["valid records", str(s.records)],
        ["snapshots", str(s.snapshots)],
        ["events", str(s.events)],
        ["bad lines (skipped)", str(s.bad_total)],
        *[[f"– {k}", str(v)] for k, v in s.bad_lines.items()],
        ["snapshots without step or loads (skipped)", str(s.incomplete_snapshots)],
        ["duplicate (run, step, node) snapshots (latest kept)", str(s.duplicate_snapshots)],
        ["(run, step) with zero total L1 (not normalisable, skipped)", str(s.zero_load_steps)],
        ["runs", str(len(s.runs))],
    ]
    parts.append(_table(["what", "count"], rows))
    parts.append(
        "\n## Normalised node load at the final step (pooled over runs)\n\n"
        "100% = sum of L1 over the nodes of a (run, step) / number of nodes. Quantiles: exact, numpy 'linear'.\n\n"
    )
    qcols = [quantile_column(p) for p in DEFAULT_PROBS]
    parts.append(
        _table(
            ["level", "n", *qcols, "mean", "max"],
            [
                [
                    r["level"],
                    str(r["n"]),
                    *[_fmt(r[c], True) for c in qcols],
                    _fmt(r["mean"], True),
                    _fmt(r["max"], True),
                ]
                for r in s.final_quantiles
            ],
        )
    )
    parts.append("\n## Correlation of normalised load with Voronoi cell area (final step, Table II)\n\n")
    if s.correlations:
        runs = [r for r in s.correlations if r["scope"] == "run"]
        crow = [
            [r["scope"], r["run"] or "all", str(r["n"]), *[_fmt(r[f"r_{lv}"]) for lv in LEVELS]]
            for r in s.correlations
            if r["scope"] == "pooled"
        ]
        if runs:
            means = [
                _fmt(float(np.mean([r[f"r_{lv}"] for r in runs if r[f"r_{lv}"] is not None] or [math.nan])))
                for lv in LEVELS
            ]
            crow.append(["mean over runs", f"{len(runs)} runs", str(sum(r["n"] for r in runs)), *means])
        parts.append(_table(["scope", "run", "n", "r(L1)", "r(L2)", "r(L3)"], crow))
    else:
        parts.append("No `cell_area` in the snapshots.\n")
    parts.append("\n## Moved load (eqs. 13-14)\n\n")
    if s.moved:
        parts.append(
            _table(
                ["run", "source", "moves", "V_ML^cum", "max R_ML", "D", "bin", "window W"],
                [
                    [
                        m["run"],
                        str(m["source"]),
                        str(m["moves"]),
                        _fmt(m["v_ml_cum"]),
                        _fmt(m["r_ml_max"]),
                        _fmt(m["duration"]),
                        _fmt(m["bin_width"]),
                        _fmt(m["window"]),
                    ]
                    for m in s.moved
                ],
            )
        )
    else:
        parts.append("No timed records.\n")
    parts.append("\n## Largest topics at the final step\n\n")
    if s.top_topics:
        parts.append(
            _table(
                ["topic", "mean L_T", "runs"],
                [[t["topic"], _fmt(t["mean_load"]), str(t["runs"])] for t in s.top_topics],
            )
        )
    else:
        parts.append("No `topics` in the snapshots.\n")
    parts.append("\n## Per-topic traffic (top per metric)\n\n")
    if s.top_traffic:
        parts.append(
            _table(
                ["metric", "rank", "topic", "value"],
                [[t["metric"], str(t["rank"]), t["topic"], _fmt(t["value"])] for t in s.top_traffic],
            )
        )
    else:
        parts.append("No per-topic counters (`topic:<topic>:<metric>`) in the snapshots.\n")
    if s.plots:
        parts.append("\n## Plots\n\n" + "".join(f"- `{p}`\n" for p in s.plots))
    return "".join(parts)
