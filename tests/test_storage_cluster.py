"""Topics on disk in a live cluster: a full restart keeps history and dedup state; SIGKILL loses no ACK."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli.cluster import LocalCluster
from client.client import Client, PublishAck
from client.errors import RequestFailed
from net.credentials import Credentials
from overlay.pubsub import Publish
from tests import tmpfs
from tests.cluster import wait_for
from tests.conftest import FAST_ARGS

TMPFS_MISSING = tmpfs.unavailable()

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
        # The publisher stays up through the brokers' restart, as a device does; it reconnects on its own.
        async with Client(addrs, client_id="meter-7", credentials=cluster.credentials()) as c:
            me = c.publisher_id
            for t in TOPICS:
                for k in range(30):
                    await c.publish(t, f"{t} reading {k}")
            await asyncio.gather(*(cluster.stop(i) for i in range(len(cluster.nodes))))
            assert not any(bp.alive for bp in cluster.nodes)
            await _restart_all(cluster)
            for t in TOPICS:
                assert await _history(cluster, t) == [(me, k) for k in range(30)], t
            # A re-send of reading 0 after the restart (its ACK lost, as far as the broker can tell), on the
            # wire as the client re-sends: the restored dedup state acknowledges it and stores nothing.
            await c._send(Publish(TOPICS[0], me, 0, b"a re-send of reading 0", 0))
            assert (await c.publish(TOPICS[0], "reading 30")).seq == 30
        history = await _history(cluster, TOPICS[0])
        assert history == [(me, k) for k in range(31)]
        # The device started again with its configured client id numbers from 0 again, under a publisher id of
        # its own: its messages are new, stored and delivered, not taken for re-sends of its previous life's.
        async with Client(addrs, client_id="meter-7", credentials=cluster.credentials()) as again:
            assert again.publisher_id != me and again.publisher_id.startswith("meter-7#")
            assert (await again.publish(TOPICS[0], "after the device's restart")).seq == 0
        assert await _history(cluster, TOPICS[0]) == [*history, (again.publisher_id, 0)]


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


async def test_syncing_every_record_stalls_no_broker_into_a_false_failover(tmp_path: Path) -> None:
    # `--fsync always` at level 2 under a steady stream of large batches: 8 publishers at once, each with a
    # window of 4096 small messages over 4 topics of its own, so one loop turn of a broker stores thousands of
    # records.  The syncs run off the event loop (group commit), so heartbeats keep flowing at the default
    # failure detection (0.2 s x 3 misses): no neighbour is declared dead, no topic taken over.  With the sync
    # on the loop (an fdatasync per record, 0.2-1.5 ms each on this machine's disk) such a turn held a broker
    # for seconds and its neighbours failed it over.
    args = (
        "--hello-timeout", "2.0", "--heartbeat-interval", "0.2", "--heartbeat-misses", "3",
        "--client-timeout", "3.0", "--fsync", "always",
    )  # fmt: skip
    publishers, per_publisher = 8, 5000
    async with LocalCluster(3, coords=COORDS[:3], state_dir=tmp_path, broker_args=args, data_dirs=True) as cluster:
        await cluster.wait_converged(20.0)
        addrs = [bp.listen for bp in cluster.nodes]

        async def publish(k: int) -> int:
            topics = [f"grid/disk/stream/{k}/{i}" for i in range(4)]
            async with Client(addrs, credentials=cluster.credentials()) as c:
                acks = [await c.publish_nowait(topics[i % 4], b"x" * 16) for i in range(per_publisher)]
                return len(await asyncio.wait_for(asyncio.gather(*acks), 120.0))

        done = await asyncio.gather(*(publish(k) for k in range(publishers)))
        assert done == [per_publisher] * publishers
        statuses = await cluster.statuses()
        for nid, st in statuses.items():
            assert st.counters["failures_detected"] == 0, f"{nid} took a neighbour for dead"
            assert st.counters["takeovers"] == 0, f"{nid} took a topic over"
        assert sum(st.counters["published"] for st in statuses.values()) == publishers * per_publisher


def _broker_on_a_small_tmpfs(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A broker in a private mount namespace whose data directory is a 256 KiB tmpfs; its stdout file."""
    data = tmp_path / "small"
    data.mkdir()
    out = tmp_path / "broker.out"
    broker = (
        f"{sys.executable} -m broker --coord 0.5,0.5 --node-id n0 --listen 127.0.0.1:0 --insecure "
        f"--data-dir {data} --fsync batch"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with out.open("wb") as stdout, (tmp_path / "broker.err").open("wb") as stderr:
        proc = subprocess.Popen(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=256k tmpfs {data} && exec {broker}"],
            stdout=stdout, stderr=stderr, env=env, start_new_session=True,
        )  # fmt: skip
    return proc, out


async def test_a_broker_on_a_full_disk_refuses_publishes_with_storage_full_and_keeps_serving(tmp_path: Path) -> None:
    # A real broker whose data directory is a 256 KiB tmpfs (mounted in a private mount namespace): publishes
    # that find no room get NACK storage_full, the broker stays up, and every acknowledged message is still
    # served, undamaged.
    if (why := TMPFS_MISSING) is not None:
        pytest.skip(why)
    proc, out = _broker_on_a_small_tmpfs(tmp_path)
    try:
        await wait_for(lambda: out.stat().st_size > 0 or proc.poll() is not None, 30.0, "the broker's ready line")
        assert proc.poll() is None, (tmp_path / "broker.err").read_text()
        listen = json.loads(out.read_text().splitlines()[0])["listen"]
        acked: list[int] = []
        refused: RequestFailed | None = None
        async with Client(listen, credentials=Credentials(insecure=True)) as c:
            for k in range(2000):  # 2000 x 1 KiB: far more than 256 KiB
                try:
                    acked.append((await c.publish("grid/full/disk", bytes([k % 256]) * 1024)).seq)
                except RequestFailed as exc:
                    refused = exc
                    break
            assert refused is not None and refused.code == "storage_full", "no storage_full refusal"
            assert "free disk space" in str(refused)
            assert len(acked) > 50
            assert proc.poll() is None, "the broker died"
            history = await c.fetch("grid/full/disk")
        assert [r.seq for r in history] == acked
        assert all(r.payload == bytes([r.seq % 256]) * 1024 for r in history), "a stored record was damaged"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def test_a_data_directory_serves_one_broker_at_a_time_and_a_crash_frees_it(tmp_path: Path) -> None:
    # Two brokers started on one --data-dir (a copied command line) appended to the same segments and each read
    # the other's records back as its own.  The second is refused in one line that names the first; a SIGKILL
    # of the first frees the directory, so a broker restarted after a crash starts.
    async with LocalCluster(1, seed=5, state_dir=tmp_path, broker_args=FAST_ARGS, data_dirs=True, tls=False) as c:
        first = c.nodes[0]
        second = [
            sys.executable, "-m", "broker", "--coord", "0.25,0.25", "--listen", "127.0.0.1:0", "--insecure",
            "--data-dir", str(c.data_dir(0)),
        ]  # fmt: skip
        res = await asyncio.to_thread(subprocess.run, second, capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 2, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
        assert lines == [
            f"sedax broker: error: data directory {c.data_dir(0)} is in use by another broker (pid {first.pid}): "
            "give each broker its own --data-dir"
        ], res.stderr
        assert first.alive
        await c.kill(0)
        again = await c.restart(0)  # the same directory, after a crash
        assert again.alive and again.listen
    # A file where the directory should be: one line, exit 2.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    res = await asyncio.to_thread(
        subprocess.run, [*second[:-1], str(not_a_dir)], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 2 and f"cannot use --data-dir {not_a_dir}: " in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
