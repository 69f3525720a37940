"""Property-based fuzzing of the frame codec and of the checks brokers apply to what they decode.

Complements tests/test_protocol.py (random bytes, random shapes under core ops): here every registered op
(pub/sub included), mutations of valid frames, routed headers with any doubles, and the broker-side
validation (ACL decisions, forged-frame checks) on whatever the codec lets through.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import struct

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

import overlay.pubsub as ps
from broker.acl import parse_acl, refusal
from broker.config import BrokerConfig
from broker.guard import Guard
from overlay import protocol as p
from overlay.protocol import (
    KNOWN_FLAGS,
    MAX_COORD_ABS,
    MAX_HOP_LIMIT,
    ControlFrame,
    FrameDecoder,
    LocalProtocolError,
    Message,
    NodeInfo,
    RemoteProtocolError,
    RoutedFrame,
    decode_message,
    encode_control,
    encode_message,
)
from overlay.topics import BadTopic, matches, validate_pattern, validate_topic

NODE = NodeInfo("n1", (0.25, 0.75), "127.0.0.1:7001")
EXAMPLES: list[Message] = [
    p.Hello(p.PROTOCOL_VERSION, "c1", "client", token="secret"),
    p.Hello(p.PROTOCOL_VERSION, "b1", "broker", (0.1, 0.2), "127.0.0.1:4000"),
    p.Join(3, NODE, NODE),
    p.Status(1, NODE, (NODE,), ("n2",), ("t",), {"L1": 1}, {"x": 2}, 2),
    ps.Publish("grid/a/voltage", "pub-1", 7, b"230.1", 5),
    ps.Subscribe(4, "grid/#x", 12.5),
    ps.Fetch(9, "grid/a", 0.0, 10),
    ps.Nack("t", "pub", 1, "rate_limited", "slow down"),
    ps.TopicRequest(
        NODE,
        (
            ps.SessionRequests("s-1", "meter-1", (encode_message(ps.Publish("t", "p", 0, b"x")),)),
            ps.SessionRequests("s-2", "", (encode_message(ps.Fetch(1, "t")), encode_message(ps.Locate(2, "t")))),
        ),
        False,
        (0.5, 0.25),
    ),
    ps.TopicReply("n1", (ps.Answer(("s-1", "s-2"), b"\x80"), ps.Answer(("s-3",), encode_message(ps.Done(1))))),
    ps.Replicate(
        1,
        "t",
        (0.5, 0.5),
        NODE,
        (ps.Record(1.0, "p", 0, b"x"),),
        (ps.SubRef(NODE, "s"),),
        (ps.Delegation((0.5, 0.5), 0.0),),
        True,
        {"p": 0},
    ),
    ps.Located(1, "t", (0.1, 0.1), (0.2, 0.2), NODE, None, NODE, (), 10, 2),
    ps.Offer(3, "t", (0.5, 0.5), NODE, {"p": ((0, 5), (7, 9)), "q": ((2, 2),)}, True),
    ps.Pull(4, "t", (0.5, 0.5), NODE, {"p": ((0, 3),)}),
    p.Suspect(5, "n2"),
    p.Witness(5, "n2", False),
]


def _decode_all(data: bytes, splits: list[int]) -> list[ControlFrame | RoutedFrame]:
    """Feed data in pieces cut at splits; only RemoteProtocolError may come out (re-raised)."""
    dec = FrameDecoder()
    out: list[ControlFrame | RoutedFrame] = []
    cuts = sorted({min(max(s, 0), len(data)) for s in splits} | {0, len(data)})
    for a, b in itertools.pairwise(cuts):
        out += dec.feed(data[a:b])
    dec.feed(b"")
    return out


def _check_sane(frame: ControlFrame | RoutedFrame) -> None:
    """What every consumer of the decoder relies on."""
    if isinstance(frame, RoutedFrame):
        assert abs(frame.x) <= MAX_COORD_ABS and abs(frame.y) <= MAX_COORD_ABS
        assert 0 <= frame.hops < frame.hop_limit <= MAX_HOP_LIMIT
        assert frame.flags & ~KNOWN_FLAGS == 0
    else:
        # Whatever decodes can be sent again (brokers re-encode what they decoded).
        assert decode_message(encode_message(frame.message)) == frame.message


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(EXAMPLES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.lists(st.integers(0, 10_000), max_size=4),
    st.sampled_from(["flip", "insert", "delete"]),
)
def test_mutated_frames_only_raise_remote_errors(
    msg: Message, edits: list[tuple[int, int]], splits: list[int], how: str
) -> None:
    data = bytearray(encode_control(msg))
    for pos, byte in edits:
        i = pos % len(data)
        if how == "flip":
            data[i] = byte
        elif how == "insert":
            data.insert(i, byte)
        elif len(data) > 1:
            del data[i]
    try:
        frames = _decode_all(bytes(data), splits)
    except RemoteProtocolError:
        return
    for f in frames:
        _check_sane(f)


ALL_OPS = sorted(p.MESSAGE_TYPES)
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
SHAPES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL_OPS), st.data())
def test_any_op_with_any_field_values_only_raises_remote_errors(op: str, data: st.DataObject) -> None:
    """Every registered op (pub/sub included) with its real field names and arbitrary values."""
    cls = p.MESSAGE_TYPES[op]
    names = [f for f in cls.__dataclass_fields__ if f != "op"]
    keep = data.draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    wire: dict[str, object] = {name: data.draw(SHAPES) for name in keep}
    wire["op"] = op
    body = msgpack.packb(wire, use_bin_type=True)
    try:
        msg = decode_message(body)
    except RemoteProtocolError:
        return
    _check_sane(ControlFrame(msg))


@settings(max_examples=500, deadline=None)
@given(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 255),
    st.binary(max_size=40),
)
def test_routed_headers_with_any_values(x: float, y: float, hops: int, limit: int, flags: int, body: bytes) -> None:
    frame = struct.pack(">IB", 1 + p.ROUTED_HEADER.size + len(body), p.FrameKind.ROUTED)
    frame += p.ROUTED_HEADER.pack(x, y, hops, limit, flags) + body
    try:
        (decoded,) = FrameDecoder().feed(frame)
    except RemoteProtocolError:
        assert (
            not (math.isfinite(x) and math.isfinite(y))
            or max(abs(x), abs(y)) > MAX_COORD_ABS
            or hops >= limit
            or flags & ~KNOWN_FLAGS
        )
        return
    _check_sane(decoded)


GUARD = Guard(BrokerConfig(coord=(0.5, 0.5), insecure=True), logging.getLogger("test"))


@settings(max_examples=500, deadline=None)
@given(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 254),
    st.integers(1, 255),
    st.one_of(st.none(), st.tuples(st.floats(0, 1), st.floats(0, 1))),
)
def test_forged_frame_check_is_total_and_rejects_what_no_broker_sends(
    x: float, y: float, hops: int, limit: int, sender: tuple[float, float] | None
) -> None:
    """Defence in depth behind the codec: any header values, never an exception, never NaN forwarded."""
    frame = RoutedFrame(x, y, min(hops, limit - 1), limit, 0, b"")
    peer = NodeInfo("n0", sender, "127.0.0.1:1") if sender is not None else None
    me = NodeInfo("n9", (0.5, 0.5), "127.0.0.1:2")
    dropped = GUARD.forged(frame, peer, me)
    if not (0.0 <= x <= 1.0 and 0.0 <= y <= 1.0) or limit > 64:
        assert dropped
    if not dropped and peer is not None:
        assert math.hypot(0.5 - x, 0.5 - y) <= math.hypot(sender[0] - x, sender[1] - y)  # type: ignore[index]


def _reference_match(pattern: str, topic: str) -> bool:
    """MQTT matching as a regular expression, to check overlay.topics.matches against."""
    parts = pattern.split("/")
    rx = ""
    for i, part in enumerate(parts):
        sep = "/" if i else ""
        if part == "#":
            rx += f"(?:{sep}.*)?" if i else ".*"
            break
        rx += sep + ("[^/]*" if part == "+" else re.escape(part))
    return re.fullmatch(rx, topic) is not None


LEVEL = st.sampled_from(["grid", "a", "b", "voltage", "x1"])


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.one_of(LEVEL, st.just("+")), min_size=1, max_size=4),
    st.booleans(),
    st.lists(LEVEL, min_size=1, max_size=5),
)
def test_acl_patterns_match_like_mqtt(levels: list[str], rest: bool, topic_levels: list[str]) -> None:
    pattern = "/".join(levels + (["#"] if rest else []))
    topic = "/".join(topic_levels)
    validate_pattern(pattern)
    validate_topic(topic)
    assert matches(pattern, topic) == _reference_match(pattern, topic)


ACL = parse_acl("deny subscribe * grid/private/#\nallow publish meter-* grid/+/voltage\nallow any admin #\n")


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80), st.text(max_size=40), st.sampled_from(["publish", "subscribe", "fetch", "locate"]))
def test_acl_decisions_are_total_on_hostile_names(topic: str, identity: str, kind: str) -> None:
    """Whatever topic and identity arrive, the ACL answers allow or a typed refusal, never an exception."""
    msg: Message
    try:
        if kind == "publish":
            msg = ps.Publish(topic, "pub", 0, b"")
        elif kind == "subscribe":
            msg = ps.Subscribe(1, topic)
        elif kind == "fetch":
            msg = ps.Fetch(1, topic)
        else:
            msg = ps.Locate(1, topic)
    except LocalProtocolError:
        return
    answer = refusal(ACL, identity, msg, "holder")
    if kind == "locate":
        assert answer is None
    elif answer is not None:
        assert answer.code == "not_allowed"
        encode_message(answer)  # the refusal itself is always sendable
    try:
        validate_topic(topic)
    except BadTopic:
        return  # invalid names never match a valid pattern's literal levels
