"""The client library's one error hierarchy (clients and admin tools alike).

ClientError
├── ConnectError      no broker could be reached, it refused us, or the connection failed
│                     (also importable as client.admin.BrokerUnavailable)
├── ClientClosed      the client was closed while the operation waited
└── RequestFailed     the overlay answered a request with a refusal; `code` says why
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of client errors (client.admin.AdminError is this class)."""


class ConnectError(ClientError):
    """No broker could be reached, it refused the connection, or the connection failed; the message says which."""


class ClientClosed(ClientError):
    """The client was closed while the operation waited."""


class RequestFailed(ClientError):
    """The overlay refused a request; `code` says why (overlay.pubsub.PubSubCode, or an admin ERROR code)."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code
        self.text = text


def describe(exc: BaseException, empty: str = "") -> str:
    """An exception as one line for an error message: its text, or where it has none `empty` (what it means
    there: "no answer within 5 s") or its type.  A bare TimeoutError printed as nothing ("no broker reachable:
    127.0.0.1:7000: "), and `f"{exc or ...}"` never takes the alternative: an exception is always true."""
    return str(exc) or empty or type(exc).__name__
