"""A broker's log does not grow with every client connection: closes are DEBUG lines and a periodic summary.

A connection flood must not fill the disk (the issue measured 1.7 MB of log after 10k connections, one INFO
line per disconnect).  Misbehaving connections are still logged in full, up to a bound per window.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from cluster import raw_connect, wait_for
from conftest import FAST_ARGS

from broker.guard import CLOSE_LOG_FIRST, CloseLog
from broker.link import CloseReason
from cli.cluster import LocalCluster
from client.admin import AdminClient
from client.client import Client

pytestmark = pytest.mark.slow

CONNECTIONS = 200


def _lines(path: Path) -> int:
    return len(path.read_bytes().splitlines())


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:]


async def test_client_connections_do_not_grow_the_log(tmp_path: Path) -> None:
    async with LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, broker_args=FAST_ARGS) as cluster:
        bp = cluster.nodes[0]
        creds = cluster.credentials()

        async def links() -> int:
            async with await AdminClient.connect(bp.listen, credentials=creds) as admin:
                st = await admin.status()
            return st.counters["links"]

        idle = await links()  # the probe's own connection is counted; it is closed again before the next
        before = _lines(bp.err_path)
        sem = asyncio.Semaphore(20)

        async def one(i: int) -> None:
            async with sem:
                if i % 3 == 0:  # a TCP connection that says nothing and goes
                    _, writer = await raw_connect(bp)
                    writer.close()
                    await writer.wait_closed()
                elif i % 3 == 1:  # an admin tool: HELLO, STATUS, close
                    async with await AdminClient.connect(bp.listen, credentials=creds) as admin:
                        await admin.status()
                else:  # a publisher
                    async with Client([bp.listen], credentials=creds, reconnect=False) as c:
                        await c.publish("grid/log-test", b"x")

        await asyncio.gather(*(one(i) for i in range(CONNECTIONS)))

        async def all_closed() -> bool:
            return await links() == idle

        await wait_for(all_closed, 20.0, "every test connection closed at the broker")
        grown = _lines(bp.err_path) - before
    # A handful of lines at most (e.g. the first publish's topic placement), not one per connection.
    assert grown < 10, _tail(bp.err_path)


def test_close_log_summarises_ordinary_closes_and_bounds_noisy_ones(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("sedax.test-close-log")
    closes = CloseLog(log, window=60.0)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for _ in range(500):
            closes.closed("link #1 client", CloseReason.PEER_CLOSED, "", now=1.0)
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
        assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 500
        caplog.clear()
        for _ in range(CLOSE_LOG_FIRST + 300):
            closes.closed("link #2 client", CloseReason.PROTOCOL_ERROR, "bad frame", now=2.0)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == CLOSE_LOG_FIRST and "reason=protocol_error (bad frame)" in warned[0].getMessage()
        caplog.clear()
        closes.tick(now=30.0)  # the window is not over: no summary yet
        assert caplog.records == []
        closes.tick(now=61.2)
        (summary,) = caplog.records
        assert summary.levelno == logging.INFO
        text = summary.getMessage()
        assert f"{500 + CLOSE_LOG_FIRST + 300} client connections closed in the last 60 s" in text
        assert "peer_closed 500" in text and f"protocol_error {CLOSE_LOG_FIRST + 300}" in text
        assert "300 not logged one by one" in text
        caplog.clear()
        closes.tick(now=200.0)  # nothing closed since: nothing to say
        assert caplog.records == []
        closes.closed("link #3 client", CloseReason.PROTOCOL_ERROR, "bad frame", now=201.0)
        assert [r.levelno for r in caplog.records] == [logging.WARNING]  # a new window logs in full again
