"""The move role: delegating a topic to another coordinate with a two-phase hand-over (Sec. III).

The old primary asks the topic's home for a lease (one move per topic at a time, home.py), enters
HANDING_OVER and copies the whole topic to the broker closest to the new coordinate, which holds it RECEIVING
until its own secondary has it too; then it confirms, the old primary sends ACTIVATE, updates the delegate list
at the home and forwards what still reaches it for a while.  Exactly one broker acknowledges and delivers each
message: requests wait during the hand-over, and the waiters travel with it (overlay.delegation,
docs/protocol.md "Moving a topic").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from broker.pubsub.core import TopicTable, chunks, same
from broker.pubsub.replica import Move, Replica, Stage, Staged, Transition, Waiting
from overlay.delegation import Activate, Lease, Leased, Release
from overlay.geometry import Coord
from overlay.protocol import NodeInfo
from overlay.pubsub import Ack, Done, Failed, Replicate, Replicated, Waiter, delegated

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.replication import ReplicationRole

log = logging.getLogger("sedax.pubsub")


class MoveRole:
    """Moves of topics this broker is primary of, and hand-overs it receives (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        # Wired by the engine.
        self.holder: HolderRole
        self.replication: ReplicationRole
        self.home: HomeRole
        self._lease_waits: dict[int, str] = {}  # lease corr -> topic
        self._forward: dict[str, tuple[Coord, float]] = {}  # former primary: topic -> (new coordinate, until)

    def forwarded_to(self, topic: str) -> Coord | None:
        """Where a topic that moved away from here now lives (for FORWARD_TTL after the move)."""
        fwd = self._forward.get(topic)
        return fwd[0] if fwd is not None else None

    def request_move(
        self, topic: str, to: Coord, reply: tuple[NodeInfo, str, int] | None = None, force: bool = False
    ) -> str | None:
        """Start moving a topic this broker is the primary of to coordinate `to`.

        Returns None once the move is under way, or why it cannot start.  The home grants a lease first
        (one move per topic at a time, a cool-down unless forced); see overlay.delegation for the phases.
        """
        r = self.t.replicas.get(topic)
        why = None
        if r is None or r.rank != 1:
            why = f"this broker is not the primary of {topic!r}"
        elif r.waits:
            why = f"{topic!r} is being moved, pulled or placed; try again in a moment"
        elif same(r.coord, to):
            why = f"{topic!r} is already at ({to[0]}, {to[1]})"
        if why is not None:
            if reply is not None:
                self.t.reply(reply[0], [reply[1]], Failed(reply[2], topic, "bad_request", why))
            return why
        assert r is not None
        corr = self.t.next_corr()
        me = self.t.ov.me
        r.enter(Transition.HAND_OVER)
        r.move = Move(corr, to, self.t.ov.now(), reply, force=force)
        self.t.wake(r)  # (the move's time-out)
        if self.t.closest_id(r.home) == me.id:
            ok, reason = self.home.grant(topic, r.coord, to, me.id, force)
            self._lease_result(r, ok, reason)
        else:
            self._lease_waits[corr] = topic
            self.t.ov.route(r.home, Lease(corr, topic, r.coord, to, me, force))
        return None

    def leased_arrived(self, m: Leased) -> None:
        """LEASED: the home's answer to our lease request."""
        topic = self._lease_waits.pop(m.corr, None)
        r = self.t.replicas.get(topic) if topic is not None else None
        if r is not None and r.move is not None and r.move.corr == m.corr and not r.move.leased:
            self._lease_result(r, m.granted, m.reason)

    def _lease_result(self, r: Replica, ok: bool, reason: str) -> None:
        mv = r.move
        assert mv is not None
        if not ok:
            self._abort_move(r, f"the home refused: {reason}")
            return
        mv.leased = True
        mv.started = self.t.ov.now()
        if self.t.closest_id(mv.to) == self.t.ov.me.id:
            self._local_move(r)
        else:
            self._send_handover(r)

    def _send_handover(self, r: Replica) -> None:
        mv = r.move
        assert mv is not None
        last: dict[tuple[str, str, str], Waiting] = {}
        for w in r.waiting:
            key = (w.access.id, w.session, w.record.publisher)
            if key not in last or w.record.seq > last[key].record.seq:
                last[key] = w
        waiters = tuple(
            Waiter(w.access, w.session, w.record.publisher, w.record.seq, w.record.ts) for w in last.values()
        )
        delivered_upto = r.delivered_mark
        # The list with this move appended, as the old primary gives it to the home once the move is confirmed:
        # the new coordinate's copies keep it on their disks (a restart tells the stale copies by it).
        dl = tuple(delegated(r.delegates, mv.to, mv.started))
        subs, _, last_seq = r.meta()  # the delegates go as dl: the list with this move appended
        batches = chunks(r.log.records())
        me = self.t.ov.me
        for i, batch in enumerate(batches):
            final = i == len(batches) - 1
            self.t.ov.route(
                mv.to,
                Replicate(
                    mv.corr if final else 0,
                    r.name,
                    mv.to,
                    me,
                    tuple(batch),
                    subs,
                    dl,
                    i == 0,
                    last_seq,
                    handover=True,
                    delivered_upto=delivered_upto,
                    waiters=waiters if final else (),
                ),
            )

    def handover_arrived(self, m: Replicate, now: float) -> None:
        """A hand-over chunk at the new primary; the final one (with the corr) makes the replica RECEIVING."""
        r = self.t.replicas.get(m.topic)
        if r is not None and r.stage is Stage.HANDING_OVER:
            log.warning("ignoring a hand-over of %s from %s: this broker is moving it itself", m.topic, m.origin.id)
            return
        if r is None:
            r = self.holder.replica(m.topic, m.coord)
        if m.full:
            # The hand-over carries the whole topic; what a stale copy here holds besides stays (a set union).
            r.waiting.clear()
            r.first_waiting.clear()
            r.waiter_max.clear()
            r.undelivered.clear()
            r.queued.clear()
        r.log.merge(m.records, now)
        for pub, seq in m.last_seq.items():
            if seq > r.log.last_seq.get(pub, -1):
                r.log.last_seq[pub] = seq
                r.log.last_seen[pub] = now
        if (newest := r.log.last_ts) is not None:
            r.last_ts = max(r.last_ts, newest)
        r.subscribers = {(s.access.id, s.session): s for s in m.subscribers}
        r.place(m.coord, list(m.delegates))
        self.t.rerank(r)
        if not m.corr:
            r.settle()
            return  # a leading chunk; the final one carries the corr, the waiters and the delivery mark
        if r.stage is not Stage.RECEIVING:
            r.enter(Transition.RECEIVE)
        r.staged = Staged(m.origin, m.corr, now, m.waiters)
        self.t.wake(r)  # (the hand-over's time-out)
        r.undelivered = list(r.log.since(m.delivered_upto))
        r.copy.want(new_holder=True)
        r.window.clear()
        r.outbox.clear()
        r.meta_dirty = True
        self.replication.flush(r)

    def release_arrived(self, m: Release) -> None:
        """RELEASE: a hand-over that will not be activated, or a copy this broker no longer needs to keep."""
        r = self.t.replicas.get(m.topic)
        if r is None or not same(r.coord, m.coord) or r.stage is Stage.HANDING_OVER:
            return
        if r.stage is Stage.RECEIVING:
            self._drop_staged(r)
        elif r.rank != 1:
            self.t.drop(r)

    def _drop_staged(self, r: Replica) -> None:
        """A hand-over that will not be activated: drop it here and at the replicas it was copied to."""
        queued, r.queued = r.queued, []
        me = self.t.ov.me
        for n in self.t.ranked(r.coord)[1:]:
            self.t.ov.route(n.coord, Release(r.name, r.coord, me))
        self.t.drop(r)
        for access, session, req in queued:
            self.holder.forward_request(access, session, req, r.home, via_home=False)

    def staged_ready(self, r: Replica) -> None:
        """New primary: the replica caught up with the hand-over, so the old primary may let go."""
        st = r.staged
        if st is None or st.confirmed or r.copying:
            return
        st.confirmed = True
        self.t.ov.route(st.origin.coord, Replicated(st.corr, r.name, self.t.ov.me.id))

    def handover_confirmed(self, r: Replica, corr: int) -> None:
        """REPLICATED at the old primary while HANDING_OVER: the new coordinate holds everything."""
        mv = r.move
        if mv is not None and corr == mv.corr and mv.leased:
            self._move_confirmed(r)

    def _move_confirmed(self, r: Replica) -> None:
        mv = r.move
        assert mv is not None
        now = self.t.ov.now()
        old = r.coord
        size = r.log.size
        me = self.t.ov.me
        self.t.ov.route(mv.to, Activate(r.name, mv.to, me))
        # Requests that waited go behind the ACTIVATE on the same path, so the new primary serves them.
        queued, r.queued = r.queued, []
        for access, session, req in queued:
            self.holder.forward_request(access, session, req, mv.to, via_home=True)
        self._redirect_all(r, mv.to)
        dl = delegated(r.delegates, mv.to, mv.started)  # as the hand-over carried it
        self.home.set_delegates(r.name, dl)
        self._forward[r.name] = (mv.to, now + self.t.config.forward_ttl)
        self._release_old(r.name, old, mv.to)
        self.t.counters["moves"] += 1
        self.t.counters["moved_bytes"] += size
        self.t.event("move", topic=r.name, load=float(size), frm=old, to=mv.to)
        log.info("moved topic %s (%d bytes) from (%.4f, %.4f) to (%.4f, %.4f)", r.name, size, *old, *mv.to)
        if mv.reply is not None:
            self.t.reply(mv.reply[0], [mv.reply[1]], Done(mv.reply[2]))
        self._clear_primary_state(r)
        r.place(mv.to, dl)
        r.moved_at = now
        self.t.rerank(r)
        r.enter(Transition.HANDED_OVER)
        if r.rank not in (2, 3) or (r.rank == 3 and self.t.config.resilience < 3):
            self.t.drop(r)

    def _local_move(self, r: Replica) -> None:
        """The new coordinate is in this broker's own cell: it stays primary, its replicas change."""
        mv = r.move
        assert mv is not None
        now = self.t.ov.now()
        old = r.coord
        r.enter(Transition.MOVED_LOCALLY)
        r.place(mv.to, delegated(r.delegates, mv.to, mv.started))
        r.moved_at = now
        self.home.set_delegates(r.name, r.delegates)
        self._redirect_all(r, mv.to)
        self._release_old(r.name, old, mv.to)
        # The new coordinate's secondary gets the whole history (a back-fill), and the next batch every record
        # that waits for an acknowledgement.
        r.copy.want(new_holder=True)
        r.window.clear()
        r.outbox = r.unconfirmed()
        r.meta_dirty = True
        self.t.counters["moves"] += 1
        self.t.event("move", topic=r.name, load=0.0, frm=old, to=mv.to)
        if mv.reply is not None:
            self.t.reply(mv.reply[0], [mv.reply[1]], Done(mv.reply[2]))
        self.holder.release_queue(r)
        self.replication.flush(r)

    def _abort_move(self, r: Replica, reason: str) -> None:
        mv = r.move
        assert mv is not None
        r.enter(Transition.MOVE_ABORTED)
        self._lease_waits.pop(mv.corr, None)
        self.t.counters["moves_aborted"] += 1
        log.info("move of topic %s to (%.4f, %.4f) abandoned: %s", r.name, *mv.to, reason)
        if mv.leased and self.t.closest_id(mv.to) != self.t.ov.me.id:
            self.t.ov.route(mv.to, Release(r.name, mv.to, self.t.ov.me))
        if self.t.closest_id(r.home) == self.t.ov.me.id:
            self.home.end_lease(r.name)
        if mv.reply is not None:
            self.t.reply(mv.reply[0], [mv.reply[1]], Failed(mv.reply[2], r.name, "timeout", reason))
        r.copy.want(new_holder=True)  # the secondary may have missed what waited: back-fill it, re-send what waits
        r.window.clear()
        r.outbox = r.unconfirmed()
        r.meta_dirty = True
        self.holder.release_queue(r)
        self.replication.flush(r)

    def activate_arrived(self, m: Activate) -> None:
        """ACTIVATE at the new primary: acknowledge the waiters, deliver, serve."""
        r = self.t.replicas.get(m.topic)
        if r is None or r.staged is None or not same(r.coord, m.coord):
            log.warning("ACTIVATE of %s from %s without a staged hand-over here", m.topic, m.origin.id)
            return
        st = r.staged
        r.enter(Transition.ACTIVATE)
        r.moved_at = self.t.ov.now()
        self.t.counters["delegations"] += 1
        for w in st.waiters:
            self.t.reply(w.access, [w.session], Ack(r.name, w.publisher, w.seq, w.ts))
        self.t.counters["acked"] += len(st.waiters)
        deliver, r.undelivered = r.undelivered, []
        self.t.deliver_to(r.subscribers.values(), r.name, deliver)
        self.holder.release_queue(r)
        self.replication.flush(r)

    def _redirect_all(self, r: Replica, to: Coord) -> None:
        groups: dict[str, tuple[NodeInfo, set[str]]] = {}
        for sub in r.subscribers.values():
            groups.setdefault(sub.access.id, (sub.access, set()))[1].add(sub.session)
        for w in r.waiting:
            groups.setdefault(w.access.id, (w.access, set()))[1].add(w.session)
        for access, sessions in groups.values():
            self.holder.redirect(access, sorted(sessions), r.name, to)

    def _release_old(self, topic: str, old: Coord, new: Coord) -> None:
        # The new coordinate's holders are its N1 .. N_level: ranked() names three at every level, and an old
        # copy at the new N3 at level 2 was spared, kept the history up to the move, and took the topic over at
        # its old coordinate with it when the home's broker failed.
        keep = {n.id for n in self.t.ranked(new)[: self.t.config.resilience]}
        me = self.t.ov.me
        for n in self.t.ranked(old)[1:]:
            if n.id not in keep:
                self.t.ov.route(n.coord, Release(topic, old, me))

    @staticmethod
    def _clear_primary_state(r: Replica) -> None:
        r.forget_primary_work()
        r.copy.alone()  # a copy at the new coordinate now: a next holder it has there is new to it

    def deadline(self, r: Replica) -> float:
        """When r's move or hand-over is given up (`tick`), if not done by then; math.inf if neither is under way."""
        timeout = self.t.config.move_timeout
        at = r.move.until(timeout) if r.move is not None else math.inf
        return min(at, r.staged.until(timeout)) if r.staged is not None else at

    def tick(self, now: float, due: Iterable[Replica]) -> None:
        """Moves and hand-overs that took too long (of the replicas `due` this tick, TopicTable.due: a replica
        with either under way is armed for its time-out, `deadline`); forwards that expired."""
        timeout = self.t.config.move_timeout
        for r in due:
            if r.move is not None and now > r.move.until(timeout):
                self._abort_move(r, f"no confirmation from the new coordinate within {timeout:.1f} s")
            if r.staged is not None and now > r.staged.until(timeout):
                log.warning("hand-over of %s from %s never activated; dropping it", r.name, r.staged.origin.id)
                self._drop_staged(r)
        for topic in [t for t, (_, until) in self._forward.items() if until < now]:
            del self._forward[topic]
