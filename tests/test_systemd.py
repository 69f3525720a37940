"""Running a broker under systemd: the shipped unit file and example configuration (deploy/systemd/), and the
notifications a broker sends a `Type=notify` service manager (broker/sdnotify.py).

No systemd runs here as PID 1, so the test plays the service manager's part of sd_notify(3): it binds the
datagram socket systemd would pass in NOTIFY_SOCKET, sets WATCHDOG_USEC as `WatchdogSec=` does, starts the broker
with the example configuration as the unit's ExecStart does, and reads what arrives.  `systemd-analyze` checks the
unit file itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cluster import wait_for
from conftest import FAST_ARGS

from broker.sdnotify import ENV_SOCKET, ENV_WATCHDOG_PID, ENV_WATCHDOG_USEC, Notifier
from cli.cluster import LocalCluster
from net import certs
from net.credentials import ENV_INSECURE

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "deploy" / "systemd" / "sedax-broker.service"
EXAMPLE = REPO / "deploy" / "systemd" / "broker.toml"


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze is not installed: it comes with `apt-get install -y systemd` (deploy/test-deps.sh)"
        )
    return found


def _unit_here(tmp_path: Path) -> Path:
    """The unit file with its ExecStart pointing at this checkout's `sedax` (verify wants an executable)."""
    sedax = Path(sys.executable).parent / "sedax"
    assert sedax.exists(), f"{sedax}: install the package (pip install -e .)"
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/sedax/bin/sedax", str(sedax)))
    return unit


def test_the_unit_file_verifies_and_is_hardened(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    unit = _unit_here(tmp_path)
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    # An unknown key or a value systemd cannot parse is only a warning on stderr: none may appear.
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr
    text = UNIT.read_text()
    for setting in ("Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "KillSignal=SIGTERM", "WatchdogSec="):
        assert f"\n{setting}" in text, setting
    assert "ExecStart=/opt/sedax/bin/sedax broker --config /etc/sedax/broker.toml\n" in text
    r = subprocess.run(
        [tool, "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert level is not None, r.stdout[-2000:] + r.stderr
    assert float(level.group(1)) < 4.0, r.stdout  # systemd calls up to 4.0 "OK"; an unhardened unit scores 9.6


def _example_config(tmp_path: Path, cluster: LocalCluster, node: str) -> Path:
    """deploy/systemd/broker.toml with this machine's addresses and paths in place of the example's."""
    cert, key = certs.issue(cluster.certs_dir, node, "broker", ["127.0.0.1"])
    values: dict[str, object] = {
        "node_id": node,
        "listen": "127.0.0.1:0",
        "join": [cluster.nodes[0].listen],
        "data_dir": str(tmp_path / "data"),
        "log_dir": str(tmp_path / "log"),
        "metrics": "127.0.0.1:0",
        "tls_cert": str(cert),
        "tls_key": str(key),
        "tls_ca": str(certs.ca_paths(cluster.certs_dir)[0]),
    }
    text = EXAMPLE.read_text()
    text = re.sub(r"^advertise = .*\n", "", text, flags=re.M)  # (127.0.0.1 needs none)
    for name, value in values.items():
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {json.dumps(value)}", text, flags=re.M)
        assert n == 1, f"{name} is not set in {EXAMPLE}"
    cfg = tmp_path / "broker.toml"
    cfg.write_text(text)
    return cfg


class Manager:
    """The service manager's end of sd_notify(3): a datagram socket, and what arrived on it, in order."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.path = path
        self.service: subprocess.Popen[bytes] | None = None  # its exit fails a wait at once
        self.log: Path | None = None

    async def next(self, within: float = 30.0) -> dict[str, str]:
        """The next notification, as its KEY=VALUE lines."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(within):
            while True:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(self.sock, 4096), 0.5)
                    break
                except TimeoutError:
                    if self.service is not None and self.service.poll() is not None:
                        tail = self.log.read_text()[-2000:] if self.log is not None else ""
                        raise AssertionError(f"the broker exited ({self.service.returncode}): {tail}") from None
        return dict(line.split("=", 1) for line in data.decode().split("\n") if line)

    async def until(self, key: str, within: float = 30.0) -> tuple[dict[str, str], list[dict[str, str]]]:
        """Notifications up to the first with `key`: that one, and those before it."""
        before: list[dict[str, str]] = []
        deadline = time.monotonic() + within
        while True:
            got = await self.next(max(0.1, deadline - time.monotonic()))
            if key in got:
                return got, before
            before.append(got)

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv(4096)
            except BlockingIOError:
                return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[Manager]:
    m = Manager(tmp_path / "notify.sock")
    try:
        yield m
    finally:
        m.close()


async def test_a_broker_tells_systemd_when_it_serves_reloads_and_leaves(tmp_path: Path, manager: Manager) -> None:
    watchdog_usec = 400_000  # WatchdogSec=0.4: a ping every 0.2 s
    async with LocalCluster(
        1, coords=[(0.5, 0.5)], state_dir=tmp_path / "cluster", tls=True, broker_args=FAST_ARGS
    ) as cluster:
        cfg = _example_config(tmp_path, cluster, "substation-12")
        env = {**os.environ, ENV_SOCKET: str(manager.path), ENV_WATCHDOG_USEC: str(watchdog_usec)}
        env["PYTHONPATH"] = str(REPO)
        env.pop(ENV_INSECURE)  # (the tests' CLI default; the configuration file decides)
        out = (tmp_path / "broker.out").open("wb")
        err = (tmp_path / "broker.err").open("wb")
        # As the unit's ExecStart (`sedax broker --config /etc/sedax/broker.toml`), with the tests' heartbeats.  (A
        # child that outlives every await here, stopped by its PID below: Popen returns at once.)
        proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "broker", "--config", str(cfg), *FAST_ARGS],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, start_new_session=True,
        )  # fmt: skip
        manager.service, manager.log = proc, tmp_path / "broker.err"
        try:
            ready, before = await manager.until("READY")
            # Ready only once it serves: it said it was joining first, and its readiness line is out.
            assert any("joining the overlay through" in n.get("STATUS", "") for n in before), before
            line = json.loads((tmp_path / "broker.out").read_text().splitlines()[0])
            assert line["event"] == "ready" and line["node"] == "substation-12"
            assert ready["STATUS"].startswith(f"serving as substation-12 at (0.25, 0.75) on {line['listen']}"), ready
            statuses = await cluster.statuses()
            assert "substation-12" in {n.id for n in statuses[cluster.nodes[0].node_id].neighbours}

            # The watchdog: pings while the loop runs, none while the process is stopped (a hung broker),
            # pings again once it runs.
            await manager.until("WATCHDOG", 10.0)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(0)  # (the signal is delivered before kill() returns; let queued pings land)
                manager.drain()
                with pytest.raises(TimeoutError):
                    await manager.next(4 * watchdog_usec / 1e6)  # systemd would have killed it by now
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await manager.until("WATCHDOG", 10.0)

            # SIGHUP (ExecReload=): RELOADING=1 with the time, then READY=1 once the reload is over.
            os.kill(proc.pid, signal.SIGHUP)
            reloading, _ = await manager.until("RELOADING")
            assert int(reloading["MONOTONIC_USEC"]) > 0
            ready, _ = await manager.until("READY")
            assert "SIGHUP: read again the TLS certificate" in ready["STATUS"], ready
            # A reload that is refused ends with READY=1 too, and says so.
            cfg.write_text(cfg.read_text().replace("resilience = 2", "resilience = 3"))
            os.kill(proc.pid, signal.SIGHUP)
            await manager.until("RELOADING")
            ready, _ = await manager.until("READY")
            assert "nothing was reloaded" in ready["STATUS"] and "resilience" in ready["STATUS"], ready

            # SIGTERM (KillSignal=): STOPPING=1, then the graceful leave and exit 0.
            os.kill(proc.pid, signal.SIGTERM)
            stopping, _ = await manager.until("STOPPING")
            assert "leaving the overlay" in stopping["STATUS"]
            await wait_for(lambda: proc.poll() is not None, 30.0, "the broker exited")
            assert proc.returncode == 0, (tmp_path / "broker.err").read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()
        assert "Traceback" not in (tmp_path / "broker.err").read_text()


def test_the_environment_systemd_sets_is_read_as_sd_notify_reads_it(tmp_path: Path) -> None:
    log = logging.getLogger("test")
    assert Notifier.from_environ({}, 7, log) is None  # not started by systemd
    assert Notifier.from_environ({ENV_SOCKET: "relative/path"}, 7, log) is None
    n = Notifier.from_environ({ENV_SOCKET: "@sedax-test", ENV_WATCHDOG_USEC: "3000000"}, 7, log)
    assert n is not None and n.address == "\0sedax-test" and n.watchdog_interval == 1.5
    n.close()
    # WATCHDOG_PID names the process the watchdog is for: another one's is not ours to ping.
    n = Notifier.from_environ({ENV_SOCKET: "/x", ENV_WATCHDOG_USEC: "3000000", ENV_WATCHDOG_PID: "8"}, 7, log)
    assert n is not None and n.watchdog_interval is None
    n.close()
    n = Notifier.from_environ({ENV_SOCKET: "/x", ENV_WATCHDOG_USEC: "soon", ENV_WATCHDOG_PID: "7"}, 7, log)
    assert n is not None and n.watchdog_interval is None
    n.send("READY=1")  # nobody listens at /x: logged once, not raised
    n.close()


async def test_a_cluster_started_by_a_service_keeps_the_service_manager_to_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `sedax cluster up` run by a systemd unit: its brokers are not the service's main process, and a READY=1
    # from one of them would be refused (NotifyAccess=main) or, with NotifyAccess=all, taken for the service's.
    monkeypatch.setenv(ENV_SOCKET, str(tmp_path / "notify.sock"))
    monkeypatch.setenv(ENV_WATCHDOG_USEC, "20000000")
    async with LocalCluster(1, state_dir=tmp_path, broker_args=FAST_ARGS) as cluster:
        environ = Path(f"/proc/{cluster.nodes[0].pid}/environ").read_bytes().split(b"\0")  # noqa: ASYNC240
        names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
    assert "PYTHONPATH" in names and not names & {ENV_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID}, names
