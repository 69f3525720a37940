"""Group commit: the `fdatasync` of a data directory's logs runs on a worker thread, not on the event loop.

An `fdatasync` takes ~1.5 ms on this machine's disk and far longer on a busy or slow one; on the event loop it
stops the whole broker meanwhile (heartbeats too, so neighbours took it for dead: docs/benchmarks-storage.md).
Here a **round** syncs every log written since the previous round began, on one worker thread (`os.fdatasync`
releases the GIL, so the loop goes on); what is written while a round is in flight is covered by the next one.
Rounds run one at a time and in order, so round k completing means every write made before round k began is
on the disk.  A log's `cover` is the round that covers its last write; whoever may not go on before that write
is on the disk (an ACK under `always`/`batch`, a copy's confirmation) waits for it (`DiskLog.when_synced`).

The thread syncs duplicates of the logs' file descriptors (`os.dup`), which it closes itself: the loop may
close, roll or delete a log meanwhile without the thread ever touching a closed (or reused) descriptor number.
A segment that rolled over hands its descriptor to the next round, which syncs and closes it.

Without a running event loop (tools, unit tests, a shutdown) a round runs in place.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol


class Synced(Protocol):
    """What a round tells a log it covered (broker/storage/disklog.py DiskLog)."""

    def round_done(self, round_id: int, error: OSError | None) -> None: ...


@dataclass(slots=True)
class _Job:
    log: Synced
    fd: int  # owned by the round: a duplicate, or a rolled segment's descriptor; closed once synced
    error: OSError | None = None  # the descriptor could not be duplicated: the round fails for this log


def _sync_all(jobs: list[_Job]) -> dict[int, OSError]:
    """The worker thread's part: fdatasync and close every descriptor; the errors by id() of their log."""
    errors: dict[int, OSError] = {}
    for job in jobs:
        if job.error is not None:
            errors.setdefault(id(job.log), job.error)
        if job.fd < 0:
            continue
        try:
            os.fdatasync(job.fd)
        except OSError as exc:
            errors.setdefault(id(job.log), exc)
        finally:
            os.close(job.fd)
    return errors


class GroupCommit:
    """The sync rounds of one data directory (see the module docstring)."""

    def __init__(self, eager: bool) -> None:
        # eager (ALWAYS, BATCH): a round starts as soon as something is written and none is in flight, and the
        # next one as soon as it completes; otherwise (INTERVAL) only when `start` is called on the beat.
        self.eager = eager
        self.next_round = 1  # the round that covers a write made now
        self.done_round = 0  # the last round that completed (rounds complete in order)
        self.rounds = 0
        self._busy = False
        self._dirty: dict[int, tuple[Synced, Callable[[], int]]] = {}  # id(log) -> (log, its fd now)
        self._retired: list[_Job] = []
        self._executor: ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        """A round is in flight on the worker thread."""
        return self._busy

    def written(self, log: Synced, fd: Callable[[], int]) -> int:
        """log was written; returns the round that covers it (started at once when eager and idle)."""
        self._dirty[id(log)] = (log, fd)
        cover = self.next_round
        if self.eager:
            self.start()
        return cover

    def retire(self, log: Synced, fd: int) -> int:
        """A rolled segment's descriptor: the next round syncs and closes it; returns that round."""
        self._retired.append(_Job(log, fd))
        cover = self.next_round
        self.start()
        return cover

    def start(self) -> None:
        """Begin a round for what was written since the last one began, unless one is in flight."""
        if self._busy or not (self._dirty or self._retired):
            return
        round_id = self.next_round
        self.next_round += 1
        self.rounds += 1
        jobs = self._retired
        for log, fd in self._dirty.values():
            now = fd()
            try:
                jobs.append(_Job(log, os.dup(now) if now >= 0 else -1))
            except OSError as exc:  # no descriptor left: what this round covers of the log is refused, not lost
                jobs.append(_Job(log, -1, exc))
        self._dirty = {}
        self._retired = []
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._finish(round_id, jobs, _sync_all(jobs))
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sedax-fsync")
        self._busy = True
        fut = loop.run_in_executor(self._executor, _sync_all, jobs)
        fut.add_done_callback(lambda f: self._finished(round_id, jobs, f))

    def _finished(self, round_id: int, jobs: list[_Job], fut: asyncio.Future[dict[int, OSError]]) -> None:
        self._busy = False
        if fut.cancelled():
            errors: dict[int, OSError] = {id(j.log): OSError("the sync was cancelled") for j in jobs}
        elif (exc := fut.exception()) is not None:
            errors = {id(j.log): exc if isinstance(exc, OSError) else OSError(str(exc)) for j in jobs}
        else:
            errors = fut.result()
        self._finish(round_id, jobs, errors)
        if self.eager:
            self.start()

    def _finish(self, round_id: int, jobs: list[_Job], errors: dict[int, OSError]) -> None:
        self.done_round = round_id
        told: set[int] = set()
        for job in jobs:
            if id(job.log) not in told:
                told.add(id(job.log))
                job.log.round_done(round_id, errors.get(id(job.log)))

    def close(self) -> None:
        """Wait for the round in flight (its callbacks are not run: the broker is going away)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
