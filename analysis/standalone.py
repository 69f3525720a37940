"""A Spark standalone cluster on 127.0.0.1 from this environment's pyspark: one master, N workers.

For the tests and the benchmark of `sedax analyze --master spark://...` (docs/analysis.md): each daemon is
`pyspark/bin/spark-class` running `deploy.master.Master` or `deploy.worker.Worker` as its own process
group, so it is stopped, with the executors and Python workers it started, through the PID this module
started.  Ports come from the OS: the master binds port 0 for its RPC and web UI and the ports it got are
read from its log (a port picked free beforehand can be taken by the time the JVM binds it, and Spark then
moves to the next one silently).  Readiness is the master's JSON status page.  Linux only (/proc).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import pyspark

SPARK_HOME: Final = Path(pyspark.__file__).resolve().parent
SPARK_CLASS: Final = SPARK_HOME / "bin" / "spark-class"
HOST: Final = "127.0.0.1"
# After SIGTERM a group gets this long to go before SIGKILL (a worker stops its executors first).
STOP_GRACE: Final = 30.0
POLL: Final = 0.2
# The master's log lines that say where it listens (Master.scala, WebUI.scala).
MASTER_URL: Final = re.compile(rb"Starting Spark master at (spark://\S+)")
MASTER_WEBUI: Final = re.compile(rb"Bound MasterWebUI to \S+, and started at https?://[^\s:]+:(\d+)")


def free_port() -> int:
    """A TCP port the OS reports free on 127.0.0.1."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The fields after the command name (which may hold spaces and parentheses): state, ppid, pgrp, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def stop_group(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> list[int]:
    """SIGTERM the process group proc leads (it was started in a session of its own), SIGKILL what is left
    after `grace` s; returns the processes still there at the end (none, normally)."""
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so it does not count as a member
            if proc.returncode is not None and not group_members(pgid):
                return []
            time.sleep(0.1)
    proc.poll()
    return group_members(pgid)


class StandaloneSpark:
    """A master and `workers` workers (`cores` and `memory` each) on 127.0.0.1, logs and work dirs in workdir.

    `worker_path_prefix` is put first on the workers' PATH (the executors inherit it).
    """

    def __init__(
        self,
        workdir: Path,
        workers: int = 2,
        cores: int = 1,
        memory: str = "1g",
        worker_path_prefix: Path | None = None,
        master_within: float = 120.0,
    ) -> None:
        self.workdir = workdir
        # Known once the master has bound them (start()).
        self.url = ""
        self.webui = 0
        self.master_within = master_within
        self.cores = cores
        self.memory = memory
        self.worker_path_prefix = worker_path_prefix
        self.work_dirs = [workdir / f"worker-{i}" for i in range(workers)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def _env(self, path_prefix: Path | None = None) -> dict[str, str]:
        # SPARK_HOME spares spark-class its search (which runs `python3`); SPARK_LOCAL_IP keeps every
        # daemon, executor and block manager on 127.0.0.1.
        env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=HOST)
        env.pop("PYSPARK_PYTHON", None)
        if path_prefix is not None:
            env["PATH"] = f"{path_prefix}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _spawn(self, name: str, args: Sequence[str], env: dict[str, str]) -> None:
        with (self.workdir / f"{name}.log").open("wb") as log:
            # A session of its own: the group holds the JVM (spark-class execs into it) and, for a worker,
            # its executors and their Python workers, so the tree is stopped through the leader's PID.
            self.procs.append(
                subprocess.Popen(
                    [str(SPARK_CLASS), *args],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.workdir,
                    start_new_session=True,
                )
            )

    def _await_master(self) -> None:
        """Read the master's URL and web UI port from its log; RuntimeError if it exits or `master_within`
        s pass first."""
        log = self.workdir / "master.log"
        deadline = time.monotonic() + self.master_within
        while True:
            text = log.read_bytes()
            url, webui = MASTER_URL.search(text), MASTER_WEBUI.search(text)
            if url and webui:
                self.url, self.webui = url.group(1).decode(), int(webui.group(1))
                return
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(text.decode(errors="replace").splitlines()[-15:])
                raise RuntimeError(
                    f"the Spark master did not report its ports within {self.master_within} s"
                    f" (exit code {self.procs[0].returncode})\n--- master.log\n{tail}"
                )
            time.sleep(POLL)

    def start(self) -> None:
        """Spawn the master, wait until it has bound its ports, then spawn the workers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        props = self.workdir / "spark.properties"
        # The master's REST submission server would take the fixed port 6066.
        props.write_text("spark.master.rest.enabled false\n")
        self._spawn(
            "master",
            ["org.apache.spark.deploy.master.Master", "--host", HOST, "--port", "0",
             "--webui-port", "0", "--properties-file", str(props)],
            self._env(),
        )  # fmt: skip
        self._await_master()
        for i, work in enumerate(self.work_dirs):
            work.mkdir(parents=True, exist_ok=True)
            self._spawn(
                f"worker-{i}",
                ["org.apache.spark.deploy.worker.Worker", self.url, "--host", HOST, "--cores", str(self.cores),
                 "--memory", self.memory, "--webui-port", "0", "--work-dir", str(work),
                 "--properties-file", str(props)],
                self._env(self.worker_path_prefix),
            )  # fmt: skip

    def state(self) -> dict[str, Any]:
        """The master's JSON status page, or {} while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.webui}/json/", timeout=5) as resp:
                doc: dict[str, Any] = json.loads(resp.read())
                return doc
        except (OSError, urllib.error.URLError, ValueError):
            return {}

    def wait_until(self, cond: Callable[[dict[str, Any]], bool], within: float, what: str) -> dict[str, Any]:
        """Poll the master's status until cond(status) holds; RuntimeError (with the daemons' log tails) if a
        daemon exits or `within` s pass first."""
        deadline = time.monotonic() + within
        while True:
            state = self.state()
            if state and cond(state):
                return state
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
                    for f in sorted(self.workdir.glob("*.log"))
                )
                raise RuntimeError(f"{what} not reached within {within} s (exited: {dead})\n{tails}")
            time.sleep(POLL)

    def wait_workers(self, within: float) -> dict[str, Any]:
        """Wait until the master is ALIVE with every worker ALIVE."""
        n = len(self.work_dirs)
        return self.wait_until(
            lambda s: s.get("status") == "ALIVE" and s.get("aliveworkers") == n,
            within,
            f"a master with {n} ALIVE workers",
        )

    def stop(self) -> list[int]:
        """Stop the workers, then the master, each through its PID's process group; returns leftover PIDs."""
        left: list[int] = []
        for proc in reversed(self.procs):
            left += stop_group(proc)
        return left
