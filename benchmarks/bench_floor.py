"""The floor under the latency targets (not a test): SeDAX's processes and frames, and nothing else.

    .venv/bin/python benchmarks/bench_floor.py [--rates 5000,10000] [--duration 2]
        [--fanin fanin50,fanin1000,fanout100] [--fanin-duration 10] [--burn-us 0] [--out docs/benchmarks-latency.md]

bench_latency.py and bench_fanin.py measure SeDAX against Mosquitto.  What part of SeDAX's figures is SeDAX's
own code, and what part the shape of its path: one Python process per broker on the machine's cores, every
frame a process wake-up, a read and a write?  This benchmark runs that shape with the least Python a broker
can do.  "Relays", each a uvloop process with an asyncio Protocol per connection:

* speak just enough MQTT 3.1.1 (CONNECT, SUBSCRIBE, PUBLISH QoS 1 -> PUBACK, QoS 0 out, PINGREQ) for the MQTT
  workers of bench_latency.py and bench_fanin.py, the ones that measure Mosquitto;
* forward a frame that is not for them by its one-byte destination header, without decoding it (as SeDAX's
  forwarding hops read only the ROUTED header), greedily over their neighbours;
* hold a topic at one relay (a list append), copy it to a second and wait for the confirmation at level 2,
  then deliver to the subscribers' relays and acknowledge to the publisher's; msgpack bodies, decoded and
  encoded once at each end, as SeDAX's;
* write what a loop turn produced for one connection in one write, as SeDAX does.

Nothing else: no sequence numbers, ACLs, retention, metrics, heartbeats or re-sends.  Rows, with the same
workers and pacing as the SeDAX benchmarks and Mosquitto measured in the same run:

* bench_latency's layout (`--rates`): relays on a line, the topic at relay 0 and its copy at relay 1, the
  subscriber at relay 0 and the publisher 0 or `--far-hops` hops away; levels 1 and 2;
* bench_fanin's scenarios (`--fanin`): nine relays at random coordinates (`--seed`) with Delaunay neighbours,
  each topic at the relay closest to h(t) and copied to the next closest, level 2, the same clients and
  subscriber placement.

`--burn-us N` makes every relay spend N µs of CPU on each message it handles (not on frames it only
forwards): what added CPU per message costs in latency on this machine.  What SeDAX adds above the floor is
its own code; the floor is what the machine gives any broker built as one Python process per node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final, cast

_ROOT: Final = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))

import bench_fanin as bf  # noqa: E402 - after the path set-up above
import bench_latency as bl  # noqa: E402
import bench_pubsub as bp  # noqa: E402
from harness import code_state, uptime, write_section  # noqa: E402

RESULTS_MARK: Final = "<!-- bench_floor results -->"
FLOOR: Final = "Python relay floor"
_LINK: Final = struct.Struct("<IB")  # frame length (after these 5 bytes), destination relay
# To the primary; to the secondary; its confirmation; the ACK to the access relay; a delivery to a subscriber's
# relay; a subscription to the primary; the first frame on a link (the dialler's index).
REQ, REP, REPD, ANS, DLV, SUB, HELLO = 0, 1, 2, 3, 4, 5, 255


# ================================================================================================= a relay


class Relay:
    """One node; see the module docstring.  Frames between relays: `_LINK` (length, destination) + msgpack."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import msgpack

        from overlay.geometry import closest, geohash, greedy_next_hop

        self.index, self.level = spec["index"], spec["level"]
        self.burn = spec.get("burn_us", 0) / 1e6  # --burn-us: CPU spent per message handled (see main())
        coords = {i: tuple(c) for i, c in enumerate(spec["coords"])}
        self.links: dict[int, asyncio.Transport] = {}
        # Greedy forwarding over the given neighbours, worked out once per destination.
        mine = {j: coords[j] for j in spec["neighbours"]}
        self.next_hop = {d: greedy_next_hop(self.index, coords[self.index], mine, coords[d]) for d in coords}
        self.line = spec["placement"] == "line"  # every topic at relay 0, its copy at relay 1 (bench_latency)
        self._closest, self._geohash, self._coords = closest, geohash, coords
        self.holders: dict[str, tuple[int, int]] = {}
        self.sessions: dict[int, asyncio.Transport] = {}
        self.subs: dict[str, list[asyncio.Transport]] = {}  # local subscribers
        self.sub_relays: dict[str, set[int]] = {}  # at the primary: relays with subscribers
        self.stored: dict[str, list[bytes]] = {}
        self.seq = 0
        self.pending: dict[int, tuple[int, int, int, str, bytes]] = {}  # seq -> origin, session, pid, topic, payload
        self.pack, self.unpack = msgpack.packb, msgpack.unpackb
        self.next_session = 0
        # What each connection is to be sent, written once at the end of the loop turn (as SeDAX's links and
        # client connections do): one system call per connection and turn, not one per frame.
        self.out: dict[asyncio.Transport, list[bytes]] = {}
        self.call_soon = asyncio.get_running_loop().call_soon

    def write(self, t: asyncio.Transport, data: bytes) -> None:
        out = self.out
        if not out:
            self.call_soon(self.flush)
        parts = out.get(t)
        if parts is None:
            out[t] = [data]
        else:
            parts.append(data)

    def flush(self) -> None:
        out, self.out = self.out, {}
        for t, parts in out.items():
            if not t.is_closing():
                t.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def _burn(self) -> None:
        end = time.perf_counter() + self.burn
        while time.perf_counter() < end:
            pass

    def holders_of(self, topic: str) -> tuple[int, int]:
        h = self.holders.get(topic)
        if h is None:
            if self.line:
                h = (0, 1)
            else:
                a, b = self._closest(self._coords, self._geohash(topic), 2)
                h = (a, b)
            self.holders[topic] = h
        return h

    # ---- frames between relays
    def send(self, dest: int, body: list[Any]) -> None:
        data = self.pack(body)
        self.write(self.links[self.next_hop[dest]], _LINK.pack(len(data), dest) + data)  # type: ignore[index]

    def link_frame(self, dest: int, frame: bytes, body: memoryview) -> None:
        if dest != self.index:
            self.write(self.links[self.next_hop[dest]], frame)  # type: ignore[index]  # forwarding: the header only
            return
        if self.burn:
            self._burn()
        m = self.unpack(body)
        kind = m[0]
        if kind == REQ:
            self.request(*m[1:])
        elif kind == REP:
            self.stored.setdefault(m[5], []).append(m[6])
            self.send(m[2], [REPD, m[1]])
        elif kind == REPD:
            self.commit(*self.pending.pop(m[1]))
        elif kind == ANS:
            self.acked(m[1], m[2])
        elif kind == DLV:
            self.deliver(m[1], m[2])
        elif kind == SUB:
            self.sub_relays.setdefault(m[2], set()).add(m[1])

    # ---- the primary
    def request(self, origin: int, session: int, pid: int, topic: str, payload: bytes) -> None:
        self.stored.setdefault(topic, []).append(payload)
        if self.level == 1:
            self.commit(origin, session, pid, topic, payload)
            return
        self.seq += 1
        self.pending[self.seq] = (origin, session, pid, topic, payload)
        self.send(self.holders_of(topic)[1], [REP, self.seq, self.index, session, pid, topic, payload])

    def commit(self, origin: int, session: int, pid: int, topic: str, payload: bytes) -> None:
        for r in self.sub_relays.get(topic, ()):
            if r == self.index:
                self.deliver(topic, payload)
            else:
                self.send(r, [DLV, topic, payload])
        if origin == self.index:
            self.acked(session, pid)
        else:
            self.send(origin, [ANS, session, pid])

    # ---- the access side (MQTT)
    def deliver(self, topic: str, payload: bytes) -> None:
        t = topic.encode()
        out = bytes([0x30]) + _varint(2 + len(t) + len(payload)) + len(t).to_bytes(2, "big") + t + payload
        for s in self.subs.get(topic, ()):
            self.write(s, out)

    def acked(self, session: int, pid: int) -> None:
        t = self.sessions.get(session)
        if t is not None:
            self.write(t, b"\x40\x02" + pid.to_bytes(2, "big"))

    def mqtt_packet(self, session: int, t: asyncio.Transport, first: int, body: bytes) -> None:
        kind = first & 0xF0
        if kind == 0x30:  # PUBLISH, QoS 1
            if self.burn:
                self._burn()
            n = int.from_bytes(body[:2], "big")
            topic = body[2 : 2 + n].decode()
            pid = int.from_bytes(body[2 + n : 4 + n], "big")
            payload = body[4 + n :]
            primary = self.holders_of(topic)[0]
            if primary == self.index:
                self.request(self.index, session, pid, topic, payload)
            else:
                self.send(primary, [REQ, self.index, session, pid, topic, payload])
        elif kind == 0x10:  # CONNECT
            t.write(b"\x20\x02\x00\x00")
        elif kind == 0x80:  # SUBSCRIBE (one topic)
            n = int.from_bytes(body[2:4], "big")
            topic = body[4 : 4 + n].decode()
            self.subs.setdefault(topic, []).append(t)
            primary = self.holders_of(topic)[0]
            if primary == self.index:
                self.sub_relays.setdefault(topic, set()).add(self.index)
            else:
                self.send(primary, [SUB, self.index, topic])
            t.write(b"\x90\x03" + body[:2] + b"\x00")
        elif kind == 0xC0:  # PINGREQ
            t.write(b"\xd0\x00")
        elif kind == 0xE0:  # DISCONNECT
            t.close()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _nodelay(transport: asyncio.BaseTransport) -> None:
    transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LinkProtocol(asyncio.Protocol):
    """A link between two relays: the dialling side first sends its index (destination HELLO)."""

    def __init__(self, relay: Relay, peer: int | None = None) -> None:
        self.relay, self.peer, self.buf = relay, peer, bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)
        self.t = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        if self.peer is not None:
            self.relay.links[self.peer] = self.t
            self.t.write(_LINK.pack(1, HELLO) + bytes([self.relay.index]))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, n = 0, len(buf)
        view = memoryview(buf)
        while n - pos >= 5:
            size, dest = _LINK.unpack_from(buf, pos)
            end = pos + 5 + size
            if end > n:
                break
            if dest == HELLO:
                self.peer = buf[pos + 5]
                self.relay.links[self.peer] = self.t
            else:
                self.relay.link_frame(dest, bytes(view[pos:end]), view[pos + 5 : end])
            pos = end
        view.release()
        del buf[:pos]


class MqttProtocol(asyncio.Protocol):
    def __init__(self, relay: Relay) -> None:
        self.relay, self.buf = relay, bytearray()
        relay.next_session += 1
        self.session = relay.next_session

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)
        self.t = cast(asyncio.Transport, transport)
        self.relay.sessions[self.session] = self.t

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay.sessions.pop(self.session, None)
        for ts in self.relay.subs.values():
            if self.t in ts:
                ts.remove(self.t)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, n = 0, len(buf)
        while pos + 2 <= n:
            length, shift, i = 0, 0, pos + 1
            while i < n:
                b = buf[i]
                length |= (b & 0x7F) << shift
                shift += 7
                i += 1
                if not b & 0x80:
                    break
            else:
                break
            if i + length > n:
                break
            self.relay.mqtt_packet(self.session, self.t, buf[pos], bytes(buf[i : i + length]))
            pos = i + length
        del buf[:pos]


def _port(server: asyncio.Server) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


async def relay_main(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    r = Relay(spec)
    # Port 0 for both servers (a port picked free beforehand can be taken by the time it is bound); the driver
    # learns them from the ready line and hands the link ports to the relays started after this one.
    ports = {int(k): v for k, v in spec["link_ports"].items()}
    link = await loop.create_server(lambda: LinkProtocol(r), "127.0.0.1", 0)
    mqtt = await loop.create_server(lambda: MqttProtocol(r), "127.0.0.1", 0)
    for j in spec["neighbours"]:
        if j < r.index:  # relays start in index order: the lower one listens already
            await loop.create_connection(lambda j=j: LinkProtocol(r, j), "127.0.0.1", ports[j])
    print(json.dumps({"event": "ready", "link_port": _port(link), "mqtt_port": _port(mqtt)}), flush=True)
    await asyncio.Event().wait()


# ================================================================================================= driver


@contextlib.asynccontextmanager
async def relays(
    coords: list[tuple[float, float]], neighbours: list[set[int]], level: int, placement: str, burn_us: float = 0.0
) -> AsyncIterator[tuple[list[int], list[str]]]:
    """Start one relay per coordinate (in index order: each dials its lower neighbours); yields their pids and
    MQTT addresses, and kills them on exit."""
    link_ports: dict[int, int] = {}
    mqtt_ports: list[int] = []
    procs: list[asyncio.subprocess.Process] = []
    try:
        for i in range(len(coords)):
            spec = {"index": i, "level": level, "coords": coords, "neighbours": sorted(neighbours[i]),
                    "link_ports": link_ports, "placement": placement, "burn_us": burn_us}  # fmt: skip
            p = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--relay", json.dumps(spec), stdout=asyncio.subprocess.PIPE
            )
            procs.append(p)
            assert p.stdout is not None
            async with asyncio.timeout(bl.READY_TIMEOUT):
                line = await p.stdout.readline()
            ready = json.loads(line or b"{}")
            if ready.get("event") != "ready":
                raise RuntimeError(f"relay {i} did not start")
            link_ports[i] = ready["link_port"]
            mqtt_ports.append(ready["mqtt_port"])
        yield [p.pid for p in procs], [f"127.0.0.1:{port}" for port in mqtt_ports]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


class FloorDriver(bl.Driver):
    async def line(self, level: int, hops: list[int]) -> None:
        """bench_latency's shape: relays on a line, the topic at relay 0 (its copy at 1), the subscriber at
        relay 0 and the publisher h hops away."""
        n = max(max(hops) + 1, level)
        coords = [(0.1 + 0.8 * i / max(1, n - 1), 0.5) for i in range(n)]
        neighbours = [{j for j in (i - 1, i + 1) if 0 <= j < n} for i in range(n)]
        async with relays(coords, neighbours, level, "line", self.args.burn_us) as (pids, addrs):
            for h in hops:
                for rate in self.args.rate_list:
                    config = f"resilience {level}, {h} hop{'s' if h != 1 else ''}"
                    config += f", +{self.args.burn_us:g} µs per message handled" if self.args.burn_us else ""
                    res = bl.Result(FLOOR, config, rate)
                    spec = {"system": "mqtt", "unbatched": True, "pace": self.args.pace}
                    await self.run_pair(res, spec, addrs[0], addrs[h], pids, False)
                    self.report(res)


async def fanin(args: argparse.Namespace, workdir: Path) -> list[bf.Result]:
    """bench_fanin's scenarios on nine relays at random coordinates (Delaunay neighbours, greedy forwarding,
    each topic at the relay closest to h(t) and copied to the next closest), level 2, its clients and
    subscriber placement; Mosquitto under the same clients first, as the reference."""
    import numpy as np

    from overlay.geometry import UNIT_SQUARE, delaunay_neighbours

    # (bench_fanin's defaults for the flags its Driver reads: subscribers take their messages by on_message)
    fargs = argparse.Namespace(
        duration=args.fanin_duration, connect_time=30.0, pub_workers=2, sub_workers=1, sub_iterate=False
    )
    d = bf.Driver(fargs, workdir)
    scenarios = [bf.SCENARIOS[s] for s in args.fanin.split(",")]
    if not args.no_mosquitto:
        await d.mosquitto(scenarios)
    points = UNIT_SQUARE.uniform(np.random.default_rng(args.seed), bf.BROKERS)
    coords = [(float(x), float(y)) for x, y in points]
    async with relays(coords, delaunay_neighbours(points), 2, "hash", args.burn_us) as (pids, addrs):
        for sc in scenarios:
            subs = addrs if sc.fanout else [addrs[i] for i in bf.SUB_BROKERS]
            await d.run(FLOOR, sc, addrs, subs, pids)
    return d.results


def markdown(d: FloorDriver, fan: list[bf.Result], command: str, up: tuple[str, str], elapsed: float, code: str) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "## The floor: the same path with the least Python a broker can do",
        "",
        f"`{command}` — {elapsed:.0f} s, {when}, {code}.",
        "",
        f"Load: `{up[0]}` at the start, `{up[1]}` at the end (2 cores).",
        "",
    ]
    if d.results:
        lines += [*bl.table(d.results), ""]
    if fan:
        lines += bf.table(fan, {"mqtt": "Mosquitto (1 broker)", FLOOR: f"{FLOOR} (9 relays, level 2)"})
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> int:
    started = time.monotonic()
    up0, code = uptime(), code_state()
    workdir = Path(tempfile.mkdtemp(prefix="sedax-floor-"))
    print(f"{up0}\nlogs in {workdir}", flush=True)
    d = FloorDriver(args, workdir)
    fan: list[bf.Result] = []
    if args.rates:
        if not args.no_mosquitto:
            print("Mosquitto", flush=True)
            await d.mosquitto()
        print("floor, level 1", flush=True)
        await d.line(1, [0])
        print("floor, level 2", flush=True)
        await d.line(2, [0, args.far_hops])
    if args.fanin:
        print("fan-in", flush=True)
        fan = await fanin(args, workdir)
    command = ".venv/bin/python " + " ".join(["benchmarks/bench_floor.py", *sys.argv[1:]])
    text = markdown(d, fan, command, (up0, uptime()), time.monotonic() - started, code)
    print(text)
    if args.out:
        write_section(Path(args.out), RESULTS_MARK, text, "Latency benchmark")
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--relay":
        import uvloop

        uvloop.run(relay_main(json.loads(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="5000,10000", help="publish rates, msg/s (default 5000,10000)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds per run (default 2)")
    p.add_argument("--far-hops", type=int, default=3, help="hops of the far access relay at level 2 (default 3)")
    p.add_argument("--pace", choices=bp.PACES, default="sleep", help=bp.PACE_HELP)
    p.add_argument("--fanin", default="fanin50,fanin1000,fanout100", help="bench_fanin scenarios ('' for none)")
    p.add_argument("--fanin-duration", type=float, default=10.0, help="seconds per fan-in scenario (default 10)")
    p.add_argument(
        "--burn-us", type=float, default=0.0,
        help="CPU (busy wait) each relay spends per message it handles, to see what added CPU costs in latency",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1, help="the fan-in relays' coordinates (default 1)")
    p.add_argument("--no-mosquitto", action="store_true", help="no Mosquitto reference rows")
    p.add_argument("--out", help="write the markdown report here (the part after the results marker)")
    args = p.parse_args()
    args.rate_list = [int(x) for x in args.rates.split(",") if x]
    os.environ["SEDAX_INSECURE"] = "1"
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
