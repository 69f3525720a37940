"""What an idle overlay costs (docs/benchmarks-scale.md), on real brokers: one end of each broker link pings,
traffic on a link replaces its PINGs, and load reports go out when loads change, not every interval.

The brokers' own counters are the evidence (STATUS: heartbeat_pings, load_reports_sent); the time that passes
is measured in the brokers' own beats (PINGs sent), never asserted.
"""

from __future__ import annotations

import asyncio
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


async def test_one_end_of_each_broker_link_pings(tmp_path: Path) -> None:
    # Three brokers are a triangle: n0 < n1 < n2, so n0 pings on both its links, n1 on its link to n2, n2 on
    # none (it answers with PONGs).  Before, every end pinged every interval: n2 as often as n0.
    async with LocalCluster(3, seed=5, state_dir=tmp_path, broker_args=ARGS) as cluster:
        await cluster.wait_converged(30.0)
        before = await _counters(cluster)
        pings: dict[str, dict[str, int]] = {}

        await wait_for(_beats(cluster, before, 40, pings), 30.0, "40 PINGs from n0")
        sent = {nid: pings[nid]["heartbeat_pings"] - before[nid]["heartbeat_pings"] for nid in before}
        assert sent["n2"] <= sent["n0"] / 4, sent  # a few at most: a PONG that came late, the STATUS connection
        assert sent["n0"] / 4 < sent["n1"] < sent["n0"] * 3 / 4, sent  # one link of two


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
