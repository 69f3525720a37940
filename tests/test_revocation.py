"""Certificate revocation (`--tls-crl`) on real TLS brokers, and the CRL reader (net/crl.py) on CRLs openssl wrote.

What an operator does when a meter's or a broker's key leaks: `sedax certs revoke` (or their own CA) writes the
CRL, and `kill -HUP` each broker.  The revoked holder is refused at every handshake from then on, and its
connections made before the revocation are cut off, broker links included; everyone else is untouched.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cluster import hup, log_has, wait_for, wait_refused
from conftest import FAST_ARGS

from cli.cluster import BrokerProcess, LocalCluster
from client.admin import AdminClient
from client.client import Client, ClientError
from net import certs
from net.credentials import peer_cert
from net.crl import CrlError, RevocationList, load_crls, parse_crl, uncovered

pytestmark = pytest.mark.slow


def _serial(cert: Path) -> int:
    out = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-serial"], capture_output=True, text=True)
    return int(out.stdout.strip().split("=", 1)[1], 16)


def _next_update(crl: Path) -> float:
    out = subprocess.run(["openssl", "crl", "-in", str(crl), "-noout", "-nextupdate"], capture_output=True, text=True)
    return float(time.mktime(time.strptime(out.stdout.strip().split("=", 1)[1], "%b %d %H:%M:%S %Y %Z")))


# ------------------------------------------------------------------------------------------- the reader


def test_the_crl_reader_finds_what_openssl_revoked(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    cert_a, _ = certs.issue(tmp_path, "meter-a", "client")
    cert_b, _ = certs.issue(tmp_path, "meter-b", "client")
    (empty,) = load_crls(str(certs.write_crl(tmp_path, days=7)))
    assert empty.serials == frozenset()
    assert empty.issuer == ((("organizationName", "SeDAX"),), (("commonName", "SeDAX development CA"),))
    assert empty.next_update is not None and empty.next_update - empty.this_update == 7 * 86400
    crl = certs.revoke(tmp_path, "meter-a")
    certs.revoke(tmp_path, "meter-a")  # again: no error, the same list
    (one,) = load_crls(str(crl))
    assert one.serials == {_serial(cert_a)}
    assert one.next_update == _next_update(crl)
    # A certificate as a connection's getpeercert() gives it: revoked by issuer and serial, not by name.
    seen = {"subject": ((("commonName", "meter-a"),),), "issuer": one.issuer, "serialNumber": f"{_serial(cert_a):X}"}
    pc = peer_cert(seen)
    assert pc is not None and pc.serial is not None and one.revokes(pc.issuer, pc.serial)
    assert not one.revokes(pc.issuer, _serial(cert_b))
    assert not one.revokes(((("commonName", "another CA"),),), _serial(cert_a))
    # Every CA of a bundle needs a CRL; a CRL whose issuer is another CA does not count.
    ca = {"subject": one.issuer}
    assert uncovered([ca], [one]) == []
    assert uncovered([ca, {"subject": ((("commonName", "second CA"),),)}], [one]) == ["second CA"]
    assert uncovered([ca, ca], [one]) == ["SeDAX development CA"]  # a CA and its replacement: a CRL each
    assert uncovered([ca, ca], [one, one]) == []


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "holds no PEM CRL"),
        (b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n", "CRL 1 of 1 cannot be read"),
        (b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "holds a certificate too"),
    ],
)
def test_a_crl_file_that_cannot_be_used_says_why(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "crl.pem"
    path.write_bytes(content)
    with pytest.raises(CrlError, match=match):
        load_crls(str(path))
    with pytest.raises(CrlError, match="cannot read"):
        load_crls(str(tmp_path / "missing.pem"))


def test_a_tool_given_a_crl_it_cannot_use_says_why_in_one_line(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    ca = certs.ca_paths(tmp_path)[0]
    cmd = [sys.executable, "-m", "cli.main", "status", "--broker", "127.0.0.1:9", "--ca", str(ca), "--token", "t"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEDAX_")}
    for crl, says in ((ca, "holds a certificate too"), (tmp_path / "none.pem", "cannot read --crl/SEDAX_CRL=")):
        res = subprocess.run([*cmd, "--crl", str(crl)], capture_output=True, text=True, timeout=60, env=env)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr


def test_the_crl_reader_refuses_bytes_that_are_no_crl(tmp_path: Path) -> None:
    for junk in (b"\x30", b"\x30\x85\x00\x00\x00\x00\x00", b"\x02\x01\x00", b"\x30\x03\x02\x01\x00"):
        with pytest.raises((ValueError, IndexError)):
            parse_crl(junk)
    assert not RevocationList((), frozenset({1}), 0.0, None).revokes("not a name", 1)
    # A real CRL with bytes flipped, cut or grown: read, or refused with CrlError naming the file, never another
    # exception (the broker would die at start or at a reload with a traceback).
    certs.init_ca(tmp_path)
    certs.issue(tmp_path, "meter-a", "client")
    good = certs.revoke(tmp_path, "meter-a")
    der = base64.b64decode(b"".join(good.read_bytes().splitlines()[1:-1]))
    rng = random.Random(53)
    bad = tmp_path / "bad.pem"
    for _ in range(1500):
        b = bytearray(der)
        for _ in range(rng.randint(1, 4)):
            if not b:
                break
            i = rng.randrange(len(b))
            how = rng.random()
            if how < 0.6:
                b[i] = rng.randrange(256)
            elif how < 0.8:
                del b[i:]
            else:
                b[i:i] = rng.randbytes(rng.randint(1, 8))
        bad.write_bytes(b"-----BEGIN X509 CRL-----\n" + base64.encodebytes(bytes(b)) + b"-----END X509 CRL-----\n")
        try:
            load_crls(str(bad))
        except CrlError as exc:
            assert str(bad) in str(exc)


# ------------------------------------------------------------------------------------------- the brokers


def _metric(bp: BrokerProcess, name: str) -> float:
    assert bp.metrics is not None
    with urllib.request.urlopen(f"http://{bp.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found.group(1))


@pytest.fixture
async def crl_cluster(tmp_path: Path) -> AsyncIterator[LocalCluster]:
    d = tmp_path / "certs"
    certs.init_ca(d)
    crl = certs.write_crl(d)
    args = (*FAST_ARGS, "--tls-crl", str(crl), "--metrics", "127.0.0.1:0")
    cluster = LocalCluster(3, seed=7, state_dir=tmp_path, tls=True, broker_args=args)
    try:
        await cluster.start()
        yield cluster
    finally:
        await cluster.close()


async def test_a_revoked_client_is_cut_off_at_the_reload_and_refused_after(crl_cluster: LocalCluster) -> None:
    cluster = crl_cluster
    bp = cluster.nodes[0]
    d = cluster.certs_dir
    crl = d / certs.CRL_FILE
    assert _metric(bp, "sedax_tls_crl_next_update_timestamp_seconds") == _next_update(crl)
    st = (await cluster.statuses())[bp.node_id]  # and STATUS, for `sedax status` and `sedax brokers`
    assert st.crl_next_update == _next_update(crl)
    async with (
        Client(bp.listen, credentials=cluster.credentials("meter-1")) as good,
        Client(bp.listen, credentials=cluster.credentials("meter-2"), connect_timeout=3.0, request_timeout=3.0) as bad,
    ):
        sub = await good.subscribe("grid/crl/voltage")
        await bad.publish("grid/crl/voltage", b"1")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"1"
        before = (await cluster.statuses())[bp.node_id].counters["tls_handshake_failures"]

        certs.revoke(d, "meter-2")
        for other in cluster.nodes:  # every broker, as docs/security.md says: meter-2 reconnects to any
            await hup(other, "SIGHUP: read again")
        assert log_has(bp, "the certificate of client 'meter-2' is revoked in")
        assert log_has(bp, "1 connections they no longer admit closed")

        await wait_refused(bad, "grid/crl/voltage", "the revoked client to be refused")

        async def handshakes_refused() -> bool:
            sts = await cluster.statuses()
            return sum(st.counters["tls_handshake_failures"] for st in sts.values()) > before

        await wait_for(handshakes_refused, 20.0, "the revoked client's reconnects to fail their handshake")
        # The other client is untouched: still subscribed, still served.
        await good.publish("grid/crl/voltage", b"3")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"3"
    assert "Traceback" not in bp.stderr_tail(200)


async def test_brokers_names_a_broker_that_has_not_read_the_newest_crl(crl_cluster: LocalCluster) -> None:
    cluster = crl_cluster
    await cluster.wait_converged(30.0)
    addrs = ",".join(bp.listen for bp in cluster.nodes)
    creds = cluster.credentials("operator")
    assert creds.ca and creds.cert and creds.key
    tls = ["--ca", creds.ca, "--cert", creds.cert, "--key", creds.key]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEDAX_")}  # (the suite sets SEDAX_INSECURE)

    def warnings() -> list[str]:
        res = subprocess.run(
            [sys.executable, "-m", "cli.main", "brokers", "--broker", addrs, *tls, "--json"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert res.stdout, res.stderr
        return list(json.loads(res.stdout)["warnings"])

    assert warnings() == []
    certs.write_crl(cluster.certs_dir, days=31)  # a newer list (due a day later than the one they run with)
    first, *rest = cluster.nodes
    await hup(first, "SIGHUP: read again")
    said = warnings()
    assert [w.split()[0] for w in said] == sorted(bp.node_id for bp in rest), said
    assert all("checks an older CRL" in w and "SIGHUP it" in w for w in said)
    for bp in rest:
        await hup(bp, "SIGHUP: read again")
    assert warnings() == []


async def test_a_revoked_broker_is_cut_out_of_the_overlay(crl_cluster: LocalCluster) -> None:
    cluster = crl_cluster
    await cluster.wait_converged(30.0)
    gone, *kept = sorted(cluster.nodes, key=lambda bp: bp.node_id, reverse=True)
    certs.revoke(cluster.certs_dir, gone.node_id)
    for bp in kept:
        await hup(bp, "SIGHUP: read again")
    names = {bp.node_id for bp in kept}

    async def cut_out() -> bool:
        sts = await cluster.statuses()
        return all({n.id for n in sts[bp.node_id].neighbours} == names - {bp.node_id} for bp in kept) and all(
            sts[bp.node_id].counters["tls_handshake_failures"] > 0 for bp in kept
        )

    # Linked to each other only, and the revoked broker's attempts to link again fail their handshake.
    await wait_for(cut_out, 30.0, f"{gone.node_id} to be cut out and refused")
    assert any(log_has(bp, f"the certificate of broker {gone.node_id!r} is revoked in") for bp in kept)
    # The two left serve on, and a client given the CRL (--crl) refuses the revoked broker: it still runs and
    # would serve whoever connects.
    checking = dataclasses.replace(cluster.credentials("operator"), crl=str(cluster.certs_dir / certs.CRL_FILE))
    async with Client([bp.listen for bp in kept], credentials=checking) as c:
        sub = await c.subscribe("grid/crl/after")
        await c.publish("grid/crl/after", b"x")
        async with asyncio.timeout(10):
            assert (await anext(sub)).payload == b"x"
    with pytest.raises(ClientError, match="certificate revoked"):
        async with Client([gone.listen], credentials=checking, connect_timeout=3.0, reconnect=False) as c:
            await c.publish("grid/crl/after", b"y")
    async with await AdminClient.connect(gone.listen, credentials=cluster.credentials("operator")):
        pass  # (without the CRL a client cannot tell)


async def test_a_crl_given_at_a_reload_takes_effect_and_dropped_again_admits(tmp_path: Path) -> None:
    # A running cluster that never checked CRLs starts to: tls_crl added to the config file, then SIGHUP (a
    # revoked client already connected is cut off at once); and dropped again (it connects again).
    d = tmp_path / "certs"
    certs.init_ca(d)
    conf = tmp_path / "broker.toml"
    conf.write_text("")
    args = (*FAST_ARGS, "--config", str(conf))
    async with LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, tls=True, broker_args=args) as cluster:
        bp = cluster.nodes[0]
        creds = cluster.credentials("meter-3")
        async with Client(bp.listen, credentials=creds, connect_timeout=3.0, request_timeout=3.0) as c:
            await c.publish("grid/crl/late", b"1")
            conf.write_text(f'tls_crl = "{certs.revoke(d, "meter-3")}"\n')
            await hup(bp, "1 connections they no longer admit closed")
            assert log_has(bp, "1 CRLs revoking 1 certificates from")

            await wait_refused(c, "grid/crl/late", "the revoked client to be refused")
        conf.write_text("")
        await hup(bp, "changed tls_crl")
        async with Client(bp.listen, credentials=creds) as c:
            await c.publish("grid/crl/late", b"3")  # no CRL checked: admitted again


async def test_a_crl_near_its_next_update_is_warned_of(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    certs.init_ca(d)
    crl = certs.write_crl(d, days=1)  # within CRL_WARNING (3 days)
    args = (*FAST_ARGS, "--tls-crl", str(crl))
    async with LocalCluster(1, coords=[(0.5, 0.5)], state_dir=tmp_path, tls=True, broker_args=args) as cluster:
        bp = cluster.nodes[0]
        await wait_for(lambda: log_has(bp, "(sedax certs crl, or your CA) and send this broker SIGHUP"), 15.0)
        assert log_has(bp, f"a CRL of {crl} is due in 2") or log_has(bp, f"a CRL of {crl} is due in 23."), (
            bp.stderr_tail()
        )
        certs.write_crl(d)  # a fresh one, 30 days: the next warning is a day away, and the reload says what it read
        await hup(bp, "1 CRLs revoking 0 certificates from")


# ------------------------------------------------------------------------------------------- at start


def _start(cert: Path, key: Path, ca: Path, crl: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEDAX_")}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "broker", "--listen", "127.0.0.1:0", "--coord", "0.5,0.5", "--check",
         "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca), "--tls-crl", str(crl)],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip


def test_a_broker_refuses_to_start_on_a_crl_that_would_refuse_everyone(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    certs.init_ca(d)
    cert, key = certs.issue(d, "n0", "broker")
    ca = certs.ca_paths(d)[0]
    crl = certs.write_crl(d)
    ok = _start(cert, key, ca, crl)
    assert ok.returncode == 0, ok.stderr

    def refused(res: subprocess.CompletedProcess[str], text: str) -> None:
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and text in lines[0], res.stderr  # (a setting to fix)

    # A bundle of two CAs and the CRL of one: every certificate of the other would be refused.  (Both are named
    # "SeDAX development CA", as a replaced CA is.)
    other = tmp_path / "other"
    certs.init_ca(other)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca.read_bytes() + certs.ca_paths(other)[0].read_bytes())
    refused(_start(cert, key, bundle, crl), "holds no CRL of the CA 'SeDAX development CA'")
    # A certificate in the CRL file would be trusted as a CA.
    mixed = tmp_path / "mixed.pem"
    mixed.write_bytes(crl.read_bytes() + ca.read_bytes())
    refused(_start(cert, key, ca, mixed), "holds a certificate too")
    # A CRL past its nextUpdate.
    stale = tmp_path / "stale.pem"
    shutil.copyfile(crl, stale)
    dates = ["-crl_lastupdate", "20200101000000Z", "-crl_nextupdate", "20200102000000Z"]
    certs._ca_command(d, ["-gencrl", *dates, "-out", str(stale)], 1)  # (what `sedax certs crl` runs, dated back)
    refused(_start(cert, key, ca, stale), "was due for renewal at 2020-01-02 00:00 UTC")
    # Its own certificate revoked.
    refused(_start(cert, key, ca, certs.revoke(d, "n0")), "is revoked in tls_crl")
