"""SeDAX wire protocol: framing and messages, sans-IO (no asyncio, no sockets, no clocks).

A connection carries frames: a 4-byte big-endian length, one byte of frame kind, then the body; the length
counts the kind byte and the body.  Two kinds exist:

* CONTROL: the body is one msgpack array ``[op, field, ...]`` (fields in declaration order) decoded into a
  `Message`; the handshake's messages (MAP_FORM) are maps ``{"op": ..., field: value, ...}``, the form of
  versions 1 and 2, and either form decodes.
* ROUTED: a fixed `struct` header (destination x, y as f64, hops u8, hop limit u8, flags u8) and an opaque
  body; hops counts the links crossed before the current one.  A forwarding broker reads the destination and
  bumps the hop count without decoding the body, which is what makes greedy forwarding cheap (Sec. I-A:
  every broker forwards messages addressed to a coordinate).

Broker and client only move bytes: `FrameDecoder.feed` turns received bytes into frames, the ``encode_*``
functions turn frames into bytes.  Errors say whose fault they are: `RemoteProtocolError` for anything the
peer sent, `LocalProtocolError` for our own misuse (as in h11).

New message types (later issues add SUBSCRIBE, PUBLISH, ...) are dataclasses decorated with
`register_message`; fields whose annotation is not yet known get a codec through `register_field_type`.

Why one module of ~900 lines: it is the counterpart of docs/protocol.md's framing and control messages, and
most of it is declarative (a checked dataclass per message).  The frame codec, the field codecs and the
message registry check each other at import (every registered message must encode and decode through them),
so a change to the wire is one file and one diff; the pub/sub and delegation messages already live beside it
(overlay/pubsub.py, overlay/delegation.py).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from enum import IntEnum
from types import MemberDescriptorType
from typing import Any, ClassVar, Final, Literal, NamedTuple, NoReturn, TypeAlias, TypeVar, get_args

import msgpack

# The wire protocol's version, checked at HELLO: peers of different versions refuse each other there, not
# after misreading each other's frames.  Bumped whenever a message's fields or meaning change:
#   1: the first overlay and pub/sub messages;
#   2: client requests for other brokers travel in TOPIC_REQUEST / TOPIC_REPLY, one per turn (afe1dea), and
#      REPLICATE may carry records only (its `meta` field);
#   3: every message but the handshake's is a msgpack array `[op, field, ...]`, not a map: decoding a PUBLISH
#      takes half the time (docs/benchmarks-latency.md, "Eleventh round");
#   4: frames between brokers may be MAX_LINK_FRAME_SIZE, a topic's subscribers travel grouped by access
#      broker, and a topic holds at most MAX_TOPIC_ENTRIES subscribers and publishers (`topic_full`);
#   5: a topic's primary sends its subscribers HEADS (the newest seq of publishers gone quiet);
#   6: REPLICATED may say that the copy was refused (`refused`: the copy's disk is full); clients see nothing
#      new, so those of version 5 are still admitted.
#   7: a broker's HELLO carries its resilience level and its space, and a broker refuses one that keeps a
#      different number of copies (`resilience_mismatch`) or maps topics into another space (`space_mismatch`);
#      a client's HELLO is unchanged.
PROTOCOL_VERSION: Final = 7
# The oldest version whose clients and admin tools a broker still admits.  Those of versions 1 and 2 read
# only maps; those of version 3 cannot read the `topic_full` refusal, those of version 4 a HEADS (an unknown op
# ends a connection).  They are refused at HELLO (version_mismatch, in a form they read).  Brokers must speak
# PROTOCOL_VERSION itself.
OLDEST_CLIENT_VERSION: Final = 5

# One frame must fit in memory before it is processed, so its size is bounded.  1 MiB is far above the largest
# control message (a STATUS with MAX_LIST_LEN entries is < 100 KiB) and leaves room for publish payloads of
# later issues, while a hostile peer announcing a 4 GiB frame is refused before a single body byte is kept.
MAX_FRAME_SIZE: Final = 1 << 20
# Frames between brokers (authenticated peers) may be larger: a REPLICATE carries a topic's subscriber list and
# publisher table besides its records, and a TOPIC_REQUEST or TOPIC_REPLY wraps a client's frame of up to
# MAX_FRAME_SIZE.  Held to MAX_FRAME_SIZE, one publish of the largest payload to a topic with a few dozen
# subscribers made a REPLICATE or a TOPIC_REPLY over the frame: it was dropped, the topic's replication
# stalled and those subscribers never got the message.  Room: the largest record (MAX_FRAME_SIZE) plus a topic's
# meta at its limit (overlay.pubsub.MAX_TOPIC_ENTRIES), with a margin.
MAX_LINK_FRAME_SIZE: Final = 4 << 20

# Node ids appear in logs, status output and tie-breaks; 64 printable characters are plenty for a uuid.
MAX_ID_LEN: Final = 64
# "host:port" with a DNS name of at most 253 characters, brackets of an IPv6 literal and a 5-digit port.
MAX_ADDR_LEN: Final = 262
# Human-readable reasons (REFUSE, ERROR) are for logs; longer text is a bug or an attack.
MAX_TEXT_LEN: Final = 1024
# Neighbour lists hold a node's Delaunay neighbours (6 on average, rarely above 20); route paths hold at most
# 255 hops (u8 hop counter).  1024 bounds both with a wide margin.
MAX_LIST_LEN: Final = 1024
# The lists that grow with a topic rather than with the overlay: its subscribers and the publishes waiting for
# acknowledgement (REPLICATE), its publishers' sequence numbers (REPLICATE's table, the digests of OFFER and
# PULL), the sessions one DELIVER is for (TOPIC_REPLY).  Held to MAX_LIST_LEN, a topic of 1,025 subscribers or
# publishers could no longer be replicated or repaired, nor delivered to 1,025 sessions of one access broker.
# The frame size bounds them in any case; the decoder's own limit only keeps a hostile frame from making more
# objects than this.
MAX_LONG_LIST_LEN: Final = 1 << 16
# The hop counter and limit are u8 in the ROUTED header.
MAX_HOP_LIMIT: Final = 255
# Coordinates live in a space of order 1; anything beyond this magnitude is garbage, and bounding it keeps
# distances finite (hypot of two 1e150s would still be finite, but no real space is that large).
MAX_COORD_ABS: Final = 1e12
# A bearer token in HELLO (client authentication without a certificate); 256 characters hold any sane secret.
MAX_TOKEN_LEN: Final = 256
# Correlation ids are unsigned 63-bit so they survive msgpack and every language's signed int64.
MAX_CORR: Final = (1 << 63) - 1
# A broker numbers the routed messages it expects answers to (REPLICATE, PULL, OFFER, a relayed JOIN, COORD_QUERY)
# from a random point below this in each of its lives.  An answer is routed to the asker's coordinate and matched
# there by its corr (pub/sub's also by its sender), so one meant for an earlier life of a broker at the same
# coordinate (a restart), or for a broker that died (it reaches the one now closest), must not match the corr of a
# request under way: with every life counting from 1, a confirmation of the dead life's first batches, late, could
# count as a pull of the new life's answered with nothing.  Well below MAX_CORR, so a life can count on for ever.
CORR_SPAN: Final = 1 << 48

# ROUTED flag: every broker that receives the frame appends itself to the body's path (route probes only; it
# costs a decode and re-encode per hop, which ordinary routed traffic must not pay).
FLAG_TRACE: Final = 0x01
KNOWN_FLAGS: Final = FLAG_TRACE

_LEN: Final = struct.Struct(">I")
_PREFIX: Final = struct.Struct(">IB")
# One packer for all messages: msgpack.packb builds a new Packer on every call.
_packb: Final = msgpack.Packer(use_bin_type=True).pack
# msgpack bytes of one value, packed as every message's fields are (bin for bytes, str for str): for a message
# type's own fast encoder (overlay.pubsub.PublishFrames).
pack_value: Final[Callable[[Any], bytes]] = _packb
ROUTED_HEADER: Final = struct.Struct(">ddBBB")
_ROUTED_PREFIX_LEN: Final = _PREFIX.size + ROUTED_HEADER.size

_ID_RE: Final = re.compile(r"[A-Za-z0-9._:\-]+")

Coord: TypeAlias = tuple[float, float]
Role: TypeAlias = Literal["broker", "client", "admin"]
RefuseCode: TypeAlias = Literal[
    "version_mismatch",
    "duplicate_coordinate",
    "duplicate_node_id",
    "coordinate_outside_space",
    "shutting_down",
    "not_allowed",
    "unauthenticated",
    "too_many_connections",
    "not_joined",  # JOIN sent to a broker that is itself still joining (brokers started together)
    "resilience_mismatch",  # a broker started with another --resilience than the overlay's
    "space_mismatch",  # a broker started with another --space than the overlay's
]
ErrorCode: TypeAlias = Literal["coordinate_outside_space", "busy", "unreachable", "not_allowed"]
UnlinkReason: TypeAlias = Literal["not_neighbour", "duplicate_link"]


class ProtocolError(Exception):
    """The SeDAX protocol was violated; see the subclass for whose fault it is."""


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol does not allow: a bug in the calling code."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that violate the protocol: close the connection and log the reason."""


class FrameKind(IntEnum):
    """The frame kind byte that follows the length."""

    CONTROL = 1
    ROUTED = 2


# --------------------------------------------------------------------------------------------------- checks


def _check_id(value: str, what: str) -> None:
    if not (0 < len(value) <= MAX_ID_LEN) or not _ID_RE.fullmatch(value):
        raise LocalProtocolError(f"{what} must be 1..{MAX_ID_LEN} characters of [A-Za-z0-9._:-], got {value!r}")


def _check_coord(value: Coord, what: str) -> None:
    x, y = value
    if not (math.isfinite(x) and math.isfinite(y)) or abs(x) > MAX_COORD_ABS or abs(y) > MAX_COORD_ABS:
        raise LocalProtocolError(f"{what} must be finite with |x|, |y| <= {MAX_COORD_ABS:g}, got {value!r}")


def _check_text(value: str, what: str, limit: int = MAX_TEXT_LEN) -> None:
    if len(value) > limit:
        raise LocalProtocolError(f"{what} is {len(value)} characters, the limit is {limit}")


def _check_list(value: tuple[Any, ...], what: str) -> None:
    if len(value) > MAX_LIST_LEN:
        raise LocalProtocolError(f"{what} has {len(value)} entries, the limit is {MAX_LIST_LEN}")


def _check_uint(value: int, what: str, limit: int) -> None:
    if not 0 <= value <= limit:
        raise LocalProtocolError(f"{what} must be in 0..{limit}, got {value}")


def check_corr(corr: int) -> None:
    """LocalProtocolError unless corr is a valid correlation id (0..MAX_CORR)."""
    _check_uint(corr, "correlation id", MAX_CORR)


def parse_address(text: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into host and port, raising ValueError saying what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"address must be HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port must be a number in {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port} in {text!r}")
    return host, port


def format_address(host: str, port: int) -> str:
    """The "host:port" text of an address, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_address(value: str, what: str, *, allow_empty: bool) -> None:
    if not value and allow_empty:
        return
    _check_text(value, what, MAX_ADDR_LEN)
    try:
        parse_address(value)
    except ValueError as exc:
        raise LocalProtocolError(f"{what}: {exc}") from None


# ------------------------------------------------------------------------------------------------ messages


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A broker as others see it: id, coordinate and the address it listens on."""

    id: str
    coord: Coord
    listen: str

    def __post_init__(self) -> None:
        _check_id(self.id, "node id")
        _check_coord(self.coord, "node coordinate")
        _check_address(self.listen, "listen address", allow_empty=False)

    def to_json(self) -> dict[str, Any]:
        """The JSON form used by status and route output."""
        return {"id": self.id, "coord": [self.coord[0], self.coord[1]], "listen": self.listen}


class Message:
    """Base of every control message; subclasses are frozen slotted dataclasses with a Literal `op`."""

    __slots__ = ()
    op: ClassVar[str]


M = TypeVar("M", bound=Message)
_D = TypeVar("_D")

MESSAGE_TYPES: Final[dict[str, type[Message]]] = {}


@dataclass(frozen=True, slots=True)
class _FieldCodec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


_FIELD_CODECS: Final[dict[str, _FieldCodec]] = {}
_MESSAGE_CODECS: Final[dict[type[Message], tuple[tuple[str, _FieldCodec], ...]]] = {}
# Per message type, an encoder and decoders compiled from its fields (as `dataclasses` compiles __init__):
# one call and no intermediate dicts or sets per message, which is most of a broker's per-message cost.
_ENCODERS: Final[dict[type[Message], Callable[[Any], list[Any] | dict[str, Any]]]] = {}
_DECODERS: Final[dict[str, Callable[[dict[str, Any]], Message]]] = {}  # the map form
_ARRAY_DECODERS: Final[dict[str, Callable[[list[Any]], Message]]] = {}  # the array form
# The handshake's messages keep the map form of versions 1 and 2, so that a client or broker of any version
# reads the REFUSE (version_mismatch) that tells it to upgrade, and an older broker the HELLO it refuses.
MAP_FORM: Final = frozenset({"hello", "hello_ok", "refuse"})
# Answers that only tools read and that grow a field now and then: a decoder takes an array with more fields than
# it knows and ignores the rest, so a tool reads the STATUS of a broker one release newer (brokers themselves must
# speak the same PROTOCOL_VERSION; everything else is refused whole, as a field it skipped could change meaning).
TRAILING_FIELDS_IGNORED: Final = frozenset({"status", "held_page"})


def _field_default(f: Field[Any], env: dict[str, Any], key: str) -> str | None:
    """For code generated from a dataclass: put f's default value or factory in env[key] and return the
    expression that yields the default (`key` or `key()`), or None if f has no default."""
    if f.default is not MISSING:
        env[key] = f.default
        return key
    if f.default_factory is not MISSING:
        env[key] = f.default_factory
        return f"{key}()"
    return None


def _compile(cls: type[Message], codecs: tuple[tuple[str, _FieldCodec], ...]) -> None:
    """The encoder and both decoders of cls.

    Array form (version 3): `[op, field, ...]`, every field in declaration order; a decoder also takes an
    array that ends before fields with defaults (they get the default).  Map form (versions 1 and 2, and the
    handshake's messages, MAP_FORM): `{"op": op, field: value, ...}`, fields with defaults optional.
    """
    env: dict[str, Any] = {
        "cls": cls,
        "names": frozenset(name for name, _ in codecs),
        "bad": _unknown_fields,
        "bad_len": _bad_length,
    }
    values = []
    dec_args = []
    arr_args = []
    required = 0
    defaults = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    for i, (name, codec) in enumerate(codecs):
        env[f"e{i}"] = codec.encode
        env[f"d{i}"] = codec.decode
        values.append(f"m.{name}" if codec.encode is _ident else f"e{i}(m.{name})")
        default = _field_default(defaults[name], env, f"v{i}")
        # A field whose decoder only checks the wire type is checked inline, its decoder called only to raise:
        # a call per field was a third of decoding a PUBLISH (benchmarks-latency.md, "Twentieth round").
        wire_type = _CHECK_ONLY.get(codec.decode)
        if wire_type is not None:
            env[f"t{i}"] = wire_type
            by_name = f"(x if type(x := w[{name!r}]) is t{i} else d{i}(x))"
            by_index = f"(x if type(x := w[{i + 1}]) is t{i} else d{i}(x))"
        else:
            by_name, by_index = f"d{i}(w[{name!r}])", f"d{i}(w[{i + 1}])"
        if default is None:
            dec_args.append(by_name)
            arr_args.append(by_index)
            required = i + 1
        else:
            dec_args.append(f"{by_name} if {name!r} in w else {default}")
            arr_args.append(f"{by_index} if n > {i + 1} else {default}")
    if cls.op in MAP_FORM:
        items = [f"'op': {cls.op!r}", *(f"{name!r}: {v}" for (name, _), v in zip(codecs, values, strict=True))]
        enc = f"def enc(m):\n    return {{{', '.join(items)}}}\n"
    else:
        enc = f"def enc(m):\n    return [{', '.join([repr(cls.op), *values])}]\n"
    # Fields with defaults follow the others in a dataclass, so a shorter array lacks only defaulted ones.
    most = 1 << 30 if cls.op in TRAILING_FIELDS_IGNORED else len(codecs) + 1
    src = (
        enc + f"def dec(w):\n    if not w.keys() <= names:\n        bad(cls, w, names)\n"
        f"    return cls({', '.join(dec_args)})\n"
        f"def adec(w):\n    n = len(w)\n    if not {required + 1} <= n <= {most}:\n"
        f"        bad_len(cls, n, {required}, {len(codecs)})\n"
        f"    return cls({', '.join(arr_args)})\n"
    )
    exec(src, env)  # the source is built from the dataclass's own field names, as `dataclasses` does
    _ENCODERS[cls] = env["enc"]
    _DECODERS[cls.op] = env["dec"]
    _ARRAY_DECODERS[cls.op] = env["adec"]


# A default_factory field's argument when the caller gave none (dataclasses uses a sentinel the same way).
_FACTORY: Final = object()


def fast_init(cls: type[_D]) -> type[_D]:
    """Give a frozen slotted dataclass an __init__ that fills its slots through their descriptors.

    The frozen __init__ that `dataclasses` writes must get past the class's own __setattr__ (which refuses), so
    it calls object.__setattr__(self, name, value) per field: a lookup and a call of a Python-level builtin each.
    A slot's member descriptor stores the same value directly.  Same signature, defaults and __post_init__;
    classes this does not fit (a field outside __init__ or keyword-only, no slot) keep their own.  A message
    object is made for every frame decoded or sent, several per message at each broker: 1.2 -> 0.7 us for a
    five-field message (docs/benchmarks-latency.md, "Ninth round").
    """
    fs = fields(cls)  # type: ignore[arg-type]
    setters = [cls.__dict__.get(f.name) for f in fs]
    if any(not f.init or f.kw_only or f.name == "self" for f in fs) or not all(
        isinstance(d, MemberDescriptorType) for d in setters
    ):
        return cls
    env: dict[str, Any] = {"_FACTORY": _FACTORY}
    params: list[str] = []
    body: list[str] = []
    for i, (f, d) in enumerate(zip(fs, setters, strict=True)):
        env[f"_s{i}"] = d.__set__  # type: ignore[union-attr]
        default = _field_default(f, env, f"_v{i}")
        if default is None:
            params.append(f.name)
        elif f.default_factory is MISSING:
            params.append(f"{f.name}={default}")
        else:  # a new object per call, as dataclasses does: the factory runs only when no argument came
            params.append(f"{f.name}=_FACTORY")
            body.append(f"    if {f.name} is _FACTORY:\n        {f.name} = {default}\n")
        body.append(f"    _s{i}(self, {f.name})\n")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()\n")
    if set(env) & {f.name for f in fs}:
        return cls  # a field named like one of the helpers above: keep dataclasses' own
    src = f"def __init__(self, {', '.join(params)}):\n" + ("".join(body) or "    pass\n")
    exec(src, env)  # built from the dataclass's own field names, as `dataclasses` builds its __init__
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    setattr(cls, "__init__", init)  # noqa: B010 - replaces a method, which mypy refuses as an assignment
    return cls


def _unknown_fields(cls: type[Message], wire: dict[str, Any], names: frozenset[str]) -> NoReturn:
    raise ValueError(f"{cls.op}: unknown fields {sorted(set(wire) - names)}")


def _bad_length(cls: type[Message], n: int, required: int, total: int) -> NoReturn:
    want = f"{required} to {total}" if required < total else str(total)
    raise ValueError(f"{cls.op}: {n - 1} fields, expected {want}")


def register_field_type(annotation: str, encode: Callable[[Any], Any], decode: Callable[[Any], Any]) -> None:
    """Teach the codec a field annotation (as written in the dataclass, e.g. "tuple[str, ...]").

    `decode` receives the msgpack value and must return the field value or raise ValueError/TypeError; the
    message's `__post_init__` then checks bounds.
    """
    if annotation in _FIELD_CODECS:
        raise LocalProtocolError(f"field type {annotation!r} already has a codec")
    _FIELD_CODECS[annotation] = _FieldCodec(encode, decode)


def register_message(cls: type[M]) -> type[M]:
    """Class decorator: add a message dataclass to the op registry so the codec can encode and decode it."""
    op = cls.op
    if op in MESSAGE_TYPES:
        raise LocalProtocolError(f"op {op!r} is already registered to {MESSAGE_TYPES[op].__name__}")
    codecs: list[tuple[str, _FieldCodec]] = []
    for f in fields(cls):  # type: ignore[arg-type]
        ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        codec = _FIELD_CODECS.get(ann)
        if codec is None:
            raise LocalProtocolError(f"{cls.__name__}.{f.name}: no codec for field type {ann!r}")
        if f.name == "op":
            raise LocalProtocolError(f"{cls.__name__}: 'op' is reserved for the message tag")
        codecs.append((f.name, codec))
    MESSAGE_TYPES[op] = cls
    _MESSAGE_CODECS[cls] = tuple(codecs)
    _compile(cls, tuple(codecs))
    return fast_init(cls)


# Field decoders: strict about types (a bool is not an int, a string is not a list), lenient only where
# msgpack itself is (an integer is accepted where a float is expected).  Public, so that the message modules
# (overlay.pubsub, overlay.delegation) build their field codecs from the same pieces.


def dec_int(v: Any) -> int:
    """An integer from the wire (a bool is not one), else TypeError."""
    if type(v) is not int:
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


# The wire types of a number (exact: a bool is an int subclass and not a number here).
_NUMBER_TYPES: Final = (int, float)


def dec_float(v: Any) -> float:
    """A number from the wire as a float (integers accepted), else TypeError."""
    if type(v) not in _NUMBER_TYPES:
        raise TypeError(f"expected a number, got {type(v).__name__}")
    return float(v)


def dec_str(v: Any) -> str:
    """A string from the wire, else TypeError."""
    if type(v) is not str:
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def dec_bool(v: Any) -> bool:
    """A boolean from the wire, else TypeError."""
    if type(v) is not bool:
        raise TypeError(f"expected a boolean, got {type(v).__name__}")
    return v


def dec_bytes(v: Any) -> bytes:
    """Binary from the wire, else TypeError."""
    if type(v) is not bytes:
        raise TypeError(f"expected binary, got {type(v).__name__}")
    return v


def dec_list(v: Any, limit: int = MAX_LIST_LEN) -> list[Any]:
    """An array from the wire of at most limit entries, else TypeError/ValueError."""
    if type(v) is not list:
        raise TypeError(f"expected an array, got {type(v).__name__}")
    if len(v) > limit:
        raise ValueError(f"array of {len(v)} entries exceeds {limit}")
    return v


def dec_coord(v: Any) -> Coord:
    """A coordinate [x, y] from the wire, else TypeError/ValueError."""
    items = dec_list(v)
    if len(items) != 2:
        raise ValueError(f"a coordinate has two components, got {len(items)}")
    return (dec_float(items[0]), dec_float(items[1]))


def _enc_coord(c: Coord) -> list[float]:
    return [c[0], c[1]]


# Nodes decoded from the wire, by (id, x, y, listen): a broker receives the same few nodes in nearly every routed
# message (a TOPIC_REQUEST's access broker, a REPLICATE's origin and subscribers' access brokers), and validating
# each again (id pattern, coordinate, address parse) was ~4 % of a fan-in broker's profiled time.  A NodeInfo is
# frozen, so one instance serves every message naming that node.  Bounded: a peer naming ever new nodes only
# empties it again.
_NODE_CACHE: Final[dict[tuple[str, float, float, str], NodeInfo]] = {}
_NODE_CACHE_SIZE: Final = 1024


def _node_key(v: Any) -> tuple[str, float, float, str] | None:
    """The cache key of a wire node [id, [x, y], listen] of exact types, else None (decoded the long way).
    Exact types only (a bool is not a number here, as in dec_float), so a key can only equal the key of a wire
    value that decodes to an equal NodeInfo."""
    if type(v) is list and len(v) == 3:
        node_id, c, listen = v
        if type(c) is list and len(c) == 2 and type(node_id) is str and type(listen) is str:
            x, y = c
            if type(x) in _NUMBER_TYPES and type(y) in _NUMBER_TYPES:
                return (node_id, x, y, listen)
    return None


def dec_node(v: Any) -> NodeInfo:
    """A NodeInfo [id, [x, y], listen] from the wire, else TypeError/ValueError."""
    key = _node_key(v)
    if key is not None and (node := _NODE_CACHE.get(key)) is not None:
        return node
    items = dec_list(v)
    if len(items) != 3:
        raise ValueError(f"a node is [id, coord, listen], got {len(items)} entries")
    node = NodeInfo(dec_str(items[0]), dec_coord(items[1]), dec_str(items[2]))  # validates: raises on a bad node
    if key is not None:
        if len(_NODE_CACHE) >= _NODE_CACHE_SIZE:
            _NODE_CACHE.clear()
        _NODE_CACHE[key] = node
    return node


def enc_node(n: NodeInfo) -> list[Any]:
    """A NodeInfo as the wire carries it: [id, [x, y], listen]."""
    return [n.id, [n.coord[0], n.coord[1]], n.listen]


def _optional(codec: _FieldCodec) -> _FieldCodec:
    return _FieldCodec(
        lambda v: None if v is None else codec.encode(v),
        lambda v: None if v is None else codec.decode(v),
    )


def _tuple_of(codec: _FieldCodec) -> _FieldCodec:
    return _FieldCodec(
        lambda v: [codec.encode(x) for x in v],
        lambda v: tuple(codec.decode(x) for x in dec_list(v)),
    )


def _dec_str_int_map(v: Any) -> dict[str, int]:
    if type(v) is not dict:
        raise TypeError(f"expected a map, got {type(v).__name__}")
    if len(v) > MAX_LONG_LIST_LEN:  # (a topic's publisher table: one entry per publisher)
        raise ValueError(f"map of {len(v)} entries exceeds {MAX_LONG_LIST_LEN}")
    return {dec_str(k): dec_int(x) for k, x in v.items()}


def _literal(alias: Any) -> _FieldCodec:
    allowed = frozenset(get_args(alias))

    def dec(v: Any) -> str:
        s = dec_str(v)
        if s not in allowed:
            raise ValueError(f"{s!r} is not one of {sorted(allowed)}")
        return s

    return _FieldCodec(lambda v: v, dec)


def _ident(v: Any) -> Any:
    return v


# The decoders that only check a value's exact wire type (`_compile` inlines the check).
_CHECK_ONLY: Final[dict[Callable[[Any], Any], type]] = {dec_str: str, dec_int: int, dec_bytes: bytes, dec_bool: bool}
_INT = _FieldCodec(_ident, dec_int)
_STR = _FieldCodec(_ident, dec_str)
_COORD = _FieldCodec(_enc_coord, dec_coord)
_NODE = _FieldCodec(enc_node, dec_node)
for _ann, _codec in {
    "int": _INT,
    "float": _FieldCodec(_ident, dec_float),
    "str": _STR,
    "bool": _FieldCodec(_ident, dec_bool),
    "bytes": _FieldCodec(_ident, dec_bytes),
    "Coord": _COORD,
    "Coord | None": _optional(_COORD),
    "NodeInfo": _NODE,
    "NodeInfo | None": _optional(_NODE),
    "tuple[NodeInfo, ...]": _tuple_of(_NODE),
    "tuple[str, ...]": _tuple_of(_STR),
    "tuple[float, ...]": _FieldCodec(list, lambda v: tuple(dec_float(x) for x in dec_list(v))),
    "dict[str, int]": _FieldCodec(dict, _dec_str_int_map),
    "Role": _literal(Role),
    "RefuseCode": _literal(RefuseCode),
    "ErrorCode": _literal(ErrorCode),
    "UnlinkReason": _literal(UnlinkReason),
}.items():
    register_field_type(_ann, _codec.encode, _codec.decode)


@register_message
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message on every connection, from the side that connected.

    Brokers give their coordinate and listen address; clients and admin tools may leave them empty.  A client
    without a certificate authenticates with `token` (checked against the broker's --tokens file).  A broker
    (also when it says HELLO as a client to ask to join) gives its `resilience` level: brokers that keep a
    different number of copies of each topic must not form one overlay (0: not a broker, nothing to check); and
    its `space` (xmin, ymin, xmax, ymax): brokers that place topics in different rectangles would look for the
    same topic at different coordinates (empty: not a broker).
    """

    op: ClassVar[Literal["hello"]] = "hello"
    version: int
    node: str
    role: Role
    coord: Coord | None = None
    listen: str = ""
    token: str = ""
    resilience: int = 0
    space: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check_uint(self.version, "protocol version", 0xFFFF)
        _check_uint(self.resilience, "resilience", 3)
        if self.space and not (len(self.space) == 4 and all(math.isfinite(v) for v in self.space)):
            raise LocalProtocolError(f"a HELLO's space is four finite numbers, got {self.space!r}")
        _check_text(self.token, "token", MAX_TOKEN_LEN)
        _check_id(self.node, "node id")
        if self.coord is not None:
            _check_coord(self.coord, "hello coordinate")
        _check_address(self.listen, "listen address", allow_empty=self.role != "broker")
        if self.role == "broker" and self.coord is None:
            raise LocalProtocolError("a broker's HELLO must carry its coordinate")


_encode_hello_fields: Final = _ENCODERS[Hello]


def _encode_hello(m: Hello) -> Any:
    # Without a resilience level and a space (a client's HELLO) those fields are left out: brokers of version 6
    # and older refuse a field they do not know, and must still read a newer client's HELLO to refuse it in a
    # form it reads.
    wire = _encode_hello_fields(m)
    if isinstance(wire, dict):  # the handshake's messages are maps (MAP_FORM)
        if not m.resilience:
            del wire["resilience"]
        if not m.space:
            del wire["space"]
    return wire


_ENCODERS[Hello] = _encode_hello


@register_message
@dataclass(frozen=True, slots=True)
class HelloOk(Message):
    """The accepting broker's answer to HELLO: the connection is established; here is who I am."""

    op: ClassVar[Literal["hello_ok"]] = "hello_ok"
    version: int
    node: NodeInfo

    def __post_init__(self) -> None:
        _check_uint(self.version, "protocol version", 0xFFFF)


@register_message
@dataclass(frozen=True, slots=True)
class Refuse(Message):
    """A HELLO or a JOIN is refused; the connection is closed after it.  corr is the JOIN's, else 0."""

    op: ClassVar[Literal["refuse"]] = "refuse"
    code: RefuseCode
    text: str
    corr: int = 0

    def __post_init__(self) -> None:
        _check_text(self.text, "refuse text")
        _check_uint(self.corr, "correlation id", MAX_CORR)


@register_message
@dataclass(frozen=True, slots=True)
class Join(Message):
    """A new broker asks to join; routed to its own coordinate so the closest live broker answers.

    The newcomer sends it to a bootstrap broker with origin None; the bootstrap fills in itself as origin and
    routes it, and the answer (JOIN_ACCEPT or REFUSE) is routed back to the origin's coordinate.
    """

    op: ClassVar[Literal["join"]] = "join"
    corr: int
    node: NodeInfo
    origin: NodeInfo | None = None

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)


@register_message
@dataclass(frozen=True, slots=True)
class JoinAccept(Message):
    """The closest broker's view for a newcomer: itself and its neighbours (the first candidates)."""

    op: ClassVar[Literal["join_accept"]] = "join_accept"
    corr: int
    node: NodeInfo
    neighbours: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_list(self.neighbours, "join_accept neighbours")


@register_message
@dataclass(frozen=True, slots=True)
class Neighbours(Message):
    """The sender's current desired neighbour set; sent when it changes and when a link comes up."""

    op: ClassVar[Literal["neighbours"]] = "neighbours"
    neighbours: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        _check_list(self.neighbours, "neighbour list")


@register_message
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Heartbeat; the peer answers PONG with the same seq."""

    op: ClassVar[Literal["ping"]] = "ping"
    seq: int

    def __post_init__(self) -> None:
        _check_uint(self.seq, "ping seq", MAX_CORR)


@register_message
@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Answer to PING."""

    op: ClassVar[Literal["pong"]] = "pong"
    seq: int

    def __post_init__(self) -> None:
        _check_uint(self.seq, "pong seq", MAX_CORR)


@register_message
@dataclass(frozen=True, slots=True)
class Leave(Message):
    """The sender leaves the overlay; its neighbour list lets the receivers fill the hole at once."""

    op: ClassVar[Literal["leave"]] = "leave"
    neighbours: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        _check_list(self.neighbours, "leave neighbours")


@register_message
@dataclass(frozen=True, slots=True)
class Unlink(Message):
    """The sender closes this link but stays in the overlay (not a Delaunay edge any more, or a duplicate)."""

    op: ClassVar[Literal["unlink"]] = "unlink"
    reason: UnlinkReason


@register_message
@dataclass(frozen=True, slots=True)
class RouteProbe(Message):
    """Find the broker closest to target and the path to it.

    From an admin tool: origin None, empty path.  In the overlay (ROUTED with FLAG_TRACE): origin is the
    broker that started the probe and every broker that receives it appends itself to path.
    """

    op: ClassVar[Literal["route_probe"]] = "route_probe"
    corr: int
    target: Coord
    origin: NodeInfo | None = None
    path: tuple[NodeInfo, ...] = ()

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_coord(self.target, "probe target")
        _check_list(self.path, "probe path")


@register_message
@dataclass(frozen=True, slots=True)
class RouteReply(Message):
    """The broker a probe reached (N_1 of the target), the number of overlay hops and the path taken."""

    op: ClassVar[Literal["route_reply"]] = "route_reply"
    corr: int
    node: NodeInfo
    hops: int
    path: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_uint(self.hops, "hop count", MAX_HOP_LIMIT)
        _check_list(self.path, "route path")


@register_message
@dataclass(frozen=True, slots=True)
class Suspect(Message):
    """Broker -> a neighbour it shares with `node`: "my link to node went silent; do you still hear it?".

    A broker declares a neighbour dead only when no common neighbour still hears it: a single broken link
    between two live brokers must not trigger a failover (the underlay-aware SIENA overlay keeps a second,
    disjoint path for exactly this).  Answered by WITNESS."""

    op: ClassVar[Literal["suspect"]] = "suspect"
    corr: int
    node: str

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_id(self.node, "node id")


@register_message
@dataclass(frozen=True, slots=True)
class Witness(Message):
    """The answer to SUSPECT: whether this broker has heard `node` on its own link lately."""

    op: ClassVar[Literal["witness"]] = "witness"
    corr: int
    node: str
    alive: bool

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_id(self.node, "node id")


@register_message
@dataclass(frozen=True, slots=True)
class StatusReq(Message):
    """Ask a broker for its STATUS."""

    op: ClassVar[Literal["status_req"]] = "status_req"
    corr: int

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)


@dataclass(frozen=True, slots=True)
class TopicHeld:
    """A topic a broker holds, its role there (primary, delegate, secondary, tertiary, home) and its bytes.

    `state` is where the replica stands with the other holders (docs/storage.md): caught_up, backfilling (giving
    the next holder the history: the secondary, or at level 3 the tertiary), recovering (read back from disk, not
    yet compared), syncing (pulling what it lacks before it serves), retiring (handing its records on before it
    lets go), moving (a delegation hand-over), placing (Alg. 1 choosing a coordinate).
    `behind` is the bytes not yet confirmed between it and the other holders (a primary: stored, not yet
    confirmed by the secondary; a retiring copy: what it still offers), `pending` the pulls or offers under way.
    """

    topic: str
    role: str
    size: int
    state: str = "caught_up"
    behind: int = 0
    pending: int = 0


def _dec_held(v: Any) -> TopicHeld:
    items = dec_list(v)
    if not 3 <= len(items) <= 6:
        raise ValueError("a held topic is [topic, role, size, state, behind, pending] (the last three optional)")
    state = dec_str(items[3]) if len(items) > 3 else "caught_up"
    behind = dec_int(items[4]) if len(items) > 4 else 0
    pending = dec_int(items[5]) if len(items) > 5 else 0
    return TopicHeld(dec_str(items[0]), dec_str(items[1]), dec_int(items[2]), state, behind, pending)


register_field_type(
    "tuple[TopicHeld, ...]",
    lambda hs: [[h.topic, h.role, h.size, h.state, h.behind, h.pending] for h in hs],
    lambda v: tuple(_dec_held(x) for x in dec_list(v)),
)


# A STATUS lists a broker's first STATUS_PAGE topics (by name) and says how many it holds; HELD_REQ asks for the
# topics after a name, STATUS_PAGE at a time, so that the tools see every topic of a broker holding 100,000.  A
# page of topics of the longest names is ~300 KiB, within MAX_FRAME_SIZE; at most MAX_LIST_LEN.
STATUS_PAGE: Final = 1000

# STATUS `recent` counts the messages a topic's primary stored in this many seconds before it answered:
# `sedax topics` shows recent / RATE_WINDOW as the topic's rate (msg/s).
RATE_WINDOW: Final = 60


@register_message
@dataclass(frozen=True, slots=True)
class Status(Message):
    """A broker's state: itself, its established neighbour links, topics, loads and counters."""

    op: ClassVar[Literal["status"]] = "status"
    corr: int
    node: NodeInfo
    neighbours: tuple[NodeInfo, ...]
    desired: tuple[str, ...]
    topics: tuple[str, ...]
    loads: dict[str, int]
    counters: dict[str, int]
    resilience: int
    held: tuple[TopicHeld, ...] = ()
    # Per topic held as primary or delegate: messages stored in the last RATE_WINDOW s (and still kept).  A
    # STATUS of a broker that predates the field decodes to {}: the CLI then shows no rate.
    recent: dict[str, int] = field(default_factory=dict)
    # What runs and since when: the broker's package version, the wall-clock time it started and when its TLS
    # certificate (or the CA that issued it, if earlier) expires (both epoch seconds; expiry 0 = plain TCP).  A
    # STATUS of a broker that predates them decodes to these defaults: the CLI then leaves them out.
    version: str = ""
    started: float = 0.0
    certificate_expires: float = 0.0
    # False from a refused reload (SIGHUP) until one takes effect: the broker runs on its earlier files.
    reload_ok: bool = True
    # How many entries `held` has in all (a topic held as home and as a copy is two): STATUS lists the first
    # STATUS_PAGE or so by name, HELD_REQ asks for the rest.  A STATUS of a broker that predates the field decodes
    # to 0: its `held` is then all the tools see.
    held_total: int = 0
    # When the first CRL of the broker's --tls-crl is due (its nextUpdate, epoch seconds): past it every new link
    # and client fails its handshake.  0: no CRL, or a broker that predates the field.
    crl_next_update: float = 0.0

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_uint(self.held_total, "status held_total", MAX_CORR)
        _check_text(self.version, "status version")
        _check_list(self.held, "status held topics")
        _check_list(self.neighbours, "status neighbours")
        _check_list(self.desired, "status desired")
        _check_list(self.topics, "status topics")
        _check_uint(self.resilience, "resilience", 3)


@register_message
@dataclass(frozen=True, slots=True)
class HeldReq(Message):
    """Ask a broker for the topics it holds after `after` in name order: the pages that follow STATUS's `held`."""

    op: ClassVar[Literal["held_req"]] = "held_req"
    corr: int
    after: str

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_text(self.after, "held_req after")


@register_message
@dataclass(frozen=True, slots=True)
class HeldPage(Message):
    """The answer to HELD_REQ: the next STATUS_PAGE topics at most, as STATUS's `held` and `recent` list them, and
    whether more follow (ask again after the last name)."""

    op: ClassVar[Literal["held_page"]] = "held_page"
    corr: int
    held: tuple[TopicHeld, ...]
    recent: dict[str, int]
    more: bool

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_list(self.held, "held_page held topics")


@register_message
@dataclass(frozen=True, slots=True)
class Error(Message):
    """A request (matched by corr) failed; the connection stays open."""

    op: ClassVar[Literal["error"]] = "error"
    corr: int
    code: ErrorCode
    text: str

    def __post_init__(self) -> None:
        _check_uint(self.corr, "correlation id", MAX_CORR)
        _check_text(self.text, "error text")


# -------------------------------------------------------------------------------------------------- frames


class ControlFrame(NamedTuple):
    """A decoded CONTROL frame."""

    message: Message


class RoutedFrame(NamedTuple):
    """A ROUTED frame: destination, hop counter and limit, flags, and the still-encoded body.

    A NamedTuple rather than a dataclass because a busy broker builds ~10^5 of these per second.
    """

    x: float
    y: float
    hops: int
    hop_limit: int
    flags: int
    body: bytes


Frame: TypeAlias = ControlFrame | RoutedFrame


def encode_message(msg: Message, limit: int = MAX_FRAME_SIZE) -> bytes:
    """The msgpack body of a message (used inside CONTROL frames and as the body of ROUTED frames), at most a
    frame of `limit` bytes: MAX_FRAME_SIZE for what may reach a client, MAX_LINK_FRAME_SIZE between brokers."""
    enc = _ENCODERS.get(type(msg))
    if enc is None:
        raise LocalProtocolError(f"{type(msg).__name__} is not a registered message type")
    return check_body(msg.op, _packb(enc(msg)), limit)


def check_body(op: str, data: bytes, limit: int = MAX_FRAME_SIZE) -> bytes:
    """data, the encoded body of an op message, if it fits a frame of `limit` bytes (routed, the larger
    envelope), else LocalProtocolError: encode_message's check, for a message type's own fast encoder too."""
    if len(data) + _ROUTED_PREFIX_LEN > limit:
        raise LocalProtocolError(f"{op} encodes to {len(data)} bytes, over the frame limit of {limit}")
    return data


def _message_from_wire(wire: Any) -> Message:
    if type(wire) is list:
        op = wire[0] if wire else None
        adec = _ARRAY_DECODERS.get(op) if type(op) is str else None
        if adec is None:
            raise ValueError(f"unknown op {op!r}")
        return adec(wire)
    if type(wire) is not dict:
        raise TypeError(f"a message is an array or a map, got {type(wire).__name__}")
    op = wire.pop("op", None)
    dec = _DECODERS.get(op) if type(op) is str else None
    if dec is None:
        raise ValueError(f"unknown op {op!r}")
    try:
        return dec(wire)
    except KeyError as exc:
        raise ValueError(f"{op}: missing field {exc.args[0]!r}") from None


def decode_message(data: bytes) -> Message:
    """Decode one msgpack-encoded message, raising RemoteProtocolError for anything malformed."""
    try:
        # unpackb derives its max_*_len limits from len(data), which MAX_FRAME_SIZE bounds; the explicit
        # limits below are tighter where the protocol allows it (no ext types at all); each field's decoder then
        # holds its arrays to MAX_LIST_LEN, or MAX_LONG_LIST_LEN where they grow with a topic.
        wire = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_LINK_FRAME_SIZE,
            max_bin_len=MAX_LINK_FRAME_SIZE,
            max_array_len=MAX_LONG_LIST_LEN,
            max_map_len=MAX_LONG_LIST_LEN,
            max_ext_len=0,
        )
        return _message_from_wire(wire)
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, LocalProtocolError) as exc:
        raise RemoteProtocolError(f"bad message: {exc}") from exc


def encode_control(msg: Message) -> bytes:
    """One CONTROL frame carrying msg."""
    return control_frame(encode_message(msg))


def control_frame(body: bytes) -> bytes:
    """One CONTROL frame around an encoded message body (encode_control, or a message type's own fast encoder
    such as overlay.pubsub.PublishFrames)."""
    return _PREFIX.pack(len(body) + 1, FrameKind.CONTROL) + body


def _check_routed(x: float, y: float, hops: int, hop_limit: int, flags: int) -> None:
    _check_coord((x, y), "routed destination")
    if not 1 <= hop_limit <= MAX_HOP_LIMIT:
        raise LocalProtocolError(f"hop limit must be in 1..{MAX_HOP_LIMIT}, got {hop_limit}")
    if not 0 <= hops < hop_limit:
        raise LocalProtocolError(f"hop count must be in 0..{hop_limit - 1} (links crossed before this one), got {hops}")
    if flags & ~KNOWN_FLAGS or flags < 0:
        raise LocalProtocolError(f"unknown routed flags {flags:#x}")


def append_routed(
    buf: bytearray, x: float, y: float, body: bytes, *, hop_limit: int, hops: int = 0, flags: int = 0
) -> None:
    """Append one ROUTED frame to buf: the cheap way to build a batch of frames for one write()."""
    _check_routed(x, y, hops, hop_limit, flags)
    length = 1 + ROUTED_HEADER.size + len(body)
    if length > MAX_LINK_FRAME_SIZE:
        raise LocalProtocolError(f"routed frame of {length} bytes is over MAX_LINK_FRAME_SIZE")
    buf += _PREFIX.pack(length, FrameKind.ROUTED)
    buf += ROUTED_HEADER.pack(x, y, hops, hop_limit, flags)
    buf += body


def encode_routed(dest: Coord, body: bytes, *, hop_limit: int, hops: int = 0, flags: int = 0) -> bytes:
    """One ROUTED frame addressed to dest with an opaque body."""
    buf = bytearray()
    append_routed(buf, dest[0], dest[1], body, hop_limit=hop_limit, hops=hops, flags=flags)
    return bytes(buf)


def encode_routed_message(dest: Coord, msg: Message, *, hop_limit: int, flags: int = 0) -> bytes:
    """One ROUTED frame addressed to dest whose body is msg."""
    return encode_routed(dest, encode_message(msg), hop_limit=hop_limit, flags=flags)


def forward_routed(frame: RoutedFrame, body: bytes | None = None) -> bytes:
    """The frame as the next hop receives it: hop count + 1, body unchanged unless a new one is given.

    `hops` counts the links crossed before the current one (the originator writes 0), so a receiver has seen
    hops + 1 links.  A frame may cross at most hop_limit links: the caller checks `may_forward` first.
    """
    b = frame.body if body is None else body
    if not may_forward(frame):
        raise LocalProtocolError(f"hop limit {frame.hop_limit} reached; the frame must be dropped")
    return b"".join(
        (
            _PREFIX.pack(1 + ROUTED_HEADER.size + len(b), FrameKind.ROUTED),
            ROUTED_HEADER.pack(frame.x, frame.y, frame.hops + 1, frame.hop_limit, frame.flags),
            b,
        )
    )


def may_forward(frame: RoutedFrame) -> bool:
    """True if the frame may cross one more link without exceeding its hop limit."""
    return frame.hops + 1 < frame.hop_limit


class FrameDecoder:
    """Incremental frame parser: feed received bytes, get complete frames.

    `feed(b"")` signals EOF; EOF inside a frame is a RemoteProtocolError.  After any error the decoder stays
    broken (every later feed raises the same error) because the byte stream has lost its framing.
    """

    __slots__ = ("_buf", "_eof", "_error", "max_frame_size")

    def __init__(self, max_frame_size: int = MAX_FRAME_SIZE) -> None:
        if not 1 + ROUTED_HEADER.size <= max_frame_size <= MAX_LINK_FRAME_SIZE:
            raise LocalProtocolError(f"max_frame_size must be in {1 + ROUTED_HEADER.size}..{MAX_LINK_FRAME_SIZE}")
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._eof = False
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        """Add received bytes (b"" = EOF) and return every frame they complete, in order."""
        if self._error is not None:
            raise self._error
        if self._eof:
            raise LocalProtocolError("feed() after EOF")
        if not data:
            self._eof = True
            if self._buf:
                self._fail(f"connection closed inside a frame ({len(self._buf)} bytes pending)")
            return []
        # The common read holds whole frames only: with nothing left over from the last read they are cut from
        # the bytes received as they are (one copy per frame), and only a partial frame at the end is kept.
        buf: bytes | bytearray = self._buf
        if buf:
            self._buf += data
        else:
            buf = data
        out: list[Frame] = []
        pos = 0
        end_of_data = len(buf)
        limit = self.max_frame_size
        try:
            while end_of_data - pos >= 4:
                # The length is checked as soon as it is known, before any of the body is waited for.
                (length,) = _LEN.unpack_from(buf, pos)
                if length > limit:
                    self._fail(f"frame length {length} exceeds the limit of {limit} bytes")
                if length == 0:
                    self._fail("frame length 0 (a frame has at least its kind byte)")
                end = pos + 4 + length
                if end > end_of_data:
                    break
                kind = buf[pos + 4]
                start = pos + 5
                if kind == FrameKind.ROUTED:
                    if length < 1 + ROUTED_HEADER.size:
                        self._fail(f"routed frame of {length} bytes is shorter than its header")
                    x, y, hops, hop_limit, flags = ROUTED_HEADER.unpack_from(buf, start)
                    if not (abs(x) <= MAX_COORD_ABS and abs(y) <= MAX_COORD_ABS):  # also false for NaN
                        self._fail(f"routed destination ({x}, {y}) is not a finite coordinate")
                    if hops >= hop_limit:
                        self._fail(f"routed frame has crossed {hops + 1} links, over its hop limit {hop_limit}")
                    if flags & ~KNOWN_FLAGS:
                        self._fail(f"unknown routed flags {flags:#x}")
                    out.append(RoutedFrame(x, y, hops, hop_limit, flags, bytes(buf[start + ROUTED_HEADER.size : end])))
                elif kind == FrameKind.CONTROL:
                    out.append(ControlFrame(decode_message(bytes(buf[start:end]))))
                else:
                    self._fail(f"unknown frame kind {kind}")
                pos = end
        except RemoteProtocolError as exc:
            self._error = exc
            self._buf = bytearray()
            raise
        if buf is data:
            if pos < end_of_data:
                self._buf += data[pos:]
        else:
            del self._buf[:pos]
        return out

    @staticmethod
    def _fail(text: str) -> NoReturn:
        raise RemoteProtocolError(text)
