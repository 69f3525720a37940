"""Give freed memory back to the system after connection churn (cyclic GC, then glibc `malloc_trim`); how much
memory the broker may use (`memory_available`, the default of --max-memory).

Why: every TLS connection allocates its OpenSSL state and buffers (tens of KiB) in the C heap.  Measured with
waves of 400 concurrent TLS clients that connect and leave (benchmarks/bench_churn.py), one broker's RSS grew
by 10-25 MB per wave and was not given back when idle (80 MB to 222 MB over 12 waves).  Nothing leaked for
good: what a closed connection freed stayed in glibc's heap, fragmented among allocations that live on (its
objects then referred to each other, so only the cyclic collector freed them; they no longer do:
`freeze_survivors`).  So after a burst of closes the broker collects and trims: once enough connections have
closed since the last trim, or as soon as closes stop coming after a burst of at least a quarter of that, at
most every `min_interval` seconds.  A collection and trim cost milliseconds; a broker without churn never does either.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

# Trim after this many closed connections (a client fleet reconnecting, a scan of hostile peers) ...
TRIM_AFTER_CLOSES: Final = 64
# ... but not more often than this (a trim costs about a millisecond; one a second is nothing).
TRIM_MIN_INTERVAL: Final = 1.0


def _glibc_trim() -> Callable[[], None] | None:
    """malloc_trim(0) of the C library, where it is glibc; None elsewhere (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: fn(0)


def freeze_survivors() -> None:
    """From now on, what survives a full collection of the cyclic collector is frozen (`gc.freeze`): the next
    full collection walks only what was made since, not everything the broker holds.

    Why: a full collection walks every object tracked, and a broker's are mostly its topics' (~18 objects per
    replica).  Measured (three brokers' topics in one process, the in-memory overlay of the tests): a full
    collection took 0.22 s at 20,000 replicas and 0.87 s at 90,000 (filling them, 19 collections, 6.4 s in all).
    A broker silent that long is declared failed by its neighbours (three missed 0.2 s heartbeats): at level 2,
    three brokers filling 100,000 topics took each other for failed and took their topics over
    (docs/benchmarks-scale.md).  With survivors frozen: 32 collections, 67 ms the longest, 1.3 s in all.

    What is frozen is still freed when its last reference goes, as anything is; only a reference cycle among
    frozen objects would stay.  The broker's own lifecycles leave none: a topic made, copied, taken over, moved
    and dropped, and a client's connection made and closed (TLS, refused, reset) are freed without the cyclic
    collector (tests/test_gc_policy.py checks that with the collector off).  The collections
    of young objects, where cycles of short-lived objects end, run as before."""
    if _freeze_after_full not in gc.callbacks:
        gc.callbacks.append(_freeze_after_full)


def _freeze_after_full(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


class HeapTrimmer:
    """Counts closed connections and trims the heap when enough have closed (see the module docstring)."""

    def __init__(
        self,
        trim: Callable[[], None] | None = None,
        after: int = TRIM_AFTER_CLOSES,
        min_interval: float = TRIM_MIN_INTERVAL,
    ) -> None:
        self._trim = trim if trim is not None else _glibc_trim()
        self.after = after
        self.min_interval = min_interval
        self.closed_since = 0
        self._seen = 0  # closed_since at the previous call: unchanged means the burst is over
        self.last = float("-inf")
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def closed(self) -> None:
        """One connection closed."""
        self.closed_since += 1

    def maybe_trim(self, now: float) -> bool:
        """Trim if connections closed since the last trim (enough of them, or the burst is over) and the interval
        passed; True if it did.  Called on the broker's regular tick."""
        # A burst is over when no close came since the last tick; a few closes are not worth a collection (a
        # full one pauses a broker holding much for milliseconds: it would show in the latency tail).
        burst_over = self.closed_since >= max(1, self.after // 4) and self.closed_since == self._seen
        self._seen = self.closed_since
        if self._trim is None or now - self.last < self.min_interval:
            return False
        if self.closed_since < self.after and not burst_over:
            return False
        # Whatever cycles are left to free first (what survived a full collection is frozen: this walks only
        # what was made since, `freeze_survivors`), and then the heap can be given back.
        gc.collect()
        self._trim()
        self.closed_since = 0
        self._seen = 0
        self.last = now
        self.trims += 1
        return True


def memory_available() -> int:
    """Bytes of memory this process may use: the machine's, or its container's (cgroup v2 memory.max, v1
    memory.limit_in_bytes) where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def human_bytes(n: float) -> str:
    """n bytes for a log line or an error text: "512 B", "97.7 KiB", "1.9 MiB", "12.0 GiB"."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
