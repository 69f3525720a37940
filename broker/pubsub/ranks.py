"""The ranking role: what a broker does with the topics it holds when the overlay changes.

When the view changes, every broker re-ranks itself for each topic it holds (`view_changed`): a secondary that
became closest takes over (sync.py: it merges what the other holders have, then re-delivers the last moments);
a primary that gained a new secondary gives it the whole history (replication.py); a broker ranked out of the
holders retires (sync.py: it offers its records to the holders now and lets go once they confirmed).  A copy
that a move left behind follows the topic's later delegate list to where it lives (`follow`, `relocate`), and a
broker that hears from such a copy tells it the later list (`left_behind`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from broker.pubsub.core import TopicTable, same
from broker.pubsub.replica import Replica, Stage, Transition
from broker.pubsub.settings import RERANK_SLICE
from overlay.delegation import DelegateUpdate
from overlay.geometry import Coord
from overlay.protocol import NodeInfo
from overlay.pubsub import Delegation, later

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.replication import ReplicationRole
    from broker.pubsub.sync import SyncRole

log = logging.getLogger("sedax.pubsub")


class RankRole:
    """Re-ranking on view changes, and copies a move left behind (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        # The walk of a view change (`view_changed`): the replicas in the order it takes them, how far it got,
        # and the names not yet re-ranked for the current view (a replica settled out of turn leaves the set).
        self._walk: list[str] = []
        self._at = 0
        self.pending: set[str] = set()
        self._stepping = False  # the next slice is deferred to the next turn
        self._paused = False  # the walk waits for its peers' answers (`step`, `resume`)
        # Wired by the engine.
        self.holder: HolderRole
        self.home: HomeRole
        self.replication: ReplicationRole
        self.sync: SyncRole

    # ---- overlay changes -------------------------------------------------------------------------------------
    def view_changed(self, failed: Collection[str]) -> None:
        """Re-rank every topic held: take-over, new secondary, or drop (moves in progress finish first).

        Not in one turn: RERANK_SLICE replicas now and as many per turn of the event loop after it (`step`), so a
        broker of many topics keeps its heartbeats and requests going through a view change.  A replica that is
        touched before the walk reaches it (a request, a routed message about its topic, a time-out: `settle`)
        is re-ranked first, so no replica acts on the rank it had in an earlier view.  A view change during the
        walk starts it again, every replica pending for the newest view.

        The walk takes the topics that stored something last first: what it starts for each (a first batch to a
        new secondary, a back-fill, offers, and at a new primary the pulls its offers bring) queues on the links
        in walk order, and a topic with publishers waiting must not wait behind the history of idle ones.  In
        the order they were made, a publish to a topic whose new secondary was a broker that had just joined
        next to 30,000 topics waited seconds for that broker's confirmation (bench_join.py)."""
        self.sync.leaving &= set(self.t.ov.view())
        replicas = self.t.replicas
        self._walk = sorted(replicas, key=lambda name: replicas[name].last_ts, reverse=True)
        self._at = 0
        self.pending = set(self._walk)
        self.step()

    def step(self, *, paced: bool = False) -> None:
        """The walk's next slice (`view_changed`); the one after it is deferred to the next turn of the loop.

        paced (the slices after the first): at most as many replicas as the busiest peer has room for requests
        (PeerProgress `room`, BULK_WINDOW), none while it has none: the walk pauses, and `resume` goes on once the
        peers answered.  What the walk starts queues at the peers ahead of the live batches, confirmations and
        pull answers of the topics walked first (those with publishers), and of every request that settles a topic
        out of turn; paced, that queue holds a window's worth, not the history of every idle topic held."""
        walk, pending, replicas = self._walk, self.pending, self.t.replicas
        size = RERANK_SLICE
        if paced:
            size = min(size, self._room())
            if size <= 0 and self._at < len(walk):
                self._paused = True
                return
        self._paused = False
        todo: list[Replica] = []
        while self._at < len(walk) and len(todo) < size:
            name = walk[self._at]
            self._at += 1
            if name in pending and (r := replicas.get(name)) is not None:
                todo.append(r)
        self.t.rank_many(r.coord for r in todo)  # (at once: then rank_of_me reads the cache)
        for r in todo:
            if r.name in pending:  # (not settled meanwhile by what an earlier one of the slice did)
                self._settle(r)
        if self._at < len(walk):
            if not self._stepping:
                self._stepping = True
                self.t.ov.defer(self._deferred_step)
        else:
            self._walk, self._at = [], 0
            pending.clear()

    def _room(self) -> int:
        """How many more replicas the walk may re-rank now (PeerProgress `room`)."""
        return self.t.peers.room(self.t.ov.now(), self.t.config.offer_timeout)

    def _deferred_step(self) -> None:
        self._stepping = False
        self.step(paced=True)

    def resume(self) -> None:
        """Go on with a walk that paused for its peers' answers (`step`), if one did, in the next turn: the engine
        calls this after each routed message (answers come in) and each tick (unanswered requests age out)."""
        if self._paused and not self._stepping:
            self._stepping = True
            self.t.ov.defer(self._deferred_step)

    @property
    def paused(self) -> bool:
        """The walk waits for its peers' answers (`step`)."""
        return self._paused

    def settle(self, topic: str) -> None:
        """If the walk of a view change has not reached topic's replica yet, re-rank it now (see view_changed)."""
        if topic in self.pending and (r := self.t.replicas.get(topic)) is not None:
            self._settle(r)

    def settled(self, r: Replica) -> bool:
        """`settle` r if the walk has not reached it; False if that let it go (ranked out with nothing to hand on)."""
        if r.name not in self.pending:
            return True
        self._settle(r)
        return self.t.replicas.get(r.name) is r

    def settle_due(self, due: list[Replica]) -> list[Replica]:
        """Of a tick's `due` replicas, those settled for the current view: at most RERANK_SLICE that the walk has
        not reached are re-ranked now (`settled`), the rest looked at by a later tick (the walk may reach them
        first).  After a late tick the sweep's share of every replica comes due with the time-outs, and settling
        them all in one turn (each re-ranked copy offering its records) held a broker's loop 0.5-1 s while a
        broker joined next to 30,000 topics (bench_join.py), which made the next tick later still.  Paced as the
        walk is (`step`): the sweep comes to every replica within a few seconds, and settled here unpaced, the
        replicas the paused walk had not reached sent their offers all the same."""
        out: list[Replica] = []
        budget = min(RERANK_SLICE, self._room())
        for r in due:
            if r.name not in self.pending:
                out.append(r)
            elif budget > 0:
                budget -= 1
                if self.settled(r):
                    out.append(r)
            else:
                self.t.look_again(r)
        return out

    def walking(self) -> bool:
        """The walk of a view change is under way."""
        return bool(self._walk)

    def settle_all(self) -> None:
        """Finish the walk of a view change at once (the tests and bench_rank.py; a broker walks a slice per turn)."""
        while self._walk:
            self.step()

    def _settle(self, r: Replica) -> None:
        self.pending.discard(r.name)
        old = r.rank
        self.t.rerank(r)
        self._rerank(r, old)

    def _rerank(self, r: Replica, old: int, *, offer: bool = False) -> None:
        """r's rank changed from old (the view changed, or r follows the topic to a new coordinate: `relocate`):
        take over, get a new secondary, become a copy, or retire.  offer: a copy offers what it holds to the
        primary, as a demoted primary does (a relocated copy may hold what the topic's holders lack)."""
        if r.stage in (Stage.HANDING_OVER, Stage.RECEIVING, Stage.RECOVERING):
            return  # finishes (or times out, or resumes once joined) as it is; roles are settled then
        if r.stage is Stage.RETIRING:
            if not self.keeps(r.rank):
                self.sync.retire(r)  # the holders changed: offer to the new ones
                return
            r.enter(Transition.KEEP)  # ranked again before it let go: a copy, or the primary below
            old = 0
        if r.rank == 1:
            if old != 1 and r.stage is not Stage.PLACING:
                self.sync.take_over(r)
                # What this broker got from the dead primary, its secondary may lack (a batch it confirmed
                # that never reached the old tertiary, at level 3): a back-fill, which costs one offer if not.
                r.copy.want()
            sec = self.t.secondary(r)
            if sec is not None and r.copy.next_is(sec.id):
                # A new secondary gets the whole history, after a failure too (replication.py).
                if any(b.target != sec.id for b in r.window):
                    r.window.clear()  # re-sent to the new secondary below
                    r.outbox = r.unconfirmed()
                r.meta_dirty = True
            self.replication.flush(r)
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
                self.sync.offer(r, self.t.holders(r.coord)[:1])
                r.copy.want()
            if (nxt := self.replication.next_holder(r)) is not None:
                r.copy.next_is(nxt.id)  # level 3: a new tertiary gets the history from the secondary
            else:
                # No next holder now (a tertiary; a secondary at level 2).  The broker that held the history for
                # this one may be ranked out meanwhile and let its copy go: when it is next again, it is given
                # the history anew (one offer round trip if it still has all of it).  Before, `holder` outlived
                # that copy, and a tertiary ranked out and back in stayed without the history.
                r.copy.alone()
            self.replication.copy_down(r)
            queued, r.queued = r.queued, []
            for access, session, req in queued:
                self.holder.handle_request(access, session, req)
        else:
            self.sync.retire(r)

    def keeps(self, rank: int) -> bool:
        """A broker of this rank keeps a copy of the topic (primary, secondary, tertiary at level 3)."""
        return 1 <= rank <= max(2, self.t.config.resilience) and (rank == 1 or self.t.config.resilience >= 2)

    # ---- a copy a move left behind ---------------------------------------------------------------------------
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

    def left_behind(
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
        self.t.rerank(r, self.t.rank_of_me(to))
        self._rerank(r, 0, offer=True)

    # ---- time ------------------------------------------------------------------------------------------------
    def ranked_out(self, r: Replica) -> bool:
        """At an anti-entropy round: a steady copy the view no longer ranks among the holders, made or kept
        (`settle` keeps any ranked copy) by a batch from a primary whose view lagged, after this broker's last view
        change (seen 30 s after a healed partition at level 2).  It hands its records on and lets go, as
        view_changed would have had it (True); not while a broker is leaving (the copies it hands its topics to
        may rank below the holders until it is gone)."""
        if r.stage is not Stage.HOLDING or r.offers or self.sync.leaving:
            return False
        if self.keeps(rank := self.t.rank_of_me(r.coord)):
            return False
        self.t.rerank(r, rank)
        self.sync.retire(r)
        return True
