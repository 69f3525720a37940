"""Topic data follows membership on real brokers (docs/storage.md): rolling restarts, joins next to a topic,
churn.  Real broker processes over mutual TLS on 127.0.0.1; a publisher and a subscriber that stay attached
through it all (they reconnect to other brokers as theirs go away)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cli.cluster import LocalCluster
from client.client import Client, PublishAck, Subscription
from overlay.geometry import distance, geohash
from tests import netcut
from tests.cluster import wait_for
from tests.conftest import FAST_ARGS

pytestmark = pytest.mark.slow

RATE = 100.0  # messages per second, as the operator tried it


@dataclass
class Stream:
    """A publisher at RATE msg/s on one topic and a subscriber on another broker, both reconnecting."""

    topic: str
    acked: set[int] = field(default_factory=set)
    received: list[int] = field(default_factory=list)
    sent: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def publish(self, client: Client) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        pending: list[asyncio.Future[PublishAck]] = []
        while not self.stop.is_set():
            fut = await client.publish_nowait(self.topic, f"reading {self.sent}")
            fut.add_done_callback(self._acked)
            pending.append(fut)
            self.sent += 1
            # Paced, not synchronised: the next message is due at start + sent / RATE.
            await asyncio.sleep(max(0.0, start + self.sent / RATE - loop.time()))

    def _acked(self, fut: asyncio.Future[PublishAck]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.acked.add(fut.result().seq)

    async def receive(self, sub: Subscription) -> None:
        async for m in sub:
            self.received.append(m.seq)


@contextlib.asynccontextmanager
async def streaming(cluster: LocalCluster, topic: str, pub_at: int, sub_at: int) -> AsyncIterator[Stream]:
    """Run a Stream while the body changes the cluster; on exit, wait until every acknowledged message arrived."""
    s = Stream(topic)
    creds = cluster.credentials()
    addrs = [bp.listen for bp in cluster.nodes]
    pub_order = [addrs[pub_at], *(a for a in addrs if a != addrs[pub_at])]
    sub_order = [addrs[sub_at], *(a for a in addrs if a != addrs[sub_at])]
    async with (
        Client(pub_order, client_id="meter-1", credentials=creds, heartbeat_interval=0.25) as pub,
        Client(sub_order, credentials=creds, heartbeat_interval=0.25) as subc,
    ):
        sub = await subc.subscribe(topic)
        receiver = asyncio.create_task(s.receive(sub))
        publisher = asyncio.create_task(s.publish(pub))
        try:
            await wait_for(lambda: len(s.acked) >= 20, 20.0, "the first acknowledgements")
            yield s
        finally:
            s.stop.set()
            await publisher
        # Every message the publisher sent is acknowledged eventually (it re-sends), and reaches the subscriber.
        await wait_for(lambda: len(s.acked) == s.sent, 30.0, f"acknowledgements of all {s.sent} messages")
        await wait_for(lambda: s.acked <= set(s.received), 30.0, "delivery of every acknowledged message")
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver


async def replay(cluster: LocalCluster, topic: str) -> list[int]:
    async with Client([bp.listen for bp in cluster.live()], credentials=cluster.credentials()) as c:
        return [r.seq for r in await c.fetch(topic, 0.0)]


def holders(cluster: LocalCluster, topic: str) -> list[int]:
    """Broker indexes by distance to h(topic): primary first."""
    c = geohash(topic)
    return sorted(range(len(cluster.nodes)), key=lambda i: distance(cluster.nodes[i].coord, c))


@pytest.mark.parametrize(
    ("level", "disks"),
    [(2, False), (3, True)],
    ids=["level2-memory", "level3-disks"],
)
async def test_a_rolling_restart_loses_no_acknowledged_message(tmp_path: Path, level: int, disks: bool) -> None:
    # The operator's procedure of the issue: every broker in turn gets SIGTERM and starts again at the same
    # coordinate and address; the next waits until the overlay is exact again and `sedax status` shows every
    # replica of the topic caught up (a new secondary is back-filled while publishes are acknowledged, so the
    # acknowledgements flowing again do not yet say the history is copied).  Two rounds (an upgrade, then a
    # configuration change), the topic's holders first: every holder leaves twice.
    topic = "grid/rolling/voltage"
    async with LocalCluster(
        7, seed=71, resilience=level, state_dir=tmp_path, broker_args=FAST_ARGS, data_dirs=disks
    ) as cluster:

        async def settled() -> bool:
            held = [h for st in (await cluster.statuses()).values() for h in st.held if h.topic == topic]
            return len(held) >= level and all((h.state, h.pending) == ("caught_up", 0) for h in held)

        await cluster.wait_converged(30.0)
        order = holders(cluster, topic)
        # Publisher and subscriber start far from the topic; they meet every broker's restart on the way.
        async with streaming(cluster, topic, pub_at=order[-1], sub_at=order[-2]) as s:
            for i in order + order:
                assert await cluster.stop(i) == 0, cluster.nodes[i].stderr_tail()
                await cluster.restart(i)
                await cluster.wait_converged(30.0)
                await wait_for(lambda n=s.sent: len(s.acked) >= n, 30.0, f"acknowledgements after restarting {i}")
                await wait_for(settled, 30.0, f"every replica caught up after restarting {i}")
        history = await replay(cluster, topic)
        assert s.acked <= set(history), f"lost: {sorted(s.acked - set(history))[:20]}"
        assert len(history) == len(set(history)), "a replay returned a message twice"
        assert len(s.received) == len(set(s.received)), "the subscriber got a message twice"

        # What the operator sees once it is over (`sedax status`): every replica caught up, nothing behind.
        async def quiet() -> bool:
            held = [h for st in (await cluster.statuses()).values() for h in st.held if h.topic == topic]
            return len(held) >= 2 and all((h.state, h.behind, h.pending) == ("caught_up", 0, 0) for h in held)

        await wait_for(quiet, 20.0, "every replica caught up in STATUS")


async def test_brokers_joining_next_to_topics_serve_their_whole_history(tmp_path: Path) -> None:
    # The second finding: 4 joins into a 6-broker cluster holding 12 topics x 50 messages; each joiner
    # lands right next to a topic's coordinate and becomes its primary.  Every topic replays all 50.
    topics = [f"grid/join/{i}" for i in range(12)]
    async with LocalCluster(6, seed=62, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS) as cluster:
        await cluster.wait_converged(30.0)
        async with Client([bp.listen for bp in cluster.nodes], credentials=cluster.credentials()) as c:
            await asyncio.gather(*(c.publish(t, f"{t} {k}") for t in topics for k in range(50)))
        rng = random.Random(4)
        joined = rng.sample(topics, 4)
        predecessors = {holders(cluster, t)[0] for t in joined}
        for t in joined:
            x, y = geohash(t)
            await cluster.add((min(max(x + 0.003, 0.0), 1.0), min(max(y + 0.002, 0.0), 1.0)))
            await cluster.wait_converged(30.0)
        for t in joined:
            assert holders(cluster, t)[0] >= 6, f"the newcomer is not closest to {t}"
        # The newcomers' predecessors fail, one at a time: only what was handed on is left of those topics.
        for i in sorted(predecessors):
            await cluster.kill(i)
            await cluster.wait_converged(30.0)
        for t in topics:
            assert sorted(await replay(cluster, t)) == list(range(50)), t


async def test_churn_every_two_seconds_loses_no_acknowledged_message(tmp_path: Path) -> None:
    # The churn: for 60 s, every 2 s one broker joins and one leaves, alternately gracefully (SIGTERM)
    # and by SIGKILL, under publishing at level 2.  Two anchor brokers stay (the clients know their addresses;
    # the others come and go).  No acknowledged message may be lost; the delivery ratio and the time until the
    # subscriber has everything after the churn stops are reported.
    topic = "grid/churn/voltage"
    rng = random.Random(60)
    async with LocalCluster(8, seed=88, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS) as cluster:
        await cluster.wait_converged(30.0)
        anchors = {0, 1}
        loop = asyncio.get_running_loop()
        changes = 0
        async with streaming(cluster, topic, pub_at=0, sub_at=1) as s:
            start = loop.time()
            while loop.time() - start < 60.0:
                tick = loop.time()
                await cluster.add()
                victims = [bp.index for bp in cluster.live() if bp.index not in anchors]
                victim = rng.choice(victims)
                if changes % 2 == 0:
                    await cluster.stop(victim)
                else:
                    await cluster.kill(victim)
                changes += 1
                # Paced, not synchronised: the next change is due 2 s after this one began.
                await asyncio.sleep(max(0.0, tick + 2.0 - loop.time()))
            churn_end = loop.time()
            during = (len(set(s.received) & s.acked), len(s.acked))
        recovered = loop.time() - churn_end
        history = await replay(cluster, topic)
        assert s.acked <= set(history), f"lost: {sorted(s.acked - set(history))[:20]}"
        assert len(history) == len(set(history))
        print(  # the figures the issue asks to report (docs/storage.md quotes a run)
            f"\nchurn: {changes} changes in 60 s, {s.sent} messages; delivered while churning "
            f"{during[0]}/{during[1]} = {during[0] / max(1, during[1]):.3f}; all delivered {recovered:.1f} s after it"
        )


NFT_MISSING = netcut.unavailable()


@pytest.mark.skipif(NFT_MISSING is not None, reason=str(NFT_MISSING))
async def test_a_healed_partition_merges_the_histories_and_loses_no_acknowledged_message(tmp_path: Path) -> None:
    # Nine brokers at level 2, each on a loopback address of its own; nftables drops every packet between the
    # west half and the east half for several seconds while a publisher on each side goes on publishing to
    # the same topics (both sides elect their own primaries and acknowledge).  Then the cut heals: the overlays
    # find each other again and merge, and so do the topics' histories.  A subscriber on each side stays
    # attached throughout: it gets every acknowledged message, the other side's too, once and in order per
    # publisher (the primary that kept the topic pushes what it merged; the client fetches behind a gap).
    topics = [f"grid/partition/{i}" for i in range(4)]
    async with LocalCluster(9, seed=99, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS, hosts=True) as cluster:
        await cluster.wait_converged(30.0)
        west = [bp for bp in cluster.nodes if bp.coord[0] < 0.5]
        east = [bp for bp in cluster.nodes if bp.coord[0] >= 0.5]
        assert west and east
        creds = cluster.credentials()
        acked: dict[str, set[tuple[str, int]]] = {t: set() for t in topics}
        stop = asyncio.Event()
        received: dict[str, dict[str, list[tuple[str, int]]]] = {"west": {}, "east": {}}

        async def receive(sub: Subscription, into: list[tuple[str, int]]) -> None:
            async for m in sub:
                into.append((m.publisher, m.seq))

        subscribers = [
            Client([bp.listen for bp in side], credentials=creds, heartbeat_interval=0.25) for side in (west, east)
        ]
        receivers = []
        for name, sc in zip(("west", "east"), subscribers, strict=True):
            await sc.__aenter__()
            for t in topics:
                received[name][t] = []
                receivers.append(asyncio.create_task(receive(await sc.subscribe(t), received[name][t])))

        async def publish(name: str, side: list[Any]) -> None:
            sent: list[asyncio.Future[PublishAck]] = []
            c = Client([bp.listen for bp in side], client_id=name, credentials=creds)

            def note(t: str, f: asyncio.Future[PublishAck]) -> None:
                if not f.cancelled() and f.exception() is None:
                    acked[t].add((c.publisher_id, f.result().seq))  # stored under "name#start", not the client id

            async with c:
                k = 0
                while not stop.is_set():
                    for t in topics:
                        f = await c.publish_nowait(t, f"{name} {k}")
                        f.add_done_callback(functools.partial(note, t))
                        sent.append(f)
                    k += 1
                    await asyncio.sleep(0.02)  # pacing (50 rounds a second), not synchronisation
                await wait_for(lambda: all(f.done() for f in sent), 30.0, f"{name}'s acknowledgements")

        def count() -> int:
            return sum(len(a) for a in acked.values())

        tasks = [asyncio.create_task(publish("west-meter", west)), asyncio.create_task(publish("east-meter", east))]
        try:
            await wait_for(lambda: count() >= 40, 20.0, "acknowledgements before the cut")
            with netcut.Cut() as cut:
                cut.cut([cluster.host(bp.index) for bp in west], [cluster.host(bp.index) for bp in east])

                async def split() -> bool:
                    sts = await cluster.statuses()
                    ids = {bp.node_id: bp.coord[0] < 0.5 for bp in cluster.nodes}
                    return all(ids[n.id] == ids[nid] for nid, st in sts.items() for n in st.neighbours)

                await wait_for(split, 30.0, "the overlay split into its two sides")
                before = count()
                await wait_for(lambda: count() >= before + 100, 30.0, "acknowledgements on both sides of the cut")
            await cluster.wait_converged(60.0)
            after = count()
            await wait_for(lambda: count() >= after + 40, 30.0, "acknowledgements after the heal")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        for t in topics:

            async def merged(t: str = t) -> bool:
                got = await replay_pairs(cluster, t)
                return acked[t] <= set(got)

            try:
                await wait_for(merged, 30.0, f"the merged history of {t}")
            except AssertionError as exc:
                # What is missing and who holds the topic in what state: what a failure here needs to be read.
                missing = sorted(acked[t] - set(await replay_pairs(cluster, t)))
                pubs = {p: [q for pp, q in missing if pp == p] for p, _ in missing}
                held = {n: [h for h in st.held if h.topic == t] for n, st in (await cluster.statuses()).items()}
                raise AssertionError(f"{exc}: {len(missing)} acknowledged missing {pubs}; held: {held}") from None
            got = await replay_pairs(cluster, t)
            assert len(got) == len(set(got)), f"{t}: a message is stored twice"
        try:
            for name, by_topic in received.items():
                for t, got_live in by_topic.items():
                    await wait_for(
                        lambda t=t, got_live=got_live: acked[t] <= set(got_live),  # type: ignore[misc]
                        30.0,
                        f"{name} subscriber: every acknowledged message of {t}",
                    )
                    assert len(got_live) == len(set(got_live)), f"{name} subscriber got a message of {t} twice"
                    for pub in {p for p, _ in got_live}:
                        seqs = [q for p, q in got_live if p == pub]
                        assert seqs == sorted(seqs), f"{name} subscriber: {pub}'s messages of {t} out of order"
        finally:
            for task in receivers:
                task.cancel()
            await asyncio.gather(*receivers, return_exceptions=True)
            for sc in subscribers:
                await sc.__aexit__(None, None, None)


async def replay_pairs(cluster: LocalCluster, topic: str) -> list[tuple[str, int]]:
    async with Client([bp.listen for bp in cluster.live()], credentials=cluster.credentials()) as c:
        return [(r.publisher, r.seq) for r in await c.fetch(topic, 0.0)]


@pytest.mark.skipif(NFT_MISSING is not None, reason=str(NFT_MISSING))
async def test_one_broken_link_between_live_brokers_causes_no_failover(tmp_path: Path) -> None:
    # nftables cuts exactly the link between a topic's primary and its secondary (both alive, every other
    # broker reaches both).  Each end finds the link silent and asks their common neighbours, which still hear
    # the other end: no failover, no take-over; replication and deliveries detour through a neighbour.
    topic = "grid/linkcut/voltage"
    async with LocalCluster(9, seed=97, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS, hosts=True) as cluster:
        await cluster.wait_converged(30.0)
        order = holders(cluster, topic)
        primary, secondary = cluster.nodes[order[0]], cluster.nodes[order[1]]
        sts = await cluster.statuses()
        assert secondary.node_id in {n.id for n in sts[primary.node_id].neighbours}, "not a Delaunay edge"
        async with streaming(cluster, topic, pub_at=order[-1], sub_at=order[-2]) as s:
            with netcut.Cut() as cut:
                cut.cut([cluster.host(primary.index)], [cluster.host(secondary.index)])

                async def refuted() -> bool:
                    sts = await cluster.statuses()
                    return all(
                        sts[bp.node_id].counters.get("suspicions_refuted", 0) >= 1 for bp in (primary, secondary)
                    )

                await wait_for(refuted, 30.0, "both ends of the cut link vouched for by a neighbour")
                before = len(s.acked)
                await wait_for(lambda: len(s.acked) >= before + 200, 30.0, "publishing on while the link is cut")
            await cluster.wait_converged(30.0)
        sts = await cluster.statuses()
        assert all(st.counters.get("takeovers", 0) == 0 for st in sts.values()), "a take-over happened"
        assert all(st.counters.get("failures_detected", 0) == 0 for st in sts.values()), "a failure was declared"
        history = await replay(cluster, topic)
        assert s.acked <= set(history)
        assert len(history) == len(set(history))


async def test_level_three_loses_nothing_when_primary_and_secondary_die_together(tmp_path: Path) -> None:
    # Level 3: every acknowledged message is on the primary, the secondary and the tertiary, so SIGKILL of
    # the first two at the same moment (two changes at once) loses nothing.
    topic = "grid/level3/frequency"
    async with LocalCluster(7, seed=73, resilience=3, state_dir=tmp_path, broker_args=FAST_ARGS) as cluster:
        await cluster.wait_converged(30.0)
        order = holders(cluster, topic)
        async with Client([cluster.nodes[order[-1]].listen], credentials=cluster.credentials()) as c:
            acked = [(await c.publish(topic, f"v{k}")).seq for k in range(150)]
        await asyncio.gather(cluster.kill(order[0]), cluster.kill(order[1]))
        await cluster.wait_converged(30.0)
        assert sorted(await replay(cluster, topic)) == sorted(acked)
