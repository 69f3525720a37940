"""Hostile input on the broker port: each bad connection is closed with a logged reason; the broker stays up.

Every test ends by checking the overlay still routes exactly, through the attacked broker.
"""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
from cluster import check_routes, log_has, log_size, raw_connect, read_until_eof, wait_for

from cli.cluster import LocalCluster
from client.admin import AdminClient, RequestFailed
from overlay.protocol import (
    OLDEST_CLIENT_VERSION,
    PROTOCOL_VERSION,
    ControlFrame,
    FrameDecoder,
    Hello,
    HelloOk,
    Neighbours,
    NodeInfo,
    Ping,
    encode_control,
    encode_routed,
)

pytestmark = pytest.mark.slow


def _control(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">IB", len(body) + 1, 1) + body


HELLO_ADMIN = encode_control(Hello(PROTOCOL_VERSION, "hostile-1", "admin"))


@pytest.mark.parametrize(
    ("payload", "logged"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "exceeds the limit"),
        (b"\xff\xff\xff\xff\x01", "exceeds the limit"),
        (struct.pack(">IB", 3, 7) + b"ab", "unknown frame kind 7"),
        (_control("text"), "a message is an array or a map"),
        (_control({"op": "no_such_op"}), "unknown op 'no_such_op'"),
        (_control({"op": "hello", "version": 1, "node": "x", "role": "broker", "coord": "abc"}), "expected an array"),
        (encode_control(Ping(1)), "expected HELLO first, got ping"),
        (encode_routed((0.5, 0.5), b"\x80", hop_limit=4), "routed frame before the handshake"),
        (HELLO_ADMIN + _control({"op": "ping", "seq": "x"}), "expected an integer"),
        (HELLO_ADMIN + encode_control(Neighbours(())), "neighbours is not expected from a admin link"),
        (HELLO_ADMIN + HELLO_ADMIN, "hello after the handshake"),
    ],
    ids=[
        "http-garbage",
        "oversized-length",
        "unknown-kind",
        "neither-array-nor-map",
        "unknown-op",
        "wrong-shape",
        "no-hello",
        "routed-before-hello",
        "bad-field-after-hello",
        "broker-op-from-admin",
        "second-hello",
    ],
)
async def test_bad_input_closes_connection_with_reason(cluster3: LocalCluster, payload: bytes, logged: str) -> None:
    target = cluster3.nodes[0]
    since = log_size(target)
    reader, writer = await raw_connect(target)
    writer.write(payload)
    await writer.drain()
    await read_until_eof(reader, 3.0)
    writer.close()
    await wait_for(lambda: log_has(target, logged, since), 3.0, f"log line {logged!r}")
    assert log_has(target, "reason=protocol_error", since)
    assert target.alive
    await check_routes(cluster3, 30, seed=len(payload))


async def test_truncated_frame_then_eof(cluster3: LocalCluster) -> None:
    target = cluster3.nodes[1]
    since = log_size(target)
    reader, writer = await raw_connect(target)
    writer.write(HELLO_ADMIN + encode_control(Ping(5))[:-2])
    await writer.drain()
    writer.write_eof()
    await read_until_eof(reader, 3.0)
    writer.close()
    await wait_for(lambda: log_has(target, "connection closed inside a frame", since), 3.0, "truncation logged")
    assert target.alive
    await check_routes(cluster3, 30, seed=2)


async def test_peer_that_never_says_hello_times_out(cluster3: LocalCluster) -> None:
    target = cluster3.nodes[2]
    since = log_size(target)
    reader, writer = await raw_connect(target)
    await read_until_eof(reader, 10.0)  # hello timeout is 2 s in these clusters (a TLS handshake under load)
    writer.close()
    await wait_for(lambda: log_has(target, "reason=hello_timeout", since), 10.0, "hello timeout logged")
    await check_routes(cluster3, 30, seed=3)


async def test_silent_peer_after_hello_is_dropped_by_heartbeat(cluster3: LocalCluster) -> None:
    target = cluster3.nodes[0]
    since = log_size(target)
    reader, writer = await raw_connect(target)
    writer.write(HELLO_ADMIN)
    data = await read_until_eof(reader, 10.0)  # a silent admin connection is dropped after --client-timeout 3.0
    writer.close()
    frames = FrameDecoder().feed(data)
    assert isinstance(frames[0].message, HelloOk)  # type: ignore[union-attr]
    assert any(isinstance(getattr(f, "message", None), Ping) for f in frames[1:])
    await wait_for(lambda: log_has(target, "reason=heartbeat_timeout", since), 3.0, "heartbeat timeout logged")
    await check_routes(cluster3, 30, seed=4)


async def test_broker_with_duplicate_coordinate_refused_at_hello(cluster3: LocalCluster) -> None:
    target = cluster3.nodes[1]
    since = log_size(target)
    reader, writer = await raw_connect(target)
    me = NodeInfo("imposter", target.coord, "127.0.0.1:9")
    writer.write(encode_control(Hello(PROTOCOL_VERSION, me.id, "broker", me.coord, me.listen)))
    data = await read_until_eof(reader, 3.0)
    writer.close()
    (frame,) = FrameDecoder().feed(data)
    assert frame.message.code == "duplicate_coordinate"  # type: ignore[union-attr]
    await wait_for(lambda: log_has(target, "reason=refused", since), 3.0, "refusal logged")
    await check_routes(cluster3, 30, seed=5)


async def _first_frame(reader: asyncio.StreamReader) -> ControlFrame:
    """The first frame the broker sends on a raw connection (within a deadline)."""
    decoder = FrameDecoder()
    async with asyncio.timeout(3.0):
        while True:
            data = await reader.read(65536)
            assert data, "the broker closed before answering"
            if frames := decoder.feed(data):
                frame = frames[0]
                assert isinstance(frame, ControlFrame), frame
                return frame


async def test_version_mismatch_refused(cluster3: LocalCluster) -> None:
    target = cluster3.nodes[2]
    reader, writer = await raw_connect(target)
    writer.write(encode_control(Hello(PROTOCOL_VERSION + 1, "future", "admin")))
    data = await read_until_eof(reader, 3.0)
    writer.close()
    (frame,) = FrameDecoder().feed(data)
    assert frame.message.code == "version_mismatch"  # type: ignore[union-attr]
    text = frame.message.text  # type: ignore[union-attr]
    assert f"'future' speaks {PROTOCOL_VERSION + 1}" in text
    assert "same SeDAX release" in text  # the fix, not only the fault
    assert "`sedax --version` names the protocol" in text  # and how to tell which release speaks what
    # A broker of the previous version, and a client older than the oldest admitted, are refused in the map form
    # every version reads, so that they can say why.
    for role, version in (("broker", PROTOCOL_VERSION - 1), ("client", OLDEST_CLIENT_VERSION - 1)):
        reader, writer = await raw_connect(target)
        coord, listen = ((0.11, 0.83), "127.0.0.1:9") if role == "broker" else (None, "")
        writer.write(encode_control(Hello(version, f"old-{role}", role, coord, listen)))
        data = await read_until_eof(reader, 3.0)
        writer.close()
        wire = msgpack.unpackb(data[5:])
        assert wire["op"] == "refuse" and wire["code"] == "version_mismatch", wire
        speaks = str(PROTOCOL_VERSION) if role == "broker" else f"{OLDEST_CLIENT_VERSION} to {PROTOCOL_VERSION}"
        assert f"protocol {speaks} to a {role}" in wire["text"], wire
    # A client of the oldest version admitted is admitted: versions 6 and 7 changed only what brokers tell each other.
    reader, writer = await raw_connect(target)
    writer.write(encode_control(Hello(OLDEST_CLIENT_VERSION, "old-enough", "client")))
    frame = await _first_frame(reader)
    writer.close()
    assert isinstance(frame.message, HelloOk), frame
    async with await AdminClient.connect(target.listen) as c:
        assert (await c.status()).node.id == target.node_id


async def test_route_probe_outside_space_is_an_error_not_a_crash(cluster3: LocalCluster) -> None:
    async with await AdminClient.connect(cluster3.nodes[0].listen) as c:
        with pytest.raises(RequestFailed, match="coordinate_outside_space"):
            await c.route((3.0, 3.0))
        assert (await c.route((0.5, 0.5))).node.id in {bp.node_id for bp in cluster3.nodes}
