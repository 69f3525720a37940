"""Certificate revocation lists (X.509 CRLs, RFC 5280 section 5) read from a PEM file: who issued each, the
serial numbers it revokes and when it must be replaced.

OpenSSL checks a peer against the CRLs at each handshake, once `check_crls` has loaded the file into a context
(a broker's, broker/tls.py, and a client's, net/credentials.py).  What it cannot do is look again at a
connection made before a certificate was revoked: a broker reading a new CRL (SIGHUP) finds those here, by the
issuer and serial number of each connected peer's certificate, and cuts them off (broker/guard.py).
`check_crls` also refuses a file that lacks the CRL of a CA of the bundle or holds one past its nextUpdate
(OpenSSL would refuse every certificate of that CA, or every peer), and the broker warns before a nextUpdate
passes.  Only the fields needed for that are decoded; OpenSSL verifies the CRLs' signatures when it uses them.
The issuer is given as `ssl.SSLSocket.getpeercert()` gives a certificate's issuer, so the two compare as they
are.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import re
import ssl
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final, TypeAlias

# A distinguished name as getpeercert() gives it: its RDNs in order, each a tuple of (attribute, value).
Name: TypeAlias = tuple[tuple[tuple[str, str], ...], ...]

_PEM: Final = re.compile(rb"-----BEGIN X509 CRL-----(.+?)-----END X509 CRL-----", re.DOTALL)
_CERTIFICATE: Final = re.compile(rb"-----BEGIN [A-Z0-9 ]*CERTIFICATE-----")

# OpenSSL's long names of the attributes a certificate name holds (what getpeercert() reports); others are
# given by their dotted OID, as OpenSSL gives one it has no name for.
_ATTRIBUTES: Final = {
    "2.5.4.3": "commonName",
    "2.5.4.4": "surname",
    "2.5.4.5": "serialNumber",
    "2.5.4.6": "countryName",
    "2.5.4.7": "localityName",
    "2.5.4.8": "stateOrProvinceName",
    "2.5.4.9": "streetAddress",
    "2.5.4.10": "organizationName",
    "2.5.4.11": "organizationalUnitName",
    "2.5.4.12": "title",
    "2.5.4.17": "postalCode",
    "2.5.4.42": "givenName",
    "2.5.4.46": "dnQualifier",
    "2.5.4.97": "organizationIdentifier",
    "1.2.840.113549.1.9.1": "emailAddress",
    "0.9.2342.19200300.100.1.1": "userId",
    "0.9.2342.19200300.100.1.25": "domainComponent",
}
# ASN.1 string types -> how their bytes decode.
_STRINGS: Final = {
    0x0C: "utf-8",  # UTF8String
    0x13: "ascii",  # PrintableString
    0x16: "ascii",  # IA5String
    0x14: "latin-1",  # TeletexString (as OpenSSL reads it)
    0x1E: "utf-16-be",  # BMPString
    0x1C: "utf-32-be",  # UniversalString
}
_SEQUENCE, _SET, _INTEGER, _OID, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0x31, 0x02, 0x06, 0x17, 0x18


class CrlError(ValueError):
    """A CRL file that cannot be used; the message names the file and what to do."""


@dataclass(frozen=True, slots=True)
class RevocationList:
    """One CRL: its issuer, the serial numbers it revokes, when it was issued and when the next is due."""

    issuer: Name
    serials: frozenset[int]
    this_update: float  # Unix time
    next_update: float | None  # Unix time; None: the CRL names none (OpenSSL then never takes it for expired)

    def revokes(self, issuer: object, serial: int) -> bool:
        """Whether this CRL revokes the certificate of that issuer (as getpeercert() gives it) and serial."""
        return serial in self.serials and _as_name(issuer) == self.issuer


def _as_name(value: object) -> Name | None:
    """getpeercert()'s issuer as a Name (tuples all through), None if it is not one."""
    if not isinstance(value, tuple | list):
        return None
    try:
        return tuple(tuple((str(k), str(v)) for k, v in rdn) for rdn in value)
    except (TypeError, ValueError):
        return None


def load_crls(path: str, setting: str = "tls_crl") -> tuple[RevocationList, ...]:
    """The CRLs of a PEM file (one or more `-----BEGIN X509 CRL-----` blocks); CrlError says what is wrong, naming
    the file as the setting that gave it."""
    what = f"{setting}={path!r}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CrlError(f"cannot read {what}: {exc.strerror or exc}") from None
    if _CERTIFICATE.search(data):
        raise CrlError(
            f"{what} holds a certificate too: only CRLs belong there (OpenSSL would trust a certificate there as a "
            "CA); keep CA certificates in the CA file"
        )
    blocks = _PEM.findall(data)
    if not blocks:
        raise CrlError(
            f"{what} holds no PEM CRL (-----BEGIN X509 CRL-----): give the CRL of each CA (sedax certs crl, or your "
            "CA; a DER file converts with `openssl crl -inform DER -in F -out F.pem`)"
        )
    out = []
    for i, block in enumerate(blocks):
        try:
            out.append(parse_crl(base64.b64decode(block, validate=False)))
        except (binascii.Error, ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CrlError(f"{what}: CRL {i + 1} of {len(blocks)} cannot be read: {exc}") from None
    return tuple(out)


def parse_crl(der: bytes) -> RevocationList:
    """One DER-encoded CRL; ValueError (or IndexError) if it is not one."""
    tag, start, _ = _tlv(der, 0)
    _expect(tag, _SEQUENCE, "CertificateList")
    tag, pos, tbs_end = _tlv(der, start)
    _expect(tag, _SEQUENCE, "TBSCertList")
    tag, _, after = _tlv(der, pos)
    if tag == _INTEGER:  # version (v2), optional
        pos = after
        tag, _, after = _tlv(der, pos)
    _expect(tag, _SEQUENCE, "signature algorithm")
    pos = after
    tag, name_start, name_end = _tlv(der, pos)
    _expect(tag, _SEQUENCE, "issuer")
    issuer = _name(der, name_start, name_end)
    pos = name_end
    tag, t_start, t_end = _tlv(der, pos)
    this_update = _time(tag, der[t_start:t_end])
    pos = t_end
    next_update: float | None = None
    serials: set[int] = set()
    if pos < tbs_end:
        tag, t_start, t_end = _tlv(der, pos)
        if tag in (_UTC_TIME, _GENERALIZED_TIME):
            next_update = _time(tag, der[t_start:t_end])
            pos = t_end
    if pos < tbs_end:
        tag, r_start, r_end = _tlv(der, pos)
        if tag == _SEQUENCE:  # revokedCertificates: SEQUENCE OF SEQUENCE {serial, date, extensions?}
            for e_start, _ in _items(der, r_start, r_end, _SEQUENCE, "revoked certificate"):
                tag, s_start, s_end = _tlv(der, e_start)
                _expect(tag, _INTEGER, "revoked serial number")
                serials.add(int.from_bytes(der[s_start:s_end], "big", signed=True))
    return RevocationList(issuer, frozenset(serials), this_update, next_update)


def uncovered(cas: Iterable[object], crls: Iterable[RevocationList]) -> list[str]:
    """The CAs (getpeercert()-style dicts, as SSLContext.get_ca_certs() gives them) that have no CRL among crls,
    each named by its common name (or whole subject): OpenSSL, checking CRLs, refuses every certificate they
    issued.  A CRL names its CA by the CA's name only, so CAs of one name (a CA and its replacement) need as many
    CRLs of that name: one CRL would be the CRL of one of them, and the other's certificates refused."""
    have = Counter(crl.issuer for crl in crls)
    need: Counter[Name] = Counter()
    for ca in cas:
        subject = _as_name(ca.get("subject")) if isinstance(ca, dict) else None
        if subject is not None:
            need[subject] += 1
    out = []
    for subject, n in need.items():
        if have[subject] < n:
            names = dict(kv for rdn in subject for kv in rdn)
            out.append(names.get("commonName") or repr(subject))
    return out


def check_crls(path: str, setting: str, ca: str, *contexts: ssl.SSLContext) -> tuple[RevocationList, ...]:
    """Make the contexts (loaded with the CAs of the file ca) check every peer's certificate against the CRLs of
    the file at path, given by `setting` (leaf certificates, each against the CRL of its CA); returns the CRLs,
    read once (100,000 revoked serials: ~0.2 s here, OpenSSL's own load of them ~0.06 s per context).  CrlError
    where OpenSSL would refuse every peer with them: a CA without a CRL, or a CRL past its nextUpdate."""
    crls = load_crls(path, setting)
    missing = uncovered(contexts[0].get_ca_certs(), crls) if contexts else []
    if missing:
        raise CrlError(
            f"{setting}={path!r} holds no CRL of the CA {', '.join(map(repr, missing))} of {ca!r}: every certificate "
            "it issued would be refused; add its CRL to the file (sedax certs crl, or that CA), or drop the CA from "
            f"{ca!r}"
        )
    now = time.time()
    for c in crls:
        if c.next_update is not None and c.next_update <= now:
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(c.next_update))
            raise CrlError(
                f"{setting}={path!r}: a CRL was due for renewal at {when} (its nextUpdate) and every peer would be "
                "refused with it: write a fresh one (sedax certs crl, or your CA)"
            )
    for ctx in contexts:
        try:
            ctx.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise CrlError(f"cannot load {setting}={path!r}: {exc}") from None
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return crls


def serial_of(cert: object) -> int | None:
    """The serial number of a getpeercert() dict ("serialNumber", hex), None if it has none."""
    if not isinstance(cert, dict):
        return None
    try:
        return int(str(cert["serialNumber"]), 16)
    except (KeyError, ValueError):
        return None


# ---- DER ------------------------------------------------------------------------------------------------


def _tlv(der: bytes, pos: int) -> tuple[int, int, int]:
    """The tag at pos, where its value starts and where it ends (definite lengths only, as DER has)."""
    tag = der[pos]
    if tag & 0x1F == 0x1F:
        raise ValueError(f"unexpected high tag number at byte {pos}")
    first = der[pos + 1]
    pos += 2
    if first < 0x80:
        length = first
    else:
        n = first & 0x7F
        if not 1 <= n <= 4:
            raise ValueError(f"unsupported length form at byte {pos - 1}")
        length = int.from_bytes(der[pos : pos + n], "big")
        pos += n
    end = pos + length
    if end > len(der):
        raise ValueError("truncated")
    return tag, pos, end


def _expect(tag: int, want: int, what: str) -> None:
    if tag != want:
        raise ValueError(f"{what}: expected tag 0x{want:02x}, found 0x{tag:02x}")


def _items(der: bytes, pos: int, end: int, tag: int, what: str) -> Iterator[tuple[int, int]]:
    """Where the value of each element between pos and end starts and ends, each element expected to be a tag."""
    while pos < end:
        found, start, stop = _tlv(der, pos)
        _expect(found, tag, what)
        yield start, stop
        pos = stop


def _name(der: bytes, pos: int, end: int) -> Name:
    """A Name: a SEQUENCE of RDNs (SETs) of attributes (SEQUENCE {type, value})."""
    return tuple(
        tuple(_attribute(der, a) for a, _ in _items(der, start, stop, _SEQUENCE, "attribute"))
        for start, stop in _items(der, pos, end, _SET, "relative distinguished name")
    )


def _attribute(der: bytes, pos: int) -> tuple[str, str]:
    tag, o_start, o_end = _tlv(der, pos)
    _expect(tag, _OID, "attribute type")
    oid = _oid(der[o_start:o_end])
    tag, x_start, x_end = _tlv(der, o_end)
    encoding = _STRINGS.get(tag)
    value = der[x_start:x_end].decode(encoding) if encoding else der[x_start:x_end].hex()
    return _ATTRIBUTES.get(oid, oid), value


def _oid(body: bytes) -> str:
    if not body:
        raise ValueError("empty object identifier")
    arcs = [min(body[0] // 40, 2)]
    arcs.append(body[0] - 40 * arcs[0])
    value = 0
    for b in body[1:]:
        value = (value << 7) | (b & 0x7F)
        if not b & 0x80:
            arcs.append(value)
            value = 0
    return ".".join(map(str, arcs))


def _time(tag: int, body: bytes) -> float:
    text = body.decode("ascii")
    if not text.endswith("Z"):
        raise ValueError(f"time {text!r} is not in UTC (Z)")
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: YY below 50 is 20YY
        year = int(text[:2])
        text = f"{2000 + year if year < 50 else 1900 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"expected a time, found tag 0x{tag:02x}")
    fields = (int(text[0:4]), int(text[4:6]), int(text[6:8]), int(text[8:10]), int(text[10:12]), int(text[12:14]))
    return float(calendar.timegm((*fields, 0, 0, 0)))
