"""`sedax analyze` usage errors: they fail fast with exit code 2 and a message, before Spark starts."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.job import AnalysisInputError, check_inputs
from cli import analysis as cli_analysis


def test_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_analysis.main(["analyze", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "log directory not found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_no_logs_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "logs" / "sub").mkdir(parents=True)
    (tmp_path / "logs" / "sub" / "notes.txt").write_text("{}\n")
    (tmp_path / "logs" / "x.json").write_text("{}\n")  # *.json is not *.jsonl
    code = cli_analysis.main(["analyze", str(tmp_path / "logs"), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "no *.jsonl logs found" in capsys.readouterr().err


def test_check_inputs(tmp_path: Path) -> None:
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "a" / "deep" / "broker-1.3.jsonl").write_text("")
    (tmp_path / "b").mkdir()
    check_inputs([str(tmp_path / "a"), str(tmp_path / "b")])  # one directory with logs is enough
    check_inputs([str(tmp_path / "a" / "deep" / "broker-1.3.jsonl")])
    check_inputs(["hdfs://namenode/logs"])  # remote paths are left to Spark
    with pytest.raises(AnalysisInputError, match="no log directory"):
        check_inputs([])
    with pytest.raises(AnalysisInputError, match="not found"):
        check_inputs([str(tmp_path / "a"), str(tmp_path / "c")])
    with pytest.raises(AnalysisInputError, match="no"):
        check_inputs([str(tmp_path / "b")])


def test_check_inputs_measures_the_logs_spark_reads(tmp_path: Path) -> None:
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "a" / "deep" / "broker-1.3.jsonl").write_text("x" * 100)
    (tmp_path / "a" / "notes.txt").write_text("y" * 1000)  # not a log: Spark's *.jsonl filter skips it
    (tmp_path / "b.jsonl").write_text("z" * 10)
    assert check_inputs([str(tmp_path / "a")]) == 100
    assert check_inputs([str(tmp_path / "a"), str(tmp_path / "b.jsonl")]) == 110
    assert check_inputs([f"file://{tmp_path / 'a'}"]) == 100
    assert check_inputs([str(tmp_path / "a"), "hdfs://namenode/logs"]) is None  # unknown: Spark's defaults


def test_register_on_a_foreign_parser() -> None:
    parser = argparse.ArgumentParser(prog="sedax")
    cli_analysis.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["analyze", "d1", "d2", "--out", "o", "--master", "spark://h:7077", "--bin-width", "5"])
    assert args.log_dirs == ["d1", "d2"] and args.master == "spark://h:7077" and args.bin_width == 5.0
    assert args.func is not None
    args = parser.parse_args(["viz", "--log-dir", "d", "--out", "x.svg"])
    assert args.log_dir == ["d"] and args.level == "L1" and args.broker is None
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["analyze", "d"])  # --out is required
    assert exc.value.code == 2
    # Without --broker and --log-dir the brokers come from $SEDAX_BROKERS (test_viz.py); both at once: an error.
    assert parser.parse_args(["viz", "--out", "x.svg"]).broker is None
    with pytest.raises(SystemExit):
        parser.parse_args(["viz", "--broker", "h:1", "--log-dir", "d", "--out", "x.svg"])


def test_module_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cli.analysis", "analyze", str(tmp_path / "none"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "sedax: error: log directory not found" in proc.stderr


def test_progress_goes_to_stderr_before_spark_starts(tmp_path: Path) -> None:
    """The stage line names the files, their size and where the outputs go; stdout stays the result alone."""
    from overlay.logschema import base_record

    logs = tmp_path / "logs"
    logs.mkdir()
    rec = base_record("snapshot", "r1", "sim", 0.0, 0, "n0")
    (logs / "sim-r1.jsonl").write_text(json.dumps(rec) + "\n")
    # Its own process group, so that the JVM it may have started goes with it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "analyze", str(logs), "--out", str(tmp_path / "o"), "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the CLI's first line, written before pyspark is imported
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert first.startswith("sedax analyze: reading 1 *.jsonl file(s)"), first
    assert str(tmp_path / "o") in first and "plots" not in first
    assert out == ""


def test_quiet_leaves_out_the_progress(capsys: pytest.CaptureFixture[str]) -> None:
    cli_analysis._progress(argparse.Namespace(quiet=True), "reading")
    assert capsys.readouterr().err == ""
    cli_analysis._progress(argparse.Namespace(quiet=False), "reading")
    assert capsys.readouterr().err == "sedax analyze: reading\n"
