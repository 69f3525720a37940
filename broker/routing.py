"""Dispatch of routed messages that end at this broker: one table from message class to handler.

Greedy forwarding (broker/node.py `on_routed`) reads only the ROUTED header and passes a frame on; the broker
closest to the destination decodes the body and hands the message to the one handler registered for its
class: the node's own (JOIN, ROUTE_PROBE and the replies it waits for), the balancer's (COORD_QUERY,
COORD_OFFER) and pub/sub's (`PubSub.routed_handlers()`).  A class registered twice is a wiring bug and is
refused at start; a message nobody handles is counted and dropped, never raised into the read loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from overlay.protocol import Message

Handler = Callable[[Any], None]


class DuplicateHandler(ValueError):
    """Two parts of the broker registered a handler for the same routed message class."""


class DispatchTable:
    """Routed message class -> handler (see the module docstring)."""

    def __init__(self) -> None:
        self._handlers: dict[type[Message], Handler] = {}

    def register(self, cls: type[Message], handler: Handler) -> None:
        """Route messages of class cls to handler; DuplicateHandler if the class has one already."""
        if cls in self._handlers:
            raise DuplicateHandler(f"{cls.__name__} ({cls.op}) already has a handler: {self._handlers[cls]!r}")
        self._handlers[cls] = handler

    def register_all(self, handlers: Mapping[type[Message], Handler]) -> None:
        """register() each entry of handlers."""
        for cls, handler in handlers.items():
            self.register(cls, handler)

    def dispatch(self, msg: Message) -> bool:
        """Hand msg to its handler; False if no handler is registered for its class."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return False
        handler(msg)
        return True

    def __contains__(self, cls: object) -> bool:
        return cls in self._handlers
