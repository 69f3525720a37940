"""SIGHUP reads a broker's configuration, TLS files, tokens file and ACL file again, on real brokers.

What an operator does to rotate: replace the files (`sedax certs issue --force`, a tokens file without a name, a
new ACL, a new CA bundle, a config file with other limits) and `kill -HUP` the broker, as with nats-server or
Mosquitto.  New connections get the new certificate; what the new files no longer admit is cut off; a file that
does not load, or a change that takes a restart, changes nothing.  And a certificate near its expiry is said.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cluster import connects, hup, log_has, log_size, wait_for, wait_refused
from conftest import FAST_ARGS

from broker.guard import COUNTERS as GUARD_COUNTERS
from cli.cluster import BrokerProcess, LocalCluster
from client.client import Client, ClientError, RequestFailed
from net import certs
from net.credentials import Credentials
from overlay.protocol import parse_address
from overlay.pubsub import record_size

pytestmark = pytest.mark.slow

ACL = """\
allow     any        operator   grid/#
allow     publish    meter-*    grid/+/voltage
allow     subscribe  dashboard  grid/+/voltage
"""
DENY_DASHBOARD = """\
allow     any        operator   grid/#
allow     publish    meter-*    grid/+/voltage
deny      subscribe  dashboard  grid/#
"""


class One:
    """One TLS broker with an ACL and a tokens file, and the paths an operator would edit."""

    def __init__(self, cluster: LocalCluster, tokens: dict[str, str]) -> None:
        self.cluster = cluster
        self.bp: BrokerProcess = cluster.nodes[0]
        self.tokens = tokens  # name -> token
        assert cluster.state_dir is not None
        self.acl = cluster.state_dir / "broker.acl"
        self.tokens_file = cluster.certs_dir / "tokens.json"
        self.ca = str(certs.ca_paths(cluster.certs_dir)[0])

    def creds(self, name: str) -> Credentials:
        return self.cluster.credentials(name)

    def token(self, name: str) -> Credentials:
        return Credentials(ca=self.ca, token=self.tokens[name])

    async def hup(self, expect: str) -> None:
        await hup(self.bp, expect)

    async def counters(self) -> dict[str, int]:
        return dict((await self.cluster.statuses())[self.bp.node_id].counters)


@pytest.fixture
async def one(tmp_path: Path) -> AsyncIterator[One]:
    (tmp_path / "broker.acl").write_text(ACL)
    tokens = {}
    for name in ("dashboard", "meter-7"):
        tokens[name], tokens_file = certs.add_token(tmp_path / "certs", name)
    args = (*FAST_ARGS, "--acl", str(tmp_path / "broker.acl"), "--tokens", str(tokens_file), "--metrics", "127.0.0.1:0")
    cluster = LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, tls=True, broker_args=args)
    try:
        await cluster.start()
        yield One(cluster, tokens)
    finally:
        await cluster.close()


async def served_certificate(bp: BrokerProcess, ca: str) -> bytes:
    """The certificate a new TLS connection to the broker is shown (DER)."""
    host, port = parse_address(bp.listen)
    ctx = ssl.create_default_context(cafile=ca)
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx, server_hostname=host)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert isinstance(der, bytes)
        return der
    finally:
        writer.close()
        await asyncio.gather(writer.wait_closed(), return_exceptions=True)
        del reader


async def test_sighup_serves_a_renewed_certificate_and_a_broken_one_changes_nothing(one: One) -> None:
    old = await served_certificate(one.bp, one.ca)
    async with Client(one.bp.listen, credentials=one.creds("operator")) as c:
        await c.publish("grid/a/voltage", b"before")
        certs.issue(one.cluster.certs_dir, one.bp.node_id, "broker", force=True)  # the renewal
        await one.hup("SIGHUP: read again the TLS certificate")
        renewed = await served_certificate(one.bp, one.ca)
        assert renewed != old
        await c.publish("grid/a/voltage", b"after")  # a connection made before the renewal is kept

        # A key that is not the certificate's (a renewal half done): refused, the renewed one stays in use.
        cert, key = certs.cert_paths(one.cluster.certs_dir, one.bp.node_id)
        good_key = key.read_bytes()
        _, other_key = certs.issue(one.cluster.certs_dir, "someone-else", "broker")
        shutil.copyfile(other_key, key)
        await one.hup("SIGHUP: nothing was reloaded, the broker goes on as it was")
        assert await served_certificate(one.bp, one.ca) == renewed
        await c.publish("grid/a/voltage", b"still")
        counters = await one.counters()
        assert (counters["reloads"], counters["reload_failures"]) == (1, 1)
        # The guard's counters are exported under their STATUS names (the alert on failed reloads reads them).
        exported = _metrics(one.bp)
        assert {k: exported[f"sedax_{k}_total"] for k in GUARD_COUNTERS} == {k: counters[k] for k in GUARD_COUNTERS}
        assert exported["sedax_last_reload_successful"] == 0  # SedaxReloadFailed fires on it
        assert not (await one.cluster.statuses())[one.bp.node_id].reload_ok  # and `sedax status`, `brokers` say it

        # A certificate for another name is refused too: a broker keeps its name while it runs.
        key.write_bytes(good_key)
        certs.issue(one.cluster.certs_dir, "renamed", "broker")
        shutil.copyfile(certs.cert_paths(one.cluster.certs_dir, "renamed")[0], cert)
        shutil.copyfile(certs.cert_paths(one.cluster.certs_dir, "renamed")[1], key)
        await one.hup("now names 'renamed', but this broker is 'n0'")
        assert await served_certificate(one.bp, one.ca) == renewed
        assert "Traceback" not in one.bp.stderr_tail(200)


async def test_sighup_cuts_off_a_withdrawn_token_and_keeps_the_others(one: One) -> None:
    async with (
        Client(one.bp.listen, credentials=one.token("dashboard"), connect_timeout=3.0) as dash,
        Client(one.bp.listen, credentials=one.token("meter-7"), connect_timeout=3.0, request_timeout=3.0) as meter,
    ):
        sub = await dash.subscribe("grid/b/voltage")
        await meter.publish("grid/b/voltage", b"1")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"1"

        kept = json.loads(one.tokens_file.read_text())
        del kept["meter-7"]
        one.tokens_file.write_text(json.dumps(kept))
        await one.hup("1 connections they no longer admit closed")

        async def refused() -> bool:
            try:
                await meter.publish("grid/b/voltage", b"2")
            except (ClientError, TimeoutError) as exc:
                # What the publisher is told: the reason its reconnects fail, not only that no answer came.
                assert "unauthenticated: the token is not valid on this broker" in str(exc), exc
                return True
            return False

        await wait_for(refused, 20.0, "the withdrawn token's client to be refused")
        assert log_has(one.bp, "the token of 'meter-7' is no longer in")

        async def reconnect_refused() -> bool:
            return (await one.counters())["refused_unauthenticated"] >= 1

        await wait_for(reconnect_refused, 20.0, "the client's reconnect with the withdrawn token refused")
        # The other token's client is untouched: still subscribed, still served.
        async with Client(one.bp.listen, credentials=one.creds("meter-8")) as other:
            await other.publish("grid/b/voltage", b"3")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"3"


async def test_sighup_applies_a_new_acl_to_standing_subscriptions(one: One) -> None:
    async with (
        Client(one.bp.listen, credentials=one.token("dashboard")) as dash,
        Client(one.bp.listen, credentials=one.creds("operator")) as op,
    ):
        denied = await dash.subscribe("grid/c/voltage")
        kept = await op.subscribe("grid/c/voltage")
        await op.publish("grid/c/voltage", b"1")
        async with asyncio.timeout(10):
            assert (await anext(denied)).payload == b"1"
            assert (await anext(kept)).payload == b"1"

        # A broken ACL first: nothing changes.
        one.acl.write_text("allow any\n")
        await one.hup("SIGHUP: nothing was reloaded")
        await op.publish("grid/c/voltage", b"2")
        async with asyncio.timeout(10):
            assert (await anext(denied)).payload == b"2"
            assert (await anext(kept)).payload == b"2"

        one.acl.write_text(DENY_DASHBOARD)
        await one.hup("1 subscriptions the ACL now denies ended")
        async with asyncio.timeout(10):
            with pytest.raises(RequestFailed, match="not_allowed") as refused:
                await anext(denied)
        assert "'dashboard' may not subscribe to 'grid/c/voltage'" in str(refused.value)
        with pytest.raises(RequestFailed, match="not_allowed"):
            await dash.subscribe("grid/c/voltage")
        # The operator's subscription goes on, and the primary no longer sends the ended one anything.
        before = (await one.counters())["delivered"]
        await op.publish("grid/c/voltage", b"3")
        async with asyncio.timeout(10):
            assert (await anext(kept)).payload == b"3"
        assert (await one.counters())["delivered"] - before == 1


async def test_sighup_with_a_new_ca_reconnects_certificate_clients_and_refuses_the_old_ones(
    one: One, tmp_path: Path
) -> None:
    # The CA is replaced (a compromised key): the broker gets a certificate of the new CA and trusts only it.
    new = tmp_path / "new-ca"
    certs.init_ca(new)
    certs.issue(new, one.bp.node_id, "broker", ["127.0.0.1"])
    certs.issue(new, "operator", "client")
    old_dir = one.cluster.certs_dir
    old_creds = one.creds("meter-9")
    async with Client(one.bp.listen, credentials=old_creds, connect_timeout=3.0, request_timeout=3.0) as old:
        await old.publish("grid/d/voltage", b"1")
        for src, dst in (
            (certs.ca_paths(new)[0], certs.ca_paths(old_dir)[0]),
            *zip(certs.cert_paths(new, one.bp.node_id), certs.cert_paths(old_dir, one.bp.node_id), strict=True),
        ):
            shutil.copyfile(src, dst)
        # The client's CA file was the one replaced too: what it verifies the broker with now is the new CA,
        # but its own certificate is of the old one.
        await one.hup("1 connections they no longer admit closed")

        await wait_refused(old, "grid/d/voltage", "the old CA's client to be cut off")
    new_cert, new_key = certs.cert_paths(new, "operator")
    creds = Credentials(ca=str(certs.ca_paths(new)[0]), cert=str(new_cert), key=str(new_key))
    async with Client(one.bp.listen, credentials=creds) as c:
        await c.publish("grid/d/voltage", b"3")
    assert log_has(one.bp, "TLS handshake with"), one.bp.stderr_tail()  # the old client's attempts


async def test_sighup_applies_the_config_files_limits_and_refuses_what_takes_a_restart(tmp_path: Path) -> None:
    # SIGHUP used to be a graceful leave: `systemctl reload` or a renewal hook took the broker out of the overlay.
    conf = tmp_path / "broker.toml"
    conf.write_text("publish_burst = 5\n")
    args = (*FAST_ARGS, "--config", str(conf))
    async with LocalCluster(2, state_dir=tmp_path, tls=False, broker_args=args) as cluster:
        await cluster.wait_converged(20.0)
        bp = cluster.nodes[1]

        await hup(bp, "SIGHUP: the configuration is as it was")
        async with Client(bp.listen, credentials=Credentials(insecure=True), ack_timeout=0.2) as c:
            for i in range(30):  # no --publish-rate yet: nothing is limited
                await c.publish("grid/e/voltage", b"%d" % i)
            assert c.rate_limited == 0

            conf.write_text("publish_burst = 5\npublish_rate = 20.0\n")
            await hup(bp, "SIGHUP: changed publish_rate 0.0 -> 20.0")
            # A batch passes a full bucket and leaves it in debt (however the broker's reads cut the messages):
            # the second, sent once the first is acknowledged, comes into that debt (25 tokens at 20/s).
            for first in (30, 60):
                acks = [await c.publish_nowait("grid/e/voltage", b"%d" % i) for i in range(first, first + 30)]
                async with asyncio.timeout(30):
                    await asyncio.gather(*acks)  # limited, re-sent, all acknowledged
            assert c.rate_limited > 0

            conf.write_text("publish_burst = 5\npublish_rate = 20.0\nmax_hops = 9\n")
            await hup(bp, "max_hops changed, which takes effect only at a restart")
            conf.write_text("publish_burst = 5\npublish_rate = 20.0\nresilience = 3\n")  # a flag: it wins
            await hup(bp, "SIGHUP: the configuration is as it was")
            conf.write_text("publish_rate = [")
            await hup(bp, "is not valid TOML")
            assert (await cluster.statuses())[bp.node_id].counters["reload_failures"] == 2

            # The log level: at WARNING a reload's own INFO line is not written (the counter says it was done).
            async def reloaded(n: int) -> bool:
                return (await cluster.statuses())[bp.node_id].counters["reloads"] >= n

            done = (await cluster.statuses())[bp.node_id].counters["reloads"]
            conf.write_text('publish_burst = 5\npublish_rate = 20.0\nlog_level = "WARNING"\n')
            for _ in range(2):  # the reload to WARNING, then one with nothing changed
                since = log_size(bp)
                os.kill(bp.pid, signal.SIGHUP)
                done += 1
                await wait_for(functools.partial(reloaded, done), 15.0, f"reload {done} done")
                assert not log_has(bp, "SIGHUP:", since), bp.stderr_tail()
            conf.write_text('publish_burst = 5\npublish_rate = 20.0\nlog_level = "INFO"\n')
            await hup(bp, "SIGHUP: changed log_level 'WARNING' -> 'INFO'")
        await cluster.wait_converged(5.0)  # still in the overlay, where it was


async def test_sighup_changes_max_connections_for_new_connections_and_the_topic_files_budget(tmp_path: Path) -> None:
    # A broker at its --max-connections refuses every new client; raising it took a restart, which at level 2 is
    # a failover of each of its topics.  A reload raises or lowers it for the connections that come next (those
    # open are kept, as with every limit a reload changes) and gives the topic files what the clients leave.
    conf = tmp_path / "broker.toml"
    conf.write_text("max_connections = 2\n")
    args = (*FAST_ARGS, "--config", str(conf))
    async with LocalCluster(1, state_dir=tmp_path, tls=False, broker_args=args, data_dirs=True) as cluster:
        bp = cluster.nodes[0]

        async def connect(limit: int | None) -> Client | None:
            """A new client: connected (limit None), or refused at HELLO naming `limit`."""
            c = Client(bp.listen, reconnect=False)
            if limit is None:
                await c.connect()
                return c
            with pytest.raises(ClientError, match=f"too_many_connections: this broker serves at most {limit} "):
                await c.connect()
            await c.aclose()
            return None

        first, second = await connect(None), await connect(None)
        await connect(2)
        conf.write_text("max_connections = 3\n")
        since = await hup(bp, "SIGHUP: changed max_connections 2 -> 3")
        assert log_has(bp, "topic files kept open at once", since), bp.stderr_tail()
        third = await connect(None)
        await connect(3)
        conf.write_text("max_connections = 1\n")
        await hup(bp, "SIGHUP: changed max_connections 3 -> 1")
        await connect(1)
        kept = [c for c in (first, second, third) if c is not None]
        assert len(kept) == 3
        for k, c in enumerate(kept):  # the three connected before are served on
            assert (await c.publish("grid/conn/1", b"%d" % k)).seq == 0
            await c.aclose()
        await wait_for(lambda: connects(bp.listen), 10.0, "a slot free again under the lowered limit")


async def test_a_retention_rule_applies_at_every_holder_and_a_reload_changes_it(tmp_path: Path) -> None:
    # One retention for every topic made a utility choose between keeping hours of a 60 Hz phasor stream and
    # days of its events.  A rule keeps the topics its pattern matches by their own limits, at the primary and
    # at the copy alike (each applies the same configuration), and SIGHUP changes the rules of a running broker.
    conf = tmp_path / "broker.toml"
    conf.write_text('retention_topics = ["grid/short/#=,20000"]\n')
    args = (*FAST_ARGS, "--config", str(conf))
    async with LocalCluster(3, state_dir=tmp_path, tls=False, broker_args=args) as cluster:
        await cluster.wait_converged(20.0)
        payload = b"x" * 1000
        async with Client([bp.listen for bp in cluster.nodes], credentials=Credentials(insecure=True)) as c:
            for _ in range(40):
                await c.publish("grid/short/1", payload)
                await c.publish("grid/long/1", payload)
            one = record_size(c.publisher_id, payload)

            async def sizes(topic: str) -> list[int]:
                """The bytes of the topic at its primary and its secondary."""
                held = [h for st in (await cluster.statuses()).values() for h in st.held if h.topic == topic]
                return sorted(h.size for h in held if h.role in ("primary", "secondary"))

            async def kept(topic: str, n: int) -> bool:
                return await sizes(topic) == [n * one, n * one]

            await wait_for(functools.partial(kept, "grid/short/1", 20000 // one), 10.0, "the rule at both holders")
            assert await sizes("grid/long/1") == [40 * one, 40 * one]  # the broker's 64 MiB
            assert [r.seq for r in await c.fetch("grid/short/1")] == list(range(40 - 20000 // one, 40))

            conf.write_text('retention_topics = ["grid/short/#=,20000", "grid/#=,10000"]\n')
            for bp in cluster.nodes:
                await hup(bp, "SIGHUP: changed retention_topics")
                assert log_has(bp, "grid/#: the broker's age, 10000 bytes ("), bp.stderr_tail()
            await wait_for(functools.partial(kept, "grid/long/1", 10000 // one), 10.0, "the new rule at both holders")
            assert [r.seq for r in await c.fetch("grid/long/1")] == list(range(40 - 10000 // one, 40))
            assert len(await c.fetch("grid/short/1")) == 20000 // one  # the first rule that matches decides


def _not_after(cert: Path) -> float:
    out = subprocess.run(["openssl", "x509", "-enddate", "-noout", "-in", str(cert)], capture_output=True, text=True)
    return float(ssl.cert_time_to_seconds(out.stdout.strip().removeprefix("notAfter=")))


def _metrics(bp: BrokerProcess) -> dict[str, float]:
    """The broker's unlabelled series, by name, as a scrape reads them."""
    with urllib.request.urlopen(f"http://{bp.metrics}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, value in (ln.split() for ln in lines if ln[:1] != "#" and "{" not in ln)}


def _expiry_metric(bp: BrokerProcess) -> float:
    return _metrics(bp)["sedax_tls_certificate_expiry_timestamp_seconds"]


async def _status_text(cluster: LocalCluster) -> str:
    """`sedax status` of the cluster's first broker, run as a TLS client of the cluster runs it."""
    creds = cluster.credentials()
    assert creds.ca is not None and creds.cert is not None and creds.key is not None
    flags = ("--ca", creds.ca, "--cert", creds.cert, "--key", creds.key)
    env = {k: v for k, v in os.environ.items() if k != "SEDAX_INSECURE"}  # (the suite's plain-TCP default)
    argv = [sys.executable, "-m", "cli.main", "status", "--broker", cluster.nodes[0].listen, *flags]
    res = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


async def test_a_certificate_near_its_expiry_is_warned_of_and_its_date_exported(tmp_path: Path) -> None:
    # Expired while the broker runs, a certificate fails every new link's handshake: the overlay splits.
    pki = tmp_path / "certs"
    certs.init_ca(pki)
    cert, _ = certs.issue(pki, "n0", "broker", ["127.0.0.1"], days=10)
    args = (*FAST_ARGS, "--metrics", "127.0.0.1:0")
    async with LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, tls=True, broker_args=args) as cluster:
        bp = cluster.nodes[0]
        assert log_has(bp, "the TLS certificate"), bp.stderr_tail()
        assert log_has(bp, "expires in 10.0 days") or log_has(bp, "expires in 9.9 days"), bp.stderr_tail()
        before = _not_after(cert)
        assert abs(_expiry_metric(bp) - before) < 1.0
        # `sedax status` says it too, as an operator reads it (the TLS flags a client of this cluster gives)
        line = (await _status_text(cluster)).splitlines()[1]
        assert line.endswith(("(9 days left)", "(10 days left)")) and "TLS certificate (or its CA) valid until" in line

        certs.issue(pki, "n0", "broker", ["127.0.0.1"], force=True, days=400)
        since = await hup(bp, "SIGHUP: read again")
        assert _not_after(cert) > before + 300 * 86400
        assert abs(_expiry_metric(bp) - _not_after(cert)) < 1.0
        assert (await _status_text(cluster)).splitlines()[1].endswith(("(399 days left)", "(400 days left)"))
        exported = _metrics(bp)
        assert (exported["sedax_reloads_total"], exported["sedax_last_reload_successful"]) == (1, 1)
        assert not log_has(bp, "expires in", since)  # renewed for long enough: no warning after the reload


async def test_a_ca_expiring_before_the_certificate_is_what_is_warned_of(tmp_path: Path) -> None:
    pki = tmp_path / "certs"
    ca = certs.init_ca(pki, days=20)
    certs.issue(pki, "n0", "broker", ["127.0.0.1"], days=400)  # openssl lets a certificate outlive its CA
    args = (*FAST_ARGS, "--metrics", "127.0.0.1:0")
    async with LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, tls=True, broker_args=args) as cluster:
        bp = cluster.nodes[0]
        assert log_has(bp, f"the CA certificate in {ca} that issued"), bp.stderr_tail()
        assert abs(_expiry_metric(bp) - _not_after(ca)) < 1.0


async def test_json_log_lines_and_a_reload_back_to_text(tmp_path: Path) -> None:
    # --log-format json, a log pipeline's input: each line of the broker's stderr one JSON object, a start that
    # fails included; a reload (the config file's log_format) switches the format without a restart.
    conf = tmp_path / "broker.toml"
    conf.write_text('log_format = "json"\n')
    args = (*FAST_ARGS, "--config", str(conf))
    async with LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, broker_args=args) as cluster:
        bp = cluster.nodes[0]
        conf.write_text('log_format = "text"\n')
        since = await hup(bp, "SIGHUP: changed log_format 'json' -> 'text'")
        raw = bp.err_path.read_bytes()
        records = [json.loads(line) for line in raw[:since].decode().splitlines()]
        assert records and all(set(r) == {"ts", "level", "node", "logger", "message"} for r in records), records
        assert all(r["node"] == bp.node_id and r["ts"].endswith("Z") for r in records)
        assert any(r["logger"] == "sedax.broker" and r["level"] == "INFO" for r in records)
        after = raw[since:].decode().splitlines()
        assert after and all(f"broker[{bp.node_id}]" in line for line in after), after

        argv = [sys.executable, "-m", "broker", "--coord", "0.2,0.2", "--insecure", "--log-format", "json"]
        busy = await asyncio.to_thread(  # the port the broker holds: a start that fails, said as a JSON record too
            subprocess.run, [*argv, "--listen", bp.listen], capture_output=True, text=True, timeout=60
        )
        assert busy.returncode == 2, busy.stderr
        lines = [json.loads(line) for line in busy.stderr.splitlines()]
        fatal = [r for r in lines if r["level"] == "CRITICAL"]
        assert len(fatal) == 1 and f"cannot listen on {bp.listen}" in fatal[0]["message"], busy.stderr
