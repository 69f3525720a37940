"""The disk log (broker/storage): frames, write policies, segments and retention, recovery, crashes, a full disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import broker.storage.disklog
from broker.pubsub import PubSub, PubSubConfig
from broker.storage import DiskStore, FsyncMode, FsyncPolicy, StorageError, StorageFull, SyncFailed, TopicMeta
from broker.storage.files import OpenFiles
from broker.storage.frames import HEADER, encode, scan
from broker.store import Retention, TopicStore
from overlay.protocol import ControlFrame, FrameDecoder, Message, NodeInfo
from overlay.pubsub import Ack, Delegation, Failed, Fetch, Fetched, Nack, Publish, Record
from tests import tmpfs
from tests.cluster import wait_for

TMPFS_MISSING = tmpfs.unavailable()

ROOT = Path(__file__).resolve().parent.parent
WRITER = Path(__file__).with_name("storage_writer.py")
META = TopicMeta("grid/feeder-1/voltage", (0.25, 0.75), (0.5, 0.5))


def _rows(n: int, start: int = 0, pub: str = "pub-1") -> list[tuple[float, str, int, bytes]]:
    return [(100.0 + i, pub, i, f"m{i}".encode()) for i in range(start, start + n)]


# ---- frames ------------------------------------------------------------------------------------------------


def test_frames_round_trip_and_damage_in_the_middle_is_skipped() -> None:
    rows = _rows(5)
    frames = [encode(r) for r in rows]
    buf = bytearray(b"".join(frames))
    assert scan(bytes(buf)).rows == rows
    # Flip one payload byte of the third record: its CRC fails, the records around it are still read.
    third = sum(len(f) for f in frames[:2])
    buf[third + len(frames[2]) - 1] ^= 0xFF
    result = scan(bytes(buf))
    assert result.rows == rows[:2] + rows[3:]
    assert len(result.damaged) == 1
    assert (result.damaged[0].start, result.damaged[0].end) == (third, third + len(frames[2]))
    assert result.torn_at is None


def test_a_torn_tail_is_told_apart_from_damage() -> None:
    rows = _rows(3)
    whole = b"".join(encode(r) for r in rows)
    cut = whole + encode((200.0, "pub-1", 3, b"unfinished"))[: HEADER.size + 2]
    result = scan(cut)
    assert result.rows == rows
    assert result.torn_at == len(whole) == result.valid_end
    assert result.damaged == []


def test_garbage_that_is_not_a_frame_is_never_a_record() -> None:
    junk = os.urandom(4096).replace(b"\xa5\x5a", b"\x00\x00")
    assert scan(junk).rows == []


# ---- policies ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mode", "interval"),
    [("always", FsyncMode.ALWAYS, 0.0), ("batch", FsyncMode.BATCH, 0.0), ("never", FsyncMode.NEVER, 0.0),
     ("interval:200", FsyncMode.INTERVAL, 0.2), ("interval:2.5", FsyncMode.INTERVAL, 0.0025)],
)  # fmt: skip
def test_policy_parses(text: str, mode: FsyncMode, interval: float) -> None:
    policy = FsyncPolicy.parse(text)
    assert (policy.mode, policy.interval) == (mode, interval)
    assert FsyncPolicy.parse(str(policy)) == policy


@pytest.mark.parametrize("text", ["sometimes", "interval", "interval:", "interval:-5", "interval:nan", "batch:3", ""])
def test_bad_policy_names_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="--fsync"):
        FsyncPolicy.parse(text)


# ---- the disk log ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["always", "batch", "interval:50", "never"])
def test_records_come_back_after_a_restart(tmp_path: Path, policy: str) -> None:
    store = DiskStore(tmp_path, FsyncPolicy.parse(policy))
    log = store.open_log(META)
    for r in _rows(30):
        log.stage(r)
    log.persist()
    store.sync_due(time.time())
    store.close()
    found, report = DiskStore(tmp_path, FsyncPolicy.parse(policy)).recover()
    assert [f.meta for f in found] == [META]
    assert found[0].rows == _rows(30)
    assert found[0].last_seq == {"pub-1": 29}
    assert (report.topics, report.records, report.torn_bytes, report.damaged_stretches) == (1, 30, 0, 0)


def test_retention_deletes_whole_segments_and_dedup_state_outlives_them(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FsyncPolicy.parse("batch"), segment_bytes=256)
    log = store.open_log(META)
    for r in _rows(40):
        log.stage(r)
        log.persist()
    segments = log.segment_count
    assert segments > 3
    # Everything before ts 130 has expired from memory: the segments holding only such records go.
    freed = log.expire(130.0, {"pub-1": (39, 139.0)})
    assert freed > 0 and log.segment_count < segments
    store.close()
    found, _ = DiskStore(tmp_path, FsyncPolicy.parse("batch"), segment_bytes=256).recover()
    kept = found[0].rows
    assert kept == _rows(40)[-len(kept) :] and kept[0][0] <= 130.0
    # Nothing left: the log starts over, and the publisher's last seq is still known (a re-send is a duplicate).
    store2 = DiskStore(tmp_path, FsyncPolicy.parse("batch"), segment_bytes=256)
    found, _ = store2.recover()
    log2 = store2.open_log(META)
    log2.expire(None, {"pub-1": (39, 139.0)})
    store2.close()
    found, _ = DiskStore(tmp_path, FsyncPolicy.parse("batch")).recover()
    assert found[0].rows == [] and found[0].last_seq == {"pub-1": 39}


def test_rewrite_replaces_the_history(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FsyncPolicy.parse("batch"))
    log = store.open_log(META)
    for r in _rows(10):
        log.stage(r)
    log.persist()
    log.rewrite(_rows(5, start=20, pub="pub-2"), {"pub-1": (9, 109.0), "pub-2": (24, 124.0)})
    store.close()
    found, _ = DiskStore(tmp_path, FsyncPolicy.parse("batch")).recover()
    assert found[0].rows == _rows(5, start=20, pub="pub-2")
    assert found[0].last_seq == {"pub-1": 9, "pub-2": 24}


def test_a_damaged_record_in_the_middle_is_reported_and_the_rest_served(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FsyncPolicy.parse("batch"))
    log = store.open_log(META)
    for r in _rows(20):
        log.stage(r)
    log.persist()
    store.close()
    (seg,) = sorted((tmp_path / "topics").glob("*/*.seg"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x55
    seg.write_bytes(bytes(data))
    found, report = DiskStore(tmp_path, FsyncPolicy.parse("batch")).recover()
    assert report.damaged_stretches == 1 and report.damaged_bytes > 0
    assert len(found[0].rows) == 19  # exactly the damaged record is missing
    assert "damaged" in str(report)


def test_a_copy_follows_its_coordinate_and_delegate_list_across_a_restart(tmp_path: Path) -> None:
    # A copy's meta.json is written again when the coordinate it is held for or its delegate list changes (a
    # move), so a restart puts it back where the topic was and tells how recent that is; a meta.json written
    # before delegate lists were kept still reads, as a topic that never moved.
    store = _store(tmp_path, "batch")
    log = store.ensure("grid/moved", (0.3, 0.4), (0.3, 0.4))
    log.append(Record(100.0, "pub-1", 0, b"x"), 100.0)
    log.persist()
    moved = (((0.3, 0.4), 0.0), ((0.9, 0.1), 1234.5))
    log.relocate((0.9, 0.1), moved)
    store.close()
    again = _store(tmp_path, "batch")
    (meta,), _ = again.recover(200.0)
    assert (meta.coord, meta.home, meta.delegates) == ((0.9, 0.1), (0.3, 0.4), moved)
    again.close()
    path = next((tmp_path / "topics").glob("*/meta.json"))
    path.write_text('{"name": "grid/moved", "coord": [0.3, 0.4], "home": [0.3, 0.4]}')
    (old,), _ = _store(tmp_path, "batch").recover(200.0)
    assert (old.coord, old.delegates) == ((0.3, 0.4), ())
    path.write_text('{"name": "grid/moved", "coord": [0.3, 0.4], "home": [0.3, 0.4], "delegates": [7]}')
    found, report = DiskStore(tmp_path, FsyncPolicy.parse("batch")).recover()
    assert found == [] and len(report.unreadable) == 1  # reported and skipped, not a traceback


def test_an_unreadable_directory_is_reported_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "topics" / "not-a-topic").mkdir(parents=True)
    found, report = DiskStore(tmp_path, FsyncPolicy.parse("batch")).recover()
    assert found == [] and report.unreadable == ["not-a-topic"]


# ---- crashes and a full disk -------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("policy", ["always", "batch", "interval:100", "never"])
def test_sigkill_during_a_write_stream_loses_no_persisted_record(tmp_path: Path, policy: str) -> None:
    acked = 0
    with subprocess.Popen(
        [sys.executable, str(WRITER), str(tmp_path), policy, "stream"], stdout=subprocess.PIPE, text=True, env=_env()
    ) as proc:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        try:
            while acked < 3000 and time.monotonic() < deadline:
                line = proc.stdout.readline()
                assert line.startswith("acked "), line
                acked = int(line.split()[1])
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    assert acked >= 3000
    found, report = DiskStore(tmp_path, FsyncPolicy.parse(policy), segment_bytes=64 * 1024).recover()
    (topic,) = found
    seqs = [r[2] for r in topic.rows]
    # Every batch the writer saw persisted is there, in order, once; an unfinished append was truncated.
    assert seqs[:acked] == list(range(acked))
    assert len(seqs) == len(set(seqs))
    assert report.damaged_stretches == 0


def test_a_full_disk_refuses_writes_and_keeps_what_is_stored(tmp_path: Path) -> None:
    if (why := TMPFS_MISSING) is not None:
        pytest.skip(why)
    data = tmp_path / "small"
    data.mkdir()
    # A 512 KiB tmpfs in a private mount namespace (a user namespace where we are not root): a real full disk.
    script = f"mount -t tmpfs -o size=512k tmpfs {data} && exec {sys.executable} {WRITER} {data} batch fill"
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=_env(), timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    full, recovered = res.stdout.splitlines()
    written = int(full.split()[1])
    assert written > 1000 and "no space left" in full and "storage_full" in full
    assert recovered.split()[1] == str(written)  # every persisted record reads back; the failed batch is gone
    assert "damaged" not in recovered


def test_storage_full_is_a_storage_error_with_the_fix(tmp_path: Path) -> None:
    exc = StorageFull(tmp_path)
    assert "free disk space" in str(exc) and str(tmp_path) in str(exc)


# ---- the topic store with its journals -------------------------------------------------------------------------


def _store(
    tmp_path: Path, policy: str = "batch", retention: Retention | None = None, open_files: int = 1 << 20
) -> TopicStore:
    disk = DiskStore(tmp_path, FsyncPolicy.parse(policy), open_files=open_files)
    return TopicStore(retention or Retention(None, None), disk)


@pytest.mark.parametrize("policy", ["always", "batch", "interval:20", "never"])
def test_a_restarted_store_has_its_topics_and_dedup_state(tmp_path: Path, policy: str) -> None:
    store = _store(tmp_path, policy)
    a = store.ensure("grid/a", (0.1, 0.2), (0.3, 0.4))
    b = store.ensure("grid/b", (0.5, 0.5), (0.5, 0.5))
    for i in range(20):
        a.append(Record(100.0 + i, "pub-1", i, b"a%d" % i), 100.0 + i)
    b.merge([Record(200.0 + i, "pub-2", i, b"b") for i in range(5)], 205.0)
    a.persist()
    b.persist()
    store.close()
    again = _store(tmp_path, policy)
    metas, report = again.recover(300.0)
    assert sorted(m.name for m in metas) == ["grid/a", "grid/b"]
    assert next(m for m in metas if m.name == "grid/a").coord == (0.1, 0.2)
    assert report.records == 25
    ra = again.get("grid/a")
    assert ra.records() == a.records() and ra.size == a.size
    assert ra.is_duplicate("pub-1", 19) and not ra.is_duplicate("pub-1", 20)
    assert not ra.append(Record(400.0, "pub-1", 7, b"re-sent"), 400.0)  # a re-send after the restart: dropped
    assert again.get("grid/b").last_seq == {"pub-2": 4}


def test_messages_re_stamped_by_a_merge_come_back_as_re_stamped(tmp_path: Path) -> None:
    # TopicLog.merge moves a held record later to keep its publisher's order and writes it to the journal
    # again: recovery reads the last copy, so the order survives a restart.
    store = _store(tmp_path)
    log = store.ensure("grid/a")
    for i in range(10):
        log.append(Record(128.41 + i * 1e-3, "pub-1", i, b"a%d" % i), 128.5)
    log.persist()
    log.merge([Record(127.85 + i * 1e-3, "pub-1", i, b"a%d" % i) for i in range(14)], 129.0)
    log.persist()
    rows = list(log.rows)
    assert [r[2] for r in rows] == list(range(14))
    store.close()
    again = _store(tmp_path)
    again.recover(130.0)
    assert list(again.get("grid/a").rows) == rows


def test_retention_applies_on_disk_and_at_recovery(tmp_path: Path) -> None:
    store = TopicStore(Retention(50.0, None), DiskStore(tmp_path, FsyncPolicy.parse("batch"), segment_bytes=200))
    log = store.ensure("grid/a")
    for i in range(40):
        log.append(Record(1000.0 + i, "pub-1", i, b"x" * 20), 1000.0 + i)
        log.persist()
    assert len(log.rows) == 40
    assert log.journal is not None
    before = log.journal.segment_count
    log.expire(1075.0)  # everything older than ts 1025 goes, in memory and in whole segments on disk
    assert log.rows[0][0] == 1025.0 and log.journal.segment_count < before
    store.close()
    again = TopicStore(Retention(50.0, None), DiskStore(tmp_path, FsyncPolicy.parse("batch"), segment_bytes=200))
    again.recover(1080.0)
    rows = again.get("grid/a").rows
    assert rows[0][0] == 1030.0 and rows[-1][0] == 1039.0  # retention applied at recovery, nothing more
    assert again.get("grid/a").last_seq == {"pub-1": 39}


def test_a_full_copy_replaces_the_journal(tmp_path: Path) -> None:
    store = _store(tmp_path)
    log = store.ensure("grid/a")
    log.merge([Record(10.0 + i, "pub-1", i, b"old") for i in range(10)], 20.0)
    log.persist()
    log.clear()
    log.merge([Record(50.0 + i, "pub-2", i, b"new") for i in range(3)], 60.0)
    log.persist()
    store.close()
    again = _store(tmp_path)
    again.recover(60.0)
    assert [r.payload for r in again.get("grid/a").records()] == [b"new"] * 3
    assert again.get("grid/a").last_seq == {"pub-1": 9, "pub-2": 2}


def test_a_dropped_topic_leaves_no_files(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.ensure("grid/a").append(Record(1.0, "p", 0, b"x"), 1.0)
    store.get("grid/a").persist()
    store.drop("grid/a")
    assert list((tmp_path / "topics").iterdir()) == []


def test_a_full_disk_rolls_the_failed_records_out_of_memory(tmp_path: Path) -> None:
    if (why := TMPFS_MISSING) is not None:
        pytest.skip(why)
    data = tmp_path / "small"
    data.mkdir()
    script = f"mount -t tmpfs -o size=512k tmpfs {data} && exec {sys.executable} {WRITER} {data} batch store-fill"
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=_env(), timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
    full, recovered = res.stdout.splitlines()
    _, persisted, in_memory, last, *_ = full.split()
    # Memory holds exactly what the disk holds: the batch that found no room is gone from both.
    assert int(persisted) > 1000 and int(in_memory) == int(persisted) and int(last) == int(persisted) - 1
    assert recovered == f"recovered {persisted}"


# ---- group commit: the sync off the event loop --------------------------------------------------------------


async def _durable(log: object) -> StorageError | None:
    """What TopicLog.when_durable reports, awaited (bounded)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[StorageError | None] = loop.create_future()
    log.when_durable(lambda exc: done.set_result(exc))  # type: ignore[attr-defined]
    return await asyncio.wait_for(done, 30.0)


async def test_group_commit_covers_what_was_written_while_a_sync_was_in_flight(tmp_path: Path) -> None:
    # Under `always` and `batch` the fdatasync runs on a worker thread: a persist returns before it, records
    # written meanwhile go into the next round, and a waiter is told only once the round covering it completed.
    store = _store(tmp_path, "batch")
    log = store.ensure("grid/a")
    assert store.disk is not None and log.journal is not None
    committer = store.disk.committer
    order: list[str] = []
    for i in range(3):
        log.append(Record(100.0 + i, "pub-1", i, b"first"), 100.0)
    log.persist()
    first_cover = log.journal.cover
    log.when_durable(lambda exc: order.append(f"first {exc}"))
    assert order == [] and committer.busy  # the sync is on the thread; the loop went on
    for i in range(3, 6):
        log.append(Record(100.0 + i, "pub-1", i, b"second"), 100.0)
    log.persist()
    assert log.journal.cover == first_cover + 1  # written during the first round: covered by the next
    assert await _durable(log) is None
    assert order == ["first None"] and committer.done_round >= first_cover + 1
    log.when_durable(lambda exc: order.append(f"at once {exc}"))  # nothing unsynced: told at once
    assert order[-1] == "at once None"
    store.close()
    again = _store(tmp_path, "batch")
    again.recover(200.0)
    assert [r.seq for r in again.get("grid/a").records()] == list(range(6))
    again.close()


async def test_a_failed_sync_takes_the_records_back_and_says_why(tmp_path: Path) -> None:
    # A sync the disk refuses (here: the log's descriptor is made a pipe, which fdatasync rejects with EINVAL,
    # as a failing disk answers EIO) must never let its records be acknowledged: they leave memory, their
    # publishers' dedup state goes back, and the waiters get an error that says what to do.
    store = _store(tmp_path, "batch")
    log = store.ensure("grid/a")
    assert log.journal is not None
    for i in range(5):
        log.append(Record(100.0 + i, "pub-1", i, b"kept"), 100.0)
    log.persist()
    assert await _durable(log) is None
    fd = log.journal._fd
    saved = os.dup(fd)
    r, w = os.pipe()
    os.dup2(w, fd)
    try:
        for i in range(5, 9):
            log.append(Record(100.0 + i, "pub-1", i, b"refused"), 100.0)
        log.persist()
        exc = await _durable(log)
    finally:
        os.dup2(saved, fd)
        for x in (saved, r, w):
            os.close(x)
    assert isinstance(exc, SyncFailed) and "check the disk" in str(exc)
    assert exc.lost == {("pub-1", i) for i in range(5, 9)}
    assert [m.seq for m in log.records()] == list(range(5)) and log.last_seq == {"pub-1": 4}
    assert (store.tallies[0].size, store.tallies[0].records) == (log.size, 5)  # what memory checks count
    assert not log.is_duplicate("pub-1", 5)  # the publisher's re-send is stored, not taken for a duplicate
    assert log.append(Record(200.0, "pub-1", 5, b"re-sent"), 200.0)
    log.persist()
    assert await _durable(log) is None
    store.close()


def _open_in(directory: Path) -> int:
    """How many descriptors of this process are open on files below directory."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    return n


def test_the_open_files_budget_closes_the_least_recently_written_first() -> None:
    # A file whose sync fails stays open (the group commit reports the failure); the next oldest goes instead.
    files = OpenFiles(2)
    closed: list[str] = []

    class Log:
        def __init__(self, name: str, closes: bool = True) -> None:
            self.name, self.closes = name, closes

        def release_file(self) -> bool:
            if not self.closes:
                return False
            closed.append(self.name)
            files.gone(self)
            return True

    a, b, c, d = Log("a", closes=False), Log("b"), Log("c"), Log("d")
    files.opened(a)
    files.opened(b)
    files.opened(c)  # a cannot close: b goes
    assert closed == ["b"] and len(files) == 2
    files.used(a)
    files.opened(d)  # c is the least recently written now
    assert closed == ["b", "c"] and len(files) == 2 and files.closed == 2
    # A smaller budget (--max-connections raised at a reload) closes the least recently written at once, past
    # one that cannot close; a larger one closes nothing.
    files.resize(3)
    assert closed == ["b", "c"]
    e = Log("e")
    files.opened(e)
    files.resize(1)
    assert closed == ["b", "c", "d", "e"] and len(files) == 1 and files.closed == 4
    with pytest.raises(ValueError, match="at least 1"):
        files.resize(0)


@pytest.mark.parametrize("policy", ["always", "batch", "interval:20", "never"])
async def test_a_data_directory_keeps_at_most_its_budget_of_files_open(tmp_path: Path, policy: str) -> None:
    # 40 topics written in turns through a budget of 4 open files (a broker derives its budget from its
    # open-file limit): the least recently written are closed, synced first when the policy must, so every
    # waiter is told its records are on the disk, nothing is refused, and all of them come back after a restart.
    store = _store(tmp_path, policy, open_files=4)
    disk = store.disk
    assert disk is not None
    names = [f"grid/budget/{i}" for i in range(40)]
    for turn in range(3):
        for i, name in enumerate(names):
            log = store.ensure(name)
            log.append(Record(100.0 + turn, "pub-1", turn, f"{i}-{turn}".encode()), 100.0)
            log.persist()
            assert len(disk.files) <= 4
        assert [await _durable(store.get(n)) for n in names] == [None] * len(names)
        await wait_for(lambda: not disk.committer.busy, 30.0, "the sync round in flight")
        assert _open_in(tmp_path) <= 4
    assert disk.files.closed >= 3 * (40 - 4)
    store.close()
    assert _open_in(tmp_path) == 0
    again = _store(tmp_path, policy, open_files=4)
    again.recover(200.0)
    for i, name in enumerate(names):
        assert [m.payload for m in again.get(name).records()] == [f"{i}-{t}".encode() for t in range(3)]
    assert _open_in(tmp_path) == 0  # recovery reads the segments and opens a file only when it writes
    again.close()


@pytest.mark.parametrize("policy", ["always", "batch"])
def test_a_write_that_finds_no_descriptor_is_refused_and_taken_again(tmp_path: Path, policy: str) -> None:
    # The process has no descriptor left (EMFILE: connections took them, or a limit too low) when a topic's file
    # must be opened: that publish is refused with storage_full naming the fix, not an exception that closed
    # the publisher's connection, and its re-send is stored once a descriptor is free.
    broker = _Alone(_store(tmp_path, policy, open_files=1))
    assert [type(m) for m in broker.request(Publish("grid/fd/a", "P", 0, b"a", 0))] == [Ack]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # the next open fails with EMFILE
    try:
        (refused,) = broker.request(Publish("grid/fd/b", "P", 0, b"b", 0))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert isinstance(refused, Nack) and refused.code == "storage_full", refused
    assert "raise the open-file limit (ulimit -n" in refused.text
    (fetched,) = broker.request(Fetch(7, "grid/fd/b", 0.0))  # nothing of it was stored
    assert isinstance(fetched, Failed) and fetched.code == "unknown_topic", fetched
    (ack,) = broker.request(Publish("grid/fd/b", "P", 0, b"b", 0))
    assert isinstance(ack, Ack) and ack.seq == 0
    broker.ps.close()
    found, _ = DiskStore(tmp_path, FsyncPolicy.parse(policy)).recover()
    assert sorted((f.meta.name, [r[3] for r in f.rows]) for f in found) == [
        ("grid/fd/a", [b"a"]),
        ("grid/fd/b", [b"b"]),
    ]


class _Alone:
    """The pub/sub engine's port for one broker alone (level 1), run in place: no event loop, so every sync
    round runs in place too, and a failing one is seen at once."""

    def __init__(self, store: TopicStore) -> None:
        self._me = NodeInfo("n0", (0.5, 0.5), "127.0.0.1:1")
        self.queue: list[Message] = []
        self.deferred: list[object] = []
        self.inbox: list[Message] = []
        self.ps = PubSub(self, PubSubConfig(resilience=1), store)

    @property
    def me(self) -> NodeInfo:
        return self._me

    def view(self) -> dict[str, NodeInfo]:
        return {"n0": self._me}

    def route(self, dest: tuple[float, float], msg: Message) -> None:
        self.queue.append(msg)

    def to_session(self, session: str, frame: bytes, sent: Message | None = None) -> bool:
        for f in FrameDecoder().feed(frame):
            assert isinstance(f, ControlFrame)
            self.inbox.append(f.message)
        return True

    def now(self) -> float:
        return 1000.0

    def defer(self, fn: object) -> None:
        self.deferred.append(fn)

    def request(self, msg: Message) -> list[Message]:
        self.inbox.clear()
        self.ps.client_message("s", msg)
        while self.queue or self.deferred:
            if self.queue:
                self.ps.routed(self.queue.pop(0))
            else:
                self.deferred.pop(0)()  # type: ignore[operator]
        return list(self.inbox)


def test_a_publish_whose_sync_fails_is_refused_with_storage_full_not_acknowledged(tmp_path: Path) -> None:
    broker = _Alone(_store(tmp_path, "batch"))
    topic = "grid/sync/fails"
    assert [type(m) for m in broker.request(Publish(topic, "P", 0, b"kept", 0))] == [Ack]
    journal = broker.ps.store.get(topic).journal
    assert journal is not None
    fd = journal._fd
    saved = os.dup(fd)
    r, w = os.pipe()
    os.dup2(w, fd)  # fdatasync on a pipe: EINVAL, as a failing disk answers EIO
    try:
        (refused,) = broker.request(Publish(topic, "P", 1, b"lost", 1))
    finally:
        os.dup2(saved, fd)
        for x in (saved, r, w):
            os.close(x)
    assert isinstance(refused, Nack) and refused.code == "storage_full" and refused.seq == 1
    assert "check the disk" in refused.text
    (fetched,) = broker.request(Fetch(7, topic, 0.0))
    assert isinstance(fetched, Fetched) and [m.seq for m in fetched.records] == [0]
    # The publisher re-sends: stored, synced, acknowledged.
    (ack,) = broker.request(Publish(topic, "P", 1, b"again", 1))
    assert isinstance(ack, Ack) and ack.seq == 1
    broker.ps.close()


def test_a_new_copy_of_a_moved_topic_writes_its_meta_once_with_its_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A copy made for a moved topic knows the topic's delegate list before its meta.json is first written: one
    # write that holds it (the meta was written without it, then again with it).  The first write of a record
    # makes the topic's directory (DiskLog._make): a copy that never holds a record leaves nothing on the disk.
    writes: list[Path] = []
    original = broker.storage.disklog.write_atomic

    def counted(path: Path, data: bytes) -> None:
        writes.append(path)
        original(path, data)

    monkeypatch.setattr(broker.storage.disklog, "write_atomic", counted)
    alone = _Alone(_store(tmp_path, "batch"))
    topic = "grid/moved/new-copy"
    home = alone.ps.table.home(topic)
    there = (0.9, 0.1)
    alone.ps.home.delegate_lists[topic] = [Delegation(home, 0.0), Delegation(there, 1234.5)]
    r = alone.ps.holder.replica(topic, there)
    assert (r.coord, r.delegates[-1].coord) == (there, there)
    assert writes == [] and r.log.journal is not None and not r.log.journal.directory.exists()
    r.log.append(Record(100.0, "pub-1", 0, b"first"), 100.0)
    r.log.persist()
    assert [p.name for p in writes] == ["meta.json"]
    meta = TopicMeta.from_json(writes[0].read_bytes())
    assert (meta.coord, meta.delegates) == (there, ((home, 0.0), (there, 1234.5)))
    # A copy for a coordinate the list does not end at keeps the oldest list there is (Replica.place's rule).
    elsewhere = "grid/moved/elsewhere"
    alone.ps.home.delegate_lists[elsewhere] = [Delegation(alone.ps.table.home(elsewhere), 0.0), Delegation(there, 9.0)]
    other = alone.ps.holder.replica(elsewhere, (0.2, 0.2))
    assert [(d.coord, d.start) for d in other.delegates] == [(alone.ps.table.home(elsewhere), 0.0)]
    alone.ps.close()
