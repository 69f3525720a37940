"""The topic-replica lifecycle (broker/pubsub/replica.py): every transition of the table, and every illegal one."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from typing import TypeVar

import pytest

from broker.pubsub.replica import (
    COPYING,
    PULLING,
    WAITING,
    Backfill,
    Copy,
    CopyEvent,
    CopyStage,
    IllegalCopyTransition,
    IllegalReplicaTransition,
    Move,
    Pulling,
    Replica,
    Stage,
    Staged,
    Transition,
    copy_transitions,
    next_stage,
    transitions,
)
from broker.store import Retention, TopicLog
from overlay.protocol import NodeInfo
from overlay.pubsub import Delegation

TABLE = transitions()
E = TypeVar("E", bound=enum.Enum)
NODE = NodeInfo("n1", (0.5, 0.5), "127.0.0.1:7000")


def _replica(stage: Stage) -> Replica:
    r = Replica("grid/a", TopicLog("grid/a", Retention()), (0.5, 0.5), (0.5, 0.5), [Delegation((0.5, 0.5), 0.0)])
    r.stage = stage
    if stage in PULLING:
        r.pull = Pulling(asked={7: "n2"})
    if stage is Stage.HANDING_OVER:
        r.move = Move(1, (0.2, 0.2), 0.0, None)
    if stage is Stage.RECEIVING:
        r.staged = Staged(NODE, 3, 0.0, ())
    return r


@pytest.mark.parametrize(("stage", "transition"), sorted(TABLE, key=lambda k: (k[0].value, k[1].value)))
def test_every_legal_transition(stage: Stage, transition: Transition) -> None:
    r = _replica(stage)
    new = r.enter(transition)
    assert new is TABLE[(stage, transition)] is r.stage
    # What belongs to a stage goes with it, and stays while the replica stays in it; the pull is there exactly
    # while the replica pulls (made fresh on entering, kept from SYNCING to TAKING_OVER).
    assert (r.pull is not None) == (new in PULLING)
    assert (r.pull is not None and r.pull.asked == {7: "n2"}) == (stage in PULLING and new in PULLING)
    assert (r.move is not None) == (stage is Stage.HANDING_OVER and new is Stage.HANDING_OVER)
    assert (r.staged is not None) == (stage is Stage.RECEIVING and new is Stage.RECEIVING)
    assert r.waits == (new in WAITING)


ILLEGAL = [(s, t) for s, t in itertools.product(Stage, Transition) if (s, t) not in TABLE]


@pytest.mark.parametrize(("stage", "transition"), ILLEGAL)
def test_every_illegal_transition_raises_a_typed_error(stage: Stage, transition: Transition) -> None:
    r = _replica(stage)
    with pytest.raises(IllegalReplicaTransition) as info:
        r.enter(transition)
    assert r.stage is stage  # nothing changed
    err = info.value
    assert (err.topic, err.stage, err.transition) == ("grid/a", stage, transition)
    assert transition.value in str(err) and stage.value in str(err) and "grid/a" in str(err)


def test_gone_is_final_and_every_stage_can_be_dropped() -> None:
    assert all(s is Stage.GONE or TABLE[(s, Transition.DROP)] is Stage.GONE for s in Stage)
    assert not [t for (s, t) in TABLE if s is Stage.GONE]
    with pytest.raises(IllegalReplicaTransition, match="final"):
        next_stage("t", Stage.GONE, Transition.PROMOTE)


def test_every_stage_is_reachable_from_the_two_initial_ones() -> None:
    # A replica starts HOLDING (made for a request or a copy; settle() serves it at rank 1) or RECOVERING (read
    # back from the data directory).
    assert not [s for (s, _), b in TABLE.items() if b is Stage.RECOVERING]
    assert _reachable(TABLE, {Stage.HOLDING, Stage.RECOVERING}) == set(Stage)


def _reachable(table: Mapping[tuple[E, enum.Enum], E], start: set[E]) -> set[E]:
    """The stages a transition table reaches from start."""
    seen, frontier = set(start), list(start)
    while frontier:
        s = frontier.pop()
        for (a, _), b in table.items():
            if a is s and b not in seen:
                seen.add(b)
                frontier.append(b)
    return seen


@pytest.mark.parametrize(
    ("stage", "rank", "after"),
    [
        (Stage.HOLDING, 1, Stage.SERVING),
        (Stage.HOLDING, 2, Stage.HOLDING),
        (Stage.SERVING, 2, Stage.HOLDING),
        (Stage.SERVING, 0, Stage.HOLDING),
        (Stage.SERVING, 1, Stage.SERVING),
        (Stage.SYNCING, 2, Stage.SYNCING),  # a stage with work under way finishes it first
        (Stage.RECEIVING, 3, Stage.RECEIVING),
    ],
)
def test_settle_follows_the_rank_only_in_steady_stages(stage: Stage, rank: int, after: Stage) -> None:
    r = _replica(stage)
    r.rank = rank
    r.settle()
    assert r.stage is after


def test_a_pull_asks_the_silent_holders_again_sooner_once_another_has_answered() -> None:
    # Right after a failure a pull's answer can be lost on a route through a broker that has not noticed the
    # failure yet.  With no answer at all the pull is repeated after a quarter of the time-out (1 s here); once
    # one holder has answered, after ten times its delay (at least 20 ms, at most that quarter); only once.
    timeout = 1.0
    silent = Pulling(asked={1: "n2", 2: "n3"}, started=10.0)
    assert not silent.retry_due(10.24, timeout) and silent.retry_due(10.26, timeout)
    fast = Pulling(asked={1: "n2", 2: "n3"}, started=10.0)
    del fast.asked[1]
    fast.answered(10.001)  # n2 answered in 1 ms: n3 is asked again after 20 ms, not 250
    assert not fast.retry_due(10.019, timeout) and fast.retry_due(10.021, timeout)
    slow = Pulling(asked={1: "n2", 2: "n3"}, started=10.0)
    del slow.asked[1]
    slow.answered(10.010)  # 10 ms: after 100 ms
    assert not slow.retry_due(10.099, timeout) and slow.retry_due(10.101, timeout)
    slower = Pulling(asked={1: "n2", 2: "n3"}, started=10.0)
    del slower.asked[1]
    slower.answered(10.050)  # 50 ms: ten times is past the quarter; the quarter holds
    assert not slower.retry_due(10.249, timeout) and slower.retry_due(10.251, timeout)
    slower.answered(10.060)  # a second answer does not change the first one's delay
    assert slower.answered_in == pytest.approx(0.050)
    slower.retried = True
    assert not slower.retry_due(11.0, timeout)  # asked again once only
    slower.asked.clear()
    slower.retried = False
    assert not slower.retry_due(11.0, timeout)  # nobody left to ask


# ---- the copy at the next holder (Replica.copy) ----------------------------------------------------------------
COPY_TABLE = copy_transitions()
OFFER = Backfill(9, "n2", 0.0)


def _copy(stage: CopyStage) -> Copy:
    return Copy("grid/a", stage, OFFER if stage in (CopyStage.OFFERED, CopyStage.OFFERED_WANTED) else None, "n3")


def _take(c: Copy, event: CopyEvent) -> None:
    {
        CopyEvent.WANT: c.want,
        CopyEvent.OFFER: lambda: c.offered(Backfill(10, "n4", 1.0)),
        CopyEvent.CONFIRMED: lambda: c.confirmed("n2"),
        CopyEvent.LAPSED: c.lapsed,
        CopyEvent.ALONE: c.alone,
    }[event]()


@pytest.mark.parametrize(("stage", "event"), sorted(COPY_TABLE, key=lambda k: (k[0].value, k[1].value)))
def test_every_legal_copy_step(stage: CopyStage, event: CopyEvent) -> None:
    c = _copy(stage)
    _take(c, event)
    assert c.stage is COPY_TABLE[(stage, event)]
    # The back-fill under way is there exactly while one is (a new offer replaces the old); the holder is the
    # node that confirmed a back-fill nothing came after, kept through a wanted one, gone once alone.
    under_way = c.stage in (CopyStage.OFFERED, CopyStage.OFFERED_WANTED)
    assert (c.offer is not None) == under_way
    if event is CopyEvent.OFFER:
        assert c.offer == Backfill(10, "n4", 1.0)
    elif under_way:
        assert c.offer is OFFER
    expected_holder = {CopyEvent.ALONE: None}.get(event, "n3")
    if event is CopyEvent.CONFIRMED and stage is CopyStage.OFFERED:
        expected_holder = "n2"
    assert c.holder == expected_holder
    assert c.wanted == (c.stage in (CopyStage.WANTED, CopyStage.OFFERED_WANTED))


COPY_ILLEGAL = [(s, e) for s, e in itertools.product(CopyStage, CopyEvent) if (s, e) not in COPY_TABLE]


@pytest.mark.parametrize(("stage", "event"), COPY_ILLEGAL)
def test_every_illegal_copy_step_raises_a_typed_error(stage: CopyStage, event: CopyEvent) -> None:
    c = _copy(stage)
    with pytest.raises(IllegalCopyTransition) as info:
        _take(c, event)
    assert c.stage is stage
    assert (info.value.topic, info.value.stage, info.value.event) == ("grid/a", stage, event)
    assert event.value in str(info.value) and stage.value in str(info.value)


def test_the_copy_machine_offers_only_what_is_wanted_and_reaches_every_stage() -> None:
    # Nothing is offered that nobody wanted, nor confirmed or lapsed that was not offered; from a new replica's
    # WANTED every copy stage is reachable; a replica copies (Replica.copying) in exactly the COPYING stages.
    assert {s for (s, e) in COPY_TABLE if e is CopyEvent.OFFER} == {CopyStage.WANTED, CopyStage.OFFERED_WANTED}
    ended = {s for (s, e) in COPY_TABLE if e in (CopyEvent.CONFIRMED, CopyEvent.LAPSED)}
    assert ended == {CopyStage.OFFERED, CopyStage.OFFERED_WANTED}
    assert _reachable(COPY_TABLE, {CopyStage.WANTED}) == set(CopyStage)
    r = _replica(Stage.SERVING)
    assert r.copy.stage is CopyStage.WANTED and r.copying
    for stage in CopyStage:
        r.copy = _copy(stage)
        assert r.copying == (stage in COPYING)
    assert not r.copy.knows("n9") and _copy(CopyStage.HELD).knows("n3") and _copy(CopyStage.OFFERED).knows("n2")
    c = _copy(CopyStage.HELD)
    c.want(new_holder=True)
    assert (c.stage, c.holder) == (CopyStage.WANTED, None)
    # A next holder that holds the history or is being given it changes nothing; a new one wants it anew.
    c = _copy(CopyStage.HELD)
    assert not c.next_is("n3") and (c.stage, c.holder) == (CopyStage.HELD, "n3")
    c = _copy(CopyStage.OFFERED)
    assert not c.next_is("n2") and c.stage is CopyStage.OFFERED
    assert c.next_is("n9") and (c.stage, c.holder, c.offer) == (CopyStage.OFFERED_WANTED, None, OFFER)
