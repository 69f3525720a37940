"""The secure defaults from the command line: `sedax certs`, `cluster up` with TLS, tools with credentials."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _sedax(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SEDAX_")}  # the secure default
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**base, **(env or {})},
        input=stdin,
    )


def test_certs_cli(tmp_path: Path) -> None:
    d = str(tmp_path / "pki")
    res = _sedax("certs", "issue", "--dir", d, "--name", "n0", "--role", "broker")
    assert res.returncode == 2 and "no CA in" in res.stderr and "sedax certs init" in res.stderr
    assert _sedax("certs", "init", "--dir", d).returncode == 0
    again = _sedax("certs", "init", "--dir", d)
    assert again.returncode == 2 and "--force" in again.stderr
    res = _sedax("certs", "issue", "--dir", d, "--name", "n0", "--role", "broker", "--host", "10.1.2.3")
    assert res.returncode == 0 and "--tls-cert" in res.stdout
    res = _sedax("certs", "token", "--dir", d, "--name", "dashboard")
    assert res.returncode == 0 and len(res.stdout.strip()) >= 40
    assert json.loads((tmp_path / "pki" / "tokens.json").read_text())["dashboard"].startswith("sha256:")
    res = _sedax("certs", "issue", "--dir", d, "--name", "bad name", "--role", "client")
    assert res.returncode == 2 and "name must be" in res.stderr


async def test_cluster_up_is_tls_and_tools_need_credentials(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = await asyncio.to_thread(_sedax, "cluster", "up", "--nodes", "2", "--seed", "4", "--state-dir", str(state))
    try:
        assert up.returncode == 0, up.stderr
        assert "TLS with a development CA" in up.stdout
        exports = re.search(r"export SEDAX_BROKERS=\S+ (SEDAX_CA=\S+) (SEDAX_CERT=\S+) (SEDAX_KEY=\S+)", up.stdout)
        assert exports is not None
        creds = dict(kv.split("=", 1) for kv in exports.groups())
        info = json.loads((state / "cluster.json").read_text())
        assert info["tls"] is True
        addr = info["nodes"][0]["listen"]
        # No credentials: a clear usage error before any connection.
        res = await asyncio.to_thread(_sedax, "status", "--broker", addr)
        assert res.returncode == 2 and "no credentials: brokers speak TLS" in res.stderr
        # Plain TCP against a TLS broker fails.
        res = await asyncio.to_thread(_sedax, "status", "--broker", addr, "--insecure", "--timeout", "3")
        assert res.returncode == 1 and "cannot reach broker" in res.stderr
        # With the printed credentials everything works.
        res = await asyncio.to_thread(_sedax, "status", "--broker", addr, "--json", env=creds)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["node"] == info["nodes"][0]["node"]
        res = await asyncio.to_thread(_sedax, "pub", "grid/cli/voltage", "230.2", "--broker", addr, env=creds)
        assert res.returncode == 0, res.stderr
        other = info["nodes"][1]["listen"]
        res = await asyncio.to_thread(
            _sedax, "sub", "grid/cli/voltage", "--since", "0", "--count", "1", "--timeout", "20", "--broker", other,
            env=creds,
        )  # fmt: skip
        assert res.returncode == 0 and res.stdout.strip() == "230.2", res.stderr
    finally:
        down = await asyncio.to_thread(_sedax, "cluster", "down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
