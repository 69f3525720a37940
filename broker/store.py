"""The topic store of one broker: published data kept for a retention, dedup state, subscriber registrations.

The stored bytes of a topic are its load L_T(t) (Sec. IV-C1), measured in bytes, so the load model of
`overlay.load` sees what the broker really holds.  Clocks are passed in: the store never reads time itself.

With a data directory (broker/storage), every topic log has a disk journal: what `append`/`merge` store is
staged for it, `persist()` writes it before anything of it is acknowledged or confirmed, and a write that
fails for lack of space rolls the staged records back out of memory too, so memory never holds an
acknowledgeable record the disk does not.  Under `always` and `batch` the sync runs off the event loop (group
commit, broker/storage/commit.py): whoever acknowledges or confirms waits for it with `when_durable`, and a
sync that fails takes every record it should have covered back out of memory the same way.  Reads are always
served from memory.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

from broker import defaults
from broker.storage import DiskLog, DiskStore, FsyncMode, RecoveryReport, StorageError, TopicMeta
from broker.storage.disklog import sync_error
from broker.sweep import Sweep
from overlay.pubsub import Delegation, Record, record_size
from overlay.seqset import Digest, SeqRanges, count_outside, digest_of, lacks, ranges_minus
from overlay.topics import BadTopic, matches, validate_pattern

_log = logging.getLogger("sedax.store")

# Dedup remembers the last sequence number of every publisher; publishers that have been silent this long
# are forgotten so a topic with short-lived publishers (CLI invocations) does not grow without bound.
PUBLISHER_IDLE_FORGET: Final = 24 * 3600.0
# How soon a silent publisher whose records are still kept is looked at again (TopicLog._forget_idle).
PUBLISHER_FORGET_RECHECK: Final = 60.0
# A topic looks for idle publishers to forget (TopicLog._forget_idle) only once it remembers more than this many.
_FORGET_LOOK: Final = 64
# Publishers a topic remembers having forgotten or refused (TopicLog.forgotten), the oldest dropped beyond.
FORGOTTEN_KEEP: Final = 4096
# How many of the rows newer than a merge's oldest record `TopicLog._fits` looks at one by one for each merged
# publisher's first, before it walks all of them.
_FIRST_ROWS: Final = 64
# Timestamps of one topic strictly increase, so "FETCH since ts" never skips a message stored in the same
# clock tick as the one before it (the primary stamps, TopicLog.merge keeps it so after a merge).
TS_EPSILON: Final = 1e-6
# What a stored message takes in memory beside the bytes record_size counts (payload, publisher id,
# MESSAGE_OVERHEAD): its row tuple, timestamp, sequence number, bytes object, its place in the rows and the
# held ranges.  Measured: RSS growth per message minus record_size was 225-236 B for 300,000 messages of 16,
# 100 and 1,000 B over 100 topics (docs/storage.md, "Memory").
RECORD_MEMORY: Final = 240
# ... and what a topic held takes beside its messages: its log, replica, dictionaries and sets.  Measured: a
# broker's RSS grew by 4,057-4,072 B per topic for 2 x 20,000 topics of one 16 B message each, of which
# ~290 B were the message.
TOPIC_MEMORY: Final = 3800


class StoreError(Exception):
    """Base of topic-store errors."""


class TopicNotFound(StoreError):
    """The broker holds no data for this topic; ask `sedax locate TOPIC` which brokers do."""


@dataclass(frozen=True, slots=True)
class Retention:
    """How long and how much a broker keeps of every topic (oldest messages go first)."""

    max_age: float | None = defaults.RETENTION_SECONDS  # seconds; None: until max_bytes pushes them out
    max_bytes: int | None = defaults.RETENTION_BYTES  # per topic; None is no limit

    def __post_init__(self) -> None:
        if self.max_age is not None and not self.max_age > 0:
            raise ValueError(f"retention max_age must be positive seconds, got {self.max_age}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"retention max_bytes must be at least 1, got {self.max_bytes}")


class BadRetentionRule(ValueError):
    """A --retention-topic entry that does not parse; the message shows the form."""


@dataclass(frozen=True, slots=True)
class RetentionRule:
    """The retention of the topics a pattern matches, where it differs from the broker's (`--retention-topic`).

    Written `PATTERN=SECONDS[,BYTES]` (or `PATTERN=,BYTES`): the part left out is the broker's
    --retention-seconds / --retention-bytes.  Every broker of an overlay should be given the same rules, as
    the same ACL: each holder of a topic (primary, copies, delegates) applies it to what it keeps.
    """

    pattern: str
    max_age: float | None = None  # None: the broker's
    max_bytes: int | None = None  # None: the broker's

    @classmethod
    def parse(cls, text: str) -> RetentionRule:
        form = "give PATTERN=SECONDS[,BYTES], e.g. 'grid/+/pmu/#=600,16777216' or 'grid/events/#=604800'"
        pattern, eq, value = text.strip().rpartition("=")
        if not eq or not pattern:
            raise BadRetentionRule(f"retention rule {text!r} has no PATTERN=: {form}")
        try:
            validate_pattern(pattern)
        except BadTopic as exc:
            raise BadRetentionRule(f"retention rule {text!r}: {exc}") from None
        age_text, _, bytes_text = value.partition(",")
        try:
            age = float(age_text) if age_text.strip() else None
            size = int(bytes_text) if bytes_text.strip() else None
        except ValueError:
            raise BadRetentionRule(f"retention rule {text!r}: SECONDS and BYTES must be numbers: {form}") from None
        if age is None and size is None:
            raise BadRetentionRule(f"retention rule {text!r} sets neither SECONDS nor BYTES: {form}")
        if age is not None and not (math.isfinite(age) and age > 0):
            raise BadRetentionRule(f"retention rule {text!r}: SECONDS must be a positive number, got {age_text}")
        if size is not None and size < 1:
            raise BadRetentionRule(f"retention rule {text!r}: BYTES must be at least 1, got {bytes_text}")
        return cls(pattern, age, size)

    def __str__(self) -> str:
        age = "" if self.max_age is None else f"{self.max_age:g}"
        return f"{self.pattern}={age}" + ("" if self.max_bytes is None else f",{self.max_bytes}")


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """What a broker keeps of each topic: the first rule whose pattern matches the topic's name, else `base`."""

    base: Retention = field(default_factory=Retention)
    rules: tuple[RetentionRule, ...] = ()

    def __str__(self) -> str:
        """For the log: `3600 s, 67108864 bytes per topic; grid/+/pmu/#: 600 s, the broker's bytes`."""
        base = _limits(self.base.max_age, self.base.max_bytes, "no age limit", "no byte limit")
        inherit = ("the broker's age", "the broker's bytes")
        ruled = [f"{r.pattern}: {_limits(r.max_age, r.max_bytes, *inherit)}" for r in self.rules]
        return "; ".join([f"{base} per topic", *ruled])

    def of(self, topic: str) -> Retention:
        for rule in self.rules:
            if matches(rule.pattern, topic):
                return Retention(
                    self.base.max_age if rule.max_age is None else rule.max_age,
                    self.base.max_bytes if rule.max_bytes is None else rule.max_bytes,
                )
        return self.base


def _limits(max_age: float | None, max_bytes: int | None, no_age: str, no_bytes: str) -> str:
    return (
        f"{no_age if max_age is None else f'{max_age:g} s'}, {no_bytes if max_bytes is None else f'{max_bytes} bytes'}"
    )


# A stored message is the wire's Record.
StoredMessage: TypeAlias = Record
# In the log it is kept as a plain tuple (ts, publisher, seq, payload): the garbage collector stops tracking
# a tuple of strings, numbers and bytes, so a log of 10^6 messages costs full collections nothing, where
# 10^6 Record objects made every full collection walk them (a third of a long run's broker CPU).
_Row: TypeAlias = tuple[float, str, int, bytes]
_as_record = Record._make


@dataclass(slots=True)
class Tally:
    """What a group of the topics held weighs, kept as each log changes (TopicStore.tallies: one per rank of this
    broker for them), so a memory check, a load report or a STATUS sums four of these, not every topic: at
    100,000 topics each walk of them stalled the event loop for 5-6 ms, twice a second."""

    size: int = 0  # their L_T(t) summed, in bytes (record_size)
    records: int = 0  # their stored messages
    names: set[str] = field(default_factory=set)


# What a log made outside a TopicStore (a unit test, a tool reading a directory) counts into: nobody reads it.
_LOOSE: Final = Tally()


@dataclass(slots=True)
class _Unsynced:
    """Records written to a journal and not yet synced, under always/batch."""

    cover: int  # the sync round that covers them (-1 until the write returned)
    rows: list[_Row]


@dataclass(frozen=True, slots=True)
class Subscriber:
    """A subscription: which access broker holds the client session, and the session's id there."""

    access: str  # node id of the access broker
    access_coord: tuple[float, float]  # where to route deliveries: the access broker is N1 of its own coordinate
    session: str


@dataclass(slots=True)
class TopicLog:
    """Everything a broker keeps for one topic."""

    name: str
    retention: Retention
    rows: deque[_Row] = field(default_factory=deque)  # stored messages, oldest first; records() as Records
    size: int = 0
    last_seq: dict[str, int] = field(default_factory=dict)  # publisher -> highest seq stored
    # publisher -> every seq stored (expired ones too): what a merge skips.  last_seq alone would refuse the
    # stretch a replica missed once it holds anything newer, and that stretch is what a re-sync brings.
    held: dict[str, SeqRanges] = field(default_factory=dict)
    # publisher -> the seqs of `held` that retention dropped: held is exactly the rows' seqs plus these, so
    # what a peer lacks of the rows can be counted from ranges alone (missing_from).
    expired: dict[str, SeqRanges] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # publisher -> when it last published
    # Publishers this copy knowingly holds nothing of: forgotten after a day of silence (`_forget_idle`), or
    # refused as new to a full topic (holder: topic_full).  One that comes back with a sequence number past 0
    # is taken up where it is, not counted as having lost what came before (that expired, or was never
    # accepted): before, every such return counted its whole past in sedax_lost_messages_total and logged
    # acknowledged messages as lost.  An ordered set, FORGOTTEN_KEEP at most; not kept across a restart.
    forgotten: dict[str, None] = field(default_factory=dict)
    # The earliest moment a publisher can have been idle for PUBLISHER_IDLE_FORGET (expire): the oldest last_seen
    # at the last look, plus that.  last_seen only moves forward, so none goes stale sooner.  Looking at every
    # publisher on every append cost 27 µs a message on a topic of 1,000 publishers (1.8 µs with 30).
    _forget_at: float = 0.0
    subscribers: dict[tuple[str, str], Subscriber] = field(default_factory=dict)
    # After the last message expired the topic is still known (subscribers, dedup state) but weighs nothing.
    journal: DiskLog | None = None  # the disk log, with a data directory
    # Staged for the journal since the last persist(), and each publisher's last seq before the first of them:
    # what a failed write takes back out of memory.
    _staged: list[_Row] = field(default_factory=list)
    _staged_prev: dict[str, int] = field(default_factory=dict)
    # Written to the journal but not yet synced, under `always`/`batch`, by the sync round that covers them:
    # what a failed sync takes back out of memory.
    _unsynced: list[_Unsynced] = field(default_factory=list)
    # Under `always`, a write made as a record was stored that failed (those records are out of memory again):
    # raised by the next `persist`, which the holder calls before anything of the topic is acknowledged.
    _write_failure: StorageError | None = None
    # Told how many stored records a merge re-stamped (`_reorder_merge`), set by the store: counted in
    # sedax_restamped_records_total.
    on_restamp: Callable[[int], None] | None = None
    # The tally this log's size and records count into (TopicStore: by this broker's rank for the topic).
    tally: Tally = field(default_factory=lambda: _LOOSE)

    def __post_init__(self) -> None:
        if self.journal is not None:
            self.journal.on_sync_failed = self._sync_failed

    @property
    def writes_each(self) -> bool:
        """Each record is written as it is stored (a journal under `always`): `append` one at a time."""
        return self.journal is not None and self.journal.policy.mode is FsyncMode.ALWAYS

    @property
    def waits_for_disk(self) -> bool:
        """An ACK of what is stored here waits for the sync (`when_durable`): a journal under always/batch."""
        return self.journal is not None and self.journal.policy.before_ack

    def when_durable(self, fn: Callable[[StorageError | None], None]) -> None:
        """Call fn once everything stored so far (and persisted) is as safe as the write policy promises an
        acknowledged record is: at once without a journal or under interval/never, else after the sync that
        covers it, with the error if that sync failed (the records it covered were taken back out first)."""
        if self.journal is None:
            fn(None)
        else:
            self.journal.when_synced(fn)

    def _stage(self, row: _Row) -> None:
        assert self.journal is not None
        self._staged.append(row)
        self._staged_prev.setdefault(row[1], self.last_seq.get(row[1], -1))
        self.journal.stage(row)

    def persist(self) -> None:
        """Write what was stored since the last call to the journal (a no-op without one).

        Raises StorageFull (no room) or WriteFailed (an I/O error, no descriptor left) after taking the records it
        could not write back out of memory (and the publishers' dedup state back to before them), with them in
        its `lost`: they were never acknowledged and must not be served.  Under `always` also for the writes
        made as records were stored since the last call (`_write_each`).
        """
        if self.journal is None or not (self._staged or self._write_failure):
            return  # (the common case, and the whole of it without a data directory: no call further)
        failure, self._write_failure = self._write_failure, None
        try:
            self._persist()
        except StorageError as exc:
            if failure is not None:
                exc.lost |= failure.lost
            raise
        if failure is not None:
            raise failure

    def _write_each(self) -> None:
        """`always`: the record just stored is written at once; a failure is kept for the next `persist`."""
        try:
            self._persist()
        except StorageError as exc:
            if self._write_failure is not None:
                exc.lost |= self._write_failure.lost
            self._write_failure = exc

    def _persist(self) -> None:
        if self.journal is None or not self._staged:
            return
        journal = self.journal
        waits = journal.policy.before_ack
        # Unsynced before the write: a round that runs in place (no event loop) and fails inside persist() takes
        # these records back out with the others (_sync_failed); its cover is known once persist() returns.
        pending = _Unsynced(-1, self._staged)
        if waits:
            self._unsynced.append(pending)
        try:
            journal.persist()
        except StorageError as exc:
            if waits:
                self._unsynced.pop()
            exc.lost = self._roll_back()
            raise
        self._staged = []
        self._staged_prev.clear()
        if not waits or not self._unsynced or self._unsynced[-1] is not pending:
            return  # no sync to wait for, or a round in place already synced them (or failed and took them out)
        cover = pending.cover = journal.cover
        if len(self._unsynced) > 1 and self._unsynced[-2].cover == cover:
            self._unsynced.pop()  # `always`: a persist per record, one entry per round
            self._unsynced[-1].rows.extend(pending.rows)
            return
        journal.when_synced(lambda exc: self._synced(cover, exc))

    def _synced(self, cover: int, exc: StorageError | None) -> None:
        if exc is None and self._unsynced and self._unsynced[0].cover <= cover:
            self._unsynced = [u for u in self._unsynced if u.cover > cover]

    def _sync_failed(self, error: OSError) -> StorageError:
        """A sync round failed for this journal: take back everything not known to be synced."""
        rows = [row for u in self._unsynced for row in u.rows]
        self._unsynced.clear()
        first: dict[str, int] = {}
        for _, pub, seq, _ in rows:
            if seq < first.get(pub, seq + 1):
                first[pub] = seq
        # Each publisher's dedup state goes back to before its first record taken out (they re-send from it).
        prev = {pub: seq - 1 for pub, seq in first.items() if self.last_seq.get(pub, -1) >= seq}
        assert self.journal is not None
        return sync_error(self.journal.directory, error, self._take_out(rows, prev))

    def _roll_back(self) -> frozenset[tuple[str, int]]:
        lost = self._take_out(self._staged, self._staged_prev)
        self._staged.clear()
        self._staged_prev.clear()
        return lost

    def _take_out(self, rows: list[_Row], prev_seq: Mapping[str, int]) -> frozenset[tuple[str, int]]:
        """Remove rows from memory, and set each publisher's last seq back to prev_seq's."""
        lost = frozenset((r[1], r[2]) for r in rows)
        for pub, seq in lost:
            if (h := self.held.get(pub)) is not None:
                h.discard(seq)
            if (x := self.expired.get(pub)) is not None:
                x.discard(seq)  # expired before its sync failed: it leaves held, so it leaves expired too
        kept = deque(r for r in self.rows if (r[1], r[2]) not in lost)
        freed = sum(record_size(r[1], r[3]) for r in self.rows if (r[1], r[2]) in lost)
        self._counted(-freed, len(kept) - len(self.rows))
        self.rows = kept
        for pub, prev in prev_seq.items():
            if prev < 0:
                self.last_seq.pop(pub, None)
            else:
                self.last_seq[pub] = prev
        return lost

    def dedup_state(self) -> dict[str, tuple[int, float]]:
        """publisher -> (last seq, last seen): what the journal keeps beside the records."""
        return {p: (s, self.last_seen.get(p, 0.0)) for p, s in self.last_seq.items()}

    def is_duplicate(self, publisher: str, seq: int) -> bool:
        """True if the publisher already got seq stored here or at the primary this replica copies (a re-send
        after a failover): publishers number their messages in order, so the highest seq decides."""
        return seq <= self.last_seq.get(publisher, -1)

    def holds(self, publisher: str, seq: int) -> bool:
        """True if (publisher, seq) itself was stored here (what a merge of another replica's records skips)."""
        h = self.held.get(publisher)
        return h is not None and seq in h

    def _held(self, publisher: str) -> SeqRanges:
        h = self.held.get(publisher)
        if h is None:
            h = self.held[publisher] = SeqRanges()
        return h

    def append(self, msg: StoredMessage, now: float) -> bool:
        """Store msg unless it is a duplicate; returns whether it was stored.  Expires what it pushes out."""
        if self.is_duplicate(msg.publisher, msg.seq):
            return False
        row: _Row = tuple(msg)  # type: ignore[assignment]  # a Record's fields are a _Row
        if self.journal is not None:
            self._stage(row)
        self.rows.append(row)
        n = record_size(msg.publisher, msg.payload)
        self.size += n
        tally = self.tally  # (`_counted`, inlined: once per message)
        tally.size += n
        tally.records += 1
        self.last_seq[msg.publisher] = msg.seq
        self._held(msg.publisher).add(msg.seq)
        self.last_seen[msg.publisher] = now
        if self.journal is not None and self.journal.policy.mode is FsyncMode.ALWAYS:  # (`writes_each`, inlined)
            self._write_each()  # written as it is stored, its sync started at once (a failure: rolled back)
        self.expire(now)
        return True

    def append_run(self, recs: list[Record], now: float) -> None:
        """Store recs, one publisher's next messages in seq order after its last stored one, as `append` would
        one by one (the caller checked the first follows `last_seq`; not under `always`, whose per-record write
        is `append`'s).  A batched PUBLISH costs one pass through the bookkeeping, not one per message."""
        publisher = recs[0].publisher
        rows: list[_Row] = [tuple(r) for r in recs]  # type: ignore[misc]  # a Record's fields are a _Row
        if self.journal is not None:
            for row in rows:
                self._stage(row)
        self.rows.extend(rows)
        self._counted(sum([len(r.payload) for r in recs]) + len(recs) * record_size(publisher, b""), len(recs))
        self.last_seq[publisher] = recs[-1].seq
        self._held(publisher).add_range(recs[0].seq, recs[-1].seq)
        self.last_seen[publisher] = now
        self.expire(now)

    def expire(self, now: float) -> int:
        """Drop messages older than max_age and the oldest beyond max_bytes; returns the bytes freed."""
        freed = dropped = 0
        r = self.retention
        expired = self.expired
        while self.rows and (
            (r.max_age is not None and self.rows[0][0] < now - r.max_age)
            or (r.max_bytes is not None and self.size > r.max_bytes)
        ):
            _, pub, seq, payload = self.rows.popleft()
            n = record_size(pub, payload)
            self.size -= n
            freed += n
            dropped += 1
            x = expired.get(pub)
            if x is None:
                x = expired[pub] = SeqRanges()
            x.add(seq)  # oldest first, so almost always the next of the last range
        if dropped:
            tally = self.tally
            tally.size -= freed
            tally.records -= dropped
        if len(self.last_seen) > _FORGET_LOOK and now >= self._forget_at:
            self._forget_idle(now)
        if freed and self.journal is not None:
            self.journal.expire(self.rows[0][0] if self.rows else None, self.dedup_state())
        return freed

    def _forget_idle(self, now: float) -> None:
        """Forget the dedup state of the publishers silent for PUBLISHER_IDLE_FORGET whose records are all gone.

        One whose records are still kept (a retention longer than a day) keeps its numbers: without them a
        merge would store those records a second time, and `missing_from` would not count them.
        """
        cutoff = now - PUBLISHER_IDLE_FORGET
        next_at = now + PUBLISHER_IDLE_FORGET  # no publisher seen from now on goes stale sooner
        for p, t in list(self.last_seen.items()):
            if t >= cutoff:
                next_at = min(next_at, t + PUBLISHER_IDLE_FORGET)
            elif self.kept(p):
                next_at = min(next_at, now + PUBLISHER_FORGET_RECHECK)
            else:
                del self.last_seen[p]
                self.last_seq.pop(p, None)
                self.held.pop(p, None)
                self.expired.pop(p, None)
                self.mark_forgotten(p)
        self._forget_at = next_at

    def mark_forgotten(self, publisher: str) -> None:
        """Remember that this copy holds nothing of publisher on purpose (`forgotten`)."""
        f = self.forgotten
        f.pop(publisher, None)
        f[publisher] = None
        if len(f) > FORGOTTEN_KEEP:
            del f[next(iter(f))]

    def since(self, ts: float, limit: int | None = None) -> list[StoredMessage]:
        """Stored messages with timestamp > ts, oldest first, at most limit of them."""
        # Messages are appended in timestamp order, so the start is found by bisection.
        start = bisect.bisect_right(_TsView(self.rows), ts)
        end = len(self.rows) if limit is None else min(len(self.rows), start + limit)
        msgs = self.rows
        return [_as_record(msgs[i]) for i in range(start, end)]

    def records(self) -> list[StoredMessage]:
        """Every stored message, oldest first."""
        return [_as_record(m) for m in self.rows]

    def digest(self) -> Digest:
        """Per publisher, the stretches of sequence numbers stored here (what a re-sync compares)."""
        return digest_of(self.held)

    def kept(self, publisher: str) -> tuple[tuple[int, int], ...]:
        """The stretches of publisher's sequence numbers in the rows kept here: held minus what expired."""
        mine = self.held.get(publisher)
        if mine is None:
            return ()
        gone = self.expired.get(publisher)
        return mine.ranges() if gone is None else ranges_minus(mine, gone)

    def offerable(self) -> Digest:
        """What an OFFER names: the stretches of the rows kept here, without what retention dropped.

        A copy made after a failure holds only what was kept then, while `held` (and `digest`) still names
        what retention dropped; offered that, the copy pulled at every anti-entropy round, for nothing.
        """
        return {pub: kept for pub in self.held if (kept := self.kept(pub))}

    def missing_from(self, theirs: Mapping[str, SeqRanges]) -> list[StoredMessage]:
        """The stored messages a replica whose digest is `theirs` lacks, oldest first (`missing_stream`, all at
        once)."""
        missing = self.missing_stream(theirs)
        return missing.take(missing.left)

    def lacking(self, theirs: Mapping[str, SeqRanges]) -> int:
        """How many of the records kept here a replica whose digest is `theirs` lacks (from the ranges alone)."""
        return sum(count_outside(self.kept(pub), theirs.get(pub)) for pub in self.held)

    def missing_stream(self, theirs: Mapping[str, SeqRanges]) -> Missing:
        """The stored messages a replica whose digest is `theirs` lacks, to be taken a piece at a time (`Missing`).

        They are counted from the ranges first (`kept`); then the rows are walked back from the newest until the
        oldest of them is found, and only the rows from there on are kept to be taken.  What a copy lacks at an
        anti-entropy round is a batch or two in flight, or nothing but what retention dropped here: a scan of
        every row instead blocked the primary's event loop for ~75 ms per 300,000 rows retained, at every round.
        A copy that lacks everything (a new secondary) gets every row without a walk.
        """
        want = self.lacking(theirs)
        if not want:
            return Missing([], theirs, 0)
        if want >= len(self.rows):
            return Missing(list(self.rows), theirs, want)
        tail: list[_Row] = []
        found = 0
        for m in reversed(self.rows):
            tail.append(m)
            if lacks(theirs, m[1], m[2]):
                found += 1
                if found == want:
                    break
        tail.reverse()
        return Missing(tail, theirs, want)

    def relocate(self, coord: tuple[float, float], delegates: tuple[tuple[tuple[float, float], float], ...]) -> None:
        """The copy is held for another coordinate, or knows a newer delegate list: the journal's meta says so
        (recovery places the copy by it)."""
        if self.journal is not None:
            self.journal.relocate(coord, delegates)

    @property
    def last_ts(self) -> float | None:
        """Timestamp of the newest stored message, None when nothing is stored."""
        return self.rows[-1][0] if self.rows else None

    def clear(self) -> None:
        """Forget the stored messages; the publishers' sequence numbers (dedup state) stay."""
        self.tally.size -= self.size
        self.tally.records -= len(self.rows)
        self.rows.clear()
        self.size = 0
        self.held.clear()
        self.expired.clear()
        if self.journal is not None:
            self._staged.clear()
            self._staged_prev.clear()
            self._unsynced.clear()
            self.journal.rewrite((), self.dedup_state())

    def merge(self, msgs: Iterable[StoredMessage], now: float) -> list[StoredMessage]:
        """Add another replica's messages as a set union by (publisher, seq), in any order; returns those that
        were new, by timestamp.  A stretch this replica missed is filled in even when it holds newer messages.

        Each publisher's messages stay in the order of their sequence numbers in time, here as at every holder:
        a catch-up reads by timestamp and a subscriber drops what is not newer than the last seq it handed out
        of that publisher.  Two holders that both stored a stretch as primary (a paused primary, resumed, reads
        the originals of what the publisher already re-sent to the take-over) stamped it with their own clocks,
        and merging one's later messages into the other put seq 10 before 0-9 (`_reorder_merge`)."""
        new: list[StoredMessage] = []
        for m in msgs:
            h = self._held(m.publisher)
            if m.seq not in h:
                h.add(m.seq)
                new.append(m)
        if not new:
            return new
        if any(new[i].ts >= new[i + 1].ts for i in range(len(new) - 1)):
            new.sort(key=_ts)
            if any(new[i].ts == new[i + 1].ts for i in range(len(new) - 1)):
                return self._reorder_merge(new, now)  # two holders' stamps alike (`_fits`)
        rows: list[_Row] = [tuple(m) for m in new]  # type: ignore[misc]  # a Record's fields are a _Row
        held = self.rows
        if not held or new[0].ts > held[-1][0]:
            # The common case (a replica receiving the primary's next batch): append, no re-sort of history.
            if not self._follows(new):
                return self._reorder_merge(new, now)
            self._stage_all(rows)
            held.extend(rows)
        else:
            # Older than the newest row (a stretch missed, a back-fill, a re-send): only the rows newer than the
            # oldest of the new ones are looked at, not the whole history (a re-sort of every row retained stalled
            # the event loop as long as a scan of them, ~0.25 µs a row).
            keep = bisect.bisect_right(held, new[0].ts, key=_ts)
            if not self._fits(new, keep):
                return self._reorder_merge(new, now)
            self._stage_all(rows)
            newer = len(held) - keep
            if new[-1].ts < held[keep][0]:
                # All of new falls between two rows (a back-fill, oldest first, into a copy that holds the recent
                # rows): two rotations in C instead of taking the newer rows out and merging them back one by one.
                held.rotate(-keep)
                held.extend(rows)
                held.rotate(keep + len(rows))
            else:
                tail = [held.pop() for _ in range(newer)]
                tail.reverse()
                held.extend(heapq.merge(tail, rows, key=_ts))
        self._merged(new, now)
        return new

    def _counted(self, size: int, records: int) -> None:
        """size bytes and that many records more (or fewer) are stored: this log's size and its tally's."""
        self.size += size
        tally = self.tally
        tally.size += size
        tally.records += records

    def _stage_all(self, rows: list[_Row]) -> None:
        if self.journal is not None:
            for row in rows:
                self._stage(row)

    def _merged(self, new: list[StoredMessage], now: float) -> None:
        """What follows the rows of a merge taking their places: size, each publisher's last seq, the journal's
        write under `always`, retention."""
        self._counted(sum(record_size(m.publisher, m.payload) for m in new), len(new))
        for m in new:
            if m.seq > self.last_seq.get(m.publisher, -1):
                self.last_seq[m.publisher] = m.seq
                self.last_seen[m.publisher] = now
        if self.journal is not None and self.journal.policy.mode is FsyncMode.ALWAYS:
            self._write_each()
        self.expire(now)

    def _follows(self, new: list[StoredMessage]) -> bool:
        """Whether new (by timestamp, unique, already in `held`, all after the newest row) keeps every
        publisher's rows in seq order.  A cost per merged record on every secondary, so no more than a look at
        each: every publisher's seqs rise with the stamps, from above what is stored here."""
        last_seq = self.last_seq
        seen: dict[str, int] = {}
        for m in new:
            pub, seq = m.publisher, m.seq
            prev = seen.get(pub)
            if prev is None:
                if last_seq.get(pub, -1) >= seq:
                    return self._fits(new, len(self.rows))  # a stretch below what is stored: count it
            elif seq <= prev:
                return False
            seen[pub] = seq
        return True

    def _fits(self, new: list[StoredMessage], keep: int) -> bool:
        """Whether new (by timestamp, unique, already in `held`) keeps every publisher's rows in seq order and
        every stamp unique, when the rows from index keep on are newer than new's oldest (two holders stamping
        from the same newest row in one clock tick can give two messages one stamp, and a FETCH paging by
        timestamp would skip the second).

        The order holds here before the merge, so of a publisher's rows the newer ones (from keep on) hold its
        highest seqs, the first of them the lowest of these, and the older ones the rest.  Only the newer rows
        are walked, once, a dictionary look-up each; the older ones are out of place only if more of the
        publisher's kept seqs lie between its lowest new one and its first newer row than new has there."""
        rows = self.rows
        if keep and rows[keep - 1][0] == new[0].ts:
            return False
        span: dict[str, list[Any]] = {}  # publisher -> [lowest seq, highest seq, stamp of the highest, count]
        for m in new:
            sp = span.get(m.publisher)
            if sp is None:
                span[m.publisher] = [m.seq, m.seq, m.ts, 1]
            elif m.seq <= sp[1]:
                return False
            else:
                sp[1], sp[2], sp[3] = m.seq, m.ts, sp[3] + 1
        first: dict[str, _Row] = {}  # publisher -> its first row from keep on
        newer = len(rows) - keep
        stamps: set[float] | None = None
        walk_all = False
        if newer and new[-1].ts < rows[keep][0]:
            # All of new falls before the newer rows (a back-fill): no stamp to compare, and each publisher's first
            # newer row is usually among the first few of them.
            end = min(len(rows), keep + _FIRST_ROWS)
            for i in range(keep, end):
                row = rows[i]
                if row[1] in span and row[1] not in first:
                    first[row[1]] = row
                    if len(first) == len(span):
                        break
            walk_all = len(first) < len(span) and end < len(rows)
        elif newer:
            stamps = {m.ts for m in new}
            walk_all = True
        if walk_all:
            first.clear()
            for row in itertools.islice(reversed(rows), newer):
                if row[1] in span:
                    first[row[1]] = row
                if stamps is not None and row[0] in stamps:
                    return False
        for pub, (lowest, highest, stamp, count) in span.items():
            upper = None
            if (at := first.get(pub)) is not None:
                if at[2] <= highest or at[0] <= stamp:
                    return False  # a newer row of the publisher numbered below new, or above it but stamped before
                upper = at[2]
            if self.last_seq.get(pub, -1) <= lowest:
                continue  # nothing stored before this merge is numbered above new's lowest
            between = 0
            for lo, hi in self.kept(pub):
                lo, hi = max(lo, lowest + 1), hi if upper is None else min(hi, upper - 1)
                if lo <= hi:
                    between += hi - lo + 1
            if between > count - 1:
                return False
        return True

    def _reorder_merge(self, new: list[StoredMessage], now: float) -> list[StoredMessage]:
        """Merge new while putting each publisher's messages back in seq order in time (rare: `merge`).

        A message that would come before one with a lower seq of its publisher is stamped just after that one;
        stamps only ever move later, so a subscriber resuming by timestamp from any holder at worst gets a
        message again (dropped by seq), never misses one.  Then every stamp of the topic is made unique again
        (TS_EPSILON).  Held rows whose stamp moved are written to the journal again (recovery keeps the last
        copy of a record); their first copy stays until its segment expires, so a failed write loses nothing.
        Whole-history work: only a merge that found the order broken does it."""
        rows: list[_Row] = list(self.rows)
        held = len(rows)
        rows.extend(tuple(m) for m in new)  # type: ignore[misc]  # a Record's fields are a _Row
        stamp = [row[0] for row in rows]
        pubs = {m.publisher for m in new}
        mine: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            if row[1] in pubs:
                mine.setdefault(row[1], []).append(i)
        for idx in mine.values():
            idx.sort(key=lambda i: rows[i][2])
            floor = -math.inf
            for i in idx:
                if stamp[i] <= floor:
                    stamp[i] = floor + TS_EPSILON
                floor = stamp[i]
        out: list[_Row] = []
        moved: list[_Row] = []
        added: list[_Row] = []
        restamped = 0
        last = -math.inf
        for i in sorted(range(len(rows)), key=lambda i: (stamp[i], i)):
            row = rows[i]
            t = stamp[i] if stamp[i] > last else last + TS_EPSILON
            if t != row[0]:
                row = (t, row[1], row[2], row[3])
                restamped += 1
                if i < held:
                    moved.append(row)
            if i >= held:
                added.append(row)
            out.append(row)
            last = t
        if restamped:  # (a merge _fits could not prove in order can turn out to be: then nothing moved)
            _log.info(
                "topic %s: %d stored message(s) re-stamped to keep each publisher's messages in seq order "
                "(two holders had stored them apart)",
                self.name,
                restamped,
            )
            if self.on_restamp is not None:
                self.on_restamp(restamped)
        self._stage_all(added)
        if self.journal is not None:
            for row in moved:
                self.journal.stage(row)
        self.rows = deque(out)
        self._merged(new, now)
        return [_as_record(row) for row in added]


class Missing:
    """The records a replica lacks, taken a piece at a time, oldest first: a long answer to a pull leaves as the
    asker confirms what it got (sync.py `_Answer`).  Building and encoding 300,000 records in one go
    stalled the answering broker's event loop for ~0.4 s, and every batch queued behind them on the link.

    It walks the rows as they were when it was made (a copy of the deque's references from the oldest row the
    replica lacks, ~1 ms per 300,000 rows): what is stored later travels as the next batches or at the next
    anti-entropy round; a row that expires meanwhile is sent all the same (the asker's retention drops it again)."""

    __slots__ = ("_pos", "_rows", "_theirs", "left")

    def __init__(self, rows: list[_Row], theirs: Mapping[str, SeqRanges], want: int) -> None:
        self._rows = rows
        self._theirs = theirs
        self._pos = 0
        self.left = want  # still to be found

    @property
    def done(self) -> bool:
        return self.left <= 0 or self._pos >= len(self._rows)

    def take(self, n: int) -> list[StoredMessage]:
        """The next (at most) n records the replica lacks."""
        out: list[StoredMessage] = []
        rows, theirs, i, end = self._rows, self._theirs, self._pos, len(self._rows)
        while i < end and len(out) < n and len(out) < self.left:
            m = rows[i]
            i += 1
            if lacks(theirs, m[1], m[2]):
                out.append(_as_record(m))
        self._pos = i
        self.left -= len(out)
        if self.done:
            self._rows = []  # the snapshot is let go as soon as it is used up
        return out


def _ts(m: _Row) -> float:
    return m[0]


class _TsView:
    """A read-only sequence of timestamps over a deque of messages, for bisect."""

    __slots__ = ("_msgs",)

    def __init__(self, msgs: deque[_Row]) -> None:
        self._msgs = msgs

    def __len__(self) -> int:
        return len(self._msgs)

    def __getitem__(self, i: int) -> float:
        return self._msgs[i][0]


class TopicStore:
    """All topics a broker holds, whatever its role for each (with `disk`, each with its disk journal)."""

    def __init__(self, retention: Retention | RetentionPolicy | None = None, disk: DiskStore | None = None) -> None:
        self.policy = retention if isinstance(retention, RetentionPolicy) else RetentionPolicy(retention or Retention())
        self.disk = disk
        self._topics: dict[str, TopicLog] = {}
        # The topics held by this broker's rank for each (0 none, 1 primary, 2 secondary, 3 tertiary): `ranked`.
        self.tallies: tuple[Tally, ...] = tuple(Tally() for _ in range(4))
        self._expiry: Sweep[str] = Sweep()
        # Records re-stamped by the merges of every topic held (TopicLog.on_restamp), dropped topics' too.
        self.restamped = 0

    def _restamped(self, n: int) -> None:
        self.restamped += n

    def retain(self, policy: RetentionPolicy) -> int:
        """A new retention policy (a reload): every topic held keeps by it from now on, the next `expire`
        dropping what it no longer keeps.  Returns how many topics' retention changed."""
        self.policy = policy
        changed = 0
        for log in self._topics.values():
            if (r := policy.of(log.name)) != log.retention:
                log.retention = r
                changed += 1
        return changed

    def __contains__(self, name: object) -> bool:
        return name in self._topics

    def __iter__(self) -> Iterator[TopicLog]:
        return iter(list(self._topics.values()))

    def __len__(self) -> int:
        return len(self._topics)

    def get(self, name: str) -> TopicLog:
        """The topic's log, or TopicNotFound."""
        log = self._topics.get(name)
        if log is None:
            raise TopicNotFound(
                f"this broker holds no data for topic {name!r}; `sedax locate {name}` shows which brokers do"
            )
        return log

    def ensure(
        self,
        name: str,
        coord: tuple[float, float] = (0.0, 0.0),
        home: tuple[float, float] = (0.0, 0.0),
        delegates: tuple[tuple[tuple[float, float], float], ...] = (),
    ) -> TopicLog:
        """The topic's log, created empty if new (its journal records coord, home and the delegate list for
        recovery)."""
        log = self._topics.get(name)
        if log is None:
            journal = None if self.disk is None else self.disk.open_log(TopicMeta(name, coord, home, delegates))
            log = self._topics[name] = TopicLog(name, self.policy.of(name), journal=journal, on_restamp=self._restamped)
            self._count_in(log, self.tallies[0])
        return log

    def _count_in(self, log: TopicLog, tally: Tally | None) -> None:
        """log's size and records count into tally from now on (None: no longer into any of this store's)."""
        if (old := log.tally) is not _LOOSE:
            old.size -= log.size
            old.records -= len(log.rows)
            old.names.discard(log.name)
        if tally is None:
            log.tally = _LOOSE
            return
        tally.size += log.size
        tally.records += len(log.rows)
        tally.names.add(log.name)
        log.tally = tally

    def ranked(self, log: TopicLog, rank: int) -> None:
        """This broker's rank for log's topic is rank now (TopicTable.rerank): it counts by that in `held`."""
        if self._topics.get(log.name) is log and log.tally is not (tally := self.tallies[rank]):
            self._count_in(log, tally)

    def held(self, rank: int) -> int:
        """L_T summed over the topics this broker holds at rank (1 primary, 2 secondary, 3 tertiary), in bytes."""
        return self.tallies[rank].size

    def drop(self, name: str) -> TopicLog | None:
        """Forget a topic (handed over, or no longer ours), its journal too; returns what was dropped."""
        log = self._topics.pop(name, None)
        if log is not None:
            self._count_in(log, None)
            if self.disk is not None:
                self.disk.forget(name)
        return log

    def recover(self, now: float) -> tuple[list[TopicMeta], RecoveryReport]:
        """Load every topic of the data directory (none without one); returns their metas and what was found.

        Retention applies at once: a broker that was down longer than the retention starts without the
        expired records (their dedup state stays).
        """
        if self.disk is None:
            return [], RecoveryReport()
        found, report = self.disk.recover()
        metas = []
        for rec in found:
            log = TopicLog(
                rec.meta.name,
                self.policy.of(rec.meta.name),
                journal=self.disk.open_log(rec.meta),
                on_restamp=self._restamped,
            )
            log.rows = deque(rec.rows)
            log.size = sum(record_size(r[1], r[3]) for r in rec.rows)
            log.last_seq = dict(rec.last_seq)
            log.last_seen = dict(rec.last_seen)
            for _, pub, seq, _ in rec.rows:
                log._held(pub).add(seq)
            self._count_in(log, self.tallies[0])
            log.expire(now)
            self._topics[rec.meta.name] = log
            metas.append(rec.meta)
        return metas, report

    def save_delegates(self, lists: Mapping[str, Sequence[Delegation]]) -> None:
        """Keep the delegate lists of the topics this broker is the home of on the disk (without a data
        directory: nothing to keep them on, as the topics themselves).  A write that fails is logged: the lists
        stay in memory, and the copies' own meta.json keep theirs."""
        if self.disk is None:
            return
        try:
            self.disk.save_delegates({t: [(d.coord, d.start) for d in dl] for t, dl in lists.items()})
        except OSError as exc:
            _log.error("could not write the delegate lists to %s: %s", self.disk.data_dir, exc)

    def load_delegates(self) -> dict[str, list[Delegation]]:
        """The delegate lists `save_delegates` kept ({} without a data directory); StorageError if unreadable."""
        if self.disk is None:
            return {}
        return {t: [Delegation(c, start) for c, start in dl] for t, dl in self.disk.load_delegates().items()}

    def sync_due(self, now: float) -> None:
        """The INTERVAL write policy's beat (a no-op without a data directory or under other policies)."""
        if self.disk is not None:
            self.disk.sync_due(now)

    def close(self) -> None:
        """Write and close every journal (graceful shutdown)."""
        if self.disk is not None:
            for log in self._topics.values():
                # A record that finds no room now was never acknowledged: it is rolled back, not an error here.
                with contextlib.suppress(StorageError):
                    log.persist()
            self.disk.close()

    def expire(self, now: float) -> int:
        """Apply retention to every topic; returns the bytes freed."""
        return sum(log.expire(now) for log in self._topics.values())

    def expire_due(self, now: float) -> int:
        """Apply retention to the next slice of topics (broker/sweep.py): each within SWEEP_PERIOD.  (Bytes are
        applied as each record is appended; this is for age, and for a byte limit a reload lowered.)"""
        topics = self._topics
        return sum(log.expire(now) for name in self._expiry.take(topics, now) if (log := topics.get(name)) is not None)

    def memory(self) -> int:
        """Bytes the topics held and their stored messages take in memory, estimated (RECORD_MEMORY,
        TOPIC_MEMORY)."""
        stored = sum(t.size + t.records * RECORD_MEMORY for t in self.tallies)
        return stored + len(self._topics) * TOPIC_MEMORY

    def sizes(self) -> dict[str, int]:
        """L_T(t) in bytes for every topic held."""
        return {name: log.size for name, log in self._topics.items()}
