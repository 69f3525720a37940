"""Randomised faults against a real cluster under load, checking what docs/storage.md promises (not a test).

    .venv/bin/python benchmarks/chaos.py [--seed 1] [--level 2] [--disks] [--faults 12] [--brokers 7]
                                         [--topics 8] [--publishers 3] [--subscribers 3] [--late 2] [--rate 40]
                                         [--kinds kill,term,replace,pause,isolate,cut,full,move,renew] [--stagger]

Real broker processes over mutual TLS on 127.0.0.(10 + i), each publisher and subscriber a `Client` that
reconnects to other brokers as its own goes away.  Publishers publish to every topic (one PUBLISH per message,
paced at --rate per publisher), subscribers each take a random half of the topics; halfway through, --late more
subscribe from the beginning (the stored history, then the live stream).  Faults come one at a time
(docs/storage.md: "every acknowledged message survives any single change" at level 2); at level 3 the kinds
that fail a broker fail two at once (or, with --stagger, one and then another one before the first healed).
Most faults hit the holders of one topic (its primary first).  After each fault the run waits until the overlay
is exact again, every publish sent before it is acknowledged, and every topic's replicas show `caught_up` in
STATUS; then the next.

Kinds (a broker is never one of the first --anchors, whose addresses every client tries first):
  kill     SIGKILL a broker, start it again at its address (with --disks it reads its data back)
  term     SIGTERM (a graceful leave with hand-over), start it again
  replace  SIGKILL a broker and start a new one at a random coordinate
  pause    SIGSTOP for 0.3-3 s (long past failure detection), then SIGCONT: a stale primary comes back
  isolate  nftables drops every packet between a broker and the others for 1-4 s (clients still reach it, so
           both sides acknowledge), then heals: the histories merge
  cut      nftables drops every packet between two neighbouring brokers (most often a topic's primary and
           secondary) for 1-4 s; both stay reachable by the others, so nobody fails over and replication,
           routing and deliveries detour through a common neighbour
  full     with --disks, every broker SIGKILLed at once and started again (needs all anchors to come back)
  move     an operator moves a random topic to a random coordinate (a delegation: the records follow it)
  renew    a broker's certificate issued again and taken by SIGHUP while it serves (docs/security.md)

Checked at the end, once publishing stopped and every subscriber is given 90 s to catch up:
  - every acknowledged message is in its topic's history (a FETCH), once, with the payload it was sent with;
  - every subscriber got every acknowledged message of its topics, once, in order per publisher.
Prints one line per fault and a JSON summary (with `routing`: the routed messages the brokers held while a link
formed, the holds that ran out, and the routed messages dropped with no route, over every broker's lives); exit
status 1 if anything was lost, duplicated or out of order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from cli.cluster import ClusterError, LocalCluster  # noqa: E402
from client.client import Client, PublishAck, RequestFailed, Subscription  # noqa: E402
from client.errors import ClientClosed  # noqa: E402
from net import certs  # noqa: E402
from tests import netcut  # noqa: E402
from tests.cluster import log_has, log_size  # noqa: E402
from tests.cluster import wait_for as poll_until  # noqa: E402

# As the tests run brokers: failure detection within ~2 s of silence, clients that notice a dead broker quickly.
BROKER_ARGS = ("--hello-timeout", "2.0", "--heartbeat-interval", "0.25", "--heartbeat-misses", "8",
               "--client-timeout", "3.0")  # fmt: skip
KINDS = ("kill", "term", "replace", "pause", "isolate", "cut", "full", "move", "renew")
HEAL_WITHIN = 60.0  # seconds for the overlay, the acknowledgements and the replicas after one fault
DRAIN_WITHIN = 90.0  # seconds for every subscriber to get every acknowledged message at the end


class Stuck(RuntimeError):
    """The cluster did not get back to a healthy state within the deadline: reported with what was waited for."""


async def wait_for(cond: Callable[[], bool | Awaitable[bool]], within: float, what: str) -> float:
    """tests/cluster.py's wait_for (a condition polled until true, with a deadline), failing with Stuck."""
    try:
        return await poll_until(cond, within, what)
    except AssertionError as exc:
        raise Stuck(str(exc)) from None


@dataclass
class Publisher:
    """One client publishing to every topic in turn; remembers what each acknowledgement numbered."""

    name: str
    topics: list[str]
    rate: float
    sent: int = 0
    failed: list[str] = field(default_factory=list)
    # (topic, seq) -> the payload sent under it: the history must hold that record with that payload
    ack_payload: dict[tuple[str, int], bytes] = field(default_factory=dict)
    publisher_id: str = ""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    unanswered: dict[int, str] = field(default_factory=dict)  # number (0, 1, ...) -> topic of a publish not answered

    @property
    def acked(self) -> int:
        return len(self.ack_payload)

    async def run(self, client: Client) -> None:
        self.publisher_id = client.publisher_id
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not self.stop.is_set():
            topic = self.topics[self.sent % len(self.topics)]
            payload = f"{self.name}/{topic}/{self.sent}".encode()
            try:
                fut = await client.publish_nowait(topic, payload)
            except ClientClosed:
                return  # the run is over (or failed): the client closed under it
            fut.add_done_callback(lambda f, t=topic, p=payload, n=self.sent: self._done(f, t, p, n))
            self.unanswered[self.sent] = topic
            self.sent += 1
            # Paced, not synchronised: the next message is due at start + sent / rate.
            await asyncio.sleep(max(0.0, start + self.sent / self.rate - loop.time()))

    def answered_before(self, n: int) -> bool:
        """Every publish numbered below n has its answer (an acknowledgement or an error)."""
        return min(self.unanswered, default=n) >= n

    def _done(self, fut: asyncio.Future[PublishAck], topic: str, payload: bytes, n: int) -> None:
        del self.unanswered[n]
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failed.append(f"{topic}: {exc!r}")
            return
        ack = fut.result()
        self.ack_payload[(topic, ack.seq)] = payload


@dataclass
class Subscriber:
    """One client subscribed to some topics; what it got, per topic, in arrival order."""

    name: str
    topics: list[str]
    got: dict[str, list[tuple[str, int, bytes]]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)
    subscriptions: dict[str, Subscription] = field(default_factory=dict)  # (their counters, for a post-mortem)
    client: Client | None = None  # (its renewals: subscriptions whose registration was lost, found by the lease)

    async def receive(self, topic: str, sub: Subscription) -> None:
        self.subscriptions[topic] = sub
        try:
            async for m in sub:
                self.got[topic].append((m.publisher, m.seq, m.payload))
        except Exception as exc:
            self.errors.append(f"{topic}: {exc!r}")


# The routing counters the summary sums over the brokers (docs/metrics.md): routed messages held until a link
# led on, holds that ran out (handled where they were), and routed messages dropped with no route.
ROUTING_COUNTERS = ("routed_held", "routed_held_expired", "dropped_no_route")


@dataclass
class Fault:
    kind: str
    brokers: list[int]
    detail: str = ""
    healed_s: float = 0.0


class Chaos:
    def __init__(self, args: argparse.Namespace, state_dir: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        # Each broker's events (takeover, sync, handoff, move, retire: docs/logs.md) go to state_dir/events, for
        # the post-mortem of a failed run.
        events = ("--log-dir", str(state_dir / "events"), "--log-interval", "1")
        self.cluster = LocalCluster(
            args.brokers, seed=args.seed, resilience=args.level, state_dir=state_dir,
            broker_args=(*BROKER_ARGS, *events), data_dirs=args.disks, hosts=True,
        )  # fmt: skip
        self.topics = [f"grid/chaos/{i}/voltage" for i in range(args.topics)]
        self.pubs = [Publisher(f"meter-{i}", self.rng.sample(self.topics, len(self.topics)), args.rate)
                     for i in range(args.publishers)]  # fmt: skip
        self.subs = [Subscriber(f"scada-{i}", sorted(self.rng.sample(self.topics, max(1, len(self.topics) // 2))))
                     for i in range(args.subscribers)]  # fmt: skip
        self.faults: list[Fault] = []
        self.failed_reloads: list[str] = []  # a renew whose SIGHUP did not take the new certificate

    # ------------------------------------------------------------------------------------------ health

    def _victims(self) -> list[int]:
        return [bp.index for bp in self.cluster.live() if bp.index >= self.args.anchors]

    async def _replicas_settled(self) -> bool:
        try:
            return not await self.cluster.lagging(self.topics, within=3.0)
        except Exception:
            return False

    async def heal(self) -> float:
        """Wait until the overlay is exact, what was sent is acknowledged, and the replicas caught up."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self.cluster.wait_converged(HEAL_WITHIN)
        targets = [(p, p.sent) for p in self.pubs]
        await wait_for(lambda: all(p.answered_before(n) for p, n in targets), HEAL_WITHIN, "acknowledgements")
        await wait_for(self._replicas_settled, HEAL_WITHIN, "every topic's replicas caught_up")
        return loop.time() - start

    # ------------------------------------------------------------------------------------------ faults

    async def _pick(self, k: int) -> list[int]:
        """k brokers to fault: most of the time holders of one topic (its primary first), else any."""
        victims = self._victims()
        if self.rng.random() < 0.7:
            topic = self.rng.choice(self.topics)
            rank = {"primary": 0, "delegate": 0, "secondary": 1, "tertiary": 2}
            try:
                statuses = await self.cluster.statuses(within=3.0)
            except Exception:  # a broker still starting: fault anyone
                statuses = {}
            held = sorted(
                (rank[h.role], int(node[1:])) for node, st in statuses.items() for h in st.held
                if h.topic == topic and h.role in rank
            )  # fmt: skip
            holders = [i for _, i in held if i in victims]
            if holders:
                return holders[:k]
        return self.rng.sample(victims, min(k, len(victims)))

    async def _link(self) -> list[int]:
        """Two brokers linked in the overlay: most of the time a topic's first two holders (primary and secondary
        are Delaunay neighbours), else a random broker and one of its neighbours."""
        statuses = await self.cluster.statuses(within=3.0)
        index = {st.node.id: int(st.node.id[1:]) for st in statuses.values()}
        neighbours = {index[nid]: [index[n.id] for n in st.neighbours if n.id in index] for nid, st in statuses.items()}
        picked = await self._pick(2)
        if len(picked) == 2 and picked[1] in neighbours.get(picked[0], []):
            return picked
        a = picked[0] if picked and neighbours.get(picked[0]) else self.rng.choice(sorted(neighbours))
        return [a, self.rng.choice(neighbours[a])]

    async def fault(self, kind: str, k: int) -> Fault:
        """Inject one fault on k brokers (those kinds that take brokers); the caller waits for the heal."""
        c = self.cluster
        k = k if kind in ("kill", "term", "replace", "pause") else 1
        picked = [] if kind in ("full", "move") else await self._link() if kind == "cut" else await self._pick(k)
        f = Fault(kind, picked)
        if kind == "kill":
            for i in picked:
                await c.kill(i)
            await asyncio.sleep(self.rng.uniform(0.0, 3.0))  # down for a while: the failover may or may not run
            for i in picked:
                await c.restart(i)
        elif kind == "term":
            for i in picked:
                code = await c.stop(i)
                f.detail += f"n{i} exit {code} "
            for i in picked:
                await c.restart(i)
        elif kind == "replace":
            for i in picked:
                await c.kill(i)
            for _ in picked:
                bp = await c.add()
                f.detail += f"new n{bp.index} "
        elif kind == "pause":
            seconds = self.rng.uniform(0.3, 3.0)
            f.detail = f"{seconds:.1f} s "
            for i in picked:
                os.kill(c.nodes[i].pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(seconds)  # the fault itself lasts this long
            finally:
                for i in picked:
                    os.kill(c.nodes[i].pid, signal.SIGCONT)
        elif kind == "isolate":
            seconds = self.rng.uniform(1.0, 4.0)
            f.detail = f"{seconds:.1f} s "
            i = picked[0]
            others = [c.host(bp.index) for bp in c.live() if bp.index != i]
            with netcut.Cut() as cut:
                cut.cut([c.host(i)], others)
                await asyncio.sleep(seconds)  # the fault itself lasts this long
        elif kind == "cut":
            seconds = self.rng.uniform(1.0, 4.0)
            f.detail = f"{seconds:.1f} s "
            with netcut.Cut() as cut:
                cut.cut([c.host(picked[0])], [c.host(picked[1])])
                await asyncio.sleep(seconds)  # the fault itself lasts this long
        elif kind == "move":
            topic = self.rng.choice(self.topics)
            to = (self.rng.random(), self.rng.random())
            f.detail = f"{topic} to ({to[0]:.2f}, {to[1]:.2f}) "
            async with Client([bp.listen for bp in c.live()], credentials=c.credentials()) as admin:
                try:
                    await admin.move(topic, to)
                except Exception as exc:  # a refusal is reported, not a failure of the run
                    f.detail += f"refused: {exc} "
        elif kind == "renew":
            i = picked[0]
            bp = c.nodes[i]
            since = log_size(bp)
            if c.tls:
                certs.issue(c.certs_dir, bp.node_id, "broker", [c.host(i)], force=True)
            os.kill(bp.pid, signal.SIGHUP)
            await poll_until(lambda: log_has(bp, "SIGHUP: ", since), 15.0, f"n{i} reloading")
            if not log_has(bp, "SIGHUP: read again" if c.tls else "SIGHUP: the configuration is as it was", since):
                f.detail += "the reload failed "
                self.failed_reloads.append(f"n{i}: {bp.stderr_tail(3)}")
        elif kind == "full":
            live = [bp.index for bp in c.live()]
            for bp in c.live():
                bp.proc.send_signal(signal.SIGKILL)
            for i in live:
                await c.wait_exit(c.nodes[i], 10.0)
            # Every broker starts again, the anchors first (the others join through them).
            for i in sorted(live):
                await c.restart(i)
            f.brokers = live
        return f

    # ------------------------------------------------------------------------------------------ run

    async def run(self) -> dict[str, object]:
        c = self.cluster
        await c.start()
        try:
            return await self._run()
        finally:
            await c.close()

    async def _dump(self, why: str) -> None:
        """What a stuck run leaves for the reader: the topics still waiting and every broker's STATUS."""
        assert self.cluster.state_dir is not None
        waiting = Counter(t for p in self.pubs for t in p.unanswered.values())
        lines = [f"stuck: {why}", f"publishes not answered, per topic: {json.dumps(waiting)}"]
        try:
            statuses = await self.cluster.statuses(within=5.0)
        except Exception as exc:  # the dump is best effort: say what failed
            lines.append(f"STATUS failed: {exc!r}")
        else:
            for node, st in sorted(statuses.items()):
                held = [f"{h.topic}:{h.role}:{h.state}:behind={h.behind}:pending={h.pending}" for h in st.held]
                lines.append(f"{node} neighbours={sorted(n.id for n in st.neighbours)} held={held}")
        (self.cluster.state_dir / "stuck.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:2]), file=sys.stderr)

    async def _run(self) -> dict[str, object]:
        args = self.args
        c = self.cluster
        await c.wait_converged(60.0)
        creds = c.credentials()
        addrs = [bp.listen for bp in c.nodes]
        tasks: list[asyncio.Task[None]] = []

        def order(first: int) -> list[str]:
            return [addrs[first], *(a for a in addrs if a != addrs[first])]

        async with contextlib.AsyncExitStack() as stack:

            async def attach(s: Subscriber, since: float | None) -> None:
                sc = await stack.enter_async_context(
                    Client(order(self.rng.randrange(len(addrs))), credentials=creds, heartbeat_interval=0.25)
                )
                s.client = sc
                for t in s.topics:
                    for attempt in range(10):  # as an application does: a subscribe refused mid-fault is retried
                        try:
                            sub = await sc.subscribe(t, since)
                            break
                        except (TimeoutError, RequestFailed) as exc:
                            print(f"{s.name} subscribing {t} failed ({exc!r}); again", flush=True)
                            if attempt == 9:
                                raise
                    tasks.append(asyncio.create_task(s.receive(t, sub)))

            for s in self.subs:
                await attach(s, None)
            for p in self.pubs:
                pc = await stack.enter_async_context(
                    Client(order(self.rng.randrange(len(addrs))), client_id=p.name, credentials=creds,
                           heartbeat_interval=0.25, batch_publishes=False)
                )  # fmt: skip
                tasks.append(asyncio.create_task(p.run(pc)))
            await wait_for(lambda: all(p.acked >= 10 for p in self.pubs), 30.0, "the first acknowledgements")
            try:
                kinds = [k for k in args.kinds.split(",") if k != "full" or args.disks]
                t0 = time.monotonic()
                # At level 3 two changes may overlap: together (k=2), or --stagger: one, then another before
                # the first healed (the second lands in the failover, sync or back-fill of the first).
                together = 1 if args.level < 3 or args.stagger else 2
                for n in range(args.faults):
                    if n == args.faults // 2:
                        # Late subscribers, from the beginning: the stored history, then the live stream, while
                        # faults go on; they must end with the same messages as the others.
                        for i in range(args.late):
                            late = Subscriber(f"late-{i}", sorted(self.rng.sample(self.topics, len(self.topics) // 2)))
                            self.subs.append(late)
                            await attach(late, 0.0)
                    kind = self.rng.choice(kinds)
                    f = await self.fault(kind, together)
                    if args.stagger and args.level >= 3 and n % 2 == 0 and kind != "full":
                        await asyncio.sleep(self.rng.uniform(0.0, 1.5))  # the gap between the two changes
                        self.faults.append(f)
                        print(f"{time.monotonic() - t0:7.1f} s  fault {n + 1}/{args.faults}: {f.kind} "
                              f"{','.join(f'n{i}' for i in f.brokers)} {f.detail}(not healed)", flush=True)  # fmt: skip
                        continue
                    f.healed_s = await self.heal()
                    self.faults.append(f)
                    print(
                        f"{time.monotonic() - t0:7.1f} s  fault {n + 1}/{args.faults}: {f.kind} "
                        f"{','.join(f'n{i}' for i in f.brokers)} {f.detail}healed in {f.healed_s:.1f} s; "
                        f"sent {sum(p.sent for p in self.pubs)}, acked {sum(p.acked for p in self.pubs)}",
                        flush=True,
                    )
                for p in self.pubs:
                    p.stop.set()
                await wait_for(lambda: all(not p.unanswered for p in self.pubs), HEAL_WITHIN, "final acks")
            except Stuck as exc:  # what the clients still wait for, before they close
                await self._dump(str(exc))
                raise
            drained = True
            try:
                await wait_for(self._drained, DRAIN_WITHIN, "every subscriber has every acknowledged message")
            except Stuck:
                drained = False
            report = await self.check(drained)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return report

    def _acked(self) -> dict[str, dict[tuple[str, int], bytes]]:
        """topic -> (publisher id, seq) -> payload of every acknowledged message."""
        out: dict[str, dict[tuple[str, int], bytes]] = defaultdict(dict)
        for p in self.pubs:
            for (t, seq), payload in p.ack_payload.items():
                out[t][(p.publisher_id, seq)] = payload
        return out

    def _drained(self) -> bool:
        acked = self._acked()
        for s in self.subs:
            for t in s.topics:
                have = {(pub, seq) for pub, seq, _ in s.got[t]}
                if not acked[t].keys() <= have:
                    return False
        return True

    async def check(self, drained: bool) -> dict[str, object]:
        acked = self._acked()
        problems: list[str] = [f"a reload after a renewal failed: {why}" for why in self.failed_reloads]
        c = self.cluster
        async with Client([bp.listen for bp in c.live()], credentials=c.credentials()) as reader:
            for t in self.topics:
                history = await reader.fetch(t, 0.0)
                keys = [(r.publisher, r.seq) for r in history]
                if len(keys) != len(set(keys)):
                    dup = [k for k in set(keys) if keys.count(k) > 1]
                    problems.append(f"{t}: history holds {len(dup)} messages twice, e.g. {dup[:3]}")
                by_key = {(r.publisher, r.seq): r.payload for r in history}
                lost = [k for k in acked[t] if k not in by_key]
                if lost:
                    problems.append(
                        f"{t}: {len(lost)} acknowledged messages not in the history, e.g. {sorted(lost)[:5]}"
                    )
                wrong = [k for k, p in acked[t].items() if k in by_key and by_key[k] != p]
                if wrong:
                    problems.append(f"{t}: {len(wrong)} records with another payload than acknowledged: {wrong[:3]}")
        for s in self.subs:
            for t in s.topics:
                got = s.got[t]
                keys = [(pub, seq) for pub, seq, _ in got]
                if len(keys) != len(set(keys)):
                    problems.append(f"{s.name} {t}: {len(keys) - len(set(keys))} messages delivered twice")
                last: dict[str, int] = {}
                disorder = 0
                for pub, seq, _ in got:
                    if seq <= last.get(pub, -1):
                        disorder += 1
                    last[pub] = max(seq, last.get(pub, -1))
                if disorder:
                    problems.append(f"{s.name} {t}: {disorder} messages out of order")
                missing = acked[t].keys() - set(keys)
                if missing:
                    # For the post-mortem: a publisher's first messages missing while later ones came (the client
                    # sees no gap before a publisher's first message) against messages dropped as duplicates
                    # (they came after a later one) or repaired.
                    pubs = sorted({pub for pub, _ in missing})
                    first = {pub: next((seq for p, seq, _ in got if p == pub), None) for pub in pubs}
                    sub = s.subscriptions.get(t)
                    counts = (
                        ""
                        if sub is None
                        else (
                            f"; the subscription dropped {sub.duplicates} duplicates, repaired {sub.repaired}, "
                            f"counted {sub.gaps} lost"
                        )
                    )
                    problems.append(f"{s.name} {t}: {len(missing)} acknowledged messages never delivered, "
                                    f"e.g. {sorted(missing)[:5]}; first seq got: {first}{counts}")  # fmt: skip
            problems += [f"{s.name}: {e}" for e in s.errors]
        for p in self.pubs:
            problems += [f"{p.name}: publish failed: {e}" for e in p.failed[:5]]
        return {
            "seed": self.args.seed,
            "level": self.args.level,
            "disks": self.args.disks,
            "faults": [f"{f.kind}:{','.join(map(str, f.brokers))}" for f in self.faults],
            "heal_s_max": round(max((f.healed_s for f in self.faults), default=0.0), 1),
            "sent": sum(p.sent for p in self.pubs),
            "acked": sum(p.acked for p in self.pubs),
            "drained": drained,
            "renewals": sum(s.client.renewals for s in self.subs if s.client is not None),
            "routing": self._routing_counts(),
            "problems": problems,
        }

    def _routing_counts(self) -> dict[str, int]:
        """What the brokers' routing did while the overlay changed (docs/storage.md, "A routed message that arrives
        too early is held"), summed over every life of every broker from the snapshots in state_dir/events.  A
        counter starts again from 0 when its broker restarts, so each life's last value counts (a counter lower
        than the one before is a new life); a life SIGKILLed up to a snapshot interval (1 s) after its last
        snapshot is undercounted by what it did in that second."""
        assert self.cluster.state_dir is not None
        totals = dict.fromkeys(ROUTING_COUNTERS, 0.0)
        for path in sorted((self.cluster.state_dir / "events").glob("*.jsonl")):
            last = dict.fromkeys(ROUTING_COUNTERS, 0.0)
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a SIGKILL
                counters = rec.get("counters") if isinstance(rec, dict) and rec.get("type") == "snapshot" else None
                if not isinstance(counters, dict):
                    continue
                for name in ROUTING_COUNTERS:
                    value = float(counters.get(name, 0.0))
                    if value < last[name]:
                        totals[name] += last[name]  # the broker restarted: its previous life ended at last
                    last[name] = value
            for name in ROUTING_COUNTERS:
                totals[name] += last[name]
        return {name: int(v) for name, v in totals.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--level", type=int, choices=(2, 3), default=2)
    ap.add_argument("--disks", action="store_true", help="every broker keeps its topics in a data directory")
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--brokers", type=int, default=7)
    ap.add_argument("--anchors", type=int, default=2, help="brokers never faulted (clients try them first)")
    ap.add_argument("--topics", type=int, default=8)
    ap.add_argument("--publishers", type=int, default=3)
    ap.add_argument("--subscribers", type=int, default=3)
    ap.add_argument("--late", type=int, default=2, help="subscribers from the beginning, halfway through")
    ap.add_argument("--rate", type=float, default=40.0, help="messages per second per publisher")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to draw from: {','.join(KINDS)}")
    ap.add_argument("--stagger", action="store_true", help="level 3: a second change before the first healed")
    ap.add_argument("--keep", action="store_true", help="keep the cluster's logs and data directories")
    args = ap.parse_args()
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}: choose from {','.join(KINDS)}")
    for kind in ("isolate", "cut"):
        if kind in args.kinds.split(",") and netcut.unavailable():
            ap.error(f"{kind} needs nftables: {netcut.unavailable()} (or leave it out of --kinds)")
    if not netcut.unavailable():
        for table in netcut.sweep_stale():
            print(f"deleted the nftables table {table} a killed run left behind", file=sys.stderr)
    # SIGTERM (a run stopped from outside) ends the run as Ctrl-C does: the cut heals and the brokers stop.
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))
    state = Path(tempfile.mkdtemp(prefix=f"sedax-chaos-{args.seed}-"))
    try:
        report = asyncio.run(Chaos(args, state).run())
    except Stuck as exc:
        print(f"stuck: {exc}; logs in {state}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the cut healed and the brokers stopped on the way out
        print(f"interrupted; logs in {state}", file=sys.stderr)
        return 130
    except ClusterError as exc:  # a broker that exited instead of starting: a finding, with its log
        print(f"a broker failed: {exc}\nlogs in {state}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1))
    if report["problems"]:
        print(f"FAILED: logs in {state}", file=sys.stderr)
        return 1
    if not args.keep:
        import shutil

        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
