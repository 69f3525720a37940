"""The replication role: the primary's copy at the secondary (and, at level 3, the tertiary's).

The primary sends what it stored in a turn to the secondary (REPLICATE), acknowledges once the secondary
confirmed it (REPLICATED) and re-sends on a time-out.  Up to REPLICATION_WINDOW batches per topic are in
flight at once; they count in order (a confirmation counts once every earlier batch is confirmed too), so an
acknowledgement means the secondary holds the message and every message not yet acknowledged before it (and,
once its back-fill is confirmed, the whole history: `backfill`).  At level 3 the secondary passes each batch on
to the tertiary and confirms it once both hold it (`_chain`).

Data follows membership (docs/storage.md): a new secondary always receives the whole history, after a join or a
failure alike, so that every acknowledged message survives any later single change (the paper's level 2 copies
history only at level 3, Sec. IV-B; a cluster that restarts its brokers one by one spends a "failure" at every
step). The history is a back-fill beside the batches, not ahead of them (`backfill`): the first batch to a new
secondary carries every record not yet confirmed, so acknowledgements go on while the history streams; at level
3 the secondary back-fills a new tertiary the same way.  Anti-entropy: a primary compares digests with its
secondary now and then for the topics that changed, and sends what the copy lacks.

Every REPLICATE is taken here (`replicate_arrived`): a primary's batch, an answer to a pull or an offer (sync.py,
where pulls, offers and take-overs live) or a hand-over (moves.py).  What a broker does with its topics when the
overlay changes is ranks.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from broker.pubsub.core import TopicTable, chunks, same
from broker.pubsub.replica import PULLING, Backfill, Batch, CopyStage, Replica, Stage
from broker.pubsub.settings import MAX_CHAINED, MAX_RTO, MAX_SUPERSEDED, REPLICATION_WINDOW
from broker.storage import StorageError
from overlay.protocol import NodeInfo
from overlay.pubsub import SUBSCRIBED_TABLE_MAX, Heads, Offer, Replicate, Replicated, later

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.moves import MoveRole
    from broker.pubsub.ranks import RankRole
    from broker.pubsub.sync import SyncRole

log = logging.getLogger("sedax.pubsub")


@dataclass(slots=True)
class _Chained:
    """Level 3, at the secondary: a primary's batch passed on to the tertiary, not yet confirmed upstream."""

    topic: str
    origin: NodeInfo  # the primary
    upstream: int  # the primary's corr
    tertiary: str
    held_here: bool = False  # on this broker's disk (always/batch: the sync completed)
    held_there: bool = False  # the tertiary confirmed it


@dataclass(slots=True)
class RoundTrip:
    """How long a copy takes to confirm a batch, smoothed as TCP does (RFC 6298, section 2): its re-send
    time-out for every topic it holds a copy of.

    One fixed time-out per topic made a busy copy's slowness look like loss: with 100,000 topics in flight to a
    secondary, their confirmations came back after more than REPLICATION_TIMEOUT, every topic re-sent its batch,
    which doubled the secondary's work, and the three brokers of `bench_listing.py --topics 100000 --brokers 3
    --resilience 2` re-sent millions of batches (and logged each) without end.  Each confirmation measures its
    own batch (a re-send has a corr of its own), so there is no ambiguity to skip (Karn)."""

    srtt: float = 0.0  # smoothed round trip, seconds (0: no sample yet)
    rttvar: float = 0.0

    def sample(self, rtt: float) -> None:
        if self.srtt == 0.0:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def timeout(self, floor: float) -> float:
        """RTO = SRTT + 4 RTTVAR, within [floor, MAX_RTO]."""
        return min(MAX_RTO, max(floor, self.srtt + 4 * self.rttvar))


# A copy's re-sends are logged once per this many seconds, counted (one line per topic was millions of lines).
RESEND_LOG_EVERY: Final = 5.0


class ReplicationRole:
    """The primary's copies (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        # Level 3, at the secondary: corr of a batch passed on to the tertiary -> what to confirm to the primary
        # once the tertiary and this broker's disk hold it (`_chain`).
        self._chained: dict[int, _Chained] = {}
        # Per copy (node id): its confirmations' round trip (the re-send time-out of every topic it copies), and
        # its re-sends not logged yet and when the last was (`_resent`).
        self._round_trips: dict[str, RoundTrip] = {}
        self._resends: dict[str, tuple[int, float]] = {}
        # Wired by the engine.
        self.holder: HolderRole
        self.moves: MoveRole
        self.home: HomeRole
        self.sync: SyncRole
        self.ranks: RankRole

    # ---- the primary's copy at the secondary -----------------------------------------------------------------
    def flush(self, r: Replica) -> None:
        """Send the next batch to the secondary, or acknowledge and deliver when no copy is required."""
        if r.rank != 1 or r.stage in PULLING or r.stage is Stage.HANDING_OVER:
            return  # while pulling, pull_progress flushes once the other holders have answered
        # Written before it is replicated; acknowledged once it is on the disk as the write policy says (the sync
        # runs off the loop meanwhile, the copy travels to the secondary in parallel).
        self.holder.persist(r)
        self.holder.await_disk(r)
        sec = self.t.secondary(r)
        if sec is None:
            r.outbox.clear()
            r.meta_dirty = False
            r.meta_confirmed = False
            r.copy_refused = ""  # no copy left to refuse (a copy that comes back is given the history)
            r.copy.alone()  # stored without a copy: a secondary that comes (back) gets the whole history
            r.window.clear()
            self.holder.commit(r, r.last_ts)
            self.moves.staged_ready(r)
            return
        changed = any(b.target != sec.id for b in r.window)
        if changed:
            # The secondary changed under batches in flight (view_changed normally saw it first): they no longer
            # count; what they carried goes to the new one in the next batch, which carries every record not
            # yet confirmed.
            r.window.clear()
            r.outbox = r.unconfirmed()
            r.meta_dirty = True
        if r.copy.next_is(sec.id):  # a new secondary gets the whole history (module docstring)
            r.meta_confirmed = False  # (and the meta goes along until a batch that carried it is confirmed)
            changed = True
        if changed:
            # The re-send time-out doubled while the former secondary was silent; the new one starts afresh, or a
            # lost first batch to it waited up to MAX_RTO.
            r.rto = self.t.config.replication_timeout
        self._send_batch(r, sec)
        if r.copy.wanted:
            self.backfill(r, sec)

    def _send_batch(self, r: Replica, sec: NodeInfo) -> None:
        """The records stored since the last batch (and the meta, until confirmed), if the window has room."""
        live = [b for b in r.window if not b.superseded]
        if len(live) >= REPLICATION_WINDOW:
            return  # the outbox waits for a confirmation and then leaves as one batch
        if not r.outbox and not r.meta_dirty:
            return
        # With nothing else in flight, the outbox after a re-send or a change of secondary holds every record not
        # yet confirmed, so this batch alone proves them held (`Batch.whole`).
        whole = not live and len(r.outbox) == (len(r.unconfirmed()) if r.recopying else len(r.undelivered))
        r.unchecked = True  # the next anti-entropy round compares digests with the secondary
        batches = chunks(r.outbox)
        if r.meta_dirty:
            r.meta_version += 1
            r.meta_confirmed = False
        # The subscribers, delegates and publisher table go along until the secondary confirmed them; after that
        # a batch is its records alone.
        meta = not r.meta_confirmed
        subs, dl, last_seq = r.meta() if meta else ((), (), {})
        corr = 0
        me, mark = self.t.ov.me, r.delivered_mark
        for batch in batches:
            corr = self.t.next_corr()
            recs = tuple(batch)
            msg = Replicate(corr, r.name, r.coord, me, recs, subs, dl, False, last_seq, delivered_upto=mark, meta=meta)
            self.t.ov.route(sec.coord, msg)
        upto = r.waiting[-1].record.ts if r.waiting else r.last_ts
        if len(batches) > 1:
            # A long re-send takes a while to copy: no re-send of all of it before it could have arrived.
            r.rto = max(r.rto, self.t.config.replication_timeout * len(batches))
        if live:
            self.t.counters["replicated_pipelined"] += 1
        if whole and len(r.window) > MAX_SUPERSEDED:
            r.window.clear()  # re-sends that stayed unconfirmed: this batch carries everything they did
        r.unchecked_mark = self.t.peers.mark()
        r.window.append(Batch(corr, sec.id, self.t.ov.now(), upto, whole, meta_version=r.meta_version if meta else -1))
        if not live:  # (with batches in flight it is armed for the oldest one's time-out, the earliest)
            self.t.wake(r)
        r.outbox.clear()
        r.meta_dirty = False
        self.t.counters["replicated_batches"] += 1

    def backfill(self, r: Replica, sec: NodeInfo) -> None:
        """Give the next holder (the secondary; at level 3 the secondary's tertiary) the whole history: OFFER it
        everything kept here; it pulls what it lacks (a broker that restarted with its disk, only its gap) and
        confirms once that is on its disk.

        The history does not gate the acknowledgements: they count on the batches, the first of which to a new
        secondary carries every record not yet confirmed, so an acknowledged message is on both brokers however
        far the back-fill has got.  What was acknowledged before the change is on this broker alone until the
        back-fill is confirmed, as it was while a back-fill sent as one batch was in flight; an operator waits
        for `caught_up` (docs/storage.md).  The answer streams a few chunks at a time (`_Answer`), so neither
        this broker's event loop nor the batches behind it on the link wait for a long history: publishes were
        not acknowledged for ~1 s when a new secondary got 300,000 records as one batch."""
        corr = self.t.next_corr()
        now = self.t.ov.now()
        r.copy.offered(Backfill(corr, sec.id, now, mark=corr))
        self.t.peers.asked(sec.id, corr, now)
        self.t.wake(r)
        self.t.counters["offers"] += 1
        have = r.log.offerable()
        self.t.ov.route(sec.coord, Offer(corr, r.name, r.coord, self.t.ov.me, have, False, tuple(r.delegates)))

    def _backfilled(self, r: Replica, node: str, corr: int) -> None:
        """The next holder confirmed the back-fill (offered under corr): it holds the history offered, and the
        batches hold the rest."""
        nxt = self.next_holder(r)
        if nxt is None or nxt.id != node:
            r.copy.lapsed()  # the holders changed meanwhile: flush or tick starts the next one's back-fill
            self.copy_down(r)
            return
        if r.rank == 1 and r.unchecked and r.unchecked_mark <= corr:
            # Nothing stored here since the offer went out (its digest named all of it, the secondary holds all
            # of it now): the next anti-entropy round has nothing to compare.  A new secondary's first batch
            # made every topic of a join or a leave unchecked, and those rounds were a fifth of a 30,000-topic
            # join's offers and nearly half of a leave's (bench_join.py).
            r.unchecked = False
        r.copy.confirmed(node)  # (WANTED again if a merge since asked for another back-fill, which flush sends)
        if r.rank == 2:
            self.copy_down(r)  # what the secondary was given since goes to the tertiary too
            return
        self.moves.staged_ready(r)
        self.flush(r)

    def next_holder(self, r: Replica) -> NodeInfo | None:
        """The holder r copies its history to: the primary's secondary; at level 3, the secondary's tertiary."""
        if r.rank == 1:
            return self.t.secondary(r)
        if r.rank == 2 and self.t.config.resilience >= 3:
            ranked = self.t.ranked(r.coord)
            return ranked[2] if len(ranked) > 2 else None
        return None

    # ---- confirmations and copies arriving -------------------------------------------------------------------
    def replicated_arrived(self, m: Replicated) -> None:
        """REPLICATED: a copy, a pull answer or a hand-over was confirmed (or, with `refused`, not)."""
        self.t.peers.answered(m.node, m.corr, self.t.ov.now())
        if m.refused:
            self.copy_refused(m)
            return
        if self.sync.chunk_confirmed(m):
            return
        chained = self._chained.get(m.corr)
        if chained is not None:
            if chained.tertiary == m.node and chained.topic == m.topic:
                # The tertiary has the batch: the secondary confirms it to the primary once it is on its own disk
                # too (level 3, `_chain`).
                chained.held_there = True
                self._chain_confirm(m.corr)
            return
        r = self.t.replicas.get(m.topic)
        if r is None:
            return
        if self.sync.confirmed(r, m):
            return
        if r.stage is Stage.HANDING_OVER:
            self.moves.handover_confirmed(r, m.corr)
            return  # replica confirmations wait: an aborted move re-copies everything to the secondary
        if (bf := r.copy.offer) is not None and bf.corr == m.corr:
            if bf.target == m.node:
                self._backfilled(r, m.node, bf.corr)
            return
        batch = next((b for b in r.window if b.corr == m.corr), None)
        if batch is None or batch.target != m.node:
            return  # not ours, or from a node we no longer replicate to
        batch.confirmed = True
        self._round_trip(m.node).sample(self.t.ov.now() - batch.sent_at)
        # Confirmed in order: the batches up to the last one whose earlier ones are all confirmed, or up to a
        # confirmed whole batch, whatever became of the ones before it.
        frontier = -1
        for i, b in enumerate(r.window):
            if b.confirmed and (b.whole or frontier == i - 1):
                frontier = i
        if frontier < 0:
            return  # an earlier batch is still unconfirmed: the acknowledgements wait for it
        done, r.window = r.window[: frontier + 1], r.window[frontier + 1 :]
        if not r.meta_confirmed and any(b.confirmed and b.meta_version == r.meta_version for b in done):
            r.meta_confirmed = True  # the next batches carry records only
        r.rto = self.t.config.replication_timeout
        if r.copy_refused:
            log.warning("topic %s: the copies confirm again; publishes are taken again", r.name)
            r.copy_refused = ""
        self.holder.commit(r, done[-1].upto)
        self.moves.staged_ready(r)
        self.flush(r)

    def replicate_arrived(self, m: Replicate) -> None:
        """REPLICATE: the primary's copy, an answer to our pull, or a hand-over (moves.py)."""
        self._take(m)
        if self.t.config.resilience >= 3 and (r := self.t.replicas.get(m.topic)) is not None and r.copy.wanted:
            self.copy_down(r)  # (the level is looked at first: a REPLICATE at a level-2 copy is the hot path)

    def _take(self, m: Replicate) -> None:
        now = self.t.ov.now()
        if m.handover:
            self.moves.handover_arrived(m, now)
            return
        r = self.t.replicas.get(m.topic)
        if r is not None and r.stage is Stage.HANDING_OVER:
            # The topic's new primary picked this node as its secondary while the move is under way: this node
            # already holds everything it is sent, and becomes the replica when the move completes.  That includes
            # the meta it handed over: known, so the records-only batches after it count (before, the first of
            # them was left unconfirmed when the broker handing a topic over became the new primary's secondary,
            # and the topic's ACKs waited for the re-send, a replication time-out later).
            r.meta_known = True
            if m.corr:
                self.t.ov.route(m.origin.coord, Replicated(m.corr, m.topic, self.t.ov.me.id))
            return
        pull = r.pull if r is not None else None
        answers_pull = pull is not None and pull.asked.get(m.corr) == m.origin.id
        if r is not None and pull is not None and answers_pull and not same(m.coord, r.coord):
            # The asked node knows the topic at another coordinate: a delegate list, not data for us (a later one
            # moves this replica there: `follow`).
            del pull.asked[m.corr]
            self.home.learn_delegates(m.topic, list(m.delegates), m.origin)
            if self.t.replicas.get(m.topic) is r:
                self.sync.pull_progress(r)
            return
        if self.ranks.left_behind(m.topic, r, m.coord, m.delegates, m.origin):
            return  # a copy left behind sent this: it was told where the topic lives, and nothing is confirmed
        if pull is not None and pull.asked and m.origin.id in pull.asked.values():
            pull.heard = now  # an answer is still streaming in: the pull is making progress
        if answers_pull:
            self.t.peers.answered(m.origin.id, m.corr, now)
        if self.t.full and m.records and m.corr and not m.sync and not answers_pull:
            # New messages from their primary while this broker's memory is over --max-memory: refused like a
            # full disk refuses them (the primary refuses new publishes until a copy confirms again).  What a
            # membership change brings (syncs, pulls, hand-overs) is always taken.
            self.refuse_copy(m.topic, m.origin, m.corr, self.t.full)
            return
        created = r is None
        r = self.holder.replica(m.topic, m.coord)
        dl = r.delegates
        # Histories merge as a set union by (publisher, seq): a copy (even a complete one) adds to what is
        # here and never replaces it, so nothing another holder lacked is lost by a re-sync.
        new = r.log.merge(m.records, now)
        if m.delivered_upto > r.delivered_upto:
            r.delivered_upto = m.delivered_upto  # (a primary's batch, or one a level-3 secondary passed on)
        if new:
            r.unchecked = True
            r.unchecked_mark = self.t.peers.mark()
            if m.sync and r.rank == 2:
                r.copy.want()  # level 3: the tertiary gets what a back-fill or a repair brought (`copy_down`)
            if pull is not None and pull.push_merged and r.rank == 1:
                self.holder.merged(r, new)
        for pub, seq in m.last_seq.items():  # (merge took the records' own; this adds what only the table has)
            if seq > r.log.last_seq.get(pub, -1):
                r.log.last_seq[pub] = seq
                r.log.last_seen[pub] = now
        if (newest := r.log.last_ts) is not None:
            r.last_ts = max(r.last_ts, newest)
        if m.meta:
            subs = {(s.access.id, s.session): s for s in m.subscribers}
            theirs = pull.offered.pop(m.origin.id, None) if pull is not None else None
            if theirs is not None and r.rank == 1:
                self.sync.catch_up_newcomers(r, [s for k, s in subs.items() if k not in r.subscribers], theirs)
            # A copy takes its primary's lists as they are: from the primary's batch, or at level 3 from the
            # secondary, which passes the batches on (`_chain`) and back-fills the tertiary as syncs.  Other
            # syncs only add (the sender need not be the primary); so does a primary.
            upstream = not m.sync or self._from_secondary(m)
            if r.rank == 1 or not upstream:
                r.subscribers.update(subs)  # handed over to us, or a re-sync: keep what we had as well
            else:
                r.subscribers = subs
            if (upstream or created) and not later(dl, m.delegates):
                dl = list(m.delegates)
            r.meta_known = True
        r.place(m.coord, dl)
        self.t.rerank(r)
        if r.rank == 1:
            r.meta_dirty = True  # what a pull or an offer added here goes to the secondary with the next batch
        r.settle()
        refusal = self.holder.persist(r)
        stored = refusal is None
        if not m.meta and not r.meta_known:
            # A records-only batch for a copy that never received the subscribers and the publisher table from
            # its primary (it was read back from disk, or lost them): not confirmed, so the primary's re-send,
            # which carries them, makes it whole before the batch counts.
            self.t.counters["replicate_without_meta"] += 1
            return
        if pull is not None and answers_pull:
            del pull.asked[m.corr]
            if stored and self.sync.offer_answered(m.corr, m.origin.id):
                # The answer to an OFFER taken as part of this broker's sync: the offerer may let go now.
                self.confirm_on_disk(r, m.origin, m.corr)
            self.sync.pull_progress(r)
            return
        if stored and self._chain(r, m):
            pass  # level 3: confirmed to the primary once the tertiary has it too (`_chain`)
        elif m.corr and stored:  # 0: a leading chunk of a multi-frame copy; the last one carries the corr
            # Confirmed only once on disk: a full disk here leaves the batch unconfirmed, so the primary neither
            # acknowledges it nor forgets it (it re-sends).
            self.confirm_on_disk(r, m.origin, m.corr)
        elif m.corr and refusal is not None:
            self.refuse_copy(m.topic, m.origin, m.corr, str(refusal))
        if (
            m.sync
            and r.stage is Stage.HOLDING
            and not self.ranks.keeps(r.rank)
            and m.origin.id not in self.sync.leaving
        ):
            self.sync.retire(r)  # offered by a broker whose view ranks this one, but ours does not (yet)
        elif m.sync and created:
            self.sync.sync_learned(r)

    def _from_secondary(self, m: Replicate) -> bool:
        """m comes from the topic's secondary and this broker is its tertiary (level 3: a batch passed on, or
        the secondary's back-fill).  Before, the tertiary added the subscribers of such a sync to its own, so it
        kept every subscriber that ever unsubscribed; a secondary taking over pulled them back from it, and a
        session that had unsubscribed was delivered to again after one failure."""
        ranked = self.t.ranked(m.coord)
        return len(ranked) > 2 and ranked[1].id == m.origin.id and ranked[2].id == self.t.ov.me.id

    # ---- level 3: the secondary passes batches on ------------------------------------------------------------
    def _chain(self, r: Replica, m: Replicate) -> bool:
        """Level 3: the secondary passes each batch of the primary on to the tertiary and confirms the batch
        (the last chunk's corr) only once the tertiary confirmed it, so an acknowledged message is on three
        brokers and survives two of them failing at the same moment.  False if there is nothing to chain (not
        level 3, not the secondary, no third broker, not a primary's batch)."""
        if self.t.config.resilience < 3 or m.sync or m.handover or r.rank != 2:
            return False
        ranked = self.t.ranked(r.coord)
        if len(ranked) < 3:
            return False
        tertiary = ranked[2]
        corr = self.t.next_corr() if m.corr else 0
        if corr:
            self._chained[corr] = _Chained(m.topic, m.origin, m.corr, tertiary.id)
            if len(self._chained) > MAX_CHAINED:  # confirmations that never came; the primary re-sends anyway
                del self._chained[next(iter(self._chained))]

            def on_disk(exc: StorageError | None) -> None:
                if exc is not None:
                    log.warning("topic %s: %s", m.topic, exc)  # not confirmed: the primary re-sends the batch
                    if self._chained.pop(corr, None) is not None:
                        self.refuse_copy(m.topic, m.origin, m.corr, str(exc))
                elif (c := self._chained.get(corr)) is not None:
                    c.held_here = True
                    self._chain_confirm(corr)

            r.log.when_durable(on_disk)
        meta, subs, dl, last_seq = m.meta, m.subscribers, m.delegates, m.last_seq
        # A tertiary new to this broker is given the history (`replicate_arrived`): the batches passed on carry
        # only what is new.
        r.copy.next_is(tertiary.id)
        if not meta and r.meta_chained_to != tertiary.id:
            # A tertiary that has not had them from this broker gets this broker's (which are the primary's: a
            # records-only batch comes only after this broker confirmed them).
            meta, (subs, dl, last_seq) = True, r.meta()
        if meta:
            r.meta_chained_to = tertiary.id
        msg = Replicate(
            corr, m.topic, m.coord, self.t.ov.me, m.records, subs, dl, False, last_seq,
            delivered_upto=m.delivered_upto, sync=True, meta=meta,
        )  # fmt: skip
        self.t.ov.route(tertiary.coord, msg)
        return True

    def _chain_confirm(self, corr: int) -> None:
        """Level 3: confirm a batch to the primary once it is on this broker's disk and at the tertiary."""
        c = self._chained[corr]
        if c.held_here and c.held_there:
            del self._chained[corr]
            self.t.ov.route(c.origin.coord, Replicated(c.upstream, c.topic, self.t.ov.me.id))

    def confirm_on_disk(self, r: Replica, to: NodeInfo, corr: int) -> None:
        """REPLICATED to `to` once what r holds is on the disk as the write policy promises before an ACK (a
        copy's confirmation counts toward one); a failed sync confirms nothing, so the sender tries again."""
        me, topic = self.t.ov.me.id, r.name

        def on_disk(exc: StorageError | None) -> None:
            if exc is None:
                self.t.ov.route(to.coord, Replicated(corr, topic, me))
            else:
                log.warning("topic %s: %s", topic, exc)
                self.refuse_copy(topic, to, corr, str(exc))

        r.log.when_durable(on_disk)

    def refuse_copy(self, topic: str, to: NodeInfo, corr: int, why: str) -> None:
        """Tell the sender of a copy this broker could not store (its disk is full, or its memory over --max-memory)
        why, instead of leaving it to time out: a primary refuses new publishes with that text until a copy confirms
        again (`copy_refused`).  Before, its publishers saw only "no acknowledgement within 5 s", and the reason was
        in this log alone."""
        self.t.counters["copies_refused"] += 1
        me = self.t.ov.me.id
        self.t.ov.route(to.coord, Replicated(corr, topic, me, refused=f"{me}: {why}"))

    def copy_refused(self, m: Replicated) -> None:
        """A REPLICATED with `refused`: nothing is confirmed.  At a level-3 secondary, the tertiary's refusal of a
        batch passed on goes to the primary; at the primary, the refused batch's topic refuses new publishes
        (holder `publish_checked`) and the batch is sent again at the re-send time-out, until a copy confirms."""
        chained = self._chained.get(m.corr)
        if chained is not None:
            if chained.tertiary == m.node and chained.topic == m.topic:
                del self._chained[m.corr]
                self.t.ov.route(
                    chained.origin.coord, Replicated(chained.upstream, m.topic, self.t.ov.me.id, refused=m.refused)
                )
            return
        r = self.t.replicas.get(m.topic)
        if r is None or r.rank != 1:
            return
        batch = next((b for b in r.window if b.corr == m.corr), None)
        if batch is None or batch.target != m.node:
            return  # a sync, an offer or a back-fill: its sender's time-out tries again
        text = f"not stored: a broker that must hold a copy of {r.name!r} has no room for it ({m.refused})"
        if r.copy_refused != text:
            log.warning("topic %s: %s; refusing new publishes until a copy confirms", r.name, text)
        r.copy_refused = text

    # ---- time ------------------------------------------------------------------------------------------------
    def _round_trip(self, node: str) -> RoundTrip:
        rt = self._round_trips.get(node)
        if rt is None:
            if len(self._round_trips) >= 64:  # (forget the copies no longer in the view)
                view = self.t.ov.view()
                self._round_trips = {n: x for n, x in self._round_trips.items() if n in view}
            rt = self._round_trips[node] = RoundTrip()
        return rt

    def _resend_after(self, r: Replica, b: Batch) -> float:
        """How long after it was sent an unconfirmed batch of r is re-sent: its copy's round-trip time-out, at
        least r's own (`RoundTrip.timeout`)."""
        return self._round_trip(b.target).timeout(r.rto)

    def _resent(self, node: str, topic: str, rto: float, now: float) -> None:
        """Count a re-send to node, and log the count at most every RESEND_LOG_EVERY seconds per copy."""
        n, logged = self._resends.get(node, (0, -RESEND_LOG_EVERY))
        if now - logged < RESEND_LOG_EVERY:
            self._resends[node] = (n + 1, logged)
            return
        more = f" (and {n} more batch(es) to it since the last such line)" if n else ""
        log.warning("replica %s of %s did not confirm within %.1f s; re-sending%s", node, topic, rto, more)
        self._resends[node] = (0, now)

    def _tick_backfill(self, r: Replica, now: float) -> None:
        """A back-fill not confirmed (nor its answer making progress) within the offer time-out is offered again,
        from what the next holder has by then; a level-3 secondary back-fills its tertiary from here."""
        bf = r.copy.offer
        if bf is not None and now > bf.until(timeout := self.t.config.offer_timeout):
            if self.t.peers.behind(bf.target, bf.mark, now, timeout):
                bf.at = now  # the next holder is still answering what came before the offer (PeerProgress)
                return
            r.copy.lapsed()
            if r.rank == 1:
                self.flush(r)
                return
        self.copy_down(r)

    def copy_down(self, r: Replica) -> None:
        """Level 3: a secondary gives its tertiary the history when the tertiary is new to it or a back-fill or
        repair brought it records (one back-fill at a time; what arrives meanwhile goes with the next).  Only once
        it holds its primary's lists (`meta_known`): the tertiary takes the secondary's subscriber list as it is
        (`_from_secondary`), and a secondary read back from disk has none until its primary's batch brings it."""
        if self.t.config.resilience < 3:
            return  # (checked first: every replica passes here at every tick)
        idle = r.copy.stage is CopyStage.WANTED and r.rank == 2 and r.stage is Stage.HOLDING and r.meta_known
        if idle and (nxt := self.next_holder(r)) is not None:
            self.backfill(r, nxt)

    def _tell_heads(self, r: Replica, now: float) -> None:
        """HEADS to r's subscribers: the newest seq of each publisher that went quiet since the last round (last
        seen after the last HEADS' horizon, and at least heads_quiet ago).  A subscriber that lacks such a
        publisher's last messages finds no gap to repair until its next message, and one that stopped for good
        sends none (the subscriber's side: client `Subscription._heads`).  Not while records wait for the
        secondary: a head would name a message not yet delivered; the next round covers them."""
        if r.undelivered:
            return
        horizon = now - self.t.config.heads_quiet
        since, r.heads_at = r.heads_at, max(r.heads_at, horizon)
        last = r.log.last_seq
        quiet = [(p, last[p]) for p, t in r.log.last_seen.items() if since < t <= horizon and p in last]
        if not quiet and r.last_ts >= now - self.t.config.anti_entropy_interval:
            return  # nothing went quiet, and it delivered this round: its subscribers heard from it
        # An idle topic's subscribers hear from it anyway, an empty HEADS: one that hears nothing for a while is
        # registered nowhere that serves it, and subscribes again (client SUBSCRIPTION_LEASE).
        for i in range(0, max(len(quiet), 1), SUBSCRIBED_TABLE_MAX):
            self.t.counters["heads"] += 1
            self.t.tell_subscribers(r.subscribers.values(), Heads(r.name, dict(quiet[i : i + SUBSCRIBED_TABLE_MAX])))

    def tick(self, now: float, due: Iterable[Replica]) -> None:
        """Re-send unconfirmed batches, back-fills and anti-entropy (with the copies, and HEADS to the
        subscribers); the sync role repeats offers and slow pulls, the ranking role retires a copy ranked out.
        `due`: the replicas this tick looks at (TopicTable.due): those with such work under way, and a slice of
        the others, each of which so has its anti-entropy round every anti_entropy_interval or up to a
        SWEEP_PERIOD later."""
        self.sync.drop_quiet_answers(now)
        interval = self.t.config.anti_entropy_interval
        level3 = self.t.config.resilience >= 3
        for r in due:
            anti_entropy = now - r.checked_at >= interval
            if not anti_entropy and not r.timing_out() and (not level3 or r.copy.stage is not CopyStage.WANTED):
                # Nothing for this look (below: each step finds nothing to do), the common case of a sweep's
                # slice: the steps one by one cost ~2 us a replica, ~15 % of a core at 100,000 topics held.
                continue
            if anti_entropy:
                r.checked_at = now
            self.sync.repeat_offers(r, now)
            if anti_entropy and self.ranks.ranked_out(r):
                continue
            # Not while a batch is in flight or stored this turn and not yet sent (`outbox`): the offer would
            # reach the secondary before the batch, which would then pull what is already on its way.
            if anti_entropy and r.unchecked and r.stage is Stage.SERVING and not r.window and not r.outbox:
                r.unchecked = False
                sec = self.t.secondary(r)
                if sec is not None and r.copy.holder == sec.id:
                    self.t.counters["anti_entropy_offers"] += 1
                    self.sync.offer(r, [sec], track=False)
            if anti_entropy and r.subscribers and r.stage is Stage.SERVING and r.rank == 1:
                self._tell_heads(r, now)
            self._tick_backfill(r, now)
            live = [b for b in r.window if not b.superseded]
            if live and now > live[0].resend_at(rto := self._resend_after(r, live[0])):
                if self.t.peers.behind(live[0].target, live[0].corr, now, rto):
                    live[0].held_until = now + rto  # not lost: the copy still confirms earlier ones (PeerProgress)
                else:
                    self._resend(r, live, rto, now)
            self.sync.retry_pull(r, now)

    def _resend(self, r: Replica, live: list[Batch], rto: float, now: float) -> None:
        """The oldest unconfirmed batch (or one before it) was lost or the copy is slow: go back to it."""
        self._resent(live[0].target, r.name, rto, now)
        r.rto = max(r.rto, min(r.rto * 2, MAX_RTO))  # a long re-send keeps its longer time-out
        self.t.counters["replication_resends"] += 1
        for b in live:
            b.superseded = True
        # Re-send everything not yet confirmed in one whole batch; the replica merges, so what it already had is
        # not duplicated.
        r.outbox = r.unconfirmed()
        r.meta_dirty = True
        self.flush(r)

    def deadline(self, r: Replica) -> float:
        """When r's oldest unconfirmed batch is re-sent, or its back-fill offered again (`tick`), if not confirmed
        by then; math.inf if neither is under way."""
        at = math.inf
        live = next((b for b in r.window if not b.superseded), None)
        if live is not None:
            at = live.resend_at(self._resend_after(r, live))
        if (bf := r.copy.offer) is not None:
            at = min(at, bf.until(self.t.config.offer_timeout))
        return at
