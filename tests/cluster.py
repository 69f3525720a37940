"""Helpers for the broker tests: condition polling with a deadline, raw connections, expected routes, a relay."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

from cli.cluster import BrokerProcess, LocalCluster
from client.admin import AdminClient
from client.client import Client, ClientError
from net.credentials import Credentials
from overlay.geometry import closest, geohash
from overlay.protocol import ControlFrame, FrameDecoder, Message, encode_control, parse_address

POLL = 0.02


async def wait_for(cond: Callable[[], bool | Awaitable[bool]], within: float, what: str = "condition") -> float:
    """Poll cond until it is true; fail the test after `within` seconds.  Returns the seconds it took."""
    start = time.monotonic()
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"{what} not reached within {within} s")
        await asyncio.sleep(POLL)


def log_size(bp: BrokerProcess) -> int:
    """Current length of the broker's stderr log (to look only at what a test causes)."""
    try:
        return Path(bp.err_path).stat().st_size
    except OSError:
        return 0


def log_has(bp: BrokerProcess, text: str, since: int = 0) -> bool:
    """True if the broker's stderr log contains text after byte offset since."""
    try:
        with Path(bp.err_path).open("rb") as f:
            f.seek(since)
            return text in f.read().decode(errors="replace")
    except OSError:
        return False


async def hup(bp: BrokerProcess, expect: str) -> int:
    """SIGHUP the broker and wait for its log line about it; returns where its log stood before."""
    since = log_size(bp)
    os.kill(bp.pid, signal.SIGHUP)
    await wait_for(lambda: log_has(bp, expect, since), 15.0, f"{expect!r} in {bp.node_id}'s log")
    assert bp.alive, bp.stderr_tail()
    return since


async def connects(listen: str) -> bool:
    """Whether a new client connection to the broker at listen is admitted (not refused, not failed)."""
    c = Client(listen, reconnect=False)
    try:
        await c.connect()
    except ClientError:
        return False
    finally:
        await c.aclose()
    return True


async def wait_refused(client: Client, topic: str, what: str, within: float = 20.0) -> None:
    """Publish to topic until the broker refuses the client (a ClientError, or no answer in its request_timeout):
    what a client cut off by a reload sees, once its reconnects fail too."""

    async def refused() -> bool:
        try:
            await client.publish(topic, b"probe")
        except (ClientError, TimeoutError):
            return True
        return False

    await wait_for(refused, within, what)


async def raw_connect(bp: BrokerProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to a broker (for hostile-input tests)."""
    host, port = parse_address(bp.listen)
    return await asyncio.open_connection(host, port)


async def read_until_eof(reader: asyncio.StreamReader, within: float) -> bytes:
    """Everything the broker sends until it closes the connection; fails if it stays open past `within` s."""
    chunks = []
    async with asyncio.timeout(within):
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def check_routes(cluster: LocalCluster, n: int, seed: int, credentials: Credentials | None = None) -> list[int]:
    """Probe n random targets from random live brokers; assert each ends at the closest broker.

    Returns the hop counts.
    """
    rng = np.random.default_rng(seed)
    live = cluster.live()
    coords = {bp.node_id: bp.coord for bp in live}
    clients = await asyncio.gather(*(AdminClient.connect(bp.listen, credentials=credentials) for bp in live))
    try:
        targets = [(float(x), float(y)) for x, y in rng.random((n, 2))]
        sources = [int(i) for i in rng.integers(len(live), size=n)]
        replies = await asyncio.gather(*(clients[s].route(t) for s, t in zip(sources, targets, strict=True)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    wrong = []
    for s, t, r in zip(sources, targets, replies, strict=True):
        want = closest(coords, t)[0]
        if r.node.id != want:
            wrong.append(f"{t} from {live[s].node_id}: reached {r.node.id}, closest is {want}")
        assert r.path[0].id == live[s].node_id
        assert r.path[-1].id == r.node.id
        assert r.hops == len(r.path) - 1
    assert not wrong, f"{len(wrong)} of {n} probes ended at the wrong broker:\n" + "\n".join(wrong[:10])
    return [r.hops for r in replies]


def topics_per_broker(coords: dict[str, tuple[float, float]], per: int, prefix: str = "t") -> list[str]:
    """Topic names such that every broker is the closest to the home coordinate of exactly `per` of them."""
    want = dict.fromkeys(coords, per)
    out: list[str] = []
    i = 0
    while any(want.values()):
        topic = f"{prefix}/{i}"
        i += 1
        owner = closest(coords, geohash(topic))[0]
        if want[owner] > 0:
            want[owner] -= 1
            out.append(topic)
    return out


class Relay:
    """A TCP relay of ours in front of a broker, for clients of a plain-TCP cluster (`tls=False`): it passes
    every frame both ways but those `drop(message, upstream)` is true for (upstream: client -> broker), as a
    lossy path or a dying broker does, holds each frame until `hold(message, upstream)` returns, as a slow path
    does, and `cut()` breaks every connection it carries at once."""

    def __init__(
        self,
        target: str,
        drop: Callable[[Message, bool], bool] = lambda m, up: False,
        hold: Callable[[Message, bool], Awaitable[None]] | None = None,
    ) -> None:
        self.target = parse_address(target)
        self.drop = drop
        self.hold = hold  # awaited before a frame passes: the frame (and those behind it) wait meanwhile
        self.address = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._pumps: set[asyncio.Future[Any]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for p in self._pumps:
            p.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    def cut(self) -> None:
        """Close every connection through the relay (both sides see the end of the stream)."""
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]
        self._pumps.add(
            asyncio.gather(
                self._pump(reader, up_writer, True), self._pump(up_reader, writer, False), return_exceptions=True
            )
        )

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
        frames = FrameDecoder()
        while data := await src.read(65536):
            for frame in frames.feed(data):
                assert isinstance(frame, ControlFrame)
                if self.hold is not None:
                    await self.hold(frame.message, up)
                if not self.drop(frame.message, up):
                    dst.write(encode_control(frame.message))
        dst.close()


def brokers_marked(mark: str) -> list[int]:
    """The pids of broker processes started with SEDAX_TEST_MARK=mark in their environment (what a command under
    test left running)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (
                f"SEDAX_TEST_MARK={mark}".encode() in (d / "environ").read_bytes()
                and b"-m\x00broker" in (d / "cmdline").read_bytes()
            ):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids
