"""Storage benchmark (not a test): fsync policies against the in-memory store, NATS JetStream, catch-up times.

    .venv/bin/python benchmarks/bench_storage.py [--quick] [--out docs/benchmarks-storage.md]

Everything runs on 127.0.0.1 with ports from the OS; every process started here is stopped by PID at the end.
Three sections, in one run (`--only fsync,jetstream,catchup` picks some):

* fsync: 1 publisher -> 1 subscriber, 100-byte payloads, SeDAX brokers with `--store memory` and with
  `--data-dir` at each `--fsync` policy (always, batch, interval:50, never); level 1 (one broker, both clients
  on it) and level 2 (two brokers on a line through h(t): the subscriber on the primary, the publisher on
  the secondary, one hop away).  Each repetition gets fresh brokers (and data directories) and a fresh
  publisher and subscriber process; the publisher runs three phases of fixed duration: `seq` (one publish
  awaiting its ACK at a time: publish -> ACK latency without queueing), `window` (publish_nowait with up
  to --window unacknowledged, the client batching what one loop turn publishes into one PUBLISH),
  `window-1` (the same with one PUBLISH per message).
* jetstream: Debian's nats-server with `-js` and a file store, a stream with one replica (R1) on file storage,
  the PyPI client nats-py: `seq` (js.publish, awaiting each PubAck) and `window` (js.publish_async with
  --window pending), the subscriber an ordered push consumer of the stream; same payloads, same phases.
* catchup: three brokers at level 2 on a line (primary, secondary, a third), data directories (`--fsync`
  default) and, for comparison, memory only; a topic of --history messages (published with batching); the
  primary, then the secondary is stopped with SIGTERM, --extra more messages are published, the broker is
  started again (same address and data directory) and timed until its STATUS shows the topic in its old role
  with the holders' stored bytes and (primary) a FETCH through it returns every message; then (data
  directories) every broker is stopped and all are started again, timed until the whole history is served.

Rates: messages acknowledged / (last ACK - first publish) per phase; delivered: messages received by the
subscriber / (last arrival - first publish).  Latencies: publish -> ACK at the publisher and publish -> arrival
at the subscriber (one CLOCK_MONOTONIC for all processes of the machine), p50/p99 over all messages of a phase.
Broker CPU: user+system CPU of the broker processes (/proc) between the publisher's phase marks, per message.
Cells are repeated (--repeat, 3; 1 with --quick) and the median is reported.  The repetitions go in rounds
(every SeDAX configuration of level 1, JetStream, every configuration of level 2; then again), so that on a
shared machine each configuration sees the same stretch of load as the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

_ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

from harness import (  # noqa: E402
    code_state,
    cpu_seconds,
    pct,
    program_output,
    sedax_consume,
    spawn_worker,
    uptime,
    write_section,
)

PAYLOAD_SIZE: Final = 100
# phase (0 = warm-up, END = the publisher is done), message index, the publisher's perf_counter()
_HEAD: Final = struct.Struct("<BId")
WARM: Final = 0
END: Final = 255
WARMUP: Final = 500
TOPIC: Final = "bench/storage/t1"
CATCHUP_TOPIC: Final = "bench/storage/history"
SUBJECT: Final = "bench.storage.t1"
STREAM: Final = "BENCHSTORE"
POLICIES: Final = ("memory", "always", "batch", "interval:50", "never")
SEDAX_MODES: Final = ("seq", "window", "window-1")
JS_MODES: Final = ("seq", "window")
READY_TIMEOUT: Final = 30.0
IDLE_TIMEOUT: Final = 30.0
# After the END marker the subscriber waits until nothing arrived for this long (stragglers of other clients).
LINGER: Final = 0.5
STOP_GRACE: Final = 10.0
POLL: Final = 0.05
CATCHUP_DEADLINE: Final = 90.0
BROKER_ARGS: Final = ("--log-level", "WARNING")


def payload(phase: int, index: int, ts: float) -> bytes:
    return _HEAD.pack(phase, index, ts).ljust(PAYLOAD_SIZE, b"x")


def mark(phase: int, at: str) -> None:
    print(json.dumps({"event": "mark", "phase": phase, "at": at}), flush=True)


# ================================================================================================= workers
# `--worker JSON`: one publisher or subscriber process.  The subscriber prints {"event": "ready"} once
# subscribed and one JSON result line at the end; the publisher prints a mark line at the start and end of each
# phase (the driver samples the brokers' CPU there) and one JSON result line.

PublishOne = Callable[[bytes], Awaitable[object]]
PublishNowait = Callable[[bytes], Awaitable["asyncio.Future[Any]"]]
Flush = Callable[[], Awaitable[object]]


async def phase_seq(one: PublishOne, phase: int, duration: float) -> dict[str, Any]:
    """One publish awaiting its acknowledgement at a time, for `duration` seconds."""
    perf = time.perf_counter
    lat = array("d")
    mark(phase, "start")
    t0 = last = perf()
    i = 0
    while last - t0 < duration:
        ts = perf()
        await one(payload(phase, i, ts))
        last = perf()
        lat.append(last - ts)
        i += 1
    mark(phase, "end")
    return summary(phase, t0, last, i, i, 0, lat)


async def phase_window(nowait: PublishNowait, flush: Flush, phase: int, duration: float) -> dict[str, Any]:
    """publish_nowait for `duration` seconds (the window blocks when full), then wait for every ACK."""
    perf = time.perf_counter
    lat = array("d")
    state = {"last": 0.0, "errors": 0}

    def done(ts: float, fut: asyncio.Future[Any]) -> None:
        now = perf()
        if fut.cancelled() or fut.exception() is not None:
            state["errors"] += 1
        else:
            lat.append(now - ts)
        state["last"] = now

    mark(phase, "start")
    t0 = perf()
    i = 0
    while perf() - t0 < duration:
        ts = perf()
        fut = await nowait(payload(phase, i, ts))
        fut.add_done_callback(functools.partial(done, ts))
        i += 1
    async with asyncio.timeout(120.0):
        await flush()
    await asyncio.sleep(0)  # the last done-callbacks
    mark(phase, "end")
    return summary(phase, t0, state["last"] or perf(), i, len(lat), int(state["errors"]), lat)


def summary(
    phase: int, t0: float, last: float, sent: int, acked: int, errors: int, lat: array[float]
) -> dict[str, Any]:
    vals = sorted(lat)
    out: dict[str, Any] = {"phase": phase, "first_tx": t0, "last_ack": last, "sent": sent, "acked": acked}
    out["errors"] = errors
    if vals:
        out.update(p50=pct(vals, 0.5), p99=pct(vals, 0.99))
    return out


async def sedax_pub(spec: dict[str, Any]) -> dict[str, Any]:
    from client.client import Client

    topic, addr, window = spec["topic"], spec["addr"], spec["window"]
    pid = os.getpid()
    results = []
    clients: list[Client] = []
    try:
        for batched in (True, False):
            c = Client(
                [addr], client_id=f"bench-pub-{pid}-{int(batched)}", max_inflight=window, batch_publishes=batched
            )
            await c.connect()
            clients.append(c)
            for i in range(WARMUP):
                await c.publish_nowait(topic, payload(WARM, i, 0.0))
            async with asyncio.timeout(60.0):
                await c.flush()
        main, single = clients

        async def one(p: bytes) -> object:
            return await main.publish(topic, p)

        for phase, mode in enumerate(spec["modes"], start=1):
            if mode == "seq":
                results.append(await phase_seq(one, phase, spec["seq_s"]))
            else:
                c = main if mode == "window" else single

                async def nowait(p: bytes, c: Client = c) -> asyncio.Future[Any]:
                    return await c.publish_nowait(topic, p)

                results.append(await phase_window(nowait, c.flush, phase, spec["window_s"]))
            results[-1]["mode"] = mode
        await main.publish(topic, payload(END, 0, 0.0))
        extra = {"resent": sum(c.resent for c in clients), "reconnects": sum(c.reconnects for c in clients)}
    finally:
        for c in clients:
            await c.aclose()
    return {"phases": results, **extra}


async def jetstream_pub(spec: dict[str, Any]) -> dict[str, Any]:
    import nats

    nc = await nats.connect(f"nats://{spec['addr']}", name=f"bench-pub-{os.getpid()}")
    subject = spec["subject"]
    results = []
    try:
        js = nc.jetstream(publish_async_max_pending=spec["window"])
        for i in range(WARMUP):
            await js.publish_async(subject, payload(WARM, i, 0.0))
        async with asyncio.timeout(60.0):
            await js.publish_async_completed()

        async def one(p: bytes) -> object:
            return await js.publish(subject, p)

        async def nowait(p: bytes) -> asyncio.Future[Any]:
            return await js.publish_async(subject, p)

        for phase, mode in enumerate(spec["modes"], start=1):
            if mode == "seq":
                results.append(await phase_seq(one, phase, spec["seq_s"]))
            else:
                results.append(await phase_window(nowait, js.publish_async_completed, phase, spec["window_s"]))
            results[-1]["mode"] = mode
        await js.publish(subject, payload(END, 0, 0.0))
    finally:
        await nc.close()
    return {"phases": results}


class PhaseSink:
    """Per phase: deliveries, first and last arrival, publish -> arrival delays; END sets `ended`."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.delay: dict[int, array[float]] = {}
        self.out_of_order = 0
        self.expect: dict[int, int] = {}
        self.ended = asyncio.Event()
        self.arrived = 0.0

    def __call__(self, p: bytes) -> None:
        now = time.perf_counter()
        self.arrived = now
        phase = p[0]
        if phase == WARM:
            return
        if phase == END:
            self.ended.set()
            return
        _, idx, ts = _HEAD.unpack_from(p)
        if idx != self.expect.get(phase, 0):
            self.out_of_order += 1
        self.expect[phase] = idx + 1
        if phase not in self.count:
            self.count[phase] = 0
            self.first[phase] = now
            self.delay[phase] = array("d")
        self.count[phase] += 1
        self.last[phase] = now
        self.delay[phase].append(now - ts)

    async def wait(self) -> None:
        """Until END arrived and LINGER passed without arrivals, or IDLE_TIMEOUT without any arrival."""
        while True:
            quiet = time.perf_counter() - self.arrived
            if self.ended.is_set() and quiet > LINGER:
                return
            if self.arrived and quiet > IDLE_TIMEOUT:
                return
            await asyncio.sleep(0.05)

    def result(self) -> dict[str, Any]:
        phases = {}
        for ph, n in self.count.items():
            d = sorted(self.delay[ph])
            phases[str(ph)] = {"received": n, "first_rx": self.first[ph], "last_rx": self.last[ph]}
            phases[str(ph)].update(p50=pct(d, 0.5), p99=pct(d, 0.99))
        return {"phases": phases, "out_of_order": self.out_of_order, "ended": self.ended.is_set()}


async def sedax_sub(spec: dict[str, Any]) -> dict[str, Any]:
    from client.client import Client

    sink = PhaseSink()

    def subscribed() -> None:
        ready()
        sink.arrived = time.perf_counter()  # the idle time-out counts from here

    async with Client([spec["addr"]], client_id=f"bench-sub-{os.getpid()}") as c:
        # Iterating, as the JetStream consumer beside it does (and as its figures in the docs were taken).
        sub = await sedax_consume(c, spec["topic"], sink, subscribed, sink.wait, iterate=True)
        res = sink.result()
        res.update(dropped=sub.dropped, duplicates=sub.duplicates, gaps=sub.gaps, reconnects=c.reconnects)
        return res


async def jetstream_sub(spec: dict[str, Any]) -> dict[str, Any]:
    import nats
    from nats.js.api import DeliverPolicy

    sink = PhaseSink()
    nc = await nats.connect(f"nats://{spec['addr']}", name=f"bench-sub-{os.getpid()}")
    try:
        js = nc.jetstream()
        sub = await js.subscribe(spec["subject"], ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        ready()

        async def consume() -> None:
            async for m in sub.messages:
                sink(m.data)

        task = asyncio.create_task(consume())
        sink.arrived = time.perf_counter()
        await sink.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return sink.result()
    finally:
        await nc.close()


def ready() -> None:
    print(json.dumps({"event": "ready"}), flush=True)


def worker_main(spec_text: str) -> int:
    import uvloop

    spec = json.loads(spec_text)
    workers = {
        ("sedax", "pub"): sedax_pub,
        ("sedax", "sub"): sedax_sub,
        ("jetstream", "pub"): jetstream_pub,
        ("jetstream", "sub"): jetstream_sub,
    }
    res = uvloop.run(workers[spec["system"], spec["role"]](spec))
    print(json.dumps(res), flush=True)
    return 0


# ================================================================================================= driver


@dataclass
class Cell:
    """One configuration and publisher mode; one entry per repetition in each list."""

    system: str  # "SeDAX" or "JetStream"
    level: int
    store: str  # memory, always, batch, interval:50, never; "file, R1" for JetStream
    mode: str
    rates: list[float] = field(default_factory=list)  # acknowledged msg/s
    delivered: list[float] = field(default_factory=list)  # delivered msg/s
    p50: list[float] = field(default_factory=list)  # publish -> ACK, s
    p99: list[float] = field(default_factory=list)
    d50: list[float] = field(default_factory=list)  # publish -> delivery, s
    d99: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)  # broker CPU per acknowledged message
    msgs: list[int] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.system, self.level, self.store, self.mode)


@dataclass(frozen=True)
class Settings:
    quick: bool
    repeat: int
    seq_s: float
    window_s: float
    window: int
    levels: tuple[int, ...]
    policies: tuple[str, ...]
    history: int
    extra: int
    workdir: Path


def med(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def line_coords(topic: str, n: int) -> list[tuple[float, float]]:
    """n broker coordinates on a horizontal line through h(topic), broker 0 nearest (as bench_pubsub.py):
    broker 0 is the topic's primary, broker 1 its secondary, broker 2 the next."""
    from overlay.geometry import geohash

    hx, hy = geohash(topic)
    right = hx < 0.5
    room = (1.0 - hx) if right else hx
    step = min(0.15, (room - 0.02) / max(1, n - 1))
    sign = 1.0 if right else -1.0
    return [(hx + sign * (0.005 + k * step), hy) for k in range(n)]


class Driver:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.cells: dict[tuple[str, int, str, str], Cell] = {}
        self.catchup: list[dict[str, Any]] = []
        self.loads: dict[str, tuple[str, str]] = {}
        self.versions: dict[str, str] = {}
        self.seq = 0

    def cell(self, system: str, level: int, store: str, mode: str) -> Cell:
        key = (system, level, store, mode)
        if key not in self.cells:
            self.cells[key] = Cell(system, level, store, mode)
        return self.cells[key]

    async def _spawn(self, spec: dict[str, Any]) -> asyncio.subprocess.Process:
        self.seq += 1
        return await spawn_worker(
            __file__, spec, self.s.workdir / f"worker-{self.seq}-{spec['system']}-{spec['role']}.err"
        )

    async def rep(
        self, spec: dict[str, Any], sub_addr: str, pub_addr: str, pids: list[int]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[int, float]]:
        """One publisher and one subscriber process; their results and the brokers' CPU seconds per phase."""
        procs: list[asyncio.subprocess.Process] = []
        try:
            sub = await self._spawn(dict(spec, role="sub", addr=sub_addr))
            procs.append(sub)
            assert sub.stdout is not None
            async with asyncio.timeout(READY_TIMEOUT):
                line = await sub.stdout.readline()
            if json.loads(line or b"{}").get("event") != "ready":
                raise RuntimeError(f"subscriber not ready: {line!r}")
            pub = await self._spawn(dict(spec, role="pub", addr=pub_addr))
            procs.append(pub)
            assert pub.stdout is not None
            cpu: dict[int, float] = {}
            result: dict[str, Any] = {}
            async with asyncio.timeout(240.0):
                while raw := await pub.stdout.readline():
                    msg = json.loads(raw)
                    if msg.get("event") == "mark":
                        sign = -1.0 if msg["at"] == "start" else 1.0
                        cpu[msg["phase"]] = cpu.get(msg["phase"], 0.0) + sign * cpu_seconds(*pids)
                    else:
                        result = msg
                await pub.wait()
                out, _ = await sub.communicate()
            if pub.returncode or sub.returncode or not result:
                raise RuntimeError(f"worker failed (pub {pub.returncode}, sub {sub.returncode})")
            return result, json.loads(out.splitlines()[-1]), cpu
        except BaseException as exc:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
            tails = [f"{f.name}: {f.read_text(errors='replace')[-1200:]}" for f in self._recent_logs()]
            if isinstance(exc, Exception):
                raise RuntimeError(f"run failed: {exc!r}\n" + "\n".join(tails)) from exc
            raise

    def _recent_logs(self) -> list[Path]:
        return sorted(
            f for k in (self.seq - 1, self.seq) for f in self.s.workdir.glob(f"worker-{k}-*.err") if f.stat().st_size
        )

    def record(
        self, system: str, level: int, store: str, pub: dict[str, Any], sub: dict[str, Any], cpu: dict[int, float]
    ) -> None:
        load = os.getloadavg()[0]
        for ph in pub["phases"]:
            c = self.cell(system, level, store, ph["mode"])
            c.load.append(load)
            n = ph["acked"]
            c.msgs.append(n)
            if ph["errors"]:
                c.notes.append(f"{ph['errors']} publishes failed")
            if n:
                c.rates.append(n / (ph["last_ack"] - ph["first_tx"]))
                c.p50.append(ph["p50"])
                c.p99.append(ph["p99"])
                if ph["phase"] in cpu:
                    c.cpu_us.append(cpu[ph["phase"]] / n * 1e6)
            got = sub["phases"].get(str(ph["phase"]))
            if got is None:
                c.notes.append("subscriber got nothing")
                continue
            if got["received"] != n:
                c.notes.append(f"delivered {got['received']} of {n}")
            c.delivered.append(got["received"] / (got["last_rx"] - ph["first_tx"]))
            c.d50.append(got["p50"])
            c.d99.append(got["p99"])
        for key in ("resent", "reconnects", "dropped", "duplicates", "gaps", "out_of_order"):
            for who, res in (("publisher", pub), ("subscriber", sub)):
                if res.get(key):
                    # the clients count for the whole run (all phases); noted on the first phase's row
                    first = self.cell(system, level, store, pub["phases"][0]["mode"])
                    first.notes.append(f"{who} {key} {res[key]} (all phases)")

    def base_spec(self, system: str, modes: tuple[str, ...]) -> dict[str, Any]:
        s = self.s
        return {
            "system": system,
            "modes": list(modes),
            "seq_s": s.seq_s,
            "window_s": s.window_s,
            "window": s.window,
            "topic": TOPIC,
            "subject": SUBJECT,
        }

    # ------------------------------------------------------------------------------------------- fsync

    async def rounds(self, sedax: bool, jetstream: bool) -> None:
        """Repetition by repetition, every configuration once per round (SeDAX level 1, JetStream, SeDAX level 2),
        so that each sees the same stretch of the shared machine's load; each SeDAX repetition gets fresh brokers
        (and data directories), nats-server runs throughout."""
        proc: subprocess.Popen[bytes] | None = None
        addr = ""
        try:
            if jetstream:
                proc, addr = await self.jetstream_start()
            for r in range(self.s.repeat):
                for k, level in enumerate(self.s.levels):
                    for policy in self.s.policies if sedax else ():
                        await self.sedax_rep(level, policy, r)
                    if proc is not None and k == 0:
                        await self.jetstream_rep(addr, proc.pid, r)
        finally:
            if proc is not None:
                stop_proc(proc)

    async def sedax_rep(self, level: int, policy: str, r: int) -> None:
        from cli.cluster import LocalCluster

        coords = line_coords(TOPIC, level)
        disk = policy != "memory"
        args = [*BROKER_ARGS, *(("--fsync", policy) if disk else ("--store", "memory"))]
        label = f"level {level}, {policy}"
        cluster = LocalCluster(
            len(coords),
            coords=coords,
            resilience=level,
            state_dir=self.s.workdir / f"fsync-l{level}-{policy.replace(':', '')}-r{r + 1}",
            broker_args=args,
            tls=False,
            data_dirs=disk,
        )
        try:
            async with cluster:
                await cluster.wait_converged(60.0)
                await check_primary(cluster, TOPIC)
                pids = [bp.pid for bp in cluster.nodes]
                sub_addr = cluster.nodes[0].listen
                pub_addr = cluster.nodes[-1].listen
                pub, sub, cpu = await self.rep(self.base_spec("sedax", SEDAX_MODES), sub_addr, pub_addr, pids)
                self.record("SeDAX", level, policy, pub, sub, cpu)
                print(f"  {label} rep {r + 1}: " + self.brief("SeDAX", level, policy), flush=True)
                crashed = [bp.node_id for bp in cluster.nodes if not bp.alive]
                if crashed:
                    self.cell("SeDAX", level, policy, "seq").notes.append(f"exited during the run: {crashed}")
                trouble = broker_trouble(cluster)
                if trouble:
                    self.cell("SeDAX", level, policy, "seq").notes.append(f"rep {r + 1} brokers logged {trouble}")
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else repr(exc)
            self.cell("SeDAX", level, policy, "seq").notes.append(f"rep {r + 1} failed: {why}")
            print(f"{label}: {exc}", file=sys.stderr, flush=True)

    def brief(self, system: str, level: int, store: str) -> str:
        parts = []
        for (sy, lv, st, mode), c in self.cells.items():
            if (sy, lv, st) == (system, level, store) and c.rates:
                parts.append(f"{mode} {c.rates[-1]:,.0f} msg/s p50 {c.p50[-1] * 1e3:.2f} ms")
        return "; ".join(parts)

    # ---------------------------------------------------------------------------------------- jetstream

    async def jetstream_start(self) -> tuple[subprocess.Popen[bytes] | None, str]:
        """nats-server with JetStream on a file store and the stream (R1); (None, "") if it cannot run."""
        note = self.cell("JetStream", 1, "file, R1", "seq").notes
        exe = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/local/bin")
        if exe is None:
            note.append("not measured: nats-server not installed")
            return None, ""
        try:
            import nats  # noqa: F401
        except ImportError:
            note.append("not measured: nats-py not installed")
            return None, ""
        self.versions["nats-server"] = program_output([exe, "--version"])
        self.versions["nats-py"] = program_output([sys.executable, "-m", "pip", "show", "nats-py"])
        port = free_port()
        store = self.s.workdir / "jetstream"
        store.mkdir()
        log = str(self.s.workdir / "nats.log")
        argv = [exe, "-js", "-sd", str(store), "-p", str(port), "-a", "127.0.0.1", "-l", log]
        proc = start_server(argv, self.s.workdir / "nats.out")
        addr = f"127.0.0.1:{port}"
        try:
            await wait_port(port, proc)
            await create_stream(addr)
        except Exception as exc:
            stop_proc(proc)
            note.append(f"failed: {str(exc).splitlines()[0] if str(exc) else repr(exc)}")
            return None, ""
        print(f"{self.versions['nats-server']} pid {proc.pid} on {addr}, stream {STREAM} (file, R1)", flush=True)
        return proc, addr

    async def jetstream_rep(self, addr: str, pid: int, r: int) -> None:
        try:
            pub, sub, cpu = await self.rep(self.base_spec("jetstream", JS_MODES), addr, addr, [pid])
            self.record("JetStream", 1, "file, R1", pub, sub, cpu)
            print(f"  JetStream rep {r + 1}: " + self.brief("JetStream", 1, "file, R1"), flush=True)
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else repr(exc)
            self.cell("JetStream", 1, "file, R1", "seq").notes.append(f"rep {r + 1} failed: {why}")
            print(f"JetStream: {exc}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------------ catch-up

    async def catchups(self) -> None:
        for disk in (True, False):
            try:
                await self.catchup_cluster(disk)
            except Exception as exc:
                why = str(exc).splitlines()[0] if str(exc) else repr(exc)
                self.catchup.append({"store": "disk" if disk else "memory", "what": "failed", "note": why})
                print(f"catch-up ({'disk' if disk else 'memory'}): {exc}", file=sys.stderr, flush=True)

    async def catchup_cluster(self, disk: bool) -> None:
        from cli.cluster import LocalCluster

        store = "data dir (fsync interval:100, the default)" if disk else "memory (empty on restart)"
        coords = line_coords(CATCHUP_TOPIC, 3)
        # the default log level: the broker's "recovered ..." line is an INFO line
        args = [] if disk else ["--store", "memory"]
        cluster = LocalCluster(
            3,
            coords=coords,
            resilience=2,
            state_dir=self.s.workdir / f"catchup-{'disk' if disk else 'memory'}",
            broker_args=args,
            tls=False,
            data_dirs=disk,
        )
        async with cluster:
            await cluster.wait_converged(60.0)
            await check_primary(cluster, CATCHUP_TOPIC)
            writer = cluster.nodes[2].listen  # not a holder at level 2
            t = time.perf_counter()
            total = await publish_many(writer, self.s.history, "fill")
            fill_s = time.perf_counter() - t
            print(f"catch-up {store}: {total:,} messages published in {fill_s:.1f} s", flush=True)
            fill = {"store": store, "what": f"fill: publish {total:,} messages (batched, window 4096, through n2)"}
            fill["note"] = f"{fill_s:.1f} s, {total / fill_s:,.0f} msg/s"
            self.catchup.append(fill)
            for victim, role in ((0, "primary"), (1, "secondary")):
                t = time.perf_counter()
                code = await cluster.stop(victim)
                stop_s = time.perf_counter() - t
                total += await publish_many(writer, self.s.extra, f"while-{role}-down")
                sizes = await held(cluster, CATCHUP_TOPIC)
                want = max((size for _, r, size in sizes if r == "primary"), default=0)
                row: dict[str, Any] = {"store": store, "what": f"restart the {role}", "messages": total}
                row["note"] = f"stopped (SIGTERM) in {stop_s:.1f} s, exit {code}; holders' bytes {want:,}"
                keep_log(cluster.nodes[victim], f"before-restart-{role}")  # a restart starts its log afresh
                t0 = time.perf_counter()
                bp = await cluster.restart(victim)
                row["ready"] = time.perf_counter() - t0
                row.update(await self.wait_caught_up(cluster, victim, role, want, total, t0))
                row["log"] = recovered_line(bp.err_path)
                trouble = broker_trouble(cluster)
                if trouble:
                    row["note"] += f"; brokers logged (since their last start) {trouble}"
                self.catchup.append(row)
                print(f"  {row}", flush=True)
            if not disk:
                row = {"store": store, "what": "after both restarts: FETCH through n2", "messages": total}
                got: dict[str, Any] = {}
                t0 = time.perf_counter()
                await self._poll_fetch(writer, total, t0, t0 + 10.0, got)
                row.update(fetched=got.get("fetched", ""), fetch_s=got.get("fetch_s"))
                self.catchup.append(row)
                print(f"  {row}", flush=True)
                return
            sizes = await held(cluster, CATCHUP_TOPIC)
            want = max((size for _, r, size in sizes if r == "primary"), default=0)
            t = time.perf_counter()
            codes = await asyncio.gather(*(cluster.stop(i) for i in range(3)))
            stop_s = time.perf_counter() - t
            for bp in cluster.nodes:
                keep_log(bp, "before-full-restart")
            t0 = time.perf_counter()
            await cluster.restart(0)
            row = {"store": store, "what": "full restart: all 3 stopped; n0, then n1 + n2 started"}
            row["messages"] = total
            row["note"] = f"all stopped (SIGTERM at once) in {stop_s:.1f} s, exits {codes}; bytes before {want:,}"
            row["ready_n0"] = time.perf_counter() - t0
            waiting = asyncio.create_task(self.wait_caught_up(cluster, 0, "primary", want, total, t0))
            await asyncio.gather(cluster.restart(1), cluster.restart(2))
            row["ready"] = time.perf_counter() - t0
            row.update(await waiting)
            second: dict[str, Any] = {}
            await self._poll_status(cluster.nodes[1].listen, "secondary", want, t0, t0 + CATCHUP_DEADLINE, second)
            row["note"] += (
                f"; n0 ready after {row['ready_n0']:.2f} s; n1 secondary with every byte after "
                f"{_f(second.get('holds'), 1, 2)} s, caught_up after {_f(second.get('holds_caught_up'), 1, 2)} s "
                f"({second['holds_seen']})"
            )
            row["log"] = "; ".join(f"{bp.node_id}: {recovered_line(bp.err_path)}" for bp in cluster.nodes)
            self.catchup.append(row)
            print(f"  {row}", flush=True)

    async def wait_caught_up(self, cluster: Any, i: int, role: str, want: int, total: int, t0: float) -> dict[str, Any]:
        """Poll broker i's STATUS until it holds the topic in `role` with `want` bytes and, concurrently for a
        primary, FETCH the whole topic through it until it returns `total` distinct messages (answers with
        fewer are counted: served before caught up).  Times are from t0."""
        out: dict[str, Any] = {}
        bp = cluster.nodes[i]
        deadline = t0 + CATCHUP_DEADLINE
        pollers = [self._poll_status(bp.listen, role, want, t0, deadline, out)]
        if role == "primary":
            pollers.append(self._poll_fetch(bp.listen, total, t0, deadline, out))
        await asyncio.gather(*pollers)
        return out

    async def _poll_status(
        self, addr: str, role: str, want: int, t0: float, deadline: float, out: dict[str, Any], key: str = "holds"
    ) -> None:
        from client.admin import AdminClient

        seen: tuple[str, int, str] = ("", 0, "")
        while time.perf_counter() < deadline:
            with contextlib.suppress(Exception):
                async with await AdminClient.connect(addr, timeout=5.0) as ac:
                    st = await ac.status()
                # `state` (caught_up, syncing, ...) is in the STATUS of brokers since the operator view of issue 15
                mine = [(h.role, h.size, str(getattr(h, "state", ""))) for h in st.held if h.topic == CATCHUP_TOPIC]
                seen = mine[0] if mine else ("-", 0, "")
                if seen[0] == role and seen[1] >= want:
                    out.setdefault(key, time.perf_counter() - t0)
                    if seen[2] in ("caught_up", ""):
                        out[f"{key}_caught_up"] = time.perf_counter() - t0
                        break
            await asyncio.sleep(POLL)
        out[f"{key}_seen"] = f"{seen[0]} {seen[2]} {seen[1]:,} B of {want:,}"

    async def _poll_fetch(self, addr: str, total: int, t0: float, deadline: float, out: dict[str, Any]) -> None:
        from client.client import Client

        got = dups = 0
        short: list[str] = []
        while time.perf_counter() < deadline:
            try:
                async with Client([addr], client_id=f"bench-fetch-{os.getpid()}") as c:
                    tf = time.perf_counter()
                    recs = await c.fetch(CATCHUP_TOPIC)
                    fetch_s = time.perf_counter() - tf
            except Exception as exc:
                out["fetch_error"] = repr(exc)[:200]
                await asyncio.sleep(POLL)
                continue
            ids = {(r.publisher, r.seq) for r in recs}
            got, dups = len(ids), len(recs) - len(ids)
            if got >= total:
                out["serves"] = time.perf_counter() - t0
                out["fetch_s"] = fetch_s
                break
            short.append(f"{got:,} at {time.perf_counter() - t0:.2f} s")
            await asyncio.sleep(POLL)
        out["fetched"] = f"{got:,} of {total:,}" + (f", {dups} duplicates" if dups else "")
        if short:
            out["fetched"] += f"; incomplete answers before: {', '.join(short[:5])}"


async def publish_many(addr: str, n: int, tag: str) -> int:
    """Publish n messages through addr with batching (window 4096); the number acknowledged."""
    from client.client import Client

    async with Client([addr], client_id=f"bench-{tag}-{os.getpid()}") as c:
        futs = [await c.publish_nowait(CATCHUP_TOPIC, payload(1, i, time.perf_counter())) for i in range(n)]
        async with asyncio.timeout(120.0):
            await c.flush()
    failed = sum(1 for f in futs if f.exception() is not None)
    if failed:
        raise RuntimeError(f"{failed} of {n} publishes failed")
    return n


async def held(cluster: Any, topic: str) -> list[tuple[str, str, int]]:
    """(node, role, bytes) of every live broker holding topic."""
    sts = await cluster.statuses()
    return [(nid, h.role, h.size) for nid, st in sts.items() for h in st.held if h.topic == topic]


# Broker log lines that say a run was not a steady state (as bench_pubsub.py counts them).
BROKER_TROUBLE: Final = {
    "neighbour lost": "lost (",
    "heartbeat timeout": "heartbeat_timeout",
    "replica re-send": "did not confirm within",
}


def broker_trouble(cluster: Any) -> str:
    """What the cluster's brokers logged of BROKER_TROUBLE, e.g. "2 × neighbour lost"."""
    counts = dict.fromkeys(BROKER_TROUBLE, 0)
    for bp in cluster.nodes:
        with contextlib.suppress(OSError):
            text = bp.err_path.read_text(errors="replace")
            for key, needle in BROKER_TROUBLE.items():
                counts[key] += text.count(needle)
    return ", ".join(f"{n} × {k}" for k, n in counts.items() if n)


def keep_log(bp: Any, tag: str) -> None:
    """Copy a broker's log aside (LocalCluster.restart truncates it)."""
    with contextlib.suppress(OSError):
        shutil.copyfile(bp.err_path, bp.err_path.with_name(f"{bp.err_path.name}.{tag}"))


def recovered_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if "recovered" in ln]
    except OSError:
        return ""
    # from "recovered" on: the line's start names the temporary data directory
    return lines[-1][lines[-1].index("recovered") :].strip()[:160] if lines else "(no 'recovered' line)"


async def check_primary(cluster: Any, topic: str) -> None:
    from client.client import Client

    async with Client([cluster.nodes[0].listen]) as c:
        located = await c.locate(topic)
    if located.primary.id != cluster.nodes[0].node_id:
        raise RuntimeError(f"primary of {topic} is {located.primary.id}, expected {cluster.nodes[0].node_id}")


async def wait_port(port: int, proc: subprocess.Popen[bytes], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        else:
            w.close()
            return


async def create_stream(addr: str) -> None:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(f"nats://{addr}")
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE, num_replicas=1))
    finally:
        await nc.close()


def start_server(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a peer server in its own session, output to log; the caller stops it with stop_proc."""
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ================================================================================================= report


def _f(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "–" if v is None else f"{v * scale:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}"


MODE_TEXT: Final = {
    "seq": "one at a time",
    "window": "window, batched",
    "window-1": "window, 1 PUBLISH/msg",
}


def markdown(d: Driver, s: Settings, command: str, up: tuple[str, str], elapsed: float, code: str) -> str:
    out = [
        f"`{command}` — {elapsed:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {code}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
        f"{platform.python_version()}, uvloop in every client; data directories on the same disk as /tmp.  "
        f"`uptime` at start: `{up[0]}`; at end: `{up[1]}`.  The machine is shared with other engineers' runs "
        "(builds, tests, benchmarks), so wall-clock figures carry their noise; broker CPU per message much less.",
        "",
    ]
    for section, (a, b) in d.loads.items():
        out.append(f"- {section}: `{a}` → `{b}`")
    if d.loads:
        out.append("")
    if any(c.system == "SeDAX" for c in d.cells.values()):
        out += [
            "### Throughput and publish → ACK latency by fsync policy",
            "",
            f"Phases of {s.seq_s:g} s (one at a time) and {s.window_s:g} s (window of {s.window}), then the "
            f"window drained; medians of {s.repeat} repetition(s) (each with fresh brokers, publisher and subscriber). "
            "× memory: the median rate against the in-memory store at the same level and mode.",
            "",
            "| level | store | publisher | ACKed msg/s | × memory | ACK p50 ms | ACK p99 ms | delivered msg/s | "
            "delivery p50 ms | delivery p99 ms | broker CPU µs/msg | msgs per run | load | notes |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for c in d.cells.values():
            if c.system != "SeDAX":
                continue
            mem = d.cells.get(("SeDAX", c.level, "memory", c.mode))
            out.append(row_text(c, _ratio(med(c.rates), med(mem.rates) if mem else None)))
        out.append("")
    js = [c for c in d.cells.values() if c.system == "JetStream"]
    if js:
        out += [
            "### NATS JetStream (file store, R1) in the same run",
            "",
            f"{d.versions.get('nats-server', 'nats-server')}, nats-py "
            f"{_pip_version(d.versions.get('nats-py', ''))}; `seq` = `js.publish` awaiting each PubAck, `window` = "
            f"`js.publish_async` with {s.window} pending; subscriber: an ordered push consumer (DeliverPolicy.NEW).",
            "",
            "| level | store | publisher | ACKed msg/s | × memory | ACK p50 ms | ACK p99 ms | delivered msg/s | "
            "delivery p50 ms | delivery p99 ms | broker CPU µs/msg | msgs per run | load | notes |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for c in js:
            out.append(row_text(c, "–"))
        out += [
            "",
            "SeDAX against JetStream, same publisher pattern (ACKed msg/s ÷ JetStream's; > 1: SeDAX faster; "
            "p99 ÷ JetStream's; < 1: SeDAX faster):",
            "",
            "| SeDAX | publisher | vs JetStream publisher | msg/s ratio | ACK p50 ratio | ACK p99 ratio | "
            "CPU/msg ratio |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for c in d.cells.values():
            if c.system != "SeDAX" or c.store not in ("never", "interval:50", "memory", "batch", "always"):
                continue
            j = d.cells.get(("JetStream", 1, "file, R1", "seq" if c.mode == "seq" else "window"))
            if j is None:
                continue
            out.append(
                f"| level {c.level}, {c.store} | {MODE_TEXT[c.mode]} | {MODE_TEXT[j.mode]} | "
                f"{_ratio(med(c.rates), med(j.rates))} | {_ratio(med(c.p50), med(j.p50))} | "
                f"{_ratio(med(c.p99), med(j.p99))} | {_ratio(med(c.cpu_us), med(j.cpu_us))} |"
            )
        out.append("")
    if d.catchup:
        out += [
            "### Catch-up after a restart, and a full restart",
            "",
            f"Three brokers at level 2 on a line through h(t) (n0 primary, n1 secondary, n2 publishes), one topic "
            f"of {s.history:,} messages of {PAYLOAD_SIZE} B; {s.extra:,} more published while the broker is down. "
            "Times from the restart (process start, Python imports included): `ready` = the broker's readiness "
            "line; `holds` = its STATUS shows the topic in its old role with at least the holders' stored bytes; "
            "`caught up` = the same and the replica state in STATUS is caught_up; "
            "`serves` = a FETCH of the whole topic through it returned every message (distinct publisher and "
            "sequence numbers); `fetch` = how long that last FETCH took.",
            "",
            "| store | what | messages | ready s | holds s | caught up s | serves s | fetch s | STATUS seen | FETCH | "
            "notes | broker log |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
        ]
        for r in d.catchup:
            out.append(
                f"| {r['store']} | {r['what']} | {_f(r.get('messages'))} | {_f(r.get('ready'), 1, 2)} | "
                f"{_f(r.get('holds'), 1, 2)} | {_f(r.get('holds_caught_up'), 1, 2)} | "
                f"{_f(r.get('serves'), 1, 2)} | {_f(r.get('fetch_s'), 1, 2)} | "
                f"{r.get('holds_seen', '')} | {r.get('fetched', '')} | {r.get('note', '')}"
                f"{'; ' + r['fetch_error'] if r.get('fetch_error') else ''} | {r.get('log', '')} |"
            )
        out.append("")
    return "\n".join(out) + "\n"


def _pip_version(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "?"


def row_text(c: Cell, vs_memory: str) -> str:
    runs = ", ".join(f"{r:,.0f}" for r in c.rates)
    notes = "; ".join(dict.fromkeys(c.notes))
    return (
        f"| {c.level} | {c.store} | {MODE_TEXT[c.mode]} | {_f(med(c.rates))} ({runs}) | {vs_memory} | "
        f"{_f(med(c.p50), 1e3, 2)} | {_f(med(c.p99), 1e3, 2)} | {_f(med(c.delivered))} | "
        f"{_f(med(c.d50), 1e3, 2)} | {_f(med(c.d99), 1e3, 2)} | {_f(med(c.cpu_us), 1, 1)} | "
        f"{_f(med([float(m) for m in c.msgs]))} | {_f(med(c.load), 1, 1)} | {notes} |"
    )


RESULTS_MARK: Final = "<!-- bench_storage results -->"
TITLE: Final = "Storage benchmark: fsync policies, NATS JetStream, catch-up"


async def main_async(args: argparse.Namespace, s: Settings) -> int:
    sections = args.only.split(",") if args.only else ["fsync", "jetstream", "catchup"]
    command = " ".join([".venv/bin/python benchmarks/bench_storage.py", *sys.argv[1:]])
    up_start, code = uptime(), code_state()
    print(f"{up_start}\nlogs in {s.workdir}", flush=True)
    t0 = time.monotonic()
    d = Driver(s)
    if "fsync" in sections or "jetstream" in sections:
        name = "+".join(n for n in ("fsync", "jetstream") if n in sections)
        before = uptime()
        print(f"== {name}", flush=True)
        await d.rounds("fsync" in sections, "jetstream" in sections)
        d.loads[name] = (before, uptime())
    if "catchup" in sections:
        before = uptime()
        print("== catchup", flush=True)
        await d.catchups()
        d.loads["catchup"] = (before, uptime())
    elapsed = time.monotonic() - t0
    report = markdown(d, s, command, (up_start, uptime()), elapsed, code)
    print()
    print(report)
    if args.out:
        write_section(Path(args.out), RESULTS_MARK, report, TITLE)
        print(f"wrote {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short run: 1 repetition, shorter phases, 2*10^4 history")
    p.add_argument("--out", help="write the markdown report to this file (after its results mark)")
    p.add_argument("--only", help="comma-separated subset of fsync,jetstream,catchup (default: all, in that order)")
    p.add_argument("--repeat", type=int, help="repetitions per cell (default 3, quick 1)")
    p.add_argument("--levels", default="1,2", help="SeDAX resilience levels of the fsync section (default 1,2)")
    p.add_argument("--policies", default=",".join(POLICIES), help="stores of the fsync section")
    p.add_argument("--window", type=int, default=4096, help="unacknowledged publishes in window mode (default 4096)")
    p.add_argument("--history", type=int, help="messages of the catch-up topic (default 100000, quick 20000)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ["SEDAX_INSECURE"] = "1"  # plain TCP, as nats-server runs here (bench_tls.py measures TLS)
    if args.worker:
        return worker_main(args.worker)
    quick = bool(args.quick)
    history = args.history or (20_000 if quick else 100_000)
    s = Settings(
        quick=quick,
        repeat=args.repeat or (1 if quick else 3),
        seq_s=0.5 if quick else 1.0,
        window_s=0.7 if quick else 1.5,
        window=args.window,
        levels=tuple(int(v) for v in args.levels.split(",")),
        policies=tuple(args.policies.split(",")),
        history=history,
        extra=max(1, history // 10),
        workdir=Path(tempfile.mkdtemp(prefix="sedax-bench-storage-")),
    )
    try:
        return asyncio.run(main_async(args, s))
    finally:
        # the logs stay; the data directories and the JetStream store (tens of MB) go
        for d in [*s.workdir.glob("*/data"), s.workdir / "jetstream"]:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
