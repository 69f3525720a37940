"""Run one broker process: `run(config)` under uvloop, logs on stderr, one JSON readiness line on stdout."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import uvloop

from broker.config import BrokerConfig, ConfigError, config_from_args
from broker.flags import Parser, add_broker_arguments
from broker.guard import Guard
from broker.membership import JoinFailed, JoinRefused
from broker.memory import freeze_survivors
from broker.node import Broker, StartFailed
from broker.sdnotify import Notifier
from broker.storage import FormatUnknown, raise_open_file_limit, read_format
from broker.version import VERSION

# Exit codes: 2 = bad configuration (also: metrics endpoint or log cannot be opened), 3 = the overlay refused
# us, 4 = no join address answered.
EXIT_CONFIG: int = 2
EXIT_REFUSED: int = 3
EXIT_JOIN_FAILED: int = 4
# 1 = the broker failed while serving (a bug; the log says what).
EXIT_FAILED: int = 1


class JsonLines(logging.Formatter):
    """One JSON object a log record, for log pipelines (`--log-format json`): when (UTC, ISO 8601 with
    milliseconds), how bad, which broker, which layer, what; and the traceback, if the record has one."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "node": self.node_id,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _fatal(config: BrokerConfig, node_id: str, text: str) -> None:
    """Why the broker does not start or stops, on stderr: `sedax broker: error: ...`, or with `--log-format json`
    a CRITICAL record like every other line, so a log pipeline reads it too."""
    if config.log_format == "json":
        record = logging.makeLogRecord({"name": "sedax.broker", "levelname": "CRITICAL", "levelno": 50, "msg": text})
        text = JsonLines(node_id).format(record)
        print(text, file=sys.stderr, flush=True)
    else:
        print(f"sedax broker: error: {text}", file=sys.stderr, flush=True)


def _formatter(config: BrokerConfig, node_id: str) -> logging.Formatter:
    if config.log_format == "json":
        return JsonLines(node_id)
    return logging.Formatter(f"%(asctime)s %(levelname)s broker[{node_id}] %(message)s")


def _setup_logging(config: BrokerConfig, node_id: str) -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    # Configure the "sedax" parent so every layer (sedax.broker, sedax.pubsub, ...) logs the same way.
    root = logging.getLogger("sedax")
    root.handlers[:] = [handler]
    root.propagate = False
    _apply_logging(config, node_id)
    return logging.getLogger("sedax.broker")


def _apply_logging(config: BrokerConfig, node_id: str) -> None:
    """The log level and line format of every layer (the "sedax" parent logger): at start, and again at each
    reload."""
    root = logging.getLogger("sedax")
    root.setLevel(config.log_level.upper())
    for handler in root.handlers:
        handler.setFormatter(_formatter(config, node_id))


async def serve(config: BrokerConfig, reread: Callable[[], BrokerConfig] | None = None) -> int:
    """Start, join, announce readiness, serve until SIGTERM/SIGINT, then leave gracefully.  SIGHUP reloads:
    `reread` builds the configuration again as it was built (config file, environment, flags).  Under systemd
    (`Type=notify`) the service manager is told each step (broker/sdnotify.py)."""
    soft_before, _ = raise_open_file_limit()
    try:
        broker = Broker(config)
    except ConfigError as exc:  # TLS files, tokens or ACL unusable
        _fatal(config, config.node_id or "-", str(exc))
        return EXIT_CONFIG
    log = _setup_logging(config, broker.node_id)
    broker.log = log
    if broker.fd_limit.soft != soft_before:
        log.info("open-file limit raised from %d to %d (the hard limit)", soft_before, broker.fd_limit.soft)
    notifier = Notifier.from_environ(os.environ, os.getpid(), log)
    pets: asyncio.Future[None] | None = None
    if notifier is not None and notifier.watchdog_interval is not None:
        pets = asyncio.ensure_future(_watchdog(broker, notifier, notifier.watchdog_interval))
    try:
        return await _serve(broker, log, reread, notifier)
    finally:
        if pets is not None:
            pets.cancel()
            await asyncio.gather(pets, return_exceptions=True)
        if notifier is not None:
            notifier.close()


async def _watchdog(broker: Broker, notifier: Notifier, interval: float) -> None:
    """systemd's watchdog (WatchdogSec=): a ping each interval while the loop runs and the broker's timers work
    (what /healthz answers 200 for).  A hung loop pings no more, and systemd kills and restarts the broker."""
    while True:
        if broker.unhealthy() is None:
            notifier.watchdog()
        await asyncio.sleep(interval)


async def _serve(
    broker: Broker, log: logging.Logger, reread: Callable[[], BrokerConfig] | None, notifier: Notifier | None
) -> int:
    config = broker.config
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    serving = ""  # the service manager's STATUS line, once ready (read by on_reload when it runs)

    def on_signal(name: str) -> None:
        if stop.is_set():
            log.warning("second %s: exiting without a graceful leave", name)
            os._exit(1)
        log.info("%s: leaving the overlay", name)
        if notifier is not None:
            notifier.stopping(f"{name}: leaving the overlay")
        stop.set()

    def on_reload() -> None:
        if notifier is not None:
            notifier.reloading()
        line = _reload(broker, log, reread)
        if notifier is not None:  # READY=1 ends the reload, taken or refused (sd_notify(3))
            notifier.ready(f"{serving}; {line}" if serving else line)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    # SIGHUP reads the configuration, TLS files, tokens and ACL again, as for nats-server, Mosquitto and Prometheus
    # (`systemctl reload`, a certificate renewal hook).  Its default action would end the broker like a crash,
    # and a leave on a "reload" would take it out of the overlay.
    loop.add_signal_handler(signal.SIGHUP, on_reload)
    try:
        await broker.start()
    except StartFailed as exc:
        _fatal(config, broker.node_id, str(exc))
        await broker.shutdown()
        return EXIT_CONFIG
    except OSError as exc:  # the listening socket: a busy port, an address this host does not have
        _fatal(
            config,
            broker.node_id,
            f"cannot listen on {config.listen}: {exc.strerror or exc}; choose another --listen HOST:PORT (port 0 "
            "lets the system pick one) or stop the process that holds it",
        )
        await broker.shutdown()
        return EXIT_CONFIG
    join = asyncio.ensure_future(broker.join()) if config.join else None
    if join is not None:
        if notifier is not None:
            notifier.send(status=f"joining the overlay through {', '.join(config.join)}")
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({join, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not join.done():
            join.cancel()
            await asyncio.gather(join, return_exceptions=True)
            await broker.shutdown()
            return 0
        try:
            join.result()
        except JoinRefused as exc:
            _fatal(config, broker.node_id, str(exc))
            await broker.shutdown()
            return EXIT_REFUSED
        except JoinFailed as exc:
            _fatal(config, broker.node_id, str(exc))
            await broker.shutdown()
            return EXIT_JOIN_FAILED
    ready = {
        "event": "ready",
        "listen": broker.info.listen,
        "node": broker.node_id,
        "coord": [broker.info.coord[0], broker.info.coord[1]],
    }
    if broker.metrics is not None:
        ready["metrics"] = broker.metrics.address
    # What exists now (modules, classes, the configuration: ~50k objects) lives as long as the process.  Left
    # to the collector, every full collection walks it again: tens of milliseconds a time, measured as the
    # largest pauses in the latency tail (docs/benchmarks-latency.md).  Frozen, a full collection walks only
    # what the broker made since.
    gc.collect()
    gc.freeze()
    log.debug("%d objects frozen for the garbage collector", gc.get_freeze_count())
    freeze_survivors()  # (and so what the broker comes to hold: its topics, as they last)
    print(json.dumps(ready), flush=True)
    if notifier is not None:
        x, y = broker.info.coord
        serving = f"serving as {broker.node_id} at ({x:g}, {y:g}) on {broker.info.listen}"
        notifier.ready(serving)
    stopping = asyncio.ensure_future(stop.wait())
    failing = asyncio.ensure_future(broker.failed.wait())
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    failing.cancel()
    if broker.failed.is_set():
        # The traceback is in the log (the task set logs it); a broker without its timers detects no failure,
        # syncs nothing and times nothing out, so it leaves as gracefully as it still can and exits.
        why = f"the broker's timers failed ({broker.failure!r}), so it stops"
        if notifier is not None:
            notifier.stopping(why)
        _fatal(
            config,
            broker.node_id,
            f"{why}; started again it recovers its topics from --data-dir. This is a bug: please report it with the "
            "log above",
        )
        try:
            async with asyncio.timeout(config.drain_timeout + 5.0):
                await broker.shutdown()
        except TimeoutError:
            log.warning("the graceful leave did not finish within %.1f s", config.drain_timeout + 5.0)
        return EXIT_FAILED
    await broker.shutdown()
    return 0


def _reload(broker: Broker, log: logging.Logger, reread: Callable[[], BrokerConfig] | None) -> str:
    """SIGHUP: Broker.reload, and one log line saying what it did (returned too)."""
    problem: str | None = None
    try:
        done = broker.reload(reread)
    except ConfigError as exc:
        problem = str(exc)  # (logged below, outside the handler: the reason is the line, not a traceback)
    if problem is not None:
        line = f"SIGHUP: nothing was reloaded, the broker goes on as it was: {problem}"
        log.error("%s", line)
        return line
    _apply_logging(broker.config, broker.node_id)  # (first: the new level decides whether this reload's line is shown)
    parts = [f"read again {', '.join(done.files)}"] if done.files else []
    if done.settings:
        parts.append(f"changed {', '.join(done.settings)}")
    if done.revoked:
        parts.append(f"{len(done.revoked)} connections they no longer admit closed")
    if done.subscriptions_ended:
        parts.append(f"{done.subscriptions_ended} subscriptions the ACL now denies ended")
    line = f"SIGHUP: {'; '.join(parts) or 'the configuration is as it was; no file to read again'}"
    log.info("%s", line)
    return line


def check(config: BrokerConfig) -> int:
    """`--check`: read and check what a start reads (the configuration, the TLS files with their self-check
    handshake, the tokens, the ACL, whether the data directory can be written), without starting: exit 0 with one
    line saying what a start would run with, or EXIT_CONFIG with what is wrong.  It binds nothing and takes no
    lock, so it runs beside the broker it checks (the unit's ExecReload=, before the SIGHUP)."""
    try:
        guard = Guard(config, logging.getLogger("sedax.broker"))
        data = _writable_data_dir(config)
    except ConfigError as exc:
        print(f"sedax broker: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    x, y = config.coord
    name = config.node_id or guard.name or "a generated node id"
    parts = [f"{name} at ({x:g}, {y:g}) on {config.listen}", f"resilience {config.resilience}"]
    parts.append(f"joins through {', '.join(config.join)}" if config.join else "starts a new overlay")
    if guard.tls is not None:
        expires = time.strftime("%Y-%m-%d", time.gmtime(guard.tls.expires))
        parts.append(f"TLS as {guard.tls.name} until {expires}")
    else:
        parts.append("plain TCP (--insecure)")
    if guard.tokens is not None:
        parts.append(f"{len(guard.tokens)} tokens")
    if guard.acl is not None:
        parts.append(f"{len(guard.acl.rules)} ACL rules")
    if config.retention_topics:
        parts.append(f"{len(config.retention_topics)} retention rules")
    parts.append(data)
    print(f"sedax broker: configuration OK: {'; '.join(parts)}", flush=True)
    return 0


def _writable_data_dir(config: BrokerConfig) -> str:
    """Where the topics would be kept; ConfigError if the data directory cannot be made or written by this user."""
    if not (config.on_disk and config.data_dir):
        return "topics in memory"
    d = Path(config.data_dir)
    probe = d
    while not probe.exists() and probe != probe.parent:  # (made at start: its nearest existing parent must allow it)
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"data_dir {d}: {probe} is not a directory; choose another --data-dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"data_dir {d}: {probe} cannot be written by this user (uid {os.getuid()}); give it write access "
            "(chown) or choose another --data-dir"
        )
    if d.is_dir():  # (one a newer release wrote would be refused at start)
        try:
            read_format(d, VERSION)
        except FormatUnknown as exc:
            raise ConfigError(str(exc)) from None
    return f"topics in {d} (fsync {config.fsync})"


def run(config: BrokerConfig, reread: Callable[[], BrokerConfig] | None = None) -> int:
    """Run a broker until it is told to stop; returns the process exit code.  `reread`: see `serve`."""
    return uvloop.run(serve(config, reread))


def start(args: argparse.Namespace) -> int:
    """What both entry points (`sedax broker`, `python -m broker`) do with the parsed flags: build the
    configuration (config file, environment, flags), then check it (`--check`) or run the broker with it."""
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"sedax broker: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check:
        return check(config)
    return run(config, lambda: config_from_args(args))  # (SIGHUP builds it again: the config file may have changed)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m broker --coord X,Y [--listen H:P] [--join H:P ...]`."""
    # The same program as `sedax broker`, and named so: its errors, usage ones included, begin
    # `sedax broker: error:` whichever way it was started.
    parser = Parser(prog="sedax broker", description="Run one SeDAX broker.")
    add_broker_arguments(parser)
    return start(parser.parse_args(argv))
