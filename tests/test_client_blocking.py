"""BlockingClient (client/blocking.py) from plain, synchronous code against real brokers: no event loop in the
test's thread, every call waiting for its answer, the async client's guarantees kept."""

from __future__ import annotations

import threading
import uuid

import pytest

from cli.cluster import LocalCluster
from client.blocking import HANDOFF_LIMIT, READ_BATCH, BlockingClient
from client.errors import ClientClosed, ConnectError, RequestFailed


def _topic(name: str) -> str:
    return f"grid/blocking/{name}-{uuid.uuid4().hex[:8]}"


def _addrs(cluster: LocalCluster) -> list[str]:
    return [bp.listen for bp in cluster.nodes]


def test_publish_subscribe_fetch_and_locate_block_until_answered(cluster3: LocalCluster) -> None:
    topic = _topic("basic")
    with BlockingClient(_addrs(cluster3), credentials=cluster3.credentials()) as c:
        assert c.address in _addrs(cluster3)
        acks = [c.publish(topic, f"{230 + i / 10:.1f}") for i in range(3)]
        assert [a.seq for a in acks] == [0, 1, 2] and all(a.topic == topic for a in acks)
        assert [r.payload for r in c.fetch(topic)] == [b"230.0", b"230.1", b"230.2"]
        assert c.locate(topic).primary is not None
        with c.subscribe(topic, since=0) as sub:  # the stored messages first, then the live ones
            got = [sub.get(30.0) for _ in range(3)]
            assert [m.payload for m in got if m is not None] == [b"230.0", b"230.1", b"230.2"]
            assert sub.get(0.2) is None  # nothing more yet: None after the time-out, and the read stays pending
            c.publish(topic, b"230.3")
            live = sub.get(30.0)
            assert live is not None and (live.seq, live.payload) == (3, b"230.3")
        assert sub.get(0.1) is None  # closed: the subscription has ended


def test_pipelined_publishes_keep_their_order_and_a_large_replay_loses_nothing(cluster3: LocalCluster) -> None:
    # publish_nowait from one thread: futures resolved on the client's thread, sequence numbers in call order.
    # The replay from 0 of twelve times what the client's queue holds, read on another thread: the catch-up
    # waits for the reader (pulled page by page), nothing dropped.
    topic, n = _topic("pipelined"), 3 * READ_BATCH + 17
    with BlockingClient(_addrs(cluster3), credentials=cluster3.credentials(), subscription_queue=64) as c:
        futures = [c.publish_nowait(topic, str(i)) for i in range(n)]
        assert [f.result(60.0).seq for f in futures] == list(range(n))
        assert c.unacknowledged == 0
        with c.subscribe(topic, since=0) as sub:
            seen = [m for _, m in zip(range(n), sub, strict=False)]
            assert [int(m.payload) for m in seen] == list(range(n))
            assert sub.dropped == 0


def test_a_refusal_is_raised_in_the_callers_thread_and_close_ends_the_thread(cluster3: LocalCluster) -> None:
    before = {t.ident for t in threading.enumerate()}
    c = BlockingClient(_addrs(cluster3), credentials=cluster3.credentials())
    mine = [t for t in threading.enumerate() if t.ident not in before and t.name == "sedax-client"]
    assert len(mine) == 1
    with pytest.raises(ValueError, match="topic"):
        c.publish("", b"x")  # a bad name: refused by the client before anything is sent
    topic = _topic("dup")
    c.subscribe(topic)
    with pytest.raises(RequestFailed, match="already subscribed"):
        c.subscribe(topic)
    c.close()
    c.close()  # a second close does nothing
    assert not mine[0].is_alive()
    with pytest.raises(ClientClosed):
        c.publish(_topic("after"), b"x")


def test_no_broker_answering_is_a_connect_error_and_leaves_no_thread() -> None:
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConnectError):
        BlockingClient(["127.0.0.1:1"], connect_timeout=1.0, reconnect=False)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "sedax-client"]


def test_a_reader_waiting_when_the_client_closes_gets_the_end(cluster3: LocalCluster) -> None:
    # A thread blocked in `for msg in sub` while another closes the client: its loop ends, it does not hang.
    c = BlockingClient(_addrs(cluster3), credentials=cluster3.credentials())
    sub = c.subscribe(_topic("closing"))
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.extend(sub), name="reader")
    reader.start()
    c.close()
    reader.join(30.0)
    assert not reader.is_alive() and got == []


def test_calling_the_client_from_on_message_is_refused_not_a_deadlock(cluster3: LocalCluster) -> None:
    # on_message runs on the client's thread: a blocking call there would wait for that thread forever.
    topic, errors = _topic("callback"), []
    done = threading.Event()
    with BlockingClient(_addrs(cluster3), credentials=cluster3.credentials()) as c:

        def on_message(msg: object) -> None:
            try:
                c.publish(_topic("echo"), b"x")
            except RuntimeError as exc:
                errors.append(str(exc))
            done.set()

        with c.subscribe(topic, on_message=on_message):
            c.publish(topic, b"1")
            assert done.wait(30.0)
    assert len(errors) == 1 and "would wait for itself forever" in errors[0], errors


def test_closing_waits_for_the_publishes_handed_over_and_orders_them_with_publish(cluster3: LocalCluster) -> None:
    # publish_nowait returns before the client's thread took the message; publish after it still comes after it,
    # and leaving `with` sends and acknowledges every one handed over (as the async client's close does).
    topic, n = _topic("handoff"), HANDOFF_LIMIT + 1000  # (more than the hand-off holds at once)
    with BlockingClient(_addrs(cluster3), credentials=cluster3.credentials()) as c:
        futures = [c.publish_nowait(topic, str(i)) for i in range(n)]
        last = c.publish(topic, str(n))
    assert last.seq == n and [f.result(0).seq for f in futures] == list(range(n))  # all resolved by the close
    with BlockingClient(_addrs(cluster3), credentials=cluster3.credentials()) as c:
        assert [int(r.payload) for r in c.fetch(topic)] == list(range(n + 1))
