"""What one topic may hold, and that everything a broker sends about it fits a frame between brokers.

A REPLICATE carries a topic's subscriber list and publisher table beside its records, and a TOPIC_REPLY the
sessions of one DELIVER beside the payload.  Both used to be held to the client frame (1 MiB): one publish of
the largest payload to a topic with about a hundred subscribers made a frame too large to send, so the topic's
replication stalled or those subscribers never got the message.  Frames between brokers may now be
MAX_LINK_FRAME_SIZE, the sessions of a DELIVER are split over answers, and a topic takes at most
MAX_TOPIC_ENTRIES subscribers and publishers (`topic_full`), which with the longest ids still fit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import wait_for
from conftest import FAST_ARGS
from test_pubsub_memory import Net, delivered, grid, locate

from broker.defaults import MOVE_COOLDOWN
from broker.pubsub.core import SESSION_BYTES, session_groups
from cli.cluster import LocalCluster
from client.client import Client, ReceivedMessage
from client.errors import RequestFailed
from overlay.delegation import MoveTopic
from overlay.protocol import (
    MAX_ADDR_LEN,
    MAX_ID_LEN,
    MAX_LINK_FRAME_SIZE,
    MAX_LONG_LIST_LEN,
    NodeInfo,
    decode_message,
    encode_message,
)
from overlay.pubsub import (
    MAX_DELEGATES,
    MAX_PAYLOAD_SIZE,
    MAX_TOPIC_ENTRIES,
    Ack,
    Answer,
    Delegation,
    Deliver,
    Done,
    Failed,
    Nack,
    Publish,
    Record,
    Redirect,
    Replicate,
    SubRef,
    Subscribe,
    Subscribed,
    TopicReply,
    Unsubscribe,
    delegated,
    later,
)
from overlay.topics import MAX_TOPIC_LEN

TOPIC = "grid/limits/voltage"


def _longest_node(i: int) -> NodeInfo:
    """A broker with the longest id and listen address the protocol allows."""
    port = ":65535"
    host = f"h{i}-".ljust(MAX_ADDR_LEN - len(port), "x")
    return NodeInfo(f"n{i}-".ljust(MAX_ID_LEN, "x"), (0.123456789, 0.987654321), host + port)


def test_a_full_topic_with_the_longest_ids_and_the_largest_record_fits_one_frame_between_brokers() -> None:
    # The worst case MAX_TOPIC_ENTRIES is sized for: 1,000 access brokers with the longest ids and addresses,
    # one subscriber each with the longest session id, every other entry a publisher with the longest id and
    # the largest sequence number, a long delegate list, the longest topic name and the largest payload.
    topic = "t/" + "x" * (MAX_TOPIC_LEN - 2)
    groups = 1000
    subs = tuple(SubRef(_longest_node(i), f"s{i}-".ljust(MAX_ID_LEN, "s")) for i in range(groups))
    last_seq = {f"p{i}-".ljust(MAX_ID_LEN, "p"): 2**63 - 1 for i in range(MAX_TOPIC_ENTRIES - groups)}
    record = Record(1.7e9, "P".ljust(MAX_ID_LEN, "P"), 2**63 - 1, b"\xff" * MAX_PAYLOAD_SIZE)
    delegates = tuple(Delegation((0.5, i / 100), 1.7e9 + i) for i in range(100))
    msg = Replicate(
        2**63 - 1, topic, (0.5, 0.5), _longest_node(-1), (record,), subs, delegates, False, last_seq,
        delivered_upto=1.7e9, meta=True,
    )  # fmt: skip
    body = encode_message(msg, MAX_LINK_FRAME_SIZE)
    assert decode_message(body) == msg
    # ... and held to the client frame it would not have: what was sent before.
    with pytest.raises(Exception, match="over the frame limit"):
        encode_message(msg)


def test_subscribers_travel_grouped_by_their_access_broker() -> None:
    a, b = _longest_node(1), _longest_node(2)
    subs = (SubRef(a, "s1"), SubRef(b, "s2"), SubRef(a, "s3"))
    msg = Replicate(1, TOPIC, (0.5, 0.5), a, (), subs, (), False, {})
    back = decode_message(encode_message(msg))
    assert isinstance(back, Replicate)
    assert sorted(back.subscribers, key=lambda s: s.session) == sorted(subs, key=lambda s: s.session)
    # Each broker once: a subscriber costs its session id, not the broker's id, coordinate and address again.
    many = tuple(SubRef(a, f"abcdef-{i}") for i in range(10_000))
    size = len(encode_message(Replicate(1, TOPIC, (0.5, 0.5), a, (), many, (), False, {}), MAX_LINK_FRAME_SIZE))
    assert size < 10_000 * 14


def test_the_sessions_of_one_delivery_are_split_over_answers_that_each_fit() -> None:
    sessions = [f"{i:06x}-".ljust(MAX_ID_LEN, "s") for i in range(MAX_LONG_LIST_LEN + 5)]
    groups = session_groups(sessions)
    assert [s for g in groups for s in g] == sessions
    assert all(len(g) <= MAX_LONG_LIST_LEN and sum(len(s) + 2 for s in g) <= SESSION_BYTES for g in groups)
    body = encode_message(Deliver(TOPIC, (Record(1.7e9, "P", 0, b"x" * MAX_PAYLOAD_SIZE),)))
    for g in groups:
        reply = TopicReply("n".ljust(MAX_ID_LEN, "n"), (Answer(tuple(g), body),))
        encode_message(reply, MAX_LINK_FRAME_SIZE)  # raises if over


def _broker_sessions(n: int) -> list[str]:
    return [f"a1b2c3-{1000 + i}" for i in range(n)]  # as a broker names its sessions


@pytest.mark.parametrize("level", [1, 2])
def test_the_largest_payload_reaches_a_hundred_sessions_of_one_access_broker(level: int) -> None:
    # Before: one TOPIC_REPLY carried the DELIVER and its 150 sessions: over a frame, it was not sent, and
    # neither the subscribers nor the publisher (whose ACK went in the same reply) heard anything.
    net = Net(grid(10, seed=3), resilience=level)
    loc = locate(net, TOPIC)
    access = next(n for nid, n in net.nodes.items() if nid not in (loc.primary.id, getattr(loc.secondary, "id", "")))
    sessions = _broker_sessions(150)
    for s in sessions:
        access.request(s, Subscribe(1, TOPIC))
    access.request("p", Publish(TOPIC, "P", 0, b"x" * MAX_PAYLOAD_SIZE, 0))
    assert [m.seq for m in access.inbox["p"] if isinstance(m, Ack)] == [0]
    assert all([r.seq for r in delivered(access, s)] == [0] for s in sessions)


def test_a_subscriber_list_changed_in_the_turn_of_the_largest_payload_is_replicated_with_it() -> None:
    # Level 2: the subscriptions and the publish in one turn put the subscriber list (not yet confirmed by the
    # secondary) and the record in one REPLICATE.  Before, that was over a frame: dropped, and dropped again at
    # every re-send, so nothing of the topic was acknowledged any more.
    net = Net(grid(10, seed=3), resilience=2)
    loc = locate(net, TOPIC)
    assert loc.secondary is not None
    access = next(n for nid, n in net.nodes.items() if nid not in (loc.primary.id, loc.secondary.id))
    sessions = _broker_sessions(100)
    for s in [*sessions, "p"]:
        access.inbox.setdefault(s, [])
    for s in sessions:
        access.ps.client_message(s, Subscribe(1, TOPIC))
    access.ps.client_message("p", Publish(TOPIC, "P", 0, b"x" * MAX_PAYLOAD_SIZE, 0))
    net.run()
    assert [m.seq for m in access.inbox["p"] if isinstance(m, Ack)] == [0]
    assert all([r.seq for r in delivered(access, s)] == [0] for s in sessions)
    assert len(net.nodes[loc.secondary.id].ps.table.replicas[TOPIC].subscribers) == len(sessions)


def test_a_full_topic_refuses_a_new_subscriber_or_publisher_and_serves_the_others() -> None:
    net = Net(grid(10, seed=3), resilience=2, max_topic_entries=3)
    loc = locate(net, TOPIC)
    assert loc.secondary is not None
    access = next(n for nid, n in net.nodes.items() if nid not in (loc.primary.id, loc.secondary.id))
    access.request("p", Publish(TOPIC, "P", 0, b"m0", 0))  # one publisher
    access.request("s1", Subscribe(1, TOPIC))
    access.request("s2", Subscribe(2, TOPIC))  # three entries: full
    access.request("s3", Subscribe(3, TOPIC))
    (refusal,) = access.inbox["s3"]
    assert isinstance(refusal, Failed) and refusal.code == "topic_full"
    assert "2 subscribers and 1 publishers" in refusal.text and "--max-topic-entries" in refusal.text
    access.request("q", Publish(TOPIC, "Q", 0, b"q0", 0))
    (nack,) = access.inbox["q"]
    assert isinstance(nack, Nack) and nack.code == "topic_full" and nack.seq == 0
    access.request("p", Publish(TOPIC, "P", 1, b"m1", 0))  # a publisher it holds goes on
    assert [m.seq for m in access.inbox["p"] if isinstance(m, Ack)] == [0, 1]
    assert [r.seq for r in delivered(access, "s1")] == [1]
    primary = net.nodes[loc.primary.id].ps
    assert primary.counters["topic_full"] == 2
    assert "Q" not in primary.store.get(TOPIC).last_seq
    # Room again once a subscriber leaves; the refused session was not left subscribed at its access broker.
    access.request("s2", Unsubscribe(4, TOPIC))
    access.request("s3", Subscribe(5, TOPIC))
    assert isinstance(access.inbox["s3"][-1], Subscribed)
    access.request("p", Publish(TOPIC, "P", 2, b"m2", 0))
    assert [r.seq for r in delivered(access, "s3")] == [2]
    assert len(net.nodes[loc.secondary.id].ps.table.replicas[TOPIC].subscribers) == 2
    # The refused publisher, let in once there is room, goes on from its next number: what was refused is not
    # counted as lost.
    access.request("s3", Unsubscribe(6, TOPIC))
    access.request("q", Publish(TOPIC, "Q", 1, b"q1", 1))
    assert [m.seq for m in access.inbox["q"] if isinstance(m, Ack)] == [1]
    assert [(r.publisher, r.seq) for r in delivered(access, "s1")][-1] == ("Q", 1)
    assert primary.counters["lost"] == 0


def test_a_topic_moved_more_often_than_its_delegate_list_holds_keeps_its_home_and_latest_moves() -> None:
    # Before, every move appended to the delegate list for good: moved at every cool-down, a topic's list
    # outgrew what a message may carry within nine hours, and its meta grew with it in every REPLICATE.
    net = Net(grid(10, seed=8), resilience=2)
    home = locate(net, TOPIC).coord
    sites = [n.me.coord for n in net.nodes.values() if n.me.coord != home][:2]
    sub, pub = net.nodes["n0"], net.nodes["n1"]
    sub.request("s", Subscribe(1, TOPIC))
    pub.request("p", Publish(TOPIC, "P", 0, b"m0", 0))
    moves = MAX_DELEGATES + 6
    for i in range(moves):
        pub.request("adm", MoveTopic(100 + i, TOPIC, sites[i % 2]))
        assert isinstance(pub.inbox["adm"][-1], Done), pub.inbox["adm"][-1]
        net.tick(MOVE_COOLDOWN + 1.0)
    loc = locate(net, TOPIC)
    assert len(loc.delegates) == MAX_DELEGATES
    assert loc.delegates[0].coord == home and loc.delegates[-1].coord == sites[(moves - 1) % 2] == loc.coord
    starts = [d.start for d in loc.delegates]
    assert starts == sorted(starts) and starts[1] > starts[0]
    pub.request("p", Publish(TOPIC, "P", 1, b"m1", 0))
    assert [r.seq for r in delivered(sub, "s")] == [0, 1]
    assert [m.seq for m in pub.inbox["p"] if isinstance(m, Ack)][-1] == 1


def test_a_move_is_later_than_the_one_before_even_when_the_movers_clock_is_behind() -> None:
    # Two copies of a topic at different coordinates (one left behind by a move) are told apart by their lists'
    # last starts; each broker stamps the moves it makes with its own clock, so a move by a broker whose clock is
    # behind must still come out later than the move before it.
    home = [Delegation((0.5, 0.5), 0.0)]
    first = delegated(home, (0.1, 0.1), 1000.0)
    behind = delegated(first, (0.9, 0.9), 990.0)
    assert behind[-1].start > first[-1].start
    assert later(behind, first) and later(first, home) and later(first, ())
    assert not later(first, behind) and not later(first, first) and not later((), home)


def test_a_topic_with_more_than_1024_sessions_at_one_access_broker_redirects_each_of_them_when_it_moves() -> None:
    # TOPIC_MOVED names the sessions of one access broker that the moved topic concerns; its decoder held them
    # to 1,024, so a move of a topic with 1,100 subscribers there was dropped as a bad message at that broker.
    net = Net(grid(10, seed=8), resilience=2)
    loc = locate(net, TOPIC)
    access = next(n for nid, n in net.nodes.items() if nid not in (loc.primary.id, getattr(loc.secondary, "id", "")))
    to = next(n.me.coord for n in net.nodes.values() if n is not access and n.me.id != loc.primary.id)
    sessions = _broker_sessions(1100)
    for s in sessions:
        access.request(s, Subscribe(1, TOPIC))
    access.request("adm", MoveTopic(2, TOPIC, to))
    assert isinstance(access.inbox["adm"][-1], Done)
    assert all(any(isinstance(m, Redirect) and m.coord == to for m in access.inbox[s]) for s in sessions)
    access.request("p", Publish(TOPIC, "P", 0, b"after the move", 0))
    assert all([r.seq for r in delivered(access, s)] == [0] for s in sessions)


# ---- real brokers ---------------------------------------------------------------------------------------------


async def test_a_full_topic_tells_the_client_what_to_do_and_serves_the_others(tmp_path: Path) -> None:
    topic = TOPIC
    args = (*FAST_ARGS, "--max-topic-entries", "3")
    async with LocalCluster(3, seed=5, resilience=2, state_dir=tmp_path, broker_args=args, tls=False) as c:
        await c.wait_converged(30.0)
        addrs = [bp.listen for bp in c.nodes]
        got: dict[str, list[bytes]] = {"s1": [], "s2": [], "s3": []}

        def into(name: str) -> Callable[[ReceivedMessage], None]:
            return lambda m: got[name].append(m.payload)

        async with (
            Client(addrs[:1], client_id="p") as p,
            Client(addrs[1:2], client_id="q") as q,
            Client(addrs[1:2]) as s1,
            Client(addrs[2:]) as s2,
            Client(addrs[2:]) as s3,
        ):
            await p.publish(topic, b"m0")
            await s1.subscribe(topic, on_message=into("s1"))
            sub2 = await s2.subscribe(topic, on_message=into("s2"))
            with pytest.raises(RequestFailed, match="topic_full") as refused:
                await s3.subscribe(topic, on_message=into("s3"))
            assert "--max-topic-entries" in str(refused.value)
            with pytest.raises(RequestFailed, match="topic_full"):
                await q.publish(topic, b"q0")
            await p.publish(topic, b"m1")
            await wait_for(lambda: got["s1"] == [b"m1"] and got["s2"] == [b"m1"], 10.0, "m1 at both subscribers")
            await sub2.aclose()  # room for one more: the refused client subscribes on the same connection
            await s3.subscribe(topic, on_message=into("s3"))
            await p.publish(topic, b"m2")
            await wait_for(lambda: got["s3"] == [b"m2"] and got["s1"] == [b"m1", b"m2"], 10.0, "m2 at s1 and s3")


async def test_the_largest_payload_reaches_150_subscribers_of_one_access_broker(tmp_path: Path) -> None:
    # Level 2, real sockets: 150 sessions of one access broker, one publish of the largest payload from
    # another.  Before, the TOPIC_REPLY with the DELIVER and the 150 sessions was over the frame: not sent
    # (sedax_dropped_messages_total{reason="too_large"}), so nobody got the message and it was never acknowledged.
    topic, n = TOPIC, 150
    async with LocalCluster(4, seed=5, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS, tls=False) as c:
        await c.wait_converged(30.0)
        async with Client([bp.listen for bp in c.nodes]) as probe:
            loc = await probe.locate(topic)
        assert loc.secondary is not None
        others = [bp.listen for bp in c.nodes if bp.node_id not in (loc.primary.id, loc.secondary.id)]
        payload = bytes(range(256)) * (MAX_PAYLOAD_SIZE // 256) + b"\x00" * (MAX_PAYLOAD_SIZE % 256)
        got = [0] * n
        subscribers: list[Client] = []
        try:
            for i in range(n):
                sc = Client(others[:1])
                await sc.__aenter__()
                subscribers.append(sc)

                def count(m: ReceivedMessage, i: int = i) -> None:
                    got[i] += m.payload == payload

                await sc.subscribe(topic, on_message=count)
            async with Client([loc.primary.listen]) as pub:
                async with asyncio.timeout(20):
                    await pub.publish(topic, payload)
            await wait_for(lambda: sum(got) == n, 20.0, f"the message at all {n} subscribers")
            assert got == [1] * n
        finally:
            for sc in subscribers:
                await sc.aclose()
