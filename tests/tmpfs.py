"""Whether a test can mount a small private tmpfs (a real full disk) with `unshare -rm` (no root needed)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile


def unavailable() -> str | None:
    """Why a private tmpfs cannot be mounted here (no unshare; user namespaces refused, e.g. by a container's
    seccomp profile), or None."""
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux) to mount a private tmpfs"
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {d}"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs here (user namespaces refused): {probe.stderr.strip()}"
    return None
