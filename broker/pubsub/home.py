"""The home role: delegate lists, leases for moves, and the placement of new topics (Sec. III-A, VI-A).

The broker closest to h(t) is the topic's home.  It keeps the timestamped delegate list (synchronised with the
home's secondary), serialises moves with one lease per topic and a cool-down, and places a topic nobody used
yet with Alg. 1 (the balancer's `placer`) while the first requests wait (PLACING).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from broker.pubsub.core import TopicTable, same
from broker.pubsub.replica import Replica, Stage, Transition
from broker.sweep import Sweep
from overlay.delegation import DelegateUpdate, DelegateUpdated, Lease, Leased
from overlay.geometry import Coord
from overlay.protocol import NodeInfo
from overlay.pubsub import Delegation, later

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from broker.pubsub.ranks import RankRole


class HomeRole:
    """Delegate lists, leases and placement (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        # Wired by the engine.
        self.holder: HolderRole
        self.ranks: RankRole
        # Delegate lists of topics whose home this broker is (or the home's secondary).
        self.delegate_lists: dict[str, list[Delegation]] = {}
        self._list_sweep: Sweep[str] = Sweep()
        self._location_sweep: Sweep[str] = Sweep(self.t.config.location_check_interval / 2)
        self._last_move: dict[str, float] = {}  # when each topic last moved (cool-down)
        self._leases: dict[str, tuple[float, str]] = {}  # topic -> (expiry, leaseholder id)
        self._unconfirmed: dict[int, tuple[str, tuple[Delegation, ...], float]] = {}  # corr -> (topic, list, sent)
        self._location_checked: float | None = None  # when `_check_location` last ran (None: not yet ticked)
        # Set by the broker's balancer: Alg. 1 placement of a new topic (topic, done callback with the chosen
        # coordinate or None).
        self.placer: Callable[[str, Callable[[Coord | None], None]], None] | None = None

    # ---- leases ------------------------------------------------------------------------------------------
    def grant(self, topic: str, frm: Coord, to: Coord, who: str, force: bool) -> tuple[bool, str]:
        """The home's serialisation of moves: one lease per topic, the topic where the home believes it is."""
        now = self.t.ov.now()
        dl = self.delegate_lists.get(topic)
        cur = dl[-1].coord if dl else self.t.home(topic)
        if not same(cur, frm):
            return False, f"the home has {topic!r} at ({cur[0]}, {cur[1]}), not at ({frm[0]}, {frm[1]})"
        lease = self._leases.get(topic)
        if lease is not None and lease[0] > now and lease[1] != who:
            return False, f"another move of {topic!r} is in progress"
        last = self._last_move.get(topic)
        cooldown = self.t.config.move_cooldown
        if not force and last is not None and now - last < cooldown:
            return False, f"{topic!r} moved {now - last:.1f} s ago (cool-down {cooldown:.0f} s)"
        self._leases[topic] = (now + 2 * self.t.config.move_timeout, who)
        return True, ""

    def lease_arrived(self, m: Lease) -> None:
        """LEASE: a primary asks to move one of our topics."""
        ok, reason = self.grant(m.topic, m.frm, m.to, m.origin.id, m.force)
        self.t.ov.route(m.origin.coord, Leased(m.corr, m.topic, ok, reason))

    def end_lease(self, topic: str) -> None:
        """The move holding the lease was abandoned."""
        self._leases.pop(topic, None)

    # ---- delegate lists ----------------------------------------------------------------------------------
    def set_delegates(self, topic: str, dl: list[Delegation]) -> None:
        """Record a topic's new delegate list at its home (here, or by DELEGATE_UPDATE until confirmed)."""
        home = self.t.home(topic)
        if self.t.closest_id(home) == self.t.ov.me.id:
            self._store(topic, dl)
            return
        corr = self.t.next_corr()
        self._unconfirmed[corr] = (topic, tuple(dl), self.t.ov.now())
        self.t.ov.route(home, DelegateUpdate(corr, topic, tuple(dl), self.t.ov.me))

    def _store(self, topic: str, dl: list[Delegation]) -> None:
        cur = self.delegate_lists.get(topic)
        if cur and later(cur, dl):
            # An older update arriving late, or a copy left behind by a move re-registering after a restart
            # (`HolderRole.resume`): a replica here follows the list the home has.
            self.ranks.follow(topic, cur)
            return
        if cur != dl:
            self.delegate_lists[topic] = list(dl)
            self._keep()
            self._last_move[topic] = self.t.ov.now()
            self._leases.pop(topic, None)
        self.ranks.follow(topic, dl)
        r = self.t.replicas.get(topic)
        if r is not None:
            r.meta_dirty = True  # with the next batch to the secondary, as before every batch carried them
        self._sync_secondary(topic)

    def _sync_secondary(self, topic: str, upto: int = 2) -> None:
        """This broker is the home: its list of topic to the home coordinate's holders ranked 2 to upto (the
        secondary; `_check_location` every holder of the level)."""
        ranked = self.t.ranked(self.t.home(topic))
        dl = self.delegate_lists.get(topic)
        if dl and ranked and ranked[0].id == self.t.ov.me.id:
            for other in ranked[1:upto]:
                self.t.ov.route(other.coord, DelegateUpdate(0, topic, tuple(dl), self.t.ov.me, sync=True))

    def _sync_home(self, topic: str) -> None:
        """The home's secondary gives its list to the home, which may be new to the topic (a broker that joined
        closer to h(t), or one started again without its data directory)."""
        ranked = self.t.ranked(self.t.home(topic))
        dl = self.delegate_lists.get(topic)
        if dl and len(ranked) > 1 and ranked[1].id == self.t.ov.me.id:
            self.t.ov.route(ranked[0].coord, DelegateUpdate(0, topic, tuple(dl), self.t.ov.me, sync=True))

    def learn_delegates(self, topic: str, dl: list[Delegation], origin: NodeInfo | None = None) -> None:
        """A delegate list heard from another holder: keep it if it is newer, and let this broker's replica of
        the topic follow it (or tell origin ours, if ours is newer: `RankRole.follow`)."""
        cur = self.delegate_lists.get(topic)
        if dl and (not cur or cur[-1].start <= dl[-1].start) and cur != dl:
            self.delegate_lists[topic] = dl
            self._keep()
        self.ranks.follow(topic, dl, origin)

    def _keep(self) -> None:
        """The lists on the disk (with a data directory): they are all that says where a moved topic lives,
        and after a full restart its copies come back there.  In memory only, a home started again made the
        topic afresh at its home coordinate, beside the copies serving at the delegate coordinate: publishes
        went to one, subscriptions to the other (benchmarks/chaos.py)."""
        self.t.held_version += 1  # (a list kept or dropped)
        self.t.store.save_delegates(self.delegate_lists)

    def recovered(self, lists: dict[str, list[Delegation]]) -> None:
        """The lists `_keep` wrote before a restart (whether this broker is still the home is up to the view)."""
        self.delegate_lists.update(lists)
        self.t.held_version += 1

    def delegate_update_arrived(self, m: DelegateUpdate) -> None:
        """DELEGATE_UPDATE: a new list from the topic's primary, the home's copy for its secondary (or the other
        way round), or another broker's answer to a copy of ours it found out of date (`sync`)."""
        if m.sync:
            self.learn_delegates(m.topic, list(m.delegates), m.origin)
            return
        cur = self.delegate_lists.get(m.topic)
        if cur == list(m.delegates):
            pass  # a holder's periodic check (`_check_location`) with the list kept here: nothing to change
        elif cur and later(cur, m.delegates):
            # The sender's list is older than the home's: a primary left behind by a move re-registering after a
            # restart.  It follows the home's list (confirmed all the same: it need not send again).
            self.t.ov.route(m.origin.coord, DelegateUpdate(0, m.topic, tuple(cur), self.t.ov.me, sync=True))
        else:
            self._store(m.topic, list(m.delegates))
        self.t.ov.route(m.origin.coord, DelegateUpdated(m.corr, m.topic))

    def delegate_updated_arrived(self, m: DelegateUpdated) -> None:
        """DELEGATE_UPDATED: the home stored our list."""
        self._unconfirmed.pop(m.corr, None)

    # ---- placement (Alg. 1) ------------------------------------------------------------------------------
    def maybe_place(self, r: Replica) -> bool:
        """Alg. 1: a topic created at its home gets the best coordinate the selection finds (Sec. VI-A)."""
        if self.placer is None or not same(r.coord, r.home) or r.rank != 1:
            return False
        if r.log.rows or r.log.last_seq or r.subscribers or r.name in self.delegate_lists:
            return False
        r.enter(Transition.PLACE)
        topic = r.name

        def placed(coord: Coord | None) -> None:
            if self.t.replicas.get(topic) is not r or r.stage is not Stage.PLACING:
                return
            if coord is None or same(coord, r.coord) or self.t.closest_id(coord) == self.t.ov.me.id:
                r.enter(Transition.PLACED_HERE)
                self.holder.release_queue(r)
                return
            now = self.t.ov.now()
            dl = [Delegation(r.home, 0.0), Delegation(coord, now)]
            self.set_delegates(topic, dl)
            self.t.counters["delegations"] += 1
            self.t.event("delegation", topic=topic, load=0.0, frm=r.home, to=coord)
            queued, r.queued = r.queued, []
            self.t.drop(r)
            # The list goes ahead of the requests on the same path: the copies made there keep it on their disks
            # and, after a restart, know themselves later than any copy left at h(t).
            self.t.ov.route(coord, DelegateUpdate(0, topic, tuple(dl), self.t.ov.me, sync=True))
            for access, session, req in queued:
                self.holder.forward_request(access, session, req, coord, via_home=True)

        self.placer(topic, placed)
        return True

    # ---- overlay changes and time -----------------------------------------------------------------------
    def view_changed(self) -> None:
        """Keep the lists of topics whose home (or home's secondary) this broker still is."""
        dropped = False
        self.t.rank_many(self.t.home(topic) for topic in self.delegate_lists)
        for topic in list(self.delegate_lists):
            rank = self.t.rank_of_me(self.t.home(topic))
            if rank == 1:
                self._sync_secondary(topic)  # the home's secondary may be new
            elif rank == 2:
                self._sync_home(topic)  # and so may the home
            else:
                del self.delegate_lists[topic]
                dropped = True
        if dropped:
            self._keep()

    def tick(self, now: float) -> None:
        """Re-send delegate lists the home has not confirmed: a list must not be lost.  A replica here whose own
        list is earlier than the one this broker keeps follows it (a copy made or read back before the list
        was known here; nothing else would tell it)."""
        lists = self.delegate_lists
        for topic in self._list_sweep.take(lists, now):  # (a slice per tick: there is one per moved topic)
            r = self.t.replicas.get(topic)
            if r is not None and (kept := lists.get(topic)) is not None and later(kept, r.delegates):
                self.ranks.follow(topic, kept)
        for corr, (topic, dl, sent) in list(self._unconfirmed.items()):
            if now - sent > 1.0:
                self._unconfirmed[corr] = (topic, dl, now)
                self.t.ov.route(self.t.home(topic), DelegateUpdate(corr, topic, dl, self.t.ov.me))
        self._check_location(now)
        if self._location_checked is None:
            self._location_checked = now  # the first one an interval after the start (recovery did the rest)
        elif now - self._location_checked >= self.t.config.location_check_interval:
            self._location_checked = now
            for topic in self.delegate_lists:
                self._sync_secondary(topic, self.t.config.resilience)

    def _check_location(self, now: float) -> None:
        """Compare the lists of moved topics with the home's (settings.LOCATION_CHECK_INTERVAL says why).  A steady
        copy held at another coordinate than the home sends the home its list: the home keeps it if it has none or
        an earlier one, and answers with its own if that is later (`delegate_update_arrived`), which the copy
        follows (and `tick` gives each list the home keeps to the home coordinate's other holders every interval:
        DELEGATE_UPDATE sync, they follow a later one).  Two messages per moved topic and holder and interval."""
        me, interval, replicas = self.t.ov.me, self.t.config.location_check_interval, self.t.replicas
        # Each replica every interval, on its own clock (`Replica.located_at`), found a slice per tick: one look
        # at all of them stalled a broker of 100,000 topics for ~10 ms.  The first look only starts the clock.
        for topic in self._location_sweep.take(replicas, now):
            if (r := replicas.get(topic)) is None or now - r.located_at < interval:
                continue
            first, r.located_at = r.located_at == 0.0, now
            if first:
                continue
            if (r.stage is Stage.SERVING or r.stage is Stage.HOLDING) and not same(r.coord, r.home):
                dl = tuple(r.delegates)
                if self.t.closest_id(r.home) == me.id:
                    if self.delegate_lists.get(topic) != list(dl):
                        self._store(topic, list(dl))
                else:
                    self.t.ov.route(r.home, DelegateUpdate(0, topic, dl, me))
