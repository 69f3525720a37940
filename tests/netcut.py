"""Real network cuts between brokers for tests: nftables rules that drop the packets between loopback addresses.

Brokers started with `LocalCluster(hosts=True)` listen on 127.0.0.(10 + i) and dial their peers from that
address, so a rule naming two addresses cuts exactly the link between those two brokers (both directions);
clients on 127.0.0.1 still reach every broker.  The rules live in a table of their own, deleted on exit.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterable
from types import TracebackType
from typing import Self

_tables = itertools.count()


def unavailable() -> str | None:
    """Why nftables cannot be used here (not installed, not root), or None."""
    if shutil.which("nft") is None:
        return "nftables (the nft command) is not installed: apt-get install nftables"
    probe = f"sedax_probe_{os.getpid()}"
    made = subprocess.run(["nft", "add", "table", "inet", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"nft cannot add a table here (needs root or CAP_NET_ADMIN): {made.stderr.strip()}"
    subprocess.run(["nft", "delete", "table", "inet", probe], capture_output=True, check=False)
    return None


class Cut:
    """Drop every packet between each address of `a` and each of `b`, until `heal()` (or the end of `with`)."""

    def __init__(self) -> None:
        self.table = f"sedax_cut_{os.getpid()}_{next(_tables)}"
        self.active = False

    def cut(self, a: Iterable[str], b: Iterable[str]) -> None:
        rules = [f"add table inet {self.table}"]
        rules.append(f"add chain inet {self.table} out {{ type filter hook output priority 0; policy accept; }}")
        sa, sb = sorted(a), sorted(b)
        for x in sa:
            for y in sb:
                rules.append(f"add rule inet {self.table} out ip saddr {x} ip daddr {y} drop")
                rules.append(f"add rule inet {self.table} out ip saddr {y} ip daddr {x} drop")
        subprocess.run(["nft", "-f", "-"], input="\n".join(rules) + "\n", text=True, check=True, capture_output=True)
        self.active = True

    def heal(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=True, capture_output=True)
            self.active = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.heal()


def sweep_stale() -> list[str]:
    """Delete the cut tables of processes that are gone (one killed while a cut was in place never healed it,
    and its rules would partition the next run's brokers); returns the tables deleted."""
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
    gone = []
    for line in listed.splitlines():
        name = line.split()[-1] if line.startswith("table inet sedax_cut_") else ""
        parts = name.split("_")
        if len(parts) == 4 and parts[3].isdigit() and parts[2].isdigit() and not os.path.exists(f"/proc/{parts[2]}"):
            subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, check=False)
            gone.append(name)
    return gone
