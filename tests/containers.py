"""What the container tests share: running a command, whether a Docker engine answers, the offline base image.

No image can be pulled here, so the base image is built locally (deploy/offline-base.sh: debootstrap, the
dependency wheels, `docker import`), once per recipe (its tag is a hash of it), one build at a time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
# Generous bounds: image builds on a loaded 2-core machine with a slow storage driver.
BASE_BUILD_TIMEOUT = 1200.0


def run(cmd: Sequence[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """The command's outcome, its output captured as text; a non-zero exit is the caller's to judge."""
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kw)


def docker_engine() -> str | None:
    """None if a Docker engine answers, else why not."""
    if shutil.which("docker") is None:
        return "the docker command is not installed"
    try:
        r = run(["docker", "info", "--format", "{{.ServerVersion}}"], 60)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 60 s"
    if r.returncode != 0:
        return f"`docker info` failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return None


def offline_base_image() -> str:
    """The offline base image's tag, built if this recipe's is not there yet; skips the test without Docker."""
    why = docker_engine()
    if why is not None:
        pytest.skip(f"no Docker engine answers: {why}")
    env = {**os.environ, "SEDAX_PYTHON": sys.executable}
    r = run([str(REPO / "deploy" / "offline-base.sh")], BASE_BUILD_TIMEOUT, env=env, cwd=REPO)
    assert r.returncode == 0, f"deploy/offline-base.sh failed:\n{r.stderr[-4000:]}"
    return r.stdout.strip().splitlines()[-1]
