"""Who may do what on a broker, and how much: authentication at HELLO, limits, forged-frame checks.

* Authentication (at HELLO).  A broker link needs a broker certificate of the cluster CA whose CN is the
  peer's node id (TLS).  A client or admin presents a certificate of the CA (identity = CN) or a token from
  the tokens file (identity = the token's name).  On an --insecure broker without tokens every client is
  "anonymous".  Refusals say what was missing: REFUSE unauthenticated / not_allowed / too_many_connections.
* Routed frames are accepted only from broker links (and, with TLS, from tools holding a broker
  certificate; on an --insecure broker from anyone, as before TLS existed).  A routed frame that no honest
  broker would send is dropped and counted: a destination outside the space, a hop limit above this
  broker's max_hops, or a sender that is not farther from the destination than this broker (greedy
  forwarding only ever moves closer, so that is a loop or a forgery).  Framing-level lies (NaN
  coordinates, hops >= hop limit) already close the link in the codec, counted as protocol_errors.
* Limits per client: a token bucket on publishes (NACK rate_limited), a payload bound (NACK too_large),
  a bounded send queue (broker/link.py: slow consumers are dropped or throttled, never waited for), an
  idle timeout, and at most max_connections client connections.
* ACLs (broker/acl.py) at the access broker; the topic's holder checks again (broker/pubsub/holder.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from broker.acl import Acl, load_acl, refusal
from broker.config import BrokerConfig, ConfigError, changed_settings, reload_problem
from broker.link import NOISY_CLOSES, CloseReason, PeerLink
from broker.tls import BrokerTls, load_broker_tls
from net.credentials import ROLE_BROKER, PeerCert
from net.crl import RevocationList
from overlay.protocol import (
    MAX_LINK_FRAME_SIZE,
    MAX_TOKEN_LEN,
    Hello,
    Join,
    Message,
    NodeInfo,
    Refuse,
    RefuseCode,
    RoutedFrame,
)
from overlay.pubsub import Nack, Publish

ANONYMOUS: Final = "anonymous"
# Connections beyond max_connections that may still be accepted so that broker links (which do not
# count against the limit) and the clients to be refused with a reason get through; past this the
# socket is closed at once.
ACCEPT_HEADROOM: Final = 64
# Forged-frame drops are logged once per this many (a flood must not flood the log).
DROP_LOG_EVERY: Final = 1000
# The idle sweep runs at most this often (and at least four times per idle timeout).
SWEEP_INTERVAL: Final = 1.0
# Client connections' closes are summarised once per window; within one, at most CLOSE_LOG_FIRST of those
# the broker caused (misbehaviour, idle time-out) are logged one by one (CloseLog).
CLOSE_LOG_WINDOW: Final = 60.0
CLOSE_LOG_FIRST: Final = 50

# A certificate that expires while the broker runs makes every new link and client fail its handshake.  The log
# warns from this long before (at start, at each reload, then once a day); the metrics show the date.
EXPIRY_WARNING: Final = 30 * 86400.0
EXPIRY_WARN_EVERY: Final = 86400.0
# A CRL past its nextUpdate makes every new link and client fail its handshake too.  CRLs are short-lived (a CA
# writes one every day or week), so the warning starts later: from this long before.
CRL_WARNING: Final = 3 * 86400.0

# The security and limit counters, by their one name (STATUS, the metrics log's snapshots, and the metrics
# endpoint as sedax_<name>_total) with the help text the metrics endpoint gives them.
COUNTERS: Final[Mapping[str, str]] = {
    "tls_handshake_failures": "Connections whose TLS handshake failed (no or an untrusted certificate, an expired "
    "one, not TLS at all).",
    "refused_at_accept": "Connections closed at accept, before a handshake: more than --max-connections plus "
    "headroom were open or handshaking.",
    "refused_unauthenticated": "HELLOs refused unauthenticated: no certificate of the cluster CA and no valid token.",
    "refused_not_allowed": "HELLOs and JOINs refused not_allowed: a certificate that does not entitle its holder "
    "to the role or node it claimed.",
    "refused_too_many_connections": "Clients refused too_many_connections (--max-connections).",
    "protocol_errors": "Connections closed for a protocol error (a malformed or impossible frame).",
    "routed_from_non_broker": "Routed frames dropped because a client or admin connection sent them.",
    "forged_outside_space": "Routed frames dropped: a destination outside the coordinate space.",
    "forged_hop_limit": "Routed frames dropped: a hop limit above this broker's --max-hops.",
    "forged_loop": "Routed frames dropped: a sender closer to the destination than this broker (a loop or a "
    "forgery; greedy forwarding only moves closer).",
    "rate_limited": "PUBLISH frames refused rate_limited (--publish-rate, --publish-burst per client identity).",
    "too_large": "PUBLISH frames refused too_large (--max-payload).",
    "acl_denied_access": "Requests the ACL denied at the access broker (FAILED or NACK not_allowed).",
    "acl_denied_holder": "Requests the ACL denied at the topic's holder (checked again there).",
    "slow_consumers": "Client connections closed because they read too slowly (--slow-consumer-policy disconnect).",
    "slow_consumer_drops": "Frames dropped for slow readers (--slow-consumer-policy drop).",
    "idle_closed": "Client connections closed after --idle-timeout without a request.",
    "reloads": "Reloads (SIGHUP) that took effect.",
    "reload_failures": "Reloads (SIGHUP) refused whole: an unreadable or invalid file, or a setting that needs a "
    "restart; the broker's log has the reason.",
}


class TokenBucket:
    """`rate` tokens per second up to `burst`; `take()` spends some if there are enough."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float, n: int = 1) -> bool:
        """Spend n tokens; False if there are not enough.

        A batch larger than the burst passes once the bucket is full and leaves it in debt, so the average
        rate holds whatever the batch size.
        """
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= min(n, self.burst):
            self.tokens -= n
            return True
        return False


def load_tokens(path: str | Path) -> dict[str, str]:
    """{sha256 hex digest: name} from a tokens file ({"NAME": "sha256:HEX"} or {"NAME": "plain token"})."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read the tokens file {p} (--tokens): {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f'tokens file {p} must be a non-empty JSON object {{"NAME": "sha256:HEX"}}')
    out: dict[str, str] = {}
    for name, value in data.items():
        if not isinstance(value, str) or not value or len(value) > MAX_TOKEN_LEN + 7:
            raise ConfigError(f"tokens file {p}: the entry for {name!r} must be a token or 'sha256:HEX'")
        if value.startswith("sha256:"):
            digest = value[7:].lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError(f"tokens file {p}: the entry for {name!r} is not sha256: and 64 hex digits")
        else:
            digest = hashlib.sha256(value.encode()).hexdigest()
        out[digest] = str(name)
    return out


class CloseLog:
    """How the closes of client, admin and never-introduced connections reach the log.

    A line per close (as broker links get) let 10k connections write 1.7 MB of log: a connection flood
    must not fill the disk.  So an ordinary close (the client left) is a DEBUG line; a close the broker
    caused (misbehaviour, a time-out) is a WARNING or INFO line, the first `first` of a window; and every
    window in which connections closed ends with one INFO summary by reason, once `tick` sees it is over.
    """

    def __init__(self, log: logging.Logger, window: float = CLOSE_LOG_WINDOW, first: int = CLOSE_LOG_FIRST) -> None:
        self.log = log
        self.window = window
        self.first = first
        self._since: float | None = None  # the first close of the current window
        self._reasons: Counter[str] = Counter()
        self._shown = 0  # closes of this window logged one by one above DEBUG
        self._hidden = 0  # ... and those that would have been, past `first`

    def closed(self, what: str, reason: CloseReason, detail: str, now: float) -> None:
        """A connection (described by `what`) closed for `reason`."""
        if self._since is None:
            self._since = now
        self._reasons[reason.value] += 1
        level = logging.DEBUG
        if reason in NOISY_CLOSES or reason is CloseReason.IDLE_TIMEOUT:
            if self._shown < self.first:
                self._shown += 1
                level = logging.WARNING if reason in NOISY_CLOSES else logging.INFO
            else:
                self._hidden += 1
        self.log.log(level, "closed %s: reason=%s%s", what, reason.value, f" ({detail})" if detail else "")

    def tick(self, now: float) -> None:
        """Log the summary of a window that is over (nothing if no connection closed)."""
        if self._since is None or now - self._since < self.window:
            return
        reasons = ", ".join(f"{r} {n}" for r, n in self._reasons.most_common())
        hidden = f"; {self._hidden} not logged one by one" if self._hidden else ""
        self.log.info(
            "%d client connections closed in the last %.0f s (%s%s)",
            self._reasons.total(), now - self._since, reasons, hidden,
        )  # fmt: skip
        self._since = None
        self._reasons.clear()
        self._shown = self._hidden = 0


@dataclass(frozen=True, slots=True)
class Reloaded:
    """What a reload read again (`files`) and changed (`settings`), for the log, and the connections it no
    longer admits, with why."""

    files: tuple[str, ...]
    revoked: tuple[tuple[PeerLink, str], ...]
    settings: tuple[str, ...] = ()  # the settings that changed, "name old -> new"
    subscriptions_ended: int = 0  # local subscriptions the new ACL denies (filled in by the broker)


def _revoked(crls: Iterable[RevocationList], issuer: object, serial: int) -> bool:
    return any(x.revokes(issuer, serial) for x in crls)


class Guard:
    """The security and limit decisions of one broker (see the module docstring)."""

    def __init__(self, config: BrokerConfig, log: logging.Logger) -> None:
        self.config = config
        self.log = log
        if not config.tls and not config.insecure:
            raise ConfigError(
                "TLS is required: pass --tls-cert, --tls-key and --tls-ca (create them with `sedax certs init "
                "--dir DIR` and `sedax certs issue --dir DIR --name NODE_ID --role broker`), or --insecure for "
                "plain TCP on a trusted network"
            )
        self.tokens = load_tokens(config.tokens_file) if config.tokens_file else None
        self.tls: BrokerTls | None = (
            load_broker_tls(config, require_client_cert=self.tokens is None) if config.tls else None
        )
        if self.tls is not None and config.node_id is not None and config.node_id != self.tls.name:
            raise ConfigError(
                f"node_id {config.node_id!r} differs from the name in tls_cert ({self.tls.name!r}): brokers accept "
                "a peer only under the name its certificate gives; drop --node-id or issue a certificate for it"
            )
        self.acl: Acl | None = load_acl(config.acl_file) if config.acl_file else None
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._buckets: dict[str, TokenBucket] = {}
        s = config.space
        self._bounds = (s.xmin, s.xmax, s.ymin, s.ymax)
        self._next_sweep = 0.0
        self.closes = CloseLog(log)
        self._expiry_warned = -math.inf
        # False from a refused reload until one takes effect: the broker runs on files its operator replaced.
        self.last_reload_ok = True

    @property
    def name(self) -> str | None:
        """The node id this broker's certificate gives it (None without TLS)."""
        return self.tls.name if self.tls is not None else None

    @property
    def certificate_expires(self) -> float:
        """When the certificate or its CA expires first (notAfter, Unix time); 0.0 without TLS."""
        return self.tls.expires if self.tls is not None else 0.0

    @property
    def crl_next_update(self) -> float:
        """When the first CRL of tls_crl is due (nextUpdate, Unix time); 0.0 without one."""
        return self.tls.crl_next_update if self.tls is not None else 0.0

    # ------------------------------------------------------------------------------------- admission

    def may_accept(self, links: int, handshaking: int) -> bool:
        """A new TCP connection may start its handshake (else it is closed at once and counted)."""
        return links + handshaking < self.config.max_connections + ACCEPT_HEADROOM

    def admit(self, link: PeerLink, hello: Hello, clients: int) -> Refuse | None:
        """Authenticate an inbound HELLO and set the link's identity and limits; a Refuse says why not.

        `clients` is the number of client and admin connections already established.
        """
        cert = link.cert
        if hello.role == "broker":
            if self.tls is not None:
                if cert is None or cert.role != ROLE_BROKER:
                    return self._refuse(
                        "not_allowed",
                        f"a broker link needs a broker certificate (OU=broker) of the cluster CA; "
                        f"{hello.node} presented {_describe(cert)}",
                    )
                if cert.name != hello.node:
                    return self._refuse(
                        "not_allowed", f"node id {hello.node} is not the name in its certificate ({cert.name})"
                    )
            link.identity = hello.node
            link.may_route = True
            link.limit_frames(MAX_LINK_FRAME_SIZE)  # a topic's meta beside a publish of up to MAX_PAYLOAD_SIZE
            return None
        if clients >= self.config.max_connections:
            self.counters["refused_too_many_connections"] += 1
            return Refuse(
                "too_many_connections",
                f"this broker serves at most {self.config.max_connections} client connections (--max-connections); "
                "try another broker of the overlay",
            )
        if cert is not None:
            link.identity = cert.name
            link.may_route = cert.role == ROLE_BROKER
        elif hello.token:
            if self.tokens is None:
                return self._refuse(
                    "unauthenticated", "this broker has no tokens file (--tokens): present a client certificate"
                )
            digest = hashlib.sha256(hello.token.encode()).hexdigest()
            name = self._token_name(digest)
            if name is None:
                return self._refuse("unauthenticated", "the token is not valid on this broker")
            link.identity = name
            link.token = digest
        elif self.tls is not None or self.tokens is not None:
            return self._refuse(
                "unauthenticated",
                "present a client certificate of the cluster CA (sedax certs issue --role client) or a token (--token)",
            )
        else:
            # --insecure without tokens: a trusted network, as before TLS existed (tools may inject routed
            # frames, e.g. the overlay benchmark).
            link.identity = ANONYMOUS
            link.may_route = True
        c = self.config
        link.send_limit = c.client_send_buffer
        link.drop_when_full = c.slow_consumer_policy == "drop"
        link.limit_frames(c.max_frame_size)
        return None

    def _refuse(self, code: RefuseCode, text: str) -> Refuse:
        key = "refused_unauthenticated" if code == "unauthenticated" else "refused_not_allowed"
        self.counters[key] += 1
        return Refuse(code, text)

    def _token_name(self, digest: str) -> str | None:
        assert self.tokens is not None
        # Constant-time over the entries, so response timing says nothing about how close a guess was.
        found = None
        for known, name in self.tokens.items():
            if hmac.compare_digest(known, digest):
                found = name
        return found

    def may_join(self, link: PeerLink, join: Join) -> Refuse | None:
        """A JOIN from a client link: with TLS only the holder of the joining node's broker certificate."""
        if self.tls is None:
            return None
        cert = link.cert
        if cert is None or cert.role != ROLE_BROKER or cert.name != join.node.id:
            self.counters["refused_not_allowed"] += 1
            return Refuse(
                "not_allowed",
                f"joining as {join.node.id} needs that node's broker certificate (OU=broker, CN={join.node.id}); "
                f"this connection presented {_describe(cert)}",
                join.corr,
            )
        return None

    @property
    def dial_context(self) -> ssl.SSLContext | None:
        """The TLS context for dialling brokers (None on an --insecure broker)."""
        return self.tls.dial if self.tls is not None else None

    def dialled_peer_problem(self, cert: PeerCert | None, node_id: str) -> str | None:
        """Why a broker we dialled as node_id is not that node (its certificate names another one)."""
        if self.tls is None:
            return None
        if cert is None or cert.role != ROLE_BROKER or cert.name != node_id:
            return f"{node_id} answered with {_describe(cert)}"
        return None

    # ------------------------------------------------------------------------------------- requests

    def check_request(self, link: PeerLink, msg: Message) -> Message | None:
        """Limits and ACL for a client's pub/sub request at its access broker: the refusal, or None."""
        c = self.config
        if isinstance(msg, Publish):
            if (i := msg.oversized(c.max_payload)) is not None:
                # The first message over the limit is refused; those before it in a batch go out again with
                # the publisher's next re-send, those after it follow the gap (Publish.base).
                self.counters["too_large"] += 1
                return Nack(
                    msg.topic,
                    msg.publisher,
                    msg.seq + i,
                    "too_large",
                    f"payload of {len(msg.payloads()[i])} bytes is over this broker's limit of {c.max_payload} "
                    "(--max-payload)",
                )
            if c.publish_rate > 0 and not self._bucket(link).take(time.monotonic(), msg.count):
                self.counters["rate_limited"] += 1
                return Nack(
                    msg.topic,
                    msg.publisher,
                    msg.seq,
                    "rate_limited",
                    f"over {c.publish_rate:g} publishes/s for {link.identity or ANONYMOUS} (--publish-rate); "
                    "send it again later",
                )
        if self.acl is not None:
            denied = refusal(self.acl, link.identity, msg, "access")
            if denied is not None:
                return denied
        return None

    def _bucket(self, link: PeerLink) -> TokenBucket:
        # Per identity, so a client cannot multiply its rate with more connections; anonymous clients of an
        # --insecure broker are told apart by connection.
        key = link.identity if link.identity and link.identity != ANONYMOUS else f"#{link.number}"
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(
                self.config.publish_rate, self.config.publish_burst, time.monotonic()
            )
        return bucket

    # ---------------------------------------------------------------------------------------- reload

    def reload(self, links: Iterable[PeerLink], config: BrokerConfig) -> Reloaded:
        """Read the TLS files, the tokens file and the ACL file again (SIGHUP), as nats-server and Mosquitto do.

        The configuration and all three files are read and checked before any is taken, so a ConfigError (a
        setting that takes a restart, a file missing, a key that is not the certificate's, a bad rule) leaves the
        broker with what it had.  New connections get the new certificate; links made before keep their TLS
        session, as a restart would not.  What the new files no longer admit is returned to be closed: client and
        admin connections whose token was withdrawn or now names someone else, and, when a CA certificate left the
        bundle, every client and admin connection made with a certificate (it may have been verified by that CA;
        a valid one connects again at once); and every connection, a broker link too, whose certificate tls_crl
        now revokes.  Broker links are otherwise kept: closing them all would make the overlay heal around a
        broker that is well.

        `config`, the configuration read again (or the one it runs with), may change what config.RELOADABLE
        names (the files' paths, the per-client limits, which apply from then on); anything else is refused whole.
        """
        c = config
        if (problem := reload_problem(self.config, c)) is not None:
            raise ConfigError(problem)
        tokens = load_tokens(c.tokens_file) if c.tokens_file else None
        tls = load_broker_tls(c, require_client_cert=tokens is None) if c.tls else None
        if tls is not None and self.tls is not None and tls.name != self.tls.name:
            raise ConfigError(
                f"tls_cert={c.tls_cert!r} now names {tls.name!r}, but this broker is {self.tls.name!r}: a broker "
                f"keeps its name while it runs; issue the new certificate for {self.tls.name!r} (sedax certs "
                "issue --name) or restart the broker under the new name"
            )
        acl = load_acl(c.acl_file) if c.acl_file else None
        if (c.publish_rate, c.publish_burst) != (self.config.publish_rate, self.config.publish_burst):
            self._buckets.clear()  # each identity's next publish starts a bucket of the new rate, full
        settings = tuple(
            f"{n} {getattr(self.config, n)!r} -> {getattr(c, n)!r}" for n in changed_settings(self.config, c)
        )
        self.config = c
        files: list[str] = []
        ca_removed = False
        if tls is not None and self.tls is not None:
            before = self.tls.server.get_ca_certs(binary_form=True)
            ca_removed = not set(before) <= set(tls.server.get_ca_certs(binary_form=True))
            self.tls = tls
            files.append(f"the TLS certificate {c.tls_cert}, its key and CA {c.tls_ca}")
        if tokens is not None:
            self.tokens = tokens
            files.append(f"{len(tokens)} tokens from {c.tokens_file}")
        if acl is not None and self.acl is not None:
            self.acl.replace(acl)
            files.append(f"{len(acl.rules)} ACL rules from {c.acl_file}")
        revoked: list[tuple[PeerLink, str]] = []
        crls = self.tls.crls if self.tls is not None else ()
        if c.tls_crl is not None and self.tls is not None:
            files.append(f"{len(crls)} CRLs revoking {sum(len(x.serials) for x in crls)} certificates from {c.tls_crl}")
        for link in links:
            cert = link.cert
            serial = cert.serial if cert is not None else None
            # (established or not: a link still at HELLO passed its TLS handshake before this CRL too)
            if cert is not None and serial is not None and _revoked(crls, cert.issuer, serial):
                revoked.append((link, f"the certificate of {link.role} {cert.name!r} is revoked in {c.tls_crl}"))
                continue
            if link.role not in ("client", "admin") or link.outbound or not link.established:
                continue
            if link.token and (self.tokens is None or self.tokens.get(link.token) != link.identity):
                revoked.append((link, f"the token of {link.identity!r} is no longer in {c.tokens_file} as theirs"))
            elif ca_removed and link.cert is not None:
                revoked.append((link, f"a CA certificate left {c.tls_ca}: connect again to be verified anew"))
        self._expiry_warned = -math.inf  # a certificate renewed too little is said at once
        return Reloaded(tuple(files), tuple(revoked), settings)

    def check_expiry(self, wall: float) -> None:
        """Warn, at most once per EXPIRY_WARN_EVERY, while the certificate (or its CA) expires within EXPIRY_WARNING
        or a CRL is due within CRL_WARNING."""
        if self.tls is None or wall < self._expiry_warned + EXPIRY_WARN_EVERY:
            return
        due = self.tls.crl_next_update
        if due and due - wall <= CRL_WARNING:
            self._expiry_warned = wall
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(due))
            state = (
                f"is due in {(due - wall) / 3600:.1f} h" if due > wall else f"was due {(wall - due) / 3600:.1f} h ago"
            )
            self.log.warning(
                "a CRL of %s %s (%s, its nextUpdate): past it every new link and client fails its handshake; write a "
                "fresh one (sedax certs crl, or your CA) and send this broker SIGHUP",
                self.config.tls_crl, state, when,
            )  # fmt: skip
        left = self.tls.expires - wall
        if left > EXPIRY_WARNING:
            return
        self._expiry_warned = wall
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.tls.expires))
        state = f"expires in {left / 86400:.1f} days" if left > 0 else f"expired {-left / 86400:.1f} days ago"
        self.log.warning(
            "%s %s (%s): new links and clients then fail their handshake; renew it (sedax certs init/issue "
            "--force, or your CA) and send this broker SIGHUP",
            self.tls.expiring, state, when,
        )  # fmt: skip

    # --------------------------------------------------------------------------------------- routing

    def forged(self, frame: RoutedFrame, peer: NodeInfo | None, me: NodeInfo, onward: float | None = None) -> bool:
        """True (counted, logged now and then) if no honest broker would have sent this routed frame.

        onward: how close to the destination the node this broker would pass the frame to is (None: it stays
        here)."""
        x, y = frame.x, frame.y
        xmin, xmax, ymin, ymax = self._bounds
        if not (xmin <= x <= xmax and ymin <= y <= ymax):  # also false for NaN
            return self._drop("forged_outside_space", frame, peer, "destination outside the space")
        if frame.hop_limit > self.config.max_hops:
            return self._drop("forged_hop_limit", frame, peer, f"hop limit above max_hops {self.config.max_hops}")
        if peer is not None:
            # Greedy forwarding hands a frame only to a neighbour strictly closer to the destination (ties:
            # the smaller id), so a frame from a peer no farther than us went backwards.
            d_peer = math.hypot(peer.coord[0] - x, peer.coord[1] - y)
            d_me = math.hypot(me.coord[0] - x, me.coord[1] - y)
            if (d_me > d_peer or (d_me == d_peer and me.id > peer.id)) and not (onward is not None and onward < d_peer):
                # ... unless the sender detoured around a broken link through us: our next node is closer than
                # the sender (so every two hops still get strictly closer, and nothing loops).
                return self._drop("forged_loop", frame, peer, "the sender is closer to the destination than we are")
        return False

    def _drop(self, counter: str, frame: RoutedFrame, peer: NodeInfo | None, why: str) -> bool:
        self.counters[counter] += 1
        n = self.counters[counter]
        if n % DROP_LOG_EVERY == 1:
            self.log.warning(
                "dropped a routed frame for (%s, %s) hop limit %d from %s: %s (%d %s so far)",
                frame.x, frame.y, frame.hop_limit, peer.id if peer else "a non-broker link", why, n, counter,
            )  # fmt: skip
        return True

    # ---------------------------------------------------------------------------------- housekeeping

    def sweep_idle(self, links: Iterable[PeerLink], now: float, busy: Callable[[PeerLink], bool]) -> None:
        """Close client and admin links without a request for idle_timeout s, unless `busy` (subscribed)."""
        idle = self.config.idle_timeout
        if idle <= 0 or now < self._next_sweep:
            return
        self._next_sweep = now + min(SWEEP_INTERVAL, idle / 4)
        for link in list(links):
            if link.role in ("client", "admin") and not link.outbound and link.established:
                silent = now - link.last_request
                if silent > idle and not busy(link):
                    self.counters["idle_closed"] += 1
                    why = f"no request for {silent:.1f} s (--idle-timeout {idle:g})"
                    link.close_soon(CloseReason.IDLE_TIMEOUT, why)

    def link_closed(self, link: PeerLink, reason: CloseReason, detail: str, now: float) -> None:
        """Count why links close, log it if not a broker link's (PeerLink logs those), forget its state."""
        if link.role != "broker":
            self.closes.closed(repr(link), reason, detail, now)
        if reason is CloseReason.PROTOCOL_ERROR:
            self.counters["protocol_errors"] += 1
        elif reason is CloseReason.SLOW_CONSUMER:
            self.counters["slow_consumers"] += 1
        self.counters["slow_consumer_drops"] += link.overflow_drops
        link.overflow_drops = 0
        self._buckets.pop(f"#{link.number}", None)

    def status(self, links: Iterable[PeerLink], handshake_failures: int, refused: int) -> dict[str, int]:
        """The counters for STATUS (drops of open links included)."""
        out = dict(self.counters)
        out["slow_consumer_drops"] += sum(link.overflow_drops for link in links)
        out["tls_handshake_failures"] = handshake_failures
        out["refused_at_accept"] += refused
        if self.acl is not None:
            out["acl_denied_access"] = self.acl.denied["access"]
            out["acl_denied_holder"] = self.acl.denied["holder"]
        return out


def _describe(cert: PeerCert | None) -> str:
    if cert is None:
        return "no certificate"
    return f"a {cert.role or 'role-less'} certificate for {cert.name}"
