"""Pub/sub benchmark (not a test): SeDAX against Mosquitto and nats-server, side by side in one run.

    .venv/bin/python benchmarks/bench_pubsub.py [--quick] [--out docs/benchmarks-pubsub.md]

Every broker runs as its own process on 127.0.0.1 (free ports, stopped by PID at the end); the publisher and
the subscriber are two more processes (this script with `--worker`), each a Python asyncio client under
uvloop with the same batching discipline: frames queued in one event-loop turn go out in one write, a yield
every 256 publishes, a drain only above 256 KiB, reads of 256 KiB parsed whole, at most 4096 publishes
unconfirmed (see benchmarks/peers.py).

Per configuration:

* throughput: 1 publisher, 1 subscriber, 100-byte payloads, N messages (100k; 20k with --quick) after a
  1000-message warm-up; msg/s = N / (last delivery at the subscriber - first publish at the publisher);
* latency: the same pair publishing at a fixed rate (5k msg/s for 3 s; 1 s with --quick), the publisher's
  `time.perf_counter()` inside each payload, the subscriber's clock on arrival (CLOCK_MONOTONIC, one clock for
  all processes of the machine); p50/p99 over all messages;
* broker CPU: user+system CPU seconds of every broker process of the configuration (/proc) during the
  throughput run, per message: less sensitive to the machine's other load than the wall-clock rate.

Configurations: Mosquitto (publish QoS 1 with PUBACK; subscription QoS 0, and QoS 1 in a second row), core
NATS (no per-message ack: PUB plus a PING every 1024 messages, at most 4 unanswered, as flow control), and
SeDAX with the publisher's access broker 0, 1 and --far-hops (3) overlay hops from the topic's primary
(resilience 2), and 0 hops at resilience 1 and 3.  The SeDAX brokers sit on a line through the topic's
coordinate h(t), so the Delaunay overlay is the chain and broker k is exactly k hops from the primary
(checked with route probes); the subscriber is attached to the primary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

_ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

from harness import (  # noqa: E402
    add_sub_iterate,
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
# flag (1 = warm-up), message index, publisher's perf_counter(); padded to PAYLOAD_SIZE
_HEAD: Final = struct.Struct("<BId")
WARMUP: Final = 1000
MAX_INFLIGHT: Final = 4096
# A subscriber that sees no message for this long gives up and reports what it got.
IDLE_TIMEOUT: Final = 10.0
READY_TIMEOUT: Final = 30.0
# Slowest rate we wait for before declaring a throughput run stuck (the run is killed after N / this + slack).
MIN_RATE: Final = 1000.0
STOP_GRACE: Final = 5.0
TOPIC: Final = "bench/pubsub/t1"
# SeDAX brokers run with their defaults.  Before the fixes of 09:45 on 2026-11-23 the defaults collapsed under
# this machine's load (links declared dead after 0.6 s, a replication time-out back-filling the whole history);
# those runs used "--heartbeat-interval 0.5 --heartbeat-misses 6 --retention-bytes 1048576" (docs/benchmarks-pubsub.md).
SEDAX_BROKER_ARGS: Final = "--log-level WARNING"


def payload(flag: int, index: int, ts: float) -> bytes:
    return _HEAD.pack(flag, index, ts).ljust(PAYLOAD_SIZE, b"x")


# ================================================================================================= worker
# One side of one measurement in its own process: `--worker JSON`.  The subscriber prints {"event": "ready"}
# once subscribed, then one JSON result line; the publisher prints one JSON result line.


class Sink:
    """Counts measured deliveries, the first/last arrival, order, and (latency mode) each delay."""

    def __init__(self, count: int, latency: bool) -> None:
        self.count = count
        self.got = 0
        self.first = 0.0
        self.last = 0.0
        self.cpu_first = 0.0
        self.cpu_last = 0.0
        self.out_of_order = 0
        self.expect = 0
        self.lat = array("d", bytes(8 * count)) if latency else None
        self.done = asyncio.Event()

    def __call__(self, p: bytes) -> None:
        if p[0]:  # warm-up
            return
        now = time.perf_counter()
        _, idx, ts = _HEAD.unpack_from(p)
        if idx != self.expect:
            self.out_of_order += 1
        self.expect = idx + 1
        if self.lat is not None and self.got < self.count:
            self.lat[self.got] = now - ts
        if not self.got:
            self.first = now
            self.cpu_first = time.process_time()
        self.got += 1
        self.last = now
        if self.got >= self.count:
            self.cpu_last = time.process_time()
            self.done.set()

    async def wait(self) -> None:
        seen = -1
        while not self.done.is_set() and self.got != seen:
            seen = self.got
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(IDLE_TIMEOUT):
                    await self.done.wait()

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "received": self.got,
            "first_rx": self.first,
            "last_rx": self.last,
            "out_of_order": self.out_of_order,
            "cpu": (self.cpu_last or time.process_time()) - self.cpu_first,
        }
        if self.lat is not None and self.got:
            lat = sorted(self.lat[: min(self.got, self.count)])
            out.update(p50=pct(lat, 0.50), p99=pct(lat, 0.99), max=lat[-1], mean=sum(lat) / len(lat))
        return out


async def sub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    sink = Sink(spec["count"], spec["mode"] == "latency")
    system = spec["system"]
    host, port = spec["addr"].rsplit(":", 1)
    if system == "sedax":
        from client.client import Client

        async with Client([spec["addr"]], client_id=f"bench-sub-{os.getpid()}") as c:
            sub = await sedax_consume(c, spec["topic"], sink, ready, sink.wait, iterate=spec["iterate"])
            res = sink.result()
            res.update(dropped=sub.dropped, duplicates=sub.duplicates, gaps=sub.gaps, reconnects=c.reconnects)
            return res
    if system == "mqtt":
        from peers import MqttClient

        mq = await MqttClient.connect(host, int(port), f"bench-sub-{os.getpid()}")
        try:
            await mq.subscribe(spec["topic"], spec["qos"], sink)
            ready()
            await sink.wait()
            return sink.result()
        finally:
            await mq.close()
    from peers import NatsClient

    nc = await NatsClient.connect(host, int(port), f"bench-sub-{os.getpid()}")
    try:
        await nc.subscribe(spec["topic"], sink)
        ready()
        await sink.wait()
        return sink.result()
    finally:
        await nc.close()


def ready() -> None:
    print(json.dumps({"event": "ready"}), flush=True)


async def pub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    system = spec["system"]
    host, port = spec["addr"].rsplit(":", 1)
    topic = spec["topic"]
    publish: Callable[[bytes], Any]
    stats: Callable[[], dict[str, int]] = dict
    if system == "sedax":
        from client.client import Client

        extra = {"ack_timeout": spec["ack_timeout"]} if spec.get("ack_timeout") else {}
        if spec.get("unbatched"):
            extra["batch_publishes"] = False
        client = Client([spec["addr"]], client_id=f"bench-pub-{os.getpid()}", max_inflight=spec["inflight"], **extra)
        await client.connect()

        async def publish(p: bytes) -> None:
            await client.publish_nowait(topic, p)

        flush, close = client.flush, client.aclose

        def stats() -> dict[str, int]:
            return {"resent": client.resent, "reconnects": client.reconnects}
    elif system == "mqtt":
        from peers import MqttClient, mqtt_topic

        mq = await MqttClient.connect(host, int(port), f"bench-pub-{os.getpid()}", max_inflight=spec["inflight"])
        field_ = mqtt_topic(topic)

        async def publish(p: bytes) -> None:
            await mq.publish(field_, p)

        flush, close = mq.flush, mq.close
    else:
        from peers import NatsClient, nats_pub_head

        nc = await NatsClient.connect(host, int(port), f"bench-pub-{os.getpid()}", max_inflight=spec["inflight"])
        head = nats_pub_head(topic, PAYLOAD_SIZE)

        async def publish(p: bytes) -> None:
            await nc.publish(head, p)

        flush, close = nc.flush, nc.close
    try:
        for i in range(spec["warmup"]):
            await publish(payload(1, i, 0.0))
        async with asyncio.timeout(30.0):
            await flush()
        n = spec["count"]
        perf = time.perf_counter
        cpu0 = time.process_time()
        if spec["mode"] == "throughput":
            t0 = perf()
            for i in range(n):
                await publish(payload(0, i, perf()))
        else:
            rate = spec["rate"]
            t0 = perf()
            i = 0
            while i < n:
                due = min(n, int((perf() - t0) * rate) + 1)
                while i < due:
                    await publish(payload(0, i, perf()))
                    i += 1
                await pace(spec["pace"], t0 + i / rate)
        t_sent = perf()
        async with asyncio.timeout(60.0):
            await flush()
        t_acked = perf()
        cpu = time.process_time() - cpu0
    finally:
        await close()
    return {"first_tx": t0, "sent_at": t_sent, "acked_at": t_acked, "sent": n, "cpu": cpu, **stats()}


async def pace(mode: str, due: float) -> None:
    """Wait until perf_counter() reaches due, the publisher's way (PACES)."""
    perf = time.perf_counter
    if mode == "burst":
        # uvloop's timers have millisecond steps: wake once a millisecond, send what fell due meanwhile.
        await asyncio.sleep(max(0.001, due - perf()))
        return
    await asyncio.sleep(0)  # one turn of the loop: read what arrived (ACKs), write what is queued
    if mode == "sleep":
        left = due - perf()
        if left >= 0.001:
            await asyncio.sleep(left - 0.0005)  # the loop's timer for the bulk, the rest below
            left = due - perf()
        if left > 0:
            time.sleep(left)  # noqa: ASYNC251 - nanosleep: sub-millisecond, the core free meanwhile
        return
    while perf() < due:  # noqa: ASYNC110 - spin: yield until due (a timer under 0.5 ms in uvloop does)
        await asyncio.sleep(0)


# How the publisher waits for its next message: PACE_HELP says what each means.
PACES: Final = ("sleep", "spin", "burst")
PACE_HELP: Final = (
    "publisher pacing: sleep = each message on time, the wait in nanosleep below 1 ms (default); "
    "spin = yield to the loop until due (uvloop rounds timers under 0.5 ms to 0: a busy core); "
    "burst = uvloop's 1 ms timer, what fell due meanwhile at once"
)


def worker_main(spec_text: str) -> int:
    spec = json.loads(spec_text)
    fn = sub_worker if spec["role"] == "sub" else pub_worker
    prof = None
    if spec.get("profile"):
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU time: a wall clock would charge preemption to write()
        prof.enable()
    if spec.get("uvloop", True):
        import uvloop

        res = uvloop.run(fn(spec))
    else:
        res = asyncio.run(fn(spec))
    if prof is not None:
        prof.disable()
        prof.dump_stats(f"{spec['profile']}-{spec['role']}.prof")
    print(json.dumps(res), flush=True)
    return 0


# ================================================================================================= driver


@dataclass
class Row:
    """One configuration's results."""

    system: str
    config: str
    msgs: int = 0
    rate: float | None = None  # msg/s, first publish -> last delivery, best of the runs
    rates: list[float] = field(default_factory=list)  # every throughput run's
    pub_rate: float | None = None  # msg/s, first publish -> last acknowledgement (NATS: last PONG)
    cpu_us: float | None = None  # broker CPU microseconds per message
    pub_cpu_us: float | None = None  # publisher process CPU per message, first publish -> last ack
    sub_cpu_us: float | None = None  # subscriber process CPU per message, first -> last delivery
    p50: float | None = None
    p99: float | None = None
    lat_max: float | None = None
    lat_got: str = ""
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average before/after
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    messages: int
    rate: int
    duration: float
    inflight: int
    far_hops: int
    repeat: int
    profile: Path | None
    broker_args: tuple[str, ...]
    uvloop: bool
    workdir: Path
    pace: str = "sleep"  # how a latency run's publisher waits for its next message (PACES)
    sub_iterate: bool = False  # the SeDAX subscriber iterates instead of taking messages by on_message


def anomalies(pub: dict[str, Any], sub: dict[str, Any], run: str) -> list[str]:
    """What the SeDAX client reports beyond a clean run: re-sends after its ack timeout, reconnects, drops."""
    out = []
    for who, res in (("publisher", pub), ("subscriber", sub)):
        for key in ("resent", "reconnects", "dropped", "duplicates", "gaps"):
            if res.get(key):
                out.append(f"{run}: {who} {key} {res[key]}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_port(port: int, proc: subprocess.Popen[bytes], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        else:
            w.close()
            return


def stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Driver:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.rows: list[Row] = []
        self.seq = 0

    async def _spawn(self, spec: dict[str, Any]) -> asyncio.subprocess.Process:
        self.seq += 1
        return await spawn_worker(__file__, spec, self.s.workdir / f"worker-{self.seq}-{spec['role']}.err")

    async def pair(self, base: dict[str, Any], sub_addr: str, pub_addr: str, mode: str) -> tuple[dict, dict]:
        """Run one subscriber and one publisher worker; their result dicts (RuntimeError with the logs)."""
        count = self.s.messages if mode == "throughput" else int(self.s.rate * self.s.duration)
        spec = dict(
            base,
            mode=mode,
            count=count,
            rate=self.s.rate,
            pace=self.s.pace,
            warmup=WARMUP,
            inflight=self.s.inflight,
            uvloop=self.s.uvloop,
            profile=str(self.s.profile / f"{base['system']}-{mode}-{self.seq + 1}") if self.s.profile else "",
        )
        sub = await self._spawn(dict(spec, role="sub", addr=sub_addr))
        procs = [sub]
        try:
            assert sub.stdout is not None
            async with asyncio.timeout(READY_TIMEOUT):
                line = await sub.stdout.readline()
            if json.loads(line or b"{}").get("event") != "ready":
                raise RuntimeError(f"subscriber not ready: {line!r}")
            pub = await self._spawn(dict(spec, role="pub", addr=pub_addr))
            procs.append(pub)
            limit = count / MIN_RATE + 2 * IDLE_TIMEOUT + 30.0
            async with asyncio.timeout(limit):
                (pout, _), (sout, _) = await asyncio.gather(pub.communicate(), sub.communicate())
            if pub.returncode or sub.returncode:
                raise RuntimeError(f"worker failed (pub {pub.returncode}, sub {sub.returncode})")
            return json.loads(pout.splitlines()[-1]), json.loads(sout.splitlines()[-1])
        except BaseException as exc:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
            logs = [
                *self.s.workdir.glob(f"worker-{self.seq - 1}-*.err"),
                *self.s.workdir.glob(f"worker-{self.seq}-*.err"),
            ]
            tails = [f"{f.name}: {f.read_text(errors='replace')[-1500:]}" for f in sorted(logs)]
            if isinstance(exc, Exception):
                raise RuntimeError(f"{mode} run failed: {exc!r}\n" + "\n".join(tails)) from exc
            raise

    async def measure(self, row: Row, base: dict[str, Any], sub_addr: str, pub_addr: str, pids: list[int]) -> None:
        row.load = (os.getloadavg()[0], 0.0)
        label = f"{row.system} {row.config}"
        try:
            runs = []
            for _ in range(self.s.repeat):
                cpu0 = cpu_seconds(*pids)
                pub, sub = await self.pair(base, sub_addr, pub_addr, "throughput")
                cpu1 = cpu_seconds(*pids)
                runs.append((pub, sub, cpu1 - cpu0))
                if sub["received"] < pub["sent"]:
                    row.notes.append(f"throughput run: {sub['received']} of {pub['sent']} delivered")
                if sub["out_of_order"]:
                    row.notes.append(f"{sub['out_of_order']} out of order")
                row.notes += anomalies(pub, sub, "throughput run")
            row.msgs = runs[0][0]["sent"]
            rates = [s["received"] / (s["last_rx"] - p["first_tx"]) for p, s, _ in runs if s["received"]]
            row.rates = rates
            row.rate = max(rates, default=None)
            row.pub_rate = max(p["sent"] / (p["acked_at"] - p["first_tx"]) for p, _, _ in runs)
            # warm-up and connection set-up are in the CPU window too; they are ~1% of the messages
            row.cpu_us = statistics.median(c / (p["sent"] + WARMUP) * 1e6 for p, _, c in runs)
            row.pub_cpu_us = statistics.median(p["cpu"] / p["sent"] * 1e6 for p, _, _ in runs)
            sub_cpu = [s["cpu"] / s["received"] * 1e6 for _, s, _ in runs if s["received"]]
            row.sub_cpu_us = statistics.median(sub_cpu) if sub_cpu else None
            pub, sub = await self.pair(base, sub_addr, pub_addr, "latency")
            row.lat_got = f"{sub['received']}/{pub['sent']}"
            row.notes += anomalies(pub, sub, "latency run")
            if sub["received"]:
                row.p50, row.p99, row.lat_max = sub["p50"], sub["p99"], sub["max"]
            if sub["received"] < pub["sent"]:
                row.notes.append(f"latency run: {sub['received']} of {pub['sent']} delivered")
            offered = pub["sent"] / (pub["sent_at"] - pub["first_tx"])
            if offered < 0.95 * self.s.rate:
                row.notes.append(f"publisher reached only {offered:.0f} msg/s of {self.s.rate}")
        except Exception as exc:
            row.notes.append(f"failed: {str(exc).splitlines()[0]}")
            print(f"  {label}: {exc}", file=sys.stderr)
        row.load = (row.load[0], os.getloadavg()[0])
        self.rows.append(row)
        print("  " + fmt_row(row), flush=True)

    # ---------------------------------------------------------------------------------------- peers

    async def mosquitto(self) -> None:
        exe = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
        if exe is None:
            self.rows.append(Row("Mosquitto", "-", notes=["not measured: mosquitto not installed"]))
            return
        port = free_port()
        conf = self.s.workdir / "mosquitto.conf"
        # Defaults except two limits that would otherwise lose or throttle a QoS 1 subscription: at most 20
        # QoS 1 deliveries in flight per client and 1000 queued behind them (beyond that mosquitto drops).
        # A QoS 0 subscription is not affected by either.
        conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            f"max_inflight_messages {self.s.inflight}\nmax_queued_messages 0\n"
            "log_dest stderr\nlog_type error\nlog_type warning\n"
        )
        proc = start_server([exe, "-c", str(conf)], self.s.workdir / "mosquitto.log")
        try:
            await wait_port(port, proc)
            addr = f"127.0.0.1:{port}"
            print(f"Mosquitto {mosquitto_version(exe)} pid {proc.pid} on {addr}", flush=True)
            for qos in (0, 1):
                row = Row("Mosquitto", f"pub QoS 1, sub QoS {qos}")
                await self.measure(row, {"system": "mqtt", "topic": TOPIC, "qos": qos}, addr, addr, [proc.pid])
        finally:
            stop_proc(proc)

    async def amqtt(self) -> None:
        """amqtt, the asyncio MQTT broker a Python user might pick (PyPI `amqtt`: `.venv/bin/pip install amqtt`)."""
        exe = shutil.which("amqtt", path=str(Path(sys.executable).parent)) or shutil.which("amqtt")
        if exe is None:
            self.rows.append(Row("amqtt", "-", notes=["not measured: amqtt not installed (pip install amqtt)"]))
            return
        port = free_port()
        conf = self.s.workdir / "amqtt.yaml"
        # Anonymous TCP on loopback, no packet or event logging plugins (they log every packet).
        conf.write_text(
            f"listeners:\n  default:\n    type: tcp\n    bind: 127.0.0.1:{port}\n"
            "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n    allow_anonymous: true\n"
        )
        proc = start_server([exe, "-c", str(conf)], self.s.workdir / "amqtt.log")
        try:
            await wait_port(port, proc, within=30.0)
            addr = f"127.0.0.1:{port}"
            print(f"amqtt {program_output([exe, '--version'])} pid {proc.pid} on {addr}", flush=True)
            row = Row("amqtt", "pub QoS 1, sub QoS 0")
            await self.measure(row, {"system": "mqtt", "topic": TOPIC, "qos": 0}, addr, addr, [proc.pid])
        finally:
            stop_proc(proc)

    async def nats(self) -> None:
        exe = shutil.which("nats-server") or shutil.which("nats-server", path="/usr/sbin:/usr/local/bin")
        if exe is None:
            self.rows.append(Row("NATS", "-", notes=["not measured: nats-server not installed"]))
            return
        port = free_port()
        log = self.s.workdir / "nats.log"
        proc = start_server([exe, "-a", "127.0.0.1", "-p", str(port), "-l", str(log)], self.s.workdir / "nats.out")
        try:
            await wait_port(port, proc)
            addr = f"127.0.0.1:{port}"
            print(f"{program_output([exe, '--version'])} pid {proc.pid} on {addr}", flush=True)
            row = Row("NATS", "core PUB, PING/1024")
            await self.measure(row, {"system": "nats", "topic": TOPIC}, addr, addr, [proc.pid])
        finally:
            stop_proc(proc)

    # ---------------------------------------------------------------------------------------- SeDAX

    async def sedax(self, resilience: int, hops: list[int]) -> None:
        from cli.cluster import LocalCluster

        coords = line_coords(TOPIC, max(max(hops) + 1, resilience))
        try:
            cluster = LocalCluster(
                len(coords),
                coords=coords,
                resilience=resilience,
                state_dir=self.s.workdir / f"sedax-r{resilience}",
                broker_args=self.s.broker_args,
            )
            async with cluster:
                await cluster.wait_converged(60.0)
                pids = [bp.pid for bp in cluster.nodes]
                print(f"SeDAX resilience {resilience}: {len(coords)} brokers, pids {pids}", flush=True)
                primary = await check_layout(cluster, TOPIC, hops)
                for h in hops:
                    row = Row("SeDAX", f"resilience {resilience}, {h} hop{'s' if h != 1 else ''}")
                    before = broker_warnings(cluster)
                    spec = {"system": "sedax", "topic": TOPIC, "iterate": self.s.sub_iterate}
                    await self.measure(row, spec, primary, cluster.nodes[h].listen, pids)
                    after = broker_warnings(cluster)
                    row.notes += [f"brokers logged {after[k] - before[k]} × {k}" for k in after if after[k] > before[k]]
                if resilience == 1 and 0 in hops:
                    # Like for like with one-message protocols: the client sends one PUBLISH per message.
                    row = Row("SeDAX", "resilience 1, 0 hops, one PUBLISH per message")
                    spec = {"system": "sedax", "topic": TOPIC, "unbatched": True, "iterate": self.s.sub_iterate}
                    await self.measure(row, spec, primary, cluster.nodes[0].listen, pids)
        except Exception as exc:
            for h in hops:
                if not any(r.config == f"resilience {resilience}, {h} hop{'s' if h != 1 else ''}" for r in self.rows):
                    why = str(exc).splitlines()[0] if str(exc) else repr(exc)
                    self.rows.append(Row("SeDAX", f"resilience {resilience}, {h} hops", notes=[f"failed: {why}"]))
            print(f"SeDAX resilience {resilience}: {exc!r}", file=sys.stderr)


def start_server(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start a peer broker in its own session, output to log; the caller stops it with stop_proc."""
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, start_new_session=True)


# Broker log lines that say the run was not a steady state (pub/sub replication retries, links declared dead).
BROKER_TROUBLE: Final = {"replication timeout": "did not confirm in time", "neighbour lost": "lost ("}


def broker_warnings(cluster: Any) -> dict[str, int]:
    counts = dict.fromkeys(BROKER_TROUBLE, 0)
    for bp in cluster.nodes:
        with contextlib.suppress(OSError):
            text = bp.err_path.read_text(errors="replace")
            for key, needle in BROKER_TROUBLE.items():
                counts[key] += text.count(needle)
    return counts


def mosquitto_version(exe: str) -> str:
    out = program_output([exe, "-h"])
    first = out.splitlines()[0] if out else ""
    return first.split("version")[-1].strip() if "version" in first else "?"


def line_coords(topic: str, n: int) -> list[tuple[float, float]]:
    """n broker coordinates on a horizontal line through h(topic), broker 0 nearest, spaced away from it.

    Collinear sites make the Delaunay overlay a chain (overlay.geometry.delaunay_neighbours), so broker k is
    k greedy hops from broker 0, the topic's primary; broker 1 is its secondary and broker 2 its tertiary.
    """
    from overlay.geometry import geohash

    hx, hy = geohash(topic)
    right = hx < 0.5
    room = (1.0 - hx) if right else hx
    step = min(0.15, (room - 0.02) / max(1, n - 1))
    sign = 1.0 if right else -1.0
    return [(hx + sign * (0.005 + k * step), hy) for k in range(n)]


async def check_layout(cluster: Any, topic: str, hops: list[int]) -> str:
    """Check that broker 0 is the topic's primary and broker h is h hops from it; the primary's address."""
    from client.admin import AdminClient
    from client.client import Client
    from overlay.geometry import geohash

    target = geohash(topic)
    for h in hops:
        async with await AdminClient.connect(cluster.nodes[h].listen) as ac:
            reply = await ac.route(target)
        if reply.node.id != cluster.nodes[0].node_id or reply.hops != h:
            raise RuntimeError(f"route from broker {h} reached {reply.node.id} in {reply.hops} hops, not n0 in {h}")
    async with Client([cluster.nodes[0].listen]) as c:
        located = await c.locate(topic)
    if located.primary.id != cluster.nodes[0].node_id:
        raise RuntimeError(f"primary of {topic} is {located.primary.id}, expected {cluster.nodes[0].node_id}")
    return str(cluster.nodes[0].listen)


# ================================================================================================= report


def _f(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "–" if v is None else f"{v * scale:,.{digits}f}"


def fmt_row(r: Row) -> str:
    return (
        f"{r.system:9} {r.config:26} {_f(r.rate):>9} msg/s  acked {_f(r.pub_rate):>9} msg/s  "
        f"CPU µs/msg broker {_f(r.cpu_us, 1, 1):>5} pub {_f(r.pub_cpu_us, 1, 1):>5} sub {_f(r.sub_cpu_us, 1, 1):>5}"
        f"  p50 {_f(r.p50, 1e3, 2):>7} ms  p99 {_f(r.p99, 1e3, 2):>7} ms"
        f"  load {r.load[0]:.1f}->{r.load[1]:.1f}" + (f"  [{'; '.join(r.notes)}]" if r.notes else "")
    )


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def markdown(
    rows: list[Row],
    s: Settings,
    command: str,
    load_start: tuple[float, ...],
    load_end: tuple[float, ...],
    uptime_start: str,
    uptime_end: str,
    elapsed: float,
) -> str:
    mosq = next((r for r in rows if r.system == "Mosquitto" and r.config.endswith("QoS 0")), None)
    nats = next((r for r in rows if r.system == "NATS"), None)
    out = [
        "## Results",
        "",
        f"`{command}` — {elapsed:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
        f"{platform.python_version()}, {'uvloop' if s.uvloop else 'asyncio'} in every client.  "
        f"Load average (1/5/15 min) at start {'/'.join(f'{v:.2f}' for v in load_start)}, at end "
        f"{'/'.join(f'{v:.2f}' for v in load_end)} (`uptime`: `{uptime_start}` / `{uptime_end}`); the machine is "
        "shared with other test runs, so the wall-clock figures carry that noise; broker CPU per message does "
        "much less.",
        "",
        f"Throughput: {s.messages:,} messages of {PAYLOAD_SIZE} bytes, at most {s.inflight} unconfirmed.  "
        f"Latency: {s.rate:,} msg/s for {s.duration:g} s.  Throughput runs per configuration: {s.repeat} (best "
        f"msg/s shown, median CPU).  SeDAX broker flags: `{' '.join(s.broker_args)}`.",
        "",
        "| system | configuration | msg/s (publish → last delivery) | msg/s (publish → last ack) | "
        "CPU µs/msg broker | publisher | subscriber | p50 ms | p99 ms | max ms | delivered (latency run) | "
        "load 1 min | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.system} | {r.config} | {_f(r.rate)} | {_f(r.pub_rate)} | {_f(r.cpu_us, 1, 1)} | "
            f"{_f(r.pub_cpu_us, 1, 1)} | {_f(r.sub_cpu_us, 1, 1)} | {_f(r.p50, 1e3, 2)} | {_f(r.p99, 1e3, 2)} | "
            f"{_f(r.lat_max, 1e3, 1)} | {r.lat_got or '–'} | "
            f"{r.load[0]:.1f}→{r.load[1]:.1f} | {'; '.join(r.notes)} |"
        )
    out += [
        "",
        "Ratios of each SeDAX row against Mosquitto (pub QoS 1, sub QoS 0) and core NATS: throughput (> 1: SeDAX "
        "faster), broker CPU per message and p50/p99 latency (> 1: SeDAX costlier/slower).",
        "",
        "| SeDAX configuration | msg/s ÷ Mosquitto | msg/s ÷ NATS | CPU/msg ÷ Mosquitto | CPU/msg ÷ NATS | "
        "p50 ÷ Mosquitto | p50 ÷ NATS | p99 ÷ Mosquitto | p99 ÷ NATS |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.system != "SeDAX":
            continue
        m = mosq or Row("", "")
        n = nats or Row("", "")
        out.append(
            f"| {r.config} | {_ratio(r.rate, m.rate)} | {_ratio(r.rate, n.rate)} | {_ratio(r.cpu_us, m.cpu_us)} | "
            f"{_ratio(r.cpu_us, n.cpu_us)} | {_ratio(r.p50, m.p50)} | {_ratio(r.p50, n.p50)} | "
            f"{_ratio(r.p99, m.p99)} | {_ratio(r.p99, n.p99)} |"
        )
    return "\n".join(out) + "\n"


def settings(args: argparse.Namespace) -> Settings:
    quick = args.quick
    s = Settings(
        messages=args.messages or (20_000 if quick else 100_000),
        rate=args.rate,
        duration=args.duration or (1.0 if quick else 3.0),
        inflight=args.inflight,
        far_hops=args.far_hops,
        repeat=args.repeat or (1 if quick else 3),
        profile=Path(args.profile).resolve() if args.profile else None,
        broker_args=tuple(args.broker_args.split()),
        sub_iterate=args.sub_iterate,
        uvloop=not args.no_uvloop,
        workdir=Path(tempfile.mkdtemp(prefix="sedax-bench-pubsub-")),
        pace=args.pace,
    )
    if s.profile:
        s.profile.mkdir(parents=True, exist_ok=True)
    return s


async def main_async(args: argparse.Namespace, s: Settings) -> int:
    systems = set(args.only.split(",")) if args.only else {"mosquitto", "nats", "amqtt", "sedax"}
    command = " ".join(["benchmarks/bench_pubsub.py", *sys.argv[1:]])
    load_start, up_start, code = os.getloadavg(), uptime(), code_state()
    print(f"{up_start}\nlogs in {s.workdir}", flush=True)
    t0 = time.monotonic()
    d = Driver(s)
    if "mosquitto" in systems:
        await d.mosquitto()
    if "nats" in systems:
        await d.nats()
    if "amqtt" in systems:
        await d.amqtt()
    if "sedax" in systems:
        levels = [int(v) for v in args.levels.split(",")]
        for level in levels:
            await d.sedax(level, sorted({0, 1, s.far_hops}) if level == 2 and not args.no_hops else [0])
    elapsed = time.monotonic() - t0
    load_end, up_end = os.getloadavg(), uptime()
    report = markdown(d.rows, s, ".venv/bin/python " + command, load_start, load_end, up_start, up_end, elapsed)
    report = report.replace("\n\nMachine:", f"\n\nCode: {code}.\n\nMachine:", 1)
    print()
    print(report)
    if args.out:
        write_section(Path(args.out), RESULTS_MARK, report, "Pub/sub benchmark: SeDAX, Mosquitto, NATS")
        print(f"wrote {args.out}")
    return 0


RESULTS_MARK: Final = "<!-- bench_pubsub results -->"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short run (20k messages, 1 s latency runs)")
    p.add_argument("--out", help="write the markdown report to this file (results section replaced)")
    p.add_argument("--messages", type=int, help="messages per throughput run (default 100000, quick 20000)")
    p.add_argument("--rate", type=int, default=5000, help="msg/s of the latency runs (default 5000)")
    p.add_argument("--duration", type=float, help="seconds of each latency run (default 3, quick 1)")
    p.add_argument("--pace", choices=PACES, default="sleep", help=PACE_HELP)
    p.add_argument("--inflight", type=int, default=MAX_INFLIGHT, help="unconfirmed publishes (default 4096)")
    p.add_argument("--far-hops", type=int, default=3, help="hops of the far SeDAX access broker (default 3)")
    p.add_argument("--repeat", type=int, help="throughput runs per configuration, best reported (default 3, quick 1)")
    p.add_argument("--only", help="comma-separated subset of mosquitto,nats,amqtt,sedax")
    p.add_argument(
        "--broker-args", default=SEDAX_BROKER_ARGS, help=f"SeDAX broker flags (default {SEDAX_BROKER_ARGS!r})"
    )
    p.add_argument("--levels", default="1,2,3", help="SeDAX resilience levels to run (default 1,2,3)")
    p.add_argument("--no-hops", action="store_true", help="SeDAX 0-hop configurations only")
    p.add_argument("--no-uvloop", action="store_true", help="plain asyncio event loop in the clients")
    add_sub_iterate(p)
    p.add_argument("--profile", metavar="DIR", help="run the client workers under cProfile, stats into DIR")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    # SeDAX on plain TCP (brokers, clients, workers inherit it), as the peers run without TLS;
    # benchmarks/bench_tls.py measures what TLS costs.
    os.environ["SEDAX_INSECURE"] = "1"
    if args.worker:
        return worker_main(args.worker)
    return asyncio.run(main_async(args, settings(args)))


if __name__ == "__main__":
    sys.exit(main())
