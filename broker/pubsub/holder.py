"""The holder role: requests that reach the broker closest to a topic's coordinate, and serving them.

The broker closest to C(t) is the topic's primary (Sec. I-A).  It stores each message, has it copied to the
secondary (replication.py), and once the copy is confirmed (`commit`) delivers it to the subscribers and
acknowledges it to the publisher.  Requests for a topic whose replica is WAITING (a pull, a placement or a
move under way) are queued on the replica and served when it is done.  Requests that reach a broker that is
not the primary go where the topic lives: the home forwards to the delegate coordinate (Sec. III-B), a former
primary to the new one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from broker.acl import refusal
from broker.memory import human_bytes
from broker.pubsub.core import TopicTable, same
from broker.pubsub.replica import CopyStage, Replica, Stage, Transition, Waiting, held_list, journal_list
from broker.pubsub.settings import EMPTY_TOPIC_SWEEP, MEMORY_CHECK
from broker.storage import StorageError, TopicMeta
from broker.store import TS_EPSILON
from broker.sweep import Sweep
from overlay.delegation import MoveTopic, TopicMoved
from overlay.geometry import Coord
from overlay.protocol import Message, NodeInfo, RemoteProtocolError, decode_message, encode_message
from overlay.pubsub import (
    MAX_BATCH_BYTES,
    SUBSCRIBED_TABLE_MAX,
    Ack,
    Delegation,
    Done,
    Failed,
    Fetch,
    Fetched,
    Locate,
    Located,
    Nack,
    Publish,
    Record,
    SessionGone,
    SessionRequests,
    SubRef,
    Subscribe,
    Subscribed,
    TopicRequest,
    Unsubscribe,
    later,
)

if TYPE_CHECKING:
    from broker.pubsub.access import AccessRole
    from broker.pubsub.home import HomeRole
    from broker.pubsub.moves import MoveRole
    from broker.pubsub.ranks import RankRole
    from broker.pubsub.replication import ReplicationRole
    from broker.pubsub.sync import SyncRole

log = logging.getLogger("sedax.pubsub")


def _ts(rec: Record) -> float:
    return rec.ts


def _holds_nothing(r: Replica) -> bool:
    """No record kept, no publisher remembered (nor one forgotten or refused: its return must not count as a
    loss, TopicLog.forgotten), no subscriber: what a broker may forget of a topic without losing anything."""
    log_ = r.log
    return not (log_.rows or log_.last_seq or log_.forgotten or r.subscribers)


class HolderRole:
    """Requests at the topic's holders (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        # Wired by the engine.
        self.access: AccessRole
        self.replication: ReplicationRole
        self.sync: SyncRole
        self.ranks: RankRole
        self.moves: MoveRole
        self.home: HomeRole
        # Looks at every topic for `sweep_empty`, a slice per tick, each at least twice per EMPTY_TOPIC_SWEEP.
        self._empty_sweep: Sweep[str] = Sweep(EMPTY_TOPIC_SWEEP / 2)
        self._memory_at = 0.0  # the next check_memory

    def replica(self, topic: str, coord: Coord | None = None) -> Replica:
        """The topic's replica here, made (HOLDING or SERVING by rank) if this broker held none."""
        r = self.t.replicas.get(topic)
        if r is None:
            home = self.t.home(topic)
            at = coord if coord is not None else home
            # The list this copy keeps is known before its meta.json is written: one write (`Replica.place` wrote
            # it a second time for a moved topic's new copy).
            own = held_list(at, list(self.home.delegate_lists.get(topic, ())), home)
            log_ = self.t.store.ensure(topic, at, home, journal_list(own))
            r = Replica(topic, log_, at, home, own)
            self.t.rerank(r)
            r.settle()
            self.t.hold(r)
        return r

    def topic_request_arrived(self, msg: TopicRequest) -> None:
        """TOPIC_REQUEST: the requests it carries, session by session, one by one."""
        access, dest, via_home = msg.access, msg.dest, msg.via_home
        for session, identity, requests in msg.batches:
            for raw in requests:
                try:
                    inner = decode_message(raw)
                except RemoteProtocolError as exc:
                    log.warning("dropping a topic request with a bad inner message: %s", exc)
                    continue
                self.handle_request(access, session, inner, dest, via_home, identity)

    def handle_request(
        self,
        access: NodeInfo,
        session: str,
        req: Message,
        dest: Coord | None = None,
        via_home: bool = False,
        identity: str = "",
    ) -> None:
        topic = getattr(req, "topic", None)
        if not isinstance(topic, str):
            log.warning("dropping a topic request without a topic: %s", req.op)
            return
        # The first holder enforces the ACL, whatever the access broker did; requests it forwards (home to
        # delegate, old primary to new) travel between authenticated brokers and are not checked again.
        acl = None if via_home else self.t.config.acl
        if acl is not None and (denied := refusal(acl, identity, req, "holder")) is not None:
            if not (type(req) is Subscribe and not req.corr):  # (a registration again wants no answer: `serve`)
                self.t.reply(access, [session], denied)
            return
        if self.ranks.pending:
            self.ranks.settle(topic)  # (a view change's walk has not reached it yet: RankRole.view_changed)
        r = self.t.replicas.get(topic)
        if r is not None and r.waits:
            r.queued.append((access, session, req))  # served once the hand-over, pull or placement is done
            return
        if r is not None and r.rank == 1:
            if dest is not None and not same(dest, r.coord):
                self.redirect(access, [session], topic, r.coord)
            self.serve(r, access, session, req)
            return
        home = self.t.home(topic)
        me_home = self.t.closest_id(home) == self.t.ov.me.id
        dl = self.home.delegate_lists.get(topic)
        if me_home and dl and not same(dl[-1].coord, home) and self.t.closest_id(dl[-1].coord) != self.t.ov.me.id:
            # Sec. III-B: the home forwards to the delegate coordinate C(t) and the client learns it.
            self.forward_request(access, session, req, dl[-1].coord, via_home=True)
            return
        fwd = self.moves.forwarded_to(topic)
        if fwd is not None:
            self.forward_request(access, session, req, fwd, via_home=True)
            return
        if not me_home and not via_home and dest is not None and not same(dest, home):
            # Addressed to a delegate coordinate whose holders are gone or never were: the home knows.
            self.forward_request(access, session, req, home, via_home=False, identity=identity)
            return
        at = dest if (via_home and dest is not None and not me_home) else home
        r = self.replica(topic, at)
        if r.rank != 1 and not same(r.coord, at):
            # A copy held here for another coordinate: the topic lives there.  (This broker is, say, the home and
            # also the delegate's secondary, and the home's delegate list, kept in memory, did not survive a full
            # restart.)  It used to serve the request on the copy: a PUBLISH stored there was never acknowledged.
            self.forward_request(access, session, req, r.coord, via_home=True)
            return
        if self.sync.start_pull(r, takeover=False):
            r.queued.append((access, session, req))  # served once the previous holders answered
            return
        if isinstance(req, (Publish, Subscribe)) and self.home.maybe_place(r):
            r.queued.append((access, session, req))  # a new topic: Alg. 1 decides where it lives first
            return
        self.serve(r, access, session, req)

    def forward_request(
        self, access: NodeInfo, session: str, req: Message, coord: Coord, *, via_home: bool, identity: str = ""
    ) -> None:
        self.t.counters["forwarded_requests"] += 1
        batch = (SessionRequests(session, identity, (encode_message(req),)),)
        msg = TopicRequest(access, batch, via_home=via_home, dest=coord)
        self.t.ov.route(coord, msg)
        if via_home:
            self.redirect(access, [session], getattr(req, "topic", ""), coord)

    def redirect(self, access: NodeInfo, sessions: list[str], topic: str, coord: Coord) -> None:
        msg = TopicMoved(access.id, tuple(sessions), topic, coord)
        if access.id == self.t.ov.me.id:
            self.access.topic_moved_arrived(msg)
        else:
            self.t.ov.route(access.coord, msg)

    def release_queue(self, r: Replica) -> None:
        """Serve (or pass on) the requests that waited while r was WAITING."""
        queued, r.queued = r.queued, []
        for access, session, req in queued:
            if self.t.replicas.get(r.name) is r and r.rank == 1 and not r.waits:
                self.serve(r, access, session, req)
            else:
                self.handle_request(access, session, req, r.coord, True)

    def serve(self, r: Replica, access: NodeInfo, session: str, req: Message) -> None:
        match req:
            case Publish():
                self._publish(r, access, session, req)
            case Subscribe():
                # corr 0: the access broker registering its session again at a new N1 (access `view_changed`);
                # nobody waits for an answer, and the subscription fetches what it lacks itself.
                key = (access.id, session)
                if key not in r.subscribers and (text := self._full(r)):
                    if req.corr:
                        self.t.reply(access, [session], Failed(req.corr, r.name, "topic_full", text))
                    return
                r.subscribers[key] = SubRef(access, session)
                r.meta_dirty = True
                if not req.corr:
                    self.t.mark(r)
                    return
                if req.since is not None:
                    self.t.deliver_to([SubRef(access, session)], r.name, list(r.log.since(req.since)))
                # The publisher table, for a subscription from now: what the subscriber is owed of each publisher.
                table = r.log.last_seq
                known = req.since is None and not r.log.forgotten and len(table) <= SUBSCRIBED_TABLE_MAX
                ok = Subscribed(req.corr, r.name, r.coord, r.last_ts, dict(table) if known else {}, known)
                self.t.reply(access, [session], ok)
                self.t.mark(r)
            case Unsubscribe():
                if r.subscribers.pop((access.id, session), None) is None:
                    if req.corr:
                        self.t.reply(
                            access,
                            [session],
                            Failed(req.corr, r.name, "not_subscribed", f"not subscribed to {r.name!r}"),
                        )
                    return
                r.meta_dirty = True
                if req.corr:
                    self.t.reply(access, [session], Done(req.corr))
                self.t.mark(r)
            case Fetch():
                if not r.log.rows and not r.log.last_seq and not r.subscribers:
                    self.forget_if_empty(r)
                    self.t.reply(
                        access,
                        [session],
                        Failed(req.corr, r.name, "unknown_topic", f"no broker holds messages of {r.name!r}"),
                    )
                    return
                recs = r.log.since(req.since, req.limit + 1)
                more = len(recs) > req.limit
                out: list[Record] = []
                size = 0
                for m in recs[: req.limit]:
                    size += len(m.payload)
                    if out and size > MAX_BATCH_BYTES:
                        more = True
                        break
                    out.append(m)
                self.t.reply(access, [session], Fetched(req.corr, r.name, tuple(out), more, self.t.config.resilience))
            case MoveTopic():
                if not r.log.rows and not r.log.last_seq and not r.subscribers:
                    # Nothing to move: a typo must not be reported as moved, nor leave an empty replica here.
                    self.forget_if_empty(r)
                    text = f"no broker holds topic {r.name!r}; publish to it first"
                    self.t.reply(access, [session], Failed(req.corr, r.name, "unknown_topic", text))
                    return
                self.moves.request_move(r.name, req.to, reply=(access, session, req.corr), force=True)
            case Locate():
                ranked = self.t.ranked(r.coord)
                self.t.reply(
                    access,
                    [session],
                    Located(
                        req.corr,
                        r.name,
                        r.home,
                        r.coord,
                        ranked[0],
                        ranked[1] if len(ranked) > 1 else None,
                        ranked[2] if len(ranked) > 2 and self.t.config.resilience >= 3 else None,
                        tuple(self.home.delegate_lists.get(r.name) or r.delegates),
                        r.log.size,
                        len(r.subscribers),
                    ),
                )
                self.forget_if_empty(r)
            case _:
                log.warning("dropping unexpected topic request %s", req.op)

    def _full(self, r: Replica) -> str:
        """Why r takes no new subscriber or publisher (counted), or "" while it has room: its subscriber list and
        publisher table travel in one frame between brokers (overlay.pubsub.MAX_TOPIC_ENTRIES)."""
        n, limit = len(r.subscribers) + len(r.log.last_seq), self.t.config.max_topic_entries
        if n < limit:
            return ""
        self.t.counters["topic_full"] += 1
        return (
            f"topic {r.name!r} has {len(r.subscribers)} subscribers and {len(r.log.last_seq)} publishers, the most "
            f"one topic holds ({limit}, --max-topic-entries): use narrower topics (one per feeder, say), or try "
            "again once some have gone (a publisher is forgotten a day after its last message, once its messages "
            "expired)"
        )

    def forget_if_empty(self, r: Replica) -> None:
        # A FETCH or LOCATE of a topic nobody published to must not create state that lingers.
        if _holds_nothing(r) and not r.waiting:
            self.t.drop(r)

    def check_memory(self, now: float) -> None:
        """Every MEMORY_CHECK: are the stored messages over --max-memory?  Then new publishes are refused
        (`publish_checked`) and so are copies of new messages (replication `_take`), until retention frees room.
        What is already stored, and what membership changes bring (syncs, hand-overs), is always taken: it was
        acknowledged."""
        cap = self.t.config.max_memory
        if not cap or now < self._memory_at:
            return
        self._memory_at = now + MEMORY_CHECK
        used = self.t.store.memory()
        if used > cap and not self.t.full:
            self.t.full = (
                f"this broker's stored messages take {human_bytes(used)} of memory, more than its --max-memory "
                f"({human_bytes(cap)}): lower --retention-bytes/--retention-seconds, raise --max-memory or add "
                "brokers"
            )
            log.warning("%s; new publishes are refused (storage_full) until retention frees room", self.t.full)
        elif used <= cap and self.t.full:
            self.t.full = ""
            log.warning("stored messages take %s, within --max-memory again: publishes are taken", human_bytes(used))

    def sweep_empty(self, now: float) -> None:
        """Forget the replicas that every look for EMPTY_TOPIC_SWEEP found empty (`Replica.empty_since`): the
        first look that finds one empty marks it, a look that does not unmarks it, a look EMPTY_TOPIC_SWEEP or
        more after the mark forgets it.  Each replica is looked at a slice per tick (broker/sweep.py), at least
        twice per EMPTY_TOPIC_SWEEP: one look at all of them stalled a broker of 100,000 topics for ~0.1 s.

        Each holder looks on its own clock, as it forgets idle publishers: a copy forgotten just before its
        primary takes a new subscriber is made again by the next batch, which carries the meta (a new
        secondary is given it), and a primary forgotten before a new request makes it again, as it made it
        the first time.  The primary waits until its copies confirmed the meta that emptied the topic, so a
        copy never keeps a subscriber its primary forgot.
        """
        replicas = self.t.replicas
        for name in self._empty_sweep.take(replicas, now):
            if (r := replicas.get(name)) is None:
                continue
            if not self._empty_here(r):
                r.empty_since = -1.0
            elif r.empty_since < 0:
                r.empty_since = now
            elif now - r.empty_since >= EMPTY_TOPIC_SWEEP:
                self.t.drop(r)
                self.t.counters["empty_forgotten"] += 1
                log.debug("topic %s: forgotten, nothing in it for %.0f s", name, now - r.empty_since)

    def _empty_here(self, r: Replica) -> bool:
        """Nothing in r (`_holds_nothing`), nothing waiting, being copied or under way; and at its home, never
        moved (a delegated topic's home keeps its list, and the delegate must stay where that list points)."""
        if not _holds_nothing(r):
            return False
        if r.stage is not Stage.SERVING and r.stage is not Stage.HOLDING:
            return False
        if r.waiting or r.outbox or r.window or r.undelivered or r.queued or r.offers or r.meta_dirty:
            return False
        if r.copy.stage is CopyStage.OFFERED or r.copy.stage is CopyStage.OFFERED_WANTED:
            return False
        if r.rank == 1 and not r.meta_confirmed and r.copy.stage is not CopyStage.ALONE:
            return False  # the copies may still list a subscriber: wait for the batch that told them
        return same(r.coord, r.home) and len(r.delegates) <= 1 and r.name not in self.home.delegate_lists

    def session_gone_arrived(self, m: SessionGone) -> None:
        """SESSION_GONE: an access broker lost a subscriber's session; stop delivering to it."""
        r = self.t.replicas.get(m.topic)
        if r is not None and r.subscribers.pop((m.access, m.session), None) is not None:
            r.meta_dirty = True
            self.t.mark(r)

    # ---- publishing ------------------------------------------------------------------------------------
    def publish_checked(self, r: Replica, access: NodeInfo, session: str, p: Publish) -> None:
        """A PUBLISH for r, served here as the primary, already checked (a local client's on arrival, another
        access broker's in `_publish`)."""
        seq = p.seq
        if (r.copy_refused or self.t.full) and seq > r.log.last_seq.get(p.publisher, -1):
            # A copy's disk is full (replication `copy_refused`), or this broker's memory (`check_memory`):
            # refused before it is stored, as a full disk here refuses it; re-sends of what is stored still wait
            # for their acknowledgement.
            self._refuse_from(r, p.publisher, seq)
            why = r.copy_refused or f"not stored: {self.t.full}"
            self.t.reply(access, [session], Nack(r.name, p.publisher, seq, "storage_full", why))
            return
        if not p.more:
            self._publish_one(r, access, session, p.publisher, seq, p.payload, p.base)
            return
        if r.log.last_seq.get(p.publisher, -2) == seq - 1 and not r.log.writes_each:
            self._publish_run(r, access, session, p.publisher, seq, p.payloads())
            return
        for payload in p.payloads():
            if not self._publish_one(r, access, session, p.publisher, seq, payload, p.base):
                break  # out of order: the publisher re-sends from the expected number, the rest with it
            seq += 1

    def _publish(self, r: Replica, access: NodeInfo, session: str, p: Publish) -> None:
        # A local client's publish was checked on arrival (client_message); one from another access broker
        # is checked here, once.
        if access.id != self.t.ov.me.id and (refusal_ := self.access.check_publish(p)):
            self.t.reply(access, [session], refusal_)
            return
        self.publish_checked(r, access, session, p)

    def _publish_one(
        self, r: Replica, access: NodeInfo, session: str, publisher: str, seq: int, payload: bytes, base: int
    ) -> bool:
        """Store one message (or re-acknowledge a duplicate); False if it is out of order or refused."""
        last = r.log.last_seq.get(publisher, -1)
        if last < 0 and publisher not in r.log.last_seq and (text := self._full(r)):
            r.log.mark_forgotten(publisher)  # (when it is let in later, what it sent meanwhile was not lost)
            self.t.reply(access, [session], Nack(r.name, publisher, seq, "topic_full", text))
            return False
        if seq <= last:
            # A re-send (its acknowledgement was lost, or it is still on its way to the replica).
            self.t.counters["duplicates"] += 1
            first = r.first_waiting.get(publisher)
            if first is None or seq < first:
                if r.recopying:
                    # A re-send after a take-over: the dead primary may not have acknowledged it, and the new
                    # secondary has it once the batch re-copying the last moments is confirmed (sync
                    # `redeliver`); acknowledged with the batch that covers everything stored so far.
                    self._wait(r, Record(r.last_ts, publisher, seq, b""), access, session)
                    self.t.mark(r)
                    return True
                self.t.reply(access, [session], Ack(r.name, publisher, seq, 0.0))  # stored and safe already
                return True
            key = (access.id, session, publisher)
            if r.waiter_max.get(key, -1) < seq:  # a new asker (e.g. after a reconnect): answer with the batch
                self._wait(r, Record(r.last_ts, publisher, seq, b""), access, session)
            return True
        if seq > last + 1 and base > last + 1:
            if last < 0 and publisher in r.log.forgotten:
                # A publisher forgotten after a day of silence (its messages expired) or refused while the topic
                # was full: nothing of it is missing here, its sequence goes on where it is.
                del r.log.forgotten[publisher]
            elif r.refused_from.get(publisher, -1) == last + 1:
                # This broker refused them (storage_full): the publisher was told, nothing acknowledged is missing.
                del r.refused_from[publisher]
            else:
                # The publisher had [last + 1, base) acknowledged, yet this broker never got them: they were lost
                # with a failed broker (resilience level 1, or more failures than the level survives).  Count and
                # log the loss, then continue the sequence after it so subscribers see the gap.
                lost = base - last - 1
                self.t.counters["lost"] += lost
                log.warning(
                    "topic %s: %d acknowledged message(s) of publisher %s before seq %d are lost", r.name, lost,
                    publisher, base,
                )  # fmt: skip
            last = base - 1
            r.log.last_seq[publisher] = last
            r.meta_dirty = True  # a publisher table entry no record carries: the secondary needs the table
        if seq > last + 1:
            # Earlier messages are still on their way or were dropped in a failover: the publisher has them.
            self.t.reply(
                access,
                [session],
                Nack(r.name, publisher, seq, "out_of_order", f"expected seq {last + 1} first", last + 1),
            )
            return False
        now = self.t.ov.now()
        ts = max(now, r.last_ts + TS_EPSILON)
        r.last_ts = ts
        rec = Record(ts, publisher, seq, payload)
        r.log.append(rec, now)
        self.t.counters["published"] += 1
        self.t.counters["published_bytes"] += len(payload)
        self._wait(r, rec, access, session)
        r.undelivered.append(rec)
        r.outbox.append(rec)
        self.t.mark(r)
        return True

    def _publish_run(
        self, r: Replica, access: NodeInfo, session: str, publisher: str, seq: int, payloads: tuple[bytes, ...]
    ) -> None:
        """A batch that follows the publisher's last stored message (the common case: nothing re-sent, nothing
        out of order, a publisher the topic knows): stored as `_publish_one` stores each of them, in one pass."""
        now = self.t.ov.now()
        ts = max(now, r.last_ts + TS_EPSILON)
        recs = [Record(ts + i * TS_EPSILON, publisher, seq + i, x) for i, x in enumerate(payloads)]
        r.last_ts = recs[-1].ts
        r.log.append_run(recs, now)
        self.t.counters["published"] += len(recs)
        self.t.counters["published_bytes"] += sum([len(x) for x in payloads])
        r.waiting += [Waiting(rec, access, session) for rec in recs]
        r.first_waiting.setdefault(publisher, seq)
        key = (access.id, session, publisher)
        if r.waiter_max.get(key, -1) < recs[-1].seq:
            r.waiter_max[key] = recs[-1].seq
        r.undelivered += recs
        r.outbox += recs
        self.t.mark(r)

    @staticmethod
    def _keep_waiting(r: Replica, waiting: list[Waiting]) -> None:
        """Replace r's waiting publishes, and rebuild the indexes over them."""
        r.waiting = waiting
        r.first_waiting.clear()
        r.waiter_max.clear()
        for w in waiting:
            r.first_waiting.setdefault(w.record.publisher, w.record.seq)
            key = (w.access.id, w.session, w.record.publisher)
            r.waiter_max[key] = max(r.waiter_max.get(key, -1), w.record.seq)

    def persist(self, r: Replica) -> StorageError | None:
        """Write what r stored since the last call to its disk journal before anything of it is acknowledged
        or confirmed; a full disk (or a failed write) refuses those publishes (storage_full) and they leave
        memory too (returned: None if everything was written)."""
        try:
            r.log.persist()
        except StorageError as exc:
            self._refuse(r, exc)
            return exc
        return None

    def await_disk(self, r: Replica) -> None:
        """Under always/batch, what r stored so far is acknowledged only once the sync covering it completed
        (group commit off the loop: broker/storage/commit.py); a failed sync refuses it like a full disk."""
        if not (r.waiting or r.undelivered) or not r.log.waits_for_disk:
            return
        mark = r.last_ts

        def on_disk(exc: StorageError | None) -> None:
            if exc is not None:
                self._refuse(r, exc)
            elif self.t.replicas.get(r.name) is r:
                r.synced_upto = max(r.synced_upto, mark)
                self.commit(r, r.confirmed_upto)

        r.log.when_durable(on_disk)

    def merged(self, r: Replica, recs: list[Record]) -> None:
        """Records another holder had and this serving primary lacked (the other side of a healed partition):
        its subscribers never got them, so they go out like new ones, in timestamp order, once the secondary
        and the disk hold them (`commit`).  Subscribers that had some already drop them by (publisher, seq);
        the client also fetches what it finds missing behind a gap in a publisher's sequence."""
        r.outbox.extend(recs)
        r.undelivered = sorted([*r.undelivered, *recs], key=_ts)
        self.t.mark(r)

    def _refuse(self, r: Replica, exc: StorageError) -> None:
        """Records the disk did not take (exc.lost, already out of memory): their publishers get storage_full."""
        log.warning("topic %s: %s", r.name, exc)
        lost = exc.lost
        refused = [w for w in r.waiting if (w.record.publisher, w.record.seq) in lost]
        self._keep_waiting(r, [w for w in r.waiting if (w.record.publisher, w.record.seq) not in lost])
        r.undelivered = [x for x in r.undelivered if (x.publisher, x.seq) not in lost]
        r.outbox = [x for x in r.outbox if (x.publisher, x.seq) not in lost]
        first: dict[tuple[str, str, str], Waiting] = {}
        for w in refused:
            key = (w.access.id, w.session, w.record.publisher)
            if key not in first or w.record.seq < first[key].record.seq:
                first[key] = w
        for w in first.values():
            self._refuse_from(r, w.record.publisher, w.record.seq)
            nack = Nack(r.name, w.record.publisher, w.record.seq, "storage_full", str(exc))
            self.t.reply(w.access, [w.session], nack)

    def _refuse_from(self, r: Replica, publisher: str, seq: int) -> None:
        """Note that publisher's messages from seq on were refused (storage_full), not stored: the client fails
        them and goes on past them, and its next message, with `base` past them, is no loss (`_publish_one`)."""
        if seq < r.refused_from.get(publisher, seq + 1):
            r.refused_from[publisher] = seq

    def recovered(self, metas: list[TopicMeta]) -> None:
        """Replicas for the topics read back from the data directory: RECOVERING until `resume`.  Each comes back
        at the coordinate its meta.json names, or where the later of its own delegate list and the home's says
        the topic lives (a copy a move left behind, whose RELEASE was lost with the restart)."""
        for meta in metas:
            own = [Delegation(c, start) for c, start in meta.delegates] or [Delegation(meta.home, 0.0)]
            dl, coord = own, meta.coord
            if (kept := self.home.delegate_lists.get(meta.name)) and later(kept, own):
                dl, coord = list(kept), kept[-1].coord
            r = Replica(meta.name, self.t.store.get(meta.name), meta.coord, meta.home, own, stage=Stage.RECOVERING)
            r.place(coord, dl)
            if (newest := r.log.last_ts) is not None:
                r.last_ts = newest
            self.t.hold(r)

    def resume(self) -> None:
        """The broker joined: each recovered topic syncs (primary), holds (copy) or goes (neither)."""
        for r in [x for x in self.t.replicas.values() if x.stage is Stage.RECOVERING]:
            self.t.rerank(r)
            if r.rank == 1:
                r.copy.want()  # the secondary gets the whole merged history
                if len(r.delegates) > 1 and not same(r.coord, r.home):
                    # A moved topic: the home may have lost its list (a broker new at h(t), or one started
                    # without its data directory) and made the topic afresh at h(t), or know a later one that
                    # this copy missed; either way the two follow the later list (home.py `_store`).
                    self.home.set_delegates(r.name, r.delegates)
                if not self.sync.start_pull(r, takeover=False):
                    r.enter(Transition.CAUGHT_UP)
                    self.release_queue(r)
                    self.replication.flush(r)
            elif self.ranks.keeps(r.rank):
                r.enter(Transition.DEMOTE)
                self.release_queue(r)
                # It may hold what the primary lacks (everything was stopped and started again): offer it, again
                # after each time-out until the primary answers.  Offered once, an offer lost while the overlay
                # formed around this broker was never repeated: a copy a move left behind, told by the home's answer
                # where the topic lives, stayed at the old coordinate for good.
                self.sync.offer(r, self.t.holders(r.coord)[:1])
            else:
                self.sync.retire(r)  # what it kept may be all that is left of some records: hand it on

    @staticmethod
    def _wait(r: Replica, rec: Record, access: NodeInfo, session: str) -> None:
        r.waiting.append(Waiting(rec, access, session))
        r.first_waiting.setdefault(rec.publisher, rec.seq)
        key = (access.id, session, rec.publisher)
        if r.waiter_max.get(key, -1) < rec.seq:  # (per message: a comparison, not a call of max())
            r.waiter_max[key] = rec.seq

    def commit(self, r: Replica, upto: float) -> None:
        """Messages stored up to timestamp upto have their copies: deliver and acknowledge, in order, those that
        are also on this broker's disk as the write policy promises (`await_disk`)."""
        if r.stage in (Stage.RECEIVING, Stage.HANDING_OVER):
            return  # a hand-over in progress: one node acknowledges and delivers, the one that ends up primary
        r.confirmed_upto = max(r.confirmed_upto, upto)
        if r.log.waits_for_disk:
            upto = min(r.confirmed_upto, r.synced_upto)  # and on this broker's disk (await_disk)
        # Both lists are in timestamp order: nothing due is found without a scan (commit runs twice per turn
        # under always/batch, once for the copies and once for the disk), and what is due is a prefix - all of
        # it whenever nothing waits for a copy (resilience 1), taken without a test per record.
        waiting, undelivered = r.waiting, r.undelivered
        if (not waiting or waiting[0].record.ts > upto) and (not undelivered or undelivered[0].ts > upto):
            return
        if waiting and waiting[-1].record.ts <= upto:
            done = waiting
            r.waiting = []
            r.first_waiting.clear()
            r.waiter_max.clear()
        else:
            done = [w for w in waiting if w.record.ts <= upto]
            if done:
                self._keep_waiting(r, waiting[len(done) :])
        if done:
            upto = done[-1].record.ts
        if undelivered and undelivered[-1].ts <= upto:
            deliver, r.undelivered = undelivered, []
        else:
            deliver = [x for x in undelivered if x.ts <= upto]
            r.undelivered = undelivered[len(deliver) :]
        # Deliveries are written before the acknowledgements of the same commit: both are safe now, and a
        # subscriber's frame should not wait behind the system calls of the ACK writes (a lone message's
        # publish -> deliver latency).
        if deliver and r.subscribers:
            self.t.deliver_to(r.subscribers.values(), r.name, deliver)
        if not done:
            return
        # ACK is cumulative per publisher: one answers everything a session published in this batch.
        if len(done) == 1:  # one message this turn (a device's lone publish): no grouping to do
            w = done[0]
            rec = w.record
            self.t.reply(w.access, [w.session], Ack(r.name, rec.publisher, rec.seq, rec.ts))
            self.t.counters["acked"] += 1
            return
        last: dict[tuple[str, str, str], tuple[Waiting, Record]] = {}
        for w in done:
            key = (w.access.id, w.session, w.record.publisher)
            if key not in last or w.record.seq > last[key][1].seq:
                last[key] = (w, w.record)
        for w, rec in last.values():
            self.t.reply(w.access, [w.session], Ack(r.name, rec.publisher, rec.seq, rec.ts))
        self.t.counters["acked"] += len(done)
