"""The routed-message dispatch table (broker/routing.py) and the broker's registrations in it."""

from __future__ import annotations

import pytest

from broker.config import BrokerConfig
from broker.node import Broker
from broker.routing import MAX_LOCAL_DEPTH, DispatchTable, DuplicateHandler
from overlay.delegation import CoordOffer, CoordQuery
from overlay.protocol import Join, NodeInfo, Ping, RouteProbe, RouteReply, Status
from overlay.pubsub import Pull, Replicate, TopicRequest


def test_dispatch_by_class_and_refuse_a_second_registration() -> None:
    seen: list[object] = []
    t = DispatchTable()
    t.register(Ping, seen.append)
    assert t.dispatch(Ping(7)) and seen == [Ping(7)]
    with pytest.raises(DuplicateHandler, match="Ping"):
        t.register(Ping, seen.append)
    assert Ping in t and Status not in t


def test_a_message_nobody_handles_is_not_dispatched() -> None:
    t = DispatchTable()
    t.register(Ping, lambda m: None)
    assert t.dispatch(RouteReply(1, _node(), 0, ())) is False


def _node() -> NodeInfo:
    return NodeInfo("n", (0.5, 0.5), "127.0.0.1:1")


async def test_the_broker_registers_every_routed_message_it_handles_once() -> None:
    b = Broker(BrokerConfig(coord=(0.5, 0.5), insecure=True))
    for cls in (Join, RouteProbe, RouteReply, Ping, CoordQuery, CoordOffer, TopicRequest, Replicate, Pull):
        assert cls in b.routes, cls.__name__
    assert Status not in b.routes  # STATUS is a link request, never routed
    # Routed and unknown here: counted as a bad body and dropped, the read loop goes on.
    before = b.stats.dropped_bad_body
    b._handle_delivered(Status(1, b.info, (), (), (), {}, {}, 1), 1)
    assert b.stats.dropped_bad_body == before + 1 and b.stats.routed_delivered == 1


async def test_a_message_that_keeps_routing_back_here_is_dropped_not_a_recursion_error() -> None:
    # A broker with no neighbour is closest to every coordinate: what it routes is handled at once, in the same
    # call.  A handler that routes the message on again (as the home forwarding a request to a delegate
    # coordinate no neighbour leads to yet, while the overlay forms after a full restart) went round until the
    # RecursionError, which closed the link the first message came on (benchmarks/chaos.py, level 3, seed 75).
    b = Broker(BrokerConfig(coord=(0.5, 0.5), insecure=True))
    handled: list[Status] = []

    def route_again(m: Status) -> None:
        handled.append(m)
        b.send_routed((0.1, 0.1), m)

    b.routes.register(Status, route_again)
    before = b.stats.dropped_no_route
    b.send_routed((0.1, 0.1), Status(1, b.info, (), (), (), {}, {}, 1))
    assert len(handled) == MAX_LOCAL_DEPTH
    assert b.stats.dropped_no_route == before + 1
    b.send_routed((0.1, 0.1), Status(2, b.info, (), (), (), {}, {}, 1))  # the depth is back to 0 afterwards
    assert len(handled) == 2 * MAX_LOCAL_DEPTH
