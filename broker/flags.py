"""The broker's command-line flags, without importing the geometry stack (so `sedax --help` stays fast)."""

from __future__ import annotations

import argparse
from typing import Final, NoReturn

EXIT_USAGE: Final = 2  # the command line is wrong; the message says how to write it

SIGNALS_HELP = (
    "signals: SIGTERM or SIGINT (Ctrl-C) hands the broker's topics on and leaves the overlay; SIGHUP reads the "
    "--config file, the TLS files, --tokens and --acl again and applies them with the per-client limits, "
    "without a restart (docs/security.md)"
)


class Parser(argparse.ArgumentParser):
    """argparse with the house's usage error: one line that says what is wrong and where the options are listed
    (exit 2), not the whole usage above it (forty lines for `sedax broker`, where the error was the last).
    Subcommands' parsers are made of this class too (argparse gives subparsers their parent's class).  Here, below
    both entry points of a broker (`sedax broker`, `python -m broker`), so the two refuse a flag alike."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; `{self.prog} --help` lists the options\n")


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The broker's command-line flags (shared by `python -m broker` and `sedax broker`), and its signals."""
    parser.epilog = SIGNALS_HELP
    parser.add_argument("--coord", help="coordinate X,Y of this broker (env SEDAX_COORD)")
    parser.add_argument("--listen", help="HOST:PORT to listen on, port 0 = any (default 127.0.0.1:0)")
    parser.add_argument("--advertise", help="HOST:PORT peers dial to reach this broker (default: listen)")
    parser.add_argument("--join", action="append", help="HOST:PORT of a running broker to join through (repeatable)")
    parser.add_argument(
        "--bootstrap",
        action="store_true",
        default=None,
        help="with --join: start a new overlay if no join address is part of one (the cluster's first broker)",
    )
    parser.add_argument("--node-id", dest="node_id", help="node id (default: generated)")
    parser.add_argument(
        "--resilience", type=int, choices=(1, 2, 3), help="resilience level: survive 0, 1 or 2 failures (default 2)"
    )
    parser.add_argument("--retention-seconds", dest="retention_seconds", type=float, help="keep messages (3600)")
    parser.add_argument("--retention-bytes", dest="retention_bytes", type=int, help="per topic (64 MiB)")
    parser.add_argument(
        "--retention-topic",
        dest="retention_topics",
        action="append",
        metavar="PATTERN=SECONDS[,BYTES]",
        help="another retention for the topics PATTERN matches, e.g. 'grid/+/pmu/#=600,16777216' (repeatable; "
        "the first match decides)",
    )
    st = parser.add_argument_group("storage (docs/storage.md)")
    st.add_argument(
        "--data-dir",
        dest="data_dir",
        metavar="DIR",
        help="keep topics on disk here (env SEDAX_DATA_DIR; default: memory)",
    )
    st.add_argument("--store", choices=("auto", "disk", "memory"), help="auto: on disk when --data-dir is given (auto)")
    st.add_argument(
        "--fsync",
        metavar="POLICY",
        help="always | batch | interval:MS | never: when records are forced to the disk (interval:100)",
    )
    parser.add_argument("--metrics", help="HOST:PORT for the Prometheus endpoint")
    parser.add_argument("--log-dir", dest="log_dir", help="directory for the metrics log (docs/logs.md)")
    parser.add_argument("--log-interval", dest="log_interval", type=float, help="seconds between snapshots (5.0)")
    parser.add_argument("--log-max-bytes", dest="log_max_bytes", type=int, help="rotate the log at (64 MiB)")
    parser.add_argument("--log-keep", dest="log_keep", type=int, help="log files kept (5)")
    parser.add_argument("--log-run", dest="log_run", help="`run` name of this cluster lifetime (cluster)")
    parser.add_argument("--heartbeat-interval", dest="heartbeat_interval", type=float, help="seconds (0.2)")
    parser.add_argument("--heartbeat-misses", dest="heartbeat_misses", type=int, help="missed pings (3)")
    parser.add_argument("--hello-timeout", dest="hello_timeout", type=float, help="seconds (2.0)")
    parser.add_argument(
        "--client-timeout", dest="client_timeout", type=float, help="seconds a silent client is kept (5.0)"
    )
    parser.add_argument("--connect-timeout", dest="connect_timeout", type=float, help="seconds (2.0)")
    parser.add_argument("--join-timeout", dest="join_timeout", type=float, help="seconds (10.0)")
    parser.add_argument("--max-hops", dest="max_hops", type=int, help="hop limit of routed frames (64)")
    parser.add_argument("--space", help="XMIN,YMIN,XMAX,YMAX (default 0,0,1,1)")
    parser.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument(
        "--log-format",
        dest="log_format",
        choices=("text", "json"),
        help="stderr log lines as text (default) or one JSON object each (ts, level, node, logger, message)",
    )
    parser.add_argument("--config", dest="config_file", help="JSON or TOML settings file")
    parser.add_argument(
        "--check",
        action="store_true",
        help="read and check the configuration and the TLS, tokens and ACL files it names, then exit: 0 and a "
        "summary, or 2 and what is wrong (starts nothing, so it is safe beside the running broker; a unit runs "
        "it before each reload)",
    )
    lb = parser.add_argument_group("load balancing (Sec. V, VI)")
    lb.add_argument("--balance", choices=("none", "addition", "continuous", "combined"), help="when (none)")
    lb.add_argument("--goal", choices=("L1", "L2", "L3"), help="node load to equalise (L3)")
    lb.add_argument("--selection", choices=("indcoord", "bestlocal", "bestregional", "bestglobal"), help="(bestlocal)")
    lb.add_argument("--queries", type=int, help="n_queries per decision (10)")
    lb.add_argument("--hops", type=int, help="n_hops of bestregional (1)")
    lb.add_argument("--balance-interval", dest="balance_interval", type=float, help="Δτ in seconds (5.0)")
    lb.add_argument("--min-gain", dest="min_gain", type=float, help="least L_max reduction, fraction (0.05)")
    lb.add_argument("--max-move-bytes", dest="max_move_bytes", type=int, help="largest topic moved (64 MiB)")
    lb.add_argument(
        "--balance-scan", dest="balance_scan", type=int, help="smallest topics one round may try, 1 = paper's (1)"
    )
    lb.add_argument("--ties", choices=("random", "first"), help="among equally best coordinates (random)")
    lb.add_argument("--move-cooldown", dest="move_cooldown", type=float, help="seconds between moves (30)")
    lb.add_argument(
        "--load-report-interval", dest="load_report_interval", type=float, help="seconds between change checks (1.0)"
    )
    lb.add_argument(
        "--load-report-threshold",
        dest="load_report_threshold",
        type=float,
        help="relative load change that triggers a report (0.01)",
    )
    lb.add_argument(
        "--load-report-refresh", dest="load_report_refresh", type=float, help="seconds between unchanged reports (10)"
    )
    lb.add_argument("--query-timeout", dest="query_timeout", type=float, help="seconds (1.0)")
    g = parser.add_argument_group("security (TLS is required unless --insecure)")
    g.add_argument("--tls-cert", dest="tls_cert", metavar="FILE", help="this broker's certificate (sedax certs issue)")
    g.add_argument("--tls-key", dest="tls_key", metavar="FILE", help="its private key")
    g.add_argument("--tls-ca", dest="tls_ca", metavar="FILE", help="the cluster CA certificate")
    g.add_argument(
        "--tls-crl", dest="tls_crl", metavar="FILE", help="revocation lists of the CAs (sedax certs crl); reloadable"
    )
    g.add_argument("--insecure", action="store_true", default=None, help="plain TCP without TLS or client certificates")
    g.add_argument("--tokens", dest="tokens_file", metavar="FILE", help="bearer tokens (sedax certs token)")
    g.add_argument("--acl", dest="acl_file", metavar="FILE", help="topic ACL rules (allow|deny ACTION WHO PATTERN)")
    g.add_argument("--max-connections", dest="max_connections", type=int, help="client connections (1024)")
    g.add_argument("--max-frame-size", dest="max_frame_size", type=int, help="bytes per client frame (1 MiB)")
    g.add_argument("--max-payload", dest="max_payload", type=int, help="bytes per publish payload (1 MiB - 1 KiB)")
    g.add_argument(
        "--max-topic-entries", dest="max_topic_entries", type=int, help="subscribers + publishers per topic (32768)"
    )
    g.add_argument(
        "--max-memory",
        dest="max_memory",
        type=int,
        help="bytes of stored messages in memory, beyond it publishes are refused; 0 = half of the machine's (0)",
    )
    g.add_argument("--publish-rate", dest="publish_rate", type=float, help="publishes/s per client, 0 = off (0)")
    g.add_argument("--publish-burst", dest="publish_burst", type=int, help="publishes at once per client (1000)")
    g.add_argument(
        "--client-send-buffer", dest="client_send_buffer", type=int, help="bytes queued for one client (16 MiB)"
    )
    g.add_argument(
        "--slow-consumer-policy",
        dest="slow_consumer_policy",
        choices=("disconnect", "drop"),
        help="a client over its send buffer is disconnected (default) or its frames are dropped",
    )
    g.add_argument("--idle-timeout", dest="idle_timeout", type=float, help="seconds without requests (300, 0 = off)")
