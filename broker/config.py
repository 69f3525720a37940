"""Broker settings: one frozen `BrokerConfig` from defaults, a config file, SEDAX_* variables and flags.

Precedence, lowest first: built-in defaults, ``--config FILE`` (JSON, or TOML by the .toml suffix),
``SEDAX_<FIELD>`` environment variables, command-line flags.  Seconds are floats everywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

from broker import defaults
from broker.flags import add_broker_arguments
from broker.storage import FsyncPolicy
from broker.store import BadRetentionRule, Retention, RetentionPolicy, RetentionRule
from overlay.geometry import UNIT_SQUARE, BadCoordinate, Coord, Space
from overlay.logschema import DEFAULT_KEEP, DEFAULT_MAX_BYTES
from overlay.protocol import MAX_FRAME_SIZE, MAX_HOP_LIMIT, parse_address
from overlay.pubsub import MAX_PAYLOAD_SIZE, MAX_TOPIC_ENTRIES

__all__ = ["BrokerConfig", "ConfigError", "add_broker_arguments", "build_config", "config_from_args"]

ENV_PREFIX: Final = "SEDAX_"
# Snapshots more often than this would make the log the broker's main work; rarer than an hour, useless.
MIN_LOG_INTERVAL: Final = 0.05
MAX_LOG_INTERVAL: Final = 3600.0
# One snapshot line must fit a file, or every write would rotate.
MIN_LOG_BYTES: Final = 64 * 1024
MAX_RUN_LEN: Final = 128
SLOW_CONSUMER_POLICIES: Final = ("disconnect", "drop")
LOG_FORMATS: Final = ("text", "json")
# A client link must at least carry a HELLO, a small publish and a status answer.
MIN_FRAME_SIZE: Final = 4096


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the setting, its source and what is expected."""


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Everything a broker process needs to run.

    Attributes:
        coord: the broker's coordinate in `space`.
        listen: "host:port" to accept peers, clients and admin tools on (port 0: the OS picks one).
        advertise: "host:port" other brokers dial to reach this one, when the listen host is a wildcard
            such as 0.0.0.0 (default: the listen host and the bound port).
        join: addresses of running brokers to join through, tried in order; empty = start a new overlay.
        bootstrap: with `join`, start a new overlay when none of the join addresses is part of one (each is
            down, or refuses as still joining itself) instead of trying again until `join_timeout`: the broker
            that starts a cluster (compose's b1), which must rejoin the others when restarted alone.
        node_id: the broker's id; generated when None.
        resilience: resilience level 1..3 (Sec. IV-B): level 1 keeps a topic on its closest broker only,
            level 2 also on the second-closest, level 3 copies it to the third-closest after a failure.
        retention_seconds: how long a broker keeps published messages of a topic.
        retention_bytes: how many bytes per topic it keeps at most (oldest dropped first).
        retention_topics: `PATTERN=SECONDS[,BYTES]` entries (broker.store.RetentionRule): the retention of the
            topics a pattern matches, the first matching entry deciding; the part left out is the two above.
        data_dir: directory of the topic store on disk (docs/storage.md); None keeps topics in memory only.
        store: "auto" (on disk when data_dir is set), "disk" (data_dir required) or "memory" (never on disk).
        fsync: when written records are forced to the disk: always, batch, interval:MS or never
            (docs/storage.md says what an acknowledgement means under each).
        metrics: "host:port" for the Prometheus endpoint, or None.
        log_dir: directory for the exported metrics log (docs/logs.md), or None for no log.
        log_interval: seconds between the broker's snapshots in that log; snapshot `step` is the number of
            whole intervals since the Unix epoch, so brokers with the same interval share step numbers.
        log_max_bytes: size at which the log file is rotated.
        log_keep: log files kept, the current one included.
        log_run: the `run` field of the records: one name for all brokers of one cluster lifetime.
        heartbeat_interval: seconds between PINGs on an idle link.
        heartbeat_misses: a link silent for this many intervals is declared dead (3 x 0.2 s = 0.6 s, well
            under the one-second failover goal).
        hello_timeout: seconds a new connection has to complete the handshake.
        client_timeout: seconds of silence after which a client or admin connection is dropped; wider than
            the brokers' heartbeat window because a client's liveness decides no failover and a busy client
            (a burst of publishes) may not answer PINGs at once.
        connect_timeout: seconds to open a TCP connection to a peer.
        join_timeout: seconds to keep trying the join addresses (a JOIN not answered within 2 s, the wait
            doubling each round, is sent again: membership.JOIN_ANSWER_FIRST).
        drain_timeout: seconds a graceful shutdown waits for links to flush.
        tombstone_ttl: seconds a failed or departed node stays excluded from the view.
        max_hops: hop limit stamped on routed frames this broker originates (<= 255).
        space: the coordinate space.
        log_level: Python logging level name.
        log_format: stderr log lines as `text` (one line a record, for a terminal or the journal) or `json`
            (one JSON object a line: ts, level, node, logger, message; for a log pipeline such as Loki or ELK).
        balance: when to balance load (Sec. VI): none, addition (Alg. 1), continuous (Alg. 2) or combined.
        goal: the node load to equalise, L1, L2 or L3 (Sec. IV).
        selection: coordinate selection (Sec. V): indcoord, bestlocal, bestregional or bestglobal.
        queries: n_queries, coordinates queried per decision.
        hops: n_hops of BestRegionalCoord.
        balance_interval: Δτ, seconds between two continuous balancing rounds of this broker.
        min_gain: a topic moves only if the best coordinate lowers L_max by at least this fraction of the
            current coordinate's L_max (hysteresis; 0 is the paper's rule).
        max_move_bytes: a balancing round moves no topic larger than this (bytes per round).
        ties: Tiebreaker(C*) among several equally best coordinates: "random" (one is drawn) or "first".
        balance_scan: how many of its smallest topics one Alg. 2 round may try until one has a better
            coordinate (1 = the paper's: the smallest only; more lets a broker whose smallest topic sits well
            shed the next one instead of stalling).  At most one topic moves per round either way.
        move_cooldown: seconds before the balancer may move a topic again (the home enforces it).
        load_report_interval: seconds between two looks at whether the load record changed; a report goes to
            the neighbours when it did (see load_report_threshold), or when load_report_refresh has passed.
        load_report_threshold: a load value (of this broker or a neighbour it passes on) must have changed by
            more than this fraction since the last report for a new one to go out before the refresh.
        load_report_refresh: seconds after which a broker reports even unchanged loads (the neighbours drop
            records not heard of for 3 refreshes; an idle overlay sends nothing more often); at least
            load_report_interval.
        query_timeout: seconds a coordinate selection waits for its answers.
        tls_cert, tls_key, tls_ca: this broker's certificate and key and the cluster CA (PEM files), all
            three or none.  Brokers link only with mutual TLS against the CA (a broker certificate, OU=broker,
            whose CN is the peer's node id); clients present a certificate of the CA or a token.
        tls_crl: a PEM file of certificate revocation lists, one for each CA of tls_ca (`sedax certs crl`):
            brokers and clients whose certificate it revokes are refused at the handshake, and those connected
            when a reload (SIGHUP) brings the revocation are cut off.  Needs TLS.
        insecure: plain TCP without TLS: only on a network where every host is trusted.  Without TLS files
            a broker refuses to start unless this is set.
        tokens_file: JSON {"NAME": "sha256:HEX"} of bearer tokens (`sedax certs token`); clients with a
            token authenticate as NAME.  With TLS, clients then need a certificate or a token.
        acl_file: topic ACL rules (broker/acl.py); without one every authenticated identity may do everything.
        max_connections: client and admin connections served at once; more are refused at HELLO
            (too_many_connections).  Broker links do not count.
        max_frame_size: largest frame (bytes) accepted from a client or admin connection.
        max_payload: largest publish payload (bytes); larger ones get NACK too_large.
        max_topic_entries: subscribers plus publishers (of the last day) one topic holds at its primary; a new
            one beyond is refused (topic_full).  At most overlay.pubsub.MAX_TOPIC_ENTRIES, what fits a frame.
        max_memory: bytes the messages this broker stores (every topic, every role) may take in memory, as
            estimated (broker/store.py TopicStore.memory); beyond it new publishes and copies of new messages
            are refused (storage_full) until retention frees room.  0: half of the memory the broker may use
            (the machine's or its container's, broker/memory.py memory_available).
        publish_rate: publishes per second per client identity (token bucket, NACK rate_limited); 0 = no limit.
        publish_burst: how many publishes a client may send at once before the rate applies.
        client_send_buffer: bytes queued for one client that does not read; beyond it `slow_consumer_policy`
            applies, so a slow subscriber never stalls the broker or its peers.
        slow_consumer_policy: "disconnect" (close the session, reason slow_consumer; the client reconnects
            and resumes from its last message) or "drop" (discard frames for it while over the limit).
        idle_timeout: seconds a client or admin connection may go without a request while it holds no
            subscription; 0 = never.
    """

    coord: Coord
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    join: tuple[str, ...] = ()
    bootstrap: bool = False
    node_id: str | None = None
    resilience: int = defaults.RESILIENCE
    retention_seconds: float = defaults.RETENTION_SECONDS
    retention_bytes: int = defaults.RETENTION_BYTES
    retention_topics: tuple[str, ...] = ()
    data_dir: str | None = None
    store: str = "auto"
    fsync: str = "interval:100"
    metrics: str | None = None
    log_dir: str | None = None
    log_interval: float = 5.0
    log_max_bytes: int = DEFAULT_MAX_BYTES
    log_keep: int = DEFAULT_KEEP
    log_run: str = "cluster"
    heartbeat_interval: float = 0.2
    heartbeat_misses: int = 3
    hello_timeout: float = 2.0
    client_timeout: float = 5.0
    connect_timeout: float = 2.0
    join_timeout: float = 10.0
    drain_timeout: float = 2.0
    tombstone_ttl: float = 2.0
    max_hops: int = 64
    space: Space = field(default=UNIT_SQUARE)
    log_level: str = "INFO"
    log_format: str = "text"
    balance: str = "none"
    goal: str = "L3"
    selection: str = "bestlocal"
    queries: int = 10
    hops: int = 1
    balance_interval: float = 5.0
    min_gain: float = 0.05
    max_move_bytes: int = 64 << 20
    balance_scan: int = 1
    ties: str = "random"
    move_cooldown: float = defaults.MOVE_COOLDOWN
    load_report_interval: float = 1.0
    load_report_threshold: float = 0.01
    load_report_refresh: float = 10.0
    query_timeout: float = 1.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_crl: str | None = None
    insecure: bool = False
    tokens_file: str | None = None
    acl_file: str | None = None
    max_connections: int = 1024
    max_frame_size: int = MAX_FRAME_SIZE
    max_payload: int = MAX_PAYLOAD_SIZE
    max_topic_entries: int = MAX_TOPIC_ENTRIES
    max_memory: int = 0
    publish_rate: float = 0.0
    publish_burst: int = 1000
    client_send_buffer: int = 16 << 20
    slow_consumer_policy: str = "disconnect"
    idle_timeout: float = 300.0

    def __post_init__(self) -> None:
        try:
            self.space.validate(self.coord, "coord")
        except BadCoordinate as exc:
            raise ConfigError(str(exc)) from None
        _check_address("listen", self.listen)
        for i, addr in enumerate(self.join):
            _check_address(f"join[{i}]", addr)
        if self.bootstrap and not self.join:
            raise ConfigError(
                "bootstrap starts an overlay only when none of the join addresses has one: give the other "
                "brokers with --join, or leave --bootstrap out (without --join a broker starts an overlay anyway)"
            )
        if self.metrics is not None:
            _check_address("metrics", self.metrics)
        if self.advertise is not None:
            _check_address("advertise", self.advertise)
        if self.resilience not in (1, 2, 3):
            raise ConfigError(f"resilience must be 1, 2 or 3, got {self.resilience}")
        if not (math.isfinite(self.retention_seconds) and self.retention_seconds > 0):
            raise ConfigError(f"retention_seconds must be a positive number, got {self.retention_seconds}")
        if self.retention_bytes < 1:
            raise ConfigError(f"retention_bytes must be at least 1, got {self.retention_bytes}")
        self.retention_policy()  # (each entry parses)
        if self.store not in ("auto", "disk", "memory"):
            raise ConfigError(f"store must be auto, disk or memory, got {self.store!r}")
        if self.store == "disk" and self.data_dir is None:
            raise ConfigError("store disk needs a data directory: pass --data-dir DIR (or set SEDAX_DATA_DIR)")
        try:
            FsyncPolicy.parse(self.fsync)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.heartbeat_misses < 1:
            raise ConfigError(f"heartbeat_misses must be >= 1, got {self.heartbeat_misses}")
        for name in (
            "heartbeat_interval",
            "hello_timeout",
            "client_timeout",
            "connect_timeout",
            "join_timeout",
            "drain_timeout",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.tombstone_ttl) and self.tombstone_ttl >= 0):
            raise ConfigError(f"tombstone_ttl must be >= 0 seconds, got {self.tombstone_ttl}")
        if not 1 <= self.max_hops <= MAX_HOP_LIMIT:
            raise ConfigError(f"max_hops must be in 1..{MAX_HOP_LIMIT}, got {self.max_hops}")
        if self.balance not in ("none", "addition", "continuous", "combined"):
            raise ConfigError(f"balance must be none, addition, continuous or combined, got {self.balance!r}")
        if self.goal not in ("L1", "L2", "L3"):
            raise ConfigError(f"goal must be L1, L2 or L3, got {self.goal!r}")
        if self.selection not in ("indcoord", "bestlocal", "bestregional", "bestglobal"):
            raise ConfigError(
                f"selection must be indcoord, bestlocal, bestregional or bestglobal, got {self.selection!r}"
            )
        if self.ties not in ("random", "first"):
            raise ConfigError(f"ties must be random or first, got {self.ties!r}")
        if not 1 <= self.queries <= 1000:
            raise ConfigError(f"queries must be in 1..1000, got {self.queries}")
        if not 0 <= self.hops <= 64:
            raise ConfigError(f"hops must be in 0..64, got {self.hops}")
        for name in ("balance_interval", "load_report_interval", "load_report_refresh", "query_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.load_report_threshold) and self.load_report_threshold >= 0):
            raise ConfigError(f"load_report_threshold must be a fraction >= 0, got {self.load_report_threshold}")
        if not (math.isfinite(self.move_cooldown) and self.move_cooldown >= 0):
            raise ConfigError(f"move_cooldown must be >= 0 seconds, got {self.move_cooldown}")
        if not (math.isfinite(self.min_gain) and 0 <= self.min_gain < 1):
            raise ConfigError(f"min_gain must be a fraction in [0, 1), got {self.min_gain}")
        if self.balance_scan < 1:
            raise ConfigError(f"balance_scan must be >= 1 (1 = the smallest topic only), got {self.balance_scan}")
        if self.max_move_bytes < 0:
            raise ConfigError(f"max_move_bytes must be >= 0, got {self.max_move_bytes}")
        if not (math.isfinite(self.log_interval) and MIN_LOG_INTERVAL <= self.log_interval <= MAX_LOG_INTERVAL):
            raise ConfigError(
                f"log_interval must be {MIN_LOG_INTERVAL}..{MAX_LOG_INTERVAL} seconds, got {self.log_interval}"
            )
        if self.log_max_bytes < MIN_LOG_BYTES:
            raise ConfigError(f"log_max_bytes must be at least {MIN_LOG_BYTES}, got {self.log_max_bytes}")
        if self.log_keep < 1:
            raise ConfigError(f"log_keep must be at least 1 (the current file), got {self.log_keep}")
        if not (0 < len(self.log_run) <= MAX_RUN_LEN and self.log_run.isprintable()):
            raise ConfigError(f"log_run must be 1..{MAX_RUN_LEN} printable characters, got {self.log_run!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be {' or '.join(LOG_FORMATS)}, got {self.log_format!r}")
        self._check_security()

    def retention_policy(self) -> RetentionPolicy:
        """What this broker keeps of each topic: retention_topics' rules over retention_seconds/_bytes."""
        try:
            rules = tuple(RetentionRule.parse(text) for text in self.retention_topics)
        except BadRetentionRule as exc:
            raise ConfigError(str(exc)) from None
        return RetentionPolicy(Retention(self.retention_seconds, self.retention_bytes), rules)

    def _check_security(self) -> None:
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        given = [k for k, v in tls.items() if v is not None]
        if given and len(given) < 3:
            missing = ", ".join(k for k in tls if k not in given)
            raise ConfigError(f"tls_cert, tls_key and tls_ca go together: {missing} missing")
        if self.tls_crl is not None and not given:
            raise ConfigError("tls_crl needs TLS: give tls_cert, tls_key and tls_ca too, or drop tls_crl")
        if given and self.insecure:
            raise ConfigError(
                "insecure turns TLS off but tls_cert/tls_key/tls_ca are set: drop one or the other "
                "(is SEDAX_INSECURE set in the environment?)"
            )
        if not 1 <= self.max_connections <= 1_000_000:
            raise ConfigError(f"max_connections must be in 1..1000000, got {self.max_connections}")
        if not MIN_FRAME_SIZE <= self.max_frame_size <= MAX_FRAME_SIZE:
            raise ConfigError(
                f"max_frame_size must be in {MIN_FRAME_SIZE}..{MAX_FRAME_SIZE}, got {self.max_frame_size}"
            )
        if not 0 <= self.max_payload <= MAX_PAYLOAD_SIZE:
            raise ConfigError(f"max_payload must be in 0..{MAX_PAYLOAD_SIZE}, got {self.max_payload}")
        if not 1 <= self.max_topic_entries <= MAX_TOPIC_ENTRIES:
            raise ConfigError(
                f"max_topic_entries must be in 1..{MAX_TOPIC_ENTRIES} (what a frame between brokers holds), "
                f"got {self.max_topic_entries}"
            )
        if self.max_memory < 0:
            raise ConfigError(
                f"max_memory must be >= 0 bytes (0 = half of this machine's memory), got {self.max_memory}"
            )
        if not (math.isfinite(self.publish_rate) and self.publish_rate >= 0):
            raise ConfigError(f"publish_rate must be >= 0 publishes per second (0 = no limit), got {self.publish_rate}")
        if self.publish_burst < 1:
            raise ConfigError(f"publish_burst must be at least 1, got {self.publish_burst}")
        if self.client_send_buffer < MIN_FRAME_SIZE:
            raise ConfigError(
                f"client_send_buffer must be at least {MIN_FRAME_SIZE} bytes, got {self.client_send_buffer}"
            )
        if self.slow_consumer_policy not in SLOW_CONSUMER_POLICIES:
            raise ConfigError(
                f"slow_consumer_policy must be {' or '.join(SLOW_CONSUMER_POLICIES)}, got {self.slow_consumer_policy!r}"
            )
        if not (math.isfinite(self.idle_timeout) and self.idle_timeout >= 0):
            raise ConfigError(f"idle_timeout must be >= 0 seconds (0 = never), got {self.idle_timeout}")

    @property
    def on_disk(self) -> bool:
        """True if topics are kept in data_dir (docs/storage.md)."""
        return self.data_dir is not None and self.store != "memory"

    @property
    def fsync_policy(self) -> FsyncPolicy:
        return FsyncPolicy.parse(self.fsync)

    @property
    def tls(self) -> bool:
        """True if the broker speaks TLS (its certificate, key and CA are configured)."""
        return self.tls_cert is not None


def _check_address(name: str, value: str) -> None:
    try:
        parse_address(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


# ----------------------------------------------------------------------------------------------- parsing


def _to_coord(value: object) -> Coord:
    if isinstance(value, str):
        parts = value.split(",")
        if len(parts) != 2:
            raise ConfigError(f"coord must be written X,Y, got {value!r}")
        try:
            return (float(parts[0]), float(parts[1]))
        except ValueError:
            raise ConfigError(f"coord must be two numbers X,Y, got {value!r}") from None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        try:
            return (float(value[0]), float(value[1]))
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"coord must be X,Y or a pair of numbers, got {value!r}")


def _to_space(value: object) -> Space:
    if isinstance(value, Space):
        return value
    parts: Sequence[object]
    if isinstance(value, str):
        parts = value.split(",")
    elif isinstance(value, (list, tuple)):
        parts = value
    else:
        raise ConfigError(f"space must be XMIN,YMIN,XMAX,YMAX, got {value!r}")
    try:
        nums = [float(str(p)) for p in parts]
    except ValueError:
        raise ConfigError(f"space must be four numbers XMIN,YMIN,XMAX,YMAX, got {value!r}") from None
    if len(nums) != 4:
        raise ConfigError(f"space must have four numbers XMIN,YMIN,XMAX,YMAX, got {value!r}")
    try:
        return Space(*nums)
    except BadCoordinate as exc:
        raise ConfigError(f"space: {exc}") from None


def _to_join(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(",") if p.strip()) if value else ()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"join must be a list of HOST:PORT addresses, got {value!r}")


def _to_retention_topics(value: object) -> tuple[str, ...]:
    # (Patterns hold no whitespace, so a variable separates the entries by it.)
    if isinstance(value, str):
        return tuple(value.split())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"retention_topics must be a list of PATTERN=SECONDS[,BYTES] entries, got {value!r}")


def _to_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None


def _to_float(name: str, value: object) -> float:
    what = _NOT_SECONDS.get(name, "a number of seconds")
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {what}, got {value!r}") from None


def _to_opt_str(name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


_INT_FIELDS: Final = frozenset(
    {
        "resilience",
        "heartbeat_misses",
        "max_hops",
        "retention_bytes",
        "queries",
        "hops",
        "max_move_bytes",
        "balance_scan",
        "log_max_bytes",
        "log_keep",
        "max_connections",
        "max_frame_size",
        "max_payload",
        "max_topic_entries",
        "max_memory",
        "publish_burst",
        "client_send_buffer",
    }
)
_FLOAT_FIELDS: Final = frozenset(
    {
        "heartbeat_interval",
        "hello_timeout",
        "client_timeout",
        "connect_timeout",
        "join_timeout",
        "drain_timeout",
        "tombstone_ttl",
        "retention_seconds",
        "balance_interval",
        "min_gain",
        "move_cooldown",
        "load_report_interval",
        "load_report_threshold",
        "load_report_refresh",
        "query_timeout",
        "log_interval",
        "publish_rate",
        "idle_timeout",
    }
)
# The float settings that are not durations, and what they are.
_NOT_SECONDS: Final = {
    "min_gain": "a number (a fraction of the load, e.g. 0.05)",
    "load_report_threshold": "a number (a fraction of the load, e.g. 0.01)",
    "publish_rate": "a number of publishes per second",
}
_OPT_STR_FIELDS: Final = frozenset(
    {
        "metrics",
        "log_dir",
        "node_id",
        "advertise",
        "tls_cert",
        "tls_key",
        "tls_ca",
        "tls_crl",
        "tokens_file",
        "acl_file",
        "data_dir",
    }
)
FIELD_NAMES: Final = tuple(f.name for f in fields(BrokerConfig))

# What SIGHUP may change in a running broker (docs/security.md, "Reloading without a restart"): the security
# files and the per-client limits, which are read where they are used.  Anything else changes only with a
# restart; a reload that would change it is refused whole.
RELOADABLE: Final = frozenset(
    {
        "tls_cert",
        "tls_key",
        "tls_ca",
        "tls_crl",
        "tokens_file",
        "acl_file",
        "publish_rate",
        "publish_burst",
        "max_connections",
        "retention_seconds",
        "retention_bytes",
        "retention_topics",
        "max_payload",
        "max_frame_size",
        "client_send_buffer",
        "slow_consumer_policy",
        "idle_timeout",
        "log_level",
        "log_format",
    }
)
# Files that, given or not, decide how the broker admits anyone: turning one on or off takes a restart.
_SWITCHES: Final = (("tls_cert", "TLS"), ("tokens_file", "tokens"), ("acl_file", "an ACL"))


def changed_settings(old: BrokerConfig, new: BrokerConfig) -> tuple[str, ...]:
    """The names of the settings whose values differ, in field order."""
    return tuple(name for name in FIELD_NAMES if getattr(old, name) != getattr(new, name))


def reload_problem(old: BrokerConfig, new: BrokerConfig) -> str | None:
    """Why a running broker configured as `old` cannot take `new` by a reload (None if it can)."""
    fixed = [name for name in changed_settings(old, new) if name not in RELOADABLE]
    if fixed:
        return (
            f"{', '.join(fixed)} changed, which takes effect only at a restart: restart the broker, or undo that "
            f"change and send SIGHUP again (what a reload changes: {', '.join(sorted(RELOADABLE))})"
        )
    for name, what in _SWITCHES:
        if (getattr(old, name) is None) != (getattr(new, name) is None):
            now = "given" if getattr(new, name) is not None else "left out"
            return f"{name} is now {now}: turning {what} on or off takes a restart of the broker"
    return None


def _to_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
    raise ConfigError(f"{name} must be true or false (1/0, yes/no, on/off), got {value!r}")


def _to_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


def _convert_one(name: str, value: object) -> object:
    if name == "space":
        return _to_space(value)
    if name == "coord":
        return _to_coord(value)
    if name == "join":
        return _to_join(value)
    if name == "retention_topics":
        return _to_retention_topics(value)
    if name in _INT_FIELDS:
        return _to_int(name, value)
    if name in _FLOAT_FIELDS:
        return _to_float(name, value)
    if name in _OPT_STR_FIELDS:
        return _to_opt_str(name, value)
    if name in ("insecure", "bootstrap"):
        return _to_bool(name, value)
    if name in (
        "listen",
        "log_level",
        "log_format",
        "balance",
        "goal",
        "selection",
        "ties",
        "log_run",
        "slow_consumer_policy",
        "store",
        "fsync",
    ):
        return _to_str(name, value)
    raise ConfigError(f"unknown setting {name!r}; known: {', '.join(FIELD_NAMES)}")


def _convert(raw: Mapping[str, object], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in raw.items():
        try:
            out[name] = _convert_one(name, value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return out


def read_config_file(path: str | Path) -> dict[str, object]:
    """The settings of a JSON or TOML file (by suffix), keys as BrokerConfig fields ("-" allowed for "_")."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        data: object = tomllib.loads(text.decode()) if p.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("broker"), dict):
        data = data["broker"]
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table/object of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def env_settings(env: Mapping[str, str]) -> dict[str, object]:
    """Settings from SEDAX_<FIELD> variables (e.g. SEDAX_COORD=0.5,0.5, SEDAX_JOIN=h:p,h:p)."""
    out: dict[str, object] = {}
    for name in FIELD_NAMES:
        key = ENV_PREFIX + name.upper()
        if key in env:
            out[name] = env[key]
    return out


def build_config(
    flags: Mapping[str, object], env: Mapping[str, str] | None = None, config_file: str | Path | None = None
) -> BrokerConfig:
    """Merge defaults < config file < environment < flags (None flags are unset) into a BrokerConfig."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    file_path = config_file if config_file is not None else env.get(ENV_PREFIX + "CONFIG")
    if file_path:
        merged.update(_convert(read_config_file(file_path), f"config file {file_path}"))
    merged.update(_convert(env_settings(env), "environment"))
    merged.update(_convert({k: v for k, v in flags.items() if v is not None}, "command line"))
    if "coord" not in merged:
        raise ConfigError("coord is required: pass --coord X,Y, set SEDAX_COORD or put coord in the config file")
    try:
        return BrokerConfig(**merged)
    except BadCoordinate as exc:
        raise ConfigError(str(exc)) from None


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> BrokerConfig:
    """Build the config from parsed `add_broker_arguments` flags."""
    flags = {name: getattr(args, name, None) for name in FIELD_NAMES}
    if flags.get("join") is not None:
        flags["join"] = tuple(a for item in args.join for a in item.split(",") if a)
    return build_config(flags, env, getattr(args, "config_file", None))
