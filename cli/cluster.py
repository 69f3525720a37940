"""A local cluster of broker processes on 127.0.0.1 (ports from the OS), for tests, benchmarks and demos.

`LocalCluster` is an async context manager: it starts N `python -m broker` processes, each joining through
brokers that are already running, waits for their readiness lines and, on request, for the overlay to
converge to the Delaunay triangulation of the live coordinates (checked through STATUS against scipy).
It keeps no event-loop-bound state between calls, so one cluster can serve tests running on different loops.

Brokers speak TLS unless the cluster is insecure: a development CA and one broker certificate per node
(CN = node id) are created under ``state_dir/certs`` (net/certs.py), and `credentials(name)` issues
client certificates for tools and tests.  `tls=None` means TLS unless SEDAX_INSECURE is set.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, Self

import numpy as np

from broker import defaults
from broker.memory import human_bytes, memory_available
from broker.sdnotify import SERVICE_MANAGER_ENV
from cli.signals import held
from client.admin import AdminClient, AdminError
from client.crawl import Crawl, link_gaps, report
from net import certs
from net.credentials import ENV_INSECURE, Credentials, parse_bool
from overlay.geometry import UNIT_SQUARE, Coord, Space, delaunay_neighbour_map
from overlay.protocol import Status

# How often conditions (readiness, exit, convergence) are polled; small against the ~100 ms they take.
POLL_INTERVAL: Final = 0.02
# A broker process imports numpy and scipy (~0.7 s of CPU); on a loaded 2-core machine 20 starting at once
# need well over 10 s, so readiness waits are generous.
READY_TIMEOUT: Final = 60.0
# SIGTERM gives a broker this long to send LEAVE and drain before SIGKILL.
STOP_GRACE: Final = 10.0
# New brokers started at once; more only queue on the CPU behind numpy/scipy imports.
START_BATCH: Final = 8
STATE_FILE: Final = "cluster.json"
# `sedax cluster down` renames the state file to this: what `cluster up` needs to start the same brokers again.
STOPPED_FILE: Final = "cluster.stopped.json"
PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>
# What one more broker process takes: ~43 MiB of private memory when idle, most of it its imports (numpy,
# scipy.spatial; docs/benchmarks-scale.md, "Memory"), with room for its buffers.  A cluster the machine cannot
# hold (a --nodes with a zero too many) is refused before its first broker starts, not ended by the OOM killer.
BROKER_PROCESS_MEMORY: Final = 48 * 2**20
_REPO_ROOT: Final = Path(__file__).resolve().parent.parent


class ClusterError(RuntimeError):
    """A broker did not start, exited, or the overlay did not converge in time (the message says which)."""


class ClusterTooLarge(ClusterError):
    """More brokers were asked for than the machine's memory holds (a usage error: ask for fewer)."""


class Process(Protocol):
    """What a LocalCluster does with a broker's process: a child it started (`subprocess.Popen`), or one a
    `sedax cluster up` before it started and left running (`AdoptedProcess`)."""

    @property
    def pid(self) -> int: ...

    returncode: int | None

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class AdoptedProcess:
    """A broker process this process did not start (the state file of `sedax cluster up` names it): signalled
    by pid, and running while that pid is still a SeDAX broker (not a pid reused by another program)."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid or 0
        self.returncode: int | None = None if pid else 0  # (no pid: not running when the state was written)

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        # Not our child: its exit status is not ours to read; 0 once it is gone.
        if self.returncode is None and not _is_broker(self._pid):
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self._pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self._pid), timeout or 0.0)
            time.sleep(POLL_INTERVAL)
        return code


@dataclass
class BrokerProcess:
    """One broker process of a LocalCluster."""

    index: int
    coord: Coord
    node_id: str
    proc: Process
    out_path: Path
    err_path: Path
    listen: str = ""
    metrics: str = ""  # the Prometheus endpoint's "host:port" when the broker runs with --metrics

    @property
    def pid(self) -> int:
        """The OS process id."""
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def stderr_tail(self, lines: int = 20) -> str:
        """The last lines of the broker's log."""
        try:
            return "\n".join(self.err_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """N broker processes on localhost; see the module docstring.

    Attributes:
        n: brokers to start on enter.
        seed: seed of the random coordinates (uniform in the space) when coords is not given.
        coords: explicit coordinates (length >= n).
        resilience: passed to every broker.
        state_dir: where logs and the state file go (default: a fresh directory under /tmp).
        broker_args: extra command-line flags for every broker.
        tls: TLS with a development CA in state_dir/certs (True), plain TCP with --insecure (False), or
            TLS unless the environment sets SEDAX_INSECURE (None).
        data_dirs: every broker keeps its topics on disk in state_dir/data/n<index> (docs/storage.md); a
            broker started again (`restart`) finds its data there.
        hosts: every broker on a loopback address of its own, 127.0.0.(10 + index), from which it also dials its
            peers, so that firewall rules (tests: nftables) can cut the links between chosen brokers.
        detached: leave the brokers running when this process exits (`sedax cluster up`, which hands them
            to `sedax cluster down`); otherwise (Linux) they get SIGTERM when their owner dies, even by SIGKILL.
        listens: the address each broker listens on, by index (a cluster started again from its stopped state:
            clients keep the addresses they were given); one taken by another program meanwhile falls back to a
            port from the OS.  Default: ports from the OS.
    """

    n: int = 0
    seed: int = 0
    coords: Sequence[Coord] | None = None
    resilience: int = defaults.RESILIENCE
    state_dir: Path | None = None
    broker_args: Sequence[str] = ()
    space: Space = UNIT_SQUARE
    nodes: list[BrokerProcess] = field(default_factory=list)
    tls: bool | None = None
    detached: bool = False
    data_dirs: bool = False
    hosts: bool = False
    listens: Sequence[str] = ()
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        memory = memory_available()
        if self.n * BROKER_PROCESS_MEMORY > memory:
            raise ClusterTooLarge(
                f"{self.n} brokers do not fit this machine: each broker process takes about "
                f"{human_bytes(BROKER_PROCESS_MEMORY)} and the machine has {human_bytes(memory)}, room for "
                f"{memory // BROKER_PROCESS_MEMORY}; ask for fewer"
            )
        if self.state_dir is None:
            self.state_dir = Path(f"/tmp/sedax-cluster-{os.getpid()}-{time.monotonic_ns()}")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.tls is None:
            self.tls = not parse_bool(ENV_INSECURE, os.environ.get(ENV_INSECURE, ""))
        if self.tls:
            certs.ensure_ca(self.certs_dir)
        if self.coords is not None and len(self.coords) < self.n:
            raise ClusterError(f"{self.n} brokers but only {len(self.coords)} coordinates")

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------------------------- credentials

    @property
    def certs_dir(self) -> Path:
        """Where the development CA and the certificates live."""
        assert self.state_dir is not None
        return self.state_dir / "certs"

    def credentials(self, name: str = "cluster-admin", role: str = "client") -> Credentials:
        """Credentials for a client or tool named name (its certificate is issued on first use)."""
        if not self.tls:
            return Credentials(insecure=True)
        cert, key = certs.ensure_issued(self.certs_dir, name, role)
        return Credentials(ca=str(certs.ca_paths(self.certs_dir)[0]), cert=str(cert), key=str(key))

    def host(self, index: int) -> str:
        """The loopback address broker `index` listens on (127.0.0.1 unless `hosts`)."""
        if not self.hosts:
            return "127.0.0.1"
        if index > 240:
            raise ClusterError("hosts=True gives brokers 127.0.0.10 .. 127.0.0.250: at most 241 of them")
        return f"127.0.0.{10 + index}"

    def tls_args(self, name: str, host: str = "127.0.0.1") -> list[str]:
        """Broker flags for TLS as node name (certificate issued on first use, valid for host), or --insecure."""
        if not self.tls:
            return ["--insecure"]
        cert, key = certs.ensure_issued(self.certs_dir, name, "broker", [host])
        ca = certs.ca_paths(self.certs_dir)[0]
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]

    # -------------------------------------------------------------------------------------------- start

    def _next_coord(self) -> Coord:
        i = len(self.nodes)
        if self.coords is not None and i < len(self.coords):
            c = self.coords[i]
            return (float(c[0]), float(c[1]))
        p = self.space.uniform(self._rng, 1)[0]
        return (float(p[0]), float(p[1]))

    async def start(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Start the first broker, then the others in batches, each joining through running ones.

        progress(started, n) is called after each batch (`sedax cluster up` prints it).
        """
        if self.n <= 0:
            return
        await self.add()
        while len(self.nodes) < self.n:
            if progress is not None:
                progress(len(self.nodes), self.n)
            batch = min(START_BATCH, self.n - len(self.nodes))
            await asyncio.gather(*(self.add() for _ in range(batch)))
        if progress is not None:
            progress(len(self.nodes), self.n)

    def _join_addresses(self) -> list[str]:
        ready = [bp.listen for bp in self.nodes if bp.listen and bp.alive]
        if not ready:
            return []
        picks = self._rng.choice(len(ready), size=min(3, len(ready)), replace=False)
        return [ready[int(i)] for i in picks]

    def spawn(
        self,
        coord: Coord | None = None,
        join: Sequence[str] | None = None,
        *extra: str,
        index: int | None = None,
        listen: str | None = None,
    ) -> BrokerProcess:
        """Start one broker process without waiting for it (see `add`); index: start broker `index` again;
        listen: its address (the default lets the OS choose a port)."""
        assert self.state_dir is not None
        again = index is not None
        index = len(self.nodes) if index is None else index
        c = coord if coord is not None else self._next_coord()
        node_id = f"n{index}"
        if listen is None and index < len(self.listens) and _bindable(self.listens[index]):
            listen = self.listens[index]
        listen = listen or f"{self.host(index)}:0"
        joins = list(join) if join is not None else self._join_addresses()
        args = [sys.executable, "-m", "broker", "--coord", f"{c[0]!r},{c[1]!r}", "--node-id", node_id]
        host = listen.rsplit(":", 1)[0]
        args += ["--listen", listen, "--resilience", str(self.resilience), *self.tls_args(node_id, host)]
        if self.data_dirs:
            args += ["--data-dir", str(self.data_dir(index))]
        if self.space != UNIT_SQUARE:
            args += ["--space", ",".join(repr(v) for v in self.space.to_list())]
        for a in joins:
            args += ["--join", a]
        args += [*self.broker_args, *extra]
        out_path = self.state_dir / f"broker-{index}.out"
        err_path = self.state_dir / f"broker-{index}.err"
        if again and err_path.exists():
            # A restarted broker's earlier lives keep their logs (broker-<i>.<life>.err, 1 the first): what
            # happened before a crash or a full restart is what one reads them for.
            life = 1
            while (self.state_dir / f"broker-{index}.{life}.err").exists():
                life += 1
            err_path.rename(self.state_dir / f"broker-{index}.{life}.err")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.pop(ENV_INSECURE, None)  # the flags above decide
        for name in SERVICE_MANAGER_ENV:  # this command's own, if systemd runs it: the brokers are not the service
            env.pop(name, None)
        # Started and recorded as one step: a signal in between (Ctrl-C or SIGTERM during `cluster up`) left a
        # broker running that no clean-up knew of.
        with held(), out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                preexec_fn=None if self.detached else die_with_parent,
            )
            bp = BrokerProcess(index, c, node_id, proc, out_path, err_path)
            if again:
                self.nodes[index] = bp
            else:
                self.nodes.append(bp)
        return bp

    def data_dir(self, index: int) -> Path:
        """Broker `index`'s data directory (with data_dirs)."""
        assert self.state_dir is not None
        return self.state_dir / "data" / f"n{index}"

    async def restart(self, i: int, *extra: str) -> BrokerProcess:
        """Start broker i again (after stop or kill): same coordinate, node id, address and data directory (as an
        operator restarts a broker, so clients find it where it was); it joins through the running brokers, or
        starts alone if none runs."""
        old = self.nodes[i]
        if old.alive:
            raise ClusterError(f"broker {i} is still running: stop or kill it first")
        joins = [bp.listen for bp in self.nodes if bp.listen and bp.alive and bp.index != i][:3]
        bp = self.spawn(old.coord, joins, *extra, index=i, listen=old.listen or None)
        await self.wait_ready(bp)
        return bp

    async def add(self, coord: Coord | None = None, join: Sequence[str] | None = None) -> BrokerProcess:
        """Start one broker joining through running ones and wait until it reports ready."""
        bp = self.spawn(coord, join)
        await self.wait_ready(bp)
        return bp

    async def wait_ready(self, bp: BrokerProcess, within: float = READY_TIMEOUT) -> None:
        """Wait for the readiness line of bp; ClusterError (with its log) if it exits or times out."""
        deadline = time.monotonic() + within
        while True:
            line = _first_line(bp.out_path)
            if line:
                ready: dict[str, Any] = json.loads(line)
                bp.listen = str(ready["listen"])
                bp.metrics = str(ready.get("metrics", ""))
                return
            if not bp.alive:
                raise ClusterError(f"broker {bp.index} exited with {bp.proc.returncode}:\n{bp.stderr_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"broker {bp.index} not ready within {within} s:\n{bp.stderr_tail()}")
            await asyncio.sleep(POLL_INTERVAL)

    async def wait_exit(self, bp: BrokerProcess, within: float) -> int | None:
        """Wait up to `within` seconds for bp to exit; its exit code, or None if it still runs."""
        deadline = time.monotonic() + within
        # A child's exit has no asyncio event without a child watcher tied to one loop; polling keeps the
        # cluster usable from any loop.
        while bp.proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(POLL_INTERVAL)
        return bp.proc.poll()

    # ------------------------------------------------------------------------------------------ control

    def live(self) -> list[BrokerProcess]:
        """Brokers whose process runs and that reported ready."""
        return [bp for bp in self.nodes if bp.listen and bp.alive]

    async def kill(self, i: int) -> None:
        """SIGKILL broker i (a crash: no LEAVE) and reap it."""
        bp = self.nodes[i]
        if bp.alive:
            bp.proc.send_signal(signal.SIGKILL)
        await self.wait_exit(bp, STOP_GRACE)

    async def stop(self, i: int, grace: float = STOP_GRACE, sig: int = signal.SIGTERM) -> int | None:
        """SIGTERM (or sig) to broker i (graceful leave), SIGKILL after grace seconds; returns its exit code."""
        bp = self.nodes[i]
        if bp.alive:
            bp.proc.send_signal(sig)
        code = await self.wait_exit(bp, grace)
        if code is None:
            bp.proc.kill()
            code = await self.wait_exit(bp, grace)
        return code

    def abort(self) -> None:
        """SIGKILL every broker started so far and reap it (an interrupted start: nothing is worth keeping)."""
        for bp in self.nodes:
            if bp.alive:
                bp.proc.kill()
        for bp in self.nodes:
            bp.proc.wait()

    async def close(self) -> None:
        """Stop every broker: SIGTERM all, SIGKILL the ones still running after the grace period."""
        running = [bp for bp in self.nodes if bp.alive]
        for bp in running:
            bp.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(self.wait_exit(bp, STOP_GRACE) for bp in running))
        for bp in self.nodes:
            if bp.alive:
                bp.proc.kill()
            bp.proc.wait()

    # ------------------------------------------------------------------------------------- convergence

    def expected_neighbours(self) -> dict[str, set[str]]:
        """Delaunay neighbours of the live brokers' coordinates as the brokers link them, by node id."""
        return delaunay_neighbour_map({bp.node_id: bp.coord for bp in self.live()})

    async def statuses(self, within: float = 5.0) -> dict[str, Status]:
        """STATUS of every live broker, fetched concurrently."""

        creds = self.credentials()

        async def one(bp: BrokerProcess) -> Status:
            async with await AdminClient.connect(bp.listen, timeout=within, credentials=creds) as c:
                return await c.status()

        live = self.live()
        results = await asyncio.gather(*(one(bp) for bp in live))
        return {bp.node_id: st for bp, st in zip(live, results, strict=True)}

    async def mismatches(self) -> list[str]:
        """Differences between the overlay's links and the Delaunay triangulation (empty = converged)."""
        try:
            sts = await self.statuses()
        except AdminError as exc:
            return [f"status failed: {exc}"]
        coords = {bp.node_id: bp.coord for bp in self.live()}
        return link_gaps(coords, {nid: {n.id for n in st.neighbours} for nid, st in sts.items()})

    async def wait_converged(self, deadline: float = 30.0) -> float:
        """Wait up to `deadline` seconds until every live broker's links equal its Delaunay neighbours.

        Returns the seconds it took; raises ClusterError listing the differences when time runs out.
        """
        start = time.monotonic()
        limit = start + deadline
        while True:
            diff = await self.mismatches()
            if not diff:
                return time.monotonic() - start
            if time.monotonic() > limit:
                raise ClusterError(f"overlay not Delaunay after {deadline} s:\n" + "\n".join(diff[:20]))
            await asyncio.sleep(POLL_INTERVAL * 5)

    async def lagging(self, topics: Iterable[str] = (), within: float = 5.0) -> list[str]:
        """Topics whose copies are not all caught up (client.crawl.Crawl.lagging) on the live brokers; empty:
        the next broker may be restarted.  topics: topics known to exist, lagging also when no broker reports
        them."""
        creds = self.credentials()
        live = self.live()
        try:
            reports = await asyncio.gather(*(report(bp.listen, timeout=within, credentials=creds) for bp in live))
        except AdminError as exc:
            return [f"(status failed: {exc})"]
        found = Crawl()  # (what a crawl of the live brokers finds, judged the same way)
        for bp, (st, holdings) in zip(live, reports, strict=True):
            found.statuses[bp.node_id] = st
            found.holdings[bp.node_id] = holdings
        return found.lagging(topics)

    # -------------------------------------------------------------------------------------- state file

    def state(self) -> dict[str, Any]:
        """The state file contents (`ClusterState`): what `cluster down` needs to stop exactly these processes, and
        `cluster up` and `restart` to start the same brokers again."""
        return {
            "nodes": [
                {
                    "index": bp.index,
                    # (None for a broker not running: `down` must not signal a pid another program may have now)
                    "pid": bp.pid if bp.alive else None,
                    "node": bp.node_id,
                    "listen": bp.listen,
                    "coord": list(bp.coord),
                    "log": str(bp.err_path),
                }
                for bp in self.nodes
            ],
            "tls": bool(self.tls),
            "resilience": self.resilience,
            "broker_args": list(self.broker_args),
        }

    @classmethod
    def from_state(cls, state_dir: Path) -> LocalCluster:
        """The running cluster `sedax cluster up` started in state_dir (its STATE_FILE), its brokers adopted so
        that they can be stopped and started again (`stop`, `restart`); StateFileError if there is none."""
        try:
            st = read_state(state_dir / STATE_FILE)
        except FileNotFoundError:
            raise StateFileError(
                f"no cluster runs in {state_dir} ({STATE_FILE} not found): start one with `sedax cluster up`"
            ) from None
        cluster = cls(
            0,
            coords=[n.coord for n in st.nodes],
            resilience=st.resilience,
            state_dir=state_dir,
            broker_args=st.broker_args,
            tls=st.tls,
            detached=True,
            data_dirs=True,
        )
        for n in st.nodes:
            out = state_dir / f"broker-{n.index}.out"
            proc = AdoptedProcess(n.pid)
            cluster.nodes.append(BrokerProcess(n.index, n.coord, n.node, proc, out, n.log, listen=n.listen))
        return cluster

    def write_state(self) -> Path:
        """Write the state file into state_dir and return its path."""
        assert self.state_dir is not None
        path = self.state_dir / STATE_FILE
        path.write_text(json.dumps(self.state(), indent=2) + "\n")
        return path

    def detach(self) -> None:
        """Forget the processes so close() leaves them running (for `cluster up`)."""
        for bp in self.nodes:
            # The brokers outlive this process; mark the Popen objects as finished so their finalizers do
            # not warn about a child that is deliberately left running.
            bp.proc.returncode = 0
        self.nodes.clear()


class StateFileError(ValueError):
    """A cluster's state file (running or stopped) is missing, cannot be read or is not what `sedax cluster up`
    and `down` write."""


@dataclass(frozen=True)
class NodeState:
    """One broker of a state file: data directory data/n<index>, node id, process (None: not running), address,
    coordinate and log."""

    index: int
    node: str
    pid: int | None
    listen: str
    coord: Coord
    log: Path


@dataclass(frozen=True)
class ClusterState:
    """A state file (`LocalCluster.state`): what `cluster down` stops and `cluster up` (after a `down`, from
    STOPPED_FILE) or `cluster restart` starts again."""

    nodes: tuple[NodeState, ...]
    tls: bool
    resilience: int
    broker_args: tuple[str, ...]


def read_state(path: Path) -> ClusterState:
    """Parse a state file; FileNotFoundError if there is none, StateFileError if it is not one."""
    try:
        state = json.loads(path.read_text())
        nodes = tuple(
            NodeState(
                int(n["index"]),
                str(n["node"]),
                None if n["pid"] is None else int(n["pid"]),
                str(n["listen"]),
                (float(n["coord"][0]), float(n["coord"][1])),
                Path(n["log"]),
            )
            for n in sorted(state["nodes"], key=lambda n: int(n["index"]))
        )
        if [n.index for n in nodes] != list(range(len(nodes))) or not nodes:
            raise ValueError("its brokers are not numbered 0 .. n-1")
        # (a state file of an older version has no level or flags: the defaults of `cluster up` then)
        resilience = int(state.get("resilience", defaults.RESILIENCE))
        broker_args = tuple(str(a) for a in state.get("broker_args", ()))
        return ClusterState(nodes, bool(state["tls"]), resilience, broker_args)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise StateFileError(f"cannot read the cluster state {path}: {exc}") from None


def read_stopped(state_dir: Path) -> ClusterState | None:
    """The cluster stopped in state_dir (STOPPED_FILE), None if there is none; StateFileError if unreadable."""
    try:
        return read_state(state_dir / STOPPED_FILE)
    except FileNotFoundError:
        return None


def _bindable(addr: str) -> bool:
    """True if a listening socket can be bound to addr now (as the broker binds it: SO_REUSEADDR)."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
    except (OSError, ValueError):
        return False
    return True


def _first_line(path: Path) -> str:
    try:
        with path.open("rb") as f:
            line = f.readline()
    except OSError:
        return ""
    return line.decode().strip() if line.endswith(b"\n") else ""


def stop_pids(pids: Sequence[int], grace: float = STOP_GRACE) -> dict[int, str]:
    """SIGTERM each pid that is still a SeDAX broker, SIGKILL after grace; returns what happened to each."""
    result: dict[int, str] = {}
    targets = []
    for pid in pids:
        if not _is_broker(pid):
            result[pid] = "not running"
            continue
        os.kill(pid, signal.SIGTERM)
        targets.append(pid)
    deadline = time.monotonic() + grace
    while targets and time.monotonic() < deadline:
        targets = [p for p in targets if _is_broker(p)]
        if targets:
            time.sleep(POLL_INTERVAL)
    for pid in pids:
        if pid in result:
            continue
        if pid in targets and _is_broker(pid):
            os.kill(pid, signal.SIGKILL)
            result[pid] = "killed"
        else:
            result[pid] = "stopped"
    return result


def _is_broker(pid: int) -> bool:
    # Check the command line too: after a reboot or a long time the pid may belong to another program.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return b"-m" in cmdline and b"broker" in cmdline


def die_with_parent() -> None:
    """In a child process before it runs the broker (`preexec_fn`): SIGTERM when its parent dies (Linux).

    A cluster whose owner is killed (a test run cut off by a time-out, `sedax cluster up` sent SIGKILL) must not
    leave its brokers running."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
