"""`sedax demo`, the README's first command's main job, run as a newcomer runs it: TLS, nine brokers, a primary
killed and a topic moved mid-stream, every message delivered in order, nothing left running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from cluster import brokers_marked

SEDAX = str(Path(sys.executable).with_name("sedax"))


def test_the_demo_delivers_every_message_in_order_and_leaves_nothing_running() -> None:
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "SEDAX_INSECURE"}  # (the suite's plain-TCP default)
    env["SEDAX_TEST_MARK"] = mark
    res = subprocess.run([SEDAX, "demo"], capture_output=True, text=True, timeout=240, env=env, check=False)
    out = res.stdout
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr, out + res.stderr
    assert "every link is TLS: brokers mutually authenticated by the development CA" in out, out
    assert "killing the primary of grid/feeder-0/voltage" in out and "moving grid/feeder-1/voltage to" in out, out
    assert "published 200 messages on 4 topics, all acknowledged" in out, out
    assert "subscriber received 200 messages, in order per topic: True" in out, out
    lines = out.splitlines()
    assert lines[-2] == "cluster stopped" and lines[-1].startswith("next: `sedax cluster up`"), out
    deadline = time.monotonic() + 10  # the nine brokers stopped with the demo (their exit may trail its own)
    while brokers_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert brokers_marked(mark) == []
