"""The on-disk record frame of a topic segment, encoded and scanned without touching files (sans-IO).

A frame is MAGIC (2 bytes), the body length (u32, big-endian), the CRC-32 of the body (u32) and the body: the
msgpack array [ts, publisher, seq, payload] of one stored message.  The magic lets a scan find the next frame
after a damaged one; the CRC tells a damaged body from a whole one.

`scan` classifies every byte of a segment: whole records, damaged stretches in the middle (skipped and
reported; the records after them are still served) and a torn tail (an append that a crash cut short: no whole
frame follows it, so recovery truncates it).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final, TypeAlias

import msgpack

MAGIC: Final = b"\xa5\x5a"
HEADER: Final = struct.Struct(">2sII")  # magic, body length, CRC-32 of the body
# No stored message comes near this (the largest PUBLISH frame is 1 MiB); a longer length is damage.
MAX_BODY: Final = 16 << 20

Row: TypeAlias = tuple[float, str, int, bytes]  # (ts, publisher, seq, payload), as broker/store.py keeps it

_pack = msgpack.Packer(use_bin_type=True).pack
_crc = zlib.crc32
_head = HEADER.pack


def encode(row: Row) -> bytes:
    """One frame for row."""
    body: bytes = _pack(row)
    return _head(MAGIC, len(body), _crc(body)) + body


def encode_into(out: bytearray, row: Row) -> int:
    """Append row's frame to out; returns the frame's length (the append path: no intermediate bytes)."""
    body = _pack(row)
    out += _head(MAGIC, len(body), _crc(body))
    out += body
    return HEADER.size + len(body)


@dataclass(frozen=True, slots=True)
class Damaged:
    """A stretch [start, end) of a segment that holds no whole record."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a segment holds: its records (with their offsets), damaged stretches, and a torn tail if any."""

    rows: list[Row]
    damaged: list[Damaged]
    torn_at: int | None  # offset from which the end of the segment is an unfinished append; None if whole
    valid_end: int  # end of the last whole record


def _record_at(buf: bytes | memoryview, off: int) -> tuple[Row, int] | None:
    """The record whose frame starts at off and the offset after it, or None if there is no whole one."""
    if len(buf) - off < HEADER.size:
        return None
    magic, n, crc = HEADER.unpack_from(buf, off)
    if magic != MAGIC or n > MAX_BODY:
        return None
    start = off + HEADER.size
    end = start + n
    if end > len(buf):
        return None
    body = buf[start:end]
    if _crc(body) != crc:
        return None
    try:
        ts, publisher, seq, payload = msgpack.unpackb(body, use_list=False, raw=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if not (type(ts) is float and type(publisher) is str and type(seq) is int and type(payload) is bytes and seq >= 0):
        return None
    return (ts, publisher, seq, payload), end


def _next_frame(buf: bytes | memoryview, start: int) -> int | None:
    """Offset of the next whole frame at or after start, or None."""
    data = bytes(buf) if isinstance(buf, memoryview) else buf
    at = data.find(MAGIC, start)
    while at != -1:
        if _record_at(data, at) is not None:
            return at
        at = data.find(MAGIC, at + 1)
    return None


def scan(buf: bytes) -> ScanResult:
    """Every record of a segment's bytes, in file order, with what is damaged and where a torn tail starts."""
    rows: list[Row] = []
    damaged: list[Damaged] = []
    off = 0
    valid_end = 0
    size = len(buf)
    while off < size:
        got = _record_at(buf, off)
        if got is not None:
            row, off = got
            rows.append(row)
            valid_end = off
            continue
        nxt = _next_frame(buf, off + 1)
        if nxt is None:
            # Nothing whole follows: an append cut short by a crash (or damage at the very end, which recovery
            # cannot tell apart and treats the same way: it truncates).
            return ScanResult(rows, damaged, off, valid_end)
        damaged.append(Damaged(off, nxt))
        off = nxt
    return ScanResult(rows, damaged, None, valid_end)
