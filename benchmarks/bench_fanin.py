"""Fan-in and fan-out benchmark across a 9-broker overlay (not a test): many devices, one message at a time.

    .venv/bin/python benchmarks/bench_fanin.py [--scenarios fanin50,fanin1000,fanout100] [--duration 10]
                                               [--out docs/benchmarks-latency.md]

Scenarios (each for SeDAX and, as the reference, for one Mosquitto broker under the same clients):

* fanin50: 50 publishers x 50 Hz (2,500 msg/s) over 30 topics;
* fanin1000: 1,000 publishers x 10 Hz (10,000 msg/s) over 30 topics;
* fanin1000one (not run by default): the same 1,000 publishers into one topic, with one subscriber (a feeder's
  devices on the feeder's topic: what a primary does per publisher of a topic shows here);
* fanout100: 1 publisher at 100 Hz to 100 subscribers of one topic (10,000 deliveries/s).

SeDAX: nine brokers at random coordinates (`LocalCluster(9, seed=1)`, resilience 2, plain TCP); publisher i is
a `Client` of its own on broker i mod 9 with one PUBLISH per message (no client batching), each publish awaited
until its ACK (the primary stored it and the secondary confirmed it) before the next, like a device; publisher i
writes topic i mod 30.  Three subscribers (fan-in) take ten topics each and sit on brokers 0, 4 and 8; in the
fan-out the 100 subscribers are spread over all nine brokers.  Mosquitto: the same clients over MQTT (publish
QoS 1, each PUBACK awaited; subscriptions QoS 0) on one broker.  Publishers run in a few worker processes
(uvloop), started together at a common instant, each publisher at its own random phase.

Reported: p50/p99/p99.9/max publish -> deliver (the payload carries the publisher's perf_counter(), the
subscriber's clock on arrival, CLOCK_MONOTONIC for every process), delivered/offered (offered = what the
publishers actually sent; nominal = publishers x rate x duration), broker CPU (all broker processes, user+system
from /proc over the measured window, in % of one core and µs per delivered message) and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import struct
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

_ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

import bench_pubsub as bp  # noqa: E402 - after the path set-up above
from harness import add_sub_iterate, code_state, cpu_seconds, pct, spawn_worker, uptime, write_section  # noqa: E402

PAYLOAD_SIZE: Final = 100
_HEAD: Final = struct.Struct("<dII")  # publisher's perf_counter(), publisher index, message index
TOPICS: Final = 30
BROKERS: Final = 9
SUB_BROKERS: Final = (0, 4, 8)
CONNECT_PARALLEL: Final = 50
RESULTS_MARK: Final = "<!-- bench_fanin results -->"


@dataclass(frozen=True)
class Scenario:
    name: str
    publishers: int
    hz: float
    topics: int
    subscribers: int  # fan-in: 3 (each a share of the topics); fan-out: every subscriber takes the one topic
    fanout: bool = False


SCENARIOS: Final = {
    "fanin50": Scenario("50 publishers x 50 Hz, 30 topics", 50, 50.0, TOPICS, 3),
    "fanin1000": Scenario("1,000 publishers x 10 Hz, 30 topics", 1000, 10.0, TOPICS, 3),
    "fanin1000one": Scenario("1,000 publishers x 10 Hz, 1 topic", 1000, 10.0, 1, 1),
    "fanout100": Scenario("1 publisher x 100 Hz -> 100 subscribers", 1, 100.0, 1, 100, fanout=True),
}


def topic_name(k: int) -> str:
    return f"bench/fanin/t{k}"


# ================================================================================================= workers


async def sub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Subscribers: (addr, [topics]) each; latencies of everything that arrives until end_at + grace."""
    perf = time.perf_counter
    lat: list[float] = []
    got = 0
    closers: list[Any] = []

    per_pub: dict[int, int] = {}
    first: dict[int, int] = {}  # the first message index seen of each publisher

    per_sub: dict[int, int] = {}

    def sink(p: bytes, j: int = 0) -> None:
        nonlocal got
        per_sub[j] = per_sub.get(j, 0) + 1
        now = perf()
        got += 1
        t, i, k = _HEAD.unpack_from(p)
        lat.append(now - t)
        per_pub[i] = per_pub.get(i, 0) + 1
        first[i] = min(first.get(i, k), k)

    tasks: list[asyncio.Task[None]] = []
    subs_: list[Any] = []
    if spec["system"] == "sedax":
        from client.client import Client

        for j, (addr, topics) in enumerate(spec["subs"]):
            c = Client([addr], client_id=f"fan-sub-{os.getpid()}-{j}")
            await c.connect()
            closers.append(c.aclose)
            for t in topics:
                if not spec["iterate"]:
                    # Messages handed to a function as they are read, as the Mosquitto subscribers take them.
                    def on_message(m: Any, j: int = j) -> None:
                        sink(m.payload, j)

                    subs_.append(await c.subscribe(t, on_message=on_message))
                    continue
                sub = await c.subscribe(t)
                subs_.append(sub)

                async def consume(s: Any = sub, j: int = j) -> None:
                    async for m in s:
                        sink(m.payload, j)

                tasks.append(asyncio.create_task(consume()))
    else:
        from peers import MqttClient

        for j, (addr, topics) in enumerate(spec["subs"]):
            host, port = addr.rsplit(":", 1)
            mq = await MqttClient.connect(host, int(port), f"fan-sub-{os.getpid()}-{j}")
            closers.append(mq.close)
            for t in topics:
                await mq.subscribe(t, 0, lambda p, j=j: sink(p, j))
    bp.ready()
    await asyncio.sleep(max(0.0, spec["end_at"] + spec["grace"] - perf()))
    for t in tasks:
        t.cancel()
    for close in closers:
        with contextlib.suppress(Exception):
            await close()
    counters = {k: sum(getattr(s, k) for s in subs_) for k in ("dropped", "duplicates", "repaired", "gaps")}
    return {
        "got": got,
        "lat": lat,
        "per_publisher": per_pub,
        "first": first,
        "counters": counters,
        "per_subscriber": per_sub,
    }


async def pub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Publishers: (index, addr, topic) each; one message at a time, each awaited until acknowledged."""
    perf = time.perf_counter
    hz, start_at, end_at = spec["hz"], spec["start_at"], spec["end_at"]
    rng = random.Random(spec["seed"])
    sent = 0
    acked = 0
    late = 0.0  # the longest a publish went out after its due time
    errors: list[str] = []
    gate = asyncio.Semaphore(CONNECT_PARALLEL)

    # Publisher ids are new in every run: a primary takes a known (publisher, seq) for a re-send and only
    # acknowledges it again, so ids reused by the next scenario on the same cluster would deliver nothing.
    async def one(i: int, addr: str, topic: str, connected: asyncio.Event) -> None:
        nonlocal sent, acked, late
        host, port = addr.rsplit(":", 1)
        publish: Any
        if spec["system"] == "sedax":
            from client.client import Client

            async with gate:
                c = Client([addr], client_id=f"fan-pub-{os.getpid()}-{i}", batch_publishes=False)
                await c.connect()

            async def publish(p: bytes) -> None:
                await c.publish(topic, p)

            close = c.aclose
        else:
            from peers import MqttClient, mqtt_topic

            async with gate:
                mq = await MqttClient.connect(host, int(port), f"fan-pub-{os.getpid()}-{i}")
            field_ = mqtt_topic(topic)

            async def publish(p: bytes) -> None:
                await mq.publish(field_, p)
                await mq.flush()  # the PUBACK, as SeDAX's publish() awaits its ACK

            close = mq.close
        connected.set()
        try:
            phase = rng.random() / hz
            k = 0
            while True:
                due = start_at + phase + k / hz
                if due >= end_at:
                    break
                await asyncio.sleep(max(0.0, due - perf()))
                t = perf()
                if t >= end_at:
                    break  # behind its schedule (each publish waits for its ACK): what is left is not offered
                late = max(late, t - due)
                sent += 1
                await publish(_HEAD.pack(t, i, k).ljust(PAYLOAD_SIZE, b"x"))
                acked += 1
                k += 1
        except Exception as exc:  # reported with the results; the other publishers go on
            errors.append(repr(exc))
        finally:
            with contextlib.suppress(Exception):
                await close()

    events = [asyncio.Event() for _ in spec["pubs"]]
    tasks = [asyncio.create_task(one(i, a, t, e)) for (i, a, t), e in zip(spec["pubs"], events, strict=True)]
    await asyncio.gather(*(e.wait() for e in events))
    bp.ready()
    await asyncio.gather(*tasks)
    return {"sent": sent, "acked": acked, "late": late, "errors": errors[:5], "n_errors": len(errors)}


def worker_main(spec_text: str) -> int:
    import gc

    import peers  # noqa: F401
    import uvloop

    import client.client  # noqa: F401 - imported before the freeze below

    # The clients of every system run in the same kind of worker; none should pay full collections that walk
    # the interpreter's start-up heap (brokers freeze theirs too: broker/main.py).
    gc.collect()
    gc.freeze()

    spec = json.loads(spec_text)
    res = uvloop.run((sub_worker if spec["role"] == "sub" else pub_worker)(spec))
    Path(spec["out"]).write_text(json.dumps(res))
    return 0


# ================================================================================================= driver


@dataclass
class Result:
    system: str
    scenario: Scenario
    nominal: int = 0
    offered: int = 0
    acked: int = 0
    expected: int = 0  # deliveries expected for what was offered
    got: int = 0
    lat: list[float] = field(default_factory=list)
    broker_cpu: float = 0.0  # CPU seconds of all broker processes over the window
    window: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    notes: list[str] = field(default_factory=list)


class Driver:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.results: list[Result] = []
        self.seq = 0

    async def spawn(self, spec: dict[str, Any]) -> tuple[asyncio.subprocess.Process, Path]:
        self.seq += 1
        out = self.workdir / f"result-{self.seq}-{spec['role']}.json"
        err = self.workdir / f"worker-{self.seq}-{spec['role']}.err"
        return await spawn_worker(__file__, dict(spec, out=str(out)), err), out

    async def run(self, system: str, sc: Scenario, pub_addrs: list[str], sub_addrs: list[str], pids: list[int]) -> None:
        a = self.args
        res = Result(system, sc)
        grace = 3.0
        # Subscribers: fan-in, subscriber j takes topics k with k mod 3 == j; fan-out, each takes the one topic.
        subs: list[tuple[str, list[str]]] = []
        for j in range(sc.subscribers):
            topics = (
                [topic_name(0)] if sc.fanout else [topic_name(k) for k in range(sc.topics) if k % sc.subscribers == j]
            )
            subs.append((sub_addrs[j % len(sub_addrs)], topics))
        sub_groups = [subs[w :: a.sub_workers] for w in range(min(a.sub_workers, len(subs)))]
        pubs = [(i, pub_addrs[i % len(pub_addrs)], topic_name(i % sc.topics)) for i in range(sc.publishers)]
        n_pw = max(1, min(a.pub_workers, len(pubs)))
        pub_groups = [pubs[w::n_pw] for w in range(n_pw)]
        procs: list[asyncio.subprocess.Process] = []
        try:
            # Far enough ahead for every worker to connect its clients first (checked below).
            start_at = time.perf_counter() + a.connect_time
            end_at = start_at + a.duration
            base = {
                "system": system, "hz": sc.hz, "start_at": start_at, "end_at": end_at, "grace": grace,
                "iterate": a.sub_iterate,
            }  # fmt: skip
            sub_outs = []
            for g in sub_groups:
                p, out = await self.spawn(dict(base, role="sub", subs=g))
                procs.append(p)
                sub_outs.append(out)
            for p in procs:
                assert p.stdout is not None
                async with asyncio.timeout(a.connect_time):
                    await p.stdout.readline()
            pub_outs = []
            pub_procs = []
            for w, g in enumerate(pub_groups):
                p, out = await self.spawn(dict(base, role="pub", pubs=g, seed=w))
                procs.append(p)
                pub_procs.append(p)
                pub_outs.append(out)
            for p in pub_procs:
                assert p.stdout is not None
                async with asyncio.timeout(a.connect_time + 30):
                    await p.stdout.readline()
            if time.perf_counter() > start_at:
                res.notes.append(f"clients connected {time.perf_counter() - start_at:.1f} s after the start")
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            res.load = (os.getloadavg()[0], 0.0)
            cpu0, t0 = cpu_seconds(*pids), time.perf_counter()
            await asyncio.sleep(max(0.0, end_at - time.perf_counter()))
            cpu1, t1 = cpu_seconds(*pids), time.perf_counter()
            res.load = (res.load[0], os.getloadavg()[0])
            async with asyncio.timeout(grace + 120):
                await asyncio.gather(*(p.wait() for p in procs))
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        pres = [json.loads(o.read_text()) for o in pub_outs]
        sres = [json.loads(o.read_text()) for o in sub_outs]
        res.nominal = int(sc.publishers * sc.hz * a.duration)
        res.offered = sum(r["sent"] for r in pres)
        res.acked = sum(r["acked"] for r in pres)
        res.expected = res.offered * (sc.subscribers if sc.fanout else 1)
        res.got = sum(r["got"] for r in sres)
        res.lat = sorted(x for r in sres for x in r["lat"])
        res.broker_cpu, res.window = cpu1 - cpu0, t1 - t0
        late = max(r["late"] for r in pres)
        if late > 0.1:
            res.notes.append(f"publishers up to {late:.2f} s behind schedule")
        n_err = sum(r["n_errors"] for r in pres)
        if n_err:
            res.notes.append(f"{n_err} publishers failed: {pres[0]['errors'][:1]}")
        self.results.append(res)
        print("  " + fmt(res), flush=True)

    async def sedax(self, scenarios: list[Scenario]) -> None:
        from cli.cluster import LocalCluster

        cluster = LocalCluster(
            BROKERS, seed=self.args.seed, resilience=2, state_dir=self.workdir / "sedax",
            broker_args=tuple(self.args.broker_args.split()),
        )  # fmt: skip
        async with cluster:
            await cluster.wait_converged(60.0)
            pids = [b.pid for b in cluster.nodes]
            addrs = [str(b.listen) for b in cluster.nodes]
            print(f"SeDAX: {BROKERS} brokers, resilience 2, pids {pids}", flush=True)
            for sc in scenarios:
                subs = addrs if sc.fanout else [addrs[i] for i in SUB_BROKERS]
                await self.run("sedax", sc, addrs, subs, pids)

    async def mosquitto(self, scenarios: list[Scenario]) -> None:
        import shutil

        exe = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
        if exe is None:
            print("mosquitto not installed (apt-get install -y mosquitto): no reference rows", file=sys.stderr)
            return
        port = bp.free_port()
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_connections -1\nlog_dest stderr\n"
        )
        proc = bp.start_server([exe, "-c", str(conf)], self.workdir / "mosquitto.log")
        try:
            await bp.wait_port(port, proc)
            addr = f"127.0.0.1:{port}"
            for sc in scenarios:
                await self.run("mqtt", sc, [addr], [addr], [proc.pid])
        finally:
            bp.stop_proc(proc)


_LABELS: Final = {"sedax": "SeDAX", "mqtt": "Mosquitto"}


def fmt(r: Result) -> str:
    lat = r.lat
    cpu_pct = r.broker_cpu / r.window * 100 if r.window else 0.0
    per_msg = r.broker_cpu / max(1, r.got) * 1e6
    return (
        f"{_LABELS.get(r.system, r.system):9} {r.scenario.name:42} p50 {pct(lat, 0.5) * 1e3:7.2f}"
        f"  p99 {pct(lat, 0.99) * 1e3:7.2f}  p99.9 {pct(lat, 0.999) * 1e3:7.2f}"
        f"  max {(lat[-1] if lat else 0) * 1e3:7.1f} ms"
        f"  delivered {r.got}/{r.expected} (offered {r.offered} of nominal {r.nominal})  broker CPU {cpu_pct:.0f}% "
        f"({per_msg:.0f} µs/delivery)  load {r.load[0]:.1f}->{r.load[1]:.1f}"
        + (f"  [{'; '.join(r.notes)}]" if r.notes else "")
    )


_TABLE_NAMES: Final = {"sedax": "SeDAX (9 brokers, level 2)", "mqtt": "Mosquitto (1 broker)"}


def table(results: list[Result], names: Mapping[str, str] = _TABLE_NAMES) -> list[str]:
    """The results table's lines (bench_floor.py's fan-in rows use it too); names: system -> row label."""
    out = [
        "| system | scenario | p50 ms | p99 ms | p99.9 ms | max ms | delivered / expected | offered / nominal | "
        "broker CPU (% of a core) | broker CPU µs per delivery | load 1 min | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lat = r.lat
        out.append(
            f"| {names.get(r.system, r.system)} | "
            f"{r.scenario.name} | {pct(lat, 0.5) * 1e3:.2f} | {pct(lat, 0.99) * 1e3:.2f} | "
            f"{pct(lat, 0.999) * 1e3:.2f} | "
            f"{(lat[-1] if lat else float('nan')) * 1e3:.1f} | {r.got:,} / {r.expected:,} | "
            f"{r.offered:,} / {r.nominal:,} | "
            f"{(r.broker_cpu / r.window * 100 if r.window else 0):.0f} | {r.broker_cpu / max(1, r.got) * 1e6:.0f} | "
            f"{r.load[0]:.1f}→{r.load[1]:.1f} | {'; '.join(r.notes)} |"
        )
    return out


def markdown(d: Driver, command: str, up: tuple[str, str], code: str) -> str:
    out = [
        "## Fan-in and fan-out results",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {code}.",
        "",
        f"Load: `{up[0]}` at the start, `{up[1]}` at the end (2 cores shared with other engineers' runs).",
        "",
    ]
    out += table(d.results)
    return "\n".join(out) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sedax-bench-fanin-"))
    command = ".venv/bin/python " + " ".join(["benchmarks/bench_fanin.py", *sys.argv[1:]])
    up0, code = uptime(), code_state()
    print(f"{up0}\nlogs in {workdir}", flush=True)
    d = Driver(args, workdir)
    scenarios = [SCENARIOS[s] for s in args.scenarios.split(",")]
    if not args.no_mosquitto:
        await d.mosquitto(scenarios)
    await d.sedax(scenarios)
    report = markdown(d, command, (up0, uptime()), code)
    print()
    print(report)
    if args.out:
        write_section(Path(args.out), RESULTS_MARK, report, "Latency benchmark")
        print(f"wrote {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default="fanin50,fanin1000,fanout100", help=f"subset of {','.join(SCENARIOS)}")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of publishing per scenario (default 10)")
    p.add_argument("--connect-time", type=float, default=30.0, help="seconds allowed to connect every client")
    p.add_argument("--pub-workers", type=int, default=2, help="publisher processes (default 2)")
    p.add_argument("--sub-workers", type=int, default=1, help="subscriber processes (default 1)")
    p.add_argument("--seed", type=int, default=1, help="the brokers' coordinates (default 1)")
    p.add_argument("--broker-args", default=bp.SEDAX_BROKER_ARGS, help="SeDAX broker flags")
    p.add_argument("--no-mosquitto", action="store_true", help="SeDAX only")
    add_sub_iterate(p)
    p.add_argument("--out", help="write the markdown report into this file (its own section)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ["SEDAX_INSECURE"] = "1"  # plain TCP, as Mosquitto
    if args.worker:
        return worker_main(args.worker)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
