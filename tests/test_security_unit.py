"""Security building blocks without a running overlay: ACL rules, token buckets, certificates, settings.

Certificates are real (the openssl CLI, net/certs.py); TLS contexts are real (Python's ssl module).
"""

from __future__ import annotations

import json
import shutil
import ssl
import tempfile
from pathlib import Path

import pytest

from broker.acl import AclError, load_acl, parse_acl, refusal
from broker.config import BrokerConfig, ConfigError, build_config
from broker.guard import Guard, TokenBucket, load_tokens
from broker.node import Broker
from net import certs
from net.credentials import Credentials, CredentialsError
from overlay.pubsub import Failed, Fetch, Locate, Nack, Publish, Subscribe, Unsubscribe

ACL = """\
# effect  action     identity  pattern
deny      subscribe  *         grid/private/#
allow     publish    meter-*   grid/+/voltage   # meters report voltages only
allow     subscribe  operator  grid/#
allow     any        admin     #
"""


def test_acl_first_match_decides_and_default_denies() -> None:
    acl = parse_acl(ACL, "test.acl")
    assert acl.allows("meter-7", "publish", "grid/f1/voltage")[0]
    assert not acl.allows("meter-7", "publish", "grid/f1/current")[0]  # no rule: default deny
    assert not acl.allows("meter-7", "publish", "grid/f1/x/voltage")[0]  # '+' is exactly one level
    assert not acl.allows("meter-7", "subscribe", "grid/f1/voltage")[0]
    assert acl.allows("operator", "subscribe", "grid")[0]  # '#' matches the parent level too
    assert acl.allows("operator", "subscribe", "grid/f1/voltage")[0]
    ok, why = acl.allows("operator", "subscribe", "grid/private/keys")
    assert not ok and "test.acl:2" in why  # the deny above the allow wins
    assert not acl.allows("operator", "publish", "grid/f1/voltage")[0]
    assert acl.allows("admin", "publish", "anything/at/all")[0]
    assert not acl.allows("admin", "subscribe", "grid/private/x")[0]
    assert "default deny" in acl.allows("nobody", "publish", "x")[1]


def test_acl_refusals_are_typed_answers() -> None:
    acl = parse_acl(ACL, "test.acl")
    nack = refusal(acl, "meter-1", Publish("grid/f1/current", "meter-1", 5, b"1"), "access")
    assert isinstance(nack, Nack) and nack.code == "not_allowed" and nack.seq == 5
    assert "'meter-1' may not publish to 'grid/f1/current'" in nack.text
    failed = refusal(acl, "meter-1", Subscribe(9, "grid/f1/voltage"), "holder")
    assert isinstance(failed, Failed) and failed.corr == 9 and failed.code == "not_allowed"
    assert isinstance(refusal(acl, "meter-1", Fetch(3, "grid/f1/voltage"), "access"), Failed)
    # Unsubscribing and locating are never denied.
    assert refusal(acl, "meter-1", Unsubscribe(1, "grid/private/x"), "access") is None
    assert refusal(acl, "meter-1", Locate(1, "grid/private/x"), "access") is None
    assert refusal(acl, "", Publish("grid/f1/voltage", "p", 0, b""), "access") is not None  # anonymous
    assert acl.denied == {"access": 3, "holder": 1}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("allow publish x", "test.acl:1: expected 'allow|deny ACTION IDENTITY PATTERN'"),
        ("permit publish x a/b", "first word must be allow or deny"),
        ("allow write x a/b", "publish, subscribe or any"),
        ("allow publish x a/#/b", "'#' may only be the last level"),
        ("allow publish x a/b+", "a wildcard must be a whole level"),
        ("\n\nallow publish x a b", "test.acl:3: expected"),
    ],
)
def test_acl_errors_name_the_line(text: str, match: str) -> None:
    with pytest.raises(AclError, match=match):
        parse_acl(text, "test.acl")


def test_acl_file_errors(tmp_path: Path) -> None:
    with pytest.raises(AclError, match="cannot read the ACL file"):
        load_acl(tmp_path / "missing.acl")
    f = tmp_path / "ok.acl"
    f.write_text(ACL)
    assert len(load_acl(f).rules) == 4


def test_token_bucket() -> None:
    b = TokenBucket(rate=4.0, burst=3, now=100.0)
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(100.125)  # half a token
    assert b.take(100.25)
    assert [b.take(1000.0) for _ in range(4)] == [True, True, True, False]  # refills only up to the burst


def test_security_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="tls_key, tls_ca missing"):
        build_config({"coord": "0.5,0.5", "tls_cert": "c.pem"}, env={})
    with pytest.raises(ConfigError, match="insecure turns TLS off"):
        build_config({"coord": "0.5,0.5", "tls_cert": "c", "tls_key": "k", "tls_ca": "a"}, env={"SEDAX_INSECURE": "1"})
    with pytest.raises(ConfigError, match="insecure must be true or false"):
        build_config({"coord": "0.5,0.5"}, env={"SEDAX_INSECURE": "maybe"})
    with pytest.raises(ConfigError, match="slow_consumer_policy must be disconnect or drop"):
        build_config({"coord": "0.5,0.5", "slow_consumer_policy": "ignore"}, env={})
    with pytest.raises(ConfigError, match="max_frame_size must be in 4096"):
        build_config({"coord": "0.5,0.5", "max_frame_size": 100}, env={})
    with pytest.raises(ConfigError, match="publish_rate must be >= 0"):
        build_config({"coord": "0.5,0.5", "publish_rate": -1.0}, env={})
    cfg = build_config({"coord": "0.5,0.5"}, env={"SEDAX_PUBLISH_RATE": "50", "SEDAX_IDLE_TIMEOUT": "0"})
    assert cfg.publish_rate == 50.0 and cfg.idle_timeout == 0.0 and not cfg.insecure


def test_broker_refuses_to_start_without_tls_or_insecure() -> None:
    with pytest.raises(ConfigError, match="TLS is required: pass --tls-cert, --tls-key and --tls-ca"):
        Broker(BrokerConfig(coord=(0.5, 0.5)))
    Broker(BrokerConfig(coord=(0.5, 0.5), insecure=True))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cluster CA with a broker and a client certificate, and a second, unrelated CA with a broker."""
    d = tmp_path_factory.mktemp("pki")
    other = tmp_path_factory.mktemp("rogue-pki")
    certs.init_ca(d)
    certs.init_ca(other)
    b_cert, b_key = certs.issue(d, "n0", "broker", ["10.0.0.5", "broker0.example"])
    c_cert, c_key = certs.issue(d, "meter-1", "client")
    r_cert, r_key = certs.issue(other, "n0", "broker")
    return {
        "ca": d / "ca.pem",
        "b_cert": b_cert,
        "b_key": b_key,
        "c_cert": c_cert,
        "c_key": c_key,
        "r_cert": r_cert,
        "r_key": r_key,
        "dir": d,
    }


def _tls(pki: dict[str, Path], cert: str = "b_cert", key: str = "b_key", **kw: object) -> BrokerConfig:
    return BrokerConfig(
        coord=(0.5, 0.5),
        tls_cert=str(pki[cert]),
        tls_key=str(pki[key]),
        tls_ca=str(pki["ca"]),
        **kw,  # type: ignore[arg-type]
    )


def test_certs_refuse_to_overwrite_and_bad_names(pki: dict[str, Path]) -> None:
    with pytest.raises(certs.CertError, match="exists"):
        certs.init_ca(pki["dir"])
    with pytest.raises(certs.CertError, match="exists"):
        certs.issue(pki["dir"], "n0", "broker")
    with pytest.raises(certs.CertError, match="name must be"):
        certs.issue(pki["dir"], "../evil", "client")
    with pytest.raises(certs.CertError, match="role must be one of broker, client"):
        certs.issue(pki["dir"], "x", "admin")
    with pytest.raises(certs.CertError, match="no CA in"):
        certs.issue(pki["dir"] / "nowhere", "x", "client")
    assert oct(pki["b_key"].stat().st_mode & 0o777) == "0o600"


def test_issue_into_another_file_system(pki: dict[str, Path]) -> None:
    """A certificate directory on another file system than /tmp (a Docker volume): nothing crosses it."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == Path(tempfile.gettempdir()).stat().st_dev:
        pytest.skip("needs /dev/shm on another file system than the temporary directory")
    d = Path(tempfile.mkdtemp(dir=shm, prefix="sedax-test-"))
    try:
        certs.init_ca(d)
        cert, key = certs.issue(d, "n1", "broker")
        assert cert.exists() and key.exists()
        assert sorted(p.name for p in d.iterdir()) == ["ca.key", "ca.pem", "n1.key", "n1.pem"]  # no leftovers
    finally:
        shutil.rmtree(d)


def test_broker_tls_self_check(pki: dict[str, Path]) -> None:
    guard = Guard(_tls(pki), __import__("logging").getLogger("test"))
    assert guard.name == "n0"  # the node id comes from the certificate
    assert guard.tls is not None and guard.tls.server.verify_mode == ssl.CERT_REQUIRED  # no tokens: certs only
    with pytest.raises(ConfigError, match="is a client certificate for 'meter-1'"):
        Broker(_tls(pki, "c_cert", "c_key"))
    with pytest.raises(ConfigError, match="does not verify against tls_ca"):
        Broker(_tls(pki, "r_cert", "r_key"))  # a certificate of another CA
    with pytest.raises(ConfigError, match="node_id 'n1' differs from the name in tls_cert"):
        Broker(_tls(pki, node_id="n1"))
    with pytest.raises(ConfigError, match="cannot load tls_cert"):
        Broker(_tls(pki, "b_cert", "c_key"))  # key of another certificate


def test_tokens_file(tmp_path: Path, pki: dict[str, Path]) -> None:
    token, path = certs.add_token(tmp_path, "dashboard")
    assert token not in path.read_text()  # only the digest is stored
    assert load_tokens(path) == {certs.token_digest(token)[7:]: "dashboard"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"x": "sha256:abc"}))
    with pytest.raises(ConfigError, match="not sha256: and 64 hex digits"):
        load_tokens(bad)
    guard = Guard(_tls(pki, tokens_file=str(path)), __import__("logging").getLogger("test"))
    assert guard.tls is not None and guard.tls.server.verify_mode == ssl.CERT_OPTIONAL  # tokens: cert optional


def test_credentials_say_what_is_missing(pki: dict[str, Path]) -> None:
    with pytest.raises(CredentialsError, match="no credentials: brokers speak TLS"):
        Credentials.from_env({})
    with pytest.raises(CredentialsError, match="--cert and --key go together"):
        Credentials(ca="ca.pem", cert="c.pem")
    with pytest.raises(CredentialsError, match="TLS needs the cluster CA"):
        Credentials(token="t")
    with pytest.raises(CredentialsError, match="--insecure means plain TCP"):
        Credentials.from_env({"SEDAX_INSECURE": "1", "SEDAX_CA": "ca.pem"})
    with pytest.raises(CredentialsError, match="cannot load the CA certificate"):
        Credentials(ca=str(pki["dir"] / "nope.pem")).ssl_context()
    creds = Credentials.from_env({"SEDAX_CA": str(pki["ca"]), "SEDAX_TOKEN": "t"})
    assert creds.token == "t" and creds.ssl_context() is not None
    assert Credentials.from_env({"SEDAX_INSECURE": "yes"}).ssl_context() is None


def test_a_client_context_follows_renewed_files(tmp_path: Path) -> None:
    # A long-running client reconnects with the files as they are now: a renewal (or a new CA bundle) is taken,
    # an unchanged set of files shares one context.
    certs.init_ca(tmp_path)
    cert, key = certs.issue(tmp_path, "meter-9", "client")
    creds = Credentials(ca=str(tmp_path / "ca.pem"), cert=str(cert), key=str(key))
    first = creds.ssl_context()
    assert creds.ssl_context() is first
    certs.issue(tmp_path, "meter-9", "client", force=True)
    renewed = creds.ssl_context()
    assert renewed is not None and renewed is not first
    assert creds.ssl_context() is renewed
