"""The SeDAX broker: one process, one port, links to exactly its Delaunay neighbours, greedy forwarding.

The node is the wiring: it constructs the parts and starts and stops them, and it is the `LinkHandler` of
all its links, dispatching what arrives to the part that owns it:

    membership.py   join, dial, reconcile the links with the Delaunay neighbours, heal after failures
    routing.py      greedy forwarding, the routed-message dispatch table, requests relayed for clients
    pubsub/         the pub/sub engine (its roles and the topic-replica lifecycle)
    balancer.py     load reports, coordinate queries, Alg. 1 and 2
    guard.py        admission, ACLs and limits;  stats.py counters;  metrics.py and eventlog.py observe
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import secrets
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypeAlias

from broker.balancer import Balancer
from broker.config import BrokerConfig, ConfigError
from broker.eventlog import EventLog
from broker.guard import Guard, Reloaded
from broker.link import TICK_SLACK, CloseReason, LinkClosed, PeerLink
from broker.membership import Membership
from broker.memory import HeapTrimmer, human_bytes, memory_available
from broker.pubsub import PubSub, PubSubConfig
from broker.routing import DispatchTable, Routing
from broker.stats import BrokerStats, Gauges, TopicCensus
from broker.storage import (
    DataDirInUse,
    DiskStore,
    FormatUnknown,
    OpenFileLimit,
    StorageError,
    claim_format,
    lock_data_dir,
    unlock_data_dir,
)
from broker.store import TopicStore
from broker.tasks import TaskSet
from broker.tls import Listener
from broker.version import VERSION
from net.transport import Transport
from overlay.delegation import BalancePlan, BalancePlanned, LoadReport, MoveTopic
from overlay.dt import NeighbourView
from overlay.protocol import (
    CORR_SPAN,
    MAX_CORR,
    MAX_LINK_FRAME_SIZE,
    RATE_WINDOW,
    STATUS_PAGE,
    Coord,
    Frame,
    HeldPage,
    HeldReq,
    Join,
    Leave,
    Message,
    Neighbours,
    NodeInfo,
    RemoteProtocolError,
    RouteProbe,
    Status,
    StatusReq,
    Suspect,
    TopicHeld,
    Unlink,
    Witness,
    encode_control,
    format_address,
    parse_address,
)
from overlay.pubsub import Ack, Fetch, Locate, Nack, Publish, Subscribe, Unsubscribe, coalesce_publishes

if TYPE_CHECKING:
    # prometheus_client is imported only by a broker that serves metrics (--metrics): a few MB less for the rest.
    from broker.metrics import MetricsServer

# One ticker serves every timer of the broker that shares a beat (`Broker._ticker`): the links' heartbeats and
# hello deadlines, the load reports, pub/sub's time-outs, the idle sweep, the close log and heap trimming.  An
# idle broker so wakes up once per heartbeat interval (broker/link.py says why), not once per link per
# heartbeat plus twenty times for pub/sub.  Beats fall on whole multiples of the interval on the wall clock, so
# the brokers of one machine tick together and a beat's PINGs mostly reach a peer while it is awake for its
# own; between beats the ticker wakes only for a link's silence deadline or busy pub/sub.
#
# How often the pub/sub layer's timers run while it has work under way (replication and pull time-outs):
# a tenth of the replication time-out, so a lost replica is noticed within ~0.05 s of its deadline ...
PUBSUB_TICK: Final = 0.05
# ... for this long after any pub/sub input (a client request, a routed message delivered here, a change of the
# view): every time-out whose precision matters (replication 0.5 s, pull 1 s, a delegate list's re-send 1 s)
# is armed by such an input and falls due within it ...
PUBSUB_BUSY: Final = 2.0
# ... and otherwise at the first beat after this long: what is left then (retention, expired forwards and notes,
# a move's 5 s time-out, a replica's backed-off re-send) is coarse, and an idle broker makes one call a second,
# not twenty, in a wake-up it makes anyway.
PUBSUB_IDLE_TICK: Final = 1.0


async def _stepped(steps: Iterator[None]) -> None:
    """Take the steps of a walk of every topic held (`PubSub.rows`, `census`), the event loop free in between."""
    for _ in steps:
        await asyncio.sleep(0)


def _stored_after(store: TopicStore, topic: str, ts: float) -> int:
    """How many of topic's stored messages are newer than ts: a bisection of its log (kept in timestamp
    order) when STATUS is asked, instead of a counter on every publish."""
    rows = store.get(topic).rows
    return len(rows) - bisect.bisect_right(rows, ts, key=itemgetter(0))


HeldRow: TypeAlias = tuple[str, str, int]  # (topic, role, stored bytes): PubSub.topics()


def page_of(
    names: Sequence[str], after: str, size: int, rows_of: Callable[[Sequence[str]], list[HeldRow]]
) -> tuple[list[HeldRow], bool]:
    """The page after the name `after` ("": the first page) of the sorted, distinct `names`: the rows of the next
    names, in order, `size` at most but for the last name's other entries (a topic held as home and as a copy has
    one for each), so that the next page, after that name, misses none and a page stays within MAX_LIST_LEN; and
    whether more names follow.  `rows_of` gives the rows of some names now: a name with none (dropped since, or
    a delegate list this broker is not the home of) takes no room, and a page is empty only at the end."""
    first = bisect.bisect_right(names, after) if after else 0
    page: list[HeldRow] = []
    while not page and first < len(names):
        chunk = names[first : first + size]
        page = sorted(rows_of(chunk))
        first += len(chunk)
        if len(page) > size:
            last = page[size - 1][0]
            page = [row for row in page if row[0] <= last]
            first += bisect.bisect_right(chunk, last) - len(chunk)
    return page, first < len(names)


# The messages of a client's pub/sub session, and Broker.on_message's first test (isinstance takes the union at
# the cost of a tuple): the most frequent first.
ClientRequest: TypeAlias = Publish | Subscribe | Unsubscribe | Fetch | Locate | MoveTopic


class StartFailed(RuntimeError):
    """The broker could not open its metrics endpoint or its log; the message says which and why."""


class Broker(Membership, Routing):
    """A broker process's state and behaviour; the `LinkHandler` of all its links."""

    def __init__(self, config: BrokerConfig, log: logging.Logger | None = None) -> None:
        """Raises ConfigError if the security settings are missing or unusable (see broker.guard)."""
        self.config = config
        self.log = log or logging.getLogger("sedax.broker")
        self.started = time.time()  # (wall clock: STATUS says since when the broker runs)
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
        self._corr = itertools.count(1 + secrets.randbelow(CORR_SPAN))  # (CORR_SPAN says why)
        self._dirty: set[PeerLink] = set()
        self._congested: set[PeerLink] = set()
        self._reconcile_handle: asyncio.Handle | None = None
        self._listener: Listener | None = None
        self._closing = False
        self._handing_off = False
        # Set when the broker's timers failed (a bug): the process stops (broker/main.py) so that its supervisor
        # starts it again with its topics from the data directory, instead of serving on without heartbeats,
        # time-outs or syncs.
        self.failed = asyncio.Event()
        self.failure: BaseException | None = None
        self._peer_up = asyncio.Event()
        self._pubsub_input = False  # a client request since the last tick (the ticker then ticks pub/sub fast)
        self._pings_of_closed = 0  # heartbeat PINGs sent on links closed since (the open ones count their own)
        self.joined = not config.join  # the first broker of an overlay is part of it from the start
        # Client sessions (pub/sub) by id; ids carry a per-process prefix so a restarted broker with the same
        # node id never mistakes an old subscription for a new session.
        self._session_prefix = secrets.token_hex(3)
        self._session_ids = itertools.count(1)
        self.sessions: dict[str, PeerLink] = {}
        self._session_of: dict[PeerLink, str] = {}
        self._known_ids: frozenset[str] = frozenset()
        self._failed_since_view: set[str] = set()
        self._lost: dict[str, tuple[NodeInfo, float, float, float]] = {}
        self._suspects: dict[str, tuple[int, set[str]]] = {}
        self._detour_dial_at: dict[str, float] = {}
        self._corrs = itertools.count(1)
        self._redial_handle: asyncio.TimerHandle | None = None
        self.port = PubSubPort(self)
        retention = config.retention_policy()
        disk, self._data_lock = None, None
        self.fd_limit = OpenFileLimit.current()
        if config.on_disk and config.data_dir:
            data_dir = Path(config.data_dir)
            try:
                self._data_lock = lock_data_dir(data_dir)
                # Before anything in it is read: a directory a newer release wrote is refused untouched.
                claim_format(data_dir, VERSION)
                # As many topic files open as the open-file limit leaves room for (broker/storage/files.py).
                disk = DiskStore(
                    data_dir, config.fsync_policy, open_files=self.fd_limit.topic_files(config.max_connections)
                )
            except (DataDirInUse, FormatUnknown, OSError) as exc:
                if self._data_lock is not None:
                    unlock_data_dir(self._data_lock)
                    self._data_lock = None
                if isinstance(exc, StorageError):
                    raise ConfigError(str(exc)) from None
                # a file, a directory this user may not write, /proc
                why = "not a directory" if data_dir.exists() and not data_dir.is_dir() else exc.strerror or exc
                raise ConfigError(
                    f"cannot use --data-dir {data_dir}: {why}: give a directory this user may write"
                ) from None
        self.pubsub = PubSub(
            self.port,
            PubSubConfig(
                resilience=config.resilience,
                retention=retention.base,
                move_cooldown=config.move_cooldown,
                space=config.space,
                note_ttl=3 * config.load_report_interval + 1.0,
                acl=self.guard.acl,
                max_topic_entries=config.max_topic_entries,
                max_memory=config.max_memory or memory_available() // 2,
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
        # The names held, sorted, and the pubsub.held_version they were sorted at (held_page).
        self._held_index: tuple[int, list[str]] | None = None
        self._local_depth = 0
        self._held = []  # routed messages held until a link leads closer (routing.HOLD_FOR)
        self._held_bytes = 0
        self._gave_up = {}
        self._register_routes()

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the listening socket; afterwards `info.listen` holds the real port."""
        host, port = parse_address(self.config.listen)
        tls = self.guard.tls
        self._listener = Listener(
            tls.server if tls is not None else None,
            self.config.hello_timeout,
            self.accept,
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
        except StorageError as exc:
            raise StartFailed(str(exc)) from None
        if self.config.on_disk:
            self.log.info("data directory %s (fsync %s): %s", self.config.data_dir, self.config.fsync, report)
        self._log_limits()
        self.guard.check_expiry(time.time())
        if not self.config.join:
            self.pubsub.resume()  # the first broker: nobody to compare the recovered topics with
        self.balancer.start(self._now)
        self.tasks.spawn(self._ticker(), "ticker")
        await self._start_observability()
        self.log.info("listening on %s at (%s, %s) as %s", listen, *self.info.coord, self.node_id)

    def reload(self, reread: Callable[[], BrokerConfig] | None = None) -> Reloaded:
        """SIGHUP: read the configuration (`reread`, as at start) and the TLS files, tokens and ACL again
        (Guard.reload; a ConfigError changes nothing).  New connections get the new certificate and limits,
        connections the new files no longer admit are closed, and local subscriptions the new ACL denies end."""
        try:
            config = reread() if reread is not None else self.config
            done = self.guard.reload(self.links, config)
        except ConfigError:
            self.guard.counters["reload_failures"] += 1
            self.guard.last_reload_ok = False
            raise
        self.guard.counters["reloads"] += 1
        self.guard.last_reload_ok = True
        connections_changed = config.max_connections != self.config.max_connections
        policy = config.retention_policy()
        retention_changed = policy != self.pubsub.store.policy
        self.config = config
        if retention_changed:  # (what a topic no longer keeps goes at its next age check: broker/sweep.py)
            changed = self.pubsub.store.retain(policy)
            self.log.info(
                "retention: %s (%d topics held keep by another retention now)", self.pubsub.store.policy, changed
            )
        if connections_changed:  # (the guard admits clients by the new number already)
            if self.pubsub.store.disk is not None:
                self.pubsub.store.disk.files.resize(self.fd_limit.topic_files(config.max_connections))
            self._log_limits(files_only=True)
        if self._listener is not None and self.guard.tls is not None:
            self._listener.use(self.guard.tls.server)
        for link, why in done.revoked:
            link.close_soon(CloseReason.REFUSED, why)
        ended = self.pubsub.acl_reloaded()
        if ended:
            self._pubsub_input = True  # their UNSUBSCRIBEs leave at the next pub/sub tick
        return replace(done, subscriptions_ended=ended)

    def _log_limits(self, files_only: bool = False) -> None:
        """Say at start (and again when a reload changed --max-connections: `files_only`) what memory the stored
        messages may take and what the open-file limit allows; warn when that is short of --max-connections."""
        if not files_only:
            self.log.info(
                "stored messages may take %s of memory (--max-memory%s)",
                human_bytes(self.pubsub.config.max_memory),
                "" if self.config.max_memory else ": half of what this machine or container has",
            )
            self.log.info("retention: %s", self.pubsub.store.policy)
        lim, conns = self.fd_limit, self.config.max_connections
        if self.pubsub.store.disk is not None:
            self.log.info(
                "open-file limit %d: at most %d topic files kept open at once (more topics are served all the same)",
                lim.soft,
                self.pubsub.store.disk.files.limit,
            )
        if lim.short_of(conns):
            self.log.warning(
                "the open-file limit (%d, hard %d) leaves no room for %d client connections (--max-connections) "
                "beside the broker's own files: raise it (ulimit -n; LimitNOFILE= for a systemd service; "
                "--ulimit nofile= for docker) or lower --max-connections",
                lim.soft,
                lim.hard,
                conns,
            )

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
            local_id=self.node_id,
            ticked=True,  # Broker._ticker ticks every link
        )
        # Until it proves to be a broker, a peer gets the client frame limit (guard.admit lifts it); a link this
        # broker dials goes to a broker.
        link.limit_frames(MAX_LINK_FRAME_SIZE if outbound else c.max_frame_size)
        if not outbound:
            link.coalesce = self._coalesce  # (what a client sends; a broker or admin tool sends no PUBLISH)
        self.links.add(link)
        return link

    def _coalesce(self, frames: list[Frame]) -> list[Frame]:
        """One read's frames from a client, its consecutive one-message PUBLISHes as batches (counted)."""
        out = coalesce_publishes(frames, self.config.max_payload)
        if len(out) < len(frames):
            self.pubsub.counters["coalesced"] += len(frames) - len(out)
        return out

    def accept(self, transport: Transport) -> None:
        """Serve an inbound connection (the listener's, or any connected transport: tests use memory)."""
        if self._closing:
            transport.close()
            return
        self._new_link(transport, outbound=False).start()

    async def shutdown(self) -> None:
        """Leave gracefully: stop accepting, send LEAVE to every neighbour, drain, close, cancel tasks."""
        if self._closing or self._handing_off:
            return
        self._handing_off = True
        await self._hand_off()
        self._closing = True
        self.event("leave")
        if self._reconcile_handle is not None:
            self._reconcile_handle.cancel()
        if self._redial_handle is not None:
            self._redial_handle.cancel()
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
        if self._data_lock is not None:
            unlock_data_dir(self._data_lock)
            self._data_lock = None
        await self._stop_observability()
        self.log.info("left the overlay")

    async def _hand_off(self) -> None:
        """Before leaving: offer every topic held to the brokers that hold it once this one is gone, and wait
        (at most handoff_timeout) until each confirmed it holds everything (docs/storage.md)."""
        if not self.peers:
            return
        started = time.monotonic()
        offered = self.pubsub.counters["offers"]
        while self.pubsub.hand_off_step():  # noqa: ASYNC110 (no condition waited for: a turn yielded per slice)
            await asyncio.sleep(0)  # (heartbeats and confirmations between the slices: PubSub.hand_off_step)
        offers = self.pubsub.counters["offers"] - offered
        deadline = time.monotonic() + self.pubsub.config.handoff_timeout
        # The offers are answered (and repeated) by the pub/sub engine on the running loop; this only watches the
        # count, which has no event of its own.
        while self.pubsub.handing_off() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        left = self.pubsub.handing_off()
        took = time.monotonic() - started
        self.event("handoff", seconds=round(took, 3))
        if left:
            self.log.warning("%d of %d hand-off offers unconfirmed after %.1f s; leaving anyway", left, offers, took)
        elif offers:
            self.log.info("handed %d topic copies to their next holders in %.3f s", offers, took)

    # ------------------------------------------------------------------------------------------------ join

    # ------------------------------------------------------------------------------------ link handling

    def on_message(self, link: PeerLink, msg: Message) -> None:
        """Control messages of established links."""
        # A client's pub/sub request is nearly every message a busy broker handles: it goes first, past the
        # membership patterns below (each an isinstance test) and the neighbour look-up they need.
        if isinstance(msg, ClientRequest) and link.role == "client":
            self._client_request(link, msg)
            return
        current = link.peer_id is not None and self.peers.get(link.peer_id) is link
        if type(msg) is Unlink:
            self.log.debug("UNLINK(%s) on %r (current %s, dialling %s)", msg.reason, link, current,
                           link.peer_id in self._dialing)  # fmt: skip
        match msg:
            case Neighbours(neighbours=ns) if link.role == "broker":
                if current and link.peer_id is not None:
                    if self.log.isEnabledFor(logging.DEBUG):  # (the sorted list is not built at INFO)
                        self.log.debug("%s advertises %s", link.peer_id, sorted(n.id for n in ns))
                    self.view.learn(link.peer_id, ns)
                    self._schedule_reconcile()
            case Leave(neighbours=ns) if link.role == "broker":
                if current and link.peer_id is not None:
                    del self.peers[link.peer_id]
                    self.view.forget(link.peer_id, self._now(), self.config.tombstone_ttl)
                    self.view.add_candidates(ns)
                    self._after_forget()
                link.close_soon(CloseReason.PEER_LEFT, "peer sent LEAVE")
            case Unlink(reason="duplicate_link") if link.role == "broker" and current and link.peer_id in self._dialing:
                # The peer keeps the connection we are dialling (its HELLO_OK is on the way): write on here until
                # that one is up and on_established retires this one, so the peer never drops out of the view in
                # between.  If the dial fails, _dial answers here instead.
                link.unlink_arrived()
            case Unlink(reason=reason) if link.role == "broker":
                # Not a neighbour any more, or a duplicate the peer gave up for another link to us that we are
                # not dialling (we had unlinked it already): answer at once; the reconciliation dials again if we
                # want the link.  Writing on here for a twin that never comes would end in the peer's drain
                # time-out closing the link under our writes: a reset, taken here for the peer's failure.
                answered = link.unlink_arrived()  # ours was sent too: the link is closing
                if current and link.peer_id is not None:
                    # (never `answered`: a link is retired only once out of `peers`)
                    self._drop_peer(link.peer_id, link, reason)
                    self._schedule_reconcile()
                elif not answered:
                    link.retire(reason)
            case Suspect() if link.role == "broker" and current:
                self._witness_asked(link, msg)
            case Witness() if link.role == "broker" and current:
                self._witness_arrived(link, msg)
            case StatusReq(corr=corr):
                link.send_nowait(self.status(corr))
            case HeldReq(corr=corr, after=after):
                held, recent, more, _ = self.held_page(after)
                link.send_nowait(HeldPage(corr, held, recent, more))
            case RouteProbe(corr=corr, target=target, origin=None):
                self._start_probe(link, corr, target)
            case Join(origin=None) if link.role == "client":
                self._start_join(link, msg)
            case LoadReport() if link.role == "broker":
                if current:
                    self.balancer.on_report(msg)
            case BalancePlan(corr=corr, all_topics=all_topics):
                self.tasks.spawn(self._dry_run(link, corr, all_topics), "dry-run")
            case _:
                raise RemoteProtocolError(f"{msg.op} is not expected from a {link.role} link")

    def _client_request(self, link: PeerLink, msg: ClientRequest) -> None:
        sid = self._session(link)
        if (refusal := self.guard.check_request(link, msg)) is not None:
            link.send_nowait(refusal)
        else:
            if type(msg) is Publish:  # metrics: publish-to-ACK latency
                self.stats.acks.started(sid, msg.topic, msg.publisher, msg.seq)
            self.pubsub.client_message(sid, msg)
        self.written(link)
        self._pubsub_input = True

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

    async def _ticker(self) -> None:
        """The broker's timers (see PUBSUB_TICK above): heartbeats, load reports, pub/sub, sweeps, trimming.

        Each wake-up is a plain timer callback, not a task's sleep: an idle broker's wake-ups are most of what it
        costs, and a callback is ~40 us of CPU cheaper per wake-up than waking a task (docs/benchmarks-scale.md).
        """
        loop = asyncio.get_running_loop()
        beat = self.config.heartbeat_interval
        wall = time.time() - loop.time()  # the wall clock's offset, to put the beats on its multiples

        def next_beat(after: float) -> float:
            return (math.floor((after + wall) / beat) + 1) * beat - wall

        never = float("inf")
        beat_at = next_beat(loop.time())
        deadline = never  # the earliest moment a link's silence runs out, as the last tick saw it
        pubsub_at = loop.time() + PUBSUB_TICK  # the next fast pub/sub tick (never while idle)
        idle_pubsub_at = pubsub_at  # while idle: pub/sub ticks at the first beat from then on
        busy_until = 0.0
        delivered = self.stats.routed_delivered
        known = self._known_ids  # replaced (not changed in place) whenever the live view changes
        stopped: asyncio.Future[None] = loop.create_future()
        handle: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal beat_at, deadline, pubsub_at, idle_pubsub_at, busy_until, delivered, known, handle
            if self._closing:
                stopped.set_result(None)
                return
            # A timer may fire a little early (uvloop's clock has millisecond steps): what is due within
            # TICK_SLACK counts as due, or the loop would spin in zero-length waits up to its deadline.
            now = loop.time()
            due = now + TICK_SLACK
            on_beat = due >= beat_at
            if on_beat or due >= deadline:
                # Only a beat's lateness means the process was busy: a deadline wake-up is often a millisecond
                # late (the timer's steps), and counting that would push the deadline on by as much, again and
                # again.
                late = max(0.0, now - beat_at) if on_beat else 0.0
                if on_beat:
                    self.stats.loop_lag.observe(late)
                deadline = never
                for link in list(self.links):
                    d = link.tick(now, late, on_beat)
                    if d < deadline:
                        deadline = d
            if on_beat:
                self.balancer.tick(now)
                self.guard.check_expiry(time.time())  # (once a day at most; off the busy pub/sub ticks)
                beat_at = next_beat(max(now, beat_at) + TICK_SLACK)
            self.release_held()  # (their time up: handled here; `_reconcile` releases them when links come up)
            if (
                self._pubsub_input
                or self.stats.routed_delivered != delivered
                or self._known_ids is not known
                or self._held
            ):
                self._pubsub_input = False
                delivered = self.stats.routed_delivered
                known = self._known_ids
                busy_until = now + PUBSUB_BUSY
                pubsub_at = min(pubsub_at, now + PUBSUB_TICK)
            if due >= pubsub_at or (on_beat and due >= idle_pubsub_at):
                if self.pubsub.tick():
                    busy_until = max(busy_until, now + PUBSUB_TICK)  # time-outs left for the next tick
                self.guard.sweep_idle(self.links, now, self._subscribed)
                self.guard.closes.tick(now)
                self.trimmer.maybe_trim(now)
                busy = now < busy_until
                pubsub_at = now + PUBSUB_TICK if busy else never
                idle_pubsub_at = now + PUBSUB_IDLE_TICK
            handle = loop.call_at(min(beat_at, deadline, pubsub_at), guarded)

        def guarded() -> None:
            try:
                tick()
            except Exception as exc:  # noqa: BLE001 - as a task's failure: logged by the task set, timers stop
                if not stopped.done():
                    stopped.set_exception(exc)

        handle = loop.call_at(min(beat_at, pubsub_at), guarded)
        try:
            await stopped
        except Exception as exc:
            self.failure = exc
            self.failed.set()
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def _subscribed(self, link: PeerLink) -> bool:
        sid = self._session_of.get(link)
        return sid is not None and self.pubsub.subscriptions(sid) > 0

    def on_closed(self, link: PeerLink, reason: CloseReason, detail: str) -> None:
        """Forget a failed neighbour (the overlay heals) or just drop a link that is no longer wanted."""
        self.links.discard(link)
        self._pings_of_closed += link.pings_sent
        self.trimmer.closed()
        self._dirty.discard(link)
        self._congested.discard(link)
        self.guard.link_closed(link, reason, detail, self._now())
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
        current = pid is not None and self.peers.get(pid) is link
        if link.role == "broker":
            self.log.debug("%r closed: %s %s (current %s)", link, reason.value, detail, current)
        if pid is None or not current:
            return
        del self.peers[pid]
        if self._closing:
            return
        if reason is CloseReason.HEARTBEAT_TIMEOUT and self._suspect(pid):
            # Silence may be a broken link, not a dead broker: the common neighbours decide (membership.py).
            self.log.info("neighbour %s silent (%s); asking our common neighbours", pid, detail)
        elif reason.is_failure:
            self._declare_failed(pid, f"{reason.value}: {detail}")
        else:
            self.view.unlink(pid)
            self._schedule_reconcile()

    # ------------------------------------------------------------------------------------------- status

    def status(self, corr: int) -> Status:
        """This broker's STATUS answer: its first page of topics (the rest: held_page)."""
        counters = {**self.counter_values(), "links": len(self.links), "sessions": len(self.sessions)}
        held, recent, _, total = self.held_page("")
        return Status(
            corr=corr,
            node=self.info,
            neighbours=tuple(self.view.infos(k for k, link in self.peers.items() if link.established)),
            desired=tuple(sorted(self._advertised)),
            topics=tuple(dict.fromkeys(h.topic for h in held)),
            loads=self.pubsub.loads(),
            # Counters fed by clients (e.g. "lost", from a publisher's claimed base) must not make STATUS
            # unencodable: msgpack integers are 64-bit.
            counters={k: min(v, MAX_CORR) for k, v in counters.items()},
            resilience=self.config.resilience,
            held=held,
            recent=recent,
            version=VERSION,
            started=self.started,
            certificate_expires=self.guard.certificate_expires,  # (not gauges(): that also sums the store's memory)
            reload_ok=self.guard.last_reload_ok,
            held_total=total,
            crl_next_update=self.guard.crl_next_update,
        )

    def held_page(self, after: str) -> tuple[tuple[TopicHeld, ...], dict[str, int], bool, int]:
        """The topics held after the name `after` (all: ""), STATUS_PAGE names at most, in name order; for those it
        is primary or delegate of, the messages stored in the last RATE_WINDOW s; whether more follow; how many
        entries all pages hold.  A name's roles (home and a copy) are on one page.

        The names are sorted once per change of which topics are held (`_held_index`, pubsub.held_version), and
        a page looks up its names' roles, sizes and states now.  Sorting every topic for every page stalled the
        event loop ~0.2 s per page at 100,000 topics, a hundred times per listing (benchmarks/bench_listing.py).
        A topic dropped while a listing is read is left out of its page; one made then is in the pages read
        after it."""
        version = self.pubsub.held_version
        if self._held_index is None or self._held_index[0] != version:
            self._held_index = (version, self.pubsub.held_names())
        names = self._held_index[1]
        page, more = page_of(names, after, STATUS_PAGE, self.pubsub.topics)
        states = self.pubsub.replica_states(name for name, _, _ in page)
        since = time.time() - RATE_WINDOW  # the clock records are stamped with (the pub/sub port's now())
        store = self.pubsub.store
        recent = {
            name: _stored_after(store, name, since)
            for name, role, _ in page
            if role in ("primary", "delegate") and name in store
        }
        held = tuple(TopicHeld(name, role, size, *states.get(name, ("caught_up", 0, 0))) for name, role, size in page)
        return held, recent, more, self.pubsub.held_count()

    # ------------------------------------------------------------------------------------ observability

    async def _start_observability(self) -> None:
        c = self.config
        if c.metrics is not None:
            from broker.metrics import MetricsServer  # only a broker that serves metrics needs prometheus_client

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

        kind: join, leave, failure, heal, takeover, sync, handoff, delegation, move, retire; load in bytes for
        delegation and move (it feeds V_ML, eq. 13); frm/to the old and new topic coordinate.
        """
        if self.eventlog is not None:
            self.eventlog.event(kind, topic=topic, load=load, frm=frm, to=to, peer=peer, seconds=seconds)

    def counter_values(self) -> dict[str, int]:
        """Cumulative counters of the broker, its pub/sub layer and its guard (log snapshots, metrics)."""
        pubsub = {**self.pubsub.counters, "restamped": self.pubsub.store.restamped}
        return {
            **self.stats.counters(),
            **pubsub,
            **self.balancer.counters,
            **self._link_counters(),
            **self._security_counters(),
        }

    def _link_counters(self) -> dict[str, int]:
        return {"heartbeat_pings": self._pings_of_closed + sum(link.pings_sent for link in self.links)}

    def loads(self) -> dict[str, int]:
        """L1_N, L2_N, L3_N in bytes (stats.Observed)."""
        return self.pubsub.loads()

    async def topic_rows(self) -> list[HeldRow]:
        """(topic, role, stored bytes) of every topic held, a slice per turn of the event loop (stats.Observed)."""
        rows: list[HeldRow] = []
        await _stepped(self.pubsub.rows(rows))
        return rows

    async def topic_census(self) -> TopicCensus:
        """The topics held, counted by role and state, a slice per turn of the event loop (stats.Observed)."""
        census = TopicCensus()
        await _stepped(self.pubsub.census(census))
        return census

    def gauges(self) -> Gauges:
        """Neighbours, links and sessions right now (stats.Observed)."""
        neighbours = tuple(link.peer for link in self.peers.values() if link.established and link.peer is not None)
        ps = self.pubsub
        return Gauges(
            neighbours,
            len(self.links),
            len(self.sessions),
            ps.store.memory(),
            ps.config.max_memory,
            self.guard.certificate_expires,
            self.guard.last_reload_ok,
            self.guard.crl_next_update,
        )

    def unhealthy(self) -> str | None:
        """Why the broker does not serve (stats.Observed: GET /healthz), or None: only a failure of its timers,
        after which it stops.  That it answers at all says its loop runs."""
        if self.failed.is_set():
            return f"the broker's timers failed ({self.failure!r}); it is stopping"
        return None

    def unready(self) -> str | None:
        """Why the broker does not take clients now (stats.Observed: GET /readyz), or None."""
        if (why := self.unhealthy()) is not None:
            return why
        if self._closing:
            return "leaving the overlay"
        if not self.joined:
            return f"joining the overlay (--join {','.join(self.config.join)})"
        return None

    def _security_counters(self) -> dict[str, int]:
        lst = self._listener
        failures, refused = (lst.handshake_failures, lst.refused) if lst is not None else (0, 0)
        return self.guard.status(self.links, failures, refused)


class PubSubPort:
    """The broker as the pub/sub layer sees it (broker.pubsub.Overlay)."""

    def __init__(self, broker: Broker) -> None:
        self._b = broker
        self._view: dict[str, NodeInfo] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the broker's loop, once `defer` first runs

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

    def to_session(self, session: str, frame: bytes, sent: Message | None = None) -> bool:
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
        acks = self._b.stats.acks
        if session in acks.waiting:  # metrics: an ACK stops publish-to-ACK clocks
            if sent is None:
                acks.frame(session, frame)  # an answer from another broker: decoded for the three fields
            elif isinstance(sent, Ack | Nack):
                acks.answered(session, sent.topic, sent.publisher, sent.seq, isinstance(sent, Ack))
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
        # Called per message: the loop is looked up once (asyncio.get_running_loop() costs a getpid() call).
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        loop.call_soon(fn)
