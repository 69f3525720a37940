"""Shared fixtures: local broker clusters (real processes on 127.0.0.1, ports chosen by the OS)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from cli.cluster import LocalCluster

# Brokers and clients require TLS unless told otherwise.  The suite predates TLS: its brokers, clients and
# CLI processes run on plain TCP through SEDAX_INSECURE, which every process a test starts inherits.  The
# security tests (test_security_*.py) start TLS clusters explicitly (LocalCluster(tls=True)).
os.environ["SEDAX_INSECURE"] = "1"

# The suite shares 2 cores with broker processes and Spark: hypothesis's speed health checks would fail
# tests for the machine's load, not for a property; every test still has its pytest-timeout bound.
settings.register_profile("sedax", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("sedax")

# The files that take minutes are handed out first: the two workers (pyproject addopts: -n 2 --dist loadfile)
# take whole files in collection order, so a long file handed out last would end the run alone.
LONG_FIRST = ("test_compose.py", "test_analysis_standalone.py", "test_data_membership.py", "test_analysis.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: the rest keep their order


# Failure detection fast enough for the tests' 5 s heal bound, hostile peers dismissed quickly.
# A SIGKILLed broker is detected at once by the connection reset; the heartbeat only catches silent peers.
# The tests run ten brokers and their clients on two shared cores, where a 0.6 s window would declare busy
# brokers dead, so they use 2 s (0.25 s x 8).
FAST_ARGS = (
    "--hello-timeout", "2.0", "--heartbeat-interval", "0.25", "--heartbeat-misses", "8", "--client-timeout", "3.0",
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster20(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """20 brokers at seeded random coordinates, shared by the tests of one module."""
    cluster = LocalCluster(20, seed=20, state_dir=tmp_path_factory.mktemp("cluster20"), broker_args=FAST_ARGS)
    try:
        asyncio.run(cluster.start())
        yield cluster
    finally:
        asyncio.run(cluster.close())


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """3 brokers, for hostile-input and CLI tests."""
    coords = [(0.25, 0.25), (0.75, 0.3), (0.5, 0.8)]
    cluster = LocalCluster(3, coords=coords, state_dir=tmp_path_factory.mktemp("cluster3"), broker_args=FAST_ARGS)
    try:
        asyncio.run(cluster.start())
        yield cluster
    finally:
        asyncio.run(cluster.close())
