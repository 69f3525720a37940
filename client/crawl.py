"""Crawl a live overlay: STATUS from one broker, then from the neighbours it reports, breadth first.

Used by `sedax topics` (the cluster's topics and their holders), `sedax balance --cluster` (every primary's
dry run) and `sedax viz` (the overlay picture); they only read what brokers report.  Neighbours that a
reachable broker reports but that cannot be reached themselves are returned as unreachable, with the
coordinate they were reported at.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from client.admin import DEFAULT_TIMEOUT, AdminClient, AdminError, BrokerUnavailable
from client.errors import describe
from net.credentials import Credentials
from overlay.protocol import Status

# Stop after this many brokers (a picture or a listing of more is no longer readable anyway).
MAX_CRAWL: Final = 10_000
# STATUS requests in flight at once.
CRAWL_PARALLEL: Final = 16


@dataclass(slots=True)
class Crawl:
    """What a crawl found: the STATUS of every reachable broker, and the reported ones that did not answer."""

    statuses: dict[str, Status] = field(default_factory=dict)  # by node id
    unreachable: dict[str, tuple[float, float]] = field(default_factory=dict)  # node id -> reported coordinate


async def crawl(
    address: str,
    *,
    credentials: Credentials | None = None,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - a bound on each connect and request, as AdminClient's
    max_brokers: int = MAX_CRAWL,
) -> Crawl:
    """Crawl the overlay from the broker at address; BrokerUnavailable if that first broker cannot be reached."""
    sem = asyncio.Semaphore(CRAWL_PARALLEL)

    async def fetch(addr: str) -> Status:
        async with sem, await AdminClient.connect(addr, timeout=timeout, credentials=credentials) as client:
            return await client.status()

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
            found.statuses[res.node.id] = res
            for nb in res.neighbours:
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
