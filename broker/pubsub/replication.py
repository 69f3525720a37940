"""The replication role: copies at the secondary, pulls from previous holders, take-over after a failure.

The primary sends what it stored in a turn to the secondary (REPLICATE), acknowledges once the secondary
confirmed it (REPLICATED) and re-sends on a time-out.  Up to REPLICATION_WINDOW batches per topic are in
flight at once; they count in order (a confirmation counts once every earlier batch is confirmed too), so an
acknowledgement means the secondary holds the message and every message not yet acknowledged before it (and,
once its back-fill is confirmed, the whole history: `backfill`).  When the
overlay changes, every broker re-ranks itself for the topics it holds (`view_changed`): a secondary that
became closest takes over (TAKING_OVER: it merges what the other holders have, then re-delivers the last
moments, which subscribers de-duplicate by (publisher, seq)); a broker that became closest without holding the
topic pulls it first (SYNCING, Sec. III-C).

Data follows membership (docs/storage.md): a new secondary always receives the whole history, after a join or a
failure alike, so that every acknowledged message survives any later single change (the paper's level 2 copies
history only at level 3, Sec. IV-B; a cluster that restarts its brokers one by one spends a "failure" at every
step). The history is a back-fill beside the batches, not ahead of them (`backfill`): the first batch to a new
secondary carries every record not yet confirmed, so acknowledgements go on while the history streams; at level
3 the secondary back-fills a new tertiary the same way. A broker that the view ranks out of a topic's holders
does not drop it at once: it RETIRES, offering its records (OFFER: a digest of what it holds) to the topic's
holders now, which pull what they lack, and drops the topic once each confirmed. A primary that was demoted
offers to the new primary, so what only it had (a partition's other side) is merged. Pulls carry the asker's
digest, so a restarted broker fetches only what it missed. Anti-entropy: a primary compares digests with its
secondary now and then for the topics that changed, and sends what the copy lacks.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker.pubsub.core import TopicTable, chunks, same
from broker.pubsub.replica import PULLING, Backfill, Batch, CopyStage, Pulling, Replica, Stage, Transition
from broker.pubsub.settings import MAX_CHAINED, MAX_RTO, MAX_SUPERSEDED, REPLICATION_WINDOW, SYNC_CHUNK, SYNC_WINDOW
from broker.storage import StorageError
from broker.store import Missing
from overlay.delegation import DelegateUpdate
from overlay.geometry import Coord
from overlay.protocol import NodeInfo
from overlay.pubsub import (
    SUBSCRIBED_TABLE_MAX,
    Delegation,
    Heads,
    Offer,
    Publish,
    Pull,
    Record,
    Replicate,
    Replicated,
    SubRef,
    Subscribe,
    later,
)
from overlay.seqset import SeqRanges, covers, ranges_of

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.moves import MoveRole

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
class _Answer:
    """A long answer to a PULL (`_send_sync`), SYNC_WINDOW chunks in flight: the asker confirms each chunk once
    it is on its disk, and the next one leaves then; the last chunk carries the pull's corr.

    Paced by the asker's disk on purpose.  Confirmed on arrival instead, a back-fill of ~300,000 records under
    --fsync batch took 1.3-1.5 s instead of 2.3-2.5, but the topic's batches at the asker, which wait for the same
    group commits, went from p99.9 5-7 ms to 35-56 ms while it ran: each sync then covered far more data
    (bench_anti_entropy.py --fsync batch --kill-during, docs/benchmarks-latency.md, fourteenth round)."""

    topic: str
    to: NodeInfo
    corr: int  # the pull's
    rest: Missing
    heard: float  # when it was asked, or the asker last confirmed a chunk
    inflight: set[int] = field(default_factory=set)  # corrs of the chunks sent and not yet confirmed
    meta_sent: bool = False  # the first chunk went (with the meta)


class ReplicationRole:
    """Replication, pulls and take-overs (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        self._last_anti_entropy = 0.0
        self._leaving: set[str] = set()  # brokers that announced a graceful shutdown and are still in the view
        # Level 3, at the secondary: corr of a batch passed on to the tertiary -> what to confirm to the primary
        # once the tertiary and this broker's disk hold it (`_chain`).
        self._chained: dict[int, _Chained] = {}
        # OFFER corr -> offerer, where this broker answered the offer with the pull of its own sync.
        self._offer_pulls: dict[int, str] = {}
        # Long answers to pulls under way: by (topic, asker), and by the corr of each chunk in flight.
        self._answers: dict[tuple[str, str], _Answer] = {}
        self._answer_chunks: dict[int, _Answer] = {}
        # Wired by the engine.
        self.holder: HolderRole
        self.moves: MoveRole
        self.home: HomeRole

    # ---- the primary's copy at the secondary ---------------------------------------------------------
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
            r.copy.alone()  # stored without a copy: a secondary that comes (back) gets the whole history
            r.window.clear()
            self.holder.commit(r, r.last_ts)
            self.moves.staged_ready(r)
            return
        if any(b.target != sec.id for b in r.window):
            # The secondary changed under batches in flight (view_changed normally saw it first): they no longer
            # count; what they carried goes to the new one in the next batch, which carries every record not
            # yet confirmed.
            r.window.clear()
            r.outbox = r.unconfirmed()
            r.meta_dirty = True
        if r.copy.next_is(sec.id):  # a new secondary gets the whole history (module docstring)
            r.meta_confirmed = False  # (and the meta goes along until a batch that carried it is confirmed)
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
        r.window.append(Batch(corr, sec.id, self.t.ov.now(), upto, whole, meta_version=r.meta_version if meta else -1))
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
        r.copy.offered(Backfill(corr, sec.id, self.t.ov.now()))
        self.t.counters["offers"] += 1
        have = r.log.offerable()
        self.t.ov.route(sec.coord, Offer(corr, r.name, r.coord, self.t.ov.me, have, False, tuple(r.delegates)))

    def _backfilled(self, r: Replica, node: str) -> None:
        """The next holder confirmed the back-fill: it holds the history offered, and the batches hold the rest."""
        nxt = self.next_holder(r)
        if nxt is None or nxt.id != node:
            r.copy.lapsed()  # the holders changed meanwhile: flush or tick starts the next one's back-fill
            self._copy_down(r)
            return
        r.copy.confirmed(node)  # (WANTED again if a merge since asked for another back-fill, which flush sends)
        if r.rank == 2:
            self._copy_down(r)  # what the secondary was given since goes to the tertiary too
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

    def replicated_arrived(self, m: Replicated) -> None:
        """REPLICATED: a copy, a pull answer or a hand-over was confirmed."""
        answer = self._answer_chunks.get(m.corr)
        if answer is not None and answer.to.id == m.node:
            del self._answer_chunks[m.corr]
            answer.inflight.discard(m.corr)
            self._pump(answer)
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
        if r.pull is not None and r.pull.asked.get(m.corr) == m.node:
            del r.pull.asked[m.corr]  # the asked node holds nothing of it
            self.pull_progress(r)
            return
        if r.offers.get(m.corr) == m.node:
            del r.offers[m.corr]  # that holder now has everything this one offered
            if r.stage is Stage.RETIRING and not r.offers:
                self.let_go(r)
            return
        if r.stage is Stage.HANDING_OVER:
            self.moves.handover_confirmed(r, m.corr)
            return  # replica confirmations wait: an aborted move re-copies everything to the secondary
        if (bf := r.copy.offer) is not None and bf.corr == m.corr:
            if bf.target == m.node:
                self._backfilled(r, m.node)
            return
        batch = next((b for b in r.window if b.corr == m.corr), None)
        if batch is None or batch.target != m.node:
            return  # not ours, or from a node we no longer replicate to
        batch.confirmed = True
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
        self.holder.commit(r, done[-1].upto)
        self.moves.staged_ready(r)
        self.flush(r)

    def replicate_arrived(self, m: Replicate) -> None:
        """REPLICATE: the primary's copy, an answer to our pull, or a hand-over (moves.py)."""
        self._take(m)
        if self.t.config.resilience >= 3 and (r := self.t.replicas.get(m.topic)) is not None and r.copy.wanted:
            self._copy_down(r)  # (the level is looked at first: a REPLICATE at a level-2 copy is the hot path)

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
                self.pull_progress(r)
            return
        if self._left_behind(m.topic, r, m.coord, m.delegates, m.origin):
            return  # a copy left behind sent this: it was told where the topic lives, and nothing is confirmed
        if pull is not None and pull.asked and m.origin.id in pull.asked.values():
            pull.heard = now  # an answer is still streaming in: the pull is making progress
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
            if m.sync and r.rank == 2:
                r.copy.want()  # level 3: the tertiary gets what a back-fill or a repair brought (`_copy_down`)
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
                self._catch_up_newcomers(r, [s for k, s in subs.items() if k not in r.subscribers], theirs)
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
        r.rank = self.t.rank_of_me(r.coord)
        if r.rank == 1:
            r.meta_dirty = True  # what a pull or an offer added here goes to the secondary with the next batch
        r.settle()
        stored = self.holder.persist(r)
        if not m.meta and not r.meta_known:
            # A records-only batch for a copy that never received the subscribers and the publisher table from
            # its primary (it was read back from disk, or lost them): not confirmed, so the primary's re-send,
            # which carries them, makes it whole before the batch counts.
            self.t.counters["replicate_without_meta"] += 1
            return
        if pull is not None and answers_pull:
            del pull.asked[m.corr]
            if stored and self._offer_pulls.pop(m.corr, None) == m.origin.id:
                # The answer to an OFFER taken as part of this broker's sync: the offerer may let go now.
                self.confirm_on_disk(r, m.origin, m.corr)
            self.pull_progress(r)
            return
        if stored and self._chain(r, m):
            pass  # level 3: confirmed to the primary once the tertiary has it too (`_chain`)
        elif m.corr and stored:  # 0: a leading chunk of a multi-frame copy; the last one carries the corr
            # Confirmed only once on disk: a full disk here leaves the batch unconfirmed, so the primary neither
            # acknowledges it nor forgets it (it re-sends).
            self.confirm_on_disk(r, m.origin, m.corr)
        if m.sync and r.stage is Stage.HOLDING and not self.keeps(r.rank) and m.origin.id not in self._leaving:
            self.retire(r)  # offered by a broker whose view ranks this one, but ours does not (yet)
        elif m.sync and created:
            self.sync_learned(r)

    def _from_secondary(self, m: Replicate) -> bool:
        """m comes from the topic's secondary and this broker is its tertiary (level 3: a batch passed on, or
        the secondary's back-fill).  Before, the tertiary added the subscribers of such a sync to its own, so it
        kept every subscriber that ever unsubscribed; a secondary taking over pulled them back from it, and a
        session that had unsubscribed was delivered to again after one failure."""
        ranked = self.t.ranked(m.coord)
        return len(ranked) > 2 and ranked[1].id == m.origin.id and ranked[2].id == self.t.ov.me.id

    # ---- pulling a topic from its previous holders (Sec. III-C) ----------------------------------------
    def sync_learned(self, r: Replica, offered: tuple[int, NodeInfo] | None = None) -> Pulling | None:
        """A serving primary learned from another holder that it lacks records: a topic new to it (a broker that
        joined closest to it hears of it from an OFFER or a copy), or an OFFER of records it lacks (the other
        side of a healed partition, a copy that kept what it missed).  It syncs - pulls what every other holder
        has, the offerer's answer among them - and serves again only once it holds all of it (storage-anchors:
        leadership only to a caught-up replica); requests wait meanwhile.  The pull, or None if it is not a
        serving primary or there is nobody to ask."""
        if r.rank != 1 or r.stage is not Stage.SERVING:
            return None
        return self.start_pull(r, takeover=False, offered=offered)

    def start_pull(self, r: Replica, *, takeover: bool, offered: tuple[int, NodeInfo] | None = None) -> Pulling | None:
        """SYNC (a primary new to the topic) or TAKE_OVER (after a failure): ask the other holders; the pull, or
        None if there is nobody to ask (the replica stays as it is).  offered: (corr, node) of an OFFER being answered
        with this pull: that node is asked under the offer's corr, so its answer is one of the pull's."""
        if r.rank != 1:
            return None
        others = self.t.ranked(r.coord)[1:]
        if not others:
            return None
        r.enter(Transition.TAKE_OVER if takeover else Transition.SYNC)
        pull = r.pull
        assert pull is not None  # made by enter: SYNCING or TAKING_OVER now
        pull.started = pull.heard = self.t.ov.now()
        pull.retried = False
        have = r.log.digest()  # the answers carry only what this broker lacks (a restart fetches its gap)
        asked = set()
        if offered is not None:
            corr, node = offered
            pull.asked[corr] = node.id
            self._offer_pulls[corr] = node.id  # its answer also confirms the offer (replicate_arrived)
            if len(self._offer_pulls) > MAX_CHAINED:  # answers that never came (the pull timed out)
                del self._offer_pulls[next(iter(self._offer_pulls))]
            asked.add(node.id)
            self.t.ov.route(node.coord, Pull(corr, r.name, r.coord, self.t.ov.me, have))
        for n in others:
            if n.id in asked:
                continue
            corr = self.t.next_corr()
            pull.asked[corr] = n.id
            self.t.ov.route(n.coord, Pull(corr, r.name, r.coord, self.t.ov.me, have))
        return pull

    def pull_arrived(self, p: Pull) -> None:
        """PULL: send what we hold of the topic (or where it lives, or that we hold nothing)."""
        r = self.t.replicas.get(p.topic)
        dl = self.home.delegate_lists.get(p.topic)
        me = self.t.ov.me
        if (r is None or not same(r.coord, p.coord)) and dl:
            self.t.ov.route(p.origin.coord, Replicate(p.corr, p.topic, dl[-1].coord, me, (), (), tuple(dl), False, {}))
            return
        if r is None or (not r.log.rows and not r.subscribers and not r.log.last_seq):
            self.t.ov.route(p.origin.coord, Replicated(p.corr, p.topic, me.id))
            return
        self._send_sync(r, p.origin, p.corr, {} if p.have is None else ranges_of(p.have))
        self.t.counters["handovers"] += 1

    def _add_subscribers(self, r: Replica, subs: tuple[SubRef, ...], theirs: dict[str, SeqRanges]) -> None:
        """Subscribers an offering copy lists and this primary lacks (a SUBSCRIBE a demoted primary served before
        its view changed): registered here, given what they missed (the records outside the offerer's `theirs`),
        and copied to the secondary with the next batch.  Before, an offer this primary answered without a
        pull (it held every record offered) left them out, and its batches then replaced the copy's list."""
        newcomers = [s for s in subs if (s.access.id, s.session) not in r.subscribers]
        if not newcomers:
            return
        for s in newcomers:
            r.subscribers[(s.access.id, s.session)] = s
        r.meta_dirty = True
        self._catch_up_newcomers(r, newcomers, theirs)
        self.t.mark(r)

    def _catch_up_newcomers(self, r: Replica, newcomers: list[SubRef], theirs: dict[str, SeqRanges]) -> None:
        """Subscribers handed over by a holder that lacked some of r's records (the other side of a healed
        partition) never got those: send them the acknowledged ones now, before anything newer (requests wait
        while r syncs); those not yet acknowledged reach them with everyone else's (holder.commit)."""
        if not newcomers:
            return
        waiting = {(x.publisher, x.seq) for x in r.undelivered}
        recs = [x for x in r.log.missing_from(theirs) if (x.publisher, x.seq) not in waiting]
        self.t.deliver_to(newcomers, r.name, recs)

    def _send_sync(self, r: Replica, to: NodeInfo, corr: int, theirs: Mapping[str, SeqRanges]) -> None:
        """The records another holder lacks (its digest: `theirs`), with the subscribers and dedup state; the last
        frame carries corr.  A short answer (a gap, an anti-entropy round) leaves at once; a long one (a new
        holder's whole history) as the asker confirms its chunks (`_Answer`)."""
        missing = r.log.missing_stream(theirs)
        if missing.left <= SYNC_WINDOW * SYNC_CHUNK:
            records = missing.take(missing.left)
            self.t.counters["synced_records"] += len(records)
            batches = chunks(records)
            for i, batch in enumerate(batches):
                self._sync_frame(r, to, corr if i == len(batches) - 1 else 0, batch, meta=True)
            return
        answer = _Answer(r.name, to, corr, missing, self.t.ov.now())
        if (old := self._answers.get((r.name, to.id))) is not None:
            self._drop_answer(old)  # asked again (a retry, a repeated offer): this answer starts from its digest
        self._answers[(r.name, to.id)] = answer
        self._pump(answer)

    def _sync_frame(self, r: Replica, to: NodeInfo, corr: int, records: list[Record], *, meta: bool) -> None:
        """One REPLICATE (sync) of an answer; with meta, the subscribers, delegates and publisher table."""
        subs, dl, last_seq = r.meta() if meta else ((), (), {})
        self.t.ov.route(
            to.coord,
            Replicate(
                corr, r.name, r.coord, self.t.ov.me, tuple(records), subs, dl, False, last_seq, sync=True, meta=meta
            ),
        )

    def _pump(self, a: _Answer) -> None:
        """Send an answer's next chunks while fewer than SYNC_WINDOW are unconfirmed; the last one carries the
        pull's corr.  The answer is forgotten once its chunks are all confirmed (or, in `tick`, when the asker
        went quiet)."""
        r = self.t.replicas.get(a.topic)
        if r is None:
            self._drop_answer(a)  # the topic was dropped here: the asker's pull times out and asks whoever holds it
            return
        a.heard = self.t.ov.now()
        if (bf := r.copy.offer) is not None and bf.corr == a.corr:
            bf.at = a.heard  # the back-fill this answers is making progress: no time-out
        while len(a.inflight) < SYNC_WINDOW and a.corr:
            records = a.rest.take(SYNC_CHUNK)
            self.t.counters["synced_records"] += len(records)
            batches = chunks(records)
            for i, batch in enumerate(batches):
                last = a.rest.done and i == len(batches) - 1
                if last:
                    corr, a.corr = a.corr, 0  # the answer is complete once its last chunk is sent
                else:
                    corr = self.t.next_corr()
                    a.inflight.add(corr)
                    self._answer_chunks[corr] = a
                # The subscribers, delegates and publisher table go with the first chunk (a copy that never had
                # them confirms nothing without them) and the last (as they are by then), not with each.
                self._sync_frame(r, a.to, corr, batch, meta=last or not a.meta_sent)
                a.meta_sent = True
        if not a.corr and not a.inflight:
            self._drop_answer(a)

    def _drop_answer(self, a: _Answer) -> None:
        if self._answers.get((a.topic, a.to.id)) is a:
            del self._answers[(a.topic, a.to.id)]
        for corr in a.inflight:
            self._answer_chunks.pop(corr, None)
        a.inflight.clear()
        a.corr = 0

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
                    self._chained.pop(corr, None)
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

        r.log.when_durable(on_disk)

    # ---- offers: handing records on to the topic's holders -----------------------------------------------
    def keeps(self, rank: int) -> bool:
        """A broker of this rank keeps a copy of the topic (primary, secondary, tertiary at level 3)."""
        return 1 <= rank <= max(2, self.t.config.resilience) and (rank == 1 or self.t.config.resilience >= 2)

    def offer(self, r: Replica, targets: list[NodeInfo], *, track: bool = True, leaving: bool = False) -> None:
        """OFFER r's records to targets; tracked offers wait for REPLICATED and are repeated on a time-out."""
        if track:
            r.offers.clear()
            r.offered_at = self.t.ov.now()
        have = r.log.offerable()
        me = self.t.ov.me
        # A copy's subscribers go along: a demoted primary may hold some the new primary never heard of (a
        # SUBSCRIBE it served before its view changed), and an offer answered without a pull carried none.
        subs = tuple(r.subscribers.values()) if r.rank != 1 else ()
        self.t.counters["offers"] += len(targets)
        for n in targets:
            corr = self.t.next_corr()
            if track:
                r.offers[corr] = n.id
            self.t.ov.route(n.coord, Offer(corr, r.name, r.coord, me, have, leaving, tuple(r.delegates), subs))

    def offer_arrived(self, m: Offer) -> None:
        """OFFER: confirm when everything offered is here already, else ask for what is missing."""
        me = self.t.ov.me
        if m.origin.id == me.id:
            # Routed back to its sender: a broker that has just joined has no link closer to the coordinate yet.
            # Answered, it would confirm itself; unanswered, the offer goes out again after the time-out.
            return
        if m.leaving:
            self._leaving.add(m.origin.id)  # its records are to stay here although the view still ranks it
        r = self.t.replicas.get(m.topic)
        if self._left_behind(m.topic, r, m.coord, m.delegates, m.origin):
            return  # the offerer follows the list it was told, and offers there
        if r is not None and same(r.coord, m.coord) and r.stage is not Stage.GONE:
            if m.subscribers and r.rank == 1:
                self._add_subscribers(r, m.subscribers, ranges_of(m.have))
            self._offer_back(r, m)
            if covers(r.log.held, ranges_of(m.have)):
                self.confirm_on_disk(r, m.origin, m.corr)
                return
            if (pull := self.sync_learned(r, offered=(m.corr, m.origin))) is not None:
                # What it lacked never reached its subscribers (holder.merged), nor what the offerer lacked the
                # offerer's subscribers, which come with its answer.
                pull.push_merged = True
                pull.offered[m.origin.id] = ranges_of(m.have)
                return
            self.t.ov.route(m.origin.coord, Pull(m.corr, m.topic, m.coord, me, r.log.digest()))
            return
        if r is None and self.t.rank_of_me(m.coord) == 1:
            r = self.holder.replica(m.topic, m.coord)
            if self.sync_learned(r, offered=(m.corr, m.origin)):
                return
        # Nothing of it here (or at another coordinate): ask for all of it; the answer makes the replica.
        self.t.ov.route(m.origin.coord, Pull(m.corr, m.topic, m.coord, me, {}))

    def _offer_back(self, r: Replica, m: Offer) -> None:
        """The reverse check: a copy offered what a holder ranked above it keeps (the primary's anti-entropy round
        or back-fill; at level 3 the secondary's back-fill) that itself keeps records outside it offers them to
        the primary.  The primary judges with everything it ever held: a record its retention dropped is covered
        (REPLICATED, nothing moves), one it never had is pulled and delivered (`sync_learned`).

        Otherwise the comparison ran from the primary's side only: a copy holding more confirmed the offer, and
        what only it kept (a broker that came back with its disk holding what the primary lacked, a merge's offer
        that never arrived) stayed on one broker, one failure from being lost.  The copy cannot judge itself: an
        offer names what is kept, not what was held, and sending that too made the offer as large again
        (a digest of every publisher of the last day, not only of those with records kept)."""
        if r.stage is not Stage.HOLDING or r.offers:
            return  # retiring or demoted: an offer to the holders is under way already
        above = self.t.ranked(r.coord)[: max(0, r.rank - 1)]
        if not any(n.id == m.origin.id for n in above) or not r.log.lacking(ranges_of(m.have)):
            return
        self.t.counters["reverse_offers"] += 1
        self.offer(r, above[:1])

    def retire(self, r: Replica) -> None:
        """Ranked out of the topic's holders: offer the records to the holders now, let go once confirmed."""
        targets = self.t.holders(r.coord, without_me=True)
        if not targets or not (r.log.rows or r.log.last_seq or r.subscribers):
            self.let_go(r)  # nothing to hand on, or nobody to hand it to
            return
        r.enter(Transition.RETIRE)
        self.offer(r, targets)

    def let_go(self, r: Replica) -> None:
        """Drop r; requests that waited for it go where the topic is now."""
        queued, r.queued = r.queued, []
        self.t.drop(r)
        for access, session, req in queued:
            self.holder.handle_request(access, session, req)

    def hand_off(self) -> int:
        """A graceful shutdown: offer every topic held to the brokers that hold it once this one is gone;
        returns how many offers wait for confirmation (`handing_off`)."""
        for r in list(self.t.replicas.values()):
            if r.stage is Stage.GONE or not (r.log.rows or r.log.last_seq or r.subscribers):
                continue
            self.offer(r, self.t.holders(r.coord, without_me=True), leaving=True)
        return self.handing_off()

    def handing_off(self) -> int:
        """Offers not yet confirmed."""
        return sum(len(r.offers) for r in self.t.replicas.values())

    def pull_progress(self, r: Replica) -> None:
        """Once every asked holder answered (or the pull timed out): serve, place, or forward."""
        pull = r.pull
        if pull is None:
            return
        if pull.asked:
            pull.answered(self.t.ov.now())  # one of them did: the others are asked again sooner (retry_due)
            return
        dl = self.home.delegate_lists.get(r.name)
        if dl and not same(dl[-1].coord, r.coord) and not r.log.rows and not r.subscribers:
            # This broker became the home of a topic that lives at a delegate coordinate: forward, hold nothing.
            queued, r.queued = r.queued, []
            self.t.drop(r)
            for access, session, req in queued:
                self.holder.forward_request(access, session, req, dl[-1].coord, via_home=True)
            return
        took_over = r.stage is Stage.TAKING_OVER
        self.t.counters["syncs"] += 1
        self.t.event("sync", topic=r.name, seconds=round(self.t.ov.now() - pull.started, 6))
        if took_over:
            r.enter(Transition.CAUGHT_UP)
            self.redeliver(r)
        elif any(isinstance(q, (Publish, Subscribe)) for _, _, q in r.queued) and self.home.maybe_place(r):
            return  # a new topic: Alg. 1 decides where it lives; requests wait for it
        elif r.stage is Stage.SYNCING:
            r.enter(Transition.CAUGHT_UP)
        queued, r.queued = r.queued, []
        for access, session, req in queued:
            self.holder.serve(r, access, session, req)
        if r.name in self.t.replicas:  # not forgotten as empty by a FETCH/LOCATE
            if not took_over:
                r.copy.want()  # a join made us primary: the secondary gets everything we now hold
            self.flush(r)  # after a take-over, view_changed decided whether the history is copied

    def take_over(self, r: Replica) -> None:
        self.t.counters["takeovers"] += 1
        self.t.event("takeover", topic=r.name)
        log.info("taking over topic %s (%d messages, %d subscribers)", r.name, len(r.log.rows), len(r.subscribers))
        # The other holders may know more than we do (the dead primary may have replicated to a secondary
        # that our view did not rank second at the time): merge their copies first, like a returning primary
        # (Sec. III-C), then re-deliver.  Requests wait in the meantime, at most pull_timeout.
        if not self.start_pull(r, takeover=True):
            r.settle()
            self.redeliver(r)

    def redeliver(self, r: Replica) -> None:
        """After a take-over: the last moments go to the subscribers again (they drop what they had) and, with the
        first batch, to the secondary (the dead primary may have died after its secondary confirmed them and
        before acknowledging them; a newer message's acknowledgement, cumulative, or the re-send's own must not
        count on this broker alone).  The rest of the history follows as the back-fill, which gates nothing."""
        since = r.last_ts - self.t.config.redeliver_window
        if 0.0 < r.delivered_upto < since:
            # The dead primary had delivered and acknowledged nothing stored after delivered_upto (its last batch
            # said so) for longer than the window: a stall (a slow disk under always/batch holds the ACKs back
            # while the copies are confirmed).  All of that is re-delivered and re-copied, not only the window.
            since = r.delivered_upto
        recent = list(r.log.since(since))
        self.t.deliver_to(r.subscribers.values(), r.name, recent)
        if recent and self.t.secondary(r) is not None:
            r.recopy_from, r.recopy_upto = since, r.last_ts
            r.confirmed_upto = min(r.confirmed_upto, since)  # (confirmed to an earlier secondary, if ever)
            r.outbox = r.unconfirmed()

    # ---- overlay changes -------------------------------------------------------------------------------
    def view_changed(self, failed: Collection[str]) -> None:
        """Re-rank every topic held: take-over, new secondary, or drop (moves in progress finish first)."""
        self._leaving &= set(self.t.ov.view())
        self.t.rank_many(r.coord for r in self.t.replicas.values())  # (at once: then rank_of_me reads the cache)
        for r in list(self.t.replicas.values()):
            old = r.rank
            r.rank = self.t.rank_of_me(r.coord)
            self._rerank(r, old)

    def _rerank(self, r: Replica, old: int, *, offer: bool = False) -> None:
        """r's rank changed from old (the view changed, or r follows the topic to a new coordinate: `relocate`):
        take over, get a new secondary, become a copy, or retire.  offer: a copy offers what it holds to the
        primary, as a demoted primary does (a relocated copy may hold what the topic's holders lack)."""
        if r.stage in (Stage.HANDING_OVER, Stage.RECEIVING, Stage.RECOVERING):
            return  # finishes (or times out, or resumes once joined) as it is; roles are settled then
        if r.stage is Stage.RETIRING:
            if not self.keeps(r.rank):
                self.retire(r)  # the holders changed: offer to the new ones
                return
            r.enter(Transition.KEEP)  # ranked again before it let go: a copy, or the primary below
            old = 0
        if r.rank == 1:
            if old != 1 and r.stage is not Stage.PLACING:
                self.take_over(r)
                # What this broker got from the dead primary, its secondary may lack (a batch it confirmed
                # that never reached the old tertiary, at level 3): a back-fill, which costs one offer if not.
                r.copy.want()
            sec = self.t.secondary(r)
            if sec is not None and r.copy.next_is(sec.id):
                # A new secondary gets the whole history, after a failure too (module docstring).
                if any(b.target != sec.id for b in r.window):
                    r.window.clear()  # re-sent to the new secondary below
                    r.outbox = r.unconfirmed()
                r.meta_dirty = True
            self.flush(r)
        elif self.keeps(r.rank):
            was_primary = r.stage is not Stage.HOLDING
            r.settle()
            if r.stage is not Stage.HOLDING:
                r.enter(Transition.DEMOTE)  # pulling or placing when a broker joined closer: a copy now
            r.forget_primary_work()  # the new primary acknowledges: publishers re-send what we did not ack
            if was_primary or old == 1 or offer:
                # What only this former primary holds (the other side of a healed partition, the last
                # batches it stored) goes to the new one, offered again after each time-out until the new
                # primary confirms it holds all of it: once lost while the overlays merged, it was never
                # repeated, and the primary served for good without what this copy kept (anti-entropy
                # compares from the primary's side only).  At level 3 also to its next holder, now its
                # tertiary, which may be its old secondary and lack the batches that never got there (one
                # offer round trip if it lacks nothing).
                self.offer(r, self.t.holders(r.coord)[:1])
                r.copy.want()
            if (nxt := self.next_holder(r)) is not None:
                r.copy.next_is(nxt.id)  # level 3: a new tertiary gets the history from the secondary
            self._copy_down(r)
            queued, r.queued = r.queued, []
            for access, session, req in queued:
                self.holder.handle_request(access, session, req)
        else:
            self.retire(r)

    # ---- a copy a move left behind ---------------------------------------------------------------------
    def follow(self, topic: str, dl: list[Delegation], origin: NodeInfo | None = None) -> None:
        """A delegate list heard from another broker (the home, a holder, a primary's batch) against this
        broker's replica of the topic: a later list that names another coordinate moves the replica there
        (`relocate`); an earlier one that names another coordinate than ours comes from a copy left behind,
        and origin is told ours, so that it follows."""
        r = self.t.replicas.get(topic)
        if r is None or r.stage is Stage.GONE or not dl:
            return
        if later(dl, r.delegates):
            if same(dl[-1].coord, r.coord):
                r.place(dl[-1].coord, dl)
            else:
                self.relocate(r, dl)
        elif origin is not None and later(r.delegates, dl) and not same(dl[-1].coord, r.coord):
            self.tell_list(topic, r.delegates, origin)

    def tell_list(self, topic: str, dl: list[Delegation], to: NodeInfo) -> None:
        """Send dl to a broker that holds the topic at a coordinate dl says it has left (it `follow`s)."""
        self.t.ov.route(to.coord, DelegateUpdate(0, topic, tuple(dl), self.t.ov.me, sync=True))

    def _left_behind(
        self, topic: str, r: Replica | None, coord: Coord, dl: tuple[Delegation, ...], origin: NodeInfo
    ) -> bool:
        """A batch or an offer for coord, with the sender's list dl: does it come from a copy a move left behind?
        Then the sender is told the later list (it follows) and the message is not taken (True).
        - r held at another coordinate: if the sender's list is later, r follows it (`relocate`) and the message
          is taken; if r's is, the sender is told.  Lists alike (a topic placed by Alg. 1 before its copies
          learned the list): the sender's coordinate is taken, as before.  A batch without the meta has no list:
          the sender re-sends with it once told.
        - nothing held here: the list this broker keeps as the topic's home, if later and elsewhere, is told."""
        if r is None:
            known = self.home.delegate_lists.get(topic)
            if known and later(known, dl) and not same(known[-1].coord, coord):
                self.tell_list(topic, known, origin)
                return True
            return False
        if same(r.coord, coord):
            return False
        if later(r.delegates, dl):
            self.tell_list(topic, r.delegates, origin)
            return True
        if later(list(dl), r.delegates):
            self.relocate(r, list(dl))
        return False

    def relocate(self, r: Replica, dl: list[Delegation]) -> None:
        """dl, later than r's own list, says the topic lives at another coordinate now: r is a copy a move left
        behind (its broker was down during the move, or the RELEASE was lost with a restart), or it served the
        topic at the old coordinate after a full restart before the home's list was back.  r takes the new
        coordinate and re-ranks there as at a view change: a holder there keeps it and offers what it holds to
        the primary; any other broker retires it, offering its records to the holders there, and lets go once
        they confirmed.  Histories merge as a set union by (publisher, seq), so what only this copy has (what it
        acknowledged while it served at the old coordinate) reaches the topic, and its subscribers go with the
        answer to the offer; requests go where the topic lives.  Before, such a copy came back at the old
        coordinate after a full restart and served the topic there, beside the copies where it moved: a
        subscriber registered on one got nothing published to the other (benchmarks/chaos.py)."""
        if r.stage in (Stage.HANDING_OVER, Stage.RECEIVING, Stage.PLACING):
            return  # a move or a placement is under way here: it sets the list itself when it ends
        frm, to = r.coord, dl[-1].coord
        self.t.counters["relocations"] += 1
        self.t.event("relocate", topic=r.name, frm=frm, to=to)
        log.info("topic %s: the copy held for (%.4f, %.4f) follows the topic to (%.4f, %.4f)", r.name, *frm, *to)
        r.place(to, dl)
        if r.stage is Stage.RECOVERING:
            return  # `HolderRole.resume` ranks it where it is now
        # Publishers of what waits for an acknowledgement here re-send it where the topic lives; the offer takes
        # the records there, so subscribers get what was stored once the holders there merged it.
        r.forget_primary_work()
        r.rank = self.t.rank_of_me(to)
        self._rerank(r, 0, offer=True)

    # ---- time ------------------------------------------------------------------------------------------
    def _tick_backfill(self, r: Replica, now: float) -> None:
        """A back-fill not confirmed (nor its answer making progress) within the offer time-out is offered again,
        from what the next holder has by then; a level-3 secondary back-fills its tertiary from here."""
        bf = r.copy.offer
        if bf is not None and now - bf.at > self.t.config.offer_timeout:
            r.copy.lapsed()
            if r.rank == 1:
                self.flush(r)
                return
        self._copy_down(r)

    def _copy_down(self, r: Replica) -> None:
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

    def tick(self, now: float) -> None:
        """Re-send unconfirmed batches, finish or repeat pulls that are slow, repeat offers, anti-entropy (with the
        copies, and HEADS to the subscribers)."""
        anti_entropy = now - self._last_anti_entropy >= self.t.config.anti_entropy_interval
        if anti_entropy:
            self._last_anti_entropy = now
        for a in list(self._answers.values()):
            if now - a.heard > self.t.config.offer_timeout:
                self._drop_answer(a)  # the asker went quiet: it asks again (or its pull timed out)
        for r in list(self.t.replicas.values()):
            if r.offers and now - r.offered_at > self.t.config.offer_timeout:
                if r.stage is Stage.RETIRING:
                    self.retire(r)  # to whoever holds the topic by now
                else:
                    view = self.t.ov.view()
                    self.offer(r, [view[nid] for nid in r.offers.values() if nid in view])
            # A steady copy the view no longer ranks among the holders: made or kept (`settle` keeps any ranked
            # copy) by a batch from a primary whose view lagged, after this broker's last view change (seen 30 s
            # after a healed partition at level 2).  It hands its records on and lets go, as view_changed would
            # have had it; not while a broker is leaving (the copies it hands its topics to may rank below the
            # holders until it is gone).
            steady = anti_entropy and r.stage is Stage.HOLDING and not r.offers and not self._leaving
            if steady and not self.keeps(rank := self.t.rank_of_me(r.coord)):
                r.rank = rank
                self.retire(r)
                continue
            # Not while a batch is in flight or stored this turn and not yet sent (`outbox`): the offer would
            # reach the secondary before the batch, which would then pull what is already on its way.
            if anti_entropy and r.unchecked and r.stage is Stage.SERVING and not r.window and not r.outbox:
                r.unchecked = False
                sec = self.t.secondary(r)
                if sec is not None and r.copy.holder == sec.id:
                    self.offer(r, [sec], track=False)
            if anti_entropy and r.subscribers and r.stage is Stage.SERVING and r.rank == 1:
                self._tell_heads(r, now)
            self._tick_backfill(r, now)
            live = [b for b in r.window if not b.superseded]
            if live and now - live[0].sent_at > r.rto:
                # The oldest unconfirmed batch (or one before it) was lost or the replica is slow: go back to it.
                log.warning("replica %s of %s did not confirm within %.1f s; re-sending", live[0].target, r.name, r.rto)
                r.rto = max(r.rto, min(r.rto * 2, MAX_RTO))  # a long re-send keeps its longer time-out
                self.t.counters["replication_resends"] += 1
                for b in live:
                    b.superseded = True
                # Re-send everything not yet confirmed in one whole batch; the replica merges, so what it already
                # had is not duplicated.
                r.outbox = r.unconfirmed()
                r.meta_dirty = True
                self.flush(r)
            pull = r.pull
            if pull is not None and pull.asked:
                if now - max(pull.started, pull.heard) > self.t.config.pull_timeout:
                    pull.asked.clear()
                    self.pull_progress(r)
                elif pull.retry_due(now, self.t.config.pull_timeout):
                    # Right after a failure a pull, or its answer, can be routed through a broker that has not yet
                    # noticed it and be lost there; asking again once the overlay has healed beats waiting out the
                    # time-out (the topic's requests wait meanwhile).  A second answer is merged like one that comes
                    # after the time-out: the merge drops what is already stored, and the digest sent with the
                    # question keeps what this broker has since received out of it.
                    pull.retried = True
                    view = self.t.ov.view()
                    have = r.log.digest()
                    for corr, nid in pull.asked.items():
                        if (node := view.get(nid)) is not None:
                            self.t.ov.route(node.coord, Pull(corr, r.name, r.coord, self.t.ov.me, have))
