"""Running a broker under systemd: the shipped unit file and example configuration (deploy/systemd/), and the
notifications a broker sends a `Type=notify` service manager (broker/sdnotify.py).

Two ways.  Here, where no systemd is PID 1, the test plays the service manager's part of sd_notify(3): it binds the
datagram socket systemd would pass in NOTIFY_SOCKET, sets WATCHDOG_USEC as `WatchdogSec=` does, starts the broker
with the example configuration as the unit's ExecStart does, and reads what arrives; `systemd-analyze` checks the
unit file.  And in a container whose PID 1 is a real systemd (the image deploy/Dockerfile builds, on the offline
base), the unit is installed as docs/deploy.md says and driven with systemctl: start, reload, a hung broker that
the watchdog catches, stop.
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
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import containers
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
    settings = (
        "Type=notify",
        "ExecReload=/opt/sedax/bin/sedax broker --config /etc/sedax/broker.toml --check\n"
        "ExecReload=/bin/kill -HUP $MAINPID",
        "KillSignal=SIGTERM",
        "WatchdogSec=",
    )
    for setting in settings:
        assert f"\n{setting}" in text, setting
    assert "ExecStart=/opt/sedax/bin/sedax broker --config /etc/sedax/broker.toml\n" in text
    r = subprocess.run(
        [tool, "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert level is not None, r.stdout[-2000:] + r.stderr
    assert float(level.group(1)) < 2.0, r.stdout  # systemd calls up to 4.0 "OK"; an unhardened unit scores 9.6


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


def _state(pid: int) -> str:
    """The process's state letter in /proc/PID/stat (R, S, T, ...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


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
            first = cluster.nodes[0].node_id

            async def linked() -> bool:
                return "substation-12" in {n.id for n in (await cluster.statuses())[first].neighbours}

            await wait_for(linked, 30.0, "the first broker linked to the one that joined")

            # The watchdog: pings while the loop runs, none while the process is stopped (a hung broker),
            # pings again once it runs.
            await manager.until("WATCHDOG", 10.0)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                # Stopped ("T"): it sends nothing more, and what it sent before is in the socket, drained.
                await wait_for(lambda: _state(proc.pid) == "T", 10.0, "the broker stopped")
                manager.drain()
                with pytest.raises(TimeoutError):
                    await manager.next(4 * watchdog_usec / 1e6)  # systemd would have killed it by now
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await manager.until("WATCHDOG", 10.0)

            # ExecReload='s first step, beside the running broker (its data directory locked, its port bound):
            # the files check out, and a broken one is named.
            check = [sys.executable, "-m", "broker", "--config", str(cfg), "--check"]
            r = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env, check=False)  # noqa: ASYNC221
            assert r.returncode == 0 and r.stdout.startswith("sedax broker: configuration OK: substation-12 at"), r
            assert "TLS as substation-12 until" in r.stdout and "topics in " in r.stdout, r.stdout
            key = certs.cert_paths(cluster.certs_dir, "substation-12")[1]
            good = key.read_bytes()
            key.write_bytes(certs.ca_paths(cluster.certs_dir)[1].read_bytes())  # a key that is not the certificate's
            r = subprocess.run(check, capture_output=True, text=True, timeout=60, env=env, check=False)  # noqa: ASYNC221
            key.write_bytes(good)
            assert r.returncode == 2 and "key values mismatch" in r.stderr and len(r.stderr.splitlines()) == 1, r

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


async def test_a_state_notification_that_finds_the_managers_queue_full_is_sent_once_there_is_room(
    tmp_path: Path, manager: Manager
) -> None:
    # A manager's datagram socket holds net.unix.max_dgram_qlen datagrams (10 by default).  The suite's manager
    # stopped reading while `broker --check` ran beside the broker; the broker's watchdog pings filled its queue
    # and the RELOADING=1 of the SIGHUP that followed was lost, so a `systemctl reload` would have waited for it.
    n = Notifier(str(manager.path), 400_000, logging.getLogger("test"))
    try:
        for _ in range(200):  # a manager that reads nothing for a while: its queue fills, pings are dropped
            n.watchdog()
        n.reloading()
        n.ready("reloaded")
        n.watchdog()  # (behind a waiting state notification: not queued)
        got = [await manager.next(5.0)]
        while not any("READY" in g for g in got):
            got.append(await manager.next(5.0))
        keys = [next(iter(g)) for g in got]
        assert keys.count("RELOADING") == 1 and keys[-2:] == ["RELOADING", "READY"], keys
        assert all(k == "WATCHDOG" for k in keys[:-2]), keys
    finally:
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


# ---- the unit under a real systemd, in a container ----------------------------------------------------------

IMAGE_BUILD_TIMEOUT = 600.0
SYSTEMD_UP_WITHIN = 120.0
# systemctl start returns at READY=1: joining and Python's start on a loaded 2-core machine.
START_TIMEOUT = 180.0
# The test's drop-in shortens WatchdogSec= so that a hung broker is killed within seconds.
TEST_WATCHDOG_SEC = 3
RESTARTED_WITHIN = 120.0
CLIENT = ("--broker", "127.0.0.1:7000", "--ca", "/root/client/ca.pem", "--cert", "/root/client/operator.pem",
          "--key", "/root/client/operator.key")  # fmt: skip


class Machine:
    """A container whose PID 1 is systemd, as on a host: no network but its loopback, removed at close."""

    def __init__(self, image: str) -> None:
        self.name = f"sedax-systemd-test-{uuid.uuid4().hex[:10]}"
        cgroups = containers.run(["docker", "info", "--format", "{{.CgroupVersion}}"], 60).stdout.strip()
        # systemd needs the cgroup tree: the host's (v1, read-only is enough) or a namespace of its own (v2).
        mount = ["-v", "/sys/fs/cgroup:/sys/fs/cgroup:ro"] if cgroups == "1" else ["--cgroupns=private"]
        r = containers.run(
            ["docker", "run", "-d", "--name", self.name, "--user", "0", "--network", "none", "--tmpfs", "/run",
             "--tmpfs", "/run/lock", *mount, "--entrypoint", "/lib/systemd/systemd", image],
            120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr

    def sh(self, *cmd: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return containers.run(["docker", "exec", "-u", "0", self.name, *cmd], timeout)

    def ok(self, *cmd: str, timeout: float = 120.0) -> str:
        r = self.sh(*cmd, timeout=timeout)
        assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}: {r.stdout[-1500:]}{r.stderr[-1500:]}"
        return r.stdout

    def put(self, src: Path, dest: str) -> None:
        r = containers.run(["docker", "cp", str(src), f"{self.name}:{dest}"], 120)
        assert r.returncode == 0, r.stderr

    def unit(self, *props: str) -> dict[str, str]:
        out = self.ok("systemctl", "show", "sedax-broker", "-p", ",".join(props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self) -> str:
        return self.sh("journalctl", "-u", "sedax-broker", "--no-pager", "-o", "cat").stdout

    def close(self) -> None:
        containers.run(["docker", "rm", "-f", "-v", self.name], 120)


@pytest.fixture(scope="module")
def systemd_image() -> Iterator[str]:
    """deploy/Dockerfile's broker image (sedax in /opt/sedax/bin, the user sedax) on the offline base."""
    base = containers.offline_base_image()
    tag = f"sedax-systemd-test:{uuid.uuid4().hex[:10]}"
    r = containers.run(
        ["docker", "build", "-f", "deploy/Dockerfile", "--target", "broker", "--build-arg", f"BASE_IMAGE={base}",
         "--build-arg", "PIP_OPTS=--no-index --no-build-isolation", "-t", tag, "."],
        IMAGE_BUILD_TIMEOUT, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    try:
        yield tag
    finally:
        containers.run(["docker", "rmi", "-f", tag], 300)


@pytest.fixture
def machine(systemd_image: str) -> Iterator[Machine]:
    m = Machine(systemd_image)
    try:
        # Until systemd has made its socket, systemctl cannot reach it ("Failed to connect to bus").
        deadline = time.monotonic() + SYSTEMD_UP_WITHIN
        while (r := m.sh("systemctl", "is-system-running", "--wait")).stdout.strip() not in ("running", "degraded"):
            if time.monotonic() > deadline:
                pytest.skip(f"this Docker engine does not run systemd in a container: {r.stdout}{r.stderr}"[-600:])
            time.sleep(0.5)  # (a synchronous fixture; polled with a deadline)
        yield m
    finally:
        m.close()


def _install(m: Machine, tmp_path: Path) -> Path:
    """docs/deploy.md's install steps: the unit, /etc/sedax with the configuration and TLS files."""
    pki = tmp_path / "pki"
    certs.init_ca(pki)
    cert, key = certs.issue(pki, "substation-12", "broker", ["127.0.0.1"])
    client, client_key = certs.issue(pki, "operator", "client")
    ca = certs.ca_paths(pki)[0]
    cfg = EXAMPLE.read_text()
    cfg = re.sub(r"^join = .*\n", "", cfg, flags=re.M)  # the first broker: it starts the overlay
    cfg, n = re.subn(r"^advertise = .*$", 'advertise = "127.0.0.1:7000"', cfg, flags=re.M)  # (only a loopback)
    assert n == 1
    (tmp_path / "broker.toml").write_text(cfg)
    (tmp_path / "test.conf").write_text(f"[Service]\nWatchdogSec={TEST_WATCHDOG_SEC}\n")
    m.ok("install", "-d", "-m", "0750", "-g", "sedax", "/etc/sedax", "/etc/sedax/tls")
    m.ok("install", "-d", "/root/client", "/etc/systemd/system/sedax-broker.service.d")
    m.put(UNIT, "/etc/systemd/system/sedax-broker.service")
    m.put(tmp_path / "test.conf", "/etc/systemd/system/sedax-broker.service.d/test.conf")
    m.put(tmp_path / "broker.toml", "/etc/sedax/broker.toml")
    for src, dest in ((cert, "broker.pem"), (key, "broker.key"), (ca, "ca.pem")):
        m.put(src, f"/etc/sedax/tls/{dest}")
    for src in (client, client_key, ca):
        m.put(src, f"/root/client/{src.name}")
    m.ok("sh", "-c", "chown -R root:sedax /etc/sedax && chmod 0640 /etc/sedax/broker.toml /etc/sedax/tls/*")
    m.ok("systemctl", "daemon-reload")
    return pki


@pytest.mark.slow
@pytest.mark.timeout(1800)  # (the base image's first build)
async def test_the_unit_under_systemd_starts_reloads_restarts_a_hung_broker_and_stops(
    machine: Machine, tmp_path: Path
) -> None:
    m = machine
    pki = _install(m, tmp_path)
    # `systemctl start` returns once the broker said READY=1.
    m.ok("systemctl", "start", "sedax-broker", timeout=START_TIMEOUT)
    u = m.unit("ActiveState", "SubState", "StatusText", "MainPID", "User")
    assert (u["ActiveState"], u["SubState"], u["User"]) == ("active", "running", "sedax"), u
    assert u["StatusText"].startswith("serving as substation-12 at (0.25, 0.75) on 127.0.0.1:7000"), u
    # The hardening holds for the broker itself: no new privileges, and system-call filters beyond those the
    # container engine puts on every process (systemd's own, PID 1, has only those).
    status, init = m.ok("cat", f"/proc/{u['MainPID']}/status"), m.ok("cat", "/proc/1/status")
    filters = [int(re.search(r"^Seccomp_filters:\s+(\d+)$", t, re.M).group(1)) for t in (status, init)]  # type: ignore[union-attr]
    assert filters[0] > filters[1] and re.search(r"^NoNewPrivs:\s+1$", status, re.M), (filters, status)
    m.ok("sedax", "pub", *CLIENT, "grid/feeder-1/voltage", "230.4")

    # A renewed certificate, then `systemctl reload`: read again, without a restart.
    certs.issue(pki, "substation-12", "broker", ["127.0.0.1"], force=True)
    m.put(certs.cert_paths(pki, "substation-12")[0], "/etc/sedax/tls/broker.pem")
    m.put(certs.cert_paths(pki, "substation-12")[1], "/etc/sedax/tls/broker.key")
    m.ok("sh", "-c", "chown root:sedax /etc/sedax/tls/* && chmod 0640 /etc/sedax/tls/*")
    m.ok("systemctl", "reload", "sedax-broker")
    await wait_for(
        lambda: "SIGHUP: read again the TLS certificate" in m.unit("StatusText")["StatusText"], 60, "the reload"
    )
    assert m.unit("MainPID")["MainPID"] == u["MainPID"]
    # A key that is not the certificate's (a renewal half done): `systemctl reload` fails and says why; the
    # broker gets no signal and serves on with the files it has.
    m.put(certs.ca_paths(pki)[1], "/etc/sedax/tls/broker.key")
    m.ok("sh", "-c", "chown root:sedax /etc/sedax/tls/* && chmod 0640 /etc/sedax/tls/*")
    r = m.sh("systemctl", "reload", "sedax-broker")
    assert r.returncode != 0, r
    assert "key values mismatch" in m.journal(), m.journal()[-3000:]
    after = m.unit("MainPID", "ActiveState", "StatusText")
    assert (after["MainPID"], after["ActiveState"]) == (u["MainPID"], "active"), after
    assert "nothing was reloaded" not in after["StatusText"], after  # it never got the SIGHUP
    m.put(certs.cert_paths(pki, "substation-12")[1], "/etc/sedax/tls/broker.key")
    m.ok("sh", "-c", "chown root:sedax /etc/sedax/tls/* && chmod 0640 /etc/sedax/tls/*")

    # A hung broker (stopped: no loop turns, no watchdog pings) is killed by systemd and started again; it
    # recovers its topic from /var/lib/sedax.
    m.ok("kill", "-STOP", u["MainPID"])

    def restarted() -> bool:
        now = m.unit("NRestarts", "ActiveState", "MainPID", "StatusText")
        return (
            now["NRestarts"] == "1"
            and now["ActiveState"] == "active"
            and now["MainPID"] not in ("0", u["MainPID"])
            and now["StatusText"].startswith("serving as substation-12")
        )

    await wait_for(restarted, RESTARTED_WITHIN, "systemd killed the hung broker and started it again")
    assert "Watchdog timeout" in m.journal(), m.journal()[-3000:]
    got = m.ok("sedax", "sub", *CLIENT, "grid/feeder-1/voltage", "--since", "0", "--count", "1", "--json")
    assert json.loads(got.splitlines()[0])["payload"] == "230.4", got

    # `systemctl stop`: the graceful leave, exit 0.
    m.ok("systemctl", "stop", "sedax-broker", timeout=120)
    u = m.unit("ActiveState", "Result", "ExecMainStatus")
    assert (u["ActiveState"], u["Result"], u["ExecMainStatus"]) == ("inactive", "success", "0"), u
    journal = m.journal()
    assert "SIGTERM: leaving the overlay" in journal and "Traceback" not in journal, journal[-3000:]
