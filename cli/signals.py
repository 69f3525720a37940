"""How `sedax` commands end on a signal, and the steps a signal must not cut in two.

SIGTERM and SIGHUP end a command the way Ctrl-C does (`Terminated`, a KeyboardInterrupt), raised by the handler
`cli.main` installs wherever the main thread is at that moment.  A few steps must not be cut there: starting a
broker process and recording it (cut in between, the process runs on and no clean-up knows its pid).  `held()`
keeps the signals back for such a step and handles them right after it, as they would have been.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Final

# Signals that end a command the way Ctrl-C does.  Their default action ends the process at once: an interrupted
# `sedax cluster up` (a service manager's stop, `timeout`, a closed terminal) left the brokers it had started
# running, with no state file through which `cluster down` could find them.
ENDING_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)
HELD_SIGNALS: Final = (signal.SIGINT, *ENDING_SIGNALS)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: handled as Ctrl-C is (a KeyboardInterrupt, so asyncio and every `except
    BaseException` clean-up treat it alike), reported with the signal's name and exit code."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def terminated(signum: int, _frame: object) -> None:
    """The handler of ENDING_SIGNALS while a command runs."""
    raise Terminated(signum)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back for the block, then handle the first that came as its handler then
    in place would have (raise Terminated, cancel asyncio's main task, end the process by default).  Only the
    main thread receives signals in Python; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: came.append(signum)) for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if came:
            handler = previous[signal.Signals(came[0])]
            if callable(handler):
                handler(came[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), came[0])
