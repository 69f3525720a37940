"""The sync role: pulls and offers between a topic's holders, and take-over after a failure (Sec. III-C).

A broker that became a topic's primary without holding all of it pulls from the other holders first (SYNCING;
after a failure TAKING_OVER, which then re-delivers the last moments, that subscribers de-duplicate by
(publisher, seq)); it serves once it holds all of it (storage-anchors: leadership only to a caught-up replica).
Pulls carry the asker's digest, so a restarted broker fetches only what it missed, and a long answer streams a
few chunks at a time, paced by the asker's disk (`_Answer`).  Histories merge as a set union by (publisher,
seq): a copy never replaces what the receiver holds.

A broker that the view ranks out of a topic's holders does not drop it at once: it RETIRES, offering its
records (OFFER: a digest of what it holds) to the topic's holders now, which pull what they lack, and drops the
topic once each confirmed.  A primary that was demoted offers to the new primary, so what only it had (a
partition's other side) is merged; a copy offered what it lacks offers back (`_offer_back`).  A graceful
shutdown offers everything (`hand_off`).  The answers themselves arrive as REPLICATE (sync) and are taken by
replication.py with the primary's batches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker.pubsub.core import TopicTable, chunks, same
from broker.pubsub.replica import Pulling, Replica, Stage, Transition
from broker.pubsub.settings import MAX_CHAINED, PULL_WAIT_MAX, RERANK_SLICE, SYNC_CHUNK, SYNC_WINDOW
from broker.store import Missing
from overlay.protocol import NodeInfo
from overlay.pubsub import Offer, Publish, Pull, Record, Replicate, Replicated, SubRef, Subscribe
from overlay.seqset import SeqRanges, covers, ranges_of

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.ranks import RankRole
    from broker.pubsub.replication import ReplicationRole

log = logging.getLogger("sedax.pubsub")


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


class SyncRole:
    """Pulls, offers and take-overs (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        self.leaving: set[str] = set()  # brokers that announced a graceful shutdown and are still in the view
        # OFFER corr -> offerer, where this broker answered the offer with the pull of its own sync.
        self._offer_pulls: dict[int, str] = {}
        # Long answers to pulls under way: by (topic, asker), and by the corr of each chunk in flight.
        self._answers: dict[tuple[str, str], _Answer] = {}
        self._answer_chunks: dict[int, _Answer] = {}
        # A graceful shutdown's hand-off (`hand_off_step`): the topics held when it began, and how far it got.
        self._handing: list[str] | None = None
        self._handing_at = 0
        # Wired by the engine.
        self.holder: HolderRole
        self.home: HomeRole
        self.ranks: RankRole
        self.replication: ReplicationRole

    # ---- pulling a topic from its previous holders (Sec. III-C) ----------------------------------------------
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
        self.t.wake(r)  # (the pull's time-out)
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
            self.t.peers.asked(n.id, corr, pull.started)
            self.t.ov.route(n.coord, Pull(corr, r.name, r.coord, self.t.ov.me, have))
        return pull

    def pull_arrived(self, p: Pull) -> None:
        """PULL: send what we hold of the topic (or where it lives, or that we hold nothing)."""
        r = self.t.replicas.get(p.topic)
        if r is not None and (r.offers.get(p.corr) == p.origin.id or ((bf := r.copy.offer) and bf.corr == p.corr)):
            self.t.peers.answered(p.origin.id, p.corr, self.t.ov.now())  # the PULL that answers our OFFER
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
        self.catch_up_newcomers(r, newcomers, theirs)
        self.t.mark(r)

    def catch_up_newcomers(self, r: Replica, newcomers: list[SubRef], theirs: dict[str, SeqRanges]) -> None:
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
            self._answered(r, to.id, corr)
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
                if last:
                    self._answered(r, a.to.id, corr)
        if not a.corr and not a.inflight:
            self._drop_answer(a)

    def _answered(self, r: Replica, to: str, corr: int) -> None:
        """The last frame of an answer under corr went to `to`.  If it answers the PULL of r's back-fill or offer,
        that now waits for `to` to take this frame: its mark moves here (PeerProgress)."""
        if (bf := r.copy.offer) is not None and bf.corr == corr and bf.target == to:
            bf.mark = self.t.peers.mark()
            bf.at = self.t.ov.now()  # (progress: the next holder asked)
        elif r.offers.get(corr) == to:
            r.offer_mark = self.t.peers.mark()
            r.offered_at = self.t.ov.now()

    def _drop_answer(self, a: _Answer) -> None:
        if self._answers.get((a.topic, a.to.id)) is a:
            del self._answers[(a.topic, a.to.id)]
        for corr in a.inflight:
            self._answer_chunks.pop(corr, None)
        a.inflight.clear()
        a.corr = 0

    # ---- offers: handing records on to the topic's holders ---------------------------------------------------
    def offer(self, r: Replica, targets: list[NodeInfo], *, track: bool = True, leaving: bool = False) -> None:
        """OFFER r's records to targets; tracked offers wait for REPLICATED and are repeated on a time-out."""
        if track:
            r.offers.clear()
            r.offered_at = self.t.ov.now()
            r.offer_mark = self.t.peers.mark()
            self.t.wake(r)  # (the offer's time-out)
        have = r.log.offerable()
        me = self.t.ov.me
        # A copy's subscribers go along: a demoted primary may hold some the new primary never heard of (a
        # SUBSCRIBE it served before its view changed), and an offer answered without a pull carried none.
        subs = tuple(r.subscribers.values()) if r.rank != 1 else ()
        self.t.counters["offers"] += len(targets)
        now = self.t.ov.now()
        for n in targets:
            corr = self.t.next_corr()
            if track:
                r.offers[corr] = n.id
            self.t.peers.asked(n.id, corr, now)
            self.t.ov.route(n.coord, Offer(corr, r.name, r.coord, me, have, leaving, tuple(r.delegates), subs))

    def offer_arrived(self, m: Offer) -> None:
        """OFFER: confirm when everything offered is here already, else ask for what is missing."""
        me = self.t.ov.me
        if m.origin.id == me.id:
            # Routed back to its sender: a broker that has just joined has no link closer to the coordinate yet.
            # Answered, it would confirm itself; unanswered, the offer goes out again after the time-out.
            return
        if m.leaving:
            self.leaving.add(m.origin.id)  # its records are to stay here although the view still ranks it
        r = self.t.replicas.get(m.topic)
        if self.ranks.left_behind(m.topic, r, m.coord, m.delegates, m.origin):
            return  # the offerer follows the list it was told, and offers there
        if r is not None and same(r.coord, m.coord) and r.stage is not Stage.GONE:
            if m.subscribers and r.rank == 1:
                self._add_subscribers(r, m.subscribers, ranges_of(m.have))
            self._offer_back(r, m)
            if covers(r.log.held, ranges_of(m.have)):
                self.replication.confirm_on_disk(r, m.origin, m.corr)
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

    def hand_off_step(self) -> bool:
        """A graceful shutdown: offer the next RERANK_SLICE topics held to the brokers that hold them once this one
        is gone (the first call takes the topics held then); True while topics are left."""
        if self._handing is None:
            self._handing = list(self.t.replicas)
        names, at = self._handing, self._handing_at
        self._handing_at = min(len(names), at + RERANK_SLICE)
        for name in names[at : self._handing_at]:
            r = self.t.replicas.get(name)
            if r is None or r.stage is Stage.GONE or not (r.log.rows or r.log.last_seq or r.subscribers):
                continue
            self.offer(r, self.t.holders(r.coord, without_me=True), leaving=True)
        return self._handing_at < len(names)

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
            self.t.wake(r)  # (that sooner)
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
            self.replication.flush(r)  # after a take-over, view_changed decided whether the history is copied

    # ---- take-over after a failure ---------------------------------------------------------------------------
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

    # ---- confirmations, and time -----------------------------------------------------------------------------
    def chunk_confirmed(self, m: Replicated) -> bool:
        """REPLICATED for a chunk of a long answer (`_Answer`): the next chunks leave.  False if it is not one."""
        answer = self._answer_chunks.get(m.corr)
        if answer is None or answer.to.id != m.node:
            return False
        del self._answer_chunks[m.corr]
        answer.inflight.discard(m.corr)
        self._pump(answer)
        return True

    def confirmed(self, r: Replica, m: Replicated) -> bool:
        """REPLICATED from a holder r's pull asked, which holds nothing of it, or from one that now has everything
        r offered.  False if it is neither."""
        if r.pull is not None and r.pull.asked.get(m.corr) == m.node:
            del r.pull.asked[m.corr]  # the asked node holds nothing of it
            self.pull_progress(r)
            return True
        if r.offers.get(m.corr) == m.node:
            del r.offers[m.corr]  # that holder now has everything this one offered
            if r.stage is Stage.RETIRING and not r.offers:
                self.let_go(r)
            return True
        return False

    def offer_answered(self, corr: int, node: str) -> bool:
        """An answer to corr, just stored here: if corr is node's OFFER, answered with the pull of this broker's own
        sync (`start_pull`), it is forgotten and True (the offerer may let go once the answer is on the disk:
        `ReplicationRole.confirm_on_disk`)."""
        return self._offer_pulls.pop(corr, None) == node

    def drop_quiet_answers(self, now: float) -> None:
        """Forget the long answers whose asker went quiet: it asks again (or its pull timed out)."""
        timeout = self.t.config.offer_timeout
        for a in list(self._answers.values()):
            if now - a.heard > timeout:
                if a.inflight and self.t.peers.behind(a.to.id, min(a.inflight), now, timeout):
                    a.heard = now  # the asker still confirms what came before these chunks (PeerProgress)
                else:
                    self._drop_answer(a)

    def repeat_offers(self, r: Replica, now: float) -> None:
        """Offers not confirmed within the offer time-out go out again: a retiring copy's to whoever holds the
        topic by now, other copies' to the holders they went to."""
        if r.offers and now > self._offers_until(r):
            timeout = self.t.config.offer_timeout
            if any(self.t.peers.behind(nid, r.offer_mark, now, timeout) for nid in r.offers.values()):
                r.offered_at = now  # a holder still answers what came before its offer (PeerProgress)
                return
            if r.stage is Stage.RETIRING:
                self.retire(r)
            else:
                view = self.t.ov.view()
                self.offer(r, [view[nid] for nid in r.offers.values() if nid in view])

    def deadline(self, r: Replica) -> float:
        """When r's offers are repeated (`repeat_offers`) or its pull asks again or finishes (`retry_pull`), if
        not answered by then; math.inf if neither is under way."""
        at = self._offers_until(r) if r.offers else math.inf
        if (pull := r.pull) is not None and pull.asked:
            at = min(at, pull.retry_at(self.t.config.pull_timeout), pull.timeout_at(self.t.config.pull_timeout))
        return at

    def _offers_until(self, r: Replica) -> float:
        """When r's offers not yet confirmed go out again (`repeat_offers`)."""
        return r.offered_at + self.t.config.offer_timeout

    def retry_pull(self, r: Replica, now: float) -> None:
        """A pull whose holders did not all answer: finished at the pull time-out with what came, asked again
        sooner once one of them answered (`Pulling.retry_due`)."""
        pull = r.pull
        if pull is None or not pull.asked:
            return
        timeout = self.t.config.pull_timeout
        timed_out, retry = now > pull.timeout_at(timeout), pull.retry_due(now, timeout)
        if not (timed_out or retry):
            return
        peers = self.t.peers
        ours = [(corr, nid) for corr, nid in pull.asked.items() if corr not in self._offer_pulls]  # (not an offerer's)
        if any(peers.behind(nid, c, now, timeout) for c, nid in ours):
            # An asked holder still answers what this broker asked before: the question is queued there, not lost
            # (PeerProgress).  Serving without its answer would serve without the history it holds.
            pull.heard = now
            pull.held_until = now + timeout / 4
            return
        if timed_out and now < pull.started + PULL_WAIT_MAX:
            view = self.t.ov.view()
            if any(nid in view and not peers.heard(nid) for _, nid in ours):
                # A holder that has answered nothing of this broker's yet: a broker that just joined asks brokers
                # busy with the join, which took more than the pull time-out to get to the first of its questions,
                # and it served topics without their history (logged as acknowledged messages lost) while they
                # did (bench_join.py).  Waited for up to PULL_WAIT_MAX; asked again meanwhile (`retry_due`).
                pull.heard = now
                return
        if timed_out:
            pull.asked.clear()
            self.pull_progress(r)
        elif retry:
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
