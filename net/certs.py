"""A development certificate authority built with the `openssl` command line (`sedax certs init|issue|token`).

Layout of a certificate directory:

* ``ca.pem`` / ``ca.key``: the cluster CA (EC P-256, 10 years).  Whoever holds ca.key can mint brokers.
* ``NAME.pem`` / ``NAME.key``: a certificate with subject ``O=SeDAX, OU=ROLE, CN=NAME``.  The CN is the
  holder's identity (a broker's node id, a client's ACL name); the OU its role.  Broker certificates carry
  the subject alternative names IP:127.0.0.1, DNS:localhost and the ``--host`` values (clients verify the
  broker's address against them) and both server and client usage (brokers dial each other); client
  certificates carry client usage only, so they cannot pose as a broker.
* ``crl.pem``: the CA's certificate revocation list (`sedax certs crl`, `sedax certs revoke`), for a broker's
  ``--tls-crl``; ``crl-index.txt`` and ``crl-number`` are the CA's record of what it revoked (`openssl ca`).
* ``tokens.json``: ``{"NAME": "sha256:HEX"}``, bearer tokens for clients without a certificate; only the
  SHA-256 of each token is stored, so the file does not reveal them.

Keys are written 0600.  This is a development CA: a production cluster would use its own PKI, and only
the three file paths (``--tls-cert``, ``--tls-key``, ``--tls-ca``) matter to the broker.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

CA_CERT: Final = "ca.pem"
CA_KEY: Final = "ca.key"
TOKENS_FILE: Final = "tokens.json"
CRL_FILE: Final = "crl.pem"
_CRL_INDEX: Final = "crl-index.txt"
_CRL_NUMBER: Final = "crl-number"
# How long a CRL is valid (its nextUpdate): a broker checking CRLs refuses every peer once that passes, so the CRL
# is written again before then (`sedax certs crl`; every revoke writes one too).
CRL_DAYS: Final = 30
ROLES: Final = ("broker", "client")
CA_DAYS: Final = 3650
# The browser-era limit for leaf certificates; long enough for a development cluster.
LEAF_DAYS: Final = 825
# Names become file names and certificate CNs and must be valid node ids for brokers.
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
_OPENSSL_TIMEOUT: Final = 30.0


class CertError(RuntimeError):
    """Creating a certificate failed; the message says what and what to do."""


def _openssl() -> str:
    path = shutil.which("openssl")
    if path is None:
        raise CertError("the openssl command is not installed: install it (Debian: apt-get install openssl)")
    return path


def _run(args: Sequence[str]) -> None:
    try:
        res = subprocess.run([_openssl(), *args], capture_output=True, text=True, timeout=_OPENSSL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CertError(f"openssl {args[0]} failed: {exc}") from None
    if res.returncode != 0:
        raise CertError(f"openssl {args[0]} failed ({res.returncode}): {res.stderr.strip()[-800:]}")


def check_name(name: str) -> str:
    """Return name if it can be a certificate name (1..64 of [A-Za-z0-9._:-]), else raise CertError."""
    if not _NAME_RE.fullmatch(name) or name in (Path(CA_CERT).stem, Path(TOKENS_FILE).stem):
        raise CertError(f"name must be 1..64 characters of [A-Za-z0-9._:-] and not 'ca' or 'tokens', got {name!r}")
    return name


def ca_paths(directory: str | Path) -> tuple[Path, Path]:
    """(ca.pem, ca.key) of a certificate directory."""
    d = Path(directory)
    return d / CA_CERT, d / CA_KEY


def cert_paths(directory: str | Path, name: str) -> tuple[Path, Path]:
    """(NAME.pem, NAME.key) of a certificate directory."""
    d = Path(directory)
    return d / f"{name}.pem", d / f"{name}.key"


def init_ca(directory: str | Path, *, force: bool = False, days: int = CA_DAYS) -> Path:
    """Create the development CA in directory (made 0700 if new); CertError if one exists and not force."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert, key = ca_paths(d)
    if cert.exists() and not force:
        raise CertError(f"{cert} exists: use it, or pass --force to replace the CA (and re-issue every certificate)")
    _run(
        [
            "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-sha256", "-days", str(days), "-subj", "/O=SeDAX/CN=SeDAX development CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", str(key), "-out", str(cert),
        ]
    )  # fmt: skip
    key.chmod(0o600)
    for stale in (_CRL_INDEX, _CRL_NUMBER, CRL_FILE):  # the old CA's revocations and CRL mean nothing to this one
        (d / stale).unlink(missing_ok=True)
    return cert


def ensure_ca(directory: str | Path) -> Path:
    """The CA certificate of directory, created first if there is none."""
    cert, key = ca_paths(directory)
    if cert.exists() and key.exists():
        return cert
    return init_ca(directory, force=True)


def _san(hosts: Sequence[str]) -> str:
    names: list[str] = []
    for h in ("127.0.0.1", "localhost", *hosts):
        try:
            entry = f"IP:{ipaddress.ip_address(h.strip('[]'))}"
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9.\-*]{1,253}", h):
                raise CertError(f"--host must be an IP address or a DNS name, got {h!r}") from None
            entry = f"DNS:{h}"
        if entry not in names:
            names.append(entry)
    return ",".join(names)


def issue(
    directory: str | Path,
    name: str,
    role: str,
    hosts: Sequence[str] = (),
    *,
    force: bool = False,
    days: int = LEAF_DAYS,
) -> tuple[Path, Path]:
    """Issue NAME.pem/NAME.key signed by the directory's CA; returns (cert, key).

    CertError if there is no CA, the name or role is invalid, or the certificate exists and not force.
    """
    check_name(name)
    if role not in ROLES:
        raise CertError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    ca_cert, ca_key = ca_paths(directory)
    if not (ca_cert.exists() and ca_key.exists()):
        raise CertError(f"no CA in {directory}: run `sedax certs init --dir {directory}` first")
    cert, key = cert_paths(directory, name)
    if cert.exists() and not force:
        raise CertError(f"{cert} exists: use it, or pass --force to issue a new one")
    usage = "serverAuth,clientAuth" if role == "broker" else "clientAuth"
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyAgreement",
        f"extendedKeyUsage={usage}",
        "subjectKeyIdentifier=hash",
        "authorityKeyIdentifier=keyid,issuer",
    ]
    if role == "broker":
        ext.append(f"subjectAltName={_san(hosts)}")
    # Staged inside the target directory: os.replace below must not cross file systems (a Docker volume).
    with tempfile.TemporaryDirectory(prefix=".issue-", dir=directory) as tmp:
        csr = Path(tmp) / "req.csr"
        extfile = Path(tmp) / "ext.cnf"
        extfile.write_text("\n".join(ext) + "\n")
        new_key = Path(tmp) / "new.key"
        new_cert = Path(tmp) / "new.pem"
        _run(
            [
                "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-subj", f"/O=SeDAX/OU={role}/CN={name}", "-keyout", str(new_key), "-out", str(csr),
            ]
        )  # fmt: skip
        _run(
            [
                "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
                "-set_serial", f"0x{secrets.randbits(63):x}", "-days", str(days), "-sha256",
                "-extfile", str(extfile), "-out", str(new_cert),
            ]
        )  # fmt: skip
        new_key.chmod(0o600)
        # Both moved into place only once both exist, so a failed issue leaves the old pair (or none) whole, and
        # a broker that reads them again (SIGHUP, a restart) never finds a half-written certificate.
        os.replace(new_key, key)
        os.replace(new_cert, cert)
    return cert, key


def ensure_issued(directory: str | Path, name: str, role: str, hosts: Sequence[str] = ()) -> tuple[Path, Path]:
    """The certificate NAME of directory, issued first if missing."""
    cert, key = cert_paths(directory, name)
    if cert.exists() and key.exists():
        return cert, key
    return issue(directory, name, role, hosts, force=True)


def _ca_command(directory: Path, args: Sequence[str], days: int) -> None:
    """`openssl ca` on the directory's CA with its revocation record (created empty if new)."""
    ca_cert, ca_key = ca_paths(directory)
    if not (ca_cert.exists() and ca_key.exists()):
        raise CertError(f"no CA in {directory}: run `sedax certs init --dir {directory}` first")
    index, number = directory / _CRL_INDEX, directory / _CRL_NUMBER
    if not index.exists():
        index.touch()
    if not number.exists():
        number.write_text("01\n")
    with tempfile.TemporaryDirectory(prefix=".ca-", dir=directory) as tmp:
        conf = Path(tmp) / "ca.cnf"
        conf.write_text(
            f"[ca]\ndefault_ca = dev\n[dev]\ndatabase = {index}\ncrlnumber = {number}\ndefault_md = sha256\n"
            f"default_crl_days = {days}\nunique_subject = no\n"
        )
        _run(["ca", "-batch", "-config", str(conf), "-cert", str(ca_cert), "-keyfile", str(ca_key), *args])


def write_crl(directory: str | Path, *, days: int = CRL_DAYS) -> Path:
    """Write DIR/crl.pem: the CA's CRL of every certificate revoked so far (none: an empty one), valid for days.
    Written whole before it replaces the old one, so a broker reading it (SIGHUP) never finds half of it."""
    d = Path(directory)
    out = d / CRL_FILE
    staged = d / f".{CRL_FILE}.new"
    _ca_command(d, ["-gencrl", "-out", str(staged)], days)
    os.replace(staged, out)
    return out


def revoke(directory: str | Path, name: str, *, days: int = CRL_DAYS) -> Path:
    """Revoke the certificate NAME.pem of directory and write the CRL again; returns crl.pem.  A certificate
    revoked already is left so (the CRL is written again all the same)."""
    check_name(name)
    cert, _ = cert_paths(directory, name)
    if not cert.exists():
        raise CertError(f"{cert} does not exist: nothing to revoke (the names issued are DIR/NAME.pem)")
    try:
        _ca_command(Path(directory), ["-revoke", str(cert)], days)
    except CertError as exc:
        if "Already revoked" not in str(exc):
            raise
    return write_crl(directory, days=days)


def token_digest(token: str) -> str:
    """How a token is stored in tokens.json: "sha256:" and the hex digest of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def add_token(directory: str | Path, name: str) -> tuple[str, Path]:
    """Create a random token for name, store its digest in DIR/tokens.json (replacing name's old one).

    Returns (token, tokens file).  The token itself is not stored anywhere: print it once.
    """
    check_name(name)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / TOKENS_FILE
    entries: dict[str, str] = {}
    if path.exists():
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CertError(f"{path} is not readable JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise CertError(f"{path} must hold a JSON object of name: digest")
        entries = {str(k): str(v) for k, v in loaded.items()}
    token = secrets.token_urlsafe(32)
    entries[name] = token_digest(token)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    tmp.chmod(0o600)
    os.replace(tmp, path)
    return token, path
