"""Async admin client: connect to one broker, ask for its STATUS, probe routes.

Needs only the sans-IO codec (`overlay.protocol`), not the geometry stack, so it stays light to import.
Many requests may be in flight at once on one connection; replies are matched by correlation id.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

from client.errors import ClientError, ConnectError, RequestFailed, describe
from net.connection import READ_CHUNK, HandshakeRefused, Requests, open_handshake
from net.credentials import Credentials
from net.transport import Transport, connect_broker
from overlay.protocol import (
    PROTOCOL_VERSION,
    ControlFrame,
    Coord,
    Error,
    FrameDecoder,
    HeldPage,
    HeldReq,
    Hello,
    Message,
    NodeInfo,
    Ping,
    Pong,
    ProtocolError,
    RemoteProtocolError,
    Role,
    RouteProbe,
    RouteReply,
    Status,
    StatusReq,
    TopicHeld,
    encode_control,
    parse_address,
)

# Why a broker may hang up before answering HELLO: said with the error, as the broker cannot tell us.
HANDSHAKE_HINT: Final = (
    "a broker speaking TLS closes plain connections (--insecure) and ones whose certificate fails the "
    "cluster CA; check --ca/--cert/--key"
)
# Default bound on connecting and on each request; a healthy local overlay answers in milliseconds.
DEFAULT_TIMEOUT: Final = 5.0


# One error hierarchy for the whole client library (client/errors.py); the admin names are the same classes.
AdminError = ClientError
BrokerUnavailable = ConnectError
__all__ = ["AdminClient", "AdminError", "BrokerUnavailable", "Holdings", "RequestFailed", "route_json", "status_json"]


@dataclass(frozen=True, slots=True)
class Holdings:
    """Every topic one broker holds, in name order (STATUS's first page and the HELD_PAGEs after it; an entry per
    role, as STATUS's `held`), and for those it is primary or delegate of, the messages stored in the last
    RATE_WINDOW s (STATUS's `recent`)."""

    held: tuple[TopicHeld, ...]
    recent: dict[str, int]


class AdminClient:
    """One admin connection to a broker.  Use `await AdminClient.connect(addr)` or `async with`."""

    def __init__(self, transport: Transport, broker: NodeInfo, *, request_timeout: float = DEFAULT_TIMEOUT) -> None:
        self.broker = broker
        self.request_timeout = request_timeout
        self._t = transport
        self._decoder = FrameDecoder()
        self._corr = itertools.count(1)
        self._requests = Requests()
        self._closed: BaseException | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop(), name="admin-read")

    @classmethod
    async def connect(
        cls,
        addr: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - STYLE.md 11 asks for connect(addr, *, timeout=...)
        role: str = "admin",
        credentials: Credentials | None = None,
    ) -> Self:
        """Connect and complete the handshake within timeout seconds; later requests get the same bound.

        `credentials` default to the environment (net/credentials.py: SEDAX_CA, ... SEDAX_INSECURE).

        Raises:
            BrokerUnavailable: the address is unreachable, the broker refused us, or it did not answer.
            CredentialsError: no usable credentials.
        """
        try:
            host, port = parse_address(addr)
        except ValueError as exc:
            raise BrokerUnavailable(str(exc)) from None
        creds = credentials if credentials is not None else Credentials.from_env()
        ctx = creds.ssl_context()  # unreadable files fail here, before any connection attempt
        try:
            async with asyncio.timeout(timeout):
                transport = await connect_broker(host, port, ctx, timeout)
        except (OSError, TimeoutError) as exc:
            raise BrokerUnavailable(f"cannot reach broker at {addr}: {describe(exc)}") from exc
        return await cls.over(transport, addr, timeout=timeout, role=role, token=creds.token or "")

    @classmethod
    async def over(
        cls,
        transport: Transport,
        addr: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - as connect's
        role: str = "admin",
        token: str = "",
    ) -> Self:
        """The handshake (net.connection.open_handshake) on a connected transport; BrokerUnavailable if it fails."""
        node = f"{role}-{uuid.uuid4().hex[:12]}"
        kind: Role = "admin" if role == "admin" else "client"
        decoder = FrameDecoder()
        try:
            ok, _ = await open_handshake(transport, Hello(PROTOCOL_VERSION, node, kind, token=token), decoder, timeout)
        except HandshakeRefused as exc:
            transport.abort()
            raise BrokerUnavailable(f"broker at {addr} refused the connection: {exc.code}: {exc.text}") from None
        except ConnectionResetError as exc:
            transport.abort()
            raise BrokerUnavailable(f"cannot reach broker at {addr}: {exc} ({HANDSHAKE_HINT})") from exc
        except (OSError, TimeoutError, ProtocolError) as exc:
            transport.abort()
            raise BrokerUnavailable(f"cannot reach broker at {addr}: {describe(exc)}") from exc
        client = cls(transport, ok.node, request_timeout=timeout)
        client._decoder = decoder
        return client

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _read_loop(self) -> None:
        cause: BaseException = BrokerUnavailable("connection closed by the broker")
        try:
            while True:
                data = await self._t.read(READ_CHUNK)
                frames = self._decoder.feed(data)
                if not data:
                    break
                for frame in frames:
                    if not isinstance(frame, ControlFrame):
                        raise RemoteProtocolError("routed frame sent to an admin client")
                    msg = frame.message
                    if isinstance(msg, Ping):
                        self._t.write(encode_control(Pong(msg.seq)))
                        continue
                    self._requests.complete(getattr(msg, "corr", None), msg)
        except (OSError, ProtocolError) as exc:
            cause = BrokerUnavailable(f"connection to the broker failed: {exc!r}")
        self._fail_all(cause)

    def _fail_all(self, cause: BaseException) -> None:
        self._closed = cause
        self._requests.fail_all(cause)

    async def request(self, msg: Message) -> Message:
        """Send a request (corr from `next_corr`) and wait, up to request_timeout, for the matching reply."""
        timeout = self.request_timeout
        if self._closed is not None:
            raise BrokerUnavailable(str(self._closed))
        corr: int = getattr(msg, "corr")  # noqa: B009 - every request message has one
        fut = self._requests.add(corr)
        try:
            self._t.write(encode_control(msg))
            async with asyncio.timeout(timeout):
                await self._t.drain()
                reply = await fut
        except TimeoutError:
            raise BrokerUnavailable(f"no answer from {self.broker.listen} within {timeout} s") from None
        except OSError as exc:
            raise BrokerUnavailable(f"connection to {self.broker.listen} failed: {exc!r}") from exc
        finally:
            self._requests.discard(corr)
        if isinstance(reply, Error):
            raise RequestFailed(reply.code, reply.text)
        return reply

    async def send_frames(self, data: bytes) -> None:
        """Write pre-encoded frames (e.g. a batch of ROUTED frames), then wait for the socket to drain."""
        if self._closed is not None:
            raise BrokerUnavailable(str(self._closed))
        self._t.write(data)
        try:
            await self._t.drain()
        except OSError as exc:
            raise BrokerUnavailable(f"connection to {self.broker.listen} failed: {exc!r}") from exc

    def next_corr(self) -> int:
        """A fresh correlation id for this connection."""
        return next(self._corr)

    async def status(self) -> Status:
        """The broker's STATUS."""
        reply = await self.request(StatusReq(self.next_corr()))
        if not isinstance(reply, Status):
            raise BrokerUnavailable(f"expected STATUS, got {reply.op}")
        return reply

    async def holdings(self, st: Status) -> Holdings:
        """Every topic the broker that answered st holds: st's first page, then the next pages (HELD_REQ) while it
        says more follow.  A topic added or dropped while the pages are read may be missing or still listed, as in
        any listing of a live broker."""
        held, recent = list(st.held), dict(st.recent)
        more = st.held_total > len(held)  # (0 from a broker that predates paging: its STATUS is all it says)
        while more and held:
            after = held[-1].topic
            reply = await self.request(HeldReq(self.next_corr(), after))
            if not isinstance(reply, HeldPage):
                raise BrokerUnavailable(f"expected HELD_PAGE, got {reply.op}")
            if reply.held and reply.held[0].topic <= after:  # a page must move on: a broker looping is stopped here
                raise BrokerUnavailable(f"{self.broker.listen} sent a HELD_PAGE that does not follow {after!r}")
            held.extend(reply.held)
            recent.update(reply.recent)
            more = reply.more
        return Holdings(tuple(held), recent)

    async def route(self, target: Coord) -> RouteReply:
        """Probe the route from this broker to the broker closest to target."""
        reply = await self.request(RouteProbe(self.next_corr(), target))
        if not isinstance(reply, RouteReply):
            raise BrokerUnavailable(f"expected ROUTE_REPLY, got {reply.op}")
        return reply

    async def aclose(self) -> None:
        """Close the connection and wait for the reader to finish."""
        self._read_task.cancel()
        await asyncio.gather(self._read_task, return_exceptions=True)
        self._fail_all(BrokerUnavailable("client closed"))
        self._t.close()
        try:
            # Bounded: a TLS close waits for the broker's close_notify.
            async with asyncio.timeout(self.request_timeout):
                await self._t.wait_closed()
        except (OSError, TimeoutError):
            self._t.abort()


def status_json(st: Status, holdings: Holdings | None = None) -> dict[str, object]:
    """STATUS in the JSON shape of `sedax status --json`; its topics are holdings' (every page) when given, else
    STATUS's first page."""
    return {
        "node": st.node.id,
        "coord": [st.node.coord[0], st.node.coord[1]],
        "listen": st.node.listen,
        "neighbours": [n.to_json() for n in st.neighbours],
        "topics": [
            {
                "topic": h.topic,
                "role": h.role,
                "size": h.size,
                "state": h.state,
                "behind": h.behind,
                "pending": h.pending,
            }
            for h in (st.held if holdings is None else holdings.held)
        ],
        "loads": dict(st.loads),
        "resilience": st.resilience,
        "counters": dict(st.counters),
        # null from a broker that predates them (or, for the expiry, one on plain TCP)
        "version": st.version or None,
        "started": st.started or None,
        "certificate_expires": st.certificate_expires or None,
        "crl_next_update": st.crl_next_update or None,
        "reload_ok": st.reload_ok,
    }


def route_json(reply: RouteReply) -> dict[str, object]:
    """ROUTE_REPLY in the JSON shape of `sedax route --json`."""
    return {
        "node": reply.node.to_json(),
        "hops": reply.hops,
        "path": [n.to_json() for n in reply.path],
    }
