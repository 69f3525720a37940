"""Delaunay maintenance for one broker, without I/O: what a node knows and which neighbours it wants.

A broker's view holds itself, its linked neighbours with the neighbour lists they advertise (2-hop
knowledge), and candidates (nodes learned from a JOIN_ACCEPT or from a failed or departed neighbour).  The
desired neighbour set is the set of Delaunay neighbours of self in the triangulation of everything known.

Why this is enough (Liebeherr et al., IEEE JSAC 2002; Lee & Lam, ICDCS 2007): a Delaunay edge of the whole
point set is still a Delaunay edge of any subset holding both ends, and the star of triangles around a node
in the full triangulation stays empty-circled in a subset, so the local triangulation of any superset of the
node's true neighbours yields exactly the true neighbours.  Once links and adverts are consistent, the
2-hop set is such a superset; after a failure the dead node's former neighbours (kept as candidates) are
the only nodes that can gain an edge to us, so they fill the hole.

Time enters only as numbers passed in by the caller (tombstone expiry), so the view is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from overlay.geometry import Coord, delaunay_neighbours_of
from overlay.protocol import NodeInfo

# At most this many destinations' routes are remembered (NeighbourView.route); beyond it they are computed afresh.
ROUTE_CACHE = 4096


@dataclass
class NeighbourView:
    """One broker's knowledge of the overlay around it.

    Attributes:
        me: this broker.
        nodes: every node known by id (self excluded), with coordinate and listen address.
        linked: ids with an established link (the greedy forwarding table).
        adverts: for each linked node, the neighbour ids it last advertised.
        candidates: ids learned from a JOIN_ACCEPT or a lost neighbour, kept until linked or not wanted.
        tombstones: ids known to be gone, with the time their tombstone expires.  A stale advert of a
            neighbour that has not noticed the failure yet must not bring a dead node back.
        withheld: what is known of tombstoned nodes (their last NodeInfo), kept out of `nodes` meanwhile.  A
            neighbour advertises only when its own neighbours change, so an advert that lists such a node is
            not sent again when the tombstone lapses: the node then comes back from here (`expire`) if a
            linked neighbour's advert still lists it, or it would stay unknown for good.
    """

    me: NodeInfo
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    linked: set[str] = field(default_factory=set)
    adverts: dict[str, frozenset[str]] = field(default_factory=dict)
    candidates: set[str] = field(default_factory=set)
    tombstones: dict[str, float] = field(default_factory=dict)
    withheld: dict[str, NodeInfo] = field(default_factory=dict)
    # Alive nodes whose link from here is broken (a common neighbour still hears them, SUSPECT/WITNESS): node
    # -> the linked neighbour that forwards toward it.  They stay in the view (nothing fails over) and greedy
    # forwarding treats them as reachable through that neighbour.
    detours: dict[str, str] = field(default_factory=dict)
    # (next hop, x, y, node): one entry per linked node and per detour
    _route: list[tuple[str, float, float, str]] = field(default_factory=list)
    # route()'s answers for the current table, by destination: a routed frame is addressed to a topic's or a
    # broker's coordinate, so a busy broker asks about the same few again and again (a 3-hop level-2 message
    # asks 12 times across its brokers).  Emptied whenever the table changes.
    _routes: dict[tuple[float, float], tuple[str | None, float]] = field(default_factory=dict)
    # `knows_closer`'s answers by destination, and the known nodes it compares (id, x, y); both emptied whenever
    # what the view knows changes (`_known_changed`).
    _closer: dict[tuple[float, float], bool] = field(default_factory=dict)
    _known_points: list[tuple[str, float, float]] | None = None
    # True once the caller found every Delaunay neighbour linked or detoured (`settle`), False again after any
    # change of what is known.  While True, greedy forwarding reaches whatever is closer than self, so a message
    # that stops here is at its destination and `knows_closer` need not be asked (routing asks it otherwise).
    settled: bool = False
    # Counts the changes of what is known: an answer that depends on it holds while this is unchanged.
    version: int = 0

    # ----------------------------------------------------------------------------------------- updates

    def _note(self, info: NodeInfo) -> bool:
        if info.id == self.me.id or info.id in self.tombstones:
            return False
        self.nodes[info.id] = info
        return True

    def link_up(self, info: NodeInfo) -> None:
        """A link to info is established: it is a forwarding neighbour and is alive (tombstone cleared)."""
        if info.id == self.me.id:
            return
        self.tombstones.pop(info.id, None)
        self.withheld.pop(info.id, None)
        self.nodes[info.id] = info
        self.linked.add(info.id)
        self.candidates.discard(info.id)
        self.detours.pop(info.id, None)
        self._rebuild_route()

    def learn(self, node_id: str, neighbours: Iterable[NodeInfo]) -> None:
        """Record the neighbour list advertised by the linked node node_id (its NEIGHBOURS message)."""
        if node_id not in self.linked:
            return
        ids: set[str] = set()
        for info in neighbours:
            if info.id in self.tombstones:
                self.withheld[info.id] = info  # listed all the same: known again once the tombstone lapses
            elif info.id != self.me.id:
                self.nodes[info.id] = info
            ids.add(info.id)
        self.adverts[node_id] = frozenset(ids)
        self._known_changed()

    def add_candidates(self, infos: Iterable[NodeInfo]) -> None:
        """Nodes worth considering as neighbours (JOIN_ACCEPT view, LEAVE list of a departing neighbour)."""
        for info in infos:
            if self._note(info) and info.id not in self.linked:
                self.candidates.add(info.id)
        self._known_changed()

    def unlink(self, node_id: str) -> None:
        """The link to node_id closed although the node is alive (not a Delaunay edge any more)."""
        self.linked.discard(node_id)
        self.adverts.pop(node_id, None)
        self._rebuild_route()

    def forget(self, node_id: str, now: float, ttl: float) -> None:
        """node_id failed or left: drop it and its advert, keep its former neighbours as candidates.

        The node is tombstoned until now + ttl so adverts that still list it do not resurrect it.
        """
        advert = self.adverts.pop(node_id, frozenset())
        self.linked.discard(node_id)
        self.candidates.discard(node_id)
        info = self.nodes.pop(node_id, None)
        if info is not None:
            self.withheld[node_id] = info
        self.detours.pop(node_id, None)
        self.tombstones[node_id] = now + ttl
        for other in advert:
            if other != self.me.id and other in self.nodes and other not in self.linked:
                self.candidates.add(other)
        self._rebuild_route()

    def expire(self, now: float) -> bool:
        """Drop tombstones older than now; True if any expired (the known set may grow again).

        A node whose tombstone lapses is known again if a linked neighbour's advert lists it (`withheld`).
        """
        gone = [k for k, t in self.tombstones.items() if t <= now]
        for k in gone:
            del self.tombstones[k]
            info = self.withheld.pop(k, None)
            if info is not None and any(k in advert for advert in self.adverts.values()):
                self.nodes[info.id] = info
        if gone:
            self._known_changed()
        return bool(gone)

    def prune(self, keep: set[str]) -> None:
        """Drop candidates not in keep and nodes no longer referenced by links, adverts or candidates."""
        self.candidates &= keep
        referenced = set(self.linked) | self.candidates
        for advert in self.adverts.values():
            referenced |= advert
        for k in [k for k in self.nodes if k not in referenced]:
            del self.nodes[k]
        # (`knows_closer` cannot change here: a pruned node is no Delaunay neighbour, and a node closer to a point
        # than self that is no Delaunay neighbour implies one that is; emptied all the same, for `_known_points`.)
        self._known_changed()

    # --------------------------------------------------------------------------------------- queries

    def known(self) -> dict[str, Coord]:
        """Coordinates of self, linked nodes, their advertised neighbours and candidates (no tombstones)."""
        ids = set(self.linked) | self.candidates
        for k in self.linked:
            ids |= self.adverts.get(k, frozenset())
        ids.discard(self.me.id)
        out: dict[str, Coord] = {self.me.id: self.me.coord}
        for k in ids:
            info = self.nodes.get(k)
            if info is not None and k not in self.tombstones:
                out[k] = info.coord
        return out

    def desired(self) -> set[str]:
        """Delaunay neighbours of self in the triangulation of every known node."""
        known = self.known()
        if len(known) == 1:
            return set()
        return delaunay_neighbours_of(self.me.id, known)

    def infos(self, ids: Iterable[str]) -> list[NodeInfo]:
        """NodeInfo of each known id (unknown ids skipped), ordered by id for stable messages."""
        return [self.nodes[k] for k in sorted(ids) if k in self.nodes]

    def detour(self, node_id: str, via: str) -> None:
        """node_id is alive but its link from here is broken: forward toward it through the linked `via`."""
        if node_id in self.nodes and via in self.linked and node_id not in self.linked:
            self.detours[node_id] = via
            self._rebuild_route()

    def _rebuild_route(self) -> None:
        for k in [k for k, via in self.detours.items() if via not in self.linked or k not in self.nodes]:
            del self.detours[k]  # the neighbour it went through is gone: the next SUSPECT decides again
        entries = [(k, *self.nodes[k].coord, k) for k in self.linked]
        entries += [(via, *self.nodes[k].coord, k) for k, via in self.detours.items()]
        self._route = sorted(entries, key=lambda e: e[3])
        self._routes.clear()
        self._known_changed()

    def _known_changed(self) -> None:
        self._closer.clear()
        self._known_points = None
        self.settled = False
        self.version += 1

    def settle(self, desired: set[str]) -> None:
        """desired is `desired()` of the view as it is now: note whether each of them is linked or detoured.

        If so, no point has a known node closer than self while no link leads closer: a Delaunay edge of the
        known set holds for every point that is closer to some known node than self a neighbour that is closer
        too (greedy routing on a Delaunay triangulation), and that neighbour is linked or detoured.
        """
        self.settled = all(k in self.linked or k in self.detours for k in desired)

    def next_hop(self, x: float, y: float) -> str | None:
        """Greedy forwarding over linked neighbours: the one closest to (x, y), or None if self is closest.

        Same rule and tie-break as `overlay.geometry.greedy_next_hop` (distance, then id), inlined because
        it runs for every routed frame.  A detoured node (`detours`) counts at its own coordinate and is
        reached through its neighbour.
        """
        return self.route(x, y)[0]

    def knows_closer(self, x: float, y: float) -> bool:
        """True if the view knows a node closer to (x, y) than self, linked or not (same distance and tie-break,
        then id, as `route`).

        Where `route` finds no neighbour closer than self and this is True, the closer node is a Delaunay
        neighbour not linked yet (as while the overlay forms after a restart): in a linked Delaunay overlay
        greedy forwarding always finds a closer neighbour when any node is closer.  A message that stops here
        then is here too early, not at its destination (broker/routing.py holds it).
        """
        answer = self._closer.get((x, y))
        if answer is not None:
            return answer
        points = self._known_points
        if points is None:
            known = self.known()
            del known[self.me.id]
            points = self._known_points = [(k, cx, cy) for k, (cx, cy) in known.items()]
        me_d = math.hypot(self.me.coord[0] - x, self.me.coord[1] - y)
        me_id = self.me.id
        answer = False
        for k, cx, cy in points:
            d = math.hypot(cx - x, cy - y)
            if d < me_d or (d == me_d and k < me_id):
                answer = True
                break
        if len(self._closer) >= ROUTE_CACHE:
            self._closer.clear()
        self._closer[(x, y)] = answer
        return answer

    def route(self, x: float, y: float) -> tuple[str | None, float]:
        """(next hop, distance to (x, y) of the node it leads to): `next_hop` and how close that gets."""
        known = self._routes.get((x, y))
        if known is not None:
            return known
        best_id: str | None = None
        best_key = self.me.id
        best_d = math.hypot(self.me.coord[0] - x, self.me.coord[1] - y)
        for hop, nx, ny, k in self._route:
            d = math.hypot(nx - x, ny - y)
            if d < best_d or (d == best_d and k < best_key):
                best_d, best_key, best_id = d, k, hop
        if len(self._routes) >= ROUTE_CACHE:
            self._routes.clear()  # destinations beyond the bound (many topics): start again, never grow
        answer = self._routes[(x, y)] = (best_id, best_d)
        return answer
