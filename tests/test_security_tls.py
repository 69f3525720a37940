"""TLS, authentication and topic ACLs on a real TLS cluster (broker processes, certificates from openssl).

The cluster: three brokers with the strict ACL below and a tokens file, and a fourth whose own ACL allows
everything, to show that a topic's holder enforces the ACL whatever the client's access broker let pass.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import struct
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from cluster import check_routes, log_has, log_size, wait_for
from conftest import FAST_ARGS

from cli.cluster import BrokerProcess, LocalCluster
from client.client import Client, ConnectError, RequestFailed
from net import certs
from net.credentials import Credentials
from overlay.protocol import (
    PROTOCOL_VERSION,
    ControlFrame,
    FrameDecoder,
    Hello,
    HelloOk,
    Join,
    Message,
    NodeInfo,
    Ping,
    Pong,
    Refuse,
    RouteProbe,
    Status,
    StatusReq,
    encode_control,
    encode_message,
    encode_routed,
    parse_address,
)
from overlay.pubsub import Fetch, Locate, Publish, Subscribe, Unsubscribe

pytestmark = pytest.mark.slow

ACL = """\
deny      subscribe  *          grid/private/#
allow     publish    meter-*    grid/+/voltage
allow     subscribe  operator   grid/#
allow     subscribe  dashboard  grid/+/voltage
allow     any        fuzzer     fuzz/#
allow     any        tester     #
"""
COORDS = [(0.2, 0.2), (0.8, 0.25), (0.5, 0.85), (0.45, 0.45)]
LENIENT = 3  # index of the broker with the allow-everything ACL


class Tls:
    """The module's cluster and what the tests need to talk to it."""

    def __init__(self, cluster: LocalCluster, token: str) -> None:
        self.cluster = cluster
        self.token = token
        self.ca = str(certs.ca_paths(cluster.certs_dir)[0])

    def creds(self, name: str, role: str = "client") -> Credentials:
        return self.cluster.credentials(name, role)

    def node(self, i: int) -> BrokerProcess:
        return self.cluster.nodes[i]

    async def counters(self, i: int) -> dict[str, int]:
        return dict((await self.cluster.statuses())[self.node(i).node_id].counters)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tls]:
    state = tmp_path_factory.mktemp("tls-cluster")
    (state / "strict.acl").write_text(ACL)
    (state / "lenient.acl").write_text("allow any * #\n")
    token, tokens = certs.add_token(state / "certs", "dashboard")
    args = (*FAST_ARGS, "--acl", str(state / "strict.acl"), "--tokens", str(tokens))
    cluster = LocalCluster(3, coords=COORDS, state_dir=state, tls=True, broker_args=args)

    async def start() -> None:
        await cluster.start()
        bp = cluster.spawn(COORDS[LENIENT], None, "--acl", str(state / "lenient.acl"))
        await cluster.wait_ready(bp)
        await cluster.wait_converged(30.0)

    try:
        asyncio.run(start())
        yield Tls(cluster, token)
    finally:
        asyncio.run(cluster.close())


# ------------------------------------------------------------------------------------------- raw helpers


async def tls_open(bp: BrokerProcess, creds: Credentials) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = parse_address(bp.listen)
    return await asyncio.open_connection(host, port, ssl=creds.ssl_context(), server_hostname=host)


class Raw:
    """A hand-driven protocol peer over TLS: answers PINGs, hands out the other control messages in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.queue: deque[Message] = deque()

    @classmethod
    async def hello(cls, bp: BrokerProcess, creds: Credentials, h: Hello) -> tuple[Raw, Message | None]:
        raw = cls(*await tls_open(bp, creds))
        raw.writer.write(encode_control(h))
        return raw, await raw.next()

    async def next(self, within: float = 5.0) -> Message | None:
        """The next control message other than PING/PONG, or None at the end of the stream."""
        async with asyncio.timeout(within):
            while not self.queue:
                data = await self.reader.read(65536)
                for frame in self.decoder.feed(data):
                    if isinstance(frame, ControlFrame):
                        msg = frame.message
                        if isinstance(msg, Ping):
                            self.writer.write(encode_control(Pong(msg.seq)))
                        elif not isinstance(msg, Pong):
                            self.queue.append(msg)
                if not data:
                    return None
            return self.queue.popleft()

    async def until(self, op: str) -> Message | None:
        while (msg := await self.next()) is not None and msg.op != op:
            pass
        return msg

    async def eof(self, within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while await self.reader.read(65536):
                pass

    def close(self) -> None:
        self.writer.transport.abort()  # at once: a TLS close_notify exchange could outlive the test's loop


# ------------------------------------------------------------------------------------- authentication


async def test_client_without_credentials_cannot_publish(tls: Tls) -> None:
    bp = tls.node(0)
    before = await tls.counters(0)
    for creds, why in [
        (Credentials(ca=tls.ca), "unauthenticated: present a client certificate"),
        (Credentials(ca=tls.ca, token="not-a-token"), "unauthenticated: the token is not valid"),
    ]:
        c = Client(bp.listen, credentials=creds, reconnect=False)
        with pytest.raises(ConnectError, match=why):
            await c.connect()
        await c.aclose()
    # Plain TCP to a TLS broker: the handshake fails before any SeDAX frame is read.
    c = Client(bp.listen, credentials=Credentials(insecure=True), reconnect=False, connect_timeout=3.0)
    with pytest.raises(ConnectError):
        await c.connect()
    await c.aclose()
    after = await tls.counters(0)
    assert after["refused_unauthenticated"] - before["refused_unauthenticated"] == 2
    assert after["tls_handshake_failures"] > before["tls_handshake_failures"]
    # Nothing reached the topic.
    async with Client(bp.listen, credentials=tls.creds("tester")) as t:
        with pytest.raises(RequestFailed, match="unknown_topic"):
            await t.fetch("grid/nocreds/voltage")


async def test_token_authenticates_as_its_name(tls: Tls) -> None:
    async with (
        Client(tls.node(1).listen, credentials=Credentials(ca=tls.ca, token=tls.token)) as dash,
        Client(tls.node(2).listen, credentials=tls.creds("meter-3")) as meter,
    ):
        sub = await dash.subscribe("grid/tok/voltage")  # the ACL names "dashboard", the token's name
        await meter.publish("grid/tok/voltage", b"231.0")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"231.0"
        with pytest.raises(RequestFailed, match="'dashboard' may not publish"):
            await dash.publish("grid/tok/voltage", b"x")


async def test_closing_with_answers_on_the_way_is_not_reported_as_a_lost_connection(
    tls: Tls, caplog: pytest.LogCaptureFixture
) -> None:
    """A client closed while the broker's answers are on the way (ACKs of publishes just sent; a PONG, when a
    user presses Ctrl-C on `sedax pub`) reads them after its TLS close_notify: that is the close it asked for,
    not a lost connection, and it says nothing of it."""
    for _ in range(5):
        c = Client(tls.node(0).listen, credentials=tls.creds("meter-4"))
        await c.connect()
        with caplog.at_level("WARNING", logger="sedax.client"):
            for k in range(200):
                await c.publish_nowait("grid/close/voltage", b"%d" % k)
            await c.aclose(flush_timeout=0)
    lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert lost == []


# ---------------------------------------------------------------------------------------------- ACLs


async def test_acl_allows_and_denies_as_written(tls: Tls) -> None:
    a, b = tls.node(0).listen, tls.node(1).listen
    async with (
        Client(a, credentials=tls.creds("meter-1")) as meter,
        Client(b, credentials=tls.creds("operator")) as op,
    ):
        sub = await op.subscribe("grid/f1/voltage")  # allow subscribe operator grid/#
        ack = await meter.publish("grid/f1/voltage", b"230.1")  # allow publish meter-* grid/+/voltage
        assert ack.seq == 0
        async with asyncio.timeout(10):
            got = await anext(sub)
        assert (got.payload, got.publisher) == (b"230.1", meter.publisher_id)
        with pytest.raises(
            RequestFailed, match=r"not_allowed: 'meter-1' may not publish to 'grid/f1/current'.*default"
        ):
            await meter.publish("grid/f1/current", b"5.2")  # no rule
        with pytest.raises(RequestFailed, match="not_allowed"):
            await meter.publish("grid/f1/x/voltage", b"1")  # '+' is one level
        with pytest.raises(RequestFailed, match="'meter-1' may not subscribe"):
            await meter.subscribe("grid/f1/voltage")
        with pytest.raises(RequestFailed, match="not_allowed"):
            await meter.fetch("grid/f1/voltage")  # reading stored messages is subscribing
        with pytest.raises(RequestFailed, match=r"may not subscribe to 'grid/private/keys'.*strict.acl:1"):
            await op.subscribe("grid/private/keys")  # the deny rule comes first
        with pytest.raises(RequestFailed, match="'operator' may not publish"):
            await op.publish("grid/f1/voltage", b"1")
        assert len(await op.fetch("grid/f1/voltage")) == 1
        loc = await meter.locate("grid/f1/voltage")  # LOCATE is never denied
        assert loc.topic == "grid/f1/voltage"
        # A denied subscription leaves no state behind: asking again gives the same answer, not
        # already_subscribed.
        with pytest.raises(RequestFailed, match="not_allowed"):
            await meter.subscribe("grid/f1/voltage")
    counts = [await tls.counters(i) for i in (0, 1)]
    assert sum(c["acl_denied_access"] for c in counts) >= 7


async def test_holder_enforces_the_acl_whatever_the_access_broker_allows(tls: Tls) -> None:
    lenient = tls.node(LENIENT)
    async with Client(lenient.listen, credentials=tls.creds("tester")) as probe:
        # A topic whose primary is one of the strict brokers, not the lenient access broker.
        for k in range(100):
            topic = f"grid/h{k}/current"
            primary = (await probe.locate(topic)).primary.id
            if primary != lenient.node_id:
                break
        holder = next(i for i, bp in enumerate(tls.cluster.nodes) if bp.node_id == primary)
    before = await tls.counters(holder)
    async with Client(lenient.listen, credentials=tls.creds("meter-9")) as meter:
        with pytest.raises(RequestFailed, match=r"'meter-9' may not publish to 'grid/h\d+/current'"):
            await meter.publish(topic, b"1")
        voltage = topic.replace("/current", "/voltage")
        assert (await meter.publish(voltage, b"230")).seq == 0  # allowed by the holder's rules too
    after = await tls.counters(holder)
    assert after["acl_denied_holder"] - before["acl_denied_holder"] == 1
    assert (await tls.counters(LENIENT))["acl_denied_access"] == 0


# ----------------------------------------------------------------------------------- rogue brokers


def _run_broker(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SEDAX_INSECURE"}
    return subprocess.run(
        [sys.executable, "-m", "broker", "--listen", "127.0.0.1:0", *FAST_ARGS, "--join-timeout", "5", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


async def test_broker_without_cluster_certificate_cannot_join(tls: Tls, tmp_path: Path) -> None:
    entry = tls.node(0)
    before = await tls.counters(0)
    # A broker with its own CA: its certificate is worthless to the cluster (and the cluster's to it).
    certs.init_ca(tmp_path)
    cert, key = certs.issue(tmp_path, "rogue", "broker")
    tls_args = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(tmp_path / "ca.pem")]
    res = await asyncio.to_thread(_run_broker, "--coord", "0.3,0.65", "--join", entry.listen, *tls_args)
    assert res.returncode == 4, res.stderr
    assert "could not join through any address" in res.stderr and "CERTIFICATE_VERIFY_FAILED" in res.stderr
    # A broker without TLS at all.
    res = await asyncio.to_thread(_run_broker, "--coord", "0.3,0.65", "--join", entry.listen, "--insecure")
    assert res.returncode == 4, res.stderr
    # A peer that trusts the cluster CA but holds a certificate of another CA fails the handshake.
    rogue = Credentials(ca=tls.ca, cert=str(cert), key=str(key))
    try:
        raw, reply = await Raw.hello(
            entry, rogue, Hello(PROTOCOL_VERSION, "rogue", "broker", (0.3, 0.65), "127.0.0.1:9")
        )
        raw.close()
        assert reply is None  # no HELLO_OK, no REFUSE: the connection died in the handshake
    except OSError:
        pass
    after = await tls.counters(0)
    assert after["tls_handshake_failures"] - before["tls_handshake_failures"] >= 3
    sts = await tls.cluster.statuses()
    legit = {bp.node_id for bp in tls.cluster.nodes}
    assert all({n.id for n in st.neighbours} <= legit for st in sts.values())


async def test_client_certificate_cannot_act_as_a_broker(tls: Tls) -> None:
    entry = tls.node(1)
    me = NodeInfo("meter-5", (0.3, 0.65), "127.0.0.1:9")
    # HELLO as a broker with a client certificate.
    raw, reply = await Raw.hello(
        entry, tls.creds("meter-5"), Hello(PROTOCOL_VERSION, me.id, "broker", me.coord, me.listen)
    )
    raw.close()
    assert isinstance(reply, Refuse) and reply.code == "not_allowed"
    assert "needs a broker certificate (OU=broker)" in reply.text
    # JOIN from a client link with a client certificate.
    raw, reply = await Raw.hello(entry, tls.creds("meter-5"), Hello(PROTOCOL_VERSION, "meter-5", "client"))
    assert isinstance(reply, HelloOk)
    raw.writer.write(encode_control(Join(7, me)))
    reply = await raw.next()
    raw.close()
    assert isinstance(reply, Refuse) and reply.code == "not_allowed" and reply.corr == 7
    # A real broker certificate (of n9) used under another node id.
    raw, reply = await Raw.hello(
        entry, tls.creds("n9", "broker"), Hello(PROTOCOL_VERSION, "n0", "broker", (0.3, 0.65), "127.0.0.1:9")
    )
    raw.close()
    assert isinstance(reply, Refuse) and "node id n0 is not the name in its certificate (n9)" in reply.text


async def test_clients_cannot_inject_routed_frames(tls: Tls) -> None:
    target = tls.node(2)
    since = log_size(target)
    before = await tls.counters(2)
    raw, reply = await Raw.hello(target, tls.creds("tester"), Hello(PROTOCOL_VERSION, "tester", "client"))
    assert isinstance(reply, HelloOk)
    raw.writer.write(encode_routed((0.5, 0.5), encode_message(Ping(1)), hop_limit=8))
    await raw.eof()
    raw.close()
    await wait_for(lambda: log_has(target, "only brokers route", since), 5.0, "refusal logged")
    after = await tls.counters(2)
    assert after["routed_from_non_broker"] - before["routed_from_non_broker"] == 1
    assert after["protocol_errors"] > before["protocol_errors"]


# ------------------------------------------------------------------------------------------ live fuzz

FUZZ_FRAMES = 10_000
FUZZ_WORKERS = 4
WATCH_MESSAGES = 300


def _fuzz_topic(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return f"fuzz/t{rng.randrange(8)}/{rng.choice(['a', 'b', 'voltage'])}"
    if r < 0.7:
        return f"grid/f{rng.randrange(4)}/{rng.choice(['voltage', 'current'])}"
    alphabet = "ab/+# \x00\u00e9/"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300)))


def _fuzz_message(rng: random.Random) -> Message:
    """A well-formed client message with hostile content (bad topics, odd numbers, other people's ops)."""
    corr = rng.randrange(1 << 40)
    pub = "".join(rng.choice("abcXYZ019-_") for _ in range(rng.randrange(1, 65)))
    kind = rng.randrange(11)
    if kind <= 3:
        seq = rng.choice([0, 1, rng.randrange(100), rng.randrange(1 << 62)])
        return Publish(_fuzz_topic(rng), pub, seq, rng.randbytes(rng.randrange(0, 3000)), rng.randrange(seq + 1))
    if kind == 4:
        return Subscribe(corr, _fuzz_topic(rng), rng.choice([None, 0.0, rng.uniform(-1e9, 1e12)]))
    if kind == 5:
        return Unsubscribe(corr, _fuzz_topic(rng))
    if kind == 6:
        return Fetch(corr, _fuzz_topic(rng), rng.uniform(-1e6, 1e12), rng.randint(1, 512))
    if kind == 7:
        return Locate(corr, _fuzz_topic(rng))
    if kind == 8:
        return RouteProbe(corr, (rng.uniform(-2.0, 3.0), rng.uniform(-2.0, 3.0)))
    if kind == 9:
        return Join(corr, NodeInfo(f"x{corr}", (rng.random(), rng.random()), "127.0.0.1:9"))
    return rng.choice([Ping(corr), Pong(corr), StatusReq(corr)])


def _fatal_frame(rng: random.Random) -> bytes:
    """A frame that breaks the protocol (mostly) and ends the connection."""
    kind = rng.randrange(7)
    if kind == 0:  # garbage body under a valid length and kind
        body = rng.randbytes(rng.randrange(1, 200))
        return struct.pack(">IB", len(body) + 1, rng.choice([1, 2, 3, 200])) + body
    if kind == 1:  # a valid frame with bytes of its body flipped (sometimes still valid)
        frame = bytearray(encode_control(_fuzz_message(rng)))
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(5, len(frame))
            frame[i] = rng.randrange(256)
        return bytes(frame)
    if kind == 2:  # wrong shapes and unknown ops in well-formed msgpack
        wire = rng.choice(
            [
                {"op": "publish", "topic": 5},
                {"op": "subscribe", "corr": -1, "topic": "x"},
                {"op": "no_such_op"},
                {"op": "hello", "version": 1, "node": "x", "role": "client"},
                [1, 2, 3],
                {"op": "replicate", "corr": 1},
            ]
        )
        body = msgpack.packb(wire)
        return struct.pack(">IB", len(body) + 1, 1) + body
    if kind == 3:  # a routed frame from a client
        return encode_routed((rng.random(), rng.random()), rng.randbytes(20), hop_limit=rng.randint(1, 255))
    if kind == 4:  # a length beyond the limit
        return struct.pack(">IB", rng.randrange(1 << 21, 1 << 32), 1)
    if kind == 5:  # an empty frame
        return struct.pack(">I", 0)
    return encode_control(Hello(PROTOCOL_VERSION, "again", "client"))  # a second HELLO


async def _fuzz_worker(tls: Tls, target: BrokerProcess, rng: random.Random, quota: list[int]) -> tuple[int, int]:
    """Connections of up to 40 hostile frames, the last one often fatal; returns (frames, connections)."""
    creds = tls.creds("fuzzer")
    frames = conns = 0
    while quota[0] > 0:
        n = min(rng.randint(5, 40), quota[0])
        quota[0] -= n
        batch = [encode_control(_fuzz_message(rng)) for _ in range(n - 1)]
        batch.append(_fatal_frame(rng) if rng.random() < 0.7 else encode_control(_fuzz_message(rng)))
        raw, reply = await Raw.hello(target, creds, Hello(PROTOCOL_VERSION, f"fuzz-{conns}", "client"))
        assert isinstance(reply, HelloOk)
        # The broker handles frames in order, so once it answers the STATUS_REQ behind the batch, or closes
        # the connection at the fatal frame, it has processed every frame of the batch.
        raw.writer.write(b"".join(batch) + encode_control(StatusReq(1 << 50)))
        try:
            while (msg := await raw.next(10.0)) is not None and not (isinstance(msg, Status) and msg.corr == 1 << 50):
                pass
        except OSError:
            pass  # reset by the broker
        raw.close()
        frames += n
        conns += 1
    return frames, conns


async def test_live_fuzz_leaves_the_broker_serving_with_nothing_lost(tls: Tls) -> None:
    """10,000 hostile frames on several connections to one broker while a publisher streams through it."""
    target = tls.node(0)
    before = await tls.counters(0)
    rng = random.Random(20261123)
    topic = "grid/watch/voltage"
    async with (
        Client(target.listen, credentials=tls.creds("tester")) as sub_client,
        Client(tls.node(2).listen, credentials=tls.creds("tester")) as pub_client,
    ):
        sub = await sub_client.subscribe(topic)

        async def stream() -> list[int]:
            acks = []
            for i in range(WATCH_MESSAGES):
                acks.append(await pub_client.publish_nowait(topic, f"{i}".encode()))
                if i % 10 == 0:
                    await asyncio.sleep(0.01)  # a steady stream across the whole fuzz, not one burst
            return [a.seq for a in await asyncio.gather(*acks)]

        quota = [FUZZ_FRAMES]
        streaming = asyncio.create_task(stream())
        results = await asyncio.gather(
            *(_fuzz_worker(tls, target, random.Random(rng.random()), quota) for _ in range(FUZZ_WORKERS))
        )
        async with asyncio.timeout(60):
            acked = await streaming
            got = [(await anext(sub)).seq for _ in range(WATCH_MESSAGES)]
        assert acked == list(range(WATCH_MESSAGES))
        assert got == list(range(WATCH_MESSAGES)) and sub.gaps == 0 and sub.duplicates == 0
        # Still serving after the fuzz: a fresh subscription and publish through the fuzzed broker.
        async with Client(target.listen, credentials=tls.creds("tester")) as fresh:
            s2 = await fresh.subscribe("grid/after/voltage")
            await fresh.publish("grid/after/voltage", b"ok")
            async with asyncio.timeout(10):
                assert (await anext(s2)).payload == b"ok"
    frames = sum(f for f, _ in results)
    conns = sum(c for _, c in results)
    after = await tls.counters(0)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    print(f"\nlive fuzz: {frames} frames on {conns} connections; counter deltas: "
          + ", ".join(f"{k}={v}" for k, v in sorted(delta.items()) if v))  # fmt: skip
    assert frames == FUZZ_FRAMES
    assert delta["protocol_errors"] >= conns // 3  # most batches ended in a fatal frame
    assert delta["routed_from_non_broker"] > 0 and delta["refused_not_allowed"] > 0  # injections, JOINs
    assert delta["acl_denied_access"] > 0
    assert target.alive
    await check_routes(tls.cluster, 30, seed=9, credentials=tls.creds("cluster-admin"))


# --------------------------------------------------------------------------------------- the last ones


async def test_forged_routed_frames_from_a_broker_are_dropped_and_counted(tls: Tls) -> None:
    """A compromised broker (valid certificate) sends frames no honest broker would send."""
    target = tls.node(0)
    before = await tls.counters(0)
    me = (0.03, 0.97)  # a corner far from the test topics; the target is farther from it than we are
    raw, reply = await Raw.hello(
        target, tls.creds("n8", "broker"), Hello(PROTOCOL_VERSION, "n8", "broker", me, "127.0.0.1:9")
    )
    assert isinstance(reply, HelloOk)
    body = encode_message(Ping(1))
    raw.writer.write(encode_routed((5.0, 5.0), body, hop_limit=8))  # outside the space
    raw.writer.write(encode_routed((0.5, 0.5), body, hop_limit=200))  # above every broker's max_hops (64)
    raw.writer.write(encode_routed(me, body, hop_limit=8))  # sent backwards: we are closer to it than the target
    raw.writer.write(encode_control(StatusReq(42)))
    st = await raw.until("status")
    assert isinstance(st, Status)  # the link survived: the frames were dropped, not the connection
    for name in ("forged_outside_space", "forged_hop_limit", "forged_loop"):
        assert st.counters[name] - before[name] == 1, name
    # A NaN destination breaks the framing contract: the codec closes the link.
    nan = bytearray(encode_routed((0.5, 0.5), body, hop_limit=8))
    nan[5:13] = struct.pack(">d", math.nan)
    raw.writer.write(bytes(nan))
    await raw.eof()
    raw.close()
    after = await tls.counters(0)
    assert after["protocol_errors"] > before["protocol_errors"]
    await tls.cluster.wait_converged(30.0)
    await check_routes(tls.cluster, 30, seed=8, credentials=tls.creds("cluster-admin"))
