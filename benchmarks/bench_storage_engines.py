"""Which engine can carry the disk-backed topic store?  The append path of each, same records, same run.

The broker stores what one loop turn brought for a topic as one batch (then replicates, acknowledges and
delivers it), so every engine is driven the same way: batches of --batch records of --size payload bytes, one
commit per batch, with the engine's cheapest durable-enough setting ("nosync": the OS page cache, like
`--fsync never`/`interval`) and its fully synchronous one ("sync": like `--fsync batch`, one sync per batch).

    .venv/bin/python benchmarks/bench_storage_engines.py --records 200000 --batch 64 --size 100

Engines: the in-memory deque the broker uses today (the reference), our own segment files (length + CRC32
framing, msgpack bodies, append-only), SQLite in WAL mode (standard library), LMDB (`lmdb`) and RocksDB
(`rocksdict`); the last two are optional (pip install lmdb rocksdict).  Results and the decision are in
docs/benchmarks.md ("Storage engine").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import struct
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack

Row = tuple[float, str, int, bytes]
# Batches go to this many topics in turn, as a broker holding several topics writes them.
TOPICS = 16
_HEAD = struct.Struct(">II")


def rows(n: int, size: int) -> list[Row]:
    payload = os.urandom(size)
    t0 = time.time()
    return [(t0 + i * 1e-5, "pub-4f2a9c", i, payload) for i in range(n)]


def batches(data: list[Row], batch: int) -> Iterator[list[Row]]:
    for i in range(0, len(data), batch):
        yield data[i : i + batch]


def memory(data: list[Row], batch: int, _dir: Path, _sync: bool) -> None:
    log: deque[Row] = deque()
    for b in batches(data, batch):
        log.extend(b)


def segments(data: list[Row], batch: int, directory: Path, sync: bool) -> None:
    pack = msgpack.Packer(use_bin_type=True).pack
    crc = zlib.crc32
    head = _HEAD.pack
    fds = [os.open(directory / f"{t}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND) for t in range(TOPICS)]
    for k, b in enumerate(batches(data, batch)):
        fd = fds[k % TOPICS]  # one segment file per topic
        out = bytearray()
        for r in b:
            body = pack(r)
            out += head(len(body), crc(body))
            out += body
        os.write(fd, out)
        if sync:
            os.fdatasync(fd)
    for fd in fds:
        os.close(fd)


def sqlite(data: list[Row], batch: int, directory: Path, sync: bool) -> None:
    db = sqlite3.connect(directory / "store.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={'FULL' if sync else 'OFF'}")
    db.execute("CREATE TABLE m (topic INTEGER, ts REAL, publisher TEXT, seq INTEGER, payload BLOB)")
    db.execute("CREATE INDEX m_ts ON m (topic, ts)")  # FETCH since ts
    for k, b in enumerate(batches(data, batch)):
        db.execute("BEGIN")
        db.executemany(f"INSERT INTO m VALUES ({k % TOPICS}, ?, ?, ?, ?)", b)
        db.execute("COMMIT")
    db.close()


def lmdb_engine(data: list[Row], batch: int, directory: Path, sync: bool) -> None:
    import lmdb

    # No writemap: with it a full disk (or tmpfs) ends the process with SIGBUS instead of an error.
    env = lmdb.open(str(directory), map_size=1 << 34, sync=sync, metasync=sync)
    pack = msgpack.Packer(use_bin_type=True).pack
    key = struct.Struct(">Id").pack  # (topic number, ts): the topics of a broker interleave in one tree
    for k, b in enumerate(batches(data, batch)):
        topic = k % TOPICS
        with env.begin(write=True) as txn:
            for r in b:
                txn.put(key(topic, r[0]), pack(r))
    env.close()


def rocks(data: list[Row], batch: int, directory: Path, sync: bool) -> None:
    from rocksdict import Options, Rdict, WriteBatch, WriteOptions

    db = Rdict(str(directory / "rocks"), Options(raw_mode=True))
    wo = WriteOptions()
    wo.sync = sync
    pack = msgpack.Packer(use_bin_type=True).pack
    key = struct.Struct(">Id").pack
    for k, b in enumerate(batches(data, batch)):
        topic = k % TOPICS
        wb = WriteBatch(raw_mode=True)
        for r in b:
            wb.put(key(topic, r[0]), pack(r))
        db.write(wb, wo)
    db.close()


ENGINES: dict[str, Callable[[list[Row], int, Path, bool], None]] = {
    "memory": memory,
    "segments": segments,
    "sqlite-wal": sqlite,
    "lmdb": lmdb_engine,
    "rocksdb": rocks,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--sync-records", type=int, default=20_000, help="records for the sync runs (slower)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for name, fn in ENGINES.items():
        for sync in (False, True):
            if name == "memory" and sync:
                continue
            n = args.sync_records if sync else args.records
            data = rows(n, args.size)
            d = Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=args.dir))
            try:
                t = time.perf_counter()
                fn(data, args.batch, d, sync)
                dt = time.perf_counter() - t
            except ImportError as exc:
                print(f"{name}: skipped ({exc})")
                continue
            finally:
                shutil.rmtree(d, ignore_errors=True)
            rate = n / dt
            results.append({"engine": name, "sync": sync, "records": n, "msg_per_s": rate, "us_per_msg": 1e6 / rate})
            if not args.json:
                mode = "sync per batch" if sync else "no sync"
                print(f"{name:11s} {mode:15s} {rate:12,.0f} msg/s  {1e6 / rate:7.2f} µs/msg")
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
