"""A broker's data directory: one disk log per topic it holds (broker/storage/disklog.py), recovered at start.

`DiskStore` owns `<data-dir>/topics/`: it reads every topic directory back at start (`recover`), creates the
log of a topic the broker starts to hold (`open_log`), syncs the written logs off the event loop
(broker/storage/commit.py: at once under ALWAYS and BATCH, on the INTERVAL policy's beat, `sync_due`) and
closes them all on shutdown.  The on-disk format and what each write policy promises are in
docs/storage.md.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from broker.storage.commit import GroupCommit
from broker.storage.disklog import (
    DEFAULT_SEGMENT_BYTES,
    DiskLog,
    FsyncMode,
    FsyncPolicy,
    Recovered,
    RecoveryReport,
    StorageError,
    StorageFull,
    SyncFailed,
    TopicMeta,
    WriteFailed,
    recover,
    topic_dirname,
    write_atomic,
)
from broker.storage.files import OpenFileLimit, OpenFiles, raise_open_file_limit

__all__ = [
    "STORAGE_FORMAT",
    "DataDirInUse",
    "DiskLog",
    "DiskStore",
    "FormatUnknown",
    "FsyncMode",
    "FsyncPolicy",
    "OpenFileLimit",
    "Recovered",
    "RecoveryReport",
    "StorageError",
    "StorageFull",
    "SyncFailed",
    "TopicMeta",
    "WriteFailed",
    "claim_format",
    "lock_data_dir",
    "raise_open_file_limit",
    "read_format",
    "unlock_data_dir",
]

# The lock file of a data directory, beside topics/ (docs/storage.md).
LOCK_FILE = "LOCK"
# The delegate lists of the topics this broker is the home (or the home's secondary) of: the lists say where a
# moved topic lives, and a full restart must not forget them while the topic's copies come back where it moved.
DELEGATES_FILE = "delegates.json"
# What a data directory says of the layout it was written in (docs/storage.md, "Storage format").
FORMAT_FILE = "format.json"
# The storage format this release writes and reads: the layout of docs/storage.md, "On-disk format".  A release
# that changes the frames, the files or their meaning raises it, reads the formats before it, and writes its own
# number once it has converted a directory, so an older release refuses that directory instead of taking what
# it cannot read for damage and cutting it off (recovery truncates a segment's unreadable tail).
STORAGE_FORMAT = 1


class DataDirInUse(StorageError):
    """Another process holds the data directory: two brokers writing one directory would append to the same
    segments and each read the other's records back as its own."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        who = f" (pid {holder})" if holder.isdigit() else ""
        super().__init__(
            f"data directory {data_dir} is in use by another broker{who}: give each broker its own --data-dir"
        )


class FormatUnknown(StorageError):
    """The data directory was written in a storage format this release does not read (a newer release wrote it,
    or its format file is damaged).  Nothing in it was read or changed."""


def read_format(data_dir: Path, release: str) -> tuple[int, str] | None:
    """The storage format a data directory was written in and the release that last started on it, or None for a
    directory without the file: new, or written before releases recorded a format (the format 1 layout).
    Reads only (`sedax broker --check` uses it beside a running broker).  Raises FormatUnknown for a format newer
    than this release reads, or an unreadable file."""
    path = data_dir / FORMAT_FILE
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise FormatUnknown(_unreadable_format(path, str(exc))) from None
    found = obj.get("storage_format") if isinstance(obj, dict) else None
    if type(found) is not int or found < 1:
        raise FormatUnknown(_unreadable_format(path, f"no storage_format number in {obj!r:.80}"))
    by = obj.get("release")
    writer = by if isinstance(by, str) else ""
    if found > STORAGE_FORMAT:
        by_whom = f" by sedax {writer}" if writer else ""
        raise FormatUnknown(
            f"data directory {data_dir} was written in storage format {found}{by_whom}; "
            f"this release (sedax {release}) reads format {STORAGE_FORMAT} and before: run a release that reads "
            f"format {found} on it, or give this broker another --data-dir"
        )
    return found, writer


def claim_format(data_dir: Path, release: str) -> None:
    """Check the storage format a data directory was written in (`read_format`) and record ours in it.  Called with
    the directory locked (`lock_data_dir`) and before anything in it is read.  Raises FormatUnknown for a newer or
    unreadable format, OSError if the file cannot be written."""
    if read_format(data_dir, release) != (STORAGE_FORMAT, release):
        write_atomic(
            data_dir / FORMAT_FILE, json.dumps({"storage_format": STORAGE_FORMAT, "release": release}).encode()
        )


def _unreadable_format(path: Path, why: str) -> str:
    return (
        f"{path}: unreadable storage format ({why}); restore the file, or write "
        f'{{"storage_format": {STORAGE_FORMAT}}} into it if the directory was written by this release'
    )


def lock_data_dir(data_dir: Path) -> int:
    """Take the data directory for this process, as Kafka's log directories and Pulsar's bookies do: an exclusive
    flock on <data-dir>/LOCK, which holds our pid.  The kernel releases it when the process ends, SIGKILL
    included, so a broker restarted after a crash finds it free.  Returns the descriptor (`unlock_data_dir`).

    Raises DataDirInUse if another process holds it, OSError if the directory cannot be made or written.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DataDirInUse(data_dir, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_data_dir(fd: int) -> None:
    """Give the data directory up (a broker that stopped; a process that ends gives it up anyway)."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


class DiskStore:
    """The topic logs of one data directory."""

    def __init__(
        self,
        data_dir: Path,
        policy: FsyncPolicy,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        open_files: int = 1 << 20,
    ) -> None:
        """open_files: the most topic files kept open at once (broker/storage/files.py; the broker derives it
        from its open-file limit, OpenFileLimit.topic_files)."""
        self.data_dir = data_dir
        self.policy = policy
        self.segment_bytes = segment_bytes
        self.topics_dir = data_dir / "topics"
        self.topics_dir.mkdir(parents=True, exist_ok=True)
        self._logs: dict[str, DiskLog] = {}
        self._last_sync = 0.0
        self.committer = GroupCommit(eager=policy.before_ack)
        self.files = OpenFiles(open_files)

    def recover(self) -> tuple[list[Recovered], RecoveryReport]:
        """Read every topic directory back; the logs stay open for appending.  Unreadable ones are reported."""
        report = RecoveryReport()
        found: list[Recovered] = []
        for d in sorted(p for p in self.topics_dir.iterdir() if p.is_dir()):
            try:
                rec, log = recover(d, self.policy, self.segment_bytes, self.committer, self.files)
            except StorageError:
                report.unreadable.append(d.name)
                continue
            if d.name != topic_dirname(rec.meta.name) or rec.meta.name in self._logs:
                log.close()
                report.unreadable.append(d.name)
                continue
            self._logs[rec.meta.name] = log
            found.append(rec)
            report.topics += 1
            report.records += len(rec.rows)
            report.bytes += log.size
            report.damaged_stretches += rec.damaged_stretches
            report.damaged_bytes += rec.damaged_bytes
            report.torn_bytes += rec.torn_bytes
        return found, report

    def open_log(self, meta: TopicMeta) -> DiskLog:
        """The log of a topic (created empty if the broker did not hold it yet)."""
        log = self._logs.get(meta.name)
        if log is None:
            log = self._logs[meta.name] = DiskLog(
                self.topics_dir / topic_dirname(meta.name),
                meta,
                self.policy,
                self.segment_bytes,
                committer=self.committer,
                files=self.files,
            )
        return log

    def save_delegates(self, lists: dict[str, list[tuple[tuple[float, float], float]]]) -> None:
        """Write the delegate lists this broker keeps as a topic's home (or the home's secondary): topic ->
        [(coordinate, start), ...].  Written whole, to a new file renamed over the old one once it is on the
        disk, so a crash leaves the old lists or the new ones."""
        data = json.dumps({t: [[c[0], c[1], start] for c, start in dl] for t, dl in sorted(lists.items())})
        write_atomic(self.data_dir / DELEGATES_FILE, data.encode())

    def load_delegates(self) -> dict[str, list[tuple[tuple[float, float], float]]]:
        """The delegate lists `save_delegates` wrote ({} if none); StorageError if the file is unreadable."""
        path = self.data_dir / DELEGATES_FILE
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
            return {str(t): [((float(e[0]), float(e[1])), float(e[2])) for e in dl] for t, dl in dict(obj).items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, IndexError) as exc:
            why = f"{path}: unreadable delegate lists ({exc}); move the file away to start without them"
            raise StorageError(why) from exc

    def forget(self, name: str) -> None:
        """Delete a topic's files (handed over or dropped)."""
        log = self._logs.pop(name, None)
        if log is not None:
            log.destroy()

    def sync_due(self, now: float) -> None:
        """On the INTERVAL policy, force every written log to the disk once per interval (off the loop)."""
        if self.policy.mode is not FsyncMode.INTERVAL or now - self._last_sync < self.policy.interval:
            return
        self._last_sync = now
        self.committer.start()

    def close(self) -> None:
        """Write, sync and close every log (graceful shutdown)."""
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        self.committer.close()
