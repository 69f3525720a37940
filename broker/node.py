"""The SeDAX broker: one process, one port, links to exactly its Delaunay neighbours, greedy forwarding.

Overlay maintenance (see docs/protocol.md for the message sequences):

* Join: the newcomer connects to a bootstrap broker as a client and sends JOIN; the bootstrap routes it to
  the newcomer's own coordinate, so the closest live broker answers (JOIN_ACCEPT with its view, or REFUSE
  for a duplicate coordinate); the answer is routed back to the bootstrap's coordinate and handed over.
* Every broker links to its desired neighbours (`NeighbourView.desired`: Delaunay neighbours of itself among
  everything it knows) and advertises that set (NEIGHBOURS) whenever it changes.  A link is kept while
  either end wants it, so an edge disappears only when both ends agree it is not Delaunay.
* Failure (EOF, reset, heartbeat timeout) or LEAVE: the node is forgotten and tombstoned, its former
  neighbours become candidates and the survivors re-link around the hole.

Greedy forwarding reads only the ROUTED header; bodies are decoded by the broker that delivers them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Final

from broker.balancer import Balancer
from broker.config import BrokerConfig
from broker.eventlog import EventLog
from broker.guard import Guard
from broker.link import CloseReason, HandshakeRefused, LinkClosed, PeerLink
from broker.memory import HeapTrimmer
from broker.metrics import MetricsServer
from broker.pubsub import PubSub, PubSubConfig
from broker.routing import DispatchTable
from broker.stats import BrokerStats, Gauges
from broker.storage import DiskStore
from broker.store import Retention, TopicStore
from broker.tasks import TaskSet
from broker.tls import Listener
from net.credentials import connect_broker, peer_cert
from net.transport import StreamTransport, Transport
from overlay.delegation import BalancePlan, BalancePlanned, CoordOffer, CoordQuery, LoadReport, MoveTopic
from overlay.dt import NeighbourView
from overlay.geometry import MIN_SITE_SEPARATION, distance
from overlay.protocol import (
    FLAG_TRACE,
    MAX_CORR,
    PROTOCOL_VERSION,
    Coord,
    Error,
    Hello,
    HelloOk,
    Join,
    JoinAccept,
    Leave,
    Message,
    Neighbours,
    NodeInfo,
    Ping,
    Refuse,
    RemoteProtocolError,
    RoutedFrame,
    RouteProbe,
    RouteReply,
    Status,
    StatusReq,
    TopicHeld,
    Unlink,
    decode_message,
    encode_control,
    encode_message,
    encode_routed,
    format_address,
    forward_routed,
    parse_address,
)
from overlay.pubsub import Fetch, Locate, Publish, Subscribe, Unsubscribe

# Requests this broker relays for its clients (route probes, joins) and waits on; beyond this many a client
# gets "busy" rather than the broker growing without bound when replies are lost.
MAX_PENDING: Final = 65536
# Hop-limit drops are logged once per this many so a routing loop cannot flood the log.
DROP_LOG_EVERY: Final = 1000
# Write-buffer level above which a batch's reader waits for the next hop to drain (see PeerLink.drain).
FLUSH_THRESHOLD: Final = 256 * 1024
# How often the pub/sub layer's timers run (replication and pull time-outs, retention); a tenth of the
# replication time-out, so a lost replica is noticed within ~0.05 s of its deadline.
PUBSUB_TICK: Final = 0.05


class JoinRefused(Exception):
    """The overlay refused this broker (duplicate coordinate, coordinate outside the space, ...)."""

    def __init__(self, code: str, text: str, via: str) -> None:
        super().__init__(f"join refused ({code}) via {via}: {text}")
        self.code = code
        self.text = text
        self.via = via


class JoinFailed(ConnectionError):
    """No join address answered; start the first broker without --join or check the addresses."""


class StartFailed(RuntimeError):
    """The broker could not open its metrics endpoint or its log; the message says which and why."""


class Broker:
    """A broker process's state and behaviour; the `LinkHandler` of all its links."""

    def __init__(self, config: BrokerConfig, log: logging.Logger | None = None) -> None:
        """Raises ConfigError if the security settings are missing or unusable (see broker.guard)."""
        self.config = config
        self.log = log or logging.getLogger("sedax.broker")
        self.guard = Guard(config, self.log)
        self.node_id = config.node_id or self.guard.name or f"b-{uuid.uuid4().hex[:12]}"
        self.tasks = TaskSet(self.log)
        self.info = NodeInfo(self.node_id, config.coord, "0.0.0.0:0")
        self.view = NeighbourView(self.info)
        self.peers: dict[str, PeerLink] = {}
        self.links: set[PeerLink] = set()
        self.stats = BrokerStats()
        self._dialing: dict[str, asyncio.Task[None]] = {}
        self._advertised: frozenset[str] = frozenset()
        self._pending: dict[int, tuple[PeerLink, int]] = {}
        self._corr = itertools.count(1)
        self._dirty: set[PeerLink] = set()
        self._congested: set[PeerLink] = set()
        self._reconcile_handle: asyncio.Handle | None = None
        self._listener: Listener | None = None
        self._closing = False
        self._peer_up = asyncio.Event()
        # Client sessions (pub/sub) by id; ids carry a per-process prefix so a restarted broker with the same
        # node id never mistakes an old subscription for a new session.
        self._session_prefix = secrets.token_hex(3)
        self._session_ids = itertools.count(1)
        self.sessions: dict[str, PeerLink] = {}
        self._session_of: dict[PeerLink, str] = {}
        self._known_ids: frozenset[str] = frozenset()
        self._failed_since_view: set[str] = set()
        self.port = _PubSubPort(self)
        retention = Retention(config.retention_seconds, config.retention_bytes)
        disk = DiskStore(Path(config.data_dir), config.fsync_policy) if config.on_disk and config.data_dir else None
        self.pubsub = PubSub(
            self.port,
            PubSubConfig(
                resilience=config.resilience,
                retention=retention,
                move_cooldown=config.move_cooldown,
                space=config.space,
                note_ttl=3 * config.load_report_interval + 1.0,
                acl=self.guard.acl,
            ),
            TopicStore(retention, disk),
        )
        self.trimmer = HeapTrimmer()
        # Observability (docs/metrics.md, docs/logs.md): the endpoint and the log are opened in start().
        self.metrics: MetricsServer | None = None
        self.eventlog: EventLog | None = None
        self.pubsub.event = self.event
        self.balancer = Balancer(self.port, self.pubsub, config, self.tasks, self.log)
        self.routes = DispatchTable()
        self._hops = 0  # hops of the routed message being handled (a ROUTE_REPLY reports them)
        self._register_routes()

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the listening socket; afterwards `info.listen` holds the real port."""
        host, port = parse_address(self.config.listen)
        tls = self.guard.tls
        self._listener = Listener(
            tls.server if tls is not None else None,
            self.config.hello_timeout,
            self._on_stream,
            lambda handshaking: not self._closing and self.guard.may_accept(len(self.links), handshaking),
            self.tasks,
            self.log,
        )
        bound = await self._listener.start(host, port)
        listen = self.config.advertise or format_address(host, bound)
        self.info = NodeInfo(self.node_id, self.config.coord, listen)
        self.view = NeighbourView(self.info)
        self.port.refresh()
        try:
            report = self.pubsub.recover()
        except OSError as exc:
            raise StartFailed(f"cannot read the data directory {self.config.data_dir}: {exc}") from None
        if self.config.on_disk:
            self.log.info("data directory %s (fsync %s): %s", self.config.data_dir, self.config.fsync, report)
        if not self.config.join:
            self.pubsub.resume()  # the first broker: nobody to compare the recovered topics with
        self.tasks.spawn(self._pubsub_ticker(), "pubsub-tick")
        self.balancer.start(self._now)
        await self._start_observability()
        self.log.info("listening on %s at (%s, %s) as %s", listen, *self.info.coord, self.node_id)

    def _new_link(self, transport: Transport, *, outbound: bool) -> PeerLink:
        c = self.config
        link = PeerLink(
            transport,
            self,
            self.tasks,
            self.log,
            outbound=outbound,
            heartbeat_interval=c.heartbeat_interval,
            heartbeat_misses=c.heartbeat_misses,
            hello_timeout=c.hello_timeout,
            drain_timeout=c.drain_timeout,
            client_timeout=c.client_timeout,
        )
        if not outbound:
            # Until it proves to be a broker, a peer gets the client frame limit (guard.admit lifts it).
            link.limit_frames(c.max_frame_size)
        self.links.add(link)
        return link

    def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accept(StreamTransport(reader, writer))

    def accept(self, transport: Transport) -> None:
        """Serve an inbound connection (the listener's, or any connected transport: tests use memory)."""
        if self._closing:
            transport.close()
            return
        self._new_link(transport, outbound=False).start()

    async def shutdown(self) -> None:
        """Leave gracefully: stop accepting, send LEAVE to every neighbour, drain, close, cancel tasks."""
        if self._closing:
            return
        self._closing = True
        self.event("leave")
        if self._reconcile_handle is not None:
            self._reconcile_handle.cancel()
        if self._listener is not None:
            self._listener.close()
        leave = Leave(tuple(self.view.infos(set(self.peers) | self._advertised)))
        closing = [
            link.aclose(
                CloseReason.SHUTDOWN, "leaving the overlay", farewell=leave if link in self.peers.values() else None
            )
            for link in list(self.links)
        ]
        try:
            async with asyncio.timeout(self.config.drain_timeout + 1.0):
                await asyncio.gather(*closing, return_exceptions=True)
        except TimeoutError:
            self.log.warning("links did not drain within %.1f s; closing anyway", self.config.drain_timeout)
        await self.tasks.cancel_all("broker shut down")
        self.pubsub.close()
        await self._stop_observability()
        self.log.info("left the overlay")

    # ------------------------------------------------------------------------------------------------ join

    async def join(self) -> None:
        """Join the overlay through the configured addresses, in order, until one answers.

        Raises JoinRefused if the overlay refuses this broker and JoinFailed if no address answers.
        Returns once at least one neighbour link is established.
        """
        errors: list[str] = []
        for addr in self.config.join:
            try:
                accept = await self._join_via(addr)
            except (OSError, TimeoutError, LinkClosed, ValueError) as exc:
                if self._peer_up.is_set():
                    # The answer was late (a loaded machine), but the overlay accepted us meanwhile: neighbours
                    # have linked to this broker.  Asking again elsewhere would only be refused as a duplicate.
                    self.log.info("join via %s answered late (%r), but neighbours already linked", addr, exc)
                    self.pubsub.resume()
                    return
                errors.append(f"{addr}: {exc!r}")
                continue
            self.log.info("joined via %s: closest broker is %s", addr, accept.node.id)
            self.event("join", peer=accept.node.id)
            self.view.add_candidates([accept.node, *accept.neighbours])
            self._reconcile()
            try:
                async with asyncio.timeout(self.config.join_timeout):
                    await self._peer_up.wait()
            except TimeoutError:
                raise JoinFailed(f"accepted via {addr} but no neighbour link came up") from None
            self.pubsub.resume()
            return
        raise JoinFailed("could not join through any address: " + "; ".join(errors))

    async def _join_via(self, addr: str) -> JoinAccept:
        host, port = parse_address(addr)
        async with asyncio.timeout(self.config.connect_timeout):
            reader, writer = await connect_broker(host, port, self.guard.dial_context, self.config.connect_timeout)
        link = self._new_link(StreamTransport(reader, writer), outbound=True)
        hello = Hello(PROTOCOL_VERSION, self.node_id, "client", self.info.coord, self.info.listen)
        try:
            await link.open(hello)
            async with asyncio.timeout(self.config.join_timeout):
                reply = await link.request(Join(1, self.info))
        except HandshakeRefused as exc:
            if exc.code == "shutting_down":
                raise LinkClosed(CloseReason.REFUSED, exc.text) from exc
            raise JoinRefused(exc.code, exc.text, addr) from exc
        finally:
            await link.aclose(CloseReason.DONE, "join answered")
        match reply:
            case JoinAccept():
                return reply
            case Refuse(code=code, text=text):
                raise JoinRefused(code, text, addr)
            case Error(code=code, text=text):
                raise LinkClosed(CloseReason.DONE, f"{code}: {text}")
            case _:
                raise LinkClosed(CloseReason.PROTOCOL_ERROR, f"unexpected answer to JOIN: {reply.op}")

    # ------------------------------------------------------------------------------------ link handling

    def _duplicate_of(self, node_id: str, coord: Coord) -> NodeInfo | None:
        if distance(self.info.coord, coord) < MIN_SITE_SEPARATION and node_id != self.node_id:
            return self.info
        for info in self.view.nodes.values():
            if info.id != node_id and distance(info.coord, coord) < MIN_SITE_SEPARATION:
                return info
        return None

    def on_hello(self, link: PeerLink, hello: Hello) -> HelloOk | Refuse:
        """Admit a peer, client or admin tool, or say precisely why not."""
        if self._closing:
            return Refuse("shutting_down", f"broker {self.node_id} is leaving the overlay")
        if hello.version != PROTOCOL_VERSION:
            return Refuse(
                "version_mismatch", f"this broker speaks protocol {PROTOCOL_VERSION}, HELLO had {hello.version}"
            )
        clients = sum(1 for x in self.links if x.role in ("client", "admin") and not x.outbound and x.established)
        if (refusal := self.guard.admit(link, hello, clients)) is not None:
            return refusal
        if hello.role == "broker" and hello.coord is not None:
            if not self.config.space.contains(hello.coord):
                return Refuse("coordinate_outside_space", self._outside_text(hello.coord))
            if hello.node == self.node_id:
                return Refuse("duplicate_node_id", f"node id {hello.node} is this broker's own id")
            dup = self._duplicate_of(hello.node, hello.coord)
            if dup is not None:
                return Refuse("duplicate_coordinate", self._duplicate_text(hello.coord, dup))
        return HelloOk(PROTOCOL_VERSION, self.info)

    def _outside_text(self, c: Coord) -> str:
        s = self.config.space
        return f"coordinate ({c[0]}, {c[1]}) is outside the space [{s.xmin}, {s.xmax}] x [{s.ymin}, {s.ymax}]"

    @staticmethod
    def _duplicate_text(c: Coord, owner: NodeInfo) -> str:
        return f"coordinate ({c[0]}, {c[1]}) is already taken by broker {owner.id} at {owner.listen}"

    def on_established(self, link: PeerLink) -> None:
        """Register a new broker link (resolving duplicate links) and send it our neighbour advert."""
        if link.role != "broker" or link.peer is None or self._closing:
            return
        pid = link.peer.id
        existing = self.peers.get(pid)
        if existing is not None and existing is not link:
            # Both ends dialled at once.  Both keep the connection opened by the smaller id, so they agree.
            keep_new = existing.outbound != link.outbound and link.outbound == (self.node_id < pid)
            loser = existing if keep_new else link
            if keep_new:
                self.peers[pid] = link
            loser.retire("duplicate_link")
            if not keep_new:
                return
        self.peers[pid] = link
        self.view.link_up(link.peer)
        link.send_nowait(Neighbours(tuple(self.view.infos(self._advertised))))
        self._peer_up.set()
        self._schedule_reconcile()

    def on_message(self, link: PeerLink, msg: Message) -> None:
        """Control messages of established links."""
        current = link.peer_id is not None and self.peers.get(link.peer_id) is link
        match msg:
            case Neighbours(neighbours=ns) if link.role == "broker":
                if current and link.peer_id is not None:
                    self.view.learn(link.peer_id, ns)
                    self._schedule_reconcile()
            case Leave(neighbours=ns) if link.role == "broker":
                if current and link.peer_id is not None:
                    del self.peers[link.peer_id]
                    self.view.forget(link.peer_id, self._now(), self.config.tombstone_ttl)
                    self.view.add_candidates(ns)
                    self._after_forget()
                link.close_soon(CloseReason.PEER_LEFT, "peer sent LEAVE")
            case Unlink(reason="duplicate_link") if link.role == "broker":
                # The peer has both links and keeps the other one.  If we have not seen the other one yet,
                # keep writing here (the peer still reads) until on_established retires this link.
                link.unlink_arrived()
            case Unlink() if link.role == "broker":
                if current and link.peer_id is not None:
                    del self.peers[link.peer_id]
                    self.view.unlink(link.peer_id)
                    self._schedule_reconcile()
                if not link.unlink_arrived():
                    link.retire("not_neighbour")
            case StatusReq(corr=corr):
                link.send_nowait(self.status(corr))
            case RouteProbe(corr=corr, target=target, origin=None):
                self._start_probe(link, corr, target)
            case Join(origin=None) if link.role == "client":
                self._start_join(link, msg)
            case Subscribe() | Unsubscribe() | Publish() | Fetch() | Locate() | MoveTopic() if link.role == "client":
                sid = self._session(link)
                if (refusal := self.guard.check_request(link, msg)) is not None:
                    link.send_nowait(refusal)
                else:
                    if type(msg) is Publish:  # metrics: publish-to-ACK latency
                        self.stats.acks.started(sid, msg.topic, msg.publisher, msg.seq)
                    self.pubsub.client_message(sid, msg)
                self._dirty.add(link)
            case LoadReport() if link.role == "broker":
                if current:
                    self.balancer.on_report(msg)
            case BalancePlan(corr=corr, all_topics=all_topics):
                self.tasks.spawn(self._dry_run(link, corr, all_topics), "dry-run")
            case _:
                raise RemoteProtocolError(f"{msg.op} is not expected from a {link.role} link")

    def _session(self, link: PeerLink) -> str:
        sid = self._session_of.get(link)
        if sid is None:
            sid = f"{self._session_prefix}-{next(self._session_ids)}"
            self._session_of[link] = sid
            self.sessions[sid] = link
            self.pubsub.identities[sid] = link.identity
        return sid

    async def _dry_run(self, link: PeerLink, corr: int, all_topics: bool) -> None:
        plans = await self.balancer.round(dry_run=True, all_topics=all_topics)
        if link.established:
            texts = tuple(p.to_json() for p in plans[:1000])
            link.send_nowait(BalancePlanned(corr, texts))

    async def _pubsub_ticker(self) -> None:
        while not self._closing:
            await asyncio.sleep(PUBSUB_TICK)
            self.pubsub.tick()
            self.guard.sweep_idle(self.links, self._now(), self._subscribed)
            self.trimmer.maybe_trim(self._now())

    def _subscribed(self, link: PeerLink) -> bool:
        sid = self._session_of.get(link)
        return sid is not None and self.pubsub.subscriptions(sid) > 0

    def on_closed(self, link: PeerLink, reason: CloseReason, detail: str) -> None:
        """Forget a failed neighbour (the overlay heals) or just drop a link that is no longer wanted."""
        self.links.discard(link)
        self.trimmer.closed()
        self._dirty.discard(link)
        self._congested.discard(link)
        self.guard.link_closed(link, reason)
        sid = self._session_of.pop(link, None)
        if sid is not None:
            del self.sessions[sid]
            self.stats.acks.session_closed(sid)
            if not self._closing:
                self.pubsub.session_closed(sid)
        if self._pending:
            for corr in [k for k, (owner, _) in self._pending.items() if owner is link]:
                del self._pending[corr]
        pid = link.peer_id
        if pid is None or self.peers.get(pid) is not link:
            return
        del self.peers[pid]
        if self._closing:
            return
        if reason.is_failure:
            self.stats.failures_detected += 1
            self._note_failure(pid)
            self._failed_since_view.add(pid)
            self.log.warning("neighbour %s lost (%s: %s); healing", pid, reason.value, detail)
            self.view.forget(pid, self._now(), self.config.tombstone_ttl)
            self._after_forget()
        else:
            self.view.unlink(pid)
            self._schedule_reconcile()

    def written(self, link: PeerLink) -> None:
        """Something was written to link in this turn (checked for backpressure by needs_flush)."""
        self._dirty.add(link)

    def needs_flush(self) -> bool:
        """True if a next hop written to since the last check holds more than FLUSH_THRESHOLD unsent bytes."""
        dirty = self._dirty
        while dirty:
            link = dirty.pop()
            # Client links are bounded by their send limit instead: waiting for a slow subscriber would
            # stall every link this broker reads from.
            if link.write_buffered > FLUSH_THRESHOLD and not link.send_limit:
                self._congested.add(link)
        return bool(self._congested)

    async def flush(self) -> None:
        """Backpressure: wait until the congested next hops have drained."""
        while self._congested:
            await self._congested.pop().drain()

    # ----------------------------------------------------------------------------------- reconciliation

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _after_forget(self) -> None:
        # A tombstone's expiry can make a node eligible again; look once more when it lapses.
        asyncio.get_running_loop().call_later(self.config.tombstone_ttl + 0.01, self._schedule_reconcile)
        self._schedule_reconcile()

    def _schedule_reconcile(self) -> None:
        if self._reconcile_handle is None and not self._closing:
            self._reconcile_handle = asyncio.get_running_loop().call_soon(self._reconcile)

    def _reconcile(self) -> None:
        """Bring links and advert in line with the desired Delaunay neighbours (coalesced per loop turn)."""
        self._reconcile_handle = None
        if self._closing:
            return
        view = self.view
        view.expire(self._now())
        desired = view.desired()
        view.prune(desired)
        for nid in sorted(desired):
            if nid not in self.peers and nid not in self._dialing:
                info = view.nodes[nid]
                self._dialing[nid] = self.tasks.spawn(self._dial(info), f"dial-{nid}")
        for nid, link in list(self.peers.items()):
            advert = view.adverts.get(nid)
            # Keep a link while either end wants it; without the peer's advert we cannot know yet.
            if nid in desired or advert is None or self.node_id in advert:
                continue
            del self.peers[nid]
            view.unlink(nid)
            link.retire("not_neighbour")
        known = frozenset(view.known())
        if known != self._known_ids:
            # Who is closest to which coordinate may have changed: pub/sub re-ranks its topics (take-over,
            # new secondary, hand-over).  Coalesced with the reconciliation, once per loop turn.
            self._known_ids = known
            self.port.refresh()
            failed, self._failed_since_view = self._failed_since_view, set()
            self.pubsub.view_changed(failed)
        frozen = frozenset(desired)
        if frozen != self._advertised:
            self._advertised = frozen
            data = encode_control(Neighbours(tuple(view.infos(frozen))))
            for link in self.peers.values():
                if link.established:
                    link.write(data)
        if self.stats.healing_since is not None:
            self._check_healed(frozen)

    async def _dial(self, info: NodeInfo) -> None:
        try:
            host, port = parse_address(info.listen)
            async with asyncio.timeout(self.config.connect_timeout):
                reader, writer = await connect_broker(host, port, self.guard.dial_context, self.config.connect_timeout)
            problem = self.guard.dialled_peer_problem(peer_cert(writer.get_extra_info("peercert")), info.id)
            if problem is not None:
                writer.transport.abort()
                self._give_up(info.id, problem)
                return
            link = self._new_link(StreamTransport(reader, writer), outbound=True)
            hello = Hello(PROTOCOL_VERSION, self.node_id, "broker", self.info.coord, self.info.listen)
            ok = await link.open(hello)
            if ok.node.id != info.id:
                await link.aclose(CloseReason.UNLINKED, f"expected {info.id} at {info.listen}, found {ok.node.id}")
                self._give_up(info.id, f"{info.listen} is now {ok.node.id}")
        except HandshakeRefused as exc:
            self._give_up(info.id, str(exc))
        except (OSError, TimeoutError, LinkClosed, ValueError) as exc:
            self._give_up(info.id, repr(exc))
        finally:
            self._dialing.pop(info.id, None)
            self._schedule_reconcile()

    def _give_up(self, nid: str, why: str) -> None:
        if nid in self.peers or self._closing:
            return
        self.log.info("cannot link to %s (%s); treating it as gone for %.1f s", nid, why, self.config.tombstone_ttl)
        self.view.forget(nid, self._now(), self.config.tombstone_ttl)
        self._after_forget()

    # ------------------------------------------------------------------------------------------ routing

    def on_routed(self, link: PeerLink, frame: RoutedFrame) -> None:
        """Greedy forwarding: pass the frame to the neighbour closest to its destination, or deliver it."""
        peer = link.peer
        if peer is None and not link.may_route:
            self.guard.counters["routed_from_non_broker"] += 1
            raise RemoteProtocolError(f"routed frame from {link.role} {link.identity or '?'}: only brokers route")
        if self.guard.forged(frame, peer, self.info):
            return
        nh = self.view.next_hop(frame.x, frame.y)
        if nh is None:
            self._deliver(frame)
            return
        if frame.hops + 1 >= frame.hop_limit:  # same test as protocol.may_forward, inlined on the hot path
            self.stats.dropped_hop_limit += 1
            if self.stats.dropped_hop_limit % DROP_LOG_EVERY == 1:
                self.log.warning(
                    "dropped a frame for (%s, %s) at its hop limit %d (%d dropped so far)",
                    frame.x,
                    frame.y,
                    frame.hop_limit,
                    self.stats.dropped_hop_limit,
                )
            return
        out = self.peers[nh]
        body = None
        if frame.flags & FLAG_TRACE:
            body = self._trace(frame.body)
            if body is None:
                return
        try:
            out.write(forward_routed(frame, body))
        except LinkClosed:
            self.stats.dropped_no_route += 1
            return
        self.stats.forwarded += 1
        self.stats.forwarded_bytes += len(frame.body)
        self._dirty.add(out)

    def _trace(self, body: bytes) -> bytes | None:
        try:
            probe = decode_message(body)
        except RemoteProtocolError as exc:
            self.stats.dropped_bad_body += 1
            self.log.warning("dropped a traced frame with a bad body: %s", exc)
            return None
        if not isinstance(probe, RouteProbe):
            self.stats.dropped_bad_body += 1
            return None
        return encode_message(replace(probe, path=(*probe.path, self.info)))

    def send_routed(self, dest: Coord, msg: Message, flags: int = 0) -> None:
        """Originate a routed message (or handle it here if this broker is the closest)."""
        nh = self.view.next_hop(dest[0], dest[1])
        if nh is None:
            self._handle_delivered(msg, 0)
            return
        out = self.peers[nh]
        try:
            out.write(encode_routed(dest, encode_message(msg), hop_limit=self.config.max_hops, flags=flags))
        except LinkClosed:
            self.stats.dropped_no_route += 1
            return
        self._dirty.add(out)

    def _deliver(self, frame: RoutedFrame) -> None:
        try:
            msg = decode_message(frame.body)
        except RemoteProtocolError as exc:
            self.stats.dropped_bad_body += 1
            self.log.warning("dropped a routed frame with a bad body: %s", exc)
            return
        self._handle_delivered(msg, frame.hops + 1)

    def _handle_delivered(self, msg: Message, hops: int) -> None:
        self.stats.routed_delivered += 1
        self.stats.hops.observe(hops)
        self._hops = hops
        if not self.routes.dispatch(msg):
            self.stats.dropped_bad_body += 1
            self.log.warning("dropped a routed %s that this broker does not handle", msg.op)

    def _register_routes(self) -> None:
        """The routed messages that end here, by class: the node's, the balancer's and pub/sub's."""
        r = self.routes
        r.register(Join, self._join_arrived)
        r.register(RouteProbe, self._probe_arrived)
        for reply in (RouteReply, JoinAccept, Refuse, Error):
            r.register(reply, self._complete)
        r.register(Ping, lambda _msg: None)  # a routed PING only tests delivery (benchmarks): counted, not answered
        r.register(CoordQuery, self.balancer.on_query)
        r.register(CoordOffer, self.balancer.on_offer)
        r.register_all(self.pubsub.routed_handlers())

    def _join_arrived(self, msg: Join) -> None:
        if msg.origin is None:
            self.stats.dropped_bad_body += 1  # a JOIN without its bootstrap broker cannot be answered
            return
        self.send_routed(msg.origin.coord, self._answer_join(msg))

    def _probe_arrived(self, msg: RouteProbe) -> None:
        if msg.origin is None:
            self.stats.dropped_bad_body += 1
            return
        path = msg.path if msg.path and msg.path[-1].id == self.node_id else (*msg.path, self.info)
        self.send_routed(msg.origin.coord, RouteReply(msg.corr, self.info, self._hops, path))

    def _complete(self, msg: RouteReply | JoinAccept | Refuse | Error) -> None:
        entry = self._pending.pop(msg.corr, None)
        if entry is None:
            self.log.info("reply %s for unknown request %d (client gone?)", msg.op, msg.corr)
            return
        link, client_corr = entry
        if link.established:
            try:
                link.send_nowait(replace(msg, corr=client_corr))
            except LinkClosed:
                return  # the client's connection broke a moment ago; its close is on the way
            self._dirty.add(link)

    def _register(self, link: PeerLink, client_corr: int) -> int | None:
        if len(self._pending) >= MAX_PENDING:
            return None
        corr = next(self._corr)
        self._pending[corr] = (link, client_corr)
        return corr

    def _start_probe(self, link: PeerLink, corr: int, target: Coord) -> None:
        if not self.config.space.contains(target):
            link.send_nowait(Error(corr, "coordinate_outside_space", self._outside_text(target)))
            return
        mine = self._register(link, corr)
        if mine is None:
            link.send_nowait(Error(corr, "busy", f"{MAX_PENDING} requests pending"))
            return
        self.send_routed(target, RouteProbe(mine, target, self.info, (self.info,)), FLAG_TRACE)

    def _start_join(self, link: PeerLink, join: Join) -> None:
        if (refusal := self.guard.may_join(link, join)) is not None:
            link.send_nowait(refusal)
            return
        coord = join.node.coord
        if not self.config.space.contains(coord):
            link.send_nowait(Refuse("coordinate_outside_space", self._outside_text(coord), join.corr))
            return
        mine = self._register(link, join.corr)
        if mine is None:
            link.send_nowait(Error(join.corr, "busy", f"{MAX_PENDING} requests pending"))
            return
        self.send_routed(coord, Join(mine, join.node, self.info))

    def _answer_join(self, join: Join) -> JoinAccept | Refuse:
        node = join.node
        known = self.view.nodes.get(node.id)
        # The same broker asking again (its first JOIN's answer was late) is accepted again; another broker
        # with a live broker's id is not.
        if node.id == self.node_id or (known is not None and tuple(known.coord) != tuple(node.coord)):
            return Refuse("duplicate_node_id", f"node id {node.id} is already in the overlay", join.corr)
        dup = self._duplicate_of(node.id, node.coord)
        if dup is not None:
            return Refuse("duplicate_coordinate", self._duplicate_text(node.coord, dup), join.corr)
        if not self.config.space.contains(node.coord):
            return Refuse("coordinate_outside_space", self._outside_text(node.coord), join.corr)
        self.log.info("accepting %s at (%s, %s)", node.id, *node.coord)
        self.stats.joins_accepted += 1
        neighbours = tuple(self.view.infos(self.peers))
        self.view.add_candidates([node])
        self._schedule_reconcile()
        return JoinAccept(join.corr, self.info, neighbours)

    # ------------------------------------------------------------------------------------------- status

    def status(self, corr: int) -> Status:
        """This broker's STATUS answer."""
        counters = {
            **self.stats.counters(),
            "links": len(self.links),
            "sessions": len(self.sessions),
            **self.pubsub.counters,
            **self.balancer.counters,
            **self._security_counters(),
        }
        held = sorted(self.pubsub.topics())
        return Status(
            corr=corr,
            node=self.info,
            neighbours=tuple(self.view.infos(k for k, link in self.peers.items() if link.established)),
            desired=tuple(sorted(self._advertised)),
            topics=tuple(name for name, _, _ in held[:1000]),
            loads=self.pubsub.loads(),
            # Counters fed by clients (e.g. "lost", from a publisher's claimed base) must not make STATUS
            # unencodable: msgpack integers are 64-bit.
            counters={k: min(v, MAX_CORR) for k, v in counters.items()},
            resilience=self.config.resilience,
            held=tuple(TopicHeld(name, role, size) for name, role, size in held[:1000]),
        )

    # ------------------------------------------------------------------------------------ observability

    async def _start_observability(self) -> None:
        c = self.config
        if c.metrics is not None:
            self.metrics = MetricsServer(self)
            try:
                address = await self.metrics.start(c.metrics)
            except OSError as exc:
                raise StartFailed(f"cannot serve metrics on {c.metrics}: {exc.strerror or exc}") from None
            self.log.info("metrics at http://%s/metrics", address)
        if c.log_dir is not None:
            try:
                self.eventlog = EventLog(c, self.node_id)
            except OSError as exc:
                raise StartFailed(f"cannot write the metrics log in {c.log_dir}: {exc.strerror or exc}") from None
            self.tasks.spawn(self.eventlog.snapshots(self), "log-snapshots")
            self.log.info("metrics log %s, a snapshot every %s s", self.eventlog.path, c.log_interval)

    async def _stop_observability(self) -> None:
        if self.metrics is not None:
            await self.metrics.close()
        if self.eventlog is not None:
            self.eventlog.close()
            self.eventlog = None

    def event(
        self,
        kind: str,
        *,
        topic: str | None = None,
        load: float | None = None,
        frm: Coord | None = None,
        to: Coord | None = None,
        peer: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """Record an event in the metrics log (docs/logs.md), if there is one.

        kind: join, leave, failure, heal, takeover, delegation, move, retire; load in bytes for delegation
        and move (it feeds V_ML, eq. 13); frm/to the old and new topic coordinate.
        """
        if self.eventlog is not None:
            self.eventlog.event(kind, topic=topic, load=load, frm=frm, to=to, peer=peer, seconds=seconds)

    def counter_values(self) -> dict[str, int]:
        """Cumulative counters of the broker and its pub/sub layer, for the log's snapshots and the metrics."""
        return {**self.stats.counters(), **self.pubsub.counters, **self.balancer.counters}

    def loads(self) -> dict[str, int]:
        """L1_N, L2_N, L3_N in bytes (stats.Observed)."""
        return self.pubsub.loads()

    def held_topics(self) -> list[tuple[str, str, int]]:
        """(topic, role, stored bytes) of every topic held (stats.Observed)."""
        return self.pubsub.topics()

    def gauges(self) -> Gauges:
        """Neighbours, links and sessions right now (stats.Observed)."""
        neighbours = tuple(link.peer for link in self.peers.values() if link.established and link.peer is not None)
        return Gauges(neighbours, len(self.links), len(self.sessions))

    def _note_failure(self, peer: str) -> None:
        self.event("failure", peer=peer)
        if self.stats.healing_since is None:
            # time.monotonic, not the loop's clock: uvloop's has millisecond steps and a heal can take less.
            self.stats.healing_since = time.monotonic()

    def _check_healed(self, desired: frozenset[str]) -> None:
        # Healed: every desired (Delaunay) neighbour, as this broker now sees them, is linked again.
        for nid in desired:
            link = self.peers.get(nid)
            if link is None or not link.established:
                return
        since, self.stats.healing_since = self.stats.healing_since, None
        if since is not None:
            seconds = time.monotonic() - since
            self.stats.heal.observe(seconds)
            self.event("heal", seconds=seconds)
            self.log.info("overlay healed around the failure in %.3f s", seconds)

    def _security_counters(self) -> dict[str, int]:
        lst = self._listener
        failures, refused = (lst.handshake_failures, lst.refused) if lst is not None else (0, 0)
        return self.guard.status(self.links, failures, refused)


class _PubSubPort:
    """The broker as the pub/sub layer sees it (broker.pubsub.Overlay)."""

    def __init__(self, broker: Broker) -> None:
        self._b = broker
        self._view: dict[str, NodeInfo] = {}

    def refresh(self) -> None:
        """Rebuild the live-node view after the overlay view changed (read on every pub/sub request)."""
        b = self._b
        view = {nid: b.view.nodes[nid] for nid in b.view.known() if nid in b.view.nodes}
        view[b.info.id] = b.info
        self._view = view

    @property
    def me(self) -> NodeInfo:
        return self._b.info

    def view(self) -> Mapping[str, NodeInfo]:
        return self._view

    def route(self, dest: Coord, msg: Message) -> None:
        self._b.send_routed(dest, msg)

    def to_session(self, session: str, frame: bytes) -> bool:
        link = self._b.sessions.get(session)
        if link is None or not link.established:
            return False
        try:
            link.write(frame)
        except LinkClosed:
            # Broken a moment ago (its close is on the way): a failure here must not abort the batch of
            # deliveries and acknowledgements for everyone else that this call is part of.
            return False
        self._b.written(link)
        if session in self._b.stats.acks.waiting:  # metrics: an ACK stops publish-to-ACK clocks
            self._b.stats.acks.frame(session, frame)
        return True

    def now(self) -> float:
        return time.time()

    def neighbour_infos(self) -> list[NodeInfo]:
        return [link.peer for link in self._b.peers.values() if link.established and link.peer is not None]

    def send_to_neighbour(self, node_id: str, msg: Message) -> int:
        link = self._b.peers.get(node_id)
        if link is None or not link.established:
            return 0
        data = encode_control(msg)
        try:
            link.write(data)
        except LinkClosed:
            return 0
        return len(data)

    def defer(self, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_soon(fn)
