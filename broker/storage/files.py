"""How many topic files a data directory keeps open: a budget under the process's open-file limit.

Every topic a broker holds has an active segment it appends to.  Kept open for good, one descriptor per topic,
a broker holding more topics than its open-file limit allows (1,024 by default for a login shell or a systemd
service) failed at the next `open`: the sync timer died with "Too many open files" and the broker then refused
every connection (docs/storage.md, "Open files").  Kafka asks its operators for a limit of 100,000 or more;
a Go program such as nats-server raises its soft limit to the hard one at start (the Go runtime does it).

Here a broker raises its soft limit to the hard one too (`raise_open_file_limit`), and a data directory keeps
at most a budget of segment files open (`OpenFiles`): a log opens its file when it writes, and the least
recently written one is closed when the budget is full.  A closed log loses nothing: what it wrote is in the
kernel's cache, and a write not yet synced is synced before its file is closed.  With a limit far above the
topics held, as on any tuned host, nothing is ever closed.
"""

from __future__ import annotations

import contextlib
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Protocol

# Descriptors a broker needs besides its topic files and client connections: the listening socket, the
# metrics endpoint, event logs, the event loop's own, a data-directory lock, transient files (meta.json,
# dedup state), links to neighbouring brokers.
RESERVED_FDS: Final = 256
# The fewest topic files kept open, whatever the limit: fewer would close and reopen files on every turn.
MIN_OPEN_TOPIC_FILES: Final = 16


class Closable(Protocol):
    """A topic's disk log as the budget sees it (broker/storage/disklog.py DiskLog)."""

    def release_file(self) -> bool:
        """Close the log's file (synced first if it must be); False if it must stay open for now."""
        ...


@dataclass(frozen=True, slots=True)
class OpenFileLimit:
    """The process's open-file limit: the soft one (what counts) and the hard one (how far it may be raised)."""

    soft: int
    hard: int

    @classmethod
    def current(cls) -> OpenFileLimit:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        unlimited = 1 << 20  # (RLIM_INFINITY: as much as Linux's default nr_open)
        return cls(
            unlimited if soft == resource.RLIM_INFINITY else soft,
            unlimited if hard == resource.RLIM_INFINITY else hard,
        )

    def topic_files(self, max_connections: int) -> int:
        """The topic files a data directory may keep open: half of what the limit leaves after the client
        connections and RESERVED_FDS (the other half is for the group commit's duplicates of those being
        synced, broker/storage/commit.py), at least MIN_OPEN_TOPIC_FILES."""
        return max(MIN_OPEN_TOPIC_FILES, (self.soft - max_connections - RESERVED_FDS) // 2)

    def short_of(self, max_connections: int) -> bool:
        """The limit leaves no room for --max-connections clients beside the fewest topic files."""
        return self.soft < max_connections + RESERVED_FDS + 2 * MIN_OPEN_TOPIC_FILES


def raise_open_file_limit() -> tuple[int, OpenFileLimit]:
    """Raise the soft open-file limit to the hard one, as the Go runtime does for nats-server at start: the soft
    default of 1,024 is a relic of select(), and the event loop uses epoll.  Returns the soft limit before, and
    the limit now."""
    before = OpenFileLimit.current()
    if before.hard > before.soft:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # (A hard limit above the kernel's nr_open fails: the soft one stays.)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (before.hard, hard))
    return before.soft, OpenFileLimit.current()


class OpenFiles:
    """The logs of one data directory whose file is open, least recently written first, at most `limit`."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the open topic files budget must be at least 1, got {limit}")
        self.limit = limit
        self._open: OrderedDict[int, Closable] = OrderedDict()  # id(log) -> log
        self.closed = 0  # files closed to stay within the budget (reopened when their topic is written)

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, log: Closable) -> None:
        """log opened its file: the least recently written others are closed while over the budget."""
        self._open[id(log)] = log
        self._open.move_to_end(id(log))
        self._close_over(keep=log)

    def resize(self, limit: int) -> None:
        """A new budget (--max-connections reloaded): the least recently written files are closed while over it."""
        if limit < 1:
            raise ValueError(f"the open topic files budget must be at least 1, got {limit}")
        self.limit = limit
        self._close_over(keep=None)

    def _close_over(self, keep: Closable | None) -> None:
        tries = len(self._open)
        while len(self._open) > self.limit and tries > 0:
            tries -= 1
            oldest = next(iter(self._open.values()))
            if oldest is keep or not oldest.release_file():  # (release_file calls `gone`)
                self._open.move_to_end(id(oldest))  # kept open for now: tried again last
                continue
            self.closed += 1

    def used(self, log: Closable) -> None:
        """log wrote to its open file: it is the most recently used now."""
        self._open.move_to_end(id(log))

    def gone(self, log: Closable) -> None:
        """log closed its file (released, rolled to a new segment, closed, deleted)."""
        self._open.pop(id(log), None)
