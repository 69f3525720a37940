"""The broker freezes what survives a full collection of the cyclic collector (broker/memory.py
`freeze_survivors`): a full collection then walks only what was made since, not every topic held, and a broker
holding 100,000 topics is not silent for most of a second (its neighbours take three missed 0.2 s heartbeats for
a failure).  That is safe only as long as nothing the broker keeps for a while ends in a reference cycle: frozen,
such a cycle would never be freed.  These tests run the broker's lifecycles with the collector off and check that
they leave no cycle of our objects behind: topics made, copied, subscribed, moved, taken over, handed on and
dropped, and client connections made and closed (TLS, refused and reset)."""

from __future__ import annotations

import collections
import gc
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_pubsub_memory import Net, coordinate_where, grid, locate

from broker.store import Retention
from net import certs
from overlay.delegation import MoveTopic
from overlay.geometry import closest
from overlay.pubsub import Publish, Subscribe, Unsubscribe

ROOT = Path(__file__).resolve().parent.parent
OURS = ("broker.", "overlay.", "net.", "client.", "cli.")


@contextmanager
def collector_off() -> Iterator[Callable[[], list[str]]]:
    """The cyclic collector off; the callable collects and names the types of our objects that only it could
    free (a reference cycle), with how many of each."""
    gc.collect()
    gc.disable()

    def cycles() -> list[str]:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        return sorted(f"{name} x{n}" for name, n in found.items() if name.startswith(OURS))

    try:
        yield cycles
    finally:
        gc.enable()


def test_a_full_collection_freezes_what_survived_it_and_a_frozen_object_is_still_freed() -> None:
    # In a process of its own: the policy is for the whole process (the broker's), not for pytest's.
    script = textwrap.dedent(
        """
        import gc, weakref
        from broker.memory import freeze_survivors

        class Held:
            pass

        freeze_survivors()
        freeze_survivors()  # (installed once)
        held = [Held() for _ in range(1000)]
        probe = weakref.ref(held[0])
        frozen = gc.get_freeze_count()
        gc.collect(1)
        assert gc.get_freeze_count() == frozen, "a young collection froze something"
        gc.collect()
        assert gc.get_freeze_count() >= frozen + 1000, (frozen, gc.get_freeze_count())
        assert not any(isinstance(o, Held) for o in gc.get_objects()), "survivors left for the next full walk"
        del held
        assert probe() is None, "a frozen object outlived its last reference"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("resilience", [2, 3])
def test_topics_made_copied_moved_taken_over_and_dropped_leave_no_reference_cycle(resilience: int) -> None:
    net = Net(grid(8, seed=5), resilience=resilience, retention=Retention(max_age=30.0))
    client = next(iter(net.nodes.values()))
    with collector_off() as cycles:
        names = [f"grid/cycle/{i}" for i in range(60)]
        for i, t in enumerate(names):
            if i >= 20:  # (the first 20 are left empty: subscribed and dropped, then forgotten)
                client.request("p", Publish(t, "P", 0, b"v", 0))
            client.request("s", Subscribe(i + 1, t))
        for i, t in enumerate(names[:20]):
            client.request("s", Unsubscribe(100 + i, t))
        moved = names[-1]
        where = locate(net, moved)
        sites = {nid: n.me.coord for nid, n in net.nodes.items()}
        to = coordinate_where(lambda c: where.primary.id not in closest(sites, c, 3))
        client.request("a", MoveTopic(7, moved, to))
        victim = next(nid for nid in net.nodes if nid not in (client.me.id, where.primary.id))
        net.kill(victim)  # take-overs, new copies, back-fills
        for _ in range(40):
            net.tick(0.05)
        net.join((0.41, 0.63))  # copies ranked out, handed on and dropped
        for _ in range(40):
            net.tick(0.05)
        for _ in range(100):  # those left empty are forgotten
            net.tick(1.0)
        net.sent.clear()
        for n in net.nodes.values():
            n.inbox.clear()
        assert sum(n.ps.counters["empty_forgotten"] for n in net.nodes.values() if n.alive) > 0
        assert sum(n.ps.counters["takeovers"] for n in net.nodes.values() if n.alive) > 0
        assert cycles() == []


CLIENTS = textwrap.dedent(
    """
    import asyncio, sys
    from client.client import Client
    from net.credentials import Credentials

    async def main(addr, ca, cert, key):
        tls = Credentials(ca=ca, cert=cert, key=key)
        for i in range(20):
            async with Client(addr, credentials=tls) as c:
                await c.publish(f"grid/cycle/{i % 4}", b"v")
                await c.subscribe(f"grid/cycle/{i % 4}")
        host, port = addr.rsplit(":", 1)
        for i in range(20):  # refused at the handshake, or reset (last: the guard slows an address that fails)
            _, w = await asyncio.open_connection(host, int(port))
            w.write(b"\\x16\\x03\\x01junk" if i % 2 else b"")
            await w.drain()
            if i % 3 == 0:
                w.transport.abort()
            else:
                w.close()

    asyncio.run(main(*sys.argv[1:]))
    """
)


BROKER = textwrap.dedent(
    """
    import asyncio, collections, gc, sys
    import uvloop
    from broker.config import BrokerConfig
    from broker.node import Broker

    async def main(ca, cert, key, ccert, ckey):
        b = Broker(BrokerConfig(coord=(0.5, 0.5), listen="127.0.0.1:0", tls_cert=cert, tls_key=key, tls_ca=ca,
                                log_level="ERROR"))
        await b.start()
        b.pubsub.resume()
        gc.collect()
        gc.disable()
        clients = await asyncio.create_subprocess_exec(sys.executable, "-c", sys.stdin.read(), b.info.listen, ca,
                                                       ccert, ckey)
        async with asyncio.timeout(60):
            assert await clients.wait() == 0
            while b.links:  # every link closed
                await asyncio.sleep(0.05)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        for name, n in sorted(found.items()):  # (anything: a cycle of uvloop's or ssl's would be frozen too)
            print(f"{name} x{n}")
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await b.shutdown()

    uvloop.run(main(*sys.argv[1:]))
    """
)


def test_client_connections_leave_no_reference_cycle(tmp_path: Path) -> None:
    # The broker in a process of its own, as it runs (uvloop), and the clients in another: what the collector
    # finds in the broker's process is the broker's.  (A broker's links to its neighbours are the same
    # StreamTransport and PeerLink; two brokers in one process are not how brokers run, see
    # docs/benchmarks-scale.md.)
    ca = certs.init_ca(tmp_path)
    bcert, bkey = certs.issue(tmp_path, "b1", "broker", ["127.0.0.1"])
    cert, key = certs.issue(tmp_path, "c1", "client")
    args = [str(p) for p in (ca, bcert, bkey, cert, key)]
    out = subprocess.run(
        [sys.executable, "-c", BROKER, *args], input=CLIENTS, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [], out.stdout
