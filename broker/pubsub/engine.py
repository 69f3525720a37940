"""The pub/sub engine of one broker: the roles wired together, one routing table, one tick.

This package is I/O-free: the broker gives it an `Overlay` port (send, route, clock) and calls `tick()`.
Each role owns one part of the protocol and sees the others only through their methods:

    access.py       client sessions of this broker: requests out, answers in
    holder.py       requests at the topic's holders: serve, publish, acknowledge and deliver
    replication.py  the primary's copies at the secondary (and tertiary): batches, back-fill, anti-entropy
    sync.py         pulls and offers between a topic's holders, take-over after a failure, retiring
    ranks.py        re-ranking the topics held when the view changes; copies a move left behind
    moves.py        delegation of a topic to another coordinate (lease, hand-over, activate)
    home.py         delegate lists, leases, placement of new topics (Alg. 1)
    loads.py        what is held by role, and the load model's L1/L2/L3
    replica.py      the per-topic record and its one transition table of stages

`routed_handlers()` maps every routed message class pub/sub owns to its handler, so the broker's router
dispatches by table.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from broker.pubsub.access import AccessRole
from broker.pubsub.core import Overlay, TopicTable
from broker.pubsub.holder import HolderRole
from broker.pubsub.home import HomeRole
from broker.pubsub.loads import LoadRole
from broker.pubsub.moves import MoveRole
from broker.pubsub.ranks import RankRole
from broker.pubsub.replica import Replica
from broker.pubsub.replication import ReplicationRole
from broker.pubsub.settings import PubSubConfig
from broker.pubsub.sync import SyncRole
from broker.stats import TopicCensus
from broker.storage import RecoveryReport
from broker.store import TopicStore
from overlay.delegation import (
    Activate,
    DelegateUpdate,
    DelegateUpdated,
    Lease,
    Leased,
    NodeLoad,
    Release,
    TertiaryNote,
    TopicMoved,
)
from overlay.geometry import Coord
from overlay.protocol import Message, NodeInfo
from overlay.pubsub import Delegation, Offer, Pull, Replicate, Replicated, SessionGone, TopicReply, TopicRequest

Handler = Callable[[Any], None]


class PubSub:
    """The pub/sub layer of one broker (see the module docstring)."""

    def __init__(self, overlay: Overlay, config: PubSubConfig | None = None, store: TopicStore | None = None) -> None:
        self.config = config or PubSubConfig()
        self.store = store if store is not None else TopicStore(self.config.retention)
        t = self.table = TopicTable(overlay, self.config, self.store)
        self.access = AccessRole(t)
        self.holder = HolderRole(t)
        self.replication = ReplicationRole(t)
        self.sync = SyncRole(t)
        self.ranks = RankRole(t)
        self.moves = MoveRole(t)
        self.home = HomeRole(t)
        self.accounting = LoadRole(t, self.home)
        # Explicit wiring: who calls whom.
        self.access.holder = self.holder
        self.holder.access, self.holder.replication, self.holder.sync = self.access, self.replication, self.sync
        self.holder.ranks, self.holder.moves, self.holder.home = self.ranks, self.moves, self.home
        self.replication.holder, self.replication.moves, self.replication.home = self.holder, self.moves, self.home
        self.replication.sync, self.replication.ranks = self.sync, self.ranks
        self.sync.holder, self.sync.home, self.sync.ranks, self.sync.replication = (
            self.holder,
            self.home,
            self.ranks,
            self.replication,
        )
        self.ranks.holder, self.ranks.home, self.ranks.sync, self.ranks.replication = (
            self.holder,
            self.home,
            self.sync,
            self.replication,
        )
        self.moves.holder, self.moves.replication, self.moves.home = self.holder, self.replication, self.home
        self.home.holder, self.home.ranks = self.holder, self.ranks
        t.on_flush = self._flush_turn
        t.deadline = self._deadline
        t.on_local_reply = self.access.local_reply
        handlers: dict[type[Message], Handler] = {
            TopicRequest: self.holder.topic_request_arrived,
            TopicReply: self.access.reply_arrived,
            Replicate: self.replication.replicate_arrived,
            Replicated: self.replication.replicated_arrived,
            Pull: self.sync.pull_arrived,
            Offer: self.sync.offer_arrived,
            Lease: self.home.lease_arrived,
            Leased: self.moves.leased_arrived,
            Activate: self.moves.activate_arrived,
            Release: self._release_arrived,
            DelegateUpdate: self.home.delegate_update_arrived,
            DelegateUpdated: self.home.delegate_updated_arrived,
            TopicMoved: self.access.topic_moved_arrived,
            TertiaryNote: self.accounting.tertiary_note_arrived,
            SessionGone: self.holder.session_gone_arrived,
        }
        self._handlers = {cls: self._answering(h) for cls, h in handlers.items()}

    # ---- wiring the broker sets --------------------------------------------------------------------------
    @property
    def event(self) -> Callable[..., None]:
        """Where events for the metrics log go (the broker sets it; docs/logs.md)."""
        return self.table.event

    @event.setter
    def event(self, fn: Callable[..., None]) -> None:
        self.table.event = fn

    @property
    def placer(self) -> Callable[[str, Callable[[Coord | None], None]], None] | None:
        """Alg. 1 placement of new topics (the balancer sets it)."""
        return self.home.placer

    @placer.setter
    def placer(self, fn: Callable[[str, Callable[[Coord | None], None]], None] | None) -> None:
        self.home.placer = fn

    @property
    def counters(self) -> dict[str, int]:
        return self.table.counters

    @property
    def identities(self) -> dict[str, str]:
        """Who each local session authenticated as (the broker fills it)."""
        return self.access.identities

    @property
    def coords(self) -> dict[str, Coord]:
        """C(t) of topics the access side learned from redirects."""
        return self.access.coords

    @property
    def delegate_lists(self) -> dict[str, list[Delegation]]:
        return self.home.delegate_lists

    # ---- input -------------------------------------------------------------------------------------------
    def client_message(self, session: str, msg: Message) -> None:
        """A message from a client attached to this broker."""
        self.access.client_message(session, msg)

    def routed_handlers(self) -> Mapping[type[Message], Handler]:
        """Routed message class -> handler, for every routed message pub/sub owns."""
        return self._handlers

    def _answering(self, handler: Handler) -> Handler:
        """handler, then the answers it produced (a commit's ACKs and DELIVERs, refusals) leave, one TOPIC_REPLY
        per access broker: held to the end of the turn they would wait behind the next batch of reads."""
        flush = self.table.flush_replies
        ranks = self.ranks

        def handle(msg: Any) -> None:
            if ranks.pending and isinstance(topic := getattr(msg, "topic", None), str):
                ranks.settle(topic)  # (a view change's walk has not reached it yet: RankRole.view_changed)
            handler(msg)
            flush()

        return handle

    def routed(self, msg: Message) -> bool:
        """A ROUTED message that reached this broker (closest to its destination); False if not pub/sub."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return False
        handler(msg)
        if self.ranks.paused:
            self.ranks.resume()  # (an answer may have made room for the walk's next slice)
        return True

    def session_closed(self, session: str) -> None:
        """A local client went away: end its subscriptions at the topics' primaries."""
        self.access.session_closed(session)

    def acl_reloaded(self) -> int:
        """The ACL was read again: local subscriptions it denies now end (AccessRole.acl_reloaded); how many."""
        return self.access.acl_reloaded()

    def subscriptions(self, session: str) -> int:
        """How many topics a local session is subscribed to."""
        return self.access.subscriptions(session)

    def request_move(
        self, topic: str, to: Coord, reply: tuple[NodeInfo, str, int] | None = None, force: bool = False
    ) -> str | None:
        """Start moving a topic this broker is the primary of (None once under way, else why not)."""
        self.ranks.settle(topic)
        return self.moves.request_move(topic, to, reply, force)

    def recover(self) -> RecoveryReport:
        """Read the data directory back (none: nothing); the topics wait in RECOVERING until `resume`."""
        metas, report = self.store.recover(self.table.ov.now())
        self.home.recovered(self.store.load_delegates())  # first: the recovered replicas take their lists
        self.holder.recovered(metas)
        return report

    def resume(self) -> None:
        """The broker has joined (or is alone): recovered topics sync, hold or go (holder.resume)."""
        self.holder.resume()

    def hand_off(self) -> int:
        """A graceful shutdown, all at once: every `hand_off_step`; returns how many offers wait for confirmation
        (`handing_off`)."""
        while self.hand_off_step():
            pass
        return self.handing_off()

    def hand_off_step(self) -> bool:
        """The next slice of a graceful shutdown: offer the topics held to the brokers that hold them next (each by
        its rank for the current view: the walk of a view change is finished first), RERANK_SLICE per call; True
        while more is left.  The broker runs its event loop between the calls: offered in one turn, 10,000
        topics held its loop ~2 s, its neighbours took the leaving broker for dead and took its topics over.  It
        leaves once `handing_off` is 0 or time is up."""
        if self.ranks.walking():
            self.ranks.step()
            return True
        return self.sync.hand_off_step()

    def handing_off(self) -> int:
        """Offers of a graceful shutdown (or of retiring replicas) not yet confirmed."""
        return self.sync.handing_off()

    def close(self) -> None:
        """Write and close the disk journals (graceful shutdown)."""
        self.store.close()

    def view_changed(self, failed: Collection[str] = ()) -> None:
        """The broker's view of the overlay changed; failed names the brokers that died (not those that left
        gracefully or joined).  Every topic is re-ranked: take-over, new secondary, hand-over, or drop; a slice now
        and the rest over the next turns of the loop, a topic touched meanwhile first (RankRole.view_changed)."""
        self.table.peers.forget(self.table.ov.view())
        self.home.view_changed()
        self.ranks.view_changed(failed)
        self.access.view_changed()  # (after the holders re-ranked: a local registration finds its replica)

    def tick(self) -> bool:
        """Timers: replication, pull and move time-outs, registrations made again, delegate-list re-sends, notes,
        retention, empty topics.  True if time-outs are up that this tick left for the next (DUE_SLICE): the
        broker ticks again soon."""
        now = self.table.ov.now()
        due = self.table.due(now)
        if self.ranks.pending:
            due = self.ranks.settle_due(due)  # (before its time-outs act on an earlier view's rank)
            self.ranks.resume()  # (requests unanswered for long no longer hold a paused walk)
        self.replication.tick(now, due)
        self.access.tick(now)
        self.moves.tick(now, due)
        self.table.rearm(due)
        self.home.tick(now)
        self.accounting.tick(now)
        self.store.expire_due(now)
        self.holder.sweep_empty(now)
        self.holder.check_memory(now)
        self.store.sync_due(now)
        return self.table.overdue(now)

    def _deadline(self, r: Replica) -> float:
        """When the earliest time-out of r's work under way is up: each role times its own (TopicTable.wake)."""
        return min(self.replication.deadline(r), self.sync.deadline(r), self.moves.deadline(r))

    def _flush_turn(self) -> None:
        """End of a turn's input: one TOPIC_REQUEST per coordinate, then each dirty topic, then one TOPIC_REPLY
        per access broker for the answers not sent yet (last: flushing a topic may acknowledge and deliver)."""
        self.access.flush()
        dirty, self.table.dirty = self.table.dirty, {}
        ranks = self.ranks
        for r in dirty.values():
            if ranks.pending and not ranks.settled(r):
                continue  # (a view change's walk had not reached it: ranked out, let go)
            self.replication.flush(r)
        self.table.flush_replies()

    def _release_arrived(self, m: Release) -> None:
        self.accounting.forget_note(m.topic)
        self.moves.release_arrived(m)

    # ---- status and loads --------------------------------------------------------------------------------
    def topics(self, names: Iterable[str]) -> list[tuple[str, str, int]]:
        """(topic, role, stored bytes) for those of names held (loads.py)."""
        return self.accounting.topics(names)

    @property
    def held_version(self) -> int:
        """Changes when the set of topics held does (core.TopicTable.held_version)."""
        return self.table.held_version

    def held_names(self) -> list[str]:
        return self.accounting.held_names()

    def held_count(self) -> int:
        return self.accounting.held_count()

    def replica_states(self, topics: Iterable[str]) -> dict[str, tuple[str, int, int]]:
        """topic -> (state, bytes behind, pulls or offers pending) of those of topics held (loads.py)."""
        return self.accounting.replica_states(topics)

    def rows(self, into: list[tuple[str, str, int]]) -> Iterator[None]:
        """The rows `topics` has for every name held, into `into`, a slice per step (loads.py)."""
        return self.accounting.rows(into)

    def census(self, into: TopicCensus) -> Iterator[None]:
        """Count the topics held into `into`, a slice per step (loads.py)."""
        return self.accounting.census(into)

    def topic_coord(self, topic: str) -> Coord | None:
        return self.accounting.topic_coord(topic)

    def primary_topics(self) -> dict[str, int]:
        return self.accounting.primary_topics()

    def topic_triple(self, topic: str) -> tuple[str, str, str]:
        return self.accounting.topic_triple(topic)

    def load_record(self) -> NodeLoad:
        return self.accounting.load_record()

    def loads(self) -> dict[str, int]:
        return self.accounting.loads()

    def tertiary_notes(self) -> dict[str, tuple[NodeInfo, list[tuple[str, str, str]], list[float]]]:
        return self.accounting.tertiary_notes()
