"""Topic names, patterns and the broker's topic store (retention, dedup, fetch)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable

import pytest

from broker.store import (
    PUBLISHER_IDLE_FORGET,
    BadRetentionRule,
    Retention,
    RetentionPolicy,
    RetentionRule,
    StoredMessage,
    TopicNotFound,
    TopicStore,
)
from broker.sweep import Sweep
from overlay.pubsub import MESSAGE_OVERHEAD, record_size
from overlay.seqset import SeqRanges, count_outside, lacks, ranges_minus
from overlay.topics import BadTopic, matches, validate_pattern, validate_topic


def test_topic_names() -> None:
    assert validate_topic("grid/feeder-3/voltage") == "grid/feeder-3/voltage"
    for bad, why in [
        ("", "1..256"),
        ("a" * 257, "1..256"),
        ("grid//v", "empty level"),
        ("/grid", "empty level"),
        ("grid/+/v", "wildcards exist only in ACL patterns"),
        ("grid/#", "name one topic in full"),
        ("grid v", "whitespace"),
        ("grid\x00", "control"),
    ]:
        with pytest.raises(BadTopic, match=why):
            validate_topic(bad)


def test_topic_patterns() -> None:
    validate_pattern("grid/+/voltage")
    validate_pattern("grid/#")
    with pytest.raises(BadTopic, match="last level"):
        validate_pattern("grid/#/x")
    with pytest.raises(BadTopic, match="whole level"):
        validate_pattern("grid/a+/x")
    assert matches("grid/+/voltage", "grid/f1/voltage")
    assert not matches("grid/+/voltage", "grid/f1/current")
    assert not matches("grid/+/voltage", "grid/f1/x/voltage")
    assert matches("grid/#", "grid/f1/x/voltage")
    assert matches("grid/#", "grid")
    assert not matches("grid/#", "other/x")
    assert matches("a/b", "a/b") and not matches("a/b", "a")


def msg(ts: float, seq: int, size: int = 10, pub: str = "p") -> StoredMessage:
    return StoredMessage(ts, pub, seq, b"x" * size)


def test_append_dedup_and_size() -> None:
    store = TopicStore(Retention(max_age=None, max_bytes=None))
    log = store.ensure("t")
    assert log.append(msg(1.0, 0), now=1.0)
    assert log.append(msg(2.0, 1), now=2.0)
    assert not log.append(msg(3.0, 1), now=3.0)  # a re-send after failover
    assert not log.append(msg(3.0, 0), now=3.0)
    assert log.append(msg(3.0, 0, pub="q"), now=3.0)  # another publisher has its own sequence
    assert log.size == 3 * (10 + 1 + MESSAGE_OVERHEAD)
    assert store.sizes() == {"t": log.size}
    with pytest.raises(TopicNotFound, match="locate"):
        store.get("nope")


@pytest.mark.parametrize("max_bytes", [None, 5 * (30 + 1 + MESSAGE_OVERHEAD)])
def test_a_run_appended_at_once_leaves_the_log_as_one_by_one_would(max_bytes: int | None) -> None:
    # append_run (a batched PUBLISH that follows the publisher's last message) against append per message.
    def filled(at_once: bool) -> object:
        log = TopicStore(Retention(max_age=None, max_bytes=max_bytes)).ensure("t")
        log.append(msg(1.0, 0, size=30), now=1.0)
        log.append(msg(1.5, 0, pub="q", size=30), now=1.5)
        run = [msg(2.0 + i / 100, 1 + i, size=30) for i in range(6)]
        if at_once:
            log.append_run(run, now=2.0)
        else:
            for m in run:
                log.append(m, now=2.0)
        return (list(log.rows), log.size, log.last_seq, log.held, log.expired, log.last_seen)

    assert filled(at_once=True) == filled(at_once=False)


def test_retention_by_age_and_bytes() -> None:
    log = TopicStore(Retention(max_age=10.0, max_bytes=None)).ensure("t")
    for i in range(5):
        log.append(msg(float(i), i), now=float(i))
    assert log.expire(now=13.5) == 4 * log.records()[0].size
    assert [m.seq for m in log.records()] == [4]
    one = 100 + 1 + MESSAGE_OVERHEAD
    log2 = TopicStore(Retention(max_age=None, max_bytes=3 * one)).ensure("t")
    for i in range(5):
        log2.append(msg(float(i), i, size=100), now=float(i))
    assert [m.seq for m in log2.records()] == [2, 3, 4]
    assert log2.size == 3 * one
    with pytest.raises(ValueError):
        Retention(max_age=0)


def test_a_topics_retention_is_the_first_rule_its_name_matches_and_a_new_policy_applies_to_topics_held() -> None:
    one = 100 + 1 + MESSAGE_OVERHEAD
    rules = (RetentionRule.parse(f"grid/+/pmu/#=,{2 * one}"), RetentionRule.parse("grid/#=10"))
    assert str(rules[0]) == f"grid/+/pmu/#=,{2 * one}" and str(rules[1]) == "grid/#=10"
    store = TopicStore(RetentionPolicy(Retention(max_age=1000.0, max_bytes=None), rules))
    pmu, grid, other = (store.ensure(n) for n in ("grid/f1/pmu/a", "grid/f1/voltage", "meters/7"))
    assert pmu.retention == Retention(max_age=1000.0, max_bytes=2 * one)  # the age left out: the broker's
    assert grid.retention == Retention(max_age=10.0, max_bytes=None)  # the first rule does not match
    assert other.retention == Retention(max_age=1000.0, max_bytes=None)
    for log in (pmu, grid, other):
        for i in range(5):
            log.append(msg(float(i), i, size=100), now=float(i))
    store.expire(now=12.5)
    assert [[m.seq for m in log.records()] for log in (pmu, grid, other)] == [[3, 4], [3, 4], [0, 1, 2, 3, 4]]
    # A reload's policy: each topic held keeps by it from the next expiry on (what went stays gone).
    assert store.retain(RetentionPolicy(Retention(max_age=1000.0, max_bytes=one))) == 3
    assert store.retain(RetentionPolicy(Retention(max_age=1000.0, max_bytes=one))) == 0
    store.expire(now=13.0)
    assert [[m.seq for m in log.records()] for log in (pmu, grid, other)] == [[4], [4], [4]]
    assert store.ensure("grid/new").retention == Retention(max_age=1000.0, max_bytes=one)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("grid/#", "has no PATTERN="),
        ("=600", "has no PATTERN="),
        ("grid/#=", "sets neither SECONDS nor BYTES"),
        ("grid/#=,", "sets neither SECONDS nor BYTES"),
        ("grid/#=ten", "must be numbers"),
        ("grid/#=1,2.5", "must be numbers"),
        ("grid/#=0", "SECONDS must be a positive number"),
        ("grid/#=inf", "SECONDS must be a positive number"),
        ("grid/#=5,0", "BYTES must be at least 1"),
        ("grid/#/x=5", "'#' may only be the last level"),
    ],
)
def test_a_retention_rule_that_does_not_parse_says_the_form(text: str, match: str) -> None:
    with pytest.raises(BadRetentionRule, match=match):
        RetentionRule.parse(text)


def test_a_sweep_visits_every_key_once_per_period_in_slices_as_the_keys_change() -> None:
    keys = {k: None for k in range(100)}
    sweep: Sweep[int] = Sweep(period=1.0)
    assert sweep.take(keys, 0.0) == list(range(100))  # the first call: a whole round
    seen: list[int] = []
    for i in range(1, 21):  # ticks 0.05 s apart: five keys each, every key once in the second
        got = sweep.take(keys, i * 0.05)
        assert len(got) <= 5
        seen += got
    assert sorted(seen) == list(range(100))
    assert sweep.take(keys, 60.0) == list(range(25))  # a long pause: a quarter at most (MAX_SHARE), not all
    keys[100] = None
    del keys[50]
    rest: list[int] = []
    while len(rest) < 75:  # the round goes on with the keys it started with, the one dropped since included ...
        rest += sweep.take(keys, 60.0 + 0.25 * (len(rest) // 25 + 1))
    assert rest == list(range(25, 100))
    nxt = [k for i in range(4) for k in sweep.take(keys, 62.0 + 0.25 * i)]
    assert sorted(nxt) == sorted(keys)  # ... and the next round has the new one, not the one gone


@pytest.mark.parametrize("seed", range(4))
def test_the_tallies_are_what_a_walk_of_every_topic_would_sum(seed: int) -> None:
    # The memory check, the load report and STATUS read four running tallies (one per rank) instead of walking
    # every topic: whatever is stored, expired, merged out of order, cleared, dropped or ranked anew, each tally
    # must be exactly the sum over the topics counted in it.
    rng = random.Random(seed)
    store = TopicStore(Retention(max_age=50.0, max_bytes=rng.choice([None, 2000])))
    rank: dict[str, int] = {}
    seq: dict[tuple[str, str], int] = {}
    now = 0.0
    for _ in range(4000):
        now += rng.random()
        name, pub = f"t{rng.randrange(12)}", f"p{rng.randrange(3)}"
        log = store.ensure(name)
        rank.setdefault(name, 0)
        op = rng.random()
        n = seq.get((name, pub), 0)
        if op < 0.4:
            log.append(msg(now, n, size=rng.randrange(1, 60), pub=pub), now)
            seq[(name, pub)] = n + 1
        elif op < 0.55:
            k = rng.randrange(1, 6)
            if log.last_seq.get(pub, -1) == n - 1:
                log.append_run([msg(now + i / 1000, n + i, size=20, pub=pub) for i in range(k)], now)
                seq[(name, pub)] = n + k
        elif op < 0.7:  # another holder's records: some new, some held, some older than the newest
            recs = [msg(now - rng.random() * 40, rng.randrange(n + 5), size=15, pub=pub) for _ in range(4)]
            log.merge(recs, now)
            seq[(name, pub)] = max([n, *(r.seq + 1 for r in recs)])
        elif op < 0.8:
            store.expire_due(now)
        elif op < 0.85:
            log.clear()
        elif op < 0.9:
            store.drop(name)
            rank.pop(name)
            seq = {k: v for k, v in seq.items() if k[0] != name}
        else:
            rank[name] = rng.randrange(4)
            store.ranked(log, rank[name])
        for r in range(4):
            mine = [store.get(t) for t, x in rank.items() if x == r]
            t = store.tallies[r]
            assert (t.size, t.records, t.names) == (
                sum(x.size for x in mine),
                sum(len(x.rows) for x in mine),
                {x.name for x in mine},
            )
        assert all(x.size == sum(record_size(p, b) for _, p, _, b in x.rows) for x in store)
    assert store.held(1) == sum(store.get(t).size for t, x in rank.items() if x == 1)


def test_since_and_merge() -> None:
    log = TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t")
    for i in range(6):
        log.append(msg(float(i), i), now=float(i))
    assert [m.seq for m in log.since(2.0)] == [3, 4, 5]
    assert [m.seq for m in log.since(-1.0, limit=2)] == [0, 1]
    assert log.since(5.0) == []
    other = TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t")
    other.append(msg(0.0, 0), now=0.0)
    assert len(other.merge(reversed(log.records()), now=9.0)) == 5
    assert [m.seq for m in other.records()] == [0, 1, 2, 3, 4, 5]
    assert other.size == log.size
    assert other.merge(log.records(), now=9.0) == []


def _in_seq_order(log_rows: Iterable[tuple[float, str, int, bytes]]) -> bool:
    """Every publisher's rows in seq order and every timestamp unique, in the order the rows are kept."""
    rows = list(log_rows)
    last: dict[str, int] = {}
    for _, pub, seq, _ in rows:
        if seq <= last.get(pub, -1):
            return False
        last[pub] = seq
    return all(a[0] < b[0] for a, b in itertools.pairwise(rows))


def test_a_merge_keeps_each_publishers_messages_in_seq_order() -> None:
    # chaos.py seed 67: the primary was paused with a publisher's seq 0-9 unread in its socket; the take-over
    # stored their re-sends and then 10-13 (ts 127.85-127.9); the paused broker, resumed, read the originals
    # and stored them as new (ts 128.41...).  Merging the take-over's 10-13 put them before 0-9 in time, and a
    # catch-up from the beginning handed out 10 first: the subscriber then dropped 0-9 as already seen.
    store = TopicStore(Retention(max_age=None, max_bytes=None))
    log = store.ensure("t")
    for i in range(10):
        log.append(msg(128.41 + i * 1e-3, i), now=128.5)
    log.append(msg(128.42, 0, pub="q"), now=128.5)
    takeover = [msg(127.85 + i * 1e-3, i) for i in range(14)]
    new = log.merge(takeover, now=129.0)
    assert [m.seq for m in new] == [10, 11, 12, 13]
    assert store.restamped == 4  # counted (sedax_restamped_records_total): the four merged ones, stamped after 9
    assert _in_seq_order(log.rows)
    assert [m.seq for m in log.since(0.0) if m.publisher == "p"] == list(range(14))
    assert all(m.ts > 128.419 for m in new), "the merged messages come after the copy's own 0-9"
    assert {(m.publisher, m.seq): m.ts for m in log.records()}[("p", 9)] == pytest.approx(128.419)  # never earlier
    assert log.size == sum(record_size(r[1], r[3]) for r in log.rows)
    # A paging reader (FETCH since the last ts it got) sees each message once, in the same order.
    seen, since = [], -1.0
    while page := log.since(since, limit=3):
        seen += [(m.publisher, m.seq) for m in page]
        since = page[-1].ts
    assert seen == [(m.publisher, m.seq) for m in log.records()]


def test_a_merge_of_lower_seqs_stamped_later_moves_the_higher_ones_after_them() -> None:
    # The other way round (a third holder at level 3): this copy holds 14-15 stamped early, and gets 10-13
    # stamped later by another clock.  The held 14-15 move after 13; nothing moves earlier.
    log = TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t")
    log.append(msg(127.95, 14), now=128.0)
    log.append(msg(127.96, 15), now=128.0)
    log.append(msg(127.97, 0, pub="q"), now=128.0)
    before = {(m.publisher, m.seq): m.ts for m in log.records()}
    new = log.merge([msg(128.5 + i * 1e-3, i) for i in range(10, 14)], now=129.0)
    assert [m.seq for m in new] == [10, 11, 12, 13]
    assert _in_seq_order(log.rows)
    after = {(m.publisher, m.seq): m.ts for m in log.records()}
    assert all(after[k] >= t for k, t in before.items())
    assert [m.seq for m in log.records() if m.publisher == "p"] == [10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize("seed", range(8))
def test_merges_of_holders_with_their_own_clocks_keep_every_publishers_order(seed: int) -> None:
    # Holders take turns as primary with clocks of their own (skewed by up to a second) and merge each other's
    # histories in random stretches, as anti-entropy does: every copy keeps every publisher in seq order with
    # unique stamps, no stamp moves earlier, and merges that need no re-stamping (a stretch missed and filled
    # in later) leave the stamps alone.
    rng = random.Random(seed)
    logs = [TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t") for _ in range(3)]
    skew = [rng.uniform(-1.0, 1.0) for _ in logs]
    pubs = ["p0", "p1", "p2"]
    next_seq = dict.fromkeys(pubs, 0)
    now = 100.0
    stamps: list[dict[tuple[str, int], float]] = [{} for _ in logs]
    for _ in range(400):
        now += rng.uniform(0.0, 0.02)
        h = rng.randrange(len(logs))
        log = logs[h]
        if rng.random() < 0.7:
            pub = rng.choice(pubs)
            ts = max(now + skew[h], (log.last_ts or 0.0) + 1e-6)
            if log.append(StoredMessage(ts, pub, next_seq[pub], b"x"), now=now):
                next_seq[pub] += 1
        else:
            other = logs[rng.randrange(len(logs))]
            recs = other.records()
            if recs:
                a = rng.randrange(len(recs))
                part = recs[a : a + rng.randrange(1, 40)]
                have = {(r[1], r[2]) for r in log.rows}
                union = sorted([*log.rows, *(tuple(m) for m in part if (m.publisher, m.seq) not in have)])
                before = {(r[1], r[2]): r[0] for r in log.rows}
                log.merge(part, now=now)
                if _in_seq_order(union):  # nothing out of order: the merge must not re-stamp anything
                    assert {(r[1], r[2]): r[0] for r in log.rows if (r[1], r[2]) in before} == before
                    assert [r[0] for r in log.rows] == [r[0] for r in union]
        for i, lg in enumerate(logs):
            assert _in_seq_order(lg.rows)
            for m in lg.records():
                key = (m.publisher, m.seq)
                assert m.ts >= stamps[i].get(key, m.ts), "a merge moved a stored message earlier"
                stamps[i][key] = m.ts
            assert lg.size == sum(record_size(r[1], r[3]) for r in lg.rows)
    for lg in logs:
        for other in logs:
            lg.merge(other.records(), now=now)
    held = [{(m.publisher, m.seq) for m in lg.records()} for lg in logs]
    assert held[0] == held[1] == held[2]
    assert all(_in_seq_order(lg.rows) for lg in logs)


def test_a_back_fill_oldest_first_lands_between_the_rows_in_order() -> None:
    # A new secondary holds the recent rows of two publishers and gets the history in chunks, oldest first:
    # each chunk falls between two rows (inserted by rotation, `merge`), nothing is re-stamped.
    recs = [msg(1000.0 + i * 1e-3, i // 2, pub=("p", "q")[i % 2]) for i in range(3000)]
    log = TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t")
    log.merge(recs[2000:], now=2000.0)
    for a in range(0, 2000, 128):
        chunk = recs[a : min(a + 128, 2000)]
        assert log.merge(chunk, now=2000.0) == chunk
    assert log.records() == recs
    assert log.offerable() == {"p": ((0, 1499),), "q": ((0, 1499),)}


def test_filling_in_a_missed_stretch_moves_nothing() -> None:
    log = TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t")
    for i in (0, 1, 2, 6, 7):
        log.append(msg(float(i), i), now=float(i))
    stamps = [r[0] for r in log.rows]
    new = log.merge([msg(3.0, 3), msg(4.0, 4), msg(5.0, 5)], now=9.0)
    assert [m.ts for m in new] == [3.0, 4.0, 5.0]
    assert [r[0] for r in log.rows] == sorted([*stamps, 3.0, 4.0, 5.0])


def test_count_outside_and_ranges_minus_are_the_set_difference() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = {rng.randrange(60) for _ in range(rng.randrange(40))}
        b = {rng.randrange(60) for _ in range(rng.randrange(40))}
        ra, rb = SeqRanges((x, x) for x in a), SeqRanges((x, x) for x in b)
        assert count_outside(ra, rb) == len(a - b)
        assert count_outside(ra, None) == len(a)
        assert SeqRanges(ranges_minus(ra, rb)) == SeqRanges((x, x) for x in a - b)


@pytest.mark.parametrize("seed", range(6))
def test_missing_from_finds_exactly_what_a_peer_lacks(seed: int) -> None:
    # missing_from counts what the peer lacks from the ranges (held minus expired) and stops walking back from the
    # newest row once it found that many: it must return what a scan of every row returns, after gaps, merges
    # of older stretches, expiry, a cleared log and forgotten publishers alike.
    rng = random.Random(seed)
    one = 10 + 2 + MESSAGE_OVERHEAD
    log = TopicStore(Retention(max_age=None, max_bytes=rng.choice([40, 120, 400]) * one)).ensure("t")
    pubs = ["p0", "p1", "p2", "p3"]
    next_seq = dict.fromkeys(pubs, 0)
    skipped: list[tuple[str, int, float]] = []
    ts = 0.0
    for step in range(1500):
        ts += 1.0
        pub = rng.choice(pubs)
        if skipped and rng.random() < 0.1:  # a stretch missed earlier, merged later (older timestamp)
            p, seq, old_ts = skipped.pop(rng.randrange(len(skipped)))
            log.merge([StoredMessage(old_ts, p, seq, b"y" * 10)], now=ts)
        elif rng.random() < 0.1:  # a gap: this seq reaches us only later, by a merge
            skipped.append((pub, next_seq[pub], ts))
            next_seq[pub] += 1
        else:
            log.append(StoredMessage(ts, pub, next_seq[pub], b"x" * 10), now=ts)
            next_seq[pub] += 1
        if step == 700 and seed % 2:
            log.clear()
        if step % 25 == 0:
            theirs: dict[str, SeqRanges] = {}
            for p in pubs:
                if rng.random() < 0.8:  # the peer holds some stretches of p's numbers, or none of them
                    r = theirs[p] = SeqRanges()
                    for _ in range(rng.randrange(4)):
                        lo = rng.randrange(next_seq[p] + 1)
                        r.add_range(lo, lo + rng.randrange(next_seq[p] + 1))
            rows = list(log.rows)  # merges of older stretches keep the log in timestamp order, and its size
            assert all(a[0] <= b[0] for a, b in itertools.pairwise(rows))
            assert log.size == sum(record_size(r[1], r[3]) for r in rows)
            kept: dict[str, SeqRanges] = {}
            for row in rows:
                kept.setdefault(row[1], SeqRanges()).add_range(row[2], row[2])
            assert log.offerable() == {p: k.ranges() for p, k in kept.items()}  # what an OFFER names: the rows
            everything = [m for m in log.records() if lacks(theirs, m.publisher, m.seq)]
            assert log.missing_from(theirs) == everything
            # ... and so does the answer taken a piece at a time (a long answer streams: sync._Answer).
            stream, pieces = log.missing_stream(theirs), []
            while not stream.done:
                pieces.extend(stream.take(rng.randrange(1, 40)))
            assert pieces == everything
    assert log.expired, "the retention dropped nothing: the test did not exercise expired stretches"


def test_a_cleared_log_that_gets_its_expired_records_back_offers_them() -> None:
    # clear() forgets what expired along with what was held: records that come back by a merge (another replica
    # still had them) are kept, offered and found again, not taken for expired ones.
    one = 10 + 1 + MESSAGE_OVERHEAD
    log = TopicStore(Retention(max_age=None, max_bytes=3 * one)).ensure("t")
    for i in range(6):
        log.append(msg(float(i), i), now=float(i))
    assert [m.seq for m in log.records()] == [3, 4, 5] and log.offerable() == {"p": ((3, 5),)}
    log.clear()
    assert log.merge([msg(0.0, 0), msg(1.0, 1)], now=9.0) != []
    assert log.offerable() == {"p": ((0, 1),)}
    assert [m.seq for m in log.missing_from({})] == [0, 1]


def test_idle_publishers_are_forgotten_after_a_day_and_only_then() -> None:
    # Beyond 64 publishers, one idle for PUBLISHER_IDLE_FORGET loses its dedup state (expire); the look at every
    # publisher happens once the oldest can have gone idle, not on every append.
    log = TopicStore(Retention(max_age=3600.0, max_bytes=None)).ensure("t")
    for i in range(100):
        log.append(msg(float(i), 0, pub=f"dev{i}"), now=float(i))
    day = PUBLISHER_IDLE_FORGET
    log.append(msg(day + 50.5, 1, pub="dev99"), now=day + 50.5)  # dev0..dev50 idle for a day by now
    assert sorted(log.last_seen, key=lambda p: int(p[3:])) == [f"dev{i}" for i in range(51, 100)]
    assert "dev0" not in log.held and "dev0" not in log.last_seq
    log.append(msg(day + 51.0, 2, pub="dev99"), now=day + 51.0)
    assert len(log.last_seen) == 49  # 49 publishers, under the 64 the rule keeps in any case
    for i in range(100, 120):
        log.append(msg(day + i, 0, pub=f"dev{i}"), now=day + i)
    log.append(msg(2 * day + 99.5, 3, pub="dev99"), now=2 * day + 99.5)  # dev51..dev98 idle for a day now
    assert "dev98" not in log.last_seen and "dev99" in log.last_seen and "dev100" in log.last_seen


def test_a_silent_publisher_whose_records_are_kept_keeps_its_numbers() -> None:
    # Kept longer than a day (retention by bytes only): forgetting the publisher's numbers would let a merge of
    # the same records from another replica store them twice.  Once they are gone, it is forgotten.
    one = 10 + 4 + MESSAGE_OVERHEAD
    log = TopicStore(Retention(max_age=None, max_bytes=80 * one)).ensure("t")
    log.append(msg(0.0, 0, pub="old0"), now=0.0)
    for i in range(70):
        log.append(msg(1.0 + i, 0, pub=f"dev{i:02}"), now=1.0 + i)
    day = PUBLISHER_IDLE_FORGET
    log.append(msg(day + 30.0, 1, pub="dev69"), now=day + 30.0)
    assert "old0" in log.last_seen and "dev00" in log.last_seen  # silent a day, but their records are kept
    assert log.merge([msg(0.0, 0, pub="old0")], now=day + 31.0) == []  # not stored twice
    for i in range(10):  # push the oldest records out, old0's and dev00's among them
        log.append(msg(day + 40.0 + i, 2 + i, pub="dev69"), now=day + 40.0 + i)
    log.append(msg(day + 120.0, 12, pub="dev69"), now=day + 120.0)  # a look again, PUBLISHER_FORGET_RECHECK on
    assert "old0" not in log.last_seen and "old0" not in log.held
    assert "dev00" not in log.last_seen and "dev69" in log.last_seen


def test_stored_messages_cost_the_garbage_collector_nothing() -> None:
    # A log of many messages must not be walked by every full collection (docs/benchmarks.md, issue 4):
    # stored rows are plain tuples of atoms, which the collector stops tracking.
    import gc

    log = TopicStore(Retention(max_age=None, max_bytes=None)).ensure("t")
    for i in range(1000):
        log.append(msg(float(i), i), now=float(i))
    gc.collect()
    assert not any(gc.is_tracked(row) for row in log.rows)
    assert [m.seq for m in log.since(997.0)] == [998, 999]
