"""Brokers as processes: Delaunay convergence, exact greedy routing, healing after crashes and leaves."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from cluster import Relay, check_routes, log_has, raw_connect, read_until_eof, wait_for
from conftest import FAST_ARGS

# Imported for their messages' registration: a broker sends its neighbours LOAD_REPORT and pub/sub messages.
import overlay.delegation
import overlay.pubsub  # noqa: F401
from cli.cluster import BrokerProcess, LocalCluster
from client.admin import AdminClient
from overlay.geometry import distance
from overlay.protocol import (
    PROTOCOL_VERSION,
    ControlFrame,
    FrameDecoder,
    Hello,
    HelloOk,
    Join,
    JoinAccept,
    Leave,
    Message,
    Neighbours,
    NodeInfo,
    Ping,
    Unlink,
    encode_control,
)

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


async def test_twenty_brokers_converge_to_scipy_delaunay(cluster20: LocalCluster) -> None:
    await cluster20.wait_converged(30.0)
    sts = await cluster20.statuses()
    links = {nid: {n.id for n in st.neighbours} for nid, st in sts.items()}
    assert len(links) == 20
    assert links == cluster20.expected_neighbours()
    # Links are symmetric and advertised sets agree with them once converged.
    for nid, st in sts.items():
        assert set(st.desired) == links[nid]
        assert st.loads == {"L1": 0, "L2": 0, "L3": 0}


async def test_routing_1000_targets_reaches_closest_broker(cluster20: LocalCluster) -> None:
    await cluster20.wait_converged(30.0)
    hops = await check_routes(cluster20, 1000, seed=1)
    assert max(hops) <= 20


async def test_sigkill_three_brokers_heals_within_5s(cluster20: LocalCluster) -> None:
    await cluster20.wait_converged(30.0)
    live = cluster20.live()
    rng = np.random.default_rng(3)
    victims = [live[int(i)].index for i in rng.choice(len(live), size=3, replace=False)]
    await asyncio.gather(*(cluster20.kill(i) for i in victims))
    await cluster20.wait_converged(5.0)  # the bound: exact Delaunay again within 5 s, or it fails
    assert len(cluster20.live()) == 17
    await check_routes(cluster20, 300, seed=4)


async def test_sigterm_leave_heals(cluster20: LocalCluster) -> None:
    # (SIGHUP reads the security files again and the broker stays: tests/test_reload.py.)
    await cluster20.wait_converged(30.0)
    victim = cluster20.live()[len(cluster20.live()) // 2]
    code = await cluster20.stop(victim.index, sig=signal.SIGTERM)
    assert code == 0, victim.stderr_tail()
    assert log_has(victim, "SIGTERM: leaving the overlay"), victim.stderr_tail()
    await cluster20.wait_converged(5.0)
    await check_routes(cluster20, 200, seed=5)


async def test_five_brokers_joining_at_once_converge(cluster20: LocalCluster) -> None:
    await cluster20.wait_converged(30.0)
    before = len(cluster20.live())
    await asyncio.gather(*(cluster20.add() for _ in range(5)))
    await cluster20.wait_converged(15.0)
    assert len(cluster20.live()) == before + 5
    await check_routes(cluster20, 200, seed=6)


def _run_broker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker", "--listen", "127.0.0.1:0", *FAST_ARGS, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("level", [1, 3])
async def test_a_broker_with_another_resilience_level_is_refused(cluster20: LocalCluster, level: int) -> None:
    # Before, it joined: at level 1 in a level-2 overlay it acknowledged messages of its topics with no copy made.
    entry = cluster20.live()[-1]
    args = ("--coord", "0.123,0.456", "--join", entry.listen, "--resilience", str(level))
    res = await asyncio.to_thread(_run_broker, *args)
    assert res.returncode == 3, res.stderr
    assert "resilience_mismatch" in res.stderr, res.stderr
    assert f"was started with --resilience {level}: start it with --resilience 2" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stdout == ""  # never announced readiness


async def test_duplicate_coordinate_is_refused(cluster20: LocalCluster) -> None:
    taken = cluster20.live()[0]
    entry = cluster20.live()[-1]
    res = await asyncio.to_thread(
        _run_broker, "--coord", f"{taken.coord[0]!r},{taken.coord[1]!r}", "--join", entry.listen
    )
    assert res.returncode == 3
    assert "duplicate_coordinate" in res.stderr
    assert f"already taken by broker {taken.node_id}" in res.stderr
    assert res.stdout == ""  # never announced readiness


async def test_coordinate_outside_space_or_another_space_is_refused(cluster20: LocalCluster) -> None:
    entry = cluster20.live()[0]
    # Locally: the default space is the unit square, so the flag itself is rejected.
    res = await asyncio.to_thread(_run_broker, "--coord", "1.5,0.5", "--join", entry.listen)
    assert res.returncode == 2
    assert "outside the space" in res.stderr
    # Remotely: a broker configured with another space is refused by the overlay, also where its coordinate lies
    # in both (before, that one joined, and placed every topic at coordinates the others do not use).
    for coord in ("1.5,1.5", "0.5,0.5"):
        res = await asyncio.to_thread(_run_broker, "--coord", coord, "--space", "0,0,2,2", "--join", entry.listen)
        assert res.returncode == 3, res.stderr
        assert "space_mismatch" in res.stderr, res.stderr
        assert "was started with --space 0,0,2,2: start it with --space 0,0,1,1" in res.stderr, res.stderr
        assert res.stdout == ""  # never announced readiness


async def test_unreachable_join_address_fails_clearly() -> None:
    # Port 1 on localhost is closed: connecting fails at once.
    res = await asyncio.to_thread(_run_broker, "--coord", "0.5,0.5", "--join", "127.0.0.1:1")
    assert res.returncode == 4
    assert "could not join through any address" in res.stderr


async def test_a_bootstrap_broker_starts_the_overlay_alone_or_rejoins_it(tmp_path: Path) -> None:
    # Compose's b1: it lists the other brokers to join through and has --bootstrap.  Nothing listens there
    # (a whole cluster starting): it starts the overlay at once, instead of trying until its join time-out
    # (600 s here, far beyond wait_ready's deadline).
    async with LocalCluster(0, state_dir=tmp_path, broker_args=FAST_ARGS, tls=False) as cluster:
        first = cluster.spawn((0.2, 0.2), ["127.0.0.1:1", "127.0.0.1:2"], "--bootstrap", "--join-timeout", "600")
        await cluster.wait_ready(first)
        await cluster.add((0.8, 0.3), [first.listen])
        await cluster.add((0.5, 0.8), [first.listen])
        await cluster.wait_converged(20.0)
        # Restarted alone while the others run, it joins their overlay through them instead of starting a
        # second one (wait_converged expects the one triangulation of all three).
        assert await cluster.stop(0) == 0
        await cluster.restart(0, "--bootstrap", "--join-timeout", "600")
        await cluster.wait_converged(20.0)


async def test_brokers_on_a_grid_link_both_diagonals_of_every_square_and_route(tmp_path: Path) -> None:
    # A grid (how an operator may place brokers: a substation per block) has four cocircular brokers per square
    # and no unique triangulation.  Each broker computes its links from its own partial view; they must agree
    # with each other and with the overlay checks (both diagonals, `delaunay_neighbour_map`), not each pick one.
    grid = [(0.2 + 0.3 * i, 0.2 + 0.3 * j) for j in range(3) for i in range(3)]
    async with LocalCluster(9, coords=grid, state_dir=tmp_path, broker_args=FAST_ARGS, tls=False) as cluster:
        await cluster.wait_converged(60.0)
        links = cluster.expected_neighbours()
        centre = next(bp.node_id for bp in cluster.nodes if bp.coord == (0.5, 0.5))
        assert len(links[centre]) == 8, links  # the four sides and the four diagonals
        await check_routes(cluster, 100, seed=8)


async def _join_through_a_relay(tmp_path: Path, drop: Callable[[Message, bool], bool]) -> tuple[str, str]:
    """A newcomer (n3, --join-timeout 600: far beyond wait_ready's deadline) joins a settled 3-broker cluster through
    a relay of ours in front of n0 that drops the frames `drop` picks; once the overlay is whole with it, its log
    and the relay's address."""
    async with LocalCluster(3, seed=7, state_dir=tmp_path, broker_args=FAST_ARGS, tls=False) as cluster:
        await cluster.wait_converged(20.0)
        async with Relay(cluster.nodes[0].listen, drop) as relay:
            newcomer = cluster.spawn((0.5, 0.5), [relay.address], "--join-timeout", "600")
            await cluster.wait_ready(newcomer)
            await cluster.wait_converged(20.0)
        return newcomer.err_path.read_text(), relay.address


async def test_a_newcomer_whose_join_answer_is_lost_goes_on_once_a_neighbour_linked(tmp_path: Path) -> None:
    # The newcomer joins through a relay of ours in front of the bootstrap broker that passes every frame but
    # JOIN_ACCEPT: the answer is lost, as one routed back through a broker whose links are not up yet is, while
    # the join connection itself stays alive (PINGs and PONGs pass).  The closest broker accepted and dials the
    # newcomer all the same; once it has, the newcomer waits at most JOIN_ANSWER_GRACE for the answer instead
    # of its join time-out (600 s here, far beyond wait_ready's deadline).
    swallowed: list[str] = []

    def drop(m: Message, up: bool) -> bool:
        if not up and isinstance(m, JoinAccept):
            swallowed.append(m.node.id)
            return True
        return False

    log, _ = await _join_through_a_relay(tmp_path, drop)
    assert swallowed, "the relay passed the JOIN's answer"
    assert "answered late" in log


async def test_a_join_that_gets_no_answer_and_no_neighbour_is_sent_again(tmp_path: Path) -> None:
    # A 10-broker cluster started together in CI (2026-11-29): the broker that answered a JOIN was joining
    # itself, the route back ended at it ("no linked neighbour leads back"), and it dropped the newcomer again as
    # the overlay around it formed.  No answer and no neighbour: the newcomer waited its whole join time-out and
    # exited 4.  Here a relay of ours drops the first JOIN on its way (nobody accepts it, nobody dials the
    # newcomer); the newcomer sends it again after JOIN_ANSWER_FIRST instead of waiting 600 s.
    dropped: list[str] = []

    def drop(m: Message, up: bool) -> bool:
        if up and isinstance(m, Join) and not dropped:
            dropped.append(m.node.id)
            return True
        return False

    log, relay = await _join_through_a_relay(tmp_path, drop)
    assert dropped == ["n3"]  # (the newcomer)
    assert f"joined via {relay}" in log


async def test_a_broker_restarted_before_its_neighbours_redial_it_joins_again(tmp_path: Path) -> None:
    # A crashed broker started again at once (systemd's Restart=always) at its address and coordinate.  Its
    # former neighbours redial a lost neighbour's address once its tombstone lapses (2 s): the new life
    # answers and links before its own JOIN has got through (here a relay of ours holds the JOIN until a
    # neighbour has linked, as a slow path does), so the JOIN is routed to the broker's own coordinate, that
    # is to itself.  It used to refuse itself as a duplicate node id and exit (found by benchmarks/chaos.py).
    async with LocalCluster(4, seed=3, state_dir=tmp_path, broker_args=FAST_ARGS, tls=False) as cluster:
        await cluster.wait_converged(20.0)
        release = asyncio.Event()
        held: list[str] = []

        async def hold(m: Message, up: bool) -> None:
            if up and isinstance(m, Join):
                held.append(m.node.id)
                await release.wait()

        async with Relay(cluster.nodes[0].listen, hold=hold) as relay:
            # The others' STATUS, over connections opened beforehand: the JOIN must go on within JOIN_ANSWER_GRACE
            # (1 s) of the first link, or the newcomer stops waiting for its answer (and counts itself joined, as
            # it should) before the bug can show.  (The new life reports ready only once it joined.)
            creds = cluster.credentials()
            async with contextlib.AsyncExitStack() as stack:
                admins = [
                    await stack.enter_async_context(await AdminClient.connect(b.listen, timeout=5.0, credentials=creds))
                    for b in cluster.nodes[:3]
                ]

                async def linked() -> bool:
                    for a in admins:
                        if any(n.id == "n3" for n in (await a.status()).neighbours):
                            return True
                    return False

                old = cluster.nodes[3]
                await cluster.kill(3)

                async def forgotten() -> bool:
                    return not await linked()

                await wait_for(forgotten, 20.0, "the old life's failure noticed")
                again = cluster.spawn(old.coord, [relay.address], index=3, listen=old.listen)
                await wait_for(lambda: held == ["n3"], 20.0, "the new life's JOIN at the relay")
                await wait_for(linked, 20.0, "a former neighbour redialling the new life")
            release.set()
            await cluster.wait_ready(again)  # ClusterError with its log if it exits instead
            # Its JOIN was answered (not given up on as late, which would not have tested the case).
            assert log_has(again, "joined via"), again.stderr_tail()
            await cluster.wait_converged(20.0)


def test_brokers_die_with_the_cluster_owner(tmp_path: Path) -> None:
    # A test run cut off by a time-out (or `sedax cluster up` killed with SIGKILL) must not leave brokers behind.
    owner = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from cli.cluster import LocalCluster\n"
        "async def main():\n"
        "    c = LocalCluster(2, seed=1, resilience=1, state_dir=Path(sys.argv[1]), tls=False)\n"
        "    await c.__aenter__()\n"
        "    print(' '.join(str(n.proc.pid) for n in c.nodes), flush=True)\n"
        "    await asyncio.sleep(120)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", owner, str(tmp_path)], stdout=subprocess.PIPE, cwd=REPO)
    try:
        assert proc.stdout is not None
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_running(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    deadline = time.monotonic() + 20
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _RawPeer:
    """This test as a broker's neighbour, speaking the broker protocol over plain TCP: HELLO sent on connect,
    and the control messages the broker writes collected in `got` as they are read (`until`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.got: list[Message] = []
        self._frames = FrameDecoder()

    @classmethod
    async def connect(cls, target: BrokerProcess, me: NodeInfo) -> _RawPeer:
        reader, writer = await raw_connect(target)
        writer.write(encode_control(Hello(PROTOCOL_VERSION, me.id, "broker", me.coord, me.listen)))
        return cls(reader, writer)

    async def until(self, kind: type[Message], within: float = 10.0) -> None:
        """Read until the broker has sent a kind (at most within seconds); fails if it closes the link first."""
        async with asyncio.timeout(within):
            while not any(isinstance(m, kind) for m in self.got):
                data = await self.reader.read(65536)
                assert data, f"the broker closed the link before sending {kind.__name__}"
                self.got.extend(f.message for f in self._frames.feed(data) if isinstance(f, ControlFrame))


async def test_a_link_the_peer_gives_up_as_a_duplicate_is_answered_at_once(tmp_path: Path) -> None:
    # Both ends dialled at once and the peer kept the other connection, one this broker had already unlinked
    # (overlay churn while brokers join together): UNLINK(duplicate_link) arrives on the broker's only link to
    # the peer.  The broker must answer at once and close cleanly (its reconciliation dials again if it wants
    # the link); writing on, for a twin that never comes, made the peer's drain time-out reset the link, and the
    # broker declared the live peer failed (tests/test_data_membership.py's broken-link test, now and then).
    # The peer here is this test speaking the broker protocol, so the moment of the UNLINK is exact.  It sends
    # no heartbeats: the broker tolerates 30 s of silence, so only the UNLINK can end the link within the bounds.
    quiet_peer = ("--heartbeat-interval", "1.0", "--heartbeat-misses", "30")
    async with LocalCluster(1, seed=5, state_dir=tmp_path, broker_args=quiet_peer, tls=False) as cluster:
        target = cluster.nodes[0]
        me = NodeInfo("twin-peer", (0.95, 0.95), "127.0.0.1:9")
        assert distance(me.coord, target.coord) > 0.1
        peer = await _RawPeer.connect(target, me)
        await peer.until(Neighbours)  # linked: the broker counts this connection as its link to twin-peer
        assert isinstance(peer.got[0], HelloOk)
        peer.writer.write(encode_control(Unlink("duplicate_link")))
        await peer.until(Unlink)  # its answer, not more writes for a twin it has not seen
        await read_until_eof(peer.reader, 10.0)  # then it closes the connection: both ends sent UNLINK
        peer.writer.close()
        await wait_for(lambda: log_has(target, "reason=duplicate (both ends sent UNLINK)"), 10.0, "a clean close")
        (status,) = (await cluster.statuses()).values()
        assert status.counters.get("failures_detected", 0) == 0
        assert not status.neighbours


async def test_a_leaving_broker_reads_on_until_its_neighbour_has_read_the_leave(tmp_path: Path) -> None:
    # A graceful leave writes LEAVE on every broker link.  Closed at once after it, a link whose neighbour was
    # still writing (what it sent before it read the LEAVE) had bytes unread, and a socket closed with bytes
    # unread is reset: the neighbour met a broken pipe before it read the LEAVE and declared the leaving broker
    # failed (`bench_join.py --leave`, one leave in three or four).  The leaving broker now reads on, dropping
    # what arrives, until the neighbour closes its end (at most drain_timeout).  The neighbour here is this
    # test speaking the broker protocol: it writes on after the LEAVE, as a busy neighbour does, then closes its
    # end, and must see the broker's end close cleanly, not reset.
    quiet_peer = ("--heartbeat-interval", "1.0", "--heartbeat-misses", "30")
    async with LocalCluster(1, seed=5, state_dir=tmp_path, broker_args=quiet_peer, tls=False) as cluster:
        target = cluster.nodes[0]
        peer = await _RawPeer.connect(target, NodeInfo("busy-peer", (0.95, 0.95), "127.0.0.1:9"))
        await peer.until(Neighbours)  # linked: a neighbour, told of the leave
        target.proc.send_signal(signal.SIGTERM)
        await peer.until(Leave)
        try:
            for seq in range(50):  # what a neighbour busy elsewhere still writes before it reads the LEAVE
                peer.writer.write(encode_control(Ping(seq)))
                await peer.writer.drain()
            peer.writer.write_eof()
            await read_until_eof(peer.reader, 10.0)
        except ConnectionError as exc:
            pytest.fail(f"the leaving broker reset the link before its neighbour had read the LEAVE: {exc!r}")
        finally:
            peer.writer.close()
        assert await cluster.wait_exit(target, 10.0) == 0


async def test_two_brokers_leaving_at_once_close_their_link_without_waiting_out_the_drain(tmp_path: Path) -> None:
    # Each end of a link waits, after its LEAVE, for the other to close its end.  Both leaving at once (every
    # broker stopped together: `docker compose down`, `sedax cluster down`), neither closes on the other's LEAVE
    # while its own close is under way, and each waited out its drain time-out.  A LEAVE from a link this end
    # has already said LEAVE on is the peer's last frame: the link closes then.  The other broker here is this
    # test, leaving at the same moment; the drain time-out is set long, so only the LEAVE can end the wait.
    config = tmp_path / "drain.toml"
    config.write_text("drain_timeout = 60.0\n")
    quiet_peer = ("--heartbeat-interval", "1.0", "--heartbeat-misses", "30", "--config", str(config))
    async with LocalCluster(1, seed=5, state_dir=tmp_path, broker_args=quiet_peer, tls=False) as cluster:
        target = cluster.nodes[0]
        peer = await _RawPeer.connect(target, NodeInfo("leaving-peer", (0.95, 0.95), "127.0.0.1:9"))
        try:
            await peer.until(Neighbours)
            target.proc.send_signal(signal.SIGTERM)
            await peer.until(Leave)
            peer.writer.write(encode_control(Leave(())))  # ours, crossing the broker's; our end stays open
            await read_until_eof(peer.reader, 10.0)  # its end closes on our LEAVE, not after 60 s
        finally:
            peer.writer.close()
        assert await cluster.wait_exit(target, 10.0) == 0


async def test_a_link_the_broker_gives_up_carries_nothing_after_its_unlink(tmp_path: Path) -> None:
    # A broker retiring a link (UNLINK) keeps reading it until the peer's UNLINK, and then closes.  It went on
    # beating on it: a beat that reached the peer after the peer had closed made the peer's kernel reset the
    # connection, which discarded what the peer had written before its UNLINK and not yet sent.  A broker that
    # joined next to 30,000 topics lost ~1,800 topics' batches on a duplicate link that way (bench_join.py).
    # Here the peer opens a second link with the same id; the broker keeps one and retires the other.
    beats = ("--heartbeat-interval", "0.05", "--heartbeat-misses", "100")
    async with LocalCluster(1, seed=6, state_dir=tmp_path, broker_args=beats, tls=False) as cluster:
        target = cluster.nodes[0]
        me = NodeInfo("twin-peer", (0.95, 0.95), "127.0.0.1:9")
        links = [await raw_connect(target), await raw_connect(target)]
        got: list[list[Message]] = [[], []]
        ended = [False, False]

        async def reading(i: int) -> None:
            frames = FrameDecoder()
            while data := await links[i][0].read(65536):
                got[i].extend(f.message for f in frames.feed(data) if isinstance(f, ControlFrame))
            ended[i] = True

        def has(i: int, kind: type[Message]) -> bool:
            return any(isinstance(m, kind) for m in got[i])

        readers = [asyncio.create_task(reading(i)) for i in (0, 1)]
        try:
            for i in (0, 1):
                links[i][1].write(encode_control(Hello(PROTOCOL_VERSION, me.id, "broker", me.coord, me.listen)))
                await wait_for(lambda i=i: has(i, HelloOk), 10.0, f"link {i} established")
            await wait_for(lambda: has(0, Unlink) or has(1, Unlink), 10.0, "the broker retiring one of the twins")
            retired = 0 if has(0, Unlink) else 1
            kept = 1 - retired
            # Twenty beats of the broker on the link it kept, while the retired one stays open (no UNLINK of ours).
            beaten = sum(isinstance(m, Ping) for m in got[kept])
            await wait_for(lambda: sum(isinstance(m, Ping) for m in got[kept]) >= beaten + 20, 10.0, "beats")
            after = got[retired][[type(m) for m in got[retired]].index(Unlink) + 1 :]
            assert after == [] and not ended[retired], f"written on the link after its UNLINK: {after}"
            links[retired][1].write(encode_control(Unlink("duplicate_link")))
            await wait_for(lambda: ended[retired], 10.0, "the retired link closed")
            await wait_for(lambda: log_has(target, "reason=duplicate (both ends sent UNLINK)"), 10.0, "a clean close")
        finally:
            for task in readers:
                task.cancel()
            for _, writer in links:
                writer.close()


# A broker whose pub/sub timers raise: what an unforeseen bug in one of its timers does (no flag of the broker's).
FAILING_TIMERS = """
import sys
from broker.main import main
from broker.pubsub.engine import PubSub

def tick(self):
    raise RuntimeError("a bug in a timer")

PubSub.tick = tick
sys.exit(main(sys.argv[1:]))
"""


def test_a_broker_whose_timers_fail_stops_instead_of_serving_on_without_them(tmp_path: Path) -> None:
    # The ticker (heartbeats, time-outs, syncs under interval, retention) died on an exception and the broker
    # served on without it: no heartbeat, no failover, nothing timed out (seen with "Too many open files"
    # before the budget of topic files).  Now it says so in one line and exits 1, so that its supervisor
    # (Docker's restart policy, systemd) starts it again with its topics from the data directory.
    args = ["--coord", "0.5,0.5", "--listen", "127.0.0.1:0", "--insecure", "--data-dir", str(tmp_path / "d")]
    res = subprocess.run(
        [sys.executable, "-c", FAILING_TIMERS, *args], capture_output=True, text=True, timeout=60, check=False, cwd=REPO
    )
    assert res.returncode == 1, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("sedax broker: error:")]
    assert errors == [
        "sedax broker: error: the broker's timers failed (RuntimeError('a bug in a timer')), so it stops; started "
        "again it recovers its topics from --data-dir. This is a bug: please report it with the log above"
    ], res.stderr
