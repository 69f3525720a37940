"""Bad input to `sedax` ends in one line that names the problem and the fix: exit 2 for usage, 1 for runtime.

Never a traceback.  Most cases run `cli.main.main` in this process (fast); the ones that need a process of
their own (stdin, signals, a busy port) run the `sedax` command.
"""

from __future__ import annotations

import datetime
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from cluster import brokers_marked
from hypothesis import given, settings
from hypothesis import strategies as st

from cli.args import timestamp
from cli.main import main
from cli.signals import Terminated, held, terminated

SEDAX = str(Path(sys.executable).with_name("sedax"))
DEAD = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors, --help, --version
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    return code, err


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["pub", "t", "hi", "--broker", "127.0.0.1"], 2, "HOST:PORT"),
        (["pub", "t", "hi", "--broker", "127.0.0.1:99999"], 2, "1-65535"),
        (["sub", "t", "--broker", "127.0.0.1:x"], 2, "port"),
        (["locate", "t", "--broker", ":7000"], 2, "HOST:PORT"),
        (["move", "t", "0.5,0.5", "--broker", "127.0.0.1"], 2, "HOST:PORT"),
        (["balance", "--broker", "127.0.0.1:0"], 2, "1-65535"),
        (["load", "--topics", "2", "--broker", "host"], 2, "HOST:PORT"),
        (["status", "--broker", "127.0.0.1"], 2, "HOST:PORT"),
        (["route", "0.5,0.5", "--broker", "127.0.0.1:70000"], 2, "1-65535"),
        (["sub", "t", "--since", "nan", "--broker", DEAD], 2, "timestamp"),
        (["sub", "t", "--since", "-1", "--broker", DEAD], 2, "timestamp"),
        (["sub", "t", "--since", "10x", "--broker", DEAD], 2, "a span back from now such as 10m, 2h or 1d"),
        (["sub", "t", "--since=-5m", "--broker", DEAD], 2, "a span back from now such as 10m, 2h or 1d"),
        (["sub", "t", "--since", "2026-13-01", "--broker", DEAD], 2, "an ISO date and time"),
        (["route", "1e13,0", "--broker", DEAD], 2, "finite numbers within"),
        (["brokers", "--broker", DEAD], 1, "cannot reach broker at 127.0.0.1:1"),
        (["brokers", "--broker", DEAD, "--expect", "0"], 2, "a whole number >= 1"),
        (["brokers", "--broker", DEAD, "--wait", "nan"], 2, "positive number of seconds"),
        (["route", "0.5", "--broker", DEAD], 2, "X,Y"),
        (["move", "t", "inf,0", "--broker", DEAD], 2, "finite"),
        (["--log-level", "foo", "status", "--broker", DEAD], 2, "log level"),
        (["locate", "t", "--timeout", "0", "--broker", DEAD], 2, "positive number of seconds"),
        (["pub", "t", "hi", "--timeout", "-1", "--broker", DEAD], 2, "positive number of seconds"),
        (["pub", "t", "hi", "--timeout", "nan", "--broker", DEAD], 2, "positive number of seconds"),
        (["pub", "t", "hi", "--rate", "0", "--broker", DEAD], 2, "positive rate"),
        (["sub", "t", "--count", "0", "--broker", DEAD], 2, ">= 1"),
        (["status", "--timeout", "nan", "--broker", DEAD], 2, "seconds"),
        (["pub", "t", "hi", "--broker", DEAD, "--ca", "/nonexistent"], 2, "--ca"),
        (["locate", "t", "--broker", DEAD, "--ca", "/etc/hostname"], 2, "CA certificate"),
        (["route", "0.5,0.5", "--broker", DEAD, "--ca", "/nonexistent"], 2, "CA certificate"),
        (["balance", "--broker", DEAD, "--ca", "/nonexistent"], 2, "CA certificate"),
        (["move", "t", "0.5,0.5", "--broker", DEAD, "--cert", "/x.pem"], 2, "--cert and --key"),
        (["pub", "t", "hi", "--broker", DEAD], 1, "no broker reachable"),
        (["sub", "t", "--broker", DEAD], 1, "no broker reachable"),
        (["locate", "t", "--broker", DEAD], 1, "no broker reachable"),
        (["move", "t", "0.5,0.5", "--broker", DEAD], 1, "no broker reachable"),
        (["balance", "--broker", DEAD], 1, "no broker reachable"),
        (["status", "--broker", DEAD], 1, "cannot reach broker"),
        (["route", "0.5,0.5", "--broker", DEAD], 1, "cannot reach broker"),
        (["status", "--broker", f"{DEAD},127.0.0.1:2"], 1, "127.0.0.1:2"),
        (["cluster", "up", "--coords", "/nonexistent"], 1, "cannot read --coords"),
        (["cluster", "down", "--state-dir", "/nonexistent"], 1, "no readable cluster state"),
        (["cluster", "restart", "--state-dir", "/nonexistent"], 1, "no cluster runs in /nonexistent"),
        (["completion", "fish"], 2, "invalid choice"),
        # Sizes beyond what the machine holds: one line, not a MemoryError reported as a bug.
        (["sim", "static", "--topics-per-node", "1000000000"], 2, "more than the simulator holds"),
        (["sim", "growth", "--nodes", "100000", "--topics-per-node", "1000"], 2, "lower --nodes or --topics-per-node"),
        (["load", "--topics", "100000000", "--broker", DEAD], 2, "at most 1,000,000 per run"),
        # A path the machine refuses: one line naming it (it was "failed unexpectedly ... a bug in sedax").
        (["certs", "init", "--dir", "/proc/no/such"], 1, "certs: cannot use /proc/no: No such file or directory"),
        (["certs", "issue", "--dir", "/tmp", "--days", "0"], 2, "--days must be a whole number of days"),
        (["certs", "init", "--dir", "/tmp", "--days", "2.5"], 2, "--days must be a whole number of days"),
        (
            ["cluster", "up", "--nodes", "2", "--insecure", "--state-dir", "/proc/no/such"],
            1,
            "cluster: cannot use /proc",
        ),
    ],
)
def test_bad_input_is_one_line_with_the_right_exit_code(
    argv: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if "--ca" in argv or "--cert" in argv:
        monkeypatch.delenv("SEDAX_INSECURE")  # the suite's plain-TCP default (conftest.py) would clash with TLS files
    got, err = _run(argv, capsys)
    line = _one_line_error(err)
    assert got == code, err
    assert says in line, line


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "sedax: error: the following arguments are required: COMMAND"),
        (["pub"], "sedax pub: error: the following arguments are required: TOPIC"),
        (["status", "--bogus"], "sedax: error: unrecognized arguments: --bogus"),
        (["broker", "--resilience", "4"], "sedax broker: error: argument --resilience: invalid choice: 4"),
        (["sim", "static", "--nodes", "x"], "sedax sim static: error: argument --nodes"),
    ],
)
def test_a_usage_error_is_one_line_that_points_at_the_help(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not argparse's whole usage above the error (forty lines for `sedax broker`): the error, and where to look.
    got, err = _run(argv, capsys)
    assert got == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(says) and err.rstrip().endswith("--help` lists the options"), err


def test_cluster_up_without_a_size_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --nodes, no --coords and no cluster stopped in the state directory: exit 2; a stopped cluster's state
    file that cannot be read: exit 1, naming the file.  Neither starts a broker."""
    state = tmp_path / "s"
    got, err = _run(["cluster", "up", "--state-dir", str(state)], capsys)
    assert got == 2 and "give --nodes N" in _one_line_error(err) and "no cluster was stopped" in err
    state.mkdir()
    for text in ("{not json", '{"nodes": [{"index": 1, "coord": [0.1, 0.2], "listen": "127.0.0.1:1"}], "tls": false}'):
        (state / "cluster.stopped.json").write_text(text)
        got, err = _run(["cluster", "up", "--state-dir", str(state)], capsys)
        assert got == 1 and "cluster.stopped.json" in _one_line_error(err), err
    assert not (state / "cluster.json").exists()


def test_a_garbage_coords_file_is_named_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text, says in [("0.1,0.2\nnot a pair\n", "entry 2"), ("[1, 2]", "list of [x, y] pairs"), ("", "no coord")]:
        f = tmp_path / "coords.txt"
        f.write_text(text)
        got, err = _run(["cluster", "up", "--coords", str(f), "--state-dir", str(tmp_path / "s")], capsys)
        assert got == 1 and says in _one_line_error(err), err


def test_status_and_route_take_the_broker_list_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SEDAX_BROKERS", f"{DEAD},127.0.0.1:2")
    for argv in (["status"], ["route", "0.5,0.5"]):
        got, err = _run(argv, capsys)
        assert got == 1 and "127.0.0.1:2" in _one_line_error(err)  # both were tried, the last error is shown
    monkeypatch.setenv("SEDAX_BROKERS", "nonsense")
    got, err = _run(["status"], capsys)
    assert got == 2 and "$SEDAX_BROKERS" in _one_line_error(err)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    # What decides whether a release can be rolled into a running overlay one broker at a time (docs/deploy.md).
    from broker.storage import STORAGE_FORMAT
    from broker.version import VERSION
    from overlay.protocol import OLDEST_CLIENT_VERSION, PROTOCOL_VERSION

    assert out.startswith(f"sedax {VERSION} (wire protocol {PROTOCOL_VERSION}: brokers of {PROTOCOL_VERSION}, ")
    assert f"clients of {OLDEST_CLIENT_VERSION}-{PROTOCOL_VERSION}; storage format {STORAGE_FORMAT})" in out


def test_every_option_has_help_text() -> None:
    from cli.main import build_parser

    parser = build_parser()
    missing = []
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        for a in p._actions:
            if a.help is None and a.dest != "help":
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert missing == []


# ---- in a process of its own --------------------------------------------------------------------------------


def _sedax(args: list[str], stdin: bytes | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SEDAX, *args], input=stdin.decode("latin-1") if stdin else None, capture_output=True, text=True,
        timeout=timeout, check=False, encoding="latin-1",
    )  # fmt: skip


def test_a_stdin_line_over_the_payload_limit(tmp_path: Path) -> None:
    res = _sedax(["pub", "t", "--broker", DEAD], stdin=b"x" * (2 << 20) + b"\n")
    # The connection is refused before the line is read, or the line is refused: either way, one line, exit 1.
    assert res.returncode == 1
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_busy_port_is_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _sedax(["broker", "--listen", f"127.0.0.1:{port}", "--coord", "0.5,0.5", "--insecure"])
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "cannot listen on" in res.stderr and "--listen" in res.stderr


# Ctrl-C, and what ends a command the same way since SIGTERM and SIGHUP are handled: a service manager's stop,
# `timeout`, a closed terminal.  Their default action ended `cluster up` at once, and the brokers it had started
# ran on with no state file for `cluster down` to find them by.
@pytest.mark.parametrize(
    ("sig", "seed"),
    [(signal.SIGINT, 1), (signal.SIGINT, 2), (signal.SIGINT, 3), (signal.SIGTERM, 4), (signal.SIGHUP, 5)],
    ids=["SIGINT-1", "SIGINT-2", "SIGINT-3", "SIGTERM", "SIGHUP"],
)
def test_a_signal_during_cluster_up_leaves_no_broker_running(tmp_path: Path, sig: signal.Signals, seed: int) -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, "SEDAX_TEST_MARK": mark}
    extra = random.Random(seed).uniform(0.0, 1.0)  # after the first broker started: during later starts or convergence
    with subprocess.Popen(
        [SEDAX, "cluster", "up", "--nodes", "12", "--insecure", "--state-dir", str(tmp_path / "c")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        deadline = time.monotonic() + 60
        while not brokers_marked(mark) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert brokers_marked(mark), "no broker started"
        deadline = time.monotonic() + extra
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        interrupted = proc.poll() is None
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    if interrupted and proc.returncode != 0:
        said = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
        assert proc.returncode == 128 + sig and said in err, (proc.returncode, err)
        assert not (tmp_path / "c" / "cluster.json").exists()
    else:  # it finished before the signal: the brokers run and `cluster down` finds them
        down = _sedax(["cluster", "down", "--state-dir", str(tmp_path / "c")])
        assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while brokers_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert brokers_marked(mark) == []


def test_a_signal_handled_in_process_is_given_back(capsys: pytest.CaptureFixture[str]) -> None:
    # main() may be called in-process (as here): the handlers it sets for SIGTERM and SIGHUP are undone on return.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    assert main(["route", "0.5,0.5", "--broker", DEAD, "--timeout", "0.2"]) == 1
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("command", ["cluster", "demo"])
def test_a_cluster_the_machine_cannot_hold_is_refused_before_a_broker_starts(tmp_path: Path, command: str) -> None:
    # A zero too many: before, `cluster up --nodes 100000` started brokers until the machine ran out of memory;
    # `demo --nodes 100000` then said so as a failure of the demo (exit 1), not of the command line.
    argv = ["cluster", "up", "--state-dir", str(tmp_path / "c")] if command == "cluster" else ["demo"]
    res = _sedax([*argv, "--nodes", "100000", "--insecure"])
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--nodes 100000: 100000 brokers do not fit this machine" in res.stderr, res.stderr
    assert "ask for fewer" in res.stderr, res.stderr
    assert not (tmp_path / "c").exists()


# ---- random argument vectors --------------------------------------------------------------------------------

TOKENS = st.sampled_from(
    ["--broker", DEAD, "127.0.0.1", ":1", "--timeout", "0", "-1", "nan", "inf", "1e309", "--since", "--count",
     "--rate", "--json", "--ca", "/nonexistent", "--cert", "--key", "--token", "x", "--insecure", "t", "a/b",
     "", " ", "0.5,0.5", "1e13,0", ",", "--all", "--topics", "--prefix", "#", "+", "\x00", "é", "--help-me"]
)  # fmt: skip
COMMANDS = ["pub", "sub", "locate", "status", "route", "move", "balance", "load", "topics", "topics-nope", "cluster",
            "completion"]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(command=st.sampled_from(COMMANDS), rest=st.lists(TOKENS, max_size=7))
def test_random_arguments_never_end_in_a_traceback(command: str, rest: list[str]) -> None:
    argv = [command, *rest]
    if command == "cluster":
        argv = ["cluster", "down", "--state-dir", "/nonexistent", *rest]
    if command in ("sub",):
        argv += ["--timeout", "0.5"]  # never wait on a subscription
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0) if not isinstance(exc.code, str) else 2
    assert code in (0, 1, 2)


# ---- sedax analyze over input that is not a metrics log ----------------------------------------------------

ANALYZE_PROBE = """
import sys
from cli.main import main
code = main(sys.argv[1:])
print(code, "pyspark" in sys.modules)
"""


def test_analyze_over_garbage_is_one_line_before_spark_starts(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    (logs / "deep").mkdir(parents=True)
    (logs / "a.jsonl").write_bytes(random.Random(1).randbytes(5000))
    (logs / "deep" / "b.jsonl").write_text('hello\n{"x": 1}\n[1, 2]\n\n{"schema": 2, "type": "event"}\n')
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-c", ANALYZE_PROBE, "analyze", str(logs), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.stdout.split() == ["1", "False"], res.stdout + res.stderr  # exit 1, and Spark was never loaded
    line = _one_line_error(res.stderr)
    assert "no metrics-log records" in line and "2 *.jsonl file(s)" in line and "--log-dir" in line
    assert res.stderr.strip() == line
    assert not out.exists()


def test_running_out_of_memory_is_one_line_that_says_so_not_a_bug_report() -> None:
    # The largest simulation the simulator takes, in a process held to 700 MB of address space: numpy's
    # MemoryError was reported as "failed unexpectedly ... this is a bug in sedax".
    import resource

    def small() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (700 * 2**20, 700 * 2**20))

    argv = [SEDAX, "sim", "static", "--nodes", "100", "--topics-per-node", "100000"]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=small, env=env, check=False)
    assert res.returncode == 1, res.stderr
    assert "sim ran out of memory" in _one_line_error(res.stderr)
    assert "bug" not in res.stderr


def test_an_exception_without_text_is_described_by_what_it_means_there() -> None:
    # `f"{exc or 'no answer within 5 s'}"` printed "locate failed: " for a bare TimeoutError: an exception is
    # always true, so the alternative was never taken.
    from client.errors import describe

    assert describe(TimeoutError(), "no answer within 5 s") == "no answer within 5 s"
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(ConnectionResetError("gone"), "unused") == "gone"


def test_since_reads_a_timestamp_a_span_back_from_now_or_an_iso_time() -> None:
    now = 1_800_000_000.0
    assert timestamp("0", now) == 0.0 and timestamp("1764406800.5", now) == 1764406800.5
    assert [now - timestamp(t, now) for t in ("90s", "10m", "2h", "1d", "1.5h")] == [90, 600, 7200, 86400, 5400]
    assert timestamp("100000d", now) == 0.0  # further back than 1970: everything stored
    assert timestamp("2026-11-29T09:00:00Z", now) == timestamp("2026-11-29T10:00:00+01:00", now) == 1795942800.0
    naive = "2026-11-29T09:00"  # local time, as `date` reads it
    assert timestamp(naive, now) == datetime.datetime(2026, 11, 29, 9, 0).timestamp()


def test_brokers_waiting_for_brokers_that_never_answer_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # --wait asks again until its time is up (the brokers asked may be restarting), then exits 1 with the reason.
    got = main(["brokers", "--broker", DEAD, "--wait", "0.5"])
    out, err = capsys.readouterr()
    assert got == 1 and "Traceback" not in out + err, out + err
    assert out.splitlines()[-1].startswith("not ready: no broker answered: cannot reach broker at 127.0.0.1:1"), out


def test_a_signal_in_a_held_step_is_handled_after_it() -> None:
    # cli/cluster.py starts a broker and records it inside `held()`: SIGTERM or SIGHUP in between once left a
    # broker running that no clean-up knew of (seen as a stray broker after `cluster up` was stopped).
    assert threading.current_thread() is threading.main_thread()  # (pytest-xdist runs tests on the main thread)
    before = signal.signal(signal.SIGTERM, terminated)
    steps = []
    try:
        with pytest.raises(Terminated) as ended, held():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("started")  # not cut off by the signal ...
            steps.append("recorded")
        assert ended.value.signum == signal.SIGTERM and steps == ["started", "recorded"]  # ... which came after
        assert signal.getsignal(signal.SIGTERM) is terminated  # and the handler is back
    finally:
        signal.signal(signal.SIGTERM, before)
