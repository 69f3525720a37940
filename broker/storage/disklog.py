"""The disk log of one topic: append-only segment files, a write policy, retention by whole segments, recovery.

Layout (docs/storage.md): `<data-dir>/topics/<sha256(topic)[:32]>/` holds `meta.json` (the topic's name and
coordinates), segment files `000000000001.seg`, `000000000002.seg`, .. of frames (broker/storage/frames.py),
and `dedup.msgpack`, the last sequence number of every publisher, written whenever retention deletes a segment
(the records that carried that state go with it).

Writes go straight to the file descriptor (no user-space buffer), so a crashed or SIGKILLed process loses
nothing it wrote; the policy only decides when the kernel is told to put it on the disk (`FsyncPolicy`).
The in-memory log (broker/store.py TopicLog) stays the one that serves reads: the disk log is its journal,
read back only by recovery.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import msgpack

from broker.storage.commit import GroupCommit
from broker.storage.files import OpenFiles
from broker.storage.frames import Row, encode_into, scan

SEGMENT_SUFFIX: Final = ".seg"
# A topic's data rolls into a new segment past this size, so retention frees space in steps of at most this.
DEFAULT_SEGMENT_BYTES: Final = 8 << 20


class StorageError(Exception):
    """Base of disk-store errors."""

    # (publisher, seq) of the records a failed write or sync took back out of memory (broker/store.py).
    lost: frozenset[tuple[str, int]] = frozenset()


class StorageFull(StorageError):
    """The data directory has no room for more records; publishes are refused until space is freed."""

    def __init__(self, directory: Path, lost: frozenset[tuple[str, int]] = frozenset()) -> None:
        super().__init__(
            f"no space left in {directory}: free disk space or lower --retention-bytes/--retention-seconds; "
            "publishes are refused (storage_full) until then, stored data is still served"
        )
        self.directory = directory
        self.lost = lost  # (publisher, seq) of the records taken back out of memory (broker/store.py)


class SyncFailed(StorageError):
    """fdatasync of a topic's log failed (an I/O error of the disk): what it should have covered is not
    known to be on the disk, so those records were taken back out of memory and not acknowledged."""

    def __init__(self, directory: Path, error: OSError, lost: frozenset[tuple[str, int]] = frozenset()) -> None:
        super().__init__(
            f"the disk did not confirm a write to {directory} ({error}): check the disk (dmesg, SMART); the "
            "records since the last sync were refused (storage_full) and their publishers re-send them"
        )
        self.directory = directory
        self.error = error
        self.lost = lost


class WriteFailed(StorageError):
    """A topic's segment could not be opened or written for another reason than a full disk: an I/O error, a
    file this user may not write, no descriptor left."""

    def __init__(self, directory: Path, error: OSError, lost: frozenset[tuple[str, int]] = frozenset()) -> None:
        fix = (
            "raise the open-file limit (ulimit -n, LimitNOFILE= in systemd) or lower --max-connections"
            if error.errno in (errno.EMFILE, errno.ENFILE)
            else "check the disk and the directory's permissions"
        )
        super().__init__(
            f"cannot write to {directory} ({error.strerror or error}): {fix}; publishes are refused (storage_full) "
            "until a write succeeds, stored data is still served"
        )
        self.directory = directory
        self.error = error
        self.lost = lost


def sync_error(directory: Path, error: OSError, lost: frozenset[tuple[str, int]]) -> StorageError:
    """The error for a failed sync: no room (StorageFull), else SyncFailed."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(directory, lost)
    return SyncFailed(directory, error, lost)


def write_error(directory: Path, error: OSError) -> StorageError:
    """The error for a failed open or write: no room (StorageFull), else WriteFailed."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(directory)
    return WriteFailed(directory, error)


class FsyncMode(enum.Enum):
    """When a written record is forced to the disk (docs/storage.md says what an ACK means under each)."""

    ALWAYS = "always"  # every record written as it is stored, synced (group commit) before its ACK
    BATCH = "batch"  # the records of one loop turn written together, synced (group commit) before their ACK
    INTERVAL = "interval"  # written at once, synced every interval: an OS crash loses at most the interval
    NEVER = "never"  # written at once, synced when the kernel chooses


@dataclass(frozen=True, slots=True)
class FsyncPolicy:
    """A write policy: `always`, `batch`, `interval:MS` or `never`."""

    mode: FsyncMode = FsyncMode.BATCH
    interval: float = 0.0  # seconds, INTERVAL only

    @classmethod
    def parse(cls, text: str) -> FsyncPolicy:
        """The policy named by text; ValueError names the accepted forms."""
        name, _, arg = text.strip().partition(":")
        try:
            mode = FsyncMode(name)
        except ValueError:
            raise ValueError(f"--fsync must be always, batch, interval:MS or never, got {text!r}") from None
        if mode is FsyncMode.INTERVAL:
            try:
                ms = float(arg)
            except ValueError:
                raise ValueError(f"--fsync interval needs milliseconds, as in interval:200, got {text!r}") from None
            if not (math.isfinite(ms) and ms > 0):
                raise ValueError(f"--fsync interval must be a positive number of milliseconds, got {text!r}")
            return cls(mode, ms / 1000.0)
        if arg:
            raise ValueError(f"--fsync {name} takes no argument, got {text!r}")
        return cls(mode)

    @property
    def before_ack(self) -> bool:
        """An ACK (and a copy's confirmation) waits until the record is on the disk."""
        return self.mode in (FsyncMode.ALWAYS, FsyncMode.BATCH)

    def __str__(self) -> str:
        if self.mode is FsyncMode.INTERVAL:
            return f"interval:{self.interval * 1000:g}"
        return str(self.mode.value)


def topic_dirname(name: str) -> str:
    """The directory of a topic below `<data-dir>/topics/`: topic names may hold '/' and any character."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:32]


@dataclass(slots=True)
class _Segment:
    number: int
    path: Path
    size: int = 0
    max_ts: float = -math.inf


def _segment_path(directory: Path, number: int) -> Path:
    return directory / f"{number:012d}{SEGMENT_SUFFIX}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace path's content with data so that a crash leaves either the old or the new file, never half."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(frozen=True, slots=True)
class TopicMeta:
    """What a topic's directory says about the topic besides its records."""

    name: str
    coord: tuple[float, float]  # C(t): the coordinate this copy is held for (written again when it changes)
    home: tuple[float, float]  # h(t)
    # The topic's delegate list as this copy knows it, ((x, y), start) per entry; () for a topic that never
    # left its home.  After a restart it says which of two copies at different coordinates is the stale one.
    delegates: tuple[tuple[tuple[float, float], float], ...] = ()

    def to_json(self) -> bytes:
        obj: dict[str, object] = {"name": self.name, "coord": list(self.coord), "home": list(self.home)}
        if self.delegates:
            obj["delegates"] = [[c[0], c[1], start] for c, start in self.delegates]
        return json.dumps(obj).encode()

    @classmethod
    def from_json(cls, data: bytes) -> TopicMeta:
        obj = json.loads(data)
        delegates = tuple((_pair(e[:2]), float(e[2])) for e in obj.get("delegates", ()))
        return cls(str(obj["name"]), _pair(obj["coord"]), _pair(obj["home"]), delegates)


def _pair(v: object) -> tuple[float, float]:
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int | float) for x in v)):
        raise ValueError(f"a coordinate must be [x, y], got {v!r}")
    return (float(v[0]), float(v[1]))


@dataclass(slots=True)
class Recovered:
    """One topic read back from disk by `recover`, and what recovery found on the way."""

    meta: TopicMeta
    rows: list[Row]  # by timestamp, each (publisher, seq) once
    last_seq: dict[str, int]
    last_seen: dict[str, float]
    segments: int = 0
    damaged_bytes: int = 0  # skipped stretches in the middle of segments (reported; the rest is served)
    damaged_stretches: int = 0
    torn_bytes: int = 0  # an unfinished append at the end of the newest segment, truncated


class DiskLog:
    """The segment files of one topic (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        meta: TopicMeta,
        policy: FsyncPolicy,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        *,
        existing: Iterable[_Segment] = (),
        committer: GroupCommit | None = None,
        files: OpenFiles | None = None,
    ) -> None:
        self.directory = directory
        self.meta = meta
        self.policy = policy
        self.segment_bytes = segment_bytes
        self._segments: list[_Segment] = sorted(existing, key=lambda s: s.number)
        self._pending = bytearray()
        self._pending_max_ts = -math.inf
        self._dirty = False  # written since the last sync
        # The active segment's descriptor, opened by the first write and closed again when the data directory's
        # budget of open files needs it for another topic (broker/storage/files.py); -1 while closed.
        self._fd = -1
        self._files = files
        # Group commit (broker/storage/commit.py); None: every sync runs in place, on the caller's thread.
        self._committer = committer
        self.cover = 0  # the sync round that covers the last write
        self._waiters: list[tuple[int, Callable[[StorageError | None], None]]] = []
        # The last round that failed for this log, and its error: a waiter for a write that round covered is
        # told so even when it asks after the round completed (a round run in place, without an event loop).
        self._failed_round = -1
        self._failure: StorageError | None = None
        # Set by the owner (broker/store.py TopicLog): a round failed for this log; takes the records it should
        # have covered back out of memory and returns the error to give the waiters.
        self.on_sync_failed: Callable[[OSError], StorageError] | None = None
        # The directory, its first segment and meta.json are made by the first write (`_make`), inside its error
        # handling: a topic a broker starts to hold on a full disk, or with no descriptor left, is then refused
        # like any write (storage_full), instead of failing whatever request made the topic known here.
        self._made = bool(self._segments)
        self._meta_written = self._made  # meta.json says self.meta (a failed rewrite is tried again)
        if not self._segments:
            self._segments.append(_Segment(1, _segment_path(directory, 1)))

    def _make(self) -> None:
        """Make the topic's directory, first segment and meta.json (the first write), or write a meta.json that a
        move changed and could not write then.  The segment is made before meta.json, whose directory sync then
        covers it too."""
        if not self._made:
            self.directory.mkdir(parents=True, exist_ok=True)
            first = self._segments[-1]
            os.close(os.open(first.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
            first.size = first.path.stat().st_size  # (a file left by an unreadable directory: appended to)
            meta_path = self.directory / "meta.json"
            try:
                same = TopicMeta.from_json(meta_path.read_bytes()) == self.meta
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                same = False
            if same:
                _fsync_dir(self.directory)
            self._made, self._meta_written = True, same
        if not self._meta_written:
            write_atomic(self.directory / "meta.json", self.meta.to_json())
            self._meta_written = True

    def relocate(self, coord: tuple[float, float], delegates: tuple[tuple[tuple[float, float], float], ...]) -> None:
        """Write a new coordinate or delegate list to meta.json (a move; a stale copy following the topic)."""
        meta = TopicMeta(self.meta.name, coord, self.meta.home, delegates)
        if meta != self.meta:
            self.meta = meta
            self._meta_written = False
            if self._made:
                try:
                    write_atomic(self.directory / "meta.json", meta.to_json())
                    self._meta_written = True
                except OSError:
                    pass  # written by the next write of the topic (`_make`), whose error is then reported

    def _file(self) -> int:
        """The active segment's descriptor, opened if it is closed (the budget may close another log's)."""
        if not (self._made and self._meta_written):
            self._make()
        if self._fd >= 0:
            if self._files is not None:
                self._files.used(self)
            return self._fd
        active = self._segments[-1]
        fd = os.open(active.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        active.size = os.fstat(fd).st_size
        self._fd = fd
        if self._files is not None:
            self._files.opened(self)
        return fd

    def _release_fd(self) -> None:
        """Forget the descriptor (the caller closed it or handed it on)."""
        self._fd = -1
        if self._files is not None:
            self._files.gone(self)

    def release_file(self) -> bool:
        """Close the active segment's file for the budget of open files (OpenFiles).  A write not yet synced is
        synced first, in place: a sync round of the group commit syncs the logs' open descriptors, and this one
        would be gone.  False (the file stays open) if that sync fails: the round reports it as usual."""
        if self._fd < 0:
            return False
        if self._dirty and self.policy.mode is not FsyncMode.NEVER:
            try:
                os.fdatasync(self._fd)
            except OSError:
                return False
        self._dirty = self._dirty and self.policy.mode is FsyncMode.NEVER
        os.close(self._fd)
        self._release_fd()
        return True

    @property
    def size(self) -> int:
        """Bytes on disk in this topic's segments (frames, not the load model's record sizes)."""
        return sum(s.size for s in self._segments)

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    def stage(self, row: Row) -> None:
        """Take a record for the next `persist` (the owner persists at once under ALWAYS)."""
        encode_into(self._pending, row)
        if row[0] > self._pending_max_ts:
            self._pending_max_ts = row[0]

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def persist(self) -> None:
        """Write what was staged, synced as the policy says; StorageFull leaves the file as it was."""
        if not self._pending:
            return
        active = self._segments[-1]
        data = self._pending
        fd = -1
        try:
            fd = self._file()
            written = 0
            while written < len(data):
                written += os.write(fd, memoryview(data)[written:])
        except OSError as exc:
            # Cut back to the last whole record: a half-written frame would read as a torn tail anyway, but an
            # append after it would then sit behind damage.
            if fd >= 0:
                os.ftruncate(fd, active.size)
            self._pending = bytearray()
            self._pending_max_ts = -math.inf
            raise write_error(self.directory, exc) from exc
        active.size += len(data)
        active.max_ts = max(active.max_ts, self._pending_max_ts)
        self._pending = bytearray()
        self._pending_max_ts = -math.inf
        self._dirty = True
        if self._committer is not None:
            if self.policy.mode is not FsyncMode.NEVER:
                self.cover = self._committer.written(self, self._current_fd)
        elif self.policy.before_ack:
            self.sync()
        if active.size >= self.segment_bytes:
            self._roll()

    def _current_fd(self) -> int:
        return self._fd

    def when_synced(self, fn: Callable[[StorageError | None], None]) -> None:
        """Call fn once everything written so far is on the disk as the policy promises before an ACK: at once
        under INTERVAL and NEVER (or when it is already synced), else when the round covering it completed;
        with the error if that round failed (the records were taken back out of memory first)."""
        if not self.policy.before_ack or self._committer is None:
            fn(None)
        elif self.cover <= self._committer.done_round:
            fn(self._failure if self._failed_round >= self.cover else None)
        else:
            self._waiters.append((self.cover, fn))

    def round_done(self, round_id: int, error: OSError | None) -> None:
        """A sync round that covered this log completed (GroupCommit)."""
        if error is None:
            self._dirty = self.cover > round_id
            done = [fn for r, fn in self._waiters if r <= round_id]
            if done:
                self._waiters = [(r, fn) for r, fn in self._waiters if r > round_id]
            for fn in done:
                fn(None)
            return
        # Everything not yet known to be synced is refused: the rounds after this one cover writes made after
        # it began, which the failed sync may have left behind on the disk in any state.
        failed = self.on_sync_failed
        exc = failed(error) if failed is not None else sync_error(self.directory, error, frozenset())
        self._failed_round, self._failure = round_id, exc
        waiters, self._waiters = self._waiters, []
        for _, fn in waiters:
            fn(exc)

    def discard_pending(self) -> None:
        """Forget what was staged and not yet written (the caller rolled those records back)."""
        self._pending = bytearray()
        self._pending_max_ts = -math.inf

    def sync(self) -> None:
        """Force what was written to the disk, in place (without group commit, and on closing)."""
        if self._dirty:
            os.fdatasync(self._file())
            self._dirty = False

    def _roll(self) -> None:
        fd = self._file()
        if self._committer is not None:
            # The next round syncs and closes the full segment off the loop; it covers what was written to it.
            self.cover = self._committer.retire(self, fd)
        else:
            self.sync()
            os.close(fd)
        self._release_fd()
        nxt = self._segments[-1].number + 1
        self._segments.append(_Segment(nxt, _segment_path(self.directory, nxt)))
        self._file()
        _fsync_dir(self.directory)

    def expire(self, oldest_kept_ts: float | None, dedup: Mapping[str, tuple[int, float]]) -> int:
        """Delete segments holding only records older than oldest_kept_ts (None: nothing is kept).

        The dedup state (publisher -> (last seq, last seen)) is written first: it outlives the records.
        Returns the bytes deleted.
        """
        cut = math.inf if oldest_kept_ts is None else oldest_kept_ts
        old = [s for s in self._segments[:-1] if s.max_ts < cut]
        active = self._segments[-1]
        whole = oldest_kept_ts is None and active.size > 0 and not self._pending
        if not old and not whole:
            return 0
        self.write_dedup(dedup)
        freed = 0
        for s in old:
            freed += s.size
            s.path.unlink(missing_ok=True)
            self._segments.remove(s)
        if whole:
            freed += active.size
            self._restart()
        return freed

    def _restart(self) -> None:
        """Drop every segment and start a fresh one."""
        if self._fd >= 0:
            os.close(self._fd)
            self._release_fd()
        nxt = self._segments[-1].number + 1
        for s in self._segments:
            s.path.unlink(missing_ok=True)
        self._segments = [_Segment(nxt, _segment_path(self.directory, nxt))]
        self._file()
        _fsync_dir(self.directory)

    def rewrite(self, rows: Iterable[Row], dedup: Mapping[str, tuple[int, float]]) -> None:
        """Replace the whole history (a full copy from the primary replaces what this replica had)."""
        self.discard_pending()
        self.write_dedup(dedup)
        self._restart()
        for row in rows:
            encode_into(self._pending, row)
            self._pending_max_ts = max(self._pending_max_ts, row[0])
        self.persist()

    def write_dedup(self, dedup: Mapping[str, tuple[int, float]]) -> None:
        """Record every publisher's last sequence number (and when it was last seen)."""
        if not self._made:
            self._make()
        write_atomic(self.directory / "dedup.msgpack", msgpack.packb({p: list(v) for p, v in dedup.items()}))

    def close(self) -> None:
        """Write what is staged, sync, and close the file."""
        try:
            self.persist()
            self.sync()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._release_fd()

    def destroy(self) -> None:
        """Delete the topic's files (it was handed over, or is no longer this broker's to keep)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._release_fd()
        if not self.directory.exists():
            return  # never written
        for p in self.directory.iterdir():
            p.unlink(missing_ok=True)
        self.directory.rmdir()


def recover(
    directory: Path,
    policy: FsyncPolicy,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    committer: GroupCommit | None = None,
    files: OpenFiles | None = None,
) -> tuple[Recovered, DiskLog]:
    """Read a topic's directory back: records by timestamp, dedup state, damage and torn tails.

    A torn tail of the newest segment is truncated; damaged stretches are skipped and counted.  Raises
    StorageError if the directory has no readable meta.json (it is not a topic directory).
    """
    try:
        meta = TopicMeta.from_json((directory / "meta.json").read_bytes())
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise StorageError(f"{directory} is not a readable topic directory: {exc}") from exc
    segs = sorted(
        (_Segment(int(p.stem), p) for p in directory.glob(f"*{SEGMENT_SUFFIX}") if p.stem.isdigit()),
        key=lambda s: s.number,
    )
    rec = Recovered(meta, [], {}, {})
    dedup_path = directory / "dedup.msgpack"
    if dedup_path.exists():
        try:
            for pub, (seq, seen) in msgpack.unpackb(dedup_path.read_bytes(), raw=False).items():
                rec.last_seq[str(pub)] = int(seq)
                rec.last_seen[str(pub)] = float(seen)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            rec.damaged_stretches += 1  # the snapshot is rebuilt from the records below; nothing else is lost
    # A record written twice (TopicLog.merge re-stamped it to keep its publisher's order) is read back as its
    # last copy: the first stays in its segment until that expires.
    keys: dict[tuple[str, int], int] = {}
    rows: list[Row] = []
    for i, seg in enumerate(segs):
        buf = seg.path.read_bytes()
        result = scan(buf)
        for d in result.damaged:
            rec.damaged_stretches += 1
            rec.damaged_bytes += d.end - d.start
        seg.size = len(buf)
        if result.torn_at is not None:
            if i == len(segs) - 1:
                rec.torn_bytes += len(buf) - result.torn_at
                os.truncate(seg.path, result.torn_at)
                seg.size = result.torn_at
            else:
                rec.damaged_stretches += 1
                rec.damaged_bytes += len(buf) - result.torn_at
        for row in result.rows:
            key = (row[1], row[2])
            if row[0] > seg.max_ts:
                seg.max_ts = row[0]
            at = keys.get(key)
            if at is not None:
                rows[at] = row
                continue
            keys[key] = len(rows)
            rows.append(row)
    rows.sort(key=lambda r: r[0])
    for ts, pub, seq, _ in rows:
        if seq > rec.last_seq.get(pub, -1):
            rec.last_seq[pub] = seq
        if ts > rec.last_seen.get(pub, -math.inf):
            rec.last_seen[pub] = ts
    rec.rows = rows
    rec.segments = len(segs)
    return rec, DiskLog(directory, meta, policy, segment_bytes, existing=segs, committer=committer, files=files)


@dataclass(slots=True)
class RecoveryReport:
    """What a broker found in its data directory at start (logged, shown in status and the event log)."""

    topics: int = 0
    records: int = 0
    bytes: int = 0
    damaged_stretches: int = 0
    damaged_bytes: int = 0
    torn_bytes: int = 0
    unreadable: list[str] = field(default_factory=list)  # directories that are not topic directories

    def __str__(self) -> str:
        text = f"recovered {self.topics} topics, {self.records} records, {self.bytes} bytes"
        if self.torn_bytes:
            text += f"; truncated {self.torn_bytes} bytes of unfinished appends"
        if self.damaged_stretches:
            text += f"; skipped {self.damaged_stretches} damaged stretches ({self.damaged_bytes} bytes)"
        if self.unreadable:
            text += f"; ignored {len(self.unreadable)} unreadable directories: {', '.join(self.unreadable[:5])}"
        return text
