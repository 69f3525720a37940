"""Observability: a real Prometheus scraping a 5-broker cluster, the endpoint's answers to bad input, start-up
errors, the metrics-log settings, and the histogram and latency bookkeeping."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster import topics_per_broker, wait_for
from conftest import FAST_ARGS

from broker.config import ConfigError, build_config
from broker.eventlog import TOPICS_SLICE, _with_topics
from broker.stats import AckTimer, Buckets
from broker.version import VERSION
from cli.cluster import LocalCluster, die_with_parent
from client.client import Client
from overlay.protocol import encode_control, parse_address
from overlay.pubsub import Ack, Deliver, Nack, Record

# Prometheus scrapes every second: fast enough for the test, a small CPU share on two shared cores.
SCRAPE_INTERVAL = "1s"
PUBLISHED = "sedax_published_messages_total"


# ---- a real Prometheus ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server (Debian's `prometheus`) on a free port, scraping the given targets."""

    def __init__(self, workdir: Path, targets: Sequence[str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: `apt-get install -y prometheus` (.ci/run installs it)")
        self.binary = binary
        self.workdir = workdir
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": "sedax", "static_configs": [{"targets": list(targets)}]}],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # JSON is YAML
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, within: float = 60.0) -> None:
        # The free port may be taken between probing and binding; then Prometheus exits and we try another.
        for attempt in range(3):
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            with (self.workdir / f"prometheus-{attempt}.log").open("wb") as log:
                self.proc = subprocess.Popen(
                    [
                        self.binary,
                        f"--config.file={self.config}",
                        f"--storage.tsdb.path={self.workdir / f'data-{attempt}'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--log.level=warn",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            deadline = time.monotonic() + within
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                        if r.status == 200:
                            return
                except (OSError, urllib.error.URLError):
                    pass
                time.sleep(0.1)
            if self.proc.poll() is None:
                break
        log_text = (self.workdir / f"prometheus-{attempt}.log").read_text(errors="replace")[-2000:]
        self.close()
        raise AssertionError(f"prometheus did not become ready:\n{log_text}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: the result vector."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def by_instance(self, promql: str) -> dict[str, float]:
        """{instance: value} of an instant query (run in a thread: the test's loop keeps serving clients)."""
        rows = await asyncio.to_thread(self.query, promql)
        return {r["metric"]["instance"]: float(r["value"][1]) for r in rows}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _documented_metrics() -> set[str]:
    """Every metric name docs/metrics.md lists (in backquotes)."""
    return set(
        re.findall(
            r"`((?:sedax|process)_[a-z_]+)`", (Path(__file__).resolve().parent.parent / "docs/metrics.md").read_text()
        )
    )


def test_alert_rules_fire_on_what_they_name() -> None:
    # deploy/prometheus-rules.yml (loaded by the compose Prometheus), run by promtool against series that should
    # and should not raise each alert; and every metric they use is one the brokers export (docs/metrics.md).
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: it comes with `apt-get install -y prometheus` (.ci/run installs it)")
    deploy = Path(__file__).resolve().parent.parent / "deploy"
    r = subprocess.run(
        [promtool, "test", "rules", str(deploy / "prometheus-rules.test.yml")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    used = set(re.findall(r"\bsedax_[a-z_]+", (deploy / "prometheus-rules.yml").read_text()))
    documented = _documented_metrics()
    assert used and used <= documented, used - documented


async def test_prometheus_sees_every_broker_rise(tmp_path: Path) -> None:
    args = (*FAST_ARGS, "--metrics", "127.0.0.1:0")
    async with LocalCluster(5, seed=6, state_dir=tmp_path / "cluster", broker_args=args) as cluster:
        await cluster.wait_converged(60.0)
        targets = [bp.metrics for bp in cluster.nodes]
        assert all(targets) and len(set(targets)) == 5
        (tmp_path / "prometheus").mkdir()
        prom = Prometheus(tmp_path / "prometheus", targets)
        await asyncio.to_thread(prom.start)
        try:
            await _scrape_and_publish(cluster, prom, targets)
        finally:
            prom.close()


async def _scrape_and_publish(cluster: LocalCluster, prom: Prometheus, targets: list[str]) -> None:
    async def every(promql: str, ok: Any) -> bool:
        got = await prom.by_instance(promql)
        return sorted(got) == sorted(targets) and all(ok(inst, v) for inst, v in got.items())

    await wait_for(lambda: every('up{job="sedax"}', lambda _, v: v == 1.0), 60, "all 5 brokers scraped")
    info = await asyncio.to_thread(prom.query, "sedax_node_info")
    node_of = {r["metric"]["instance"]: r["metric"]["node"] for r in info}
    assert sorted(node_of.values()) == sorted(bp.node_id for bp in cluster.nodes)
    assert await every("sedax_neighbours", lambda _, v: v >= 2)  # 5 brokers in general position

    # Every broker is the primary of two topics, so every broker's load and counters must move.
    topics = topics_per_broker({bp.node_id: bp.coord for bp in cluster.nodes}, 2, "metrics")
    addrs = [bp.listen for bp in cluster.nodes]
    published = 0
    async with Client(addrs[0]) as sub_client, Client(addrs[1]) as pub1, Client(addrs[3]) as pub2:
        subs = [await sub_client.subscribe(t) for t in topics]
        before_load: dict[str, float] = {}
        before_pub: dict[str, float] = {}
        for rnd in range(2):
            futs = [
                await pub.publish_nowait(t, b"m" * (50 + 10 * i)) for i, t in enumerate(topics) for pub in (pub1, pub2)
            ]
            async with asyncio.timeout(60):
                await asyncio.gather(*futs)
            published += len(futs)
            for promql, before in (('sedax_node_load_bytes{level="L1"}', before_load), (PUBLISHED, before_pub)):
                await wait_for(
                    lambda q=promql, b=dict(before): every(q, lambda inst, v: v > b.get(inst, 0.0)),
                    60,
                    f"round {rnd}: {promql} rose on every broker",
                )
            before_load = await prom.by_instance('sedax_node_load_bytes{level="L1"}')
            before_pub = await prom.by_instance(PUBLISHED)

        async def totals_match() -> bool:
            sums = {
                q: sum((await prom.by_instance(q)).values())
                for q in (
                    "sedax_published_messages_total",
                    "sedax_acked_messages_total",
                    "sedax_delivered_messages_total",
                    "sedax_publish_ack_latency_seconds_count",
                )
            }
            # Each message is stored once (at its primary), acknowledged once, delivered to the one
            # subscriber once, and timed once at its access broker.
            return all(v == published for v in sums.values())

        await wait_for(totals_match, 60, "cluster-wide totals equal the messages published")
        for sub in subs:
            await sub.aclose()
    hops = await prom.by_instance("sedax_routed_hops_count")
    assert sum(hops.values()) > 0
    lat_sum = sum((await prom.by_instance("sedax_publish_ack_latency_seconds_sum")).values())
    assert lat_sum > 0
    beats = await prom.by_instance("sedax_event_loop_lag_seconds_count")
    assert len(beats) == 5 and all(v > 0 for v in beats.values())  # every broker times each of its beats
    roles = await asyncio.to_thread(prom.query, 'sum by (role) (sedax_topics{role=~"primary|secondary"})')
    by_role = {r["metric"]["role"]: float(r["value"][1]) for r in roles}
    assert by_role == {"primary": len(topics), "secondary": len(topics)}  # resilience 2: one copy each


# ---- the endpoint under bad input, start-up errors ------------------------------------------------------


async def _http(address: str, request: bytes) -> bytes:
    host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


async def test_endpoint_answers_bad_requests_and_stays_up(tmp_path: Path) -> None:
    args = (*FAST_ARGS, "--metrics", "127.0.0.1:0")
    async with LocalCluster(1, state_dir=tmp_path, broker_args=args) as cluster:
        m = cluster.nodes[0].metrics
        cases = [
            (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 404 "),
            (b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 405 "),
            (b"garbage\r\n\r\n", b"HTTP/1.1 400 "),
            (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", b"HTTP/1.1 431 "),
            (b"GET /metrics HTTP/1.1\r\n", b"HTTP/1.1 400 "),  # the client stops writing half-way
        ]
        for request, status in cases:
            if request.endswith(b"\r\n\r\n"):
                answer = await _http(m, request)
            else:
                host, port = parse_address(m)
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(request)
                writer.write_eof()
                async with asyncio.timeout(30):
                    answer = await reader.read()
                writer.close()
            assert answer.startswith(status), (request[:30], answer[:80])
        ok = await _http(m, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 200 ") and b'\nsedax_node_load_bytes{level="L1"} 0.0\n' in ok
        # Every series a broker exports is in docs/metrics.md.
        exported = {n.decode() for n in re.findall(rb"^# TYPE (\w+) ", ok, re.M)}
        documented = _documented_metrics()
        assert "sedax_reload_failures_total" in exported and exported <= documented, exported - documented
        assert {"sedax_build_info", "process_resident_memory_bytes", "process_start_time_seconds"} <= exported
        assert f'sedax_build_info{{version="{VERSION}"}} 1.0'.encode() in ok
        assert cluster.nodes[0].alive


async def test_health_and_readiness_for_probes(tmp_path: Path) -> None:
    # A probe that cannot speak the broker's protocol (Kubernetes, a load balancer) asks over HTTP: ready only once
    # the broker is part of the overlay.  Here one waits to join through an address where nothing listens yet.
    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        metrics, entry = (f"127.0.0.1:{s.getsockname()[1]}" for s in (s1, s2))
    argv = [sys.executable, "-m", "broker", "--coord", "0.5,0.5", "--insecure", "--listen", "127.0.0.1:0",
            "--join", entry, "--join-timeout", "120", "--metrics", metrics, *FAST_ARGS]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
    )
    try:

        async def answer(path: str) -> bytes:
            try:
                return await _http(metrics, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            except OSError:
                return b""  # not listening yet

        async def joining() -> bool:
            return (await answer("/readyz")).startswith(b"HTTP/1.1 503 ")

        await wait_for(joining, 60, "/readyz answering 503 while the broker joins")
        ready = await answer("/readyz")
        assert ready.endswith(f"joining the overlay (--join {entry})\n".encode()), ready
        assert (await answer("/healthz")).startswith(b"HTTP/1.1 200 ")
        assert proc.returncode is None
    finally:
        proc.kill()
        await proc.wait()
    async with LocalCluster(2, state_dir=tmp_path, broker_args=(*FAST_ARGS, "--metrics", "127.0.0.1:0")) as cluster:
        for bp in cluster.nodes:
            for path in ("/healthz", "/readyz"):
                got = await _http(bp.metrics, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"\r\n\r\nok\n"), (bp.node_id, path, got)


def test_start_errors_exit_2(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra, text in (
            (["--metrics", f"127.0.0.1:{port}"], "cannot serve metrics on 127.0.0.1:"),
            (["--log-dir", str(not_a_dir / "sub")], "cannot write the metrics log in"),
            (["--log-interval", "0"], "log_interval must be"),
        ):
            r = subprocess.run(
                [sys.executable, "-m", "broker", "--coord", "0.5,0.5", *extra],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert r.returncode == 2, r.stderr
            assert text in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("setting", "value", "match"),
    [
        ("log_interval", -1, "log_interval must be"),
        ("log_interval", "often", "log_interval must be a number"),
        ("log_max_bytes", 10, "log_max_bytes must be at least"),
        ("log_keep", 0, "log_keep must be at least 1"),
        ("log_run", "", "log_run must be"),
        ("log_run", "a\nb", "log_run must be"),
    ],
)
def test_log_settings_are_validated(setting: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_config({"coord": "0.5,0.5", setting: value}, env={})


def test_log_settings_from_file_and_env(tmp_path: Path) -> None:
    f = tmp_path / "b.toml"
    f.write_text('coord = "0.5,0.5"\nlog-dir = "/tmp/x"\nlog-interval = 0.5\nlog-keep = 3\n')
    cfg = build_config({}, env={"SEDAX_CONFIG": str(f), "SEDAX_LOG_RUN": "exp-1", "SEDAX_LOG_MAX_BYTES": "1048576"})
    assert (cfg.log_dir, cfg.log_interval, cfg.log_keep, cfg.log_run, cfg.log_max_bytes) == (
        "/tmp/x", 0.5, 3, "exp-1", 1 << 20,
    )  # fmt: skip


# ---- bookkeeping ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2 * TOPICS_SLICE + 3])
def test_a_snapshots_topics_encoded_in_slices_are_the_records_own(n: int) -> None:
    # A snapshot's topics are encoded TOPICS_SLICE at a time with the event loop free in between (at 10^5 topics
    # one encoding held the loop ~0.15 s): the line must be what encoding the whole record at once gives.
    rows = [(f"grid/{i}", ("primary", "secondary", "home")[i % 3], i * 7) for i in range(n)]
    rec: dict[str, Any] = {"type": "snapshot", "run": "r", "step": 3, "loads": {"L1": 1.0}, "neighbours": ["n1"]}
    line = asyncio.run(_with_topics(dict(rec), rows))
    assert line.endswith("}\n") and line.count("\n") == 1
    topics = [{"topic": t, "role": role, "size": float(size)} for t, role, size in rows]
    assert json.loads(line) == rec | {"topics": topics}


def test_buckets_match_numpy() -> None:
    rng = np.random.default_rng(1)
    bounds = (0.001, 0.01, 0.1, 1.0)
    values = np.concatenate([rng.exponential(0.05, 500), [0.01, 0.1, 1.0, 5.0]])  # ties on the bounds
    b = Buckets(bounds)
    for v in values:
        b.observe(float(v))
    cum = b.cumulative()
    assert [le for le, _ in cum] == ["0.001", "0.01", "0.1", "1.0", "+Inf"]
    for (_, count), bound in zip(cum, (*bounds, np.inf), strict=True):
        assert count == int(np.sum(values <= bound))  # Prometheus's le: upper bound inclusive
    assert b.count == len(values) and b.total == pytest.approx(float(values.sum()))


def test_ack_timer_cumulative_ack_nack_and_bounds() -> None:
    b = Buckets((1.0,))
    t = AckTimer(b, limit=5)
    for seq in range(4):
        t.started("s1", "a", "p", seq)
    t.started("s1", "a", "p", 1)  # a re-send keeps its first clock
    t.started("s1", "b", "p", 0)  # sequence numbers are per topic
    t.started("s2", "a", "p", 0)  # over the limit: untimed
    assert t.size == 5 and t.untimed == 1
    t.frame("s1", encode_control(Deliver("a", (Record(1.0, "p", 0, b"x"),))))  # not an ACK: ignored
    assert b.count == 0
    t.frame("s1", encode_control(Nack("a", "p", 3, "too_large", "x")))
    t.frame("s1", encode_control(Ack("a", "p", 2, 0.0)))  # cumulative: answers 0, 1, 2
    assert b.count == 3 and t.size == 1
    t.session_closed("s1")
    assert t.size == 0 and not t.waiting


def test_ack_timer_reads_the_acks_of_long_names_and_large_numbers() -> None:
    # Every msgpack string and integer width in an ACK, and an ACK of another publisher on the same session
    # stops nothing.
    b = Buckets((1.0,))
    t = AckTimer(b, limit=3)
    topic, publisher = "t/" + "x" * 300, "p" * 40  # str16 and str8 headers
    for seq in (5, 2**31, 2**40):
        t.started("s", topic, publisher, seq)
    t.started("s", "t/other", "q", 0)  # over the limit: untimed
    t.frame("s", encode_control(Ack(topic, "someone else", 2**40, 0.0)))
    assert b.count == 0
    t.frame("s", encode_control(Ack(topic, publisher, 2**31, 0.0)))
    assert b.count == 2 and t.size == 1
    t.frame("s", encode_control(Nack(topic, publisher, 2**40, "too_large", "x")))
    assert b.count == 2 and t.size == 0 and not t.waiting
    for i in range(5):  # more (topic, publisher) pairs over time than the limit: each timed once the last is done
        t.started("s", f"t/{i}", "p", 0)
        t.frame("s", encode_control(Ack(f"t/{i}", "p", 0, 0.0)))
    assert b.count == 7 and t.size == 0


def test_ack_timer_answers_given_typed_match_the_decoded_frames() -> None:
    # A local holder hands the ACK or NACK itself (`answered`), a TOPIC_REPLY only its bytes (`frame`): the
    # clocks must end the same either way.
    replies = [Ack("a", "p", 1, 0.0), Nack("a", "p", 3, "too_large", "x"), Ack("b", "p", 0, 0.0), Ack("a", "p", 4, 0.0)]
    timers = []
    for typed in (True, False):
        b = Buckets((1.0,))
        t = AckTimer(b, limit=10)
        for topic, seq in [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("a", 4), ("a", 5), ("b", 0), ("b", 1)]:
            t.started("s", topic, "p", seq)
        for m in replies:
            if typed:
                t.answered("s", m.topic, m.publisher, m.seq, isinstance(m, Ack))
            else:
                t.frame("s", encode_control(m))
        timers.append((b.count, t.size, {k: [seq for seq, _ in q] for k, q in t.waiting["s"].items()}))
    assert timers[0] == timers[1] == (5, 2, {("a", "p"): [5], ("b", "p"): [1]})


async def test_the_data_directorys_disk_is_exported_for_an_early_alert(tmp_path: Path) -> None:
    # SedaxDataDiskNearlyFull (deploy/prometheus-rules.yml) reads these two: what the broker may still write where
    # its topics are, and the size of that file system, as statvfs tells them at the scrape.
    args = (*FAST_ARGS, "--metrics", "127.0.0.1:0")
    async with LocalCluster(1, state_dir=tmp_path, broker_args=args, data_dirs=True) as cluster:
        bp = cluster.nodes[0]
        before = os.statvfs(cluster.data_dir(0))
        body = (await _http(bp.metrics, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")).decode()
        after = os.statvfs(cluster.data_dir(0))
    series = {ln.split()[0]: float(ln.split()[1]) for ln in body.splitlines() if ln.startswith("sedax_data_dir_")}
    assert series["sedax_data_dir_size_bytes"] == before.f_blocks * before.f_frsize
    free = sorted(st.f_bavail * st.f_frsize for st in (before, after))
    slack = 64 << 20  # (other tests write to the same file system meanwhile)
    assert free[0] - slack <= series["sedax_data_dir_free_bytes"] <= free[1] + slack, (series, free)
