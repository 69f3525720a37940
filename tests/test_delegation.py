"""Topic delegation and load balancing between real broker processes (Sec. III, V, VI)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from cluster import wait_for
from conftest import FAST_ARGS

from cli.cluster import LocalCluster
from client.admin import AdminClient, status_json
from client.client import Client, PublishAck, RequestFailed, Subscription
from overlay.geometry import closest, geohash

pytestmark = pytest.mark.slow


async def drain(sub: Subscription, want: int, within: float) -> list[tuple[str, int]]:
    got: list[tuple[str, int]] = []
    try:
        async with asyncio.timeout(within):
            while len(got) < want:
                m = await anext(sub)
                got.append((m.publisher, m.seq))
    except TimeoutError:
        seqs = {s for _, s in got}
        missing = [i for i in range(want) if i not in seqs]
        raise AssertionError(f"{len(got)} of {want} delivered; missing {missing[:20]}...") from None
    return got


def far_coord(cluster: LocalCluster, topic: str) -> tuple[float, float]:
    """A coordinate whose closest, second and third brokers are none of the topic's current holders."""
    coords = {bp.node_id: bp.coord for bp in cluster.live()}
    home = geohash(topic)
    holders = set(closest(coords, home, 3))
    best: tuple[float, tuple[float, float]] | None = None
    for bp in cluster.live():
        if bp.node_id in holders:
            continue
        c = bp.coord
        d = (c[0] - home[0]) ** 2 + (c[1] - home[1]) ** 2
        if best is None or d > best[0]:
            best = (d, c)
    assert best is not None
    # Just beside a broker far from the home: that broker becomes the delegate.
    x, y = best[1]
    return (x + (1e-3 if x < 0.5 else -1e-3), y + (1e-3 if y < 0.5 else -1e-3))


async def _move_under_stream(cluster: LocalCluster, topic: str, n: int, move_at: list[int]) -> None:
    addrs = [bp.listen for bp in cluster.nodes]
    async with (
        Client([addrs[0]]) as s1,
        Client([addrs[-1]]) as s2,
        Client([addrs[len(addrs) // 2]]) as pub,
        Client(addrs) as admin,
    ):
        sub1, sub2 = await s1.subscribe(topic), await s2.subscribe(topic)
        futs: list[asyncio.Future[PublishAck]] = []
        targets = [far_coord(cluster, topic), geohash(topic)]  # away, then back home
        moves: list[asyncio.Task[None]] = []
        for i in range(n):
            if i in move_at:
                to = targets[move_at.index(i) % len(targets)]
                if moves:
                    await moves[-1]  # one move at a time; the stream goes on meanwhile
                moves.append(asyncio.create_task(admin.move(topic, to)))
            futs.append(await pub.publish_nowait(topic, f"m{i}"))
            if i % 25 == 0:
                await asyncio.sleep(0.005)  # a steady stream, not one burst
        async with asyncio.timeout(60):
            await asyncio.gather(*moves)
            results = await asyncio.gather(*futs, return_exceptions=True)
        acked = [i for i, r in enumerate(results) if isinstance(r, PublishAck)]
        assert acked == list(range(n))
        for sub in (sub1, sub2):
            got = await drain(sub, n, 60)
            assert [seq for _, seq in got] == list(range(n)), "every message once, in order"
            assert sub.gaps == 0 and sub.duplicates == 0, "nothing lost and nothing delivered twice"
        loc = await admin.locate(topic)
        assert len(loc.delegates) >= 1 + len(move_at)
        # FETCH spans the delegations: the whole history is where the topic lives now.
        history = await admin.fetch(topic)
        assert [r.seq for r in history] == list(range(n))


@pytest.mark.parametrize("level", [2, 3])
async def test_move_under_steady_stream_loses_and_duplicates_nothing(tmp_path: Path, level: int) -> None:
    async with LocalCluster(8, seed=30 + level, resilience=level, state_dir=tmp_path, broker_args=FAST_ARGS) as c:
        await c.wait_converged(30.0)
        await _move_under_stream(c, f"grid/moving-{level}/power", 600, move_at=[150, 400])


async def test_delegate_dies_topic_still_served(tmp_path: Path) -> None:
    topic = "grid/delegated/frequency"
    async with LocalCluster(8, seed=40, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS) as c:
        await c.wait_converged(30.0)
        to = far_coord(c, topic)
        addrs = [bp.listen for bp in c.nodes]
        async with Client(addrs) as admin:
            for i in range(20):
                await admin.publish(topic, f"before-{i}")
            await admin.move(topic, to)
            loc = await admin.locate(topic)
            assert abs(loc.coord[0] - to[0]) < 1e-9 and abs(loc.coord[1] - to[1]) < 1e-9
            delegate = next(i for i, bp in enumerate(c.nodes) if bp.node_id == loc.primary.id)
        home_node = closest({bp.node_id: bp.coord for bp in c.nodes}, geohash(topic))[0]
        assert loc.primary.id != home_node
        await c.kill(delegate)
        live = [bp.listen for bp in c.live()]
        async with Client(live) as cl:
            sub = await cl.subscribe(topic, since=0.0)
            got = await drain(sub, 20, 30)
            assert [s for _, s in got] == list(range(20)), "the secondary of C(t) took over the history"
            for i in range(20, 30):
                await cl.publish(topic, f"after-{i}")
            more = await drain(sub, 10, 30)
            assert [s for _, s in more] == list(range(10))


async def _status(addr: str) -> dict[str, object]:
    a = await AdminClient.connect(addr)
    try:
        return status_json(await a.status())
    finally:
        await a.aclose()


async def test_continuous_balancing_moves_load_off_the_busiest_broker(tmp_path: Path) -> None:
    # Ten topics whose home is the same broker: only balancing can spread them.
    coords = [(0.1, 0.1), (0.9, 0.1), (0.5, 0.5), (0.1, 0.9), (0.9, 0.9), (0.5, 0.12), (0.12, 0.5)]
    owner = {i: c for i, c in enumerate(coords)}
    names: list[str] = []
    k = 0
    while len(names) < 10:
        name = f"grid/hot/t{k}"
        if closest(owner, geohash(name))[0] == 2:
            names.append(name)
        k += 1
    args = (*FAST_ARGS, "--balance", "continuous", "--goal", "L1", "--selection", "bestglobal",
            "--balance-interval", "0.5", "--load-report-interval", "0.2", "--query-timeout", "0.5",
            "--move-cooldown", "1", "--min-gain", "0.05", "--balance-scan", "3")  # fmt: skip
    async with LocalCluster(7, coords=coords, resilience=2, state_dir=tmp_path, broker_args=args) as c:
        await c.wait_converged(30.0)
        addrs = [bp.listen for bp in c.nodes]
        async with Client(addrs[0]) as sub_client, Client(addrs[4]) as pub:
            subs = [await sub_client.subscribe(t) for t in names]
            futs = [await pub.publish_nowait(t, b"x" * 1000) for t in names for _ in range(20)]
            async with asyncio.timeout(60):
                await asyncio.gather(*futs)
            busiest = c.nodes[2].listen

            async def l1_of_busiest() -> int:
                st = await _status(busiest)
                loads = st["loads"]
                assert isinstance(loads, dict)
                return int(loads["L1"])

            before = await l1_of_busiest()
            assert before >= 10 * 20 * 1000  # payloads plus per-message overhead: L_T(t) is stored bytes
            await wait_for(lambda: _lower(l1_of_busiest, before // 2), 60, "balancing spread the load")
            # Still served, once each, after the moves.
            futs = [await pub.publish_nowait(t, b"after") for t in names]
            async with asyncio.timeout(60):
                await asyncio.gather(*futs)
            for sub in subs:
                got = await drain(sub, 21, 30)
                assert [s for _, s in got] == list(range(21))
                assert sub.duplicates == 0 and sub.gaps == 0
            moves = 0
            for bp in c.nodes:
                st = await _status(bp.listen)
                counters = st["counters"]
                assert isinstance(counters, dict)
                moves += int(counters["moves"])
            assert moves >= 1


async def _lower(f: object, bound: int) -> bool:
    assert callable(f)
    return bool(await f() <= bound)


@pytest.mark.parametrize("selection", ["indcoord", "bestlocal", "bestregional", "bestglobal"])
async def test_dry_run_reports_and_moves_nothing(tmp_path: Path, selection: str) -> None:
    coords = [(0.2, 0.2), (0.8, 0.2), (0.5, 0.8), (0.5, 0.45)]
    args = (*FAST_ARGS, "--selection", selection, "--queries", "4", "--load-report-interval", "0.2",
            "--query-timeout", "5.0", "--min-gain", "0")  # fmt: skip
    async with LocalCluster(4, coords=coords, resilience=2, state_dir=tmp_path, broker_args=args) as c:
        await c.wait_converged(30.0)
        topic = next(
            f"grid/dry/{k}"
            for k in range(1000)
            if closest({i: x for i, x in enumerate(coords)}, geohash(f"grid/dry/{k}"))[0] == 3
        )
        addr = c.nodes[3].listen
        async with Client(addr) as cl:
            for _ in range(10):
                await cl.publish(topic, b"y" * 500)
            before = await cl.locate(topic)
            await wait_for(lambda: _has_reports(addr), 20, "load reports arrived")
            plans = await cl.balance_plan(all_topics=True)
            assert [p["topic"] for p in plans] == [topic]
            plan = plans[0]
            assert plan["size"] >= 5000 and plan["verdict"] in ("move", "stay")
            # IndCoord and BestLocal send 4 queries, each answered; a flood reaches every broker once (the
            # region of 1 hop around the node reached, or all 4 brokers for BestGlobal).
            assert plan["offers"] == 4 if selection in ("indcoord", "bestlocal", "bestglobal") else plan["offers"] >= 2
            assert plan["current"]["lmax"] >= 0
            if plan["verdict"] == "move":
                assert plan["best"]["lmax"] <= plan["current"]["lmax"]  # Sec. IV-D: or equal with a lower L_min
            after = await cl.locate(topic)
            assert after.coord == before.coord and len(after.delegates) == len(before.delegates)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cli.main", "balance", "--broker", addr, "--all", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)[0]["topic"] == topic


async def test_dry_run_of_the_cluster_asks_every_primary_and_names_it(tmp_path: Path) -> None:
    # A user's SEDAX_BROKERS starts with the first broker of `cluster up`, which need not hold any topic: the
    # plain dry run then says so and names the access broker; --cluster crawls the overlay and asks each
    # broker that is primary of a topic, and every plan says which broker made it.
    coords = [(0.2, 0.2), (0.8, 0.2), (0.5, 0.8), (0.5, 0.45)]
    args = (*FAST_ARGS, "--selection", "bestlocal", "--queries", "4", "--load-report-interval", "0.2",
            "--query-timeout", "5.0", "--min-gain", "0")  # fmt: skip
    async with LocalCluster(4, coords=coords, resilience=2, state_dir=tmp_path, broker_args=args) as c:
        await c.wait_converged(30.0)
        owners = {k: closest(dict(enumerate(coords)), geohash(f"grid/plan/{k}"))[0] for k in range(400)}
        topics = {i: next(f"grid/plan/{k}" for k in range(400) if owners[k] == i) for i in (1, 3)}
        empty = next(bp for bp in c.nodes if bp.index not in topics)
        async with Client(c.nodes[3].listen) as cl:
            for topic in topics.values():
                for _ in range(5):
                    await cl.publish(topic, b"w" * 400)
        for i in topics:
            await wait_for(lambda i=i: _has_reports(c.nodes[i].listen), 20, "load reports arrived")

        async def sedax(*argv: str) -> tuple[int, str, str]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cli.main", "balance", "--broker", f"{empty.listen},{c.nodes[3].listen}",
                "--all", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            async with asyncio.timeout(60):
                out, err = await proc.communicate()
            assert proc.returncode is not None
            return proc.returncode, out.decode(), err.decode()

        code, out, err = await sedax()
        assert code == 0, err
        assert out.startswith(f"nothing to balance: the broker at {empty.listen} is primary of no topic"), out
        assert "--cluster" in out
        code, out, err = await sedax("--cluster", "--json")
        assert code == 0, err
        plans = json.loads(out)
        assert {p["topic"]: p["broker"] for p in plans} == {t: c.nodes[i].node_id for i, t in topics.items()}
        assert all(p["verdict"] in ("move", "stay") for p in plans)
        code, out, err = await sedax("--cluster")
        assert code == 0, err
        lines = out.splitlines()
        assert sorted(line.split()[:2] for line in lines) == sorted([c.nodes[i].node_id, t] for i, t in topics.items())


async def test_dry_run_scans_the_smallest_topics_until_one_would_move(tmp_path: Path) -> None:
    # Two brokers at resilience 2 both hold every topic, so every coordinate is as good as any other: no topic
    # can move, and a round with --balance-scan 2 looks at exactly the two smallest, smallest first.
    args = (*FAST_ARGS, "--goal", "L2", "--selection", "bestglobal", "--balance-scan", "2",
            "--load-report-interval", "0.2", "--query-timeout", "2.0", "--min-gain", "0")  # fmt: skip
    coords = {0: (0.3, 0.5), 1: (0.7, 0.5)}
    async with LocalCluster(2, coords=list(coords.values()), resilience=2, state_dir=tmp_path, broker_args=args) as c:
        await c.wait_converged(30.0)
        names = [n for n in (f"grid/scan/{k}" for k in range(200)) if closest(coords, geohash(n))[0] == 0][:3]
        addr = c.nodes[0].listen
        async with Client(addr) as cl:
            for i, topic in enumerate(names):  # sizes grow with i
                for _ in range(i + 1):
                    await cl.publish(topic, b"z" * 400)
            await wait_for(lambda: _has_reports(addr), 20, "load reports arrived")

            async def views_agree() -> bool:
                # Until each broker has the other's latest report, one of them answers with a stale, lower
                # load, and that offer looks better than staying.
                return [p["verdict"] for p in await cl.balance_plan()] == ["stay", "stay"]

            await wait_for(views_agree, 30, "both brokers see the same loads")
            plans = await cl.balance_plan()
            assert [p["topic"] for p in plans] == names[:2]
            assert [p["verdict"] for p in plans] == ["stay", "stay"]
            assert plans[0]["size"] < plans[1]["size"]


async def _has_reports(addr: str) -> bool:
    st = await _status(addr)
    counters = st["counters"]
    assert isinstance(counters, dict)
    return int(counters["load_reports_sent"]) > 0


async def test_move_bad_requests_get_clear_errors(tmp_path: Path) -> None:
    async with LocalCluster(3, seed=5, resilience=2, state_dir=tmp_path, broker_args=FAST_ARGS) as c:
        await c.wait_converged(30.0)
        async with Client(c.nodes[0].listen) as cl:
            await cl.publish("grid/x/y", b"1")
            loc = await cl.locate("grid/x/y")
            with pytest.raises(RequestFailed) as err:
                await cl.move("grid/x/y", loc.coord)
            assert err.value.code == "bad_request" and "already" in str(err.value)
            with pytest.raises(RequestFailed):
                await cl.move("grid/x/y", (5.0, 5.0))
