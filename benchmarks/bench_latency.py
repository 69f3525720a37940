"""Latency benchmark with a per-stage breakdown (not a test): where a message's time goes, publish -> deliver.

    .venv/bin/python benchmarks/bench_latency.py [--rates 5000,10000] [--duration 3] [--out docs/benchmarks-latency.md]

One publisher and one subscriber process (benchmarks/bench_pubsub.py's discipline: a Python asyncio client
under uvloop each, 100-byte payloads, the publisher paced at a fixed rate, by default each message on time
with the sub-millisecond part of the wait in nanosleep: `--pace`, bench_pubsub.PACES), for:

* Mosquitto (publish QoS 1, subscription QoS 0): the reference, measured in the same run;
* SeDAX resilience 1, 0 hops (one broker), with the client's batching and with one PUBLISH per message;
* SeDAX resilience 2, 0 hops and 3 hops (four brokers on a line through h(t), so the overlay is a chain and
  broker k is k hops from the primary, broker 0; broker 1 is the secondary).

Every payload starts with a trace stamp (net/trace.py: magic + the publisher's perf_counter()).  The SeDAX
brokers and both workers run with SEDAX_TRACE=DIR, so each records, per stamped message, when it read it,
forwarded it, originated or received a routed message carrying it, and wrote it.  After a configuration the
brokers are stopped (they write their records at exit) and the records of all processes are joined by the
stamp: each message's events in time order give its path, and the time between consecutive events is the
stage breakdown (p50/p99 per stage over the messages that took the most common path).  Publish -> deliver is
the subscriber's clock on arrival minus the stamp; publish -> ACK the publisher's, when the ACK resolves the
publish's future.  Tracing costs a `bytes.find` per frame; `--no-trace` runs without it (the figures to quote
against Mosquitto; the breakdown is for finding where the time goes).

Both subscribers take each message in a function called as it is read: the Mosquitto one through its callback,
the SeDAX one through `subscribe(..., on_message=...)`.  Rounds 1-8 iterated the SeDAX subscription with
`async for` (a task woken per message); `--sub-iterate` runs that subscriber again.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

_ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

import bench_pubsub as bp  # noqa: E402 - after the path set-up above
from harness import add_sub_iterate, code_state, cpu_seconds, pct, sedax_consume, spawn_worker, uptime, write_section  # noqa: E402

from net.trace import MAGIC, STAMP_SIZE, stamp  # noqa: E402

PAYLOAD_SIZE: Final = 100
_TAIL: Final = struct.Struct("<BI")  # after the stamp: flag (1 = warm-up), index
WARMUP: Final = 500
TOPIC: Final = "bench/latency/t1"
READY_TIMEOUT: Final = 30.0
RESULTS_MARK: Final = "<!-- bench_latency results -->"


def payload(flag: int, index: int, t: float) -> bytes:
    return (stamp(t) + _TAIL.pack(flag, index)).ljust(PAYLOAD_SIZE, b"x")


def schedstat(pid: int | str = "self") -> tuple[int, int, int]:
    """/proc/PID/schedstat: ns on a CPU, ns waiting on a run queue (runnable, no core free), timeslices."""
    try:
        run, wait, slices = Path(f"/proc/{pid}/schedstat").read_text().split()[:3]
    except (OSError, ValueError):
        return (0, 0, 0)
    return int(run), int(wait), int(slices)


def sched_delta(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return (b[0] - a[0], b[1] - a[1], b[2] - a[2])


# ================================================================================================= workers


async def sub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    n = spec["count"]
    t0s = array("d")
    rx = array("d")
    done = asyncio.Event()
    perf = time.perf_counter

    def sink(p: bytes) -> None:
        now = perf()
        if p[STAMP_SIZE]:  # warm-up
            return
        t0s.append(struct.unpack_from("<d", p, len(MAGIC))[0])
        rx.append(now)
        if len(rx) >= n:
            done.set()

    async def wait() -> None:
        seen = -1
        while not done.is_set() and len(rx) != seen:
            seen = len(rx)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(bp.IDLE_TIMEOUT):
                    await done.wait()

    cpu0 = time.process_time()
    sched0 = schedstat()
    if spec["system"] == "sedax":
        from client.client import Client

        async with Client([spec["addr"]], client_id=f"lat-sub-{os.getpid()}") as c:
            await sedax_consume(c, spec["topic"], sink, bp.ready, wait, iterate=spec["iterate"])
    else:
        from peers import MqttClient

        host, port = spec["addr"].rsplit(":", 1)
        mq = await MqttClient.connect(host, int(port), f"lat-sub-{os.getpid()}")
        try:
            await mq.subscribe(spec["topic"], 0, sink)
            bp.ready()
            await wait()
        finally:
            await mq.close()
    sched = sched_delta(sched0, schedstat())
    return {"t0": list(t0s), "rx": list(rx), "cpu": time.process_time() - cpu0, "sched": sched}


async def pub_worker(spec: dict[str, Any]) -> dict[str, Any]:
    host, port = spec["addr"].rsplit(":", 1)
    perf = time.perf_counter
    acks: dict[float, float] = {}
    if spec["system"] == "sedax":
        from client.client import Client

        client = Client([spec["addr"]], client_id=f"lat-pub-{os.getpid()}", batch_publishes=not spec["unbatched"])
        await client.connect()

        async def publish(p: bytes, t: float, measured: bool) -> None:
            fut = await client.publish_nowait(spec["topic"], p)
            if measured:
                fut.add_done_callback(lambda _f, t=t: acks.__setitem__(t, perf()))

        flush, close = client.flush, client.aclose
    else:
        from peers import MqttClient, mqtt_topic

        mq = await MqttClient.connect(host, int(port), f"lat-pub-{os.getpid()}")
        field_ = mqtt_topic(spec["topic"])

        async def publish(p: bytes, t: float, measured: bool) -> None:
            await mq.publish(field_, p)

        flush, close = mq.flush, mq.close
    try:
        for i in range(WARMUP):
            await publish(payload(1, i, 0.0), 0.0, False)
            if i % 50 == 49:
                await asyncio.sleep(0.01)
        async with asyncio.timeout(30.0):
            await flush()
        n, rate = spec["count"], spec["rate"]
        cpu0 = time.process_time()
        sched0 = schedstat()
        late = array("d")  # each message's send time minus its intended time t_start + i / rate
        bursts: collections.Counter[int] = collections.Counter()  # messages sent per wake-up
        t_start = perf()
        i = 0
        while i < n:
            due = min(n, int((perf() - t_start) * rate) + 1)
            bursts[due - i] += 1
            while i < due:
                t = perf()
                late.append(t - (t_start + i / rate))
                # The stamp is the actual send time (as for Mosquitto): lateness of the pacing is reported apart.
                await publish(payload(0, i, t), t, True)
                i += 1
            await bp.pace(spec["pace"], t_start + i / rate)
        offered = n / (perf() - t_start)
        async with asyncio.timeout(60.0):
            await flush()
        cpu = time.process_time() - cpu0
        sched = sched_delta(sched0, schedstat())
    finally:
        await close()
    lates = sorted(late)
    return {
        "sent": n, "offered": offered, "cpu": cpu, "acks": [[t, a] for t, a in acks.items()], "sched": sched,
        "late": [pct(lates, 0.5), pct(lates, 0.99)], "bursts": sorted(bursts.items()),
    }  # fmt: skip


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
    fn = sub_worker if spec["role"] == "sub" else pub_worker
    res = uvloop.run(fn(spec))
    # A file, not stdout: the arrays of a run are megabytes, more than a pipe is worth trusting with.
    Path(spec["out"]).write_text(json.dumps(res))
    return 0


# ================================================================================================= driver


@dataclass
class Result:
    system: str
    config: str
    rate: int
    sent: int = 0
    got: int = 0
    offered: float = 0.0
    lat: list[float] = field(default_factory=list)  # publish -> deliver, seconds, sorted
    ack: list[float] = field(default_factory=list)  # publish -> ACK (SeDAX)
    broker_cpu_us: float | None = None  # broker CPU per message over the run (all brokers)
    path: list[str] = field(default_factory=list)  # the most common path's events
    path_share: float = 0.0
    stages: list[tuple[str, float, float, float]] = field(default_factory=list)  # step, p50, p99, mean (s)
    gc: str = ""
    load: tuple[float, float] = (0.0, 0.0)
    sched: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # CPU ms, run-queue wait ms, slices
    notes: list[str] = field(default_factory=list)


class Driver:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.trace_dir = workdir / "trace"
        self.results: list[Result] = []
        self.seq = 0

    async def spawn(self, spec: dict[str, Any], traced: bool) -> asyncio.subprocess.Process:
        self.seq += 1
        err = self.workdir / f"worker-{self.seq}-{spec['role']}.err"
        return await spawn_worker(__file__, spec, err, {"SEDAX_TRACE": str(self.trace_dir) if traced else None})

    async def run_pair(
        self, res: Result, spec: dict[str, Any], sub_addr: str, pub_addr: str, pids: list[int], traced: bool
    ) -> dict[int, str]:
        """One latency run; fills res; returns the workers' pid -> name (for the trace join)."""
        count = int(res.rate * self.args.duration)
        spec = dict(spec, count=count, rate=res.rate, topic=TOPIC)
        outs = {r: str(self.workdir / f"result-{self.seq + 1}-{r}.json") for r in ("sub", "pub")}
        sub = await self.spawn(dict(spec, role="sub", addr=sub_addr, out=outs["sub"]), traced)
        procs = [sub]
        res.load = (os.getloadavg()[0], 0.0)
        try:
            assert sub.stdout is not None
            async with asyncio.timeout(READY_TIMEOUT):
                line = await sub.stdout.readline()
            if json.loads(line or b"{}").get("event") != "ready":
                raise RuntimeError(f"subscriber not ready: {line!r}")
            cpu0 = cpu_seconds(*pids)
            sched0 = {pid: schedstat(pid) for pid in pids}
            pub = await self.spawn(dict(spec, role="pub", addr=pub_addr, out=outs["pub"]), traced)
            procs.append(pub)
            async with asyncio.timeout(count / 1000 + 2 * bp.IDLE_TIMEOUT + 60):
                await asyncio.gather(pub.communicate(), sub.communicate())
            cpu1 = cpu_seconds(*pids)
            sched1 = {pid: schedstat(pid) for pid in pids}
            if pub.returncode or sub.returncode:
                raise RuntimeError(f"worker failed (pub {pub.returncode}, sub {sub.returncode}); see {self.workdir}")
        except BaseException:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
            raise
        pr, sr = (json.loads(Path(outs[r]).read_text()) for r in ("pub", "sub"))  # noqa: ASYNC240 - written, closed
        res.load = (res.load[0], os.getloadavg()[0])
        res.sent, res.got, res.offered = pr["sent"], len(sr["rx"]), pr["offered"]
        res.lat = sorted(r - t for t, r in zip(sr["t0"], sr["rx"], strict=True))
        res.ack = sorted(a - t for t, a in pr["acks"])
        res.broker_cpu_us = (cpu1 - cpu0) / max(1, res.sent) * 1e6
        if res.got < res.sent:
            res.notes.append(f"{res.got} of {res.sent} delivered")
        if res.offered < 0.95 * res.rate:
            res.notes.append(f"publisher reached {res.offered:.0f} msg/s")
        # Waiting for a core: each process's run-queue time over the run (schedstat's second field).
        waits = [(f"b{i}", sched_delta(sched0[pid], sched1[pid])) for i, pid in enumerate(pids)]
        waits += [("pub", tuple(pr["sched"])), ("sub", tuple(sr["sched"]))]
        res.sched = {name: (w[0] / 1e6, w[1] / 1e6, w[2]) for name, w in waits}  # type: ignore[misc]
        res.notes.append(
            "run-queue wait ms / CPU ms / slices: "
            + ", ".join(f"{k} {w:.1f} / {r:.0f} / {n}" for k, (r, w, n) in res.sched.items())
        )
        res.notes.append(
            f"pacing: late p50 {pr['late'][0] * 1e3:.2f} p99 {pr['late'][1] * 1e3:.2f} ms, "
            f"messages per wake-up {', '.join(f'{k}:{v}' for k, v in pr['bursts'][:8])}"
        )
        self._last = (sr, pr)
        return {pub.pid: "publisher", sub.pid: "subscriber"}

    # ------------------------------------------------------------------------------------------- peers

    async def mosquitto(self) -> None:
        exe = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
        if exe is None:
            print("mosquitto not installed (apt-get install -y mosquitto): no reference row", file=sys.stderr)
            return
        port = bp.free_port()
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n")
        proc = bp.start_server([exe, "-c", str(conf)], self.workdir / "mosquitto.log")
        try:
            await bp.wait_port(port, proc)
            addr = f"127.0.0.1:{port}"
            for rate in self.args.rate_list:
                res = Result("Mosquitto", "pub QoS 1, sub QoS 0", rate)
                spec = {"system": "mqtt", "unbatched": True, "pace": self.args.pace}
                await self.run_pair(res, spec, addr, addr, [proc.pid], False)
                self.report(res)
        finally:
            bp.stop_proc(proc)

    async def sedax(self, level: int, hops: list[int], unbatched_too: bool) -> None:
        from cli.cluster import LocalCluster

        traced = not self.args.no_trace
        if traced:
            os.environ["SEDAX_TRACE"] = str(self.trace_dir)
        coords = bp.line_coords(TOPIC, max(max(hops) + 1, level))
        pending: list[tuple[Result, dict[int, str], dict[float, float]]] = []
        try:
            cluster = LocalCluster(
                len(coords), coords=coords, resilience=level, state_dir=self.workdir / f"sedax-r{level}",
                broker_args=tuple(self.args.broker_args.split()),
            )  # fmt: skip
            async with cluster:
                await cluster.wait_converged(60.0)
                pids = [b.pid for b in cluster.nodes]
                primary = await bp.check_layout(cluster, TOPIC, hops)
                names = {b.pid: f"b{b.index}" for b in cluster.nodes}
                runs = [(h, False) for h in hops] + ([(0, True)] if unbatched_too else [])
                for h, unbatched in runs:
                    for rate in self.args.rate_list:
                        config = f"resilience {level}, {h} hop{'s' if h != 1 else ''}"
                        config += ", one PUBLISH per message" if unbatched else ""
                        res = Result("SeDAX", config, rate)
                        spec = {
                            "system": "sedax", "unbatched": unbatched, "pace": self.args.pace,
                            "iterate": self.args.sub_iterate,
                        }  # fmt: skip
                        batches0 = await replication_counters(primary)
                        workers = await self.run_pair(res, spec, primary, cluster.nodes[h].listen, pids, traced)
                        if level >= 2:
                            # How the primary replicated the run: batches, and how many went while an earlier
                            # one was unconfirmed (pipelined; none before REPLICATION_WINDOW existed).
                            (b0, q0), (b1, q1) = batches0, await replication_counters(primary)
                            res.notes.append(f"{b1 - b0} REPLICATE batches, {q1 - q0} pipelined")
                        sr = self._last[0]
                        pending.append((res, {**names, **workers}, dict(zip(sr["t0"], sr["rx"], strict=True))))
                        self.report(res)
        finally:
            os.environ.pop("SEDAX_TRACE", None)
        if traced:
            records = load_traces(self.trace_dir)
            for res, names, arrivals in pending:
                breakdown(res, records, names, arrivals)
                self.print_breakdown(res)
            for f in self.trace_dir.glob("trace-*.jsonl"):
                f.unlink()

    # ------------------------------------------------------------------------------------------ output

    def report(self, res: Result) -> None:
        self.results.append(res)
        print("  " + fmt(res), flush=True)

    def print_breakdown(self, res: Result) -> None:
        if not res.stages:
            return
        print(f"  breakdown {res.config} at {res.rate} msg/s ({res.path_share:.0%} of messages on this path):")
        for step, p50, p99, mean in res.stages:
            print(f"    {step:55} p50 {p50 * 1e3:6.3f}  p99 {p99 * 1e3:6.3f}  mean {mean * 1e3:6.3f} ms")
        if res.gc:
            print(f"    {res.gc}")


def fmt(r: Result) -> str:
    lat, ack = r.lat, r.ack
    return (
        f"{r.system:9} {r.config:45} {r.rate:>6} msg/s  p50 {pct(lat, 0.5) * 1e3:6.3f}  p99 {pct(lat, 0.99) * 1e3:6.3f}"
        f"  p99.9 {pct(lat, 0.999) * 1e3:6.3f}  max {(lat[-1] if lat else float('nan')) * 1e3:6.2f} ms"
        + (f"  ack p50 {pct(ack, 0.5) * 1e3:.3f} p99 {pct(ack, 0.99) * 1e3:.3f}" if ack else "")
        + f"  broker CPU {r.broker_cpu_us or 0:.1f} µs/msg  {r.got}/{r.sent}  load {r.load[0]:.1f}->{r.load[1]:.1f}"
        + (f"  [{'; '.join(r.notes)}]" if r.notes else "")
    )


def load_traces(d: Path) -> dict[int, list[tuple[float, str, float]]]:
    """pid -> that process's trace records."""
    out: dict[int, list[tuple[float, str, float]]] = {}
    for f in d.glob("trace-*.jsonl"):
        pid = int(f.stem.split("-")[1])
        out[pid] = [tuple(json.loads(line)) for line in f.read_text().splitlines() if line]  # type: ignore[misc]
    return out


async def replication_counters(addr: str) -> tuple[int, int]:
    """The broker's replication batches sent and those of them pipelined (STATUS counters; 0 where unknown)."""
    from client.admin import AdminClient

    async with await AdminClient.connect(addr, timeout=10.0) as admin:
        counters = (await admin.status()).counters
    return counters.get("replicated_batches", 0), counters.get("replicated_pipelined", 0)


def breakdown(
    res: Result,
    records: dict[int, list[tuple[float, str, float]]],
    names: dict[int, str],
    arrivals: dict[float, float],
) -> None:
    """Join the trace records of one run by message; the most common path and the time between its steps."""
    t0s = arrivals.keys()
    events: dict[float, list[tuple[float, str]]] = collections.defaultdict(list)
    for t0, rx in arrivals.items():
        events[t0].append((rx, "subscriber delivered"))
    gcs: dict[str, list[float]] = collections.defaultdict(list)
    lo, hi = (min(t0s), max(t0s)) if t0s else (0.0, 0.0)
    for pid, recs in records.items():
        name = names.get(pid)
        if name is None:
            continue
        for t0, stage, now in recs:
            if stage.startswith("gc"):
                if lo <= t0 <= hi + 0.5:
                    gcs[f"{name} {stage}"].append(now - t0)
            elif t0 in t0s:
                events[t0].append((now, f"{name} {stage}"))
    paths: collections.Counter[tuple[str, ...]] = collections.Counter()
    chains: dict[float, list[tuple[float, str]]] = {}
    for t0, evs in events.items():
        evs.sort()
        # Up to the delivery: later records of the same message (a hand-off at shutdown) are another story.
        rx = arrivals[t0]
        evs = [e for e in evs if e[0] <= rx]
        chains[t0] = evs
        paths[tuple(label for _, label in evs)] += 1
    if not paths:
        return
    path, count = paths.most_common(1)[0]
    res.path = ["publish", *path]
    res.path_share = count / max(1, len(events))
    steps: list[list[float]] = [[] for _ in path]
    for t0, evs in chains.items():
        if tuple(label for _, label in evs) != path:
            continue
        prev = t0
        for i, (now, _) in enumerate(evs):
            steps[i].append(now - prev)
            prev = now
    labels = ["publish", *path]
    for i, vals in enumerate(steps):
        vals.sort()
        res.stages.append((f"{labels[i]} -> {labels[i + 1]}", pct(vals, 0.5), pct(vals, 0.99), statistics.fmean(vals)))
    res.gc = "GC pauses during the run: " + (
        ", ".join(f"{k} ×{len(v)} max {max(v) * 1e3:.2f} ms" for k, v in sorted(gcs.items())) if gcs else "none"
    )


def table(results: list[Result]) -> list[str]:
    """The results table's lines, p99 against Mosquitto's at the same rate (bench_floor.py's rows use it too)."""
    out = [
        "| system | configuration | msg/s | p50 ms | p99 ms | p99.9 ms | max ms | p99 ÷ Mosquitto | ACK p50 / p99 ms"
        " | broker CPU µs/msg | delivered | load 1 min | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    mosq = {r.rate: r for r in results if r.system == "Mosquitto"}
    for r in results:
        m = mosq.get(r.rate)
        ratio = f"{pct(r.lat, 0.99) / pct(m.lat, 0.99):.1f}" if m and m.lat and r.lat and r is not m else "–"
        ack = f"{pct(r.ack, 0.5) * 1e3:.2f} / {pct(r.ack, 0.99) * 1e3:.2f}" if r.ack else "–"
        out.append(
            f"| {r.system} | {r.config} | {r.rate:,} | {pct(r.lat, 0.5) * 1e3:.2f} | {pct(r.lat, 0.99) * 1e3:.2f} | "
            f"{pct(r.lat, 0.999) * 1e3:.2f} | {(r.lat[-1] if r.lat else float('nan')) * 1e3:.1f} | {ratio} | {ack} | "
            f"{r.broker_cpu_us or 0:.1f} | {r.got}/{r.sent} | {r.load[0]:.1f}→{r.load[1]:.1f} | {'; '.join(r.notes)} |"
        )
    return out


def markdown(d: Driver, command: str, up: tuple[str, str], elapsed: float, code: str) -> str:
    out = [
        "## Results",
        "",
        f"`{command}` — {elapsed:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {code}.",
        "",
        f"Load: `{up[0]}` at the start, `{up[1]}` at the end (2 cores shared with other engineers' runs).",
        "",
        *table(d.results),
    ]
    for r in d.results:
        if not r.stages:
            continue
        out += [
            "",
            f"**{r.config}, {r.rate:,} msg/s** — path of {r.path_share:.0%} of the messages "
            "(bN = broker N, b0 the primary, b1 the secondary):",
            "",
            "| step | p50 ms | p99 ms | mean ms |",
            "|---|---:|---:|---:|",
        ]
        out += [f"| {s} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {mean * 1e3:.3f} |" for s, p50, p99, mean in r.stages]
        if r.gc:
            out += ["", r.gc + "."]
    return "\n".join(out) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="sedax-bench-latency-"))
    command = ".venv/bin/python " + " ".join(["benchmarks/bench_latency.py", *sys.argv[1:]])
    up0, code = uptime(), code_state()
    print(f"{up0}\nlogs in {workdir}", flush=True)
    t0 = time.monotonic()
    d = Driver(args, workdir)
    only = set(args.only.split(","))
    if "mosquitto" in only:
        await d.mosquitto()
    if "l1" in only:
        await d.sedax(1, [0], unbatched_too=True)
    if "l2" in only:
        await d.sedax(2, sorted({0, args.far_hops}), unbatched_too=False)
    up1 = uptime()
    report = markdown(d, command, (up0, up1), time.monotonic() - t0, code)
    print()
    print(report)
    if args.out:
        write_section(Path(args.out), RESULTS_MARK, report, "Latency benchmark")
        print(f"wrote {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="5000,10000", help="publish rates, msg/s (default 5000,10000)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per run (default 3)")
    p.add_argument("--only", default="mosquitto,l1,l2", help="subset of mosquitto,l1,l2 (default all)")
    p.add_argument("--far-hops", type=int, default=3, help="hops of the far access broker at level 2 (default 3)")
    p.add_argument("--broker-args", default=bp.SEDAX_BROKER_ARGS, help="SeDAX broker flags")
    p.add_argument("--pace", choices=bp.PACES, default="sleep", help=bp.PACE_HELP)
    p.add_argument("--no-trace", action="store_true", help="run without SEDAX_TRACE (no breakdown)")
    add_sub_iterate(p)
    p.add_argument("--out", help="write the markdown report here (the part after the results marker)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ["SEDAX_INSECURE"] = "1"  # plain TCP, as the peers (bench_pubsub.py does the same)
    if args.worker:
        return worker_main(args.worker)
    args.rate_list = [int(v) for v in args.rates.split(",")]
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
