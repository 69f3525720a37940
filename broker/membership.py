"""Membership: joining the overlay, keeping links to exactly the Delaunay neighbours, healing after failures.

Overlay maintenance (see docs/protocol.md for the message sequences):

* Join: the newcomer connects to a bootstrap broker as a client and sends JOIN; the bootstrap routes it to
  the newcomer's own coordinate, so the closest live broker answers (JOIN_ACCEPT with its view, or REFUSE
  for a duplicate coordinate); the answer is routed back to the bootstrap's coordinate and handed over.
* Every broker links to its desired neighbours (`NeighbourView.desired`: Delaunay neighbours of itself among
  everything it knows) and advertises that set (NEIGHBOURS) whenever it changes.  A link is kept while
  either end wants it, so an edge disappears only when both ends agree it is not Delaunay.
* Failure (EOF, reset, heartbeat timeout) or LEAVE: the node is forgotten and tombstoned, its former
  neighbours become candidates and the survivors re-link around the hole.

`Membership` is a part of the Broker (broker/node.py), in its own module: its methods work on the node's
state (peers, view, links) and are typed on the Broker they belong to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Final

from broker.link import CloseReason, HandshakeRefused, LinkClosed, PeerLink
from broker.routing import MAX_PENDING
from net.credentials import source_address
from net.transport import Transport, connect_broker
from overlay.geometry import MIN_SITE_SEPARATION, distance
from overlay.protocol import (
    OLDEST_CLIENT_VERSION,
    PROTOCOL_VERSION,
    Coord,
    Error,
    Hello,
    HelloOk,
    Join,
    JoinAccept,
    Message,
    Neighbours,
    NodeInfo,
    Refuse,
    Suspect,
    UnlinkReason,
    Witness,
    encode_control,
    parse_address,
)

# A join that found no address answering is tried again after this pause, doubling up to the maximum.
JOIN_RETRY_FIRST: Final = 0.25
JOIN_RETRY_MAX: Final = 2.0
# Once a neighbour has linked to a joining broker, the overlay has accepted it; the JOIN's answer is then only
# waited for this much longer.  The answer travels back through the overlay and can be lost there while brokers
# join together (a full restart): waiting the whole join time-out for it kept the broker's recovered topics
# RECOVERING (requests waiting) for up to SEDAX_JOIN_TIMEOUT.
JOIN_ANSWER_GRACE: Final = 1.0
# And when no neighbour links either, the answer was lost on its way back (a reply routed while the brokers
# around the answering one still formed the overlay: "no linked neighbour leads back"), or the machine is slow:
# the JOIN is sent again after this long, the wait doubling each time, until --join-timeout.  Waiting the whole
# join time-out for one lost answer made a broker of a cluster started together exit 4 (CI, 2026-11-29); a
# broker that asks again is accepted again (`_answer_join`).
JOIN_ANSWER_FIRST: Final = 2.0
# A neighbour that *failed* (not one that left) may be alive on the other side of a partition.  Once its
# tombstone lapses it is dialled again now and then, the pause doubling from REDIAL_FIRST to REDIAL_MAX, for
# REDIAL_FOR seconds: when the partition heals, the two overlays find each other and merge into one Delaunay
# overlay (their brokers exchange views), and pub/sub merges the two histories of every topic.
# A silent neighbour is asked about (SUSPECT) to at most this many common neighbours; one that heard it within
# WITNESS_FRESH of its own silence limit vouches for it (WITNESS alive).  A vouched-for neighbour is asked
# about again every RECHECK_MISSES heartbeat limits, and declared failed once nobody vouches for it.
WITNESSES: Final = 3
WITNESS_FRESH: Final = 0.6
RECHECK_MISSES: Final = 1.0
REDIAL_FIRST: Final = 1.0
REDIAL_MAX: Final = 10.0
REDIAL_FOR: Final = 600.0

if TYPE_CHECKING:
    from broker.config import BrokerConfig
    from broker.guard import Guard
    from broker.node import PubSubPort
    from broker.pubsub import PubSub
    from broker.stats import BrokerStats
    from broker.tasks import TaskSet
    from overlay.dt import NeighbourView


class JoinRefused(Exception):
    """The overlay refused this broker (duplicate coordinate, coordinate outside the space, ...)."""

    def __init__(self, code: str, text: str, via: str) -> None:
        super().__init__(f"join refused ({code}) via {via}: {text}")
        self.code = code
        self.text = text
        self.via = via


class JoinFailed(ConnectionError):
    """No join address answered; start the first broker without --join or check the addresses."""


class Membership:
    """Join, dial, reconcile, heal (see the module docstring)."""

    # The node's state this part works on (set up by Broker.__init__ in broker/node.py).
    config: BrokerConfig
    log: logging.Logger
    guard: Guard
    tasks: TaskSet
    node_id: str
    info: NodeInfo
    view: NeighbourView
    peers: dict[str, PeerLink]
    links: set[PeerLink]
    stats: BrokerStats
    pubsub: PubSub
    port: PubSubPort
    _dialing: dict[str, asyncio.Task[None]]
    _advertised: frozenset[str]
    _known_ids: frozenset[str]
    _failed_since_view: set[str]
    _lost: dict[str, tuple[NodeInfo, float, float, float]]  # failed neighbour -> (info, next dial, pause, until)
    _suspects: dict[str, tuple[int, set[str]]]  # silent neighbour -> (SUSPECT corr, witnesses yet to answer)
    _detour_dial_at: dict[str, float]  # a detoured neighbour is dialled again after this time
    _corrs: Iterator[int]
    _redial_handle: asyncio.TimerHandle | None
    _reconcile_handle: asyncio.Handle | None
    _closing: bool
    _peer_up: asyncio.Event
    joined: bool  # part of an overlay: started without --join, or its join completed
    # ... and the parts of the other modules it calls.
    _new_link: Callable[..., PeerLink]
    _register: Callable[[PeerLink, int], int | None]
    send_routed: Callable[..., None]
    release_held: Callable[[], None]
    event: Callable[..., None]

    @property
    def _space(self) -> tuple[float, ...]:
        """The space as a HELLO carries it (Space's wire form: xmin, ymin, xmax, ymax)."""
        return tuple(self.config.space.to_list())

    async def join(self) -> None:
        """Join the overlay through the configured addresses, in order, until one answers.

        Brokers started together (a full restart, `docker compose up` of a whole cluster) may find none of
        them listening yet: the addresses are tried again, with a growing pause, until `join_timeout` has
        passed.  Raises JoinRefused if the overlay refuses this broker and JoinFailed if no address answered
        by then.  Returns once at least one neighbour link is established.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.join_timeout
        pause = JOIN_RETRY_FIRST
        answer_within = JOIN_ANSWER_FIRST
        while True:
            errors: list[str] = []
            no_overlay = True  # every address is down or still joining itself: no overlay to join
            for addr in self.config.join:
                try:
                    accept = await self._join_via(addr, min(answer_within, max(0.1, deadline - loop.time())))
                except (OSError, TimeoutError, LinkClosed, ValueError) as exc:
                    if self._peer_up.is_set():
                        # The answer was late (a loaded machine), but the overlay accepted us meanwhile:
                        # neighbours have linked to this broker.  Asking again would be refused as a duplicate.
                        self.log.info("join via %s answered late (%r), but neighbours already linked", addr, exc)
                        self.joined = True
                        self.pubsub.resume()
                        return
                    # Refused: nothing listens there, or it answered not_joined (_join_via); gaierror: the name is
                    # gone (Compose drops a stopped container's).  A time-out may be a partition: not "down".
                    no_overlay = no_overlay and isinstance(exc, (ConnectionRefusedError, socket.gaierror))
                    errors.append(f"{addr}: {exc!r}")
                    continue
                await self._joined(addr, accept)
                return
            if self.config.bootstrap and no_overlay:
                self.log.info("no join address is part of an overlay (%s): starting one", "; ".join(errors))
                self.joined = True
                self.pubsub.resume()
                return
            if loop.time() + pause > deadline:
                raise JoinFailed(
                    f"could not join through any address within {self.config.join_timeout:g} s: "
                    + "; ".join(errors)
                    + ": give --join a running broker's HOST:PORT (and its CA with --tls-ca), or start the first "
                    "broker of an overlay without --join or with --bootstrap"
                )
            self.log.info("no join address answered; trying again in %.1f s", pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, JOIN_RETRY_MAX)
            answer_within *= 2

    async def _joined(self, addr: str, accept: JoinAccept) -> None:
        self.joined = True
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

    async def _join_via(self, addr: str, answer_within: float) -> JoinAccept:
        host, port = parse_address(addr)
        async with asyncio.timeout(self.config.connect_timeout):
            transport = await connect_broker(
                host, port, self.guard.dial_context, self.config.connect_timeout, source_address(self.info.listen)
            )
        link = self._new_link(transport, outbound=True)
        hello = Hello(
            PROTOCOL_VERSION, self.node_id, "client", self.info.coord, self.info.listen,
            resilience=self.config.resilience, space=self._space,
        )  # fmt: skip
        try:
            await link.open(hello)
            reply = await self._join_answer(link, answer_within)
        except HandshakeRefused as exc:
            if exc.code == "shutting_down":
                raise LinkClosed(CloseReason.REFUSED, exc.text) from exc
            raise JoinRefused(exc.code, exc.text, addr) from exc
        finally:
            await link.aclose(CloseReason.DONE, "join answered")
        match reply:
            case JoinAccept():
                return reply
            case Refuse(code="not_joined", text=text):
                raise ConnectionRefusedError(text)  # that broker is joining itself: try another, or again
            case Refuse(code=code, text=text):
                raise JoinRefused(code, text, addr)
            case Error(code=code, text=text):
                raise LinkClosed(CloseReason.DONE, f"{code}: {text}")
            case _:
                raise LinkClosed(CloseReason.PROTOCOL_ERROR, f"unexpected answer to JOIN: {reply.op}")

    async def _join_answer(self, link: PeerLink, within: float) -> Message:
        """JOIN's answer on link; TimeoutError after `within` (join() asks again), or JOIN_ANSWER_GRACE after a
        neighbour linked to this broker without it (join() then counts the broker as accepted)."""
        answer = asyncio.ensure_future(link.request(Join(1, self.info)))
        linked = asyncio.ensure_future(self._peer_up.wait())
        try:
            async with asyncio.timeout(within):
                await asyncio.wait((answer, linked), return_when=asyncio.FIRST_COMPLETED)
                if not answer.done():
                    await asyncio.wait((answer,), timeout=JOIN_ANSWER_GRACE)
            if not answer.done():
                raise TimeoutError(f"no answer to JOIN within {JOIN_ANSWER_GRACE} s of a neighbour linking")
            return answer.result()
        finally:
            for f in (answer, linked):
                if not f.done():
                    f.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, LinkClosed, OSError):
                await asyncio.gather(answer, linked, return_exceptions=True)

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
        oldest = PROTOCOL_VERSION if hello.role == "broker" else OLDEST_CLIENT_VERSION
        if not oldest <= hello.version <= PROTOCOL_VERSION:
            speaks = f"{oldest} to {PROTOCOL_VERSION}" if oldest < PROTOCOL_VERSION else str(PROTOCOL_VERSION)
            return Refuse(
                "version_mismatch",
                f"this broker speaks protocol {speaks} to a {hello.role}, {hello.node!r} speaks {hello.version}: "
                "run the same SeDAX release on both (`sedax --version` names the protocol each speaks; "
                "across a change of it, restart all brokers together: docs/deploy.md)",
            )
        clients = sum(1 for x in self.links if x.role in ("client", "admin") and not x.outbound and x.established)
        if (refusal := self.guard.admit(link, hello, clients)) is not None:
            return refusal
        if hello.resilience and hello.resilience != self.config.resilience:
            # A broker keeping fewer copies would acknowledge messages that one crash loses; one keeping more
            # would wait for copies the others never make.  Refused at its first HELLO: the join fails at once.
            return Refuse(
                "resilience_mismatch",
                f"this overlay keeps {self.config.resilience} copies of each topic (--resilience "
                f"{self.config.resilience}); broker {hello.node!r} was started with --resilience {hello.resilience}: "
                f"start it with --resilience {self.config.resilience}",
            )
        if hello.space and hello.space != self._space:
            # Topics are placed in the space (their coordinate is a hash scaled to it): brokers of two spaces would
            # store and look for the same topic at different coordinates.
            mine, theirs = (",".join(f"{v:g}" for v in sp) for sp in (self._space, hello.space))
            return Refuse(
                "space_mismatch",
                f"this overlay's space is {mine} (--space {mine}); broker {hello.node!r} was started with --space "
                f"{theirs}: start it with --space {mine}",
            )
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
            # Both ends dialled at once.  Both keep the connection opened by the smaller id, so they agree; if the
            # peer already gave the existing one up (UNLINK(duplicate_link) while we dialled), this is its choice.
            by_id = existing.outbound != link.outbound and link.outbound == (self.node_id < pid)
            keep_new = existing.unlink_received or by_id
            loser = existing if keep_new else link
            self.log.debug("%r duplicates %r: keeping %r", link, existing, link if keep_new else existing)
            if keep_new:
                self.peers[pid] = link
            loser.retire("duplicate_link")
            if not keep_new:
                return
        self.peers[pid] = link
        self.log.debug("%r up", link)
        self.view.link_up(link.peer)
        link.send_nowait(Neighbours(tuple(self.view.infos(self._advertised))))
        self._peer_up.set()
        self._schedule_reconcile()

    # ---- reconciliation ----------------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _after_forget(self) -> None:
        # A tombstone's expiry can make a node eligible again; look once more when it lapses.
        asyncio.get_running_loop().call_later(self.config.tombstone_ttl + 0.01, self._schedule_reconcile)
        self._schedule_reconcile()

    def _drop_peer(self, pid: str, link: PeerLink, reason: UnlinkReason) -> None:
        """Stop using the link to a live neighbour: out of `peers`, no longer a forwarding neighbour (it stays
        in the view, so nothing fails over), and the link retired (UNLINK; closed once both ends sent one)."""
        del self.peers[pid]
        self.log.debug("%r retired (%s)", link, reason)
        self.view.unlink(pid)
        link.retire(reason)

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
        view.settle(desired)
        now = self._now()
        for nid in sorted(desired):
            if nid in self.view.detours and self._detour_dial_at.get(nid, 0.0) > now:
                continue  # its link is broken: dialled again after a pause, not in a loop
            if nid not in self.peers and nid not in self._dialing:
                info = view.nodes[nid]
                self._dialing[nid] = self.tasks.spawn(self._dial(info), f"dial-{nid}")
        for nid, link in list(self.peers.items()):
            advert = view.adverts.get(nid)
            # Keep a link while either end wants it; without the peer's advert we cannot know yet.
            if nid in desired or advert is None or self.node_id in advert:
                continue
            self._drop_peer(nid, link, "not_neighbour")
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
            if self.log.isEnabledFor(logging.DEBUG):  # (the sorted lists are not built at INFO)
                self.log.debug("Delaunay neighbours now %s (linked %s)", sorted(frozen), sorted(self.peers))
            self._advertised = frozen
            data = encode_control(Neighbours(tuple(view.infos(frozen))))
            for link in list(self.peers.values()):
                if link.established:
                    # A link whose transport is closing refuses writes: its close is on the way and will
                    # reconcile again; the other neighbours must still get the advert.
                    with contextlib.suppress(LinkClosed):
                        link.write(data)
        if self.stats.healing_since is not None:
            self._check_healed(frozen)
        # A link that came up (or a closer broker forgotten, or a broken link let go) may be what held routed
        # messages wait for.
        self.release_held()

    async def _dial(self, info: NodeInfo, *, quiet: bool = False) -> None:
        transport: Transport | None = None
        link: PeerLink | None = None
        try:
            host, port = parse_address(info.listen)
            async with asyncio.timeout(self.config.connect_timeout):
                transport = await connect_broker(
                    host, port, self.guard.dial_context, self.config.connect_timeout, source_address(self.info.listen)
                )
            problem = self.guard.dialled_peer_problem(transport.peer_cert, info.id)
            if problem is not None:
                transport.abort()
                self._give_up(info.id, problem, quiet=quiet)
                return
            link = self._new_link(transport, outbound=True)
            hello = Hello(
                PROTOCOL_VERSION, self.node_id, "broker", self.info.coord, self.info.listen,
                resilience=self.config.resilience, space=self._space,
            )  # fmt: skip
            ok = await link.open(hello)
            if ok.node.id != info.id:
                await link.aclose(CloseReason.UNLINKED, f"expected {info.id} at {info.listen}, found {ok.node.id}")
                self._give_up(info.id, f"{info.listen} is now {ok.node.id}", quiet=quiet)
        except HandshakeRefused as exc:
            self._give_up(info.id, str(exc), quiet=quiet)
        except (OSError, TimeoutError, LinkClosed, ValueError) as exc:
            self._give_up(info.id, repr(exc), quiet=quiet)
        except asyncio.CancelledError:
            # The broker shuts down (its tasks are cancelled) in the middle of the dial: the connection goes too.
            # Left open, it stayed half a link after the shutdown, and the peer took it for a neighbour until its
            # heartbeats timed out (tests/test_gc_policy.py caught one).
            if transport is not None:
                transport.abort()
            if link is not None:
                self.links.discard(link)
            raise
        finally:
            self._dialing.pop(info.id, None)
            current = self.peers.get(info.id)
            if current is not None and current.unlink_received:
                # The peer gave this link up for the connection this dial was to open, which did not come up
                # (node.py waits for it): answer now; the reconciliation dials again.
                self._drop_peer(info.id, current, "duplicate_link")
            self._schedule_reconcile()

    def _schedule_redial(self) -> None:
        if self._redial_handle is not None or self._closing or not self._lost:
            return
        due = min(t for _, t, _, _ in self._lost.values())
        self._redial_handle = asyncio.get_running_loop().call_at(max(due, self._now()), self._redial)

    def _redial(self) -> None:
        """Dial the failed neighbours that are due (see REDIAL_FIRST); a link that comes up merges the views."""
        self._redial_handle = None
        if self._closing:
            return
        now = self._now()
        known = self.view.known()
        for nid, (info, due, pause, until) in list(self._lost.items()):
            if nid in self.peers or nid in known or now > until:
                del self._lost[nid]  # back in this overlay (or given up on)
            elif due <= now and nid not in self._dialing:
                self._lost[nid] = (info, now + pause, min(pause * 2, REDIAL_MAX), until)
                self._dialing[nid] = self.tasks.spawn(self._dial(info, quiet=True), f"redial-{nid}")
        self._schedule_redial()

    def _give_up(self, nid: str, why: str, *, quiet: bool = False) -> None:
        if nid in self.peers or self._closing:
            return
        if nid in self.view.detours or nid in self._suspects:
            # Alive (a common neighbour hears it), only unreachable from here: keep it; dial again later.
            self.log.debug("%s still unreachable directly (%s)", nid, why)
            self._detour_dial_at[nid] = self._now() + self.config.heartbeat_interval * self.config.heartbeat_misses
            return
        if quiet:
            self.log.debug("%s still unreachable (%s)", nid, why)
        else:
            self.log.info("cannot link to %s (%s); treating it as gone for %.1f s", nid, why, self.config.tombstone_ttl)
        self.view.forget(nid, self._now(), self.config.tombstone_ttl)
        self._after_forget()  # (an advert may still list it: it is looked at again when the tombstone lapses)

    def _start_join(self, link: PeerLink, join: Join) -> None:
        if not self.joined:
            # Brokers started together (a full restart) must grow one overlay, not several: only a broker that
            # is part of one (it started it, or its own join completed) lets others in.
            link.send_nowait(Refuse("not_joined", f"broker {self.node_id} is still joining the overlay", join.corr))
            return
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
        if (node.id, node.listen, tuple(node.coord)) == (self.node_id, self.info.listen, tuple(self.info.coord)):
            # This broker's own JOIN, routed to its coordinate, that is here: it was started again at once after
            # a crash, and the neighbours of its previous life redialled its address (their tombstone lapsed)
            # before the JOIN got through.  It is where it asked to be: accepted, by itself.  (Only this process
            # listens at this address; another broker with this id is refused below.)
            self.log.info("my own JOIN was routed to me: the overlay already reaches me")
            return JoinAccept(join.corr, self.info, tuple(self.view.infos(self.peers)))
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

    # ---- suspicion: is a silent neighbour dead, or only the link to it? --------------------------------

    def _suspect(self, peer: str) -> bool:
        """The link to peer went silent: ask the neighbours shared with it whether they still hear it (SUSPECT).
        Returns False when there is nobody to ask (the caller declares the failure at once)."""
        # The common neighbours: linked brokers whose own advert lists the peer (its advert is gone with its link).
        witnesses = [
            w
            for w, link in sorted(self.peers.items())
            if link.established and peer in self.view.adverts.get(w, frozenset())
        ]
        if not witnesses:
            return False
        witnesses = witnesses[:WITNESSES]
        corr = next(self._corrs)
        self._suspects[peer] = (corr, set(witnesses))
        self.view.unlink(peer)  # no longer a forwarding neighbour; still in the view, so nothing fails over yet
        for w in witnesses:
            self.peers[w].send_nowait(Suspect(corr, peer))
        # Witnesses answer within a round trip; one that does not counts as not hearing the peer either.
        wait = 2 * self.config.heartbeat_interval
        asyncio.get_running_loop().call_later(wait, self._suspicion_due, peer, corr)
        return True

    def _witness_asked(self, link: PeerLink, msg: Suspect) -> None:
        """SUSPECT from a neighbour: do we still hear msg.node on our own link?"""
        other = self.peers.get(msg.node)
        alive = other is not None and other.heard_within(WITNESS_FRESH)
        link.send_nowait(Witness(msg.corr, msg.node, alive))

    def _witness_arrived(self, link: PeerLink, msg: Witness) -> None:
        entry = self._suspects.get(msg.node)
        if entry is None or entry[0] != msg.corr or link.peer_id not in entry[1]:
            return
        corr, waiting = entry
        if msg.alive and link.peer_id is not None:
            del self._suspects[msg.node]
            if msg.node not in self.view.detours:
                self.stats.suspicions_refuted += 1
                self.event("suspicion_refuted", peer=msg.node)
                self.log.warning(
                    "link to %s broke but %s still hears it: no failover; forwarding through %s",
                    msg.node, link.peer_id, link.peer_id,
                )  # fmt: skip
            self.view.detour(msg.node, link.peer_id)
            # Ask again later: if the peer dies meanwhile, its witnesses stop vouching and it is declared failed.
            recheck = RECHECK_MISSES * self.config.heartbeat_interval * self.config.heartbeat_misses
            asyncio.get_running_loop().call_later(recheck, self._recheck, msg.node)
            self._schedule_reconcile()  # keep trying to link to it directly
            return
        waiting.discard(link.peer_id or "")
        if not waiting:
            self._suspicion_due(msg.node, corr)

    def _suspicion_due(self, peer: str, corr: int) -> None:
        """Nobody vouched for peer in time: it failed."""
        entry = self._suspects.get(peer)
        if entry is None or entry[0] != corr:
            return  # vouched for, or asked about again since
        del self._suspects[peer]
        self._declare_failed(peer, "no common neighbour hears it either")

    def _recheck(self, peer: str) -> None:
        if self._closing or peer not in self.view.detours or peer in self.peers:
            return
        if not self._suspect(peer):
            self._declare_failed(peer, "no common neighbour is left to vouch for it")

    def _declare_failed(self, peer: str, why: str) -> None:
        """peer is dead (or cut off from every neighbour): forget it; the overlay heals and pub/sub fails over."""
        if self._closing or peer in self.peers:
            return
        self.view.detours.pop(peer, None)
        self.stats.failures_detected += 1
        self._note_failure(peer)
        self._failed_since_view.add(peer)
        self.log.warning("neighbour %s lost (%s); healing", peer, why)
        self.view.forget(peer, self._now(), self.config.tombstone_ttl)
        self._after_forget()

    def _note_failure(self, peer: str) -> None:
        self.event("failure", peer=peer)
        info = self.view.nodes.get(peer)
        if info is not None:
            now = self._now()
            self._lost[peer] = (info, now + self.config.tombstone_ttl, REDIAL_FIRST, now + REDIAL_FOR)
            self._schedule_redial()
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
