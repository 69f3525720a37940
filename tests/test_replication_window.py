"""Pipelined replication (REPLICATION_WINDOW): several REPLICATE batches per topic in flight, confirmed in
order, acknowledgements released in order, lost batches re-sent, nothing acknowledged lost when a holder dies
with a full window.  First on the in-memory overlay of test_pubsub_memory (messages held back, dropped and
re-ordered at will), then on real brokers."""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import wait_for
from conftest import FAST_ARGS
from test_pubsub_memory import Net, _near, delivered, grid, locate

from broker.pubsub.core import PeerProgress
from broker.pubsub.replica import Replica, Stage
from broker.pubsub.settings import (
    ANTI_ENTROPY_INTERVAL,
    BULK_WINDOW,
    MAX_RTO,
    OFFER_TIMEOUT,
    PULL_TIMEOUT,
    PULL_WAIT_MAX,
    REDELIVER_WINDOW,
    REPLICATION_WINDOW,
    RERANK_SLICE,
    SYNC_CHUNK,
    SYNC_WINDOW,
)
from broker.store import Retention
from broker.sweep import SWEEP_PERIOD
from cli.cluster import LocalCluster
from client.admin import AdminClient
from client.client import Client, PublishAck
from overlay.geometry import Coord, closest, geohash
from overlay.protocol import Message, decode_message
from overlay.pubsub import Ack, Fetch, Fetched, Offer, Publish, Pull, Record, Replicate, Replicated, Subscribe

TOPIC = "grid/window/voltage"


class HoldNet(Net):
    """The in-memory overlay, where messages the `hold` predicate picks are set aside (to be released later in
    any order, or never: lost)."""

    def __init__(self, coords: list[Coord], resilience: int) -> None:
        super().__init__(coords, resilience)
        self.hold: Callable[[str, Message], bool] = lambda to, m: False
        self.held: list[tuple[Coord, bytes]] = []

    def run(self) -> None:
        while self.queue or self.deferred:
            if not self.queue:
                self.deferred.popleft()()
                continue
            dest, body = self.queue.popleft()
            if dest in self.blackhole:
                continue
            target = closest({k: v.coord for k, v in self.live().items()}, dest)[0]
            msg = decode_message(body)
            if self.hold(target, msg):
                self.held.append((dest, body))
                continue
            assert self.nodes[target].ps.routed(msg)

    def release(self, item: tuple[Coord, bytes]) -> None:
        """Deliver a held message now (past the `hold` predicate), and what follows from it."""
        self.held.remove(item)
        dest, body = item
        target = closest({k: v.coord for k, v in self.live().items()}, dest)[0]
        assert self.nodes[target].ps.routed(decode_message(body))
        self.run()


def _setup(level: int) -> tuple[HoldNet, str, str, str]:
    """A net, the topic's primary and secondary, and a publisher's broker that holds no copy."""
    net = HoldNet(grid(10, seed=3), resilience=level)
    loc = locate(net, TOPIC)
    assert loc.secondary is not None
    holders = {loc.primary.id, loc.secondary.id} | ({loc.tertiary.id} if loc.tertiary else set())
    pub = next(nid for nid in net.nodes if nid not in holders)
    return net, loc.primary.id, loc.secondary.id, pub


def _acked(net: Net, pub: str) -> int:
    return max((m.seq for m in net.nodes[pub].inbox.get("p", []) if isinstance(m, Ack)), default=-1)


def _confirmations_to(primary: str) -> Callable[[str, Message], bool]:
    return lambda to, m: to == primary and isinstance(m, Replicated)


@pytest.mark.parametrize("level", [2, 3])
def test_batches_pipeline_and_are_acknowledged_in_order(level: int) -> None:
    net, primary, _, pub = _setup(level)
    sub = net.nodes[pub]
    sub.request("s", Subscribe(1, TOPIC))
    ps = net.nodes[primary].ps
    net.hold = _confirmations_to(primary)
    n = REPLICATION_WINDOW + 4
    for i in range(n):  # one message per turn: one batch each while the window has room
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, f"m{i}".encode(), 0))
    # The window is full: REPLICATION_WINDOW batches are in flight, the rest waits in the outbox.
    assert len(net.held) == REPLICATION_WINDOW
    assert ps.counters["replicated_batches"] == REPLICATION_WINDOW + 1  # the subscription's batch came first
    assert ps.counters["replicated_pipelined"] == REPLICATION_WINDOW - 1
    assert _acked(net, pub) == -1 and delivered(sub, "s") == []
    # Confirmations arrive newest first: nothing is acknowledged until the oldest batch is confirmed too.
    first, *rest = net.held
    for item in reversed(rest):
        net.release(item)
        assert _acked(net, pub) == -1 and delivered(sub, "s") == []
    net.hold = lambda to, m: False
    net.release(first)
    # Then all of it, in order, and the messages that waited went as one batch.
    assert _acked(net, pub) == n - 1
    assert [r.seq for r in delivered(sub, "s")] == list(range(n))
    assert ps.counters["replicated_batches"] == REPLICATION_WINDOW + 2
    assert not ps.table.replicas[TOPIC].window


@pytest.mark.parametrize("level", [2, 3])
def test_a_lost_batch_holds_the_acknowledgements_back_until_it_is_resent(level: int) -> None:
    net, primary, _, pub = _setup(level)
    ps = net.nodes[primary].ps

    def lose_seq_2(to: str, m: Message) -> bool:
        # The first batch that carries seq 2 (the re-send carries it again and gets through).
        return (
            not net.held and isinstance(m, Replicate) and m.origin.id == primary and any(r.seq == 2 for r in m.records)
        )

    net.hold = lose_seq_2
    for i in range(6):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, f"m{i}".encode(), 0))
    assert len(net.held) == 1
    net.hold = lambda to, m: False
    net.held.clear()  # lost on the way
    # The batches after the lost one were confirmed, but an acknowledgement means "and everything before".
    assert _acked(net, pub) == 1
    net.tick(0.6)  # past REPLICATION_TIMEOUT: every record not yet confirmed goes again, in one batch
    assert ps.counters["replication_resends"] == 1
    assert _acked(net, pub) == 5
    for nid in net.nodes:
        if nid != primary and TOPIC in net.nodes[nid].ps.store:
            assert sorted(r[2] for r in net.nodes[nid].ps.store.get(TOPIC).rows) == list(range(6))


def test_a_slow_copys_confirmations_raise_its_resend_timeout_instead_of_causing_resends() -> None:
    # A copy that confirms late is busy, not losing batches: a fixed 0.5 s time-out re-sent every topic's batch
    # to a secondary that took longer (100,000 topics in flight: millions of re-sends, doubling its work).  The
    # time-out follows the copy's measured round trip (RoundTrip, as TCP's), and a lost batch still goes again.
    net, primary, _, pub = _setup(2)
    ps = net.nodes[primary].ps
    net.hold = _confirmations_to(primary)
    for i in range(8):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, b"m", 0))
        net.clock += 1.5  # the copy's confirmation comes 1.5 s later
        for item in list(net.held):
            net.release(item)
    assert _acked(net, pub) == 7 and ps.counters["replication_resends"] == 0
    net.nodes[pub].request("p", Publish(TOPIC, "P", 8, b"m", 0))
    net.tick(1.0)  # past REPLICATION_TIMEOUT, within the copy's round trip
    assert ps.counters["replication_resends"] == 0
    for item in list(net.held):
        net.release(item)
    assert _acked(net, pub) == 8
    net.nodes[pub].request("p", Publish(TOPIC, "P", 9, b"m", 0))
    net.held.clear()  # this one is lost on the way back
    net.tick(1.0)
    assert ps.counters["replication_resends"] == 0
    net.tick(2.0)  # past the round trip's time-out (SRTT + 4 RTTVAR)
    assert ps.counters["replication_resends"] == 1
    for item in list(net.held):
        net.release(item)
    assert _acked(net, pub) == 9


def test_a_lost_batch_is_resent_on_time_at_a_primary_of_many_idle_topics() -> None:
    # The timers look at a slice of the replicas per tick (broker/sweep.py), each within SWEEP_PERIOD, and at every
    # replica with a batch in flight at each tick: a lost batch must be re-sent at its time-out, not whenever its
    # topic's slice comes round (here: in the last quarter of a primary holding hundreds of idle topics).
    net, primary, _, pub = _setup(2)
    ps = net.nodes[primary].ps
    for i in range(2000):  # idle topics, ~a fifth of them held at the primary, all made before TOPIC
        net.nodes[pub].request("p", Publish(f"grid/idle/{i}", "P", 0, b"x", 0))
    net.nodes[pub].request("p", Publish(TOPIC, "Q", 0, b"m0", 0))
    assert len(ps.table.replicas) > 200 and list(ps.table.replicas)[-1] == TOPIC
    net.tick(0.05)  # (the first tick looks at all of them, and finds nothing under way; the next ones at slices)
    assert not ps.table.armed()
    lost: list[Message] = []

    def lose_the_first_batch(to: str, m: Message) -> bool:
        if not lost and isinstance(m, Replicate) and m.topic == TOPIC and m.origin.id == primary:
            lost.append(m)
            return True
        return False

    net.hold = lose_the_first_batch
    net.nodes[pub].request("p", Publish(TOPIC, "Q", 1, b"m1", 0))

    def acked() -> bool:
        return any(isinstance(m, Ack) and m.topic == TOPIC and m.seq == 1 for m in net.nodes[pub].inbox["p"])

    assert lost and not acked()
    net.hold = lambda to, m: False
    net.held.clear()
    net.tick(0.6)  # past REPLICATION_TIMEOUT; a quarter of the replicas' slice, TOPIC not in it
    assert ps.counters["replication_resends"] == 1 and acked()


def test_batches_in_flight_are_looked_at_when_their_time_out_is_up_not_at_every_tick() -> None:
    # Each tick (every 0.05 s) looked at every replica with a batch in flight.  While 100,000 topics each had one
    # in flight to a secondary (a level-2 fill), each tick walked them all and held the loop past the links'
    # heartbeats; brokers were declared failed and their topics taken over (docs/benchmarks-scale.md).  Now a
    # replica is armed for its earliest time-out (TopicTable.wake, due): until then only the sweep's slice looks.
    net, primary, _, pub = _setup(2)
    ps = net.nodes[primary].ps
    for i in range(2000):
        net.nodes[pub].request("p", Publish(f"grid/busy/{i}", "P", 0, b"x", 0))
    mine = [name for name, r in ps.table.replicas.items() if r.rank == 1]
    assert len(mine) > 200
    net.tick(0.05)  # (the first tick looks at every replica, the next ones at slices)
    assert not ps.table.armed()
    net.hold = lambda to, m: isinstance(m, Replicate) and m.origin.id == primary  # every batch lost
    for name in mine:
        net.nodes[pub].request("p", Publish(name, "P", 1, b"y", 0))
    assert {r.name for r in ps.table.armed()} == set(mine)
    looked: list[int] = []
    due = ps.table.due

    def counted(now: float) -> list[Replica]:
        out = due(now)
        looked.append(len(out))
        return out

    ps.table.due = counted  # type: ignore[method-assign]
    for _ in range(8):  # 0.4 s: within REPLICATION_TIMEOUT
        net.tick(0.05)
    slice_ = math.ceil(len(ps.table.replicas) * 0.05 / SWEEP_PERIOD)
    assert looked and max(looked) <= slice_  # the sweep's slices, not the replicas in flight
    assert ps.counters["replication_resends"] == 0
    net.tick(0.15)  # past REPLICATION_TIMEOUT: every lost batch is re-sent, at this tick
    assert looked[-1] >= len(mine)
    assert ps.counters["replication_resends"] == len(mine)
    assert {r.name for r in ps.table.armed()} == set(mine)  # (armed again: the re-sends were lost too)


def _meta_of(batches: list[Replicate]) -> list[tuple[bool, int, int]]:
    """Per REPLICATE: whether it carried the meta, and how many subscribers and publisher-table entries."""
    return [(m.meta, len(m.subscribers), len(m.last_seq)) for m in batches]


@pytest.mark.parametrize("level", [2, 3])
def test_the_subscribers_and_publisher_table_travel_until_confirmed_then_records_alone(level: int) -> None:
    # Before, every REPLICATE carried the topic's whole subscriber list, delegates and publisher table: with a
    # thousand subscribers or publishers, every message paid for them twice (encode, decode).  Now they go
    # until the secondary confirmed a batch that carried them, and again after each change.
    net, primary, secondary, pub = _setup(level)
    sent: list[Replicate] = []

    def watch(to: str, m: Message) -> bool:
        if isinstance(m, Replicate) and m.origin.id == primary and not m.sync:
            sent.append(m)
        return False

    net.hold = watch
    net.nodes[pub].request("s1", Subscribe(1, TOPIC))
    for i in range(3):
        net.nodes[pub].request("p", Publish(TOPIC, f"P{i}", 0, b"x", 0))  # three publishers
    assert sent and sent[0].meta and len(sent[0].subscribers) == 1
    assert _meta_of(sent[1:]) == [(False, 0, 0)] * 3  # confirmed: the records alone
    sent.clear()
    net.nodes[pub].request("s2", Subscribe(2, TOPIC))  # a change: the next batch carries the new list
    net.nodes[pub].request("p", Publish(TOPIC, "P0", 1, b"y", 0))
    assert _meta_of(sent) == [(True, 2, 3), (False, 0, 0)]
    # The copy holds what the primary holds, the publisher table included (from the records themselves).
    rp, rs = net.nodes[primary].ps.table.replicas[TOPIC], net.nodes[secondary].ps.table.replicas[TOPIC]
    assert set(rs.subscribers) == set(rp.subscribers) and len(rs.subscribers) == 2
    assert rs.log.last_seq == rp.log.last_seq == {"P0": 1, "P1": 0, "P2": 0}
    if level == 3:  # the tertiary had them passed on by the secondary
        (rt,) = [n.ps.table.replicas[TOPIC] for n in net.nodes.values() if n.ps.table.replicas.get(TOPIC, rp).rank == 3]
        assert set(rt.subscribers) == set(rp.subscribers) and rt.log.last_seq == rp.log.last_seq
    # The primary fails: the copy takes over with both subscribers and knows every publisher's last message.
    net.kill(primary)
    net.nodes[pub].request("p", Publish(TOPIC, "P1", 0, b"again", 0))  # a re-send: acknowledged, not stored
    net.nodes[pub].request("p", Publish(TOPIC, "P2", 1, b"new", 0))
    for session in ("s1", "s2"):  # (the take-over re-delivers its last moments; clients drop duplicates)
        assert ("P2", 1) in [(r.publisher, r.seq) for r in delivered(net.nodes[pub], session)]
    assert _acked_by(net, pub, "P1") == 0 and _acked_by(net, pub, "P2") == 1
    rows = [(row[1], row[2]) for row in net.nodes[secondary].ps.store.get(TOPIC).rows]
    assert sorted(rows) == [("P0", 0), ("P0", 1), ("P1", 0), ("P2", 0), ("P2", 1)]  # the re-send stored once


def _acked_by(net: Net, node: str, publisher: str) -> int:
    return max(
        (m.seq for m in net.nodes[node].inbox.get("p", []) if isinstance(m, Ack) and m.publisher == publisher),
        default=-1,
    )


def test_a_copy_without_the_meta_confirms_nothing_until_the_resend_brings_it() -> None:
    # A copy that never received the subscribers and the publisher table from its primary (read back from
    # disk, say) must not count a records-only batch: were the primary to fail, it would serve the topic
    # without its subscribers.  It leaves the batch unconfirmed; the re-send carries them.
    net, _, secondary, pub = _setup(2)
    net.nodes[pub].request("s", Subscribe(1, TOPIC))
    net.nodes[pub].request("p", Publish(TOPIC, "P", 0, b"m0", 0))
    rs = net.nodes[secondary].ps.table.replicas[TOPIC]
    rs.meta_known = False  # as a copy recovered from disk
    rs.subscribers.clear()
    net.nodes[pub].request("p", Publish(TOPIC, "P", 1, b"m1", 0))
    assert net.nodes[secondary].ps.counters["replicate_without_meta"] == 1
    assert _acked(net, pub) == 0  # not acknowledged: the copy did not confirm it
    net.tick(0.6)  # past REPLICATION_TIMEOUT: the re-send carries the meta
    assert _acked(net, pub) == 1
    assert len(rs.subscribers) == 1 and rs.meta_known


def test_late_confirmations_of_superseded_batches_still_count() -> None:
    # Under load a confirmation can be slower than the time-out: the batches the re-send superseded still
    # count when their confirmations come (in order), so the primary does not re-send forever.
    net, primary, _, pub = _setup(2)
    ps = net.nodes[primary].ps
    net.nodes[pub].request("p", Publish(TOPIC, "P", 0, b"m0", 0))  # the topic exists (its first pull is done)
    net.hold = _confirmations_to(primary)
    for i in range(1, 5):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, f"m{i}".encode(), 0))
    slow = list(net.held)
    assert len(slow) == 4
    net.tick(0.6)
    assert ps.counters["replication_resends"] == 1
    assert len(net.held) == len(slow) + 1  # the re-send's confirmation, held too
    for item in slow:
        net.release(item)
    assert _acked(net, pub) == 4
    net.hold = lambda to, m: False
    net.release(net.held[0])
    assert not ps.table.replicas[TOPIC].window


@pytest.mark.parametrize("victim", ["primary", "secondary"])
def test_a_holder_dying_with_a_full_window_loses_nothing_acknowledged(victim: str) -> None:
    net, primary, secondary, pub = _setup(2)
    sub = net.nodes[pub]
    sub.request("s", Subscribe(1, TOPIC))
    pending: dict[int, bytes] = {}

    def publish(i: int) -> None:
        pending[i] = f"m{i}".encode()
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, pending[i], min(pending)))

    def settle() -> None:
        for seq in [q for q in pending if q <= _acked(net, pub)]:
            del pending[seq]

    for i in range(10):
        publish(i)
    settle()
    net.hold = _confirmations_to(primary)
    for i in range(10, 10 + REPLICATION_WINDOW + 3):
        publish(i)
    assert len(net.held) == REPLICATION_WINDOW
    net.held.clear()  # the confirmations die with the primary, or were sent by the dying secondary
    net.hold = lambda to, m: False
    net.kill(primary if victim == "primary" else secondary)
    n = 10 + REPLICATION_WINDOW + 3
    for _ in range(5):  # the publisher re-sends what is not acknowledged, as the client does on its timer
        settle()
        for seq in sorted(pending):
            net.nodes[pub].request("p", Publish(TOPIC, "P", seq, pending[seq], min(pending)))
        net.tick(0.6)
    settle()
    assert not pending and _acked(net, pub) == n - 1
    assert list(dict.fromkeys(r.seq for r in delivered(sub, "s"))) == list(range(n))
    # Both holders now have everything (the new secondary got the whole history): a second failure loses nothing.
    loc = locate(net, TOPIC)
    assert loc.secondary is not None
    for nid in (loc.primary.id, loc.secondary.id):
        assert sorted(r[2] for r in net.nodes[nid].ps.store.get(TOPIC).rows) == list(range(n))


def _rows(net: Net, nid: str) -> list[int]:
    return sorted(row[2] for row in net.nodes[nid].ps.store.get(TOPIC).rows)


def _pairs(net: Net, nid: str) -> set[tuple[str, int]]:
    """(publisher, seq) of every record nid stores of TOPIC."""
    return {(row[1], row[2]) for row in net.nodes[nid].ps.store.get(TOPIC).rows}


def _setup_history(level: int, n: int) -> tuple[HoldNet, str, str, str]:
    """_setup, with n messages published and acknowledged."""
    net, primary, secondary, pub = _setup(level)
    for i in range(n):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, b"x", i))
    assert _acked(net, pub) == n - 1
    return net, primary, secondary, pub


def _fetched(net: Net, pub: str) -> list[int]:
    net.nodes[pub].inbox["f"] = []
    net.nodes[pub].request("f", Fetch(99, TOPIC, 0.0, 512))
    return sorted(r.seq for m in net.nodes[pub].inbox["f"] if isinstance(m, Fetched) for r in m.records)


def test_a_new_secondary_gets_the_history_while_publishes_are_acknowledged() -> None:
    # The back-fill of a new secondary does not gate the acknowledgements (replication.py `backfill`): the
    # first batch to it carries every record not yet confirmed, the history follows as the answer to an OFFER.
    # Its PULL is held back here.  Before, the history went as one batch that every later batch waited
    # behind: ~1 s of unacknowledged publishes with 300,000 records retained (bench_anti_entropy.py).
    net, primary, secondary, pub = _setup_history(2, 20)
    net.hold = lambda to, m: isinstance(m, Pull) and to == primary
    net.kill(secondary)
    net.run()
    new = locate(net, TOPIC).secondary
    assert new is not None and new.id != secondary
    for i in range(20, 30):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, b"x", i))
    assert _acked(net, pub) == 29
    assert _rows(net, new.id) == list(range(20, 30))
    assert net.nodes[primary].ps.replica_states([TOPIC])[TOPIC] == ("backfilling", 0, 1)
    # The secondary's pull goes through: it gets what it lacks, and the primary counts it as the copy.
    assert len(net.held) == 1
    net.hold = lambda to, m: False
    net.release(net.held[0])
    assert _rows(net, new.id) == list(range(30))
    assert net.nodes[primary].ps.replica_states([TOPIC])[TOPIC] == ("caught_up", 0, 0)
    net.kill(primary)
    net.tick(1.5)
    assert _fetched(net, pub) == list(range(30))


@pytest.mark.parametrize("resend", [True, False], ids=["the-same-message", "the-next-one"])
def test_after_a_take_over_the_last_moments_reach_the_new_secondary_before_an_acknowledgement(resend: bool) -> None:
    # The primary dies after its secondary stored seq 10 and before the publisher got the acknowledgement. The
    # publisher re-sends seq 10 (or sends seq 11: acknowledgements are cumulative) to the secondary, now the
    # primary, which holds it already. Acknowledged on the strength of that broker alone, it would be lost with
    # the next single failure while the new secondary's back-fill is under way. The new primary's first batch
    # copies the last moments again (sync `redeliver`), so the acknowledgement waits for that batch
    # only, not for the back-fill, which is held back here.
    net, primary, secondary, pub = _setup_history(2, 10)
    net.tick(REDELIVER_WINDOW + 1.0)  # 0-9 are history, older than the last moments
    net.hold = _confirmations_to(primary)
    net.nodes[pub].request("p", Publish(TOPIC, "P", 10, b"x", 10))
    assert len(net.held) == 1 and _acked(net, pub) == 9
    net.held.clear()  # dies with the primary
    net.hold = lambda to, m: isinstance(m, Pull) and to == secondary  # the new secondary's back-fill waits
    net.kill(primary)
    net.tick(1.5)  # the take-over's pull of the other holders is answered or times out
    loc = locate(net, TOPIC)
    assert loc.primary.id == secondary and loc.secondary is not None
    new = loc.secondary.id
    if resend:
        net.nodes[pub].request("p", Publish(TOPIC, "P", 10, b"x", 10))
        assert _acked(net, pub) == 10
    else:
        net.nodes[pub].request("p", Publish(TOPIC, "P", 11, b"y", 10))
        assert _acked(net, pub) == 11
    assert net.nodes[secondary].ps.replica_states([TOPIC])[TOPIC][0] == "backfilling"
    assert len(net.held) == 1  # the back-fill's pull
    assert _rows(net, new) == list(range(10, 11 if resend else 12)), "acknowledged while only one broker holds it"
    # The new primary fails before the back-fill: what was acknowledged since the first failure survives.
    net.held.clear()
    net.hold = lambda to, m: False
    net.kill(secondary)
    net.tick(1.5)
    assert set(range(10, 12 if not resend else 11)) <= set(_fetched(net, pub))


def test_a_primary_that_stalled_longer_than_the_last_moments_has_everything_unacknowledged_copied_again() -> None:
    # The primary's ACKs stop (here its confirmations are held back; in life a slow disk under always/batch)
    # while its secondary goes on storing what it is sent; seq 10 waits for longer than REDELIVER_WINDOW before
    # the primary dies.  The new primary must re-copy and re-deliver everything the old one had not delivered and
    # acknowledged, which its batches said (REPLICATE.delivered_upto), not only the last REDELIVER_WINDOW
    # seconds: before, seq 10's re-send was acknowledged with the new secondary lacking it (lost with the next
    # single failure while the back-fill was held back), and its subscriber never got it.
    net, primary, secondary, pub = _setup_history(2, 10)
    sub = next(n for n in net.nodes if n not in (primary, secondary, pub))
    net.nodes[sub].request("s", Subscribe(1, TOPIC))
    net.tick(REDELIVER_WINDOW + 1.0)
    net.hold = _confirmations_to(primary)
    net.nodes[pub].request("p", Publish(TOPIC, "P", 10, b"x", 10))
    net.tick(REDELIVER_WINDOW + 1.0)  # (the primary re-sends the batch meanwhile; its confirmation is held too)
    net.nodes[pub].request("p", Publish(TOPIC, "P", 11, b"y", 10))
    assert _acked(net, pub) == 9 and 10 not in [r.seq for r in delivered(net.nodes[sub], "s")]
    assert _rows(net, secondary) == list(range(12))
    net.held.clear()  # dies with the primary
    net.hold = lambda to, m: isinstance(m, Pull) and to == secondary  # the new secondary's back-fill waits
    net.kill(primary)
    net.tick(1.5)
    loc = locate(net, TOPIC)
    assert loc.primary.id == secondary and loc.secondary is not None
    assert {10, 11} <= {r.seq for r in delivered(net.nodes[sub], "s")}, "the subscriber never got seq 10"
    net.nodes[pub].request("p", Publish(TOPIC, "P", 10, b"x", 10))
    net.nodes[pub].request("p", Publish(TOPIC, "P", 11, b"y", 10))
    assert _acked(net, pub) == 11
    assert net.nodes[secondary].ps.replica_states([TOPIC])[TOPIC][0] == "backfilling"
    assert {10, 11} <= set(_rows(net, loc.secondary.id)), "acknowledged while only one broker holds it"
    net.held.clear()
    net.hold = lambda to, m: False
    net.kill(secondary)
    net.tick(1.5)
    assert {10, 11} <= set(_fetched(net, pub))


def test_a_long_back_fill_streams_a_few_chunks_at_a_time() -> None:
    # A history longer than SYNC_WINDOW chunks is answered as the asker confirms its chunks: never more than
    # SYNC_WINDOW unconfirmed, the last one carrying the pull's corr.
    n = SYNC_WINDOW * SYNC_CHUNK * 2 + 7
    net, primary, secondary, _ = _setup_history(2, n)
    start = len(net.sent)
    net.kill(secondary)
    net.run()
    new = locate(net, TOPIC).secondary
    assert new is not None
    pulls = [m for s, m in net.sent[start:] if s == new.id and isinstance(m, Pull) and m.topic == TOPIC]
    assert len(pulls) == 1
    inflight: set[int] = set()
    most = chunks_sent = 0
    for sender, m in net.sent[start:]:
        if sender == primary and isinstance(m, Replicate) and m.sync and m.topic == TOPIC:
            chunks_sent += 1
            if m.corr != pulls[0].corr:
                inflight.add(m.corr)
        elif sender == new.id and isinstance(m, Replicated):
            inflight.discard(m.corr)
        most = max(most, len(inflight))
    assert chunks_sent >= n // SYNC_CHUNK
    assert most == SYNC_WINDOW
    assert _rows(net, new.id) == list(range(n))
    assert net.nodes[primary].ps.replica_states([TOPIC])[TOPIC] == ("caught_up", 0, 0)
    role = net.nodes[primary].ps.sync
    assert not role._answers and not role._answer_chunks  # every chunk confirmed: nothing kept


def test_a_long_answer_whose_last_confirmations_never_come_is_forgotten() -> None:
    # The asker goes quiet after the last chunk left, with an earlier chunk still unconfirmed: the answer is
    # forgotten after the offer time-out, its chunks with it (they were kept for ever before).
    n = SYNC_WINDOW * SYNC_CHUNK * 2 + 7
    net, primary, secondary, _ = _setup_history(2, n)
    role = net.nodes[primary].ps.sync

    def lost_after_the_last_chunk(to: str, m: Message) -> bool:
        answer = role._answer_chunks.get(m.corr) if isinstance(m, Replicated) and to == primary else None
        return answer is not None and answer.corr == 0

    net.hold = lost_after_the_last_chunk
    net.kill(secondary)
    net.run()
    assert net.held, "no chunk was still unconfirmed when the last one left"
    net.held.clear()
    net.hold = lambda to, m: False
    assert role._answer_chunks
    net.tick(OFFER_TIMEOUT + 0.5)
    assert not role._answer_chunks and not role._answers


def test_level_three_gives_a_new_tertiary_the_history() -> None:
    # The secondary back-fills a tertiary new to it (the batches it passes on carry only what is new), so once
    # the tertiary failed and was replaced, the primary and the secondary may still fail at the same moment.
    net, primary, secondary, pub = _setup_history(3, 20)
    tertiary = locate(net, TOPIC).tertiary
    assert tertiary is not None and tertiary.id != pub
    net.kill(tertiary.id)
    net.run()
    third = locate(net, TOPIC).tertiary
    assert third is not None and third.id != tertiary.id
    assert _rows(net, third.id) == list(range(20))
    for nid in (primary, secondary):
        net.nodes[nid].alive = False
    for node in net.nodes.values():
        if node.alive:
            node.ps.view_changed(failed={primary, secondary})
    net.run()
    net.tick(1.5)
    assert _fetched(net, pub) == list(range(20))


def _only_the_primary_has_seq_10(level: int) -> tuple[HoldNet, str, str, str]:
    """_setup, seq 0-9 published and acknowledged, and seq 10 stored at the primary alone: its batch to the
    secondary was lost, so it is not acknowledged."""
    net, primary, secondary, pub = _setup(level)
    for i in range(10):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, b"x", i))
    net.hold = lambda to, m: (
        isinstance(m, Replicate) and to == secondary and m.origin.id == primary and any(r.seq == 10 for r in m.records)
    )
    net.nodes[pub].request("p", Publish(TOPIC, "P", 10, b"x", 10))
    assert net.held and _acked(net, pub) == 9
    net.held.clear()  # lost
    net.hold = lambda to, m: False
    return net, primary, secondary, pub


def test_level_three_a_demoted_primary_gives_its_new_tertiary_what_it_lacks() -> None:
    # A broker joins closest to the topic: the primary becomes the secondary, its old secondary the tertiary.
    # The old secondary never got seq 10 (the batch was lost; it was never acknowledged), which the joined
    # primary pulled from the old one.  The demoted primary's next holder is now its tertiary, the broker it
    # knew as holding its history: before, it was not back-filled, so the re-send of seq 10, acknowledged at
    # once by the new primary that holds it, was on two brokers at level 3 and lost when both failed.
    net, primary, secondary, pub = _only_the_primary_has_seq_10(3)
    joined = net.join(_near(geohash(TOPIC), 0.0005))
    loc = locate(net, TOPIC)
    assert (loc.primary.id, loc.secondary and loc.secondary.id, loc.tertiary and loc.tertiary.id) == (
        joined.me.id, primary, secondary,
    )  # fmt: skip
    assert _rows(net, secondary) == list(range(11)), "the new tertiary lacks what only the demoted primary had"
    net.nodes[pub].request("p", Publish(TOPIC, "P", 10, b"x", 10))
    assert _acked(net, pub) == 10
    for nid in (joined.me.id, primary):
        net.nodes[nid].alive = False
    for node in net.nodes.values():
        if node.alive:
            node.ps.view_changed(failed={joined.me.id, primary})
    net.run()
    net.tick(1.5)
    assert _fetched(net, pub) == list(range(11))


def test_a_demoted_primary_offers_again_until_the_new_primary_holds_what_it_kept() -> None:
    # A broker joins closest to the topic while what the old primary sends it is lost (in life: two overlays
    # merging after a partition, the old primary the other side's).  The old primary alone holds seq 10 (its
    # batch to the secondary was lost).  The joined primary's pull of it times out and it serves without it;
    # the demoted primary's offer of what it keeps is repeated until the new primary confirms it holds all of
    # it.  Before, that offer went once: lost, the new primary never got seq 10 (anti-entropy offers from the
    # primary's side only), which is how a healed partition's merge lost acknowledged messages.
    net, primary, _, _ = _only_the_primary_has_seq_10(2)
    joined = f"n{len(net.nodes)}"
    net.hold = lambda to, m: to == joined and isinstance(m, (Replicate, Offer)) and m.origin.id == primary
    net.join(_near(geohash(TOPIC), 0.0005))
    net.tick(PULL_TIMEOUT + 0.5)  # (the old primary has answered nothing yet: the pull waits for it longer)
    assert net.nodes[joined].ps.table.replicas[TOPIC].stage is Stage.SYNCING
    net.tick(PULL_WAIT_MAX)  # the pull gives up on the old primary: the joined one serves
    assert locate(net, TOPIC).primary.id == joined and 10 not in _rows(net, joined)
    net.held.clear()  # lost
    net.hold = lambda to, m: False
    for _ in range(3):
        net.tick(OFFER_TIMEOUT + 0.5)
    assert _rows(net, joined) == list(range(11)), "the new primary never got what only the demoted one kept"
    assert net.nodes[primary].ps.replica_states([TOPIC])[TOPIC][2] == 0  # the offer was confirmed


def test_a_copy_the_view_no_longer_ranks_hands_its_records_on_and_lets_go() -> None:
    # Level 2: a broker outside the topic's holders keeps a HOLDING copy (a batch from a primary whose view lagged
    # made it after this broker's last view change; seen 30 s after a healed partition), with a record the
    # primary lacks.  At the next anti-entropy round it offers the record to the holders and lets go, as a view
    # change would have had it; before, it stayed for good, listed as a tertiary at level 2.
    net, primary, secondary, pub = _setup(2)
    for i in range(5):
        net.nodes[pub].request("p", Publish(TOPIC, "P", i, b"x", i))
    stray = next(n for n in net.nodes if n not in (primary, secondary, pub))
    ps = net.nodes[stray].ps
    assert TOPIC not in ps.table.replicas
    r = ps.holder.replica(TOPIC)  # (made HOLDING: the view does not rank this broker first)
    r.log.merge([Record(net.clock, "Q", 0, b"only here")], net.clock)
    assert r.stage is Stage.HOLDING
    net.tick(ANTI_ENTROPY_INTERVAL + 0.5)
    net.tick(OFFER_TIMEOUT + 0.5)
    assert TOPIC not in ps.table.replicas, "the stray copy stayed"
    assert ("Q", 0) in _pairs(net, primary)


@pytest.mark.parametrize("level", [2, 3])
def test_a_record_only_the_secondary_keeps_reaches_the_primary_at_the_next_anti_entropy_round(level: int) -> None:
    # The secondary keeps a record its primary never held (in life: it came back with its disk holding what the
    # new primary lacked, or a merge's offer was lost).  Offered what the primary keeps at the anti-entropy
    # round, it offers back what it keeps outside that; the primary, which never held the record, pulls it and
    # delivers it.  Before, the secondary, holding more, confirmed the offer and the record stayed on one broker
    # for good.
    net, primary, secondary, pub = _setup_history(level, 5)
    net.nodes[pub].request("s", Subscribe(1, TOPIC))
    net.nodes[secondary].ps.store.get(TOPIC).merge([Record(net.clock, "Q", 0, b"only here")], net.clock)
    net.nodes[pub].request("p", Publish(TOPIC, "P", 5, b"x", 5))  # the topic changed: the next round compares
    net.tick(ANTI_ENTROPY_INTERVAL + 0.5)
    net.tick(OFFER_TIMEOUT + 0.5)
    assert ("Q", 0) in _pairs(net, primary), "the primary never got the record only its secondary kept"
    assert ("Q", 0) in {(r.publisher, r.seq) for r in delivered(net.nodes[pub], "s")}
    assert net.nodes[secondary].ps.counters["reverse_offers"] == 1
    assert net.nodes[secondary].ps.replica_states([TOPIC])[TOPIC][2] == 0  # its offer was confirmed
    if level == 3:  # and the tertiary too (the primary replicates what it merged; the secondary passes it on)
        tertiary = locate(net, TOPIC).tertiary
        assert tertiary is not None
        assert ("Q", 0) in _pairs(net, tertiary.id)
    net.tick(ANTI_ENTROPY_INTERVAL + 0.5)
    assert net.nodes[secondary].ps.counters["reverse_offers"] == 1  # once: the primary holds it now


def test_records_the_primary_expired_are_not_taken_back() -> None:
    # The primary's retention dropped seq 0-4 while its secondary still keeps them (a longer retention there,
    # or it expires later).  The secondary offers them back (it cannot tell them from records the primary never
    # had); the primary, which held them, confirms without pulling or storing them again.
    net, primary, secondary, pub = _setup_history(2, 5)
    plog = net.nodes[primary].ps.store.get(TOPIC)
    plog.retention = Retention(max_age=1.0)
    net.clock += 2.0
    plog.expire(net.clock)
    assert _rows(net, primary) == [] and _rows(net, secondary) == [0, 1, 2, 3, 4]
    syncs = net.nodes[primary].ps.counters["syncs"]
    net.nodes[pub].request("p", Publish(TOPIC, "P", 5, b"x", 5))
    for _ in range(2):
        net.tick(ANTI_ENTROPY_INTERVAL + 0.5)
    assert net.nodes[secondary].ps.counters["reverse_offers"] >= 1
    assert net.nodes[secondary].ps.replica_states([TOPIC])[TOPIC][2] == 0  # confirmed
    assert net.nodes[primary].ps.counters["syncs"] == syncs, "the primary pulled what it had expired"
    assert not set(_rows(net, primary)) & {0, 1, 2, 3, 4}


@pytest.mark.parametrize("level", [1, 2])  # (level 3 passes the same REPLICATE on: 8.7 s more, no new decoder)
def test_a_topic_of_more_than_1024_subscribers_is_delivered_and_replicated(level: int) -> None:
    # 1,100 sessions of one access broker subscribe.  Before, the subscriber list in the primary's REPLICATE and
    # the sessions of one DELIVER in its TOPIC_REPLY were held to the wire's 1,024 entries for short lists: the
    # receiving broker dropped them as bad messages, so nobody got anything and nothing was acknowledged.
    net, _, secondary, pub = _setup(level)
    n = 1100
    for i in range(n):
        net.nodes[pub].request(f"s{i}", Subscribe(1, TOPIC))
    net.nodes[pub].request("p", Publish(TOPIC, "P", 0, b"x", 0))
    assert _acked(net, pub) == 0
    assert all([r.seq for r in delivered(net.nodes[pub], f"s{i}")] == [0] for i in range(n))
    if level > 1:
        assert len(net.nodes[secondary].ps.table.replicas[TOPIC].subscribers) == n


def test_a_topic_of_more_than_1024_publishers_is_repaired_copied_and_taken_over() -> None:
    # 3,000 publishers: the publisher table in a REPLICATE and the digests of OFFER and PULL name each of them.
    # Before, anything naming more than 1,024 was dropped as a bad message: anti-entropy, the meta batch after
    # a subscription, a back-fill and a take-over's pull.
    net, primary, secondary, pub = _setup(2)
    n = 3000
    for i in range(n):
        net.nodes[pub].request("p", Publish(TOPIC, f"device-{i}", 0, b"x", 0))
    net.nodes[pub].request("s", Subscribe(1, TOPIC))  # a meta batch: the whole publisher table
    missing = Record(net.clock, "device-x", 0, b"lost batch")
    net.nodes[primary].ps.store.get(TOPIC).merge([missing], net.clock)  # stored, its batch to the copy lost
    net.nodes[primary].ps.table.replicas[TOPIC].unchecked = True
    net.tick(ANTI_ENTROPY_INTERVAL + 0.5)  # the offer names 3,001 publishers; the copy pulls what it lacks
    assert len(net.nodes[secondary].ps.store.get(TOPIC).rows) == n + 1
    net.kill(primary)  # the take-over's pull names them too; then the new secondary's back-fill
    net.tick(PULL_TIMEOUT + 0.5)
    net.tick(OFFER_TIMEOUT + 0.5)
    loc = locate(net, TOPIC)
    assert loc.primary.id == secondary and loc.secondary is not None
    assert len(net.nodes[loc.secondary.id].ps.store.get(TOPIC).rows) == n + 1
    assert net.nodes[secondary].ps.replica_states([TOPIC])[TOPIC][0] == "caught_up"


# ---- real brokers ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["primary", "secondary"])
async def test_killing_a_holder_while_the_window_is_full_loses_no_acknowledged_message(
    tmp_path: Path, victim: str
) -> None:
    # The secondary is stopped (SIGSTOP) so that its confirmations stop and the primary's window fills (the
    # primary's STATUS counts the batches it sent with others unconfirmed); then the victim is SIGKILLed.
    async with LocalCluster(6, seed=21, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS) as c:
        await c.wait_converged(30.0)
        addrs = [bp.listen for bp in c.nodes]
        async with Client(addrs) as probe:
            loc = await probe.locate(TOPIC)
        assert loc.secondary is not None
        index = {bp.node_id: i for i, bp in enumerate(c.nodes)}
        p_i, s_i = index[loc.primary.id], index[loc.secondary.id]
        free = [i for i in range(len(addrs)) if i not in (p_i, s_i)]

        async def pipelined() -> int:
            async with await AdminClient.connect(addrs[p_i], timeout=5.0) as admin:
                return (await admin.status()).counters.get("replicated_pipelined", 0)

        async with (
            Client([addrs[free[0]]]) as sub_c,
            Client([addrs[free[1]]], batch_publishes=False) as pub,
        ):
            sub = await sub_c.subscribe(TOPIC)
            futs: list[asyncio.Future[PublishAck]] = []
            for i in range(200):
                futs.append(await pub.publish_nowait(TOPIC, f"m{i}"))
            async with asyncio.timeout(30):
                await asyncio.gather(*futs)
            before = await pipelined()
            os.kill(c.nodes[s_i].pid, signal.SIGSTOP)
            stopped = True
            try:

                async def window_full() -> bool:
                    # One publish per turn of this loop: a batch per turn at the primary while the window has room.
                    futs.append(await pub.publish_nowait(TOPIC, f"m{len(futs)}"))
                    return await pipelined() - before >= REPLICATION_WINDOW - 1

                await wait_for(window_full, 20.0, "a full replication window at the primary")
                await c.kill(p_i if victim == "primary" else s_i)
                if victim == "primary":
                    os.kill(c.nodes[s_i].pid, signal.SIGCONT)  # the secondary holds the batches: it takes over
                stopped = False
                for _ in range(100):
                    futs.append(await pub.publish_nowait(TOPIC, f"m{len(futs)}"))
                n = len(futs)
                async with asyncio.timeout(60):
                    acks = await asyncio.gather(*futs)
                assert [a.seq for a in acks] == list(range(n))
                got: list[int] = []
                async with asyncio.timeout(60):
                    while len(got) < n:
                        got.append((await anext(sub)).seq)
                assert got == list(range(n)) and sub.gaps == 0
                records = await sub_c.fetch(TOPIC)
                assert [r.seq for r in records] == list(range(n))
            finally:
                if stopped:
                    os.kill(c.nodes[s_i].pid, signal.SIGCONT)


def test_a_copy_still_confirming_earlier_batches_is_not_sent_the_later_ones_again() -> None:
    # A broker that joined next to 30,000 topics confirmed its new topics' batches seconds late, in order, while it
    # worked through its queue; each time-out re-sent a batch still queued there, 2,000-9,000 every 5 s, and the
    # queue only grew (bench_join.py, docs/benchmarks-scale.md).  Links deliver in order: a copy that still
    # confirms what was sent before a batch, and nothing sent after it, has not lost it (PeerProgress).  It is
    # re-sent once the copy confirms a later one (it was lost) or goes quiet.
    net, primary, secondary, pub = _setup(2)
    ps = net.nodes[primary].ps
    names = [f"grid/queue/{i}" for i in range(1200)]
    topics = [t for t in names if (loc := locate(net, t)).primary.id == primary and loc.secondary.id == secondary]
    assert len(topics) * 0.3 > MAX_RTO + 1
    for t in topics:
        net.nodes[pub].request("p", Publish(t, "P", 0, b"m", 0))
    assert _acked_topics(net, pub, topics, 0) == set(topics)
    # Everything the primary sends the copy queues there, in order (its anti-entropy offers too).
    net.hold = lambda to, m: to == secondary and getattr(getattr(m, "origin", None), "id", None) == primary
    for seq in (1, 2):
        for t in topics:
            net.nodes[pub].request("p", Publish(t, "P", seq, b"m", 0))
        assert len(net.held) == len(topics)
        if seq == 2:
            net.held.pop(len(topics) // 2)  # one of the second round is lost on the way
        # The copy works through its queue, one batch per 0.3 s, the last ones past MAX_RTO.
        while net.held:
            net.tick(0.3)
            net.release(net.held[0])
            assert ps.counters["replication_resends"] == 0 or seq == 2
        if seq == 1:
            assert _acked_topics(net, pub, topics, 1) == set(topics)
    # The lost batch: later ones were confirmed, so it is re-sent at its time-out (the copy's round trip, seconds
    # by now), and nothing else is.
    net.hold = lambda to, m: False
    for _ in range(20):
        net.tick(MAX_RTO / 10)
    assert ps.counters["replication_resends"] == 1
    assert _acked_topics(net, pub, topics, 2) == set(topics)


def _acked_topics(net: Net, pub: str, topics: list[str], seq: int) -> set[str]:
    return {m.topic for m in net.nodes[pub].inbox.get("p", []) if isinstance(m, Ack) and m.seq >= seq} & set(topics)


def _join_unanswered(net: HoldNet, publisher: str, names: list[str], at: Coord) -> tuple[str, list[str]]:
    """Publish one message to each of names at publisher, then a broker joins at `at` while everything sent to it
    is held (`net.held`): the new broker's id, and the names it ranks first for."""
    for t in names:
        net.nodes[publisher].request("p", Publish(t, "P", 0, b"history", 0))
    live = {k: v.coord for k, v in net.live().items()}
    live["new"] = at
    mine = [t for t in names if closest(live, geohash(t))[0] == "new"]
    joined = f"n{len(net.nodes)}"
    net.hold = lambda to, m: to == joined
    net.join(at)
    return joined, mine


def test_a_joined_primary_waits_for_holders_that_still_answer_its_earlier_pulls() -> None:
    # A broker that joins next to many topics pulls the history of each it becomes primary of; the old holders,
    # busy with the join, answered its first pulls after more than the pull time-out, and it served the others
    # without their history (and logged their acknowledged messages as lost: bench_join.py).  It waits while an
    # asked holder has answered nothing of its yet (up to PULL_WAIT_MAX) or still answers earlier pulls
    # (PeerProgress), and serves each topic with all of it.
    net = HoldNet(grid(10, seed=3), resilience=2)
    # What the old holders send the new broker queues there, in order, and is taken ten messages per 0.1 s.
    joined, mine = _join_unanswered(net, "n9", [f"grid/joined/{i}" for i in range(400)], (0.5, 0.5))
    assert len(mine) >= 10
    ps = net.nodes[joined].ps
    served_bare = set()
    for _ in range(2000):
        if not net.held:
            break
        net.tick(0.1)
        for item in net.held[:10]:
            net.release(item)
        for t in mine:
            r = ps.table.replicas.get(t)
            if r is not None and r.stage is Stage.SERVING and not r.log.rows:
                served_bare.add(t)
    assert not net.held
    net.hold = lambda to, m: False
    net.tick(1.0)
    assert not served_bare, f"served without their history: {sorted(served_bare)}"
    assert all(ps.table.replicas[t].stage is Stage.SERVING and ps.table.replicas[t].log.rows for t in mine)


def test_a_view_change_walk_waits_for_the_peers_answers_before_sending_more() -> None:
    # A broker that joins next to many topics is sent an offer or a back-fill for each by its neighbours' walks.
    # Sent all at once, they queued at it ahead of the batches, confirmations and pull answers of the topics with
    # publishers, which waited up to 8 s (bench_join.py).  A walk sends a peer at most a window of requests it has
    # not answered (PeerProgress `room`), the sweep's ticks too, and goes on as the answers come.
    net = HoldNet([(0.2, 0.2), (0.8, 0.25), (0.5, 0.85)], resilience=2)
    # The new broker answers nothing yet.
    joined, mine = _join_unanswered(net, "n0", [f"grid/paced/{i}" for i in range(1500)], (0.5, 0.45))
    for _ in range(5):
        net.tick(0.1)  # the sweep's ticks come to every replica: they are paced too

    def requests_from(sender: str) -> int:
        return sum(
            1 for _, body in net.held if isinstance(m := decode_message(body), Offer | Pull) and m.origin.id == sender
        )

    old = ["n0", "n1", "n2"]
    sent = {nid: requests_from(nid) for nid in old}
    assert all(0 < n <= RERANK_SLICE + BULK_WINDOW for n in sent.values()), sent
    assert all(net.nodes[nid].ps.ranks.walking() for nid in old)  # the rest waits for the answers
    # The new broker takes what came, a share per 0.1 s: the walks go on as it answers, and finish.
    for _ in range(3000):
        if not net.held and not any(net.nodes[nid].ps.ranks.walking() for nid in old):
            break
        net.tick(0.1)
        for item in net.held[:100]:
            net.release(item)
    else:
        raise AssertionError(f"{len(net.held)} held, walks {[net.nodes[n].ps.ranks.walking() for n in old]}")
    net.hold = lambda to, m: False
    net.tick(1.0)
    ps = net.nodes[joined].ps
    assert len(mine) > RERANK_SLICE
    assert all(ps.table.replicas[t].stage is Stage.SERVING and ps.table.replicas[t].log.rows for t in mine)


def test_peer_progress_gives_the_walk_room_for_a_window_of_unanswered_requests_per_peer() -> None:
    progress = PeerProgress(4)
    for corr in range(1, 7):  # six requests to a, one to b
        progress.sent(corr)
        progress.asked("a", corr, 0.0)
    progress.sent(7)
    progress.asked("b", 7, 0.0)
    assert progress.room(0.0, within=2.0) == 0  # a holds a window (and no more: its queue is bounded)
    progress.answered("a", 4, 0.5)  # and everything sent to it before 4
    assert progress.room(0.5, within=2.0) == 2  # 5 and 6 still out
    progress.answered("a", 1, 0.6)  # a late answer of an earlier one moves nothing
    assert progress.room(0.6, within=2.0) == 2
    assert progress.room(2.5, within=2.0) == 4  # unanswered for 2 s: lost, or the peer is failing
    progress.sent(8)
    progress.asked("a", 8, 2.5)
    progress.forget({"b": None})  # a left the view
    assert progress.room(2.5, within=2.0) == 4
