"""Prometheus exposition of one broker (`--metrics HOST:PORT`, GET /metrics; names in docs/metrics.md).

Almost everything is read at scrape time from what the broker keeps anyway (its counters, the pub/sub
counters, loads, topics and links), so serving metrics costs the forwarding and pub/sub paths nothing.  The
four distributions (hops of routed messages, publish-to-ACK latency, heal time, event-loop lag) need a measurement where
they happen: `Buckets` is a plain count array (one bisect per observation) that the collector turns into a
Prometheus histogram when scraped.

The endpoint is served on the broker's own event loop, so a scrape reads a consistent state without locks;
each broker has its own `CollectorRegistry` (several brokers may share a process in tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from broker.guard import COUNTERS as GUARD_COUNTERS
from broker.stats import Buckets, Observed, TopicCensus
from broker.version import VERSION
from overlay.protocol import format_address, parse_address

# Topic roles always exported (0 when none is held), so dashboards see every series from the start; other
# roles the pub/sub layer reports appear as they occur.
ROLES: Final = ("primary", "secondary", "tertiary", "home", "delegate")
# A scrape request's head must arrive within this time and fit this size; anything else is answered 4xx.
REQUEST_TIMEOUT: Final = 5.0
MAX_REQUEST_HEAD: Final = 8192

log = logging.getLogger("sedax.metrics")


# ------------------------------------------------------------------------------------------- collector

# Replica states always exported (broker/pubsub/replica.py OPERATOR_STATE), 0 when none is in them.
REPLICA_STATES: Final = ("caught_up", "backfilling", "recovering", "syncing", "retiring")
# Counter keys (Observed.counter_values) with their exported names (without `_total`) and help texts.
COUNTERS: Final[Mapping[str, tuple[str, str]]] = {
    "forwarded": ("sedax_forwarded_messages", "Routed messages this broker passed on toward their destination."),
    "forwarded_bytes": ("sedax_forwarded_bytes", "Bytes of the routed messages this broker passed on."),
    "routed_delivered": (
        "sedax_routed_delivered_messages",
        "Routed messages that ended at this broker (the closest to their destination), pub/sub and control.",
    ),
    "routed_held": (
        "sedax_routed_held_messages",
        "Routed messages held because a known broker was closer than this one but no link led there yet, or"
        " because the link to their next hop had just broken.",
    ),
    "routed_held_expired": (
        "sedax_routed_held_expired_messages",
        "Held routed messages whose hold ran out (routing.HOLD_FOR): handled here if no link led closer by then,"
        " dropped if their next hop's link was still broken.",
    ),
    "failures_detected": ("sedax_failures_detected", "Neighbour brokers this broker found dead (reset, silence)."),
    "suspicions_refuted": (
        "sedax_suspicions_refuted",
        "Silent links whose peer a common neighbour still heard: no failover, traffic detoured (false ones avoided).",
    ),
    "joins_accepted": ("sedax_joins_accepted", "Brokers this broker admitted to the overlay (it was their closest)."),
    "published": ("sedax_published_messages", "Messages stored here as the topics' primary."),
    "published_bytes": ("sedax_published_bytes", "Payload bytes stored here as the topics' primary."),
    "delivered": ("sedax_delivered_messages", "Messages sent to subscribers by this broker as primary."),
    "delivered_bytes": ("sedax_delivered_bytes", "Payload bytes sent to subscribers by this broker as primary."),
    "acked": ("sedax_acked_messages", "Messages this broker acknowledged to their publishers as primary."),
    "duplicates": ("sedax_duplicate_publishes", "Re-sent publishes this broker had stored already."),
    "takeovers": ("sedax_takeovers", "Topics this broker took over as the new primary after a failure or leave."),
    "handovers": (
        "sedax_handovers",
        "PULLs of a topic this broker answered (a new closest broker, a take-over, an offer's gap).",
    ),
    "replicated_batches": ("sedax_replicated_batches", "Replication batches sent to secondaries."),
    "replicated_pipelined": (
        "sedax_replicated_pipelined_batches",
        "Replication batches sent while an earlier one of the topic was still unconfirmed (pipelined).",
    ),
    "replication_resends": (
        "sedax_replication_resends",
        "Replication time-outs after which a primary sent every unconfirmed record of a topic again.",
    ),
    "replicate_without_meta": (
        "sedax_replicate_without_meta",
        "Records-only replication batches left unconfirmed by a copy that lacked the topic's subscribers and "
        "publisher table (the primary's re-send carries them).",
    ),
    "syncs": ("sedax_syncs", "Pulls a new, returning or taking-over primary finished before serving a topic."),
    "offers": (
        "sedax_offers",
        "Offers of held records to a topic's holders (retiring, demoted, shutdown, back-fill, repair).",
    ),
    "anti_entropy_offers": (
        "sedax_anti_entropy_offers",
        "Of the offers, those of a primary's anti-entropy rounds: a digest compared with the secondary's.",
    ),
    "synced_records": ("sedax_synced_records", "Records sent to another holder that lacked them (re-sync, hand-off)."),
    "reverse_offers": (
        "sedax_reverse_offers",
        "Offers of records this copy keeps and its primary did not, sent back to the primary (anti-entropy).",
    ),
    "topic_full": (
        "sedax_topic_full_refusals",
        "New subscribers and publishers this primary refused: the topic held --max-topic-entries (topic_full).",
    ),
    "copies_refused": (
        "sedax_copies_refused",
        "Copies this broker could not store (its data directory full, or its memory over --max-memory), answered "
        "with a refusal: the primary refuses new publishes of the topic with storage_full until a copy confirms "
        "again.",
    ),
    "empty_forgotten": (
        "sedax_empty_topics_forgotten",
        "Replicas of topics with nothing in them (no message, publisher or subscriber) this broker forgot.",
    ),
    "relocations": (
        "sedax_relocations",
        "Copies a move left behind (down during it, or back from a restart) that followed the topic where it lives.",
    ),
    "coalesced": (
        "sedax_coalesced_publishes",
        "One-message PUBLISH frames a client sent in one read with the one before, handled as one batch with it.",
    ),
    "resubscribed": (
        "sedax_resubscribed",
        "Local sessions' subscriptions this access broker registered again at the broker that became their topic's "
        "primary (a view change).",
    ),
    "heads": (
        "sedax_heads",
        "HEADS this primary sent, one per topic and round to all its subscribers: quiet publishers' newest seqs, "
        "or empty for an idle topic.",
    ),
    "restamped": (
        "sedax_restamped_records",
        "Stored records a merge stamped later, to keep a publisher's messages in seq order (two holders stored them).",
    ),
    "lost": ("sedax_lost_messages", "Acknowledged messages found lost (more failures than the level survives)."),
    "delegations": ("sedax_delegations", "Topic hand-overs this broker activated as the new primary (Sec. III)."),
    "moves": ("sedax_moves", "Topics this broker moved away to a new coordinate (Alg. 2 or an operator)."),
    "moves_aborted": ("sedax_moves_aborted", "Moves this broker abandoned (lease refused or no confirmation)."),
    "moved_bytes": ("sedax_moved_load_bytes", "Topic load moved away from this broker by delegation or balancing."),
    "balance_queries": ("sedax_balance_queries", "Coordinate queries this broker sent (Sec. V)."),
    "balance_query_bytes": ("sedax_balance_query_bytes", "Bytes of the coordinate queries sent."),
    "balance_offers": ("sedax_balance_offers", "Coordinate offers this broker answered queries with."),
    "balance_offer_bytes": ("sedax_balance_offer_bytes", "Bytes of the coordinate offers sent."),
    "load_reports_sent": ("sedax_load_reports", "Load reports sent to neighbours."),
    "load_report_bytes": ("sedax_load_report_bytes", "Bytes of the load reports sent to neighbours."),
    "heartbeat_pings": (
        "sedax_heartbeat_pings",
        "PINGs sent to keep links alive (only on links with nothing else to send, by one end of a broker link).",
    ),
    "balance_rounds": ("sedax_balance_rounds", "Balancing rounds (Alg. 2) this broker ran."),
    "balance_decisions_move": (
        "sedax_balance_decisions_move",
        "Alg. 2 rounds that chose to move a topic (moves_aborted counts those that then did not happen).",
    ),
    "placements": (
        "sedax_placements",
        "New topics Alg. 1 placed at a better coordinate than their hash h(t), as the topic's home broker.",
    ),
    "forwarded_requests": (
        "sedax_forwarded_requests",
        "Pub/sub requests for a topic that lives elsewhere this broker sent on (its delegate coordinate, where it "
        "moved, its home).",
    ),
}
# The guard's security and limit counters keep their STATUS names (broker/guard.py has their help texts).
SECURITY: Final[Mapping[str, tuple[str, str]]] = {key: (f"sedax_{key}", doc) for key, doc in GUARD_COUNTERS.items()}
# Exported from the start (0 until something happens), so dashboards see every series at once.
ALWAYS: Final = ("delegations", "moved_bytes", "balance_queries", "balance_query_bytes")
DROPS: Final = {
    "dropped_hop_limit": "hop_limit",
    "dropped_bad_body": "bad_body",
    "dropped_no_route": "no_route",
    "dropped_too_large": "too_large",
}
_NAME_SAFE = re.compile(r"[^a-zA-Z0-9_]")


class BrokerCollector:
    """A prometheus_client collector that reads a broker's state at scrape time."""

    def __init__(self, broker: Observed) -> None:
        self.b = broker
        # The topics counted for the scrape in progress (MetricsServer awaits the census before it collects: at
        # 10^5 topics counting them at once in `collect` held the broker's event loop for ~0.2 s).
        self.census: TopicCensus | None = None

    def collect(self) -> Iterator[Metric]:
        """Every metric of docs/metrics.md, from the broker's current state."""
        b = self.b
        info = GaugeMetricFamily(
            "sedax_node_info", "This broker: node id and address (value 1).", labels=["node", "listen"]
        )
        info.add_metric([b.node_id, b.info.listen], 1.0)
        yield info
        build = GaugeMetricFamily(
            "sedax_build_info", "The sedax version this broker runs (value 1).", labels=["version"]
        )
        build.add_metric([VERSION], 1.0)
        yield build
        coord = GaugeMetricFamily("sedax_node_coordinate", "The broker's coordinate C(v).", labels=["axis"])
        coord.add_metric(["x"], b.info.coord[0])
        coord.add_metric(["y"], b.info.coord[1])
        yield coord
        yield GaugeMetricFamily("sedax_resilience_level", "Configured resilience level.", value=b.config.resilience)

        loads = GaugeMetricFamily(
            "sedax_node_load_bytes", "Node load L1_N, L2_N, L3_N (eqs. 1, 2, 4) in stored bytes.", labels=["level"]
        )
        for level, value in sorted(b.loads().items()):
            loads.add_metric([level], float(value))
        yield loads

        census = self.census if self.census is not None else TopicCensus()
        counts = dict.fromkeys(ROLES, 0) | census.roles
        sizes = dict.fromkeys(ROLES, 0) | census.stored
        topics = GaugeMetricFamily("sedax_topics", "Topics held, by this broker's role for them.", labels=["role"])
        stored = GaugeMetricFamily(
            "sedax_topic_stored_bytes", "Bytes stored of the topics held, by role.", labels=["role"]
        )
        for role in counts:
            topics.add_metric([role], float(counts[role]))
            stored.add_metric([role], float(sizes[role]))
        yield topics
        yield stored

        states = dict.fromkeys(REPLICA_STATES, 0) | census.states
        behind, pending = census.behind, census.pending
        replicas = GaugeMetricFamily(
            "sedax_topic_replicas",
            "Topic replicas held, by state with the other holders "
            "(caught_up, backfilling, recovering, syncing, retiring, ...).",
            labels=["state"],
        )
        for state, n in states.items():
            replicas.add_metric([state], float(n))
        yield replicas
        yield GaugeMetricFamily(
            "sedax_replication_behind_bytes",
            "Bytes stored here not yet confirmed by the other holders (unconfirmed batches, records still offered).",
            value=behind,
        )
        yield GaugeMetricFamily(
            "sedax_sync_pending",
            "Pulls and offers under way between this broker and a topic's other holders.",
            value=pending,
        )

        g = b.gauges()
        yield GaugeMetricFamily(
            "sedax_neighbours", "Established links to Delaunay neighbours.", value=len(g.neighbours)
        )
        yield GaugeMetricFamily("sedax_links", "Open connections (brokers, clients, admin tools).", value=g.links)
        yield GaugeMetricFamily("sedax_sessions", "Attached client sessions.", value=g.sessions)
        yield GaugeMetricFamily(
            "sedax_stored_memory_bytes",
            "Memory the topics held and their stored messages take, estimated (payload, publisher id and 240 B "
            "per message, 3,800 B per topic); over sedax_max_memory_bytes new publishes are refused with "
            "storage_full.",
            value=g.stored_memory,
        )
        yield GaugeMetricFamily("sedax_max_memory_bytes", "The broker's --max-memory, in bytes.", value=g.max_memory)
        disk = _disk(b.config.data_dir) if b.config.on_disk else None  # (with --store memory it is unused)
        if disk is not None:
            yield GaugeMetricFamily(
                "sedax_data_dir_free_bytes",
                "Bytes the broker may still write to the file system of its --data-dir (statvfs f_bavail): at 0 it"
                " refuses publishes and copies (storage_full).",
                value=disk[0],
            )
            yield GaugeMetricFamily(
                "sedax_data_dir_size_bytes",
                "Size of the file system of the broker's --data-dir (statvfs f_blocks).",
                value=disk[1],
            )
        if g.certificate_expires:
            yield GaugeMetricFamily(
                "sedax_tls_certificate_expiry_timestamp_seconds",
                "When the broker's TLS certificate, or the CA that issued it if earlier, expires (notAfter, Unix "
                "time): alert well before it; renew the certificate and send the broker SIGHUP.",
                value=g.certificate_expires,
            )
        if g.crl_next_update:
            yield GaugeMetricFamily(
                "sedax_tls_crl_next_update_timestamp_seconds",
                "When the first CRL of --tls-crl is due (its nextUpdate, Unix time): past it every new link and client"
                " fails its handshake; write a fresh CRL and send the broker SIGHUP.",
                value=g.crl_next_update,
            )

        yield GaugeMetricFamily(
            "sedax_last_reload_successful",
            "1 if the last reload (SIGHUP) took effect or none was asked for, 0 if it was refused: the broker runs on"
            " its earlier files and settings; its log says what was wrong.",
            value=float(g.last_reload_ok),
        )

        values = b.counter_values()
        drops = CounterMetricFamily("sedax_dropped_messages", "Routed messages dropped, by reason.", labels=["reason"])
        for key, reason in DROPS.items():
            drops.add_metric([reason], float(values.pop(key, 0)))
        yield drops
        for key in ALWAYS:
            values.setdefault(key, 0)
        for key, value in values.items():
            name, doc = (
                COUNTERS.get(key)
                or SECURITY.get(key)
                or (f"sedax_{_NAME_SAFE.sub('_', key)}", f"Pub/sub counter {key!r}.")
            )
            yield CounterMetricFamily(name, doc, value=float(value))
        yield CounterMetricFamily(
            "sedax_untimed_publishes", "Publishes not timed because too many were waiting.", value=b.stats.acks.untimed
        )

        s = b.stats
        yield _histogram("sedax_routed_hops", "Hops of the routed messages that ended at this broker.", s.hops)
        yield _histogram(
            "sedax_publish_ack_latency_seconds",
            "From a client's PUBLISH arriving at this (access) broker to its ACK going back.",
            s.ack_latency,
        )
        yield _histogram(
            "sedax_heal_seconds",
            "From detecting a neighbour's failure to linking all desired neighbours again.",
            s.heal,
        )
        yield _histogram(
            "sedax_event_loop_lag_seconds",
            "How late each heartbeat tick ran: the event loop was busy. Neighbours take a broker silent for the "
            "heartbeat window (interval x misses) for dead.",
            s.loop_lag,
        )


def _disk(path: str | None) -> tuple[int, int] | None:
    """(bytes free to an unprivileged writer, bytes in all) of the file system holding path; None without a path or
    if it cannot be read (the directory was removed or unmounted: the scrape goes on without these two)."""
    if path is None:
        return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _histogram(name: str, doc: str, buckets: Buckets) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=buckets.cumulative(), sum_value=buckets.total)


# ---------------------------------------------------------------------------------------------- server


class MetricsServer:
    """GET /metrics (and /healthz, /readyz) over HTTP/1.x on the broker's loop; one response per connection."""

    def __init__(self, broker: Observed) -> None:
        self._broker = broker
        self.registry = CollectorRegistry()
        self._collector = BrokerCollector(broker)
        self.registry.register(self._collector)
        # The standard process_* series (CPU seconds, resident memory, open and allowed file descriptors, start
        # time), read from /proc at each scrape: what every Prometheus exporter gives, and what an operator
        # compares brokers by.
        ProcessCollector(registry=self.registry)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self, address: str) -> str:
        """Listen on address ("host:port", port 0 = any); returns the bound "host:port"."""
        host, port = parse_address(address)
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_REQUEST_HEAD)
        self.address = format_address(host, int(self._server.sockets[0].getsockname()[1]))
        return self.address

    async def close(self) -> None:
        """Stop listening and end the scrapes in progress."""
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            status, ctype, body = await self._respond(reader)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + body)
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await writer.drain()
        except (OSError, TimeoutError):
            pass  # the scraper went away; nothing to answer
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(REQUEST_TIMEOUT):
                    await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return "431 Request Header Fields Too Large", text, f"request head over {MAX_REQUEST_HEAD} bytes\n".encode()
        except (asyncio.IncompleteReadError, TimeoutError):
            return "400 Bad Request", text, b"incomplete HTTP request\n"
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return "400 Bad Request", text, b"expected an HTTP/1.x request line: GET /metrics HTTP/1.1\n"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method != b"GET":
            return "405 Method Not Allowed", text, b"only GET /metrics, /healthz and /readyz are served\n"
        if target in (b"/healthz", b"/readyz"):
            # For probes (Kubernetes, Nomad, a load balancer) that cannot speak the broker's protocol, as nats-server's
            # /healthz: alive = the loop answers and its timers run; ready = also part of the overlay, not leaving.
            why = self._broker.unhealthy() if target == b"/healthz" else self._broker.unready()
            if why is None:
                return "200 OK", text, b"ok\n"
            return "503 Service Unavailable", text, f"{why}\n".encode()
        if target != b"/metrics":
            return "404 Not Found", text, b"metrics are at /metrics (health at /healthz and /readyz)\n"
        try:
            self._collector.census = await self._broker.topic_census()
            body = generate_latest(self.registry)
        except Exception:
            log.exception("collecting metrics failed")
            return "500 Internal Server Error", text, b"collecting metrics failed; see the broker's log\n"
        return "200 OK", CONTENT_TYPE_LATEST, body
