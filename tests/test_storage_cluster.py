"""Topics on disk in a live cluster: a full restart keeps history and dedup state; SIGKILL loses no ACK."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cli.cluster import LocalCluster
from client.client import Client, PublishAck
from tests.conftest import FAST_ARGS

pytestmark = pytest.mark.slow

COORDS = [(0.2, 0.2), (0.8, 0.25), (0.5, 0.8), (0.45, 0.45)]
TOPICS = [f"grid/disk/{i}" for i in range(3)]


async def _restart_all(cluster: LocalCluster) -> None:
    """Start every broker again: the first alone (it finds its data), the others joining through it."""
    for i in range(len(cluster.nodes)):
        await cluster.restart(i)
    await cluster.wait_converged(30.0)


async def _history(cluster: LocalCluster, topic: str) -> list[tuple[str, int]]:
    async with Client([bp.listen for bp in cluster.nodes], credentials=cluster.credentials()) as c:
        return [(r.publisher, r.seq) for r in await c.fetch(topic)]


async def test_a_full_restart_keeps_the_history_and_the_dedup_state(tmp_path: Path) -> None:
    args = (*FAST_ARGS, "--fsync", "batch")
    async with LocalCluster(4, coords=COORDS, state_dir=tmp_path, broker_args=args, data_dirs=True) as cluster:
        await cluster.wait_converged(20.0)
        addrs = [bp.listen for bp in cluster.nodes]
        async with Client(addrs, client_id="meter-7", credentials=cluster.credentials()) as c:
            for t in TOPICS:
                for k in range(30):
                    await c.publish(t, f"{t} reading {k}")
        await asyncio.gather(*(cluster.stop(i) for i in range(len(cluster.nodes))))
        assert not any(bp.alive for bp in cluster.nodes)
        await _restart_all(cluster)
        for t in TOPICS:
            assert await _history(cluster, t) == [("meter-7", k) for k in range(30)], t
        # The same publisher starts over after its own restart: seq 0 again is a duplicate, acknowledged but not
        # stored or delivered twice; its next new message is seq 30.
        addrs = [bp.listen for bp in cluster.nodes]
        async with Client(addrs, client_id="meter-7", credentials=cluster.credentials()) as c:
            ack = await c.publish(TOPICS[0], "a re-send of reading 0")
            assert ack.seq == 0
        assert await _history(cluster, TOPICS[0]) == [("meter-7", k) for k in range(30)]


@pytest.mark.parametrize("policy", ["always", "batch", "interval:50", "never"])
async def test_sigkill_of_every_broker_loses_no_acknowledged_message(tmp_path: Path, policy: str) -> None:
    args = (*FAST_ARGS, "--fsync", policy)
    async with LocalCluster(3, coords=COORDS[:3], state_dir=tmp_path, broker_args=args, data_dirs=True) as cluster:
        await cluster.wait_converged(20.0)
        acked: list[int] = []
        async with Client([bp.listen for bp in cluster.nodes], credentials=cluster.credentials()) as c:
            pending: list[asyncio.Future[PublishAck]] = []
            for k in range(400):
                pending.append(await c.publish_nowait(TOPICS[1], f"v{k}"))
                if k == 300:  # a heavy stream: everything acknowledged so far, more on the way when they die
                    done = await asyncio.gather(*pending[:250])
                    acked = [a.seq for a in done]
                    for f in pending[250:]:
                        if f.done() and not f.exception():
                            acked.append(f.result().seq)
                    await asyncio.gather(*(cluster.kill(i) for i in range(len(cluster.nodes))))
                    break
            for f in pending:
                if not f.done():
                    f.cancel()
        assert len(acked) >= 250
        await _restart_all(cluster)
        stored = {seq for _, seq in await _history(cluster, TOPICS[1])}
        assert set(acked) <= stored
