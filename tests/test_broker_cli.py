"""The overlay CLI subcommands (status, route, cluster up/down) as real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import msgpack
import pytest
from cluster import wait_for
from conftest import FAST_ARGS

from broker.node import page_of
from broker.version import VERSION
from cli.cluster import LocalCluster
from cli.overlay import human_span, running_line
from client.admin import AdminClient, status_json
from client.client import Client
from overlay.geometry import closest
from overlay.protocol import (
    RATE_WINDOW,
    STATUS_PAGE,
    HeldPage,
    NodeInfo,
    RemoteProtocolError,
    Status,
    StatusReq,
    TopicHeld,
    decode_message,
    encode_message,
)

pytestmark = pytest.mark.slow


def _cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


async def test_status_json(cluster3: LocalCluster) -> None:
    bp = cluster3.nodes[0]
    await cluster3.wait_converged(10.0)
    res = await asyncio.to_thread(_cli, "status", "--broker", bp.listen, "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["coord"] == list(bp.coord) and st["listen"] == bp.listen and st["node"] == bp.node_id
    assert {n["id"] for n in st["neighbours"]} == {"n1", "n2"}
    assert all(n["listen"] and len(n["coord"]) == 2 for n in st["neighbours"])
    assert st["topics"] == [] and st["loads"] == {"L1": 0, "L2": 0, "L3": 0}
    # what runs and since when: the installed version, a start before this test asked, no certificate (plain TCP)
    assert st["version"] == VERSION and 0 < st["started"] <= time.time()
    assert st["certificate_expires"] is None and st["resilience"] == 2
    text = await asyncio.to_thread(_cli, "status", "--broker", bp.listen)
    assert text.returncode == 0 and "neighbours (2)" in text.stdout
    assert text.stdout.splitlines()[1].startswith(f"sedax {VERSION}, resilience 2, up "), text.stdout
    assert text.stdout.splitlines()[1].endswith("; plain TCP (--insecure)"), text.stdout


async def test_route_json(cluster3: LocalCluster) -> None:
    await cluster3.wait_converged(10.0)
    src = cluster3.nodes[0]
    res = await asyncio.to_thread(_cli, "route", "0.5,0.9", "--broker", src.listen, "--json")
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    want = closest({bp.node_id: bp.coord for bp in cluster3.nodes}, (0.5, 0.9))[0]
    assert r["node"]["id"] == want
    assert r["node"]["listen"] == cluster3.nodes[int(want[1:])].listen
    assert r["hops"] == len(r["path"]) - 1 == 1
    assert [p["id"] for p in r["path"]] == [src.node_id, want]
    text = await asyncio.to_thread(_cli, "route", "0.5,0.9", "--broker", src.listen)
    assert (
        text.returncode == 0 and f"-> {want} at " in text.stdout and text.stdout.splitlines()[0].endswith(" in 1 hop")
    )


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (("route", "0.5", "--broker", "{addr}"), 2, "coordinate is written X,Y"),
        (("route", "x,y", "--broker", "{addr}"), 2, "two numbers"),
        (("route", "2,2", "--broker", "{addr}"), 1, "coordinate_outside_space"),
        (("route", "0.5,0.5", "--broker", "127.0.0.1:1"), 1, "cannot reach broker"),
        (("status", "--broker", "127.0.0.1:1"), 1, "cannot reach broker"),
        (("status", "--broker", "nohost"), 2, "HOST:PORT"),
    ],
)
async def test_clear_errors(cluster3: LocalCluster, args: tuple[str, ...], code: int, match: str) -> None:
    """Usage errors exit 2, a broker that refuses or cannot be reached 1; one line each."""
    res = await asyncio.to_thread(_cli, *(a.format(addr=cluster3.nodes[0].listen) for a in args))
    assert res.returncode == code, res.stderr
    assert match in res.stderr and "Traceback" not in res.stderr
    assert [ln for ln in res.stderr.splitlines() if "error:" in ln] == [res.stderr.splitlines()[-1]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


async def test_cluster_up_and_down(tmp_path: Path) -> None:
    state = tmp_path / "state"
    res = await asyncio.to_thread(_cli, "cluster", "up", "--nodes", "4", "--seed", "3", "--state-dir", str(state))
    pids: list[int] = []
    try:
        assert res.returncode == 0, res.stderr
        assert "converged" in res.stdout and "sedax cluster down" in res.stdout
        info = json.loads((state / "cluster.json").read_text())
        pids = [n["pid"] for n in info["nodes"]]
        assert len(pids) == 4 and all(_alive(p) for p in pids)
        st = await asyncio.to_thread(_cli, "status", "--broker", info["nodes"][0]["listen"], "--json")
        assert st.returncode == 0
        again = await asyncio.to_thread(_cli, "cluster", "up", "--nodes", "2", "--state-dir", str(state))
        assert again.returncode == 1 and "cluster down" in again.stderr
    finally:
        down = await asyncio.to_thread(_cli, "cluster", "down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert down.stdout.count("stopped") == 4
    assert not any(_alive(p) for p in pids)
    assert not (state / "cluster.json").exists() and (state / "cluster.stopped.json").exists()


def _exported(stdout: str) -> dict[str, str]:
    """The variables of the `export ...` line `cluster up` prints."""
    line = next(ln for ln in stdout.splitlines() if ln.strip().startswith("export "))
    return dict(kv.split("=", 1) for kv in line.split()[1:])


async def test_cluster_down_then_up_starts_the_same_brokers_with_their_data(tmp_path: Path) -> None:
    """A full restart as a user does it: `cluster down`, then `cluster up` with only the state directory.  The
    same brokers come back at the same coordinates and addresses with their data, at the level and with the
    flags they had, and the line `up` printed still configures the tools (TLS, as users run it).  Then a
    rolling restart (`cluster restart`) of the same brokers keeps them at their addresses and their data."""
    state = tmp_path / "state"
    topic = "grid/restart/feeder-1"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEDAX_")}  # (the suite's SEDAX_INSECURE too)
    up = await asyncio.to_thread(
        _cli, "cluster", "up", "--nodes", "4", "--seed", "5", "--resilience", "3", "--state-dir", str(state), env=env
    )
    try:
        assert up.returncode == 0, up.stderr
        first = json.loads((state / "cluster.json").read_text())
        tools = {**env, **_exported(up.stdout)}
        assert tools["SEDAX_BROKERS"] == ",".join(n["listen"] for n in first["nodes"])
        pub = await asyncio.to_thread(_cli, "pub", topic, "230.4", "--count", "10", env=tools)
        assert pub.returncode == 0, pub.stderr
        down = await asyncio.to_thread(_cli, "cluster", "down", "--state-dir", str(state), env=env)
        assert down.returncode == 0 and down.stdout.count("stopped") == 4, down.stdout + down.stderr
        assert f"sedax cluster up --state-dir {state}" in down.stdout
        assert not (state / "cluster.json").exists() and (state / "cluster.stopped.json").exists()

        again = await asyncio.to_thread(_cli, "cluster", "up", "--state-dir", str(state), env=env)
        assert again.returncode == 0, again.stderr
        assert "started the cluster stopped in" in again.stdout
        second = json.loads((state / "cluster.json").read_text())
        assert not (state / "cluster.stopped.json").exists()
        assert [n["coord"] for n in second["nodes"]] == [n["coord"] for n in first["nodes"]]
        assert second["resilience"] == 3 and second["tls"] is True
        # An address another program took meanwhile is replaced, and `up` says so; the others are kept.
        taken = next((ln for ln in again.stdout.splitlines() if "new addresses for" in ln), "")
        for a, b in zip(first["nodes"], second["nodes"], strict=True):
            assert a["listen"] == b["listen"] or f"{b['node']}" in taken
        status = await asyncio.to_thread(_cli, "status", "--json", env={**env, **_exported(again.stdout)})
        assert status.returncode == 0 and json.loads(status.stdout)["resilience"] == 3, status.stderr
        sub = await asyncio.to_thread(
            _cli, "sub", topic, "--since", "0", "--count", "10", "--json", "--timeout", "20", env=tools
        )
        assert sub.returncode == 0, sub.stderr
        got = [json.loads(ln) for ln in sub.stdout.splitlines()]
        assert [m["seq"] for m in got] == list(range(10)) and {m["payload"] for m in got} == {"230.4"}

        # A rolling restart of the same cluster: each broker in turn, at its address, the next once the overlay
        # is whole and every topic caught up; the state file follows the new processes.  A broker that crashed
        # meanwhile (n3, SIGKILL) is started again in its turn.
        os.kill(second["nodes"][3]["pid"], signal.SIGKILL)
        await wait_for(lambda: not _alive(second["nodes"][3]["pid"]), 10.0, "n3 gone")
        rolling = await asyncio.to_thread(_cli, "cluster", "restart", "--state-dir", str(state), timeout=180, env=env)
        assert rolling.returncode == 0, rolling.stdout + rolling.stderr
        steps = [ln for ln in rolling.stdout.splitlines() if ": restarted at " in ln]
        assert [ln.split(":")[0] for ln in steps] == ["n0", "n1", "n2", "n3"]
        for n, ln in zip(second["nodes"][:3], steps, strict=False):
            assert f"restarted at {n['listen']} (pid {n['pid']} -> " in ln
        assert f"restarted at {second['nodes'][3]['listen']} (not running -> " in steps[3]
        third = json.loads((state / "cluster.json").read_text())
        assert [n["listen"] for n in third["nodes"]] == [n["listen"] for n in second["nodes"]]
        for n, m in zip(third["nodes"], second["nodes"], strict=True):
            assert _alive(n["pid"]) and n["pid"] != m["pid"]
        sub = await asyncio.to_thread(  # (a span back from now: all ten were published within the hour)
            _cli, "sub", topic, "--since", "1h", "--count", "10", "--json", "--timeout", "20", env=tools
        )
        assert sub.returncode == 0, sub.stderr
        assert [json.loads(ln)["seq"] for ln in sub.stdout.splitlines()] == list(range(10))
    finally:
        await asyncio.to_thread(_cli, "cluster", "down", "--state-dir", str(state), env=env)


async def test_topics_lists_every_topic_with_its_holders(cluster3: LocalCluster) -> None:
    await cluster3.wait_converged(10.0)
    names = [f"grid/topics-cli/{i}" for i in range(4)]
    addrs = [bp.listen for bp in cluster3.nodes]
    async with Client(addrs, credentials=cluster3.credentials()) as c:
        for i, t in enumerate(names):
            for k in range(i + 1):
                await c.publish(t, f"v{k}")
        async with c.subscribe(names[0]):
            res = await asyncio.to_thread(_cli, "topics", "--broker", addrs[2], "--json")
            assert res.returncode == 0, res.stderr
            rows = {r["topic"]: r for r in json.loads(res.stdout)}
            text = await asyncio.to_thread(_cli, "topics", "--broker", f"127.0.0.1:1,{addrs[1]}")
    assert set(names) <= set(rows)
    ids = {bp.node_id: bp.coord for bp in cluster3.nodes}
    for i, t in enumerate(names):
        r = rows[t]
        primary, secondary = closest(ids, tuple(r["coord"]), 2)
        assert r["holders"]["primary"] == [primary] and r["holders"]["secondary"] == [secondary]
        assert r["bytes"] > 0 and r["subscribers"] == (1 if i == 0 else 0)
    assert rows[names[3]]["bytes"] > rows[names[0]]["bytes"]
    assert text.returncode == 0 and all(t in text.stdout for t in names)
    # Rate: topic i got i + 1 messages just now, so (i + 1) / RATE_WINDOW msg/s.
    assert [rows[t]["rate"] for t in names] == [round((i + 1) / RATE_WINDOW, 3) for i in range(4)]
    lines = text.stdout.splitlines()
    assert lines[0].split()[-1] == "MSG/S"
    assert [ln.split()[-1] for ln in lines if ln.startswith(names[3])] == [f"{4 / RATE_WINDOW:.2f}"]
    # status names the topics a broker holds, in text, without a Python dict.
    holder = next(bp for bp in cluster3.nodes if bp.node_id == rows[names[0]]["holders"]["primary"][0])
    status = await asyncio.to_thread(_cli, "status", "--broker", holder.listen)
    assert status.returncode == 0 and names[0] in status.stdout and "{" not in status.stdout, status.stdout


async def test_brokers_lists_the_cluster_and_says_when_it_is_ready(tmp_path: Path) -> None:
    # `sedax brokers`: a line per broker and a verdict, exit 0 only when every broker answers (as many as
    # --expect), the overlay is whole and every topic's copies are caught up: what a rolling restart waits for.
    async with LocalCluster(4, seed=3, state_dir=tmp_path, broker_args=FAST_ARGS) as cluster:
        await cluster.wait_converged(30.0)
        addrs = ",".join(bp.listen for bp in cluster.nodes)
        async with Client(addrs.split(","), credentials=cluster.credentials()) as c:
            for i in range(6):
                await c.publish(f"grid/brokers-cli/{i}", b"1")
        ok = await asyncio.to_thread(_cli, "brokers", "--broker", addrs, "--expect", "4", "--wait", "60", timeout=120)
        lines = ok.stdout.splitlines()
        assert ok.returncode == 0 and lines[-1] == (
            "ready: 4 brokers answered; the overlay is whole; every topic's copies are caught up"
        ), ok.stdout + ok.stderr
        assert sorted(ln.split()[0] for ln in lines[1:-1]) == ["n0", "n1", "n2", "n3"]
        js = json.loads((await asyncio.to_thread(_cli, "brokers", "--broker", addrs, "--json")).stdout)
        assert js["ready"] and js["unreachable"] == {} and js["gaps"] == js["lagging"] == []
        assert sum(b["topics"] for b in js["brokers"]) == 12  # six topics, two copies each at level 2
        assert all(b["version"] == VERSION and b["certificate_expires"] is None for b in js["brokers"])
        assert all(b["reload_ok"] for b in js["brokers"])

        await cluster.kill(2)  # down: reported by its neighbours until they give it up, then by nobody
        gone = await asyncio.to_thread(_cli, "brokers", "--broker", addrs, "--expect", "4")
        last = gone.stdout.splitlines()[-1]
        assert gone.returncode == 1 and last.startswith("not ready"), gone.stdout + gone.stderr
        assert "n2 (at " in last or "3 brokers answered, 4 expected (--expect)" in last, last

        await cluster.restart(2)  # at its address, with its data; --wait until the copies are caught up again
        back = await asyncio.to_thread(_cli, "brokers", "--broker", addrs, "--expect", "4", "--wait", "90", timeout=150)
        assert back.returncode == 0 and back.stdout.splitlines()[-1].startswith("ready: 4 brokers"), (
            back.stdout + back.stderr
        )


async def test_the_tools_see_every_topic_of_a_broker_past_the_first_status_page(tmp_path: Path) -> None:
    # A STATUS lists a broker's first STATUS_PAGE topics; status, topics, brokers and the cluster's own wait read
    # the rest page by page (HELD_REQ), so that the rolling-upgrade gate judges every topic, not the first 1,000.
    names = [f"grid/paged/{i:05d}" for i in range(STATUS_PAGE + 150)]
    async with LocalCluster(2, seed=5, state_dir=tmp_path, broker_args=FAST_ARGS, resilience=2) as cluster:
        await cluster.wait_converged(30.0)
        addrs = ",".join(bp.listen for bp in cluster.nodes)
        async with Client(addrs.split(","), credentials=cluster.credentials()) as c:
            await asyncio.gather(*(c.publish(t, b"1") for t in names))
        brokers = await asyncio.to_thread(_cli, "brokers", "--broker", addrs, "--expect", "2", "--wait", "60", "--json")
        js = json.loads(brokers.stdout)
        assert js["ready"], brokers.stdout + brokers.stderr
        assert [b["topics"] for b in js["brokers"]] == [len(names)] * 2  # level 2 on two brokers: each holds all
        assert await cluster.lagging(names) == []
        status = await asyncio.to_thread(_cli, "status", "--broker", cluster.nodes[0].listen, "--json")
        assert sorted(t["topic"] for t in json.loads(status.stdout)["topics"]) == names
        topics = await asyncio.to_thread(_cli, "topics", "--broker", addrs, "--json", timeout=120)
        rows = json.loads(topics.stdout)
        assert [r["topic"] for r in rows] == names
        # A pattern lists only what matches it (and locates only that).
        one = await asyncio.to_thread(_cli, "topics", "grid/+/01042", "--broker", addrs, "--json")
        assert [r["topic"] for r in json.loads(one.stdout)] == ["grid/paged/01042"], one.stderr
        none = await asyncio.to_thread(_cli, "topics", "grid/other/#", "--broker", addrs)
        assert none.returncode == 0 and none.stdout.strip() == "no topics match grid/other/#", none.stdout
        bad = await asyncio.to_thread(_cli, "topics", "grid/#/x", "--broker", addrs)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "'#'" in bad.stderr, bad.stderr
        assert all(r["holders"].keys() == {"primary", "secondary"} for r in rows)
        # and what STATUS itself carries: the first page, and how many entries all pages hold
        async with await AdminClient.connect(cluster.nodes[1].listen, credentials=cluster.credentials()) as admin:
            st = await admin.status()
            assert [h.topic for h in st.held] == names[:STATUS_PAGE] and st.held_total == len(names)
            assert [h.topic for h in (await admin.holdings(st)).held] == names


def test_a_page_of_topics_never_ends_between_two_roles_of_one_name() -> None:
    names = ["a", "b", "c", "d", "e"]
    roles = {"b": ["home", "secondary"], "d": ["home", "secondary"]}  # b and d: home of the topic and a copy
    asked: list[list[str]] = []

    def rows_of(chunk: Sequence[str]) -> list[tuple[str, str, int]]:
        asked.append(list(chunk))
        return [(n, role, 0) for n in chunk for role in roles.get(n, ["primary"]) if role]

    def topics(page: list[tuple[str, str, int]]) -> list[str]:
        return [n for n, _, _ in page]

    page, more = page_of(names, "", 2, rows_of)
    assert (topics(page), more) == (["a", "b", "b"], True)  # b's two entries on one page
    page, more = page_of(names, "b", 2, rows_of)
    assert (topics(page), more) == (["c", "d", "d"], True)
    page, more = page_of(names, "c", 2, rows_of)  # d's entries fill it: e is the next page's
    assert (topics(page), more) == (["d", "d"], True)
    assert page_of(names, "d", 2, rows_of)[0] == [("e", "primary", 0)]
    assert page_of(names, "e", 2, rows_of) == ([], False)
    assert topics(page_of(names, "", 10, rows_of)[0]) == ["a", "b", "b", "c", "d", "d", "e"]
    assert topics(page_of(names, "bb", 1, rows_of)[0]) == ["c"]  # after a name no longer held: from the next one
    # Only a page's names are looked up, never all of them (a listing of 100,000 topics read 100 times).
    assert [len(chunk) for chunk in asked] == [2, 2, 2, 1, 5, 1] and asked[-1] == ["c"]
    # Names with no entry now (dropped since, or a delegate list kept for a home elsewhere) take no room, and a
    # page is empty only at the end: a tool reads on while one says more follow.
    roles.update({"b": [""], "c": [""], "d": [""]})
    page, more = page_of(names, "a", 2, rows_of)
    assert (topics(page), more) == (["e"], False)
    assert page_of(names, "", 1, rows_of) == ([("a", "primary", 0)], True)
    assert page_of(names, "a", 1, rows_of) == ([("e", "primary", 0)], False)


def test_status_says_what_runs_since_when_and_an_expired_certificate() -> None:
    st = {"version": "0.1.0", "resilience": 3, "started": 1_000_000.0, "certificate_expires": 1_000_000.0 + 86400}
    assert running_line(st, 1_000_000.0 + 3 * 3600 + 12 * 60) == (
        "sedax 0.1.0, resilience 3, up 3 h 12 min (since 1970-01-12 13:46 UTC); TLS certificate (or its CA) valid "
        "until 1970-01-13 13:46 UTC (20 h 48 min left)"
    )
    assert running_line(st, 1_000_000.0 + 2 * 86400).endswith(
        "TLS certificate EXPIRED at 1970-01-13 13:46 UTC: renew it (docs/security.md), then `kill -HUP` the broker"
    )
    assert [human_span(s) for s in (-1, 42, 300, 7200, 200_000)] == ["0 s", "42 s", "5 min", "2 h 0 min", "2 days"]
    # With a CRL (--tls-crl): when it is due, or that it is overdue.
    with_crl = {**st, "crl_next_update": 1_000_000.0 + 3 * 86400}
    assert running_line(with_crl, 1_000_000.0).endswith("; CRL due 1970-01-15 13:46 UTC (3 days left)")
    assert running_line(with_crl, 1_000_000.0 + 4 * 86400).endswith(
        "; its CRL was DUE at 1970-01-15 13:46 UTC: write a fresh one (sedax certs crl, or your CA), then `kill -HUP`"
    )


def test_a_status_without_recent_from_an_older_broker_decodes() -> None:
    st = Status(
        1, NodeInfo("n0", (0.5, 0.5), "127.0.0.1:7000"), (), (), ("t",), {}, {}, 2, (TopicHeld("t", "primary", 9),)
    )
    wire = msgpack.unpackb(encode_message(st))
    # `recent`, `version`, `started`, `certificate_expires`, `reload_ok`, `held_total` and `crl_next_update`, the
    # last fields: an array without them (what a broker before them sent) ...
    assert wire[-7:] == [{}, "", 0.0, 0.0, True, 0, 0.0]
    del wire[-7:]
    as_map = {"op": "status", **{f.name: v for f, v in zip(fields(Status), wire[1:], strict=False)}}
    for old_wire in (wire, as_map):  # ... and the map form of versions 1 and 2
        old = decode_message(msgpack.packb(old_wire))
        assert isinstance(old, Status) and old.recent == {} and old.held == st.held
        assert (old.version, old.started, old.certificate_expires, old.reload_ok) == ("", 0.0, 0.0, True)
        assert old.held_total == 0 and old.crl_next_update == 0.0
    # and `sedax status` then leaves out the line it cannot fill
    assert status_json(old)["version"] is None


def test_a_status_from_a_newer_broker_decodes_without_the_fields_it_added() -> None:
    # A tool reads the STATUS (and HELD_PAGE) of a broker one release newer: fields it does not know are ignored.
    st = Status(
        1, NodeInfo("n0", (0.5, 0.5), "127.0.0.1:7000"), (), (), ("t",), {}, {}, 2, (TopicHeld("t", "primary", 9),)
    )
    newer = [*msgpack.unpackb(encode_message(st)), "a later field", {"and": 1}]
    assert decode_message(msgpack.packb(newer)) == st
    page = HeldPage(3, (TopicHeld("u", "secondary", 4),), {}, False)
    assert decode_message(msgpack.packb([*msgpack.unpackb(encode_message(page)), 7])) == page
    # Everything else is still refused whole: a request with a field more than this broker knows.
    with pytest.raises(RemoteProtocolError, match="fields, expected"):
        decode_message(msgpack.packb([*msgpack.unpackb(encode_message(StatusReq(4))), 1]))


async def _holders_of(cluster: LocalCluster, topic: str) -> list[str]:
    """The brokers whose STATUS lists topic in any role."""
    out = []
    for bp in cluster.live():
        async with await AdminClient.connect(bp.listen, credentials=cluster.credentials()) as admin:
            st = await admin.status()
        if topic in st.topics or any(h.topic == topic for h in st.held):
            out.append(bp.node_id)
    return out


async def test_move_of_a_topic_nobody_published_to_fails_and_leaves_nothing(cluster3: LocalCluster) -> None:
    await cluster3.wait_converged(10.0)
    addr = cluster3.nodes[0].listen
    ghost = f"nosuch/topic-{uuid.uuid4().hex[:8]}"
    res = await asyncio.to_thread(_cli, "move", ghost, "0.5,0.5", "--broker", addr)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "moved" not in res.stdout and "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        f"sedax: error: no broker holds topic {ghost!r}; publish to it first or check the name with `sedax topics`"
    ]
    assert await _holders_of(cluster3, ghost) == []  # the refused move left no empty replica behind
    # The same command on a topic with a message moves it.
    real = f"grid/move-cli-{uuid.uuid4().hex[:8]}"
    async with Client([addr], credentials=cluster3.credentials()) as c:
        await c.publish(real, b"1")
    res = await asyncio.to_thread(_cli, "move", real, "0.9,0.1", "--broker", addr)
    assert res.returncode == 0 and res.stdout.startswith(f"moved {real}"), res.stderr


def test_broker_check_reads_what_a_start_reads_and_starts_nothing(tmp_path: Path) -> None:
    # `sedax broker --check` (a unit's ExecReload=, an operator before a restart): exit 0 and what a start would
    # run with, or 2 and one line saying what is wrong; nothing is bound, locked or created.
    acl = tmp_path / "broker.acl"
    acl.write_text("allow any operator grid/#\n")
    ok = _cli("broker", "--coord", "0.5,0.5", "--insecure", "--acl", str(acl), "--data-dir", str(tmp_path / "d"),
              "--join", "127.0.0.1:7000", "--retention-topic", "grid/+/pmu/#=600", "--check")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == (
        "sedax broker: configuration OK: a generated node id at (0.5, 0.5) on 127.0.0.1:0; resilience 2; joins "
        f"through 127.0.0.1:7000; plain TCP (--insecure); 1 ACL rules; 1 retention rules; topics in {tmp_path / 'd'} "
        "(fsync interval:100)"
    )
    assert not (tmp_path / "d").exists()
    acl.write_text("allow anything operator grid/#\n")
    (tmp_path / "file").write_text("")
    for entry in ("cli.main", "broker"):  # both entry points alike, and both named `sedax broker`
        for extra, match in (
            (("--acl", str(acl)), "broker.acl"),
            (("--data-dir", str(tmp_path / "file" / "d")), "is not a directory; choose another --data-dir"),
            (("--resilience", "4"), "invalid choice: 4 (choose from 1, 2, 3); `sedax broker --help` lists the options"),
            (("--retention-topic", "grid/#"), "retention rule 'grid/#' has no PATTERN=: give PATTERN=SECONDS[,BYTES]"),
        ):
            argv = [sys.executable, "-m", entry, *(["broker"] if entry == "cli.main" else []), "--coord", "0.5,0.5"]
            bad = subprocess.run([*argv, "--insecure", *extra, "--check"], capture_output=True, text=True, timeout=60)
            # One line that says what is wrong, a flag argparse itself refuses included (not its 40-line usage).
            assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
            assert bad.stderr.startswith("sedax broker: error: "), bad.stderr
            assert match in bad.stderr, bad.stderr
