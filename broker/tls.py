"""TLS for a broker: its server and dial contexts, a startup self-check, and the accept loop.

One port serves brokers, clients and admin tools.  The server side asks every peer for a certificate of
the cluster CA: required when the broker has no tokens file (so a peer without one fails the handshake),
optional when it has (clients may then authenticate with a token at HELLO).  What a certificate entitles
its holder to is decided at HELLO by `broker.guard`.

The accept loop is our own (`sock_accept` + `connect_accepted_socket`) rather than `asyncio.start_server`:
a failed handshake is then an exception we see, count and log with its reason, where `start_server` drops
it silently; and a connection flood is cut before any handshake work.  (uvloop's server-side `start_tls`
cannot be used instead: it reads the ClientHello into the plain stream before upgrading.)
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from broker.config import BrokerConfig, ConfigError
from broker.tasks import TaskSet
from net.credentials import ROLE_BROKER, PeerCert, peer_cert
from net.crl import CrlError, RevocationList, check_crls
from net.transport import StreamTransport

# Pending connections the kernel queues for us; asyncio's default is 100.
BACKLOG: Final = 512
# After accept() fails (out of file descriptors), wait this long before accepting again, not spin.
ACCEPT_BACKOFF: Final = 0.1
# Handshake failures are logged one by one up to this many, then once per LOG_EVERY (a port scan must not
# flood the log); all are counted.
LOG_FIRST: Final = 20
LOG_EVERY: Final = 1000

OnStream = Callable[[StreamTransport], None]


@dataclass(frozen=True, slots=True)
class BrokerTls:
    """The TLS contexts of one broker and the name its own certificate gives it."""

    server: ssl.SSLContext
    dial: ssl.SSLContext
    name: str
    expires: float  # when the certificate or the CA that issued it expires first (notAfter, epoch seconds)
    expiring: str  # which of the two that is, for the log
    crls: tuple[RevocationList, ...] = ()  # what tls_crl revokes (none without it)

    @property
    def crl_next_update(self) -> float:
        """When the first CRL of tls_crl is due (epoch seconds): past it OpenSSL refuses every peer.  0: none due."""
        due = [c.next_update for c in self.crls if c.next_update is not None]
        return min(due) if due else 0.0


def _load(ctx_for: str, purpose: ssl.Purpose, cert: str, key: str, ca: str) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(purpose, cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the CA certificate tls_ca={ca!r}: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load tls_cert={cert!r} with tls_key={key!r} ({ctx_for}): {exc}") from None
    return ctx


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> object:
    """A TLS handshake between two contexts in memory; the server side's view of the client certificate."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    cli = client.wrap_bio(c_in, c_out, server_side=False)
    done_s = done_c = False
    for _ in range(16):
        if not done_c:
            try:
                cli.do_handshake()
                done_c = True
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        if not done_s:
            try:
                srv.do_handshake()
                done_s = True
            except ssl.SSLWantReadError:
                pass
        c_in.write(s_out.read())
        if done_s and done_c:
            return srv.getpeercert()
    return None


def _why(exc: ssl.SSLError) -> str:
    return str(getattr(exc, "verify_message", None) or exc.reason or exc)


def _self_check(
    server: ssl.SSLContext, cert: str, key: str, ca: str, crl: str | None
) -> tuple[PeerCert, float, object]:
    """Handshakes with ourselves in memory: the certificate must verify against the CA as a client certificate
    (what peers we dial check) and as a server certificate (what peers dialling us check).

    Catches a certificate of another CA, a client certificate or a key that is not the certificate's at
    start-up, with a clear message, instead of as refused links later.  Returns the name the certificate gives,
    when it expires and its issuer.
    """
    # First only the server side verifies, so a client certificate of the right CA gets as far as showing
    # its name and role.
    as_client = _load("self-check", ssl.Purpose.SERVER_AUTH, cert, key, ca)
    as_client.check_hostname = False  # the addresses are checked by every peer that dials us
    as_client.verify_mode = ssl.CERT_NONE
    try:
        seen = _handshake(server, as_client)
    except ssl.SSLError as exc:
        if crl is not None and "revoked" in _why(exc):
            raise ConfigError(
                f"tls_cert={cert!r} is revoked in tls_crl={crl!r}: issue this broker a new certificate (sedax certs "
                "issue --force, or your CA)"
            ) from None
        raise ConfigError(f"tls_cert={cert!r} does not verify against tls_ca={ca!r}: {_why(exc)}") from None
    me = peer_cert(seen)
    if me is None or not isinstance(seen, dict):
        raise ConfigError(f"tls_cert={cert!r}: the TLS self-check did not complete; is it a certificate of tls_ca?")
    if me.role != ROLE_BROKER:
        raise ConfigError(
            f"tls_cert={cert!r} is a {me.role or 'role-less'} certificate for {me.name!r}; a broker needs a broker "
            "certificate (sedax certs issue --role broker)"
        )
    verifying = _load("self-check", ssl.Purpose.SERVER_AUTH, cert, key, ca)
    verifying.check_hostname = False
    try:
        _handshake(server, verifying)
    except ssl.SSLError as exc:
        raise ConfigError(f"tls_cert={cert!r} is not usable as a server certificate of tls_ca: {_why(exc)}") from None
    return me, float(ssl.cert_time_to_seconds(str(seen["notAfter"]))), seen.get("issuer")


def _expiry(server: ssl.SSLContext, cert: str, ca: str, leaf: float, issuer: object) -> tuple[float, str]:
    """When the chain stops verifying: the certificate's notAfter, or its CA's if that comes first (a CA of the
    same name as another in the bundle, as a replaced CA has, counts as the later of them)."""
    issued_by = [
        float(ssl.cert_time_to_seconds(str(c["notAfter"])))
        for c in server.get_ca_certs()
        if c.get("subject") == issuer and "notAfter" in c
    ]
    if issued_by and max(issued_by) < leaf:
        return max(issued_by), f"the CA certificate in {ca} that issued {cert}"
    return leaf, f"the TLS certificate {cert}"


def load_broker_tls(config: BrokerConfig, *, require_client_cert: bool) -> BrokerTls:
    """The broker's server and dial contexts from its config (which must have tls_cert/key/ca)."""
    cert, key, ca = config.tls_cert, config.tls_key, config.tls_ca
    if cert is None or key is None or ca is None:
        raise ConfigError("TLS needs tls_cert, tls_key and tls_ca")
    server = _load("server side", ssl.Purpose.CLIENT_AUTH, cert, key, ca)
    server.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    dial = _load("dialling brokers", ssl.Purpose.SERVER_AUTH, cert, key, ca)
    crl = config.tls_crl
    crls: tuple[RevocationList, ...] = ()
    if crl is not None:
        try:
            crls = check_crls(crl, "tls_crl", ca, server, dial)
        except CrlError as exc:
            raise ConfigError(str(exc)) from None
    me, leaf, issuer = _self_check(server, cert, key, ca, crl)
    return BrokerTls(server, dial, me.name, *_expiry(server, cert, ca, leaf, issuer), crls)


class Listener:
    """Accepts connections, completes their TLS handshake (if configured) and hands over their transports.

    `admit(handshaking)` decides at accept time whether one more connection may start its handshake;
    a refused one is closed at once (counted in `refused`).
    """

    def __init__(
        self,
        ctx: ssl.SSLContext | None,
        handshake_timeout: float,
        on_stream: OnStream,
        admit: Callable[[int], bool],
        tasks: TaskSet,
        log: logging.Logger,
    ) -> None:
        self._ctx = ctx
        self._timeout = handshake_timeout
        self._on_stream = on_stream
        self._admit = admit
        self._tasks = tasks
        self._log = log
        self._sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.handshaking = 0
        self.handshake_failures = 0
        self.refused = 0

    async def start(self, host: str, port: int) -> int:
        """Bind host:port and start accepting; returns the bound port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        if not infos:
            raise OSError(f"cannot resolve listen host {host!r}")
        family, _, _, _, addr = infos[0]
        sock = socket.create_server(addr[:2], family=family, backlog=BACKLOG)
        sock.setblocking(False)
        self._sock = sock
        self._task = self._tasks.spawn(self._accept_loop(sock), "accept")
        return int(sock.getsockname()[1])

    def use(self, ctx: ssl.SSLContext) -> None:
        """Handshake the connections accepted from now on with ctx (a reload's new certificate)."""
        self._ctx = ctx

    def close(self) -> None:
        """Stop accepting (connections already handed over are not affected)."""
        if self._task is not None:
            self._task.cancel("listener closed")
            self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                self._log.warning("accept failed: %s; accepting again in %.1f s", exc, ACCEPT_BACKOFF)
                await asyncio.sleep(ACCEPT_BACKOFF)
                continue
            if not self._admit(self.handshaking):
                self.refused += 1
                conn.close()
                continue
            self.handshaking += 1
            self._tasks.spawn(self._handshake(conn), "handshake")

    async def _handshake(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            host, port = conn.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        # The transport gets the connection once the TLS handshake has completed.  It is made here, not taken
        # from the call's result: under TLS uvloop returns its own SSL protocol there.
        transport = StreamTransport()
        try:
            if self._ctx is None:
                await loop.connect_accepted_socket(lambda: transport, conn)
            else:
                await loop.connect_accepted_socket(
                    lambda: transport, conn, ssl=self._ctx, ssl_handshake_timeout=self._timeout
                )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError and ConnectionError are OSErrors
            conn.close()
            self._failed(peer, exc)
            return
        except BaseException:
            conn.close()
            raise
        finally:
            self.handshaking -= 1
        self._on_stream(transport)

    def _failed(self, peer: str, exc: BaseException) -> None:
        self.handshake_failures += 1
        n = self.handshake_failures
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            what = "TLS handshake" if self._ctx is not None else "connection set-up"
            self._log.warning("%s with %s failed: %s (%d failures so far)", what, peer, reason, n)
