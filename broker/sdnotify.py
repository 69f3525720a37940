"""systemd's service notifications (sd_notify(3)), so that a `Type=notify` unit knows what a broker is doing.

systemd passes a datagram socket in `NOTIFY_SOCKET` (a path, or an abstract name starting with "@") and, with
`WatchdogSec=`, the interval in `WATCHDOG_USEC`.  The broker sends:

* `READY=1` once it serves: joined to the overlay, listening, its readiness line printed.  `systemctl start`
  returns then, and units ordered after it (`After=sedax-broker.service`) start only then.
* `RELOADING=1` with `MONOTONIC_USEC` at SIGHUP and `READY=1` when the reload is over (taken or refused), so
  `systemctl reload` of a `Type=notify-reload` unit (systemd 253 and later) waits for it.
* `STOPPING=1` when it starts its graceful leave.
* `WATCHDOG=1` every half `WATCHDOG_USEC` while its loop runs and its timers work (as `/healthz` answers 200):
  a broker whose loop hangs stops sending, and systemd kills it and, with `Restart=`, starts it again.
* `STATUS=...`, one line for `systemctl status`.

Without `NOTIFY_SOCKET` (not started by systemd) nothing is sent.  A send that fails is logged once and does not
stop the broker: the notifications serve the service manager, not the overlay.  A state notification (READY,
RELOADING, STOPPING, STATUS) that finds the manager's queue full (a datagram socket holds `net.unix.max_dgram_qlen`
datagrams, 10 by default) waits and is sent again shortly, in order; it was lost, and a `systemctl reload` would
have waited for a RELOADING=1 that never came.  A WATCHDOG=1 that finds it full is dropped: the next one says
the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Mapping
from typing import Final

# The variables systemd sets for a Type=notify service (sd_notify(3), sd_watchdog_enabled(3)).
ENV_SOCKET: Final = "NOTIFY_SOCKET"
ENV_WATCHDOG_USEC: Final = "WATCHDOG_USEC"
ENV_WATCHDOG_PID: Final = "WATCHDOG_PID"
SERVICE_MANAGER_ENV: Final = (ENV_SOCKET, ENV_WATCHDOG_USEC, ENV_WATCHDOG_PID)
# A STATUS line longer than this is cut: systemctl shows one line.
MAX_STATUS: Final = 200
# A state notification that found the manager's queue full is sent again after this many seconds; at most this
# many wait (the oldest goes first: a manager that reads nothing for that long has missed them anyway).
RETRY_AFTER: Final = 0.05
MAX_WAITING: Final = 32
WATCHDOG: Final = "WATCHDOG=1"


class Notifier:
    """One datagram socket to the service manager; `send` never raises."""

    def __init__(self, address: str, watchdog_usec: int | None, log: logging.Logger) -> None:
        # An abstract socket name is given with "@" for its leading NUL byte.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None  # seconds between pets
        self._log = log
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)
        self._failed = False
        self._waiting: deque[bytes] = deque(maxlen=MAX_WAITING)  # state notifications not sent yet, in order
        self._retry: asyncio.TimerHandle | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], pid: int, log: logging.Logger) -> Notifier | None:
        """The notifier systemd's variables ask for, or None when the broker was not started as a notify service."""
        address = environ.get(ENV_SOCKET, "")
        if not address.startswith(("/", "@")):
            if address:
                log.warning("%s=%r is neither a path nor an abstract socket name: not notifying", ENV_SOCKET, address)
            return None
        watchdog: int | None = None
        usec, for_pid = environ.get(ENV_WATCHDOG_USEC, ""), environ.get(ENV_WATCHDOG_PID, "")
        if usec and (not for_pid or for_pid == str(pid)):  # WATCHDOG_PID names the process meant, if any
            try:
                watchdog = int(usec)
            except ValueError:
                log.warning("%s=%r is not a number of microseconds: no watchdog pings", ENV_WATCHDOG_USEC, usec)
            else:
                watchdog = watchdog if watchdog > 0 else None
        return cls(address, watchdog, log)

    def send(self, *fields: str, status: str | None = None) -> None:
        """One notification: `fields` such as "READY=1", and a STATUS line."""
        lines = list(fields)
        if status is not None:
            lines.append("STATUS=" + " ".join(status.split())[:MAX_STATUS])
        self._waiting.append("\n".join(lines).encode())
        if self._retry is None:  # (else the retry sends it, behind what waits)
            self._flush()

    def _flush(self) -> None:
        """Send what waits, in order, until the manager's queue is full (then again after RETRY_AFTER)."""
        self._retry = None
        while self._waiting:
            try:
                self._sock.sendto(self._waiting[0], self.address)
            except BlockingIOError:
                if self._waiting[0] == WATCHDOG.encode():
                    self._waiting.popleft()  # (the next ping says the same)
                    continue
                if self._retry is None:
                    with contextlib.suppress(RuntimeError):  # (no loop: it goes with the next notification)
                        self._retry = asyncio.get_running_loop().call_later(RETRY_AFTER, self._flush)
                return
            except OSError as exc:
                self._waiting.clear()
                if not self._failed:  # (once: a manager that went away would otherwise fill the log)
                    self._failed = True
                    self._log.warning("cannot notify the service manager at %s=%s: %s", ENV_SOCKET, self.address, exc)
                return
            self._waiting.popleft()

    def ready(self, status: str) -> None:
        self.send("READY=1", status=status)

    def reloading(self) -> None:
        # MONOTONIC_USEC lets the manager tell this reload from an earlier one (systemd 253's notify-reload).
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", status=status)

    def watchdog(self) -> None:
        if not self._waiting:  # (behind a state notification that waits, a ping would say nothing new)
            self.send(WATCHDOG)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        self._sock.close()
