"""Client credentials: how a client or admin tool checks it talks to a broker and proves who it is.

Brokers speak TLS unless started with ``--insecure``.  A client then needs the cluster CA (to verify the
broker's certificate) and either a client certificate from that CA (`sedax certs issue --role client`) or a
bearer token the broker knows (`sedax certs token`).  Its identity, which topic ACLs name, is the
certificate's common name or the token's name.

Every command-line tool takes ``--ca``, ``--cert``, ``--key``, ``--token``, ``--insecure`` and ``--crl``, each
defaulting to ``SEDAX_CA``, ``SEDAX_CERT``, ``SEDAX_KEY``, ``SEDAX_TOKEN``, ``SEDAX_INSECURE`` and ``SEDAX_CRL``;
`Client` and `AdminClient` read the same variables when no `Credentials` are given.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from net.crl import CrlError, check_crls, serial_of
from overlay.protocol import parse_address

ENV_CA: Final = "SEDAX_CA"
ENV_CERT: Final = "SEDAX_CERT"
ENV_KEY: Final = "SEDAX_KEY"
ENV_TOKEN: Final = "SEDAX_TOKEN"
ENV_INSECURE: Final = "SEDAX_INSECURE"
ENV_CRL: Final = "SEDAX_CRL"

# Certificate roles, carried in the subject's OU: only a "broker" certificate may link brokers, join the
# overlay or serve clients; a "client" certificate identifies a publisher, subscriber or admin tool.
ROLE_BROKER: Final = "broker"
ROLE_CLIENT: Final = "client"

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off", ""})


class CredentialsError(ValueError):
    """Credentials are missing, contradictory or unreadable; the message names the setting and the fix."""


class NotABroker(ConnectionError):
    """The peer's certificate verified but is not a broker certificate (OU=broker)."""


def parse_bool(name: str, text: str) -> bool:
    """A boolean setting written as 1/0, true/false, yes/no or on/off (case-insensitive)."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise CredentialsError(f"{name} must be 1/0, true/false, yes/no or on/off, got {text!r}")


@dataclass(frozen=True, slots=True)
class PeerCert:
    """What a verified certificate says about its holder: the common name (identity) and the OU (role); and
    which certificate it is, its issuer and serial number, which a CRL read later may revoke (net/crl.py)."""

    name: str
    role: str
    issuer: object = None  # as getpeercert() gives it
    serial: int | None = None


def peer_cert(info: object) -> PeerCert | None:
    """The CN and OU of a verified peer certificate (`getpeercert()` / extra info "peercert"), else None."""
    if not isinstance(info, dict):
        return None
    found: dict[str, str] = {}
    for rdn in info.get("subject", ()):
        for key, value in rdn:
            found.setdefault(str(key), str(value))
    name = found.get("commonName")
    if not name:
        return None
    return PeerCert(name, found.get("organizationalUnitName", ""), info.get("issuer"), serial_of(info))


def _changed(path: str | None) -> tuple[int, int] | None:
    """When and how a file last changed (None if it cannot be read: the load then says why)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=64)
def _client_context(
    ca: str, cert: str | None, key: str | None, crl: str | None, versions: tuple[tuple[int, int] | None, ...]
) -> ssl.SSLContext:
    # Loading a CA bundle and a key costs about a millisecond; tools that open many connections (cluster
    # status polling) share one context per set of files.  `versions` (the files' mtimes and inodes) is part of
    # the key so that a long-running client reconnects with renewed files, not the ones it started with.
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsError(f"cannot load the CA certificate {ca!r} (--ca / {ENV_CA}): {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise CredentialsError(
                f"cannot load the client certificate {cert!r} with key {key!r} (--cert/--key): {exc}"
            ) from None
    if crl is not None:
        # As the brokers check theirs (broker/tls.py): a broker whose certificate the CA revoked is not trusted.
        try:
            check_crls(crl, f"--crl/{ENV_CRL}", ca, ctx)
        except CrlError as exc:
            raise CredentialsError(str(exc)) from None
    return ctx


@dataclass(frozen=True, slots=True)
class Credentials:
    """TLS material and/or a token for connecting to brokers; `insecure` means plain TCP.

    Attributes:
        ca: the cluster CA certificate (PEM) that broker certificates are checked against.
        cert, key: a client certificate and its key (PEM), both or neither.
        token: a bearer token, sent in HELLO (inside TLS unless insecure).
        insecure: plain TCP, for brokers started with --insecure.
        crl: the CA's certificate revocation lists (PEM, one per CA of `ca`): a broker whose certificate they
            revoke fails the handshake (docs/security.md, "Revoking a certificate").
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    token: str | None = None
    insecure: bool = False
    crl: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise CredentialsError("--cert and --key go together: give both (or neither and use --token)")
        if self.insecure and (self.ca is not None or self.cert is not None):
            raise CredentialsError(
                "--insecure means plain TCP without TLS: drop --ca/--cert/--key, or drop --insecure "
                f"(is {ENV_INSECURE} set in the environment?)"
            )
        if self.crl is not None and self.ca is None:
            raise CredentialsError(f"--crl ({ENV_CRL}) checks brokers' certificates: it needs TLS and --ca too")
        if not self.insecure and self.ca is None:
            raise CredentialsError(
                f"TLS needs the cluster CA to verify brokers: pass --ca FILE (or set {ENV_CA}), "
                "or --insecure for brokers started with --insecure"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """Credentials from SEDAX_CA, SEDAX_CERT, SEDAX_KEY, SEDAX_TOKEN, SEDAX_INSECURE and SEDAX_CRL."""
        e = os.environ if env is None else env
        return cls.merge(None, None, None, None, None, e)

    @classmethod
    def merge(
        cls,
        ca: str | None,
        cert: str | None,
        key: str | None,
        token: str | None,
        insecure: bool | None,
        env: Mapping[str, str] | None = None,
        crl: str | None = None,
    ) -> Credentials:
        """Explicit values (None = not given) over the environment's, setting by setting."""
        e = os.environ if env is None else env
        if insecure is None:
            insecure = parse_bool(ENV_INSECURE, e.get(ENV_INSECURE, ""))
        ca = ca if ca is not None else e.get(ENV_CA) or None
        cert = cert if cert is not None else e.get(ENV_CERT) or None
        key = key if key is not None else e.get(ENV_KEY) or None
        token = token if token is not None else e.get(ENV_TOKEN) or None
        crl = crl if crl is not None else e.get(ENV_CRL) or None
        if not insecure and ca is None and cert is None and token is None:
            raise CredentialsError(
                "no credentials: brokers speak TLS, so pass --ca with --cert/--key or --token "
                f"(or set {ENV_CA}, {ENV_CERT}, {ENV_KEY}, {ENV_TOKEN}); for brokers started with --insecure "
                f"pass --insecure (or set {ENV_INSECURE}=1)"
            )
        return cls(ca, cert, key, token, insecure, crl)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client-side TLS context (None for insecure); CredentialsError if a file cannot be loaded."""
        if self.insecure or self.ca is None:
            return None
        versions = (_changed(self.ca), _changed(self.cert), _changed(self.key), _changed(self.crl))
        return _client_context(self.ca, self.cert, self.key, self.crl, versions)


def source_address(listen: str) -> str | None:
    """The address a broker listening on `listen` connects to its peers from: the listen address itself when it
    is a specific IP (a broker bound to one address of a multi-homed host talks from it, and firewall rules
    that name a broker's address see all of its traffic); None (the kernel chooses) for a wildcard or a name."""
    try:
        host, _ = parse_address(listen)
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if ip.is_unspecified else str(ip)


def add_credential_flags(parser: argparse.ArgumentParser) -> None:
    """--ca, --cert, --key, --token, --insecure (defaults from SEDAX_CA, ... SEDAX_INSECURE)."""
    g = parser.add_argument_group("credentials (brokers speak TLS unless started with --insecure)")
    g.add_argument("--ca", metavar="FILE", help=f"cluster CA certificate that brokers are verified against (${ENV_CA})")
    g.add_argument("--cert", metavar="FILE", help=f"client certificate, from `sedax certs issue` (${ENV_CERT})")
    g.add_argument("--key", metavar="FILE", help=f"key of the client certificate (${ENV_KEY})")
    g.add_argument("--token", help=f"bearer token instead of a client certificate (${ENV_TOKEN})")
    g.add_argument("--crl", metavar="FILE", help=f"the CA's revocation lists: refuse revoked brokers (${ENV_CRL})")
    g.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help=f"plain TCP, for brokers started with --insecure (${ENV_INSECURE}=1)",
    )


def credentials_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Credentials:
    """Credentials from `add_credential_flags` flags over the environment."""
    return Credentials.merge(
        getattr(args, "ca", None),
        getattr(args, "cert", None),
        getattr(args, "key", None),
        getattr(args, "token", None),
        getattr(args, "insecure", None),
        env,
        getattr(args, "crl", None),
    )
