"""The replication role: copies at the secondary, pulls from previous holders, take-over after a failure.

The primary sends what it stored in a turn to the secondary (REPLICATE), acknowledges once the secondary
confirmed it (REPLICATED) and re-sends on a time-out.  When the overlay changes, every broker re-ranks itself
for the topics it holds (`view_changed`): a secondary that became closest takes over (TAKING_OVER: it merges
what the other holders have, then re-delivers the last moments, which subscribers de-duplicate by (publisher,
seq)); a broker that became closest without holding the topic pulls it first (SYNCING, Sec. III-C).

Level 2 versus 3 (Sec. IV-B): after a *failure*, the new secondary receives only new messages at level 2 (its
capacity L2_N has no room for more), but the full history at level 3, so that a second failure loses
nothing.  After a join, a new secondary always receives the full history, since no failure has been spent.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from broker.pubsub.core import TopicTable, chunks, same
from broker.pubsub.replica import PULLING, Replica, Stage, Transition
from broker.pubsub.settings import MAX_RTO
from overlay.pubsub import Publish, Pull, Replicate, Replicated, Subscribe

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.moves import MoveRole

log = logging.getLogger("sedax.pubsub")


class ReplicationRole:
    """Replication, pulls and take-overs (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        # Wired by the engine.
        self.holder: HolderRole
        self.moves: MoveRole
        self.home: HomeRole

    # ---- the primary's copy at the secondary ---------------------------------------------------------
    def flush(self, r: Replica) -> None:
        """Send the next batch to the secondary, or acknowledge and deliver when no copy is required."""
        if r.rank != 1 or r.stage in PULLING or r.stage is Stage.HANDING_OVER:
            return  # while pulling, pull_progress flushes once the other holders have answered
        self.holder.persist(r)  # on disk (as the write policy says) before it is replicated or acknowledged
        sec = self.t.secondary(r)
        if sec is None:
            r.outbox.clear()
            r.meta_dirty = False
            r.backfill = False
            self.holder.commit(r, float("inf"))
            self.moves.staged_ready(r)
            return
        if r.inflight is not None:
            return
        if not r.outbox and not r.meta_dirty and r.replica == sec.id and not r.backfill:
            return
        if r.replica != sec.id:
            r.replica = None
        # A back-fill replaces whatever the secondary had with the whole history; otherwise it merges.
        full = r.backfill
        records = r.log.records() if full else list(r.outbox)
        batches = chunks(records)
        corr = 0
        for i, batch in enumerate(batches):
            corr = self.t.next_corr()
            self.t.ov.route(
                sec.coord,
                Replicate(
                    corr,
                    r.name,
                    r.coord,
                    self.t.ov.me,
                    tuple(batch),
                    tuple(r.subscribers.values()),
                    tuple(r.delegates),
                    full and i == 0,
                    dict(r.log.last_seq),
                ),
            )
        upto = r.waiting[-1].record.ts if r.waiting else r.last_ts
        r.inflight = (corr, sec.id, self.t.ov.now(), upto)
        r.sent[corr] = (sec.id, upto)
        if len(r.sent) > 64:  # confirmations that never came; the newest re-send supersedes them
            for old in sorted(r.sent)[:-64]:
                del r.sent[old]
        r.outbox.clear()
        r.meta_dirty = False
        self.t.counters["replicated_batches"] += 1

    def replicated_arrived(self, m: Replicated) -> None:
        """REPLICATED: a copy, a pull answer or a hand-over was confirmed."""
        r = self.t.replicas.get(m.topic)
        if r is None:
            return
        if m.corr in r.pulling:
            del r.pulling[m.corr]  # the asked node holds nothing of it
            self.pull_progress(r)
            return
        if r.stage is Stage.HANDING_OVER:
            self.moves.handover_confirmed(r, m.corr)
            return  # replica confirmations wait: an aborted move re-copies everything to the secondary
        entry = r.sent.pop(m.corr, None)
        if entry is None or entry[0] != m.node:
            return  # not ours, or from a node we no longer replicate to
        target, upto = entry
        # Any confirmation counts, also of an earlier batch that was re-sent after a time-out: under load a
        # reply slower than the time-out must not make the primary re-send forever.
        for c in [c for c, (t, u) in r.sent.items() if t == target and u <= upto]:
            del r.sent[c]
        if r.inflight is not None and r.inflight[3] <= upto:
            r.inflight = None
        r.replica = target
        r.backfill = False
        r.rto = self.t.config.replication_timeout
        self.holder.commit(r, upto)
        self.moves.staged_ready(r)
        self.flush(r)

    def replicate_arrived(self, m: Replicate) -> None:
        """REPLICATE: the primary's copy, an answer to our pull, or a hand-over (moves.py)."""
        now = self.t.ov.now()
        if m.handover:
            self.moves.handover_arrived(m, now)
            return
        r = self.t.replicas.get(m.topic)
        if r is not None and r.stage is Stage.HANDING_OVER:
            # The topic's new primary picked this node as its secondary while the move is under way: this node
            # already holds everything it is sent, and becomes the replica when the move completes.
            if m.corr:
                self.t.ov.route(m.origin.coord, Replicated(m.corr, m.topic, self.t.ov.me.id))
            return
        if r is not None and m.corr in r.pulling and not same(m.coord, r.coord):
            # The asked node knows the topic at another coordinate: a delegate list, not data for us.
            self.home.learn_delegates(m.topic, list(m.delegates))
            del r.pulling[m.corr]
            self.pull_progress(r)
            return
        r = self.holder.replica(m.topic, m.coord)
        if m.full and m.corr not in r.pulling and r.rank != 1:
            r.log.clear()
        r.log.merge(m.records, now)
        for pub, seq in m.last_seq.items():
            if seq > r.log.last_seq.get(pub, -1):
                r.log.last_seq[pub] = seq
                r.log.last_seen[pub] = now
        if (newest := r.log.last_ts) is not None:
            r.last_ts = max(r.last_ts, newest)
        subs = {(s.access.id, s.session): s for s in m.subscribers}
        if r.rank == 1:
            r.subscribers.update(subs)  # handed over to us: keep what we had as well
        else:
            r.subscribers = subs
        r.coord = m.coord
        r.delegates = list(m.delegates)
        r.rank = self.t.rank_of_me(r.coord)
        r.settle()
        stored = self.holder.persist(r)
        if m.corr in r.pulling:
            del r.pulling[m.corr]
            self.pull_progress(r)
            return
        if m.corr and stored:  # 0: a leading chunk of a multi-frame copy; the last one carries the corr
            # Confirmed only once on disk: a full disk here leaves the batch unconfirmed, so the primary neither
            # acknowledges it nor forgets it (it re-sends).
            self.t.ov.route(m.origin.coord, Replicated(m.corr, m.topic, self.t.ov.me.id))

    # ---- pulling a topic from its previous holders (Sec. III-C) ----------------------------------------
    def start_pull(self, r: Replica, *, takeover: bool) -> bool:
        """SYNC (a primary new to the topic) or TAKE_OVER (after a failure): ask the other holders; False if
        there is nobody to ask (the replica stays as it is)."""
        if r.rank != 1:
            return False
        others = self.t.ranked(r.coord)[1:]
        if not others:
            return False
        r.enter(Transition.TAKE_OVER if takeover else Transition.SYNC)
        r.pull_started = self.t.ov.now()
        r.pull_retried = False
        for n in others:
            corr = self.t.next_corr()
            r.pulling[corr] = n.id
            self.t.ov.route(n.coord, Pull(corr, r.name, r.coord, self.t.ov.me))
        return True

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
        batches = chunks(r.log.records())
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            self.t.ov.route(
                p.origin.coord,
                Replicate(
                    p.corr if last else 0,
                    r.name,
                    r.coord,
                    me,
                    tuple(batch),
                    tuple(r.subscribers.values()),
                    tuple(r.delegates),
                    False,
                    dict(r.log.last_seq),
                ),
            )
        self.t.counters["handovers"] += 1

    def pull_progress(self, r: Replica) -> None:
        """Once every asked holder answered (or the pull timed out): serve, place, or forward."""
        if r.pulling:
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
                r.backfill = True  # a join made us primary: the secondary gets everything we now hold
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
        window = r.last_ts - self.t.config.redeliver_window
        self.t.deliver_to(r.subscribers.values(), r.name, list(r.log.since(window)))

    # ---- overlay changes -------------------------------------------------------------------------------
    def view_changed(self, failed: Collection[str]) -> None:
        """Re-rank every topic held: take-over, new secondary, or drop (moves in progress finish first)."""
        for r in list(self.t.replicas.values()):
            old = r.rank
            r.rank = self.t.rank_of_me(r.coord)
            if r.stage in (Stage.HANDING_OVER, Stage.RECEIVING, Stage.RECOVERING):
                continue  # finishes (or times out, or resumes once joined) as it is; roles are settled then
            if r.rank == 1:
                if old != 1 and r.stage is not Stage.PLACING:
                    self.take_over(r)
                sec = self.t.secondary(r)
                if sec is not None and r.replica != sec.id:
                    lost_by_failure = r.replica in failed or (old != 1 and bool(failed))
                    # Sec. IV-B: only level 3 provisions the capacity to copy history after a failure.
                    r.backfill = self.t.config.resilience >= 3 or not lost_by_failure
                    r.replica = None
                    if r.inflight is not None and r.inflight[1] != sec.id:
                        r.inflight = None  # re-sent to the new secondary below
                        r.outbox = list(r.undelivered)
                    r.meta_dirty = True
                self.flush(r)
            elif r.rank in (2, 3) and (r.rank == 2 or self.t.config.resilience >= 3):
                r.settle()
                r.inflight = None
                r.waiting.clear()  # the new primary acknowledges: publishers re-send what we did not ack
                r.first_waiting.clear()
                r.waiter_max.clear()
                r.outbox.clear()
                r.undelivered.clear()
            else:
                self.t.drop(r)

    # ---- time ------------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Re-send unconfirmed batches, finish or repeat pulls that are slow."""
        for r in list(self.t.replicas.values()):
            if r.inflight is not None and now - r.inflight[2] > r.rto:
                log.warning("replica %s of %s did not confirm within %.1f s; re-sending", r.inflight[1], r.name, r.rto)
                r.rto = min(r.rto * 2, MAX_RTO)
                r.inflight = None
                # Re-send everything not yet confirmed (a pending back-fill stays a back-fill); the replica
                # merges, so what it already had is not duplicated.
                r.outbox = list(r.undelivered)
                r.meta_dirty = True
                self.flush(r)
            if r.pulling and now - r.pull_started > self.t.config.pull_timeout:
                r.pulling.clear()
                self.pull_progress(r)
            elif r.pulling and not r.pull_retried and now - r.pull_started > self.t.config.pull_timeout / 4:
                # Right after a failure a pull can be routed through a broker that has not yet noticed it and
                # be lost there; asking again once the overlay has healed beats waiting out the time-out (the
                # requests of the topic wait meanwhile).  A second answer is merged like one that comes after the
                # time-out: the merge drops what is already stored.
                r.pull_retried = True
                view = self.t.ov.view()
                for corr, nid in r.pulling.items():
                    if (node := view.get(nid)) is not None:
                        self.t.ov.route(node.coord, Pull(corr, r.name, r.coord, self.t.ov.me))
