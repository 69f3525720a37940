"""The one default of each setting that both the broker's configuration and a layer below it use.

BrokerConfig (broker/config.py, the flags) and the layer that applies the setting (pub/sub, the store) both
start from these; a second literal anywhere is a bug.
"""

from __future__ import annotations

from typing import Final

# --resilience: how many failures a topic survives (Sec. IV-B).
RESILIENCE: Final = 2
# --move-cooldown: a topic that moved is not moved again by the balancer for this long (hysteresis: no
# ping-pong).
MOVE_COOLDOWN: Final = 30.0
# --retention-seconds / --retention-bytes: how long and how much of every topic a broker keeps.
RETENTION_SECONDS: Final = 3600.0
RETENTION_BYTES: Final = 64 << 20
