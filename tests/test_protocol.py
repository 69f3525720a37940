"""Pure codec tests: framing, every message round-trips, hostile bytes only ever raise RemoteProtocolError."""

from __future__ import annotations

import struct
from dataclasses import FrozenInstanceError, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import ClassVar, Literal

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlay import protocol as p
from overlay.protocol import (
    FLAG_TRACE,
    MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    ControlFrame,
    FrameDecoder,
    Hello,
    LocalProtocolError,
    Message,
    NodeInfo,
    RemoteProtocolError,
    RoutedFrame,
    decode_message,
    encode_message,
)
from overlay.pubsub import MAX_BATCH, MAX_BATCH_BYTES, Publish, PublishFrames, coalesce_publishes

A = NodeInfo("a", (0.1, 0.2), "127.0.0.1:4000")
B = NodeInfo("b-0123", (0.9, 0.5), "[::1]:4001")

EXAMPLES: list[Message] = [
    p.Hello(PROTOCOL_VERSION, "a", "broker", (0.1, 0.2), "127.0.0.1:4000"),
    p.Hello(PROTOCOL_VERSION, "admin-1", "admin"),
    p.Hello(PROTOCOL_VERSION, "c1", "client", (0.3, 0.3)),
    p.HelloOk(PROTOCOL_VERSION, A),
    p.Refuse("duplicate_coordinate", "coordinate (0.1, 0.2) is taken"),
    p.Refuse("coordinate_outside_space", "outside", corr=7),
    p.Join(5, A),
    p.Join(5, A, B),
    p.JoinAccept(5, B, (A,)),
    p.Neighbours((A, B)),
    p.Neighbours(()),
    p.Ping(1),
    p.Pong(1),
    p.Leave((A, B)),
    p.Unlink("not_neighbour"),
    p.RouteProbe(3, (0.5, 0.5)),
    p.RouteProbe(3, (0.5, 0.5), A, (A, B)),
    p.RouteReply(3, B, 1, (A, B)),
    p.StatusReq(9),
    p.Suspect(10, "n7"),
    p.Witness(10, "n7", True),
    p.Status(9, A, (B,), ("b-0123",), (), {"L1": 0, "L2": 0, "L3": 0}, {"forwarded": 3}, 2),
    p.HeldReq(11, "grid/feeder-7"),
    p.HeldPage(11, (p.TopicHeld("grid/feeder-8", "primary", 120), p.TopicHeld("grid/feeder-8", "home", 0)), {}, True),
    p.Error(4, "coordinate_outside_space", "nope"),
]


def test_every_core_op_has_an_example() -> None:
    # Other modules (pub/sub) register their own ops in the same registry; this file covers the core ones.
    core = {op for op, cls in p.MESSAGE_TYPES.items() if cls.__module__ == p.__name__}
    assert {m.op for m in EXAMPLES} == core


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.op)
def test_control_frame_round_trip(msg: Message) -> None:
    data = p.encode_control(msg)
    assert struct.unpack(">IB", data[:5]) == (len(data) - 4, p.FrameKind.CONTROL)
    assert FrameDecoder().feed(data) == [ControlFrame(msg)]
    assert p.decode_message(p.encode_message(msg)) == msg


def test_routed_frame_round_trip_and_forward() -> None:
    body = p.encode_message(p.RouteProbe(1, (0.7, 0.1), A, (A,)))
    data = p.encode_routed((0.7, 0.1), body, hop_limit=64, flags=FLAG_TRACE)
    (frame,) = FrameDecoder().feed(data)
    assert frame == RoutedFrame(0.7, 0.1, 0, 64, FLAG_TRACE, body)
    assert isinstance(frame, RoutedFrame)
    (fwd,) = FrameDecoder().feed(p.forward_routed(frame))
    assert fwd == frame._replace(hops=1)
    (fwd2,) = FrameDecoder().feed(p.forward_routed(frame, b"\x80"))
    assert fwd2.body == b"\x80"


def test_forward_refuses_past_hop_limit() -> None:
    frame = RoutedFrame(0.5, 0.5, 1, 2, 0, b"")
    assert not p.may_forward(frame)
    with pytest.raises(LocalProtocolError):
        p.forward_routed(frame)


def test_batch_of_frames_decodes_in_order_across_any_split() -> None:
    buf = bytearray()
    for i in range(50):
        p.append_routed(buf, i / 50, 0.5, bytes([i]) * i, hop_limit=8)
    buf += p.encode_control(p.Ping(7))
    data = bytes(buf)
    whole = FrameDecoder().feed(data)
    assert len(whole) == 51
    for step in (1, 3, 17, 1000):
        dec = FrameDecoder()
        got = []
        for i in range(0, len(data), step):
            got += dec.feed(data[i : i + step])
        got += dec.feed(b"")
        assert got == whole


def test_decoder_keeps_its_own_copy_of_a_partial_frame() -> None:
    # Whole frames are cut from the bytes received as they are; what is left of a partial frame is copied, so
    # the caller's buffer may be reused at once.
    ping, pong = p.encode_control(p.Ping(1)), p.encode_control(p.Pong(2))
    chunk = bytearray(ping + pong[:3])
    dec = FrameDecoder()
    assert [f.message for f in dec.feed(chunk)] == [p.Ping(1)]  # type: ignore[union-attr]
    chunk[:] = b"\xff" * len(chunk)
    assert dec.buffered == 3
    assert [f.message for f in dec.feed(pong[3:])] == [p.Pong(2)]  # type: ignore[union-attr]
    assert dec.buffered == 0


def test_truncated_frame_at_eof_is_remote_error() -> None:
    data = p.encode_control(p.Ping(1))
    dec = FrameDecoder()
    assert dec.feed(data[:-1]) == []
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        dec.feed(b"")


def test_oversized_length_refused_before_body() -> None:
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        dec.feed(struct.pack(">I", MAX_FRAME_SIZE + 1))
    assert dec.buffered == 0
    with pytest.raises(RemoteProtocolError):  # the decoder stays broken
        dec.feed(p.encode_control(p.Ping(1)))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (struct.pack(">IB", 1, 9), "unknown frame kind"),
        (struct.pack(">I", 0), "length 0"),
        (struct.pack(">IB", 4, 2) + b"abc", "shorter than its header"),
        (struct.pack(">IB", 20, 2) + struct.pack(">ddBBB", float("nan"), 0.0, 0, 5, 0), "not a finite"),
        (struct.pack(">IB", 20, 2) + struct.pack(">ddBBB", 0.5, 0.5, 5, 5, 0), "over its hop limit"),
        (struct.pack(">IB", 20, 2) + struct.pack(">ddBBB", 0.5, 0.5, 0, 5, 0x80), "unknown routed flags"),
    ],
)
def test_bad_frames_are_remote_errors(data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        FrameDecoder().feed(data)


def _control(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack(">IB", len(body) + 1, 1) + body


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        (5, "a message is an array or a map"),
        ([1, 2, 3], "unknown op 1"),
        ([], "unknown op None"),
        (["nope"], "unknown op"),
        (["ping"], "ping: 0 fields, expected 1"),
        (["ping", 1, 2], "ping: 2 fields, expected 1"),
        (["ping", "1"], "expected an integer"),
        (["ping", -1], "seq must be in"),
        (["nack", "t", "p", 0, "bad_topic"], "nack: 4 fields, expected 5 to 6"),
        (["neighbours", [["a", [0.1], "h:1"]]], "two components"),
        ({"op": "nope"}, "unknown op"),
        ({"x": 1}, "unknown op None"),
        ({"op": "ping"}, "missing"),
        ({"op": "ping", "seq": "1"}, "expected an integer"),
        ({"op": "ping", "seq": True}, "expected an integer"),
        ({"op": "ping", "seq": -1}, "seq must be in"),
        ({"op": "ping", "seq": 1, "extra": 2}, "unknown fields"),
        ({"op": "hello", "version": 1, "node": "x y", "role": "admin"}, "node id"),
        ({"op": "hello", "version": 1, "node": "x", "role": "king"}, "not one of"),
        ({"op": "hello", "version": 1, "node": "x", "role": "broker", "listen": "h:1"}, "must carry"),
        ({"op": "neighbours", "neighbours": [["a", [0.1], "h:1"]]}, "two components"),
        ({"op": "neighbours", "neighbours": [["a", [0.1, float("inf")], "h:1"]]}, "finite"),
        ({"op": "neighbours", "neighbours": [["a", [0.1, 0.2], "nohost"]]}, "HOST:PORT"),
        ({"op": "neighbours", "neighbours": "abc"}, "expected an array"),
        ({"op": "refuse", "code": "duplicate_coordinate", "text": "x" * 2000}, "limit"),
        ({"op": "status_req", "corr": 2**64 - 1}, "correlation id"),
    ],
)
def test_wrong_shapes_are_remote_errors(obj: object, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        FrameDecoder().feed(_control(obj))


def test_msgpack_failures_are_remote_errors() -> None:
    for body in (b"\xc1", b"\x93\x01", b"\x01\x02", b"\xd6\xff\x00\x00\x00\x00", b"\x91" * 5000, b"\x81\x01\x02"):
        with pytest.raises(RemoteProtocolError):
            FrameDecoder().feed(struct.pack(">IB", len(body) + 1, 1) + body)


def test_local_misuse_is_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        NodeInfo("", (0.0, 0.0), "h:1")
    with pytest.raises(LocalProtocolError):
        p.RouteProbe(1, (float("nan"), 0.0))
    with pytest.raises(LocalProtocolError):
        p.encode_routed((0.5, 0.5), b"", hop_limit=0)
    with pytest.raises(LocalProtocolError):
        p.encode_routed((0.5, 0.5), b"", hop_limit=4, flags=0x40)
    with pytest.raises(LocalProtocolError):
        p.encode_routed((0.5, 0.5), b"x" * p.MAX_LINK_FRAME_SIZE, hop_limit=4)  # routed: between brokers
    dec = FrameDecoder()
    dec.feed(b"")
    with pytest.raises(LocalProtocolError):
        dec.feed(b"x")


def test_registry_extends_without_touching_the_codec() -> None:
    p.register_field_type("tuple[int, ...]", list, lambda v: tuple(p.dec_int(x) for x in p.dec_list(v)))

    @p.register_message
    @dataclass(frozen=True, slots=True)
    class Subscribe(Message):
        op: ClassVar[Literal["test_subscribe"]] = "test_subscribe"
        corr: int
        topic: str
        shards: tuple[int, ...] = ()

    try:
        msg = Subscribe(1, "grid/feeder-7", (1, 2))
        assert FrameDecoder().feed(p.encode_control(msg)) == [ControlFrame(msg)]
        with pytest.raises(LocalProtocolError, match="already registered"):
            p.register_message(Subscribe)
    finally:
        del p.MESSAGE_TYPES["test_subscribe"]
        del p._FIELD_CODECS["tuple[int, ...]"]


def test_address_parsing() -> None:
    assert p.parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert p.parse_address("[::1]:80") == ("::1", 80)
    assert p.format_address("::1", 80) == "[::1]:80"
    for bad in ("nohost", ":80", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            p.parse_address(bad)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), max_size=8))
def test_random_bytes_only_raise_remote_protocol_error(chunks: list[bytes]) -> None:
    dec = FrameDecoder()
    try:
        for chunk in chunks:
            for frame in dec.feed(chunk):
                assert isinstance(frame, ControlFrame | RoutedFrame)
        dec.feed(b"")
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=12,
    ),
    st.sampled_from(sorted(op for op, cls in p.MESSAGE_TYPES.items() if cls.__module__ == p.__name__)),
)
def test_random_shapes_with_real_ops_only_raise_remote_protocol_error(value: object, op: str) -> None:
    # The map form (any value as the fields) and the array form (the op, then a list's items as the fields).
    obj = dict(value) if isinstance(value, dict) else {"junk": value}
    obj["op"] = op
    arr = [op, *value] if isinstance(value, list) else [op, value]
    for shape in (obj, arr):
        try:
            frames = FrameDecoder().feed(_control(shape))
        except RemoteProtocolError:
            continue
        assert len(frames) == 1 and isinstance(frames[0], ControlFrame)


def test_every_message_is_an_array_but_the_handshake_which_every_version_reads() -> None:
    # Version 3: [op, field, ...] in field order; HELLO, HELLO_OK and REFUSE stay maps (what versions 1 and 2
    # read), so that a peer of any version reads the refusal that names the fix.  Both forms decode, and an
    # array without its trailing defaulted fields decodes to the defaults.
    samples = [
        p.Hello(
            PROTOCOL_VERSION, "n1", "broker", (0.1, 0.2), "127.0.0.1:4000", resilience=2, space=(0.0, 0.0, 1.0, 1.0)
        ),
        p.HelloOk(PROTOCOL_VERSION, A),
        p.Refuse("version_mismatch", "upgrade"),
        p.Ping(7),
        p.Neighbours((A,)),
    ]
    import overlay.pubsub as ps

    samples += [ps.Publish("grid/a", "meter-1", 3, b"230.1"), ps.Ack("grid/a", "meter-1", 3, 1.5)]
    for msg in samples:
        wire = msgpack.unpackb(p.encode_message(msg))
        if msg.op in p.MAP_FORM:
            assert type(wire) is dict and wire["op"] == msg.op
            as_array = [msg.op, *(wire[f.name] for f in dataclass_fields(msg))]
            assert FrameDecoder().feed(_control(as_array)) == [ControlFrame(msg)]
        else:
            assert type(wire) is list and wire[0] == msg.op and len(wire) == 1 + len(dataclass_fields(msg))
            as_map = {"op": msg.op, **{f.name: v for f, v in zip(dataclass_fields(msg), wire[1:], strict=True)}}
            assert FrameDecoder().feed(_control(as_map)) == [ControlFrame(msg)]
        assert FrameDecoder().feed(p.encode_control(msg)) == [ControlFrame(msg)]
    short = ["publish", "grid/a", "meter-1", 3, b"230.1"]  # without base and more
    assert FrameDecoder().feed(_control(short)) == [ControlFrame(ps.Publish("grid/a", "meter-1", 3, b"230.1"))]


def test_batched_topic_frames_round_trip_and_refuse_bad_entries() -> None:
    # One TOPIC_REQUEST carries several sessions' requests (each with its identity), one TOPIC_REPLY several
    # answers: both keep their order, and a malformed entry is the sender's protocol error.
    import overlay.pubsub as ps

    pub = p.encode_message(ps.Publish("grid/a", "meter-1", 3, b"230.1"))
    req = ps.TopicRequest(
        A,
        (ps.SessionRequests("s-1", "meter-1", (pub, pub)), ps.SessionRequests("s-2", "", (pub,))),
        dest=(0.5, 0.5),
    )
    rep = ps.TopicReply("a", (ps.Answer(("s-1", "s-2"), pub), ps.Answer(("s-3",), b"\x80")))
    for msg in (req, rep):
        assert FrameDecoder().feed(p.encode_control(msg)) == [ControlFrame(msg)]
    node = ["a", [0.1, 0.2], "127.0.0.1:4000"]
    bad: list[tuple[object, str]] = [
        ({"op": "topic_request", "access": node, "batches": [["", "", [pub]]]}, "session id"),
        ({"op": "topic_request", "access": node, "batches": [["s", 1, [pub]]]}, "expected a string"),
        ({"op": "topic_request", "access": node, "batches": [["s", "", ["x"]]]}, "expected binary"),
        ({"op": "topic_request", "access": node, "batches": [["s", ""]]}, "not enough values"),
        ({"op": "topic_reply", "access": "a", "answers": [[["s" * 65], pub]]}, "session id"),
        ({"op": "topic_reply", "access": "a", "answers": [["s", pub]]}, "expected an array"),
    ]
    for obj, match in bad:
        with pytest.raises(RemoteProtocolError, match=match):
            FrameDecoder().feed(_control(obj))


def _probe_class() -> type:
    # Defined inside a function: `from __future__ import annotations` leaves the annotations as strings, which
    # dataclasses reads without resolving them.
    @dataclass(frozen=True, slots=True)
    class Probe:
        a: int
        b: str = "x"
        c: list[int] = field(default_factory=list)

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("a must not be negative")

    return Probe


def test_fast_init_behaves_as_the_dataclass_init() -> None:
    ref, fast = _probe_class(), p.fast_init(_probe_class())
    assert fast.__init__ is not ref.__init__ and "_s0" in fast.__init__.__code__.co_names
    for args, kwargs in [((1,), {}), ((1, "y"), {}), ((1,), {"c": [2]}), ((), {"a": 3, "b": "z"}), ((4, "w", [5]), {})]:
        r, f = ref(*args, **kwargs), fast(*args, **kwargs)
        assert (f.a, f.b, f.c) == (r.a, r.b, r.c)
    assert fast(1).c is not fast(1).c  # the factory runs per object
    for args, kwargs, exc in [((), {}, TypeError), ((1, "x", [], 9), {}, TypeError), ((1,), {"d": 1}, TypeError)]:
        with pytest.raises(exc):
            fast(*args, **kwargs)
    with pytest.raises(ValueError, match="negative"):
        fast(-1)  # __post_init__ still checks
    with pytest.raises(FrozenInstanceError):
        fast(1).a = 2  # type: ignore[misc]


def test_fast_init_leaves_the_classes_it_does_not_fit() -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class KeywordsOnly:
        a: int

    @dataclass(frozen=True)
    class NoSlots:
        a: int

    for cls in (KeywordsOnly, NoSlots):
        before = cls.__init__
        assert p.fast_init(cls).__init__ is before


def test_every_message_with_fields_gets_the_fast_init() -> None:
    slow = [cls.__name__ for cls in p.MESSAGE_TYPES.values() if "_s0" not in cls.__init__.__code__.co_names]
    assert slow == []


@pytest.mark.parametrize("topic", ["g", "grid/feeder-3/voltage", "t" * 256])
def test_publish_frames_are_the_frames_of_publish(topic: str) -> None:
    # The client's fast encoder of one-message PUBLISHes must give what the generic codec gives, for every width
    # msgpack picks for the numbers and the payload, and decode back to the same Publish.
    frames = PublishFrames(topic, "pub-1#k3x9")
    for seq in (0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, p.MAX_CORR):
        for size in (0, 31, 32, 255, 256, 65535, 65536):
            base = seq // 2
            payload = bytes(range(256)) * (size // 256) + b"p" * (size % 256)
            want = Publish(topic, "pub-1#k3x9", seq, payload, base)
            got = frames.frame(seq, payload, base)
            assert got == p.encode_control(want)
            assert FrameDecoder().feed(got) == [ControlFrame(want)]
    with pytest.raises(LocalProtocolError, match="base"):
        frames.frame(3, b"x", 4)
    # The frame limit is encode_message's own, to the byte: the largest payload either takes, the other takes.
    room = MAX_FRAME_SIZE - len(p.encode_message(Publish(topic, "pub-1#k3x9", 7, b"", 7))) - 40
    while True:
        try:
            p.encode_control(Publish(topic, "pub-1#k3x9", 7, b"z" * (room + 1), 7))
        except LocalProtocolError:
            break
        room += 1
    assert frames.frame(7, b"z" * room, 7) == p.encode_control(Publish(topic, "pub-1#k3x9", 7, b"z" * room, 7))
    with pytest.raises(LocalProtocolError, match="over the frame limit"):
        frames.frame(7, b"z" * (room + 1), 7)
    with pytest.raises(LocalProtocolError, match="publisher id"):
        PublishFrames(topic, "")


def test_consecutive_publishes_of_one_read_become_one_batch() -> None:
    def pub(
        seq: int, payload: bytes = b"x", topic: str = "grid/a", publisher: str = "p1", base: int = 0
    ) -> ControlFrame:
        return ControlFrame(Publish(topic, publisher, seq, payload, base))

    ping = ControlFrame(p.Ping(1))
    routed = RoutedFrame(0.5, 0.5, 0, 8, 0, b"\x90")
    frames: list[p.Frame] = [
        pub(3, b"a", base=1),
        pub(4, b"b", base=2),
        pub(5, b"c", base=3),  # one run: 3-5, the first base kept
        pub(7),  # a gap: a run of its own
        pub(8, topic="grid/b"),  # another topic
        pub(9, topic="grid/b", publisher="p2"),  # another publisher
        ping,
        pub(10, topic="grid/b", publisher="p2"),  # not across another frame
        routed,
    ]
    out = coalesce_publishes(frames)
    assert out == [
        ControlFrame(Publish("grid/a", "p1", 3, b"a", 1, (b"b", b"c"))),
        pub(7),
        pub(8, topic="grid/b"),
        pub(9, topic="grid/b", publisher="p2"),
        ping,
        pub(10, topic="grid/b", publisher="p2"),
        routed,
    ]
    # A batch joins a run; a payload over the broker's limit keeps its own frame (and its own NACK, too_large).
    batched = ControlFrame(Publish("grid/a", "p1", 1, b"b", 0, (b"c",)))
    assert coalesce_publishes([pub(0, b"a"), batched, pub(3, b"d")]) == [
        ControlFrame(Publish("grid/a", "p1", 0, b"a", 0, (b"b", b"c", b"d")))
    ]
    big = pub(1, b"y" * 11)
    assert coalesce_publishes([pub(0), big, pub(2), pub(3)], max_payload=10) == [
        pub(0),
        big,
        ControlFrame(Publish("grid/a", "p1", 2, b"x", 0, (b"x",))),
    ]
    # A run stays within MAX_BATCH messages and MAX_BATCH_BYTES.
    many = coalesce_publishes([pub(i) for i in range(MAX_BATCH + 3)])
    assert [f.message.count for f in many if isinstance(f.message, Publish)] == [MAX_BATCH, 3]
    half = MAX_BATCH_BYTES // 2
    heavy = coalesce_publishes([pub(i, b"z" * half) for i in range(3)], max_payload=MAX_BATCH_BYTES)
    assert [f.message.count for f in heavy if isinstance(f.message, Publish)] == [2, 1]


def test_records_decode_as_each_checked_alone() -> None:
    # A DELIVER's records go through overlay.pubsub._dec_records (a publisher id checked once per run of records
    # that share it); every record must still be checked as `_dec_record` checks one.
    from overlay.pubsub import Deliver, Record

    good = [[1.5, "p", 0, b"a"], [2, "p", 1, b"b"], [2.5, "q", 0, b""], [3.0, "p", 2, b"c"]]
    m = p.decode_message(msgpack.packb(["deliver", "t", good]))
    assert isinstance(m, Deliver)
    assert m.records == (Record(1.5, "p", 0, b"a"), Record(2.0, "p", 1, b"b"), Record(2.5, "q", 0, b""),
                         Record(3.0, "p", 2, b"c"))  # fmt: skip
    assert all(type(r) is Record for r in m.records) and type(m.records[1].ts) is float
    for bad in (  # each after a valid record of the same publisher: its id was checked already
        [float("nan"), "p", 4, b"x"],
        [1.0, "p", -1, b"x"],
        [1.0, "p", 5, "text"],
        [1.0, "p\n", 5, b"x"],
        [1.0, "", 5, b"x"],
        [1.0, "p", True, b"x"],
        [1.0, "p", 5],
        [1.0, "p", 5, b"x", 0],
        "record",
    ):
        with pytest.raises(p.RemoteProtocolError):
            p.decode_message(msgpack.packb(["deliver", "t", [[1.0, "p", 3, b"x"], bad]]))


def test_a_clients_hello_leaves_resilience_and_space_out_and_a_brokers_carries_them() -> None:
    # Brokers of version 6 refuse a HELLO field they do not know: a client's HELLO must stay readable to them so
    # that they can answer it with version_mismatch; a broker's carries its level (refused when it differs).
    client = msgpack.unpackb(encode_message(Hello(PROTOCOL_VERSION, "c1", "client", token="t")))
    assert "resilience" not in client
    broker = Hello(PROTOCOL_VERSION, "b1", "broker", (0.1, 0.2), "127.0.0.1:4000", resilience=3)
    assert msgpack.unpackb(encode_message(broker))["resilience"] == 3
    assert decode_message(encode_message(broker)) == broker
    with pytest.raises(LocalProtocolError):
        Hello(PROTOCOL_VERSION, "b1", "broker", (0.1, 0.2), "127.0.0.1:4000", resilience=4)
    spaced = Hello(
        PROTOCOL_VERSION, "b1", "broker", (0.1, 0.2), "127.0.0.1:4000", resilience=2, space=(0.0, 0.0, 2.0, 1.5)
    )
    assert "space" not in client and decode_message(encode_message(spaced)) == spaced
    for bad in ((0.0, 0.0, 1.0), (0.0, 0.0, 1.0, float("nan"))):
        with pytest.raises(LocalProtocolError):
            Hello(PROTOCOL_VERSION, "b1", "broker", (0.1, 0.2), "127.0.0.1:4000", resilience=2, space=bad)
