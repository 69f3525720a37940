"""Analysis subcommands of the `sedax` CLI: `analyze` (PySpark job over metrics logs) and `viz` (overlay picture).

`cli/main.py` calls `register(subparsers)`; each subcommand sets `func(args) -> int` (the exit code).
Exit code 2 means a usage problem the message explains (missing log directory, no logs, bad output name),
1 that the input holds no metrics-log record or the analysis failed.  `analyze` says on stderr what it
reads and where it writes before Spark starts (-q for none); stdout carries only its result line.
PySpark, numpy and matplotlib are imported inside the handlers, so `sedax --help` stays cheap.

Also runnable on its own: `python -m cli.analysis analyze LOG_DIR --out DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

from broker.flags import Parser
from cli.args import ENV_BROKERS, EXIT_FAILED, UsageError, brokers, credentials, seconds
from net.credentials import add_credential_flags
from overlay.logschema import SCHEMA

EXIT_USAGE: Final = 2
LEVELS: Final = ("L1", "L2", "L3")
# Lines (and bytes) read from the start of each local *.jsonl file to tell a metrics log from anything else
# before Spark starts: the JVM takes up to minutes on a small machine only to find that nothing was usable.
SNIFF_LINES: Final = 100
SNIFF_BYTES: Final = 1 << 20
# Seconds to wait for a TCP connection to a spark:// master before saying it cannot be reached.
MASTER_CONNECT_TIMEOUT: Final = 5.0


def _fail(msg: str) -> int:
    print(f"sedax: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _missing_dirs(paths: Sequence[str]) -> list[str]:
    # Remote URLs (hdfs://, s3a://) are Spark's to resolve; only plain local paths are checked here.
    return [p for p in paths if "://" not in p and not Path(p).exists()]


def _jsonl_files(paths: Sequence[str]) -> Iterator[Path]:
    """The local *.jsonl files below paths (the files Spark reads, analysis.job.read_logs)."""
    for p in paths:
        local = Path(p)
        if local.is_file():
            if local.name.endswith(".jsonl"):
                yield local
        elif local.is_dir():
            yield from sorted(f for f in local.rglob("*.jsonl") if f.is_file())


def _is_record(line: bytes) -> bool:
    try:
        rec = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return False
    return isinstance(rec, dict) and rec.get("schema") == SCHEMA


def _starts_like_a_log(path: Path) -> bool:
    """Whether one of the first lines of path is a metrics-log record (docs/logs.md)."""
    try:
        with path.open("rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return True  # unreadable here: Spark reports it
    return any(_is_record(line) for line in head.splitlines()[:SNIFF_LINES])


def _input_problem(paths: Sequence[str], files: list[Path]) -> str | None:
    """Why the local inputs (their *.jsonl files) hold nothing to analyse, found before Spark starts."""
    if any("://" in p for p in paths):
        return None  # remote paths (hdfs://, s3a://) are Spark's to read
    if not files or any(_starts_like_a_log(f) for f in files):
        return None  # no *.jsonl at all is analysis.job.check_inputs' usage error
    return (
        f"no metrics-log records in {', '.join(paths)}: the first lines of its {len(files)} *.jsonl file(s) are "
        f"not of the metrics-log schema {SCHEMA} (docs/logs.md); point it at the --log-dir of brokers or of "
        "`sedax sim`"
    )


def _progress(args: argparse.Namespace, text: str) -> None:
    """A stage of the analysis on stderr (stdout carries only the result line)."""
    if not args.quiet:
        print(f"sedax analyze: {text}", file=sys.stderr, flush=True)


def _spark_conf(pairs: Sequence[str] | None) -> dict[str, str]:
    """--conf KEY=VALUE pairs as a dict; UsageError naming the bad one."""
    conf: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--conf takes KEY=VALUE (a Spark property, e.g. spark.executor.memory=2g), got {pair!r}")
        conf[key.strip()] = value
    return conf


def _master_problem(master: str | None) -> str | None:
    """Why a standalone master (spark://host:port[,host:port...]) cannot be reached, found before Spark starts.

    Spark itself retries an unreachable master for a minute and then fails with a stack trace.
    """
    if not master or not master.startswith("spark://"):
        return None
    refused = []
    for hostport in master.removeprefix("spark://").split(","):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            return f"--master {master}: expected spark://HOST:PORT"
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=MASTER_CONNECT_TIMEOUT).close()
        except OSError as exc:
            refused.append(f"{hostport} ({exc.strerror or exc})")
        else:
            return None
    return f"cannot reach the Spark master at {', '.join(refused)}: start it or correct --master"


def _cmd_analyze(args: argparse.Namespace) -> int:
    missing = _missing_dirs(args.log_dirs)
    if missing:
        return _fail(f"log directory not found: {', '.join(missing)}")
    try:
        conf = _spark_conf(args.conf)
    except UsageError as exc:
        return _fail(str(exc))
    if (unreachable := _master_problem(args.master)) is not None:
        print(f"sedax: error: {unreachable}", file=sys.stderr)
        return EXIT_FAILED
    files = list(_jsonl_files(args.log_dirs))
    if (problem := _input_problem(args.log_dirs, files)) is not None:
        print(f"sedax: error: {problem}", file=sys.stderr)
        return EXIT_FAILED
    if files:
        size = sum(f.stat().st_size for f in files)
        _progress(args, f"reading {len(files)} *.jsonl file(s), {size / 1e6:.1f} MB, with Spark "
                  f"({args.master or 'local[*]'}); tables{'' if args.no_plots else ', plots'} and summary.md "
                  f"go to {args.out} ...")  # fmt: skip
    from analysis.job import AnalysisInputError, AnalysisOutputError, SparkStartError, run_analysis

    try:
        summary = run_analysis(
            list(args.log_dirs),
            args.out,
            master=args.master,
            bin_width=args.bin_width,
            top=args.top,
            ccdf_per_step=not args.no_ccdf_per_step,
            plots=not args.no_plots,
            driver_memory=args.driver_memory,
            conf=conf,
        )
    except AnalysisInputError as exc:
        return _fail(str(exc))
    except (AnalysisOutputError, SparkStartError) as exc:
        print(f"sedax: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if summary.records == 0:
        print(
            f"sedax: error: no valid records in {', '.join(args.log_dirs)} ({summary.bad_total} lines skipped as "
            "not of the metrics-log schema, docs/logs.md): point it at the --log-dir of brokers or of `sedax sim`",
            file=sys.stderr,
        )
        return 1
    print(
        f"analysed {summary.records} records ({summary.snapshots} snapshots, {summary.events} events) "
        f"of {len(summary.runs)} runs; skipped {summary.bad_total} bad lines; "
        f"wrote {Path(args.out) / 'summary.md'} in {summary.seconds:.1f} s"
    )
    return 0


def _cmd_viz(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix.lower() not in (".svg", ".png"):
        return _fail(f"--out must end in .svg or .png, got {out.name!r}")
    from analysis.viz import VizError, picture_from_logs, picture_from_statuses, render

    try:
        if args.log_dir is not None:
            missing = _missing_dirs(args.log_dir)
            if missing:
                return _fail(f"log directory not found: {', '.join(missing)}")
            pic = picture_from_logs(args.log_dir)
        else:
            from client.admin import AdminError
            from client.crawl import crawl_any

            try:
                addrs, creds = brokers(args), credentials(args)
            except UsageError as exc:
                return _fail(f"{exc}, or --log-dir DIR" if args.broker is None else str(exc))
            try:
                found, addr = asyncio.run(crawl_any(addrs, credentials=creds, timeout=args.timeout))
            except AdminError as exc:
                print(f"sedax: error: {exc}", file=sys.stderr)
                return EXIT_FAILED
            pic = picture_from_statuses(found.statuses, found.unreachable, f"live overlay via {addr}")
        path = render(pic, out, args.level)
    except VizError as exc:
        return _fail(str(exc))
    print(f"wrote {path}: {len(pic.nodes)} brokers, {len(pic.failed)} failed, {len(pic.moves)} topic moves")
    return 0


def register(subparsers: Any) -> None:
    """Add the `analyze` and `viz` subcommands to an argparse subparsers object."""
    a = subparsers.add_parser(
        "analyze",
        help="analyse metrics logs with PySpark: load quantiles/CCDFs, correlations, moved load",
        description="Read every *.jsonl below LOG_DIR... (docs/logs.md) and write tables (Parquet, CSV), "
        "plots (PNG) and summary.md to --out (docs/analysis.md).",
    )
    a.add_argument("log_dirs", nargs="+", metavar="LOG_DIR", help="directory with *.jsonl logs (searched recursively)")
    a.add_argument("--out", required=True, help="output directory (created if needed)")
    a.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    a.add_argument(
        "--bin-width",
        type=float,
        default=None,
        help="time bin for V_ML/R_ML in the logs' time unit (s for brokers, τ for the simulator; "
        "default D/100 per run)",
    )
    a.add_argument("--top", type=int, default=10, help="topics listed per metric in summary.md (default 10)")
    a.add_argument("--driver-memory", default="1g", help="spark.driver.memory when starting Spark (default 1g)")
    a.add_argument(
        "--conf",
        action="append",
        metavar="KEY=VALUE",
        help="a Spark property, repeatable (e.g. spark.executor.memory=2g; spark.pyspark.python=PATH sets the "
        "executors' Python, default $PYSPARK_PYTHON or this Python)",
    )
    a.add_argument("--no-ccdf-per-step", action="store_true", help="skip the large per-step CCDF table")
    a.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    a.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr (errors still are)")
    a.set_defaults(func=_cmd_analyze)

    v = subparsers.add_parser(
        "viz",
        help="draw the overlay: brokers, Delaunay links, Voronoi cells shaded by load, topic moves",
        description="Draw brokers at their coordinates, Delaunay links, Voronoi cells shaded by the normalised "
        "load of --level, topics' home-to-delegate arrows and failed brokers, as SVG or PNG.",
    )
    src = v.add_mutually_exclusive_group()
    src.add_argument(
        "--broker",
        action="append",
        metavar="HOST:PORT",
        help=f"a live broker, the overlay crawled from it; repeat or comma-separate: the first that answers "
        f"(default: ${ENV_BROKERS})",
    )
    src.add_argument(
        "--log-dir", action="append", metavar="DIR", help="metrics logs (last step of the newest run); repeatable"
    )
    v.add_argument("--out", required=True, metavar="FILE", help="output file, .svg or .png")
    v.add_argument("--level", choices=LEVELS, default="L1", help="load level shading the cells (default L1)")
    v.add_argument("--timeout", type=seconds, default=5.0, help="seconds per broker request (--broker; default 5)")
    add_credential_flags(v)
    v.set_defaults(func=_cmd_viz)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `analyze`/`viz` without the rest of the `sedax` CLI; returns the exit code."""
    parser: argparse.ArgumentParser = Parser(prog="sedax")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
