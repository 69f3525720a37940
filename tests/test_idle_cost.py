"""What an idle overlay costs (docs/benchmarks-scale.md), on real brokers: an idle broker wakes up about once
per heartbeat interval (its beat) however many links it has, on one thread; traffic on a link replaces its
PINGs, and load reports go out when loads change, not every interval.

The evidence is the brokers' own: their counters (STATUS: heartbeat_pings, load_reports_sent) and the kernel's
count of their wake-ups (/proc/PID/status); the time that passes is measured in the brokers' own beats (PINGs
sent), never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from cluster import topics_per_broker, wait_for

from cli.cluster import LocalCluster
from client.client import Client
from overlay.geometry import closest, geohash

pytestmark = pytest.mark.slow

INTERVAL = 0.25
# Heartbeats a loaded test machine does not mistake for failures (as conftest.FAST_ARGS), load reports
# looked at every heartbeat and, unchanged, never repeated within a test.
ARGS = (
    "--heartbeat-interval", str(INTERVAL), "--heartbeat-misses", "8", "--client-timeout", "5.0",
    "--load-report-interval", str(INTERVAL), "--load-report-refresh", "1000",
)  # fmt: skip


async def _counters(cluster: LocalCluster) -> dict[str, dict[str, int]]:
    return {nid: dict(st.counters) for nid, st in (await cluster.statuses()).items()}


def _wakeups(pid: int) -> int:
    """How often the process has gone to sleep and been woken (voluntary context switches, /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError(f"no voluntary_ctxt_switches in /proc/{pid}/status")


def _threads(pid: int) -> int:
    """How many threads the process runs (/proc)."""
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


async def test_an_idle_broker_wakes_about_once_per_beat(tmp_path: Path) -> None:
    # Five brokers: every one has 2-4 links, each carrying one PING each way per interval.  Before, a broker
    # woke for every PING and PONG it received and twice per interval for its ticker (5 or more wake-ups per
    # interval); now its peers' PINGs wait in the kernel unread and the beat does all the liveness work.
    async with LocalCluster(5, seed=5, state_dir=tmp_path, broker_args=ARGS) as cluster:
        await cluster.wait_converged(30.0)
        # Let the overlay's forming settle (the last load reports, the checks' STATUS connections closing).
        settled: dict[str, dict[str, int]] = {}
        await wait_for(_beats(cluster, await _counters(cluster), 20, settled), 30.0, "20 heartbeats")
        before = await _counters(cluster)
        woken = {bp.node_id: _wakeups(bp.pid) for bp in cluster.nodes}
        # The brokers' own wake-ups are the clock: wait until the busiest has woken 60 times.
        await wait_for(
            lambda: max(_wakeups(bp.pid) - woken[bp.node_id] for bp in cluster.nodes) >= 60, 60.0, "60 wake-ups"
        )
        woke = {bp.node_id: _wakeups(bp.pid) - woken[bp.node_id] for bp in cluster.nodes}
        after = await _counters(cluster)
        # And each runs on one thread: no OpenBLAS pool of numpy's or scipy's (a thread per core each, spinning
        # after every call) beside the event loop.
        threads = {bp.node_id: _threads(bp.pid) for bp in cluster.nodes}
        assert set(threads.values()) == {1}, threads
    for nid, n in woke.items():
        links = before[nid]["links"] - 1  # less the STATUS connection that asked
        beats = (after[nid]["heartbeat_pings"] - before[nid]["heartbeat_pings"]) / links  # PINGs per link
        assert beats >= 10, (nid, beats, woke)
        # A wake-up per beat, and a few more: the STATUS connection at either end, a load report look.
        assert n <= 1.5 * beats + 10, (nid, n, beats, woke)


async def test_traffic_on_a_link_replaces_its_pings(tmp_path: Path) -> None:
    # Two brokers; n0 (the pinger of their link) forwards a publish to n1 every 20 ms and n1 replicates it
    # back, so neither needs a PING while the stream runs.  Before, n0 pinged every interval regardless.
    async with LocalCluster(2, seed=6, state_dir=tmp_path, broker_args=ARGS) as cluster:
        await cluster.wait_converged(30.0)
        coords = {bp.node_id: bp.coord for bp in cluster.nodes}
        topic = next(t for t in topics_per_broker(coords, 1, "idle") if _primary(coords, t) == "n1")
        async with Client([cluster.nodes[0].listen], credentials=cluster.credentials("pub")) as pub:
            await pub.publish(topic, b"first")
            before = await _counters(cluster)
            started = time.monotonic()
            for i in range(150):
                await pub.publish(topic, f"m{i}".encode())
                await asyncio.sleep(0.02)  # the stream's pace: a frame on the link far more often than PING_IDLE
            intervals = (time.monotonic() - started) / INTERVAL
            after = await _counters(cluster)
        pings = after["n0"]["heartbeat_pings"] - before["n0"]["heartbeat_pings"]
        # n0 also pings the publisher's and the STATUS connections when they are quiet; its link to n1 alone
        # pinged once an interval before.
        assert intervals >= 8
        assert pings <= intervals / 4, (pings, intervals)


async def test_load_reports_only_when_loads_change(tmp_path: Path) -> None:
    async with LocalCluster(3, seed=7, state_dir=tmp_path, broker_args=ARGS) as cluster:
        await cluster.wait_converged(30.0)
        # Let the reports of the overlay's forming go out, then nothing may change for 20 looks.
        first = await _counters(cluster)
        before: dict[str, dict[str, int]] = {}
        await wait_for(_beats(cluster, first, 20, before), 30.0, "20 heartbeats")
        idle: dict[str, dict[str, int]] = {}
        await wait_for(_beats(cluster, before, 20, idle), 30.0, "20 more heartbeats")
        assert all(idle[n]["load_reports_sent"] == before[n]["load_reports_sent"] for n in idle), (before, idle)
        # A publish changes the loads of its primary and secondary: they report at their next look.
        coords = {bp.node_id: bp.coord for bp in cluster.nodes}
        topic = topics_per_broker(coords, 1, "load")[0]
        primary = _primary(coords, topic)
        async with Client([bp.listen for bp in cluster.nodes], credentials=cluster.credentials("pub")) as pub:
            await pub.publish(topic, b"x" * 1000)

        async def reported() -> bool:
            st = await _counters(cluster)
            return st[primary]["load_reports_sent"] > idle[primary]["load_reports_sent"]

        await wait_for(reported, 10.0, f"a load report from {primary} after its load changed")


def _beats(
    cluster: LocalCluster, since: dict[str, dict[str, int]], n: int, out: dict[str, dict[str, int]]
) -> Callable[[], Awaitable[bool]]:
    """A condition: n0 sent n PINGs since `since` (the brokers' own clock); out gets the counters read."""

    async def cond() -> bool:
        out.update(await _counters(cluster))
        return out["n0"]["heartbeat_pings"] - since["n0"]["heartbeat_pings"] >= n

    return cond


def _primary(coords: dict[str, tuple[float, float]], topic: str) -> str:
    return closest(coords, geohash(topic))[0]


async def test_idle_clients_are_not_pinged_at_the_brokers_beat(tmp_path: Path) -> None:
    # Ten idle clients on n0.  A client pings its access broker on its own and hears the PONGs, and the broker
    # gives a client a window of --client-timeout (5 s), not the neighbours' beats: n0 pings a quiet client so
    # that it hears from n0 `misses` times in that window.  Before, n0 pinged every client at every beat (0.25 s
    # here), a PING and a PONG per idle device per beat: half of a fan-in broker's writes with 1,000 devices.
    # The clock is n1's beats: n1 has no clients, so its PINGs are its beats on the link to n0.
    clients = 10
    async with LocalCluster(2, seed=8, state_dir=tmp_path, broker_args=ARGS) as cluster:
        await cluster.wait_converged(30.0)
        creds = cluster.credentials("idle")
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(clients):
                await stack.enter_async_context(Client([cluster.nodes[0].listen], credentials=creds))
            before = await _counters(cluster)

            async def beats(n: int) -> bool:
                now = await _counters(cluster)
                return now["n1"]["heartbeat_pings"] - before["n1"]["heartbeat_pings"] >= n

            await wait_for(lambda: beats(40), 60.0, "40 of n1's beats")
            after = await _counters(cluster)
            # Every client is still connected: nobody was dropped for silence.
            assert after["n0"]["links"] >= clients + 1, after["n0"]
    beat_count = after["n1"]["heartbeat_pings"] - before["n1"]["heartbeat_pings"]
    # n0's PINGs: one per beat on its link to n1, at most one per beat on the STATUS connections, and the
    # clients' share, which was one per client per beat.
    client_pings = after["n0"]["heartbeat_pings"] - before["n0"]["heartbeat_pings"] - beat_count
    assert client_pings <= 0.2 * clients * beat_count, (client_pings, beat_count)
