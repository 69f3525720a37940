"""Crawl a live overlay: STATUS from one broker, then from the neighbours it reports, breadth first.

Used by `sedax brokers` (every broker, and whether the overlay is whole and every topic caught up), `sedax
topics` (the cluster's topics and their holders), `sedax balance --cluster` (every primary's dry run) and `sedax
viz` (the overlay picture); they only read what brokers report.  Neighbours that a
reachable broker reports but that cannot be reached themselves are returned as unreachable, with the
coordinate they were reported at.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from client.admin import DEFAULT_TIMEOUT, AdminClient, AdminError, BrokerUnavailable, Holdings
from client.errors import describe
from net.credentials import Credentials
from overlay.protocol import Status, TopicHeld

# Stop after this many brokers (a picture or a listing of more is no longer readable anyway).
MAX_CRAWL: Final = 10_000
# STATUS requests in flight at once.
CRAWL_PARALLEL: Final = 16


@dataclass(slots=True)
class Crawl:
    """What a crawl found: the STATUS of every reachable broker with every topic it holds (a STATUS lists only the
    first STATUS_PAGE), and the reported brokers that did not answer."""

    statuses: dict[str, Status] = field(default_factory=dict)  # by node id
    holdings: dict[str, Holdings] = field(default_factory=dict)  # by node id, as statuses
    unreachable: dict[str, tuple[float, float]] = field(default_factory=dict)  # node id -> reported coordinate

    @property
    def level(self) -> int:
        """The resilience level the brokers keep (the highest any reports; 1 if none answered)."""
        return max((st.resilience for st in self.statuses.values()), default=1)

    def lagging(self, topics: Iterable[str] = ()) -> list[str]:
        """lagging_topics of what the brokers that answered hold."""
        return lagging_topics({nid: h.held for nid, h in self.holdings.items()}, self.level, topics)


async def report(
    address: str,
    *,
    credentials: Credentials | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - as AdminClient's
) -> tuple[Status, Holdings]:
    """One broker's STATUS and every topic it holds, on one connection."""
    async with await AdminClient.connect(address, timeout=timeout, credentials=credentials) as client:
        st = await client.status()
        return st, await client.holdings(st)


async def crawl(
    address: str,
    *,
    credentials: Credentials | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - a bound on each connect and request, as AdminClient's
    max_brokers: int = MAX_CRAWL,
) -> Crawl:
    """Crawl the overlay from the broker at address; BrokerUnavailable if that first broker cannot be reached."""
    sem = asyncio.Semaphore(CRAWL_PARALLEL)

    async def fetch(addr: str) -> tuple[Status, Holdings]:
        async with sem:
            return await report(addr, credentials=credentials, timeout=timeout)

    found = Crawl()
    reported: dict[str, tuple[float, float]] = {}
    asked = {address}
    frontier: list[tuple[str | None, str]] = [(None, address)]
    while frontier and len(found.statuses) < max_brokers:
        results = await asyncio.gather(*(fetch(addr) for _, addr in frontier), return_exceptions=True)
        nxt: list[tuple[str | None, str]] = []
        for (node_id, addr), res in zip(frontier, results, strict=True):
            if isinstance(res, AdminError | OSError | TimeoutError):
                if node_id is None:
                    if isinstance(res, BrokerUnavailable):
                        raise res  # (it names the address already)
                    raise BrokerUnavailable(f"cannot reach broker at {addr}: {describe(res)}")
                found.unreachable[node_id] = reported.get(node_id, (0.0, 0.0))
                continue
            if isinstance(res, BaseException):
                raise res
            st, holdings = res
            found.statuses[st.node.id] = st
            found.holdings[st.node.id] = holdings
            for nb in st.neighbours:
                reported.setdefault(nb.id, (float(nb.coord[0]), float(nb.coord[1])))
                if nb.listen not in asked and nb.id not in found.statuses:
                    asked.add(nb.listen)
                    nxt.append((nb.id, nb.listen))
        frontier = nxt
    for nid in found.statuses:
        found.unreachable.pop(nid, None)
    return found


async def crawl_any(
    addresses: Sequence[str],
    *,
    credentials: Credentials | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - as crawl's
) -> tuple[Crawl, str]:
    """Crawl from the first of addresses that answers, as the tools take their broker list; returns the crawl
    and the address it started from.  The last broker's AdminError if none answers."""
    last: AdminError | None = None
    for addr in addresses:
        try:
            return await crawl(addr, credentials=credentials, timeout=timeout), addr
        except AdminError as exc:
            last = exc
    if last is None:
        raise BrokerUnavailable("no broker address given")
    raise last


# ------------------------------------------------------------------------------------ what a crawl says

# The roles that hold a topic's messages (a home only knows where the topic is).
COPY_ROLES: Final = frozenset({"primary", "delegate", "secondary", "tertiary"})


def link_gaps(coords: Mapping[str, Sequence[float]], links: Mapping[str, set[str]]) -> list[str]:
    """Where the brokers' established links differ from the Delaunay triangulation of their coordinates, one line
    per broker (empty: the overlay is whole, as each broker's neighbour maintenance promises once it settles).
    links: each broker's linked neighbours by id, for every broker of coords."""
    from overlay.geometry import delaunay_neighbour_map  # (here: numpy, only for this check)

    expected = delaunay_neighbour_map(coords)
    out = []
    for nid, want in sorted(expected.items()):
        have = links[nid]
        if have != want:
            out.append(f"{nid}: missing {sorted(want - have)}, extra {sorted(have - want)}")
    return out


def caught_up(h: TopicHeld) -> bool:
    """A replica level with its topic's other holders: `caught_up`, with no pull or offer under way."""
    return h.state == "caught_up" and h.pending == 0


def lagging_topics(held: Mapping[str, Iterable[TopicHeld]], level: int, topics: Iterable[str] = ()) -> list[str]:
    """Topics whose copies are not all caught up: a holder not `caught_up` or with pulls or offers pending, or
    fewer holders than the level keeps (as many as there are brokers, below it).  Empty: every topic the brokers
    hold is copied as docs/storage.md promises, and the next broker may be restarted.  held: every topic each
    broker holds (Holdings.held, not a STATUS's first page), by node id.  topics: topics known to exist, lagging
    also when no broker reports them."""
    copies: dict[str, list[TopicHeld]] = {t: [] for t in topics}
    for hs in held.values():
        for h in hs:
            if h.role in COPY_ROLES:
                copies.setdefault(h.topic, []).append(h)
    want = min(level, len(held))
    return sorted(t for t, hs in copies.items() if len(hs) < want or not all(caught_up(h) for h in hs))


def crl_gaps(statuses: Mapping[str, Status]) -> list[str]:
    """Brokers that check an older CRL than another broker does, or none while others check one, one line each
    (empty: all alike).  A broker that has not read the newest list still admits what it revokes; every broker
    should be given the same file (docs/security.md, "Revoking a certificate").  Told apart by when each list is
    due (STATUS `crl_next_update`): a CRL written later is due later."""
    due = {nid: st.crl_next_update for nid, st in statuses.items()}
    newest = max(due.values(), default=0.0)
    if not newest:
        return []
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(newest))
    out = []
    for nid, d in sorted(due.items()):
        if not d:
            out.append(f"{nid} checks no CRL (no --tls-crl, or a broker older than that report) while others do")
        elif d < newest:
            at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(d))
            out.append(
                f"{nid} checks an older CRL (due {at}) than the newest (due {when}): give it the new file and SIGHUP it"
            )
    return out


def overlay_gaps(found: Crawl, expect: int | None = None) -> list[str]:
    """What keeps a crawled overlay from being whole, one line each (empty: whole): brokers their neighbours
    report that did not answer, fewer brokers than expected (one that is down and that the overlay has healed
    around is reported by nobody), and links that differ from the Delaunay triangulation."""
    out = [
        f"{nid} (at {c[0]:.4f},{c[1]:.4f}) is reported by its neighbours but does not answer"
        for nid, c in sorted(found.unreachable.items())
    ]
    if expect is not None and len(found.statuses) != expect:
        out.append(f"{len(found.statuses)} brokers answered, {expect} expected (--expect)")
    coords = {nid: st.node.coord for nid, st in found.statuses.items()}
    links = {nid: {n.id for n in st.neighbours} for nid, st in found.statuses.items()}
    return out + link_gaps(coords, links)
