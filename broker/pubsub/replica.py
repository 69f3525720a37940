"""A topic as one broker holds it, and the one transition table of its life there.

Every broker keeps a `Replica` per topic it holds.  Its `rank` is what the overlay makes it (1 = primary,
closest to the topic's coordinate C(t); 2 = secondary; 3 = tertiary; 0 = none), recomputed whenever the view
or the coordinate changes.  Its `stage` is what it is doing about that, and it changes only through
`Replica.enter`, checked against `_TRANSITIONS` (as broker/link.py does for links, and h11 for HTTP):

    HOLDING       a copy (secondary or tertiary): merges what the primary replicates, serves nothing
    SERVING       the caught-up primary: stores, replicates, acknowledges, delivers
    SYNCING       primary of a topic it just met (a join made it closest): pulls the history from the other
                  holders before it serves (Sec. III-C); requests wait
    TAKING_OVER   primary after the old one failed: pulls what the other holders have, then re-delivers the
                  last moments
    PLACING       home of a topic nobody used yet: Alg. 1 chooses its coordinate; requests wait
    HANDING_OVER  old primary of a move: the new coordinate's holders are being filled; requests wait
    RECEIVING     new primary of a move: holds the hand-over, waits for its own replica and for ACTIVATE
    RECOVERING    read back from the data directory at start, not yet compared with the other holders: once
                  the broker has joined it syncs (primary), holds (copy) or retires (neither)
    RETIRING      no longer among the topic's holders (a join or leave moved it out of the top ranks): offers
                  what it holds to the brokers that hold the topic now and lets go once each has confirmed it
                  holds all of it (a DHT's key transfer; Dynamo's hinted hand-off); serves nothing
    GONE          dropped from this broker (a late callback finds it so and does nothing)

SYNCING, TAKING_OVER, PLACING, HANDING_OVER, RECEIVING and RECOVERING hold the topic's requests (`WAITING`).  The data
that belongs to one stage lives on the replica only while it is in that stage: the `Pulling` bookkeeping
(SYNCING, TAKING_OVER), the `Move` (HANDING_OVER) and the `Staged` hand-over (RECEIVING).  Offers (`offers`)
belong to no stage: a holder also offers during a graceful shutdown and to repair gaps; a RETIRING replica is
dropped once its last offer is confirmed.

A recovered primary leaves RECOVERING through SYNCING, like a primary that joined: it serves only what the
other holders and its disk hold together (storage-anchors: only a caught-up replica may lead).

Beside the stage, a replica's `copy` says where its history stands at its next holder (the primary's secondary;
at level 3 the secondary's tertiary), with a transition table of its own (`CopyStage`, `_COPY_TRANSITIONS`): the
two are orthogonal (a SERVING primary and a HOLDING secondary both back-fill, and a new back-fill can be wanted
while one is under way), so they are two machines rather than one table of their products:

    ALONE           no next holder: stored without a copy
    WANTED          the next holder is to be given the history (replication.py `backfill` offers it)
    OFFERED         a back-fill is under way (`Backfill`)
    OFFERED_WANTED  under way, and another is wanted once it ends (records came that it may not cover)
    HELD            `Copy.holder` has the history, and the batches the rest
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from broker.pubsub.settings import PULL_RETRY_FACTOR, PULL_RETRY_MIN, REPLICATION_TIMEOUT
from broker.store import TS_EPSILON, TopicLog
from overlay.protocol import Coord, LocalProtocolError, Message, NodeInfo
from overlay.pubsub import Delegation, Record, SubRef, Waiter
from overlay.seqset import SeqRanges


class Stage(enum.Enum):
    """What a broker is doing about a topic it holds (see the module docstring)."""

    HOLDING = "holding"
    SERVING = "serving"
    SYNCING = "syncing"
    TAKING_OVER = "taking_over"
    PLACING = "placing"
    HANDING_OVER = "handing_over"
    RECEIVING = "receiving"
    RECOVERING = "recovering"
    RETIRING = "retiring"
    GONE = "gone"

    # Members are singletons compared by identity, so they hash by identity too: in C, where Enum's own __hash__
    # is a Python call (hash of the name), and `r.stage in WAITING` runs for every message.
    __hash__ = object.__hash__


class Transition(enum.Enum):
    """The named steps between stages."""

    PROMOTE = "promote"  # the view made this copy the primary, and there is nobody to pull from
    DEMOTE = "demote"  # the view made the primary (serving, pulling or placing) a copy: a broker joined closer
    SYNC = "sync"  # a primary new to the topic asks the other holders for its history
    TAKE_OVER = "take_over"  # the primary failed: this copy pulls from the other holders, then leads
    CAUGHT_UP = "caught_up"  # every holder answered (or the pull timed out): serve
    PLACE = "place"  # Alg. 1 chooses the coordinate of a new topic
    PLACED_HERE = "placed_here"  # Alg. 1 kept it here
    HAND_OVER = "hand_over"  # the home granted a move: fill the new coordinate's holders
    MOVE_ABORTED = "move_aborted"  # no lease or no confirmation: keep serving here
    MOVED_LOCALLY = "moved_locally"  # the new coordinate is in this broker's own cell: serve it there
    HANDED_OVER = "handed_over"  # the new primary confirmed: stay a copy at the new coordinate
    RECEIVE = "receive"  # a hand-over arrived: hold it until ACTIVATE
    ACTIVATE = "activate"  # the old primary let go: serve
    RETIRE = "retire"  # no longer ranked: offer the records to the topic's holders before letting go
    KEEP = "keep"  # ranked again before it let go: a copy again
    DROP = "drop"  # no longer this broker's to hold


_S, _T = Stage, Transition
_TRANSITIONS: Final[dict[tuple[Stage, Transition], Stage]] = {
    (_S.HOLDING, _T.PROMOTE): _S.SERVING,
    (_S.HOLDING, _T.TAKE_OVER): _S.TAKING_OVER,
    (_S.HOLDING, _T.RECEIVE): _S.RECEIVING,
    (_S.HOLDING, _T.DROP): _S.GONE,
    (_S.SERVING, _T.DEMOTE): _S.HOLDING,
    (_S.SERVING, _T.TAKE_OVER): _S.TAKING_OVER,
    (_S.SERVING, _T.SYNC): _S.SYNCING,
    (_S.SERVING, _T.PLACE): _S.PLACING,
    (_S.SERVING, _T.HAND_OVER): _S.HANDING_OVER,
    (_S.SERVING, _T.RECEIVE): _S.RECEIVING,
    (_S.SERVING, _T.DROP): _S.GONE,
    (_S.SYNCING, _T.CAUGHT_UP): _S.SERVING,
    (_S.SYNCING, _T.DEMOTE): _S.HOLDING,  # a broker joined closer while it pulled: a copy now
    (_S.SYNCING, _T.TAKE_OVER): _S.TAKING_OVER,  # a failure while it pulled: re-deliver once caught up
    (_S.SYNCING, _T.PLACE): _S.PLACING,
    (_S.SYNCING, _T.RECEIVE): _S.RECEIVING,
    (_S.SYNCING, _T.DROP): _S.GONE,
    (_S.TAKING_OVER, _T.CAUGHT_UP): _S.SERVING,
    (_S.TAKING_OVER, _T.DEMOTE): _S.HOLDING,
    (_S.TAKING_OVER, _T.TAKE_OVER): _S.TAKING_OVER,  # another failure: ask the holders of the new view too
    (_S.TAKING_OVER, _T.RECEIVE): _S.RECEIVING,
    (_S.TAKING_OVER, _T.DROP): _S.GONE,
    (_S.PLACING, _T.PLACED_HERE): _S.SERVING,
    (_S.PLACING, _T.DEMOTE): _S.HOLDING,
    (_S.PLACING, _T.RECEIVE): _S.RECEIVING,  # a hand-over wins over a placement still under way
    (_S.PLACING, _T.DROP): _S.GONE,
    (_S.HANDING_OVER, _T.MOVE_ABORTED): _S.SERVING,
    (_S.HANDING_OVER, _T.MOVED_LOCALLY): _S.SERVING,
    (_S.HANDING_OVER, _T.HANDED_OVER): _S.HOLDING,
    (_S.HANDING_OVER, _T.DROP): _S.GONE,
    (_S.RECEIVING, _T.ACTIVATE): _S.SERVING,
    (_S.RECEIVING, _T.DROP): _S.GONE,
    (_S.RECOVERING, _T.SYNC): _S.SYNCING,
    (_S.RECOVERING, _T.CAUGHT_UP): _S.SERVING,  # primary with nobody to ask: its disk is all there is
    (_S.RECOVERING, _T.DEMOTE): _S.HOLDING,
    (_S.RECOVERING, _T.RETIRE): _S.RETIRING,
    (_S.RECOVERING, _T.DROP): _S.GONE,
    # Whatever a replica was doing, once the view ranks it out it hands its records on before it goes
    # (HANDING_OVER and RECEIVING finish first: a move settles the roles itself).
    (_S.HOLDING, _T.RETIRE): _S.RETIRING,
    (_S.SERVING, _T.RETIRE): _S.RETIRING,
    (_S.SYNCING, _T.RETIRE): _S.RETIRING,
    (_S.TAKING_OVER, _T.RETIRE): _S.RETIRING,
    (_S.PLACING, _T.RETIRE): _S.RETIRING,
    (_S.RETIRING, _T.RETIRE): _S.RETIRING,  # the holders changed again: offer to the new ones
    (_S.RETIRING, _T.KEEP): _S.HOLDING,
    (_S.RETIRING, _T.DROP): _S.GONE,
}
# GONE is final: a replica dropped from the broker never comes back (a new one is made if needed).

# Requests for the topic wait (queued) while the replica is in one of these stages.
WAITING: Final = frozenset(
    {Stage.SYNCING, Stage.TAKING_OVER, Stage.PLACING, Stage.HANDING_OVER, Stage.RECEIVING, Stage.RECOVERING}
)
# Stages that pull the history from the other holders.
PULLING: Final = frozenset({Stage.SYNCING, Stage.TAKING_OVER})
# What an operator sees of a stage (`sedax status`, the metrics; overlay.protocol.TopicHeld): where the replica
# stands with the topic's other holders.
OPERATOR_STATE: Final[dict[Stage, str]] = {
    Stage.HOLDING: "caught_up",
    Stage.SERVING: "caught_up",
    Stage.SYNCING: "syncing",
    Stage.TAKING_OVER: "syncing",
    Stage.PLACING: "placing",
    Stage.HANDING_OVER: "moving",
    Stage.RECEIVING: "moving",
    Stage.RECOVERING: "recovering",
    Stage.RETIRING: "retiring",
    Stage.GONE: "gone",
}


class IllegalTransition(LocalProtocolError):
    """A step one of this module's tables does not allow: a bug in the pub/sub engine, not in the peer."""

    def __init__(
        self, topic: str, what: str, stage: enum.Enum, step: enum.Enum, table: Mapping[tuple[Any, Any], Any]
    ) -> None:
        allowed = sorted(t.value for (s, t) in table if s is stage)
        super().__init__(
            f"topic {topic!r}: {step.value} is not allowed in {what} {stage.value} "
            f"(allowed there: {', '.join(allowed) or 'nothing, the stage is final'})"
        )
        self.topic = topic


class IllegalReplicaTransition(IllegalTransition):
    """A transition of the replica's stage that _TRANSITIONS does not allow."""

    def __init__(self, topic: str, stage: Stage, transition: Transition) -> None:
        super().__init__(topic, "stage", stage, transition, _TRANSITIONS)
        self.stage = stage
        self.transition = transition


def next_stage(topic: str, stage: Stage, transition: Transition) -> Stage:
    """The stage transition leads to from stage, or IllegalReplicaTransition."""
    new = _TRANSITIONS.get((stage, transition))
    if new is None:
        raise IllegalReplicaTransition(topic, stage, transition)
    return new


def transitions() -> dict[tuple[Stage, Transition], Stage]:
    """A copy of the table (for tests and documentation)."""
    return dict(_TRANSITIONS)


@dataclass(slots=True)
class Waiting:
    """A stored message whose publisher still waits for its acknowledgement."""

    record: Record
    access: NodeInfo
    session: str


@dataclass(slots=True)
class Batch:
    """A REPLICATE batch the primary sent to its secondary, in `Replica.window` until confirmed in order.

    Several are in flight at once (REPLICATION_WINDOW), so a confirmation proves only its own batch held: the
    records up to `upto` are all at the target once this batch and every earlier one are confirmed, or once a
    `whole` batch is (it carries everything not yet confirmed, so it needs none of the earlier ones)."""

    corr: int  # of the batch's last chunk, which the secondary confirms (as before the window)
    target: str  # the secondary's node id
    sent_at: float
    upto: float  # every record stored up to this timestamp is in this batch or an earlier one
    whole: bool  # every record not yet confirmed (the first batch to a new secondary, a re-send)
    confirmed: bool = False
    # A re-send after a time-out carries this batch's records again: it no longer times out nor takes a
    # window slot, but its confirmation still counts (under load a reply can be slower than the time-out).
    superseded: bool = False
    meta_version: int = -1  # the Replica.meta_version it carried (-1: records only)
    held_until: float = 0.0  # not re-sent before this: the copy was still confirming earlier ones (PeerProgress)

    def resend_at(self, rto: float) -> float:
        """When it is re-sent if not confirmed, at its copy's re-send time-out rto (replication.py `tick`)."""
        return max(self.sent_at + rto, self.held_until)


@dataclass(slots=True)
class Backfill:
    """The history a primary copies to a new secondary (replication.py `backfill`): an OFFER of everything it
    keeps, which the secondary answers with a PULL for what it lacks; confirmed once that is on its disk."""

    corr: int  # the OFFER's (its PULL and the last chunk of the answer carry it too)
    target: str  # the secondary's node id
    at: float  # when it was offered, or the answer last made progress (the time-out counts from here)
    mark: int = 0  # where the OFFER, or the answer's last chunk once sent, stands among what went out (PeerProgress)

    def until(self, offer_timeout: float) -> float:
        """When it is offered again if not confirmed (replication.py `_tick_backfill`)."""
        return self.at + offer_timeout


class CopyStage(enum.Enum):
    """Where a replica's history stands at its next holder (see the module docstring)."""

    ALONE = "alone"
    WANTED = "wanted"
    OFFERED = "offered"
    OFFERED_WANTED = "offered_wanted"
    HELD = "held"

    __hash__ = object.__hash__  # (as Stage's)


class CopyEvent(enum.Enum):
    """The named steps of the copy at the next holder."""

    WANT = "want"  # a new next holder, a merge or a take-over brought records it may lack, a restart, a move
    OFFER = "offer"  # a back-fill leaves (replication.py `backfill`)
    CONFIRMED = "confirmed"  # the next holder confirmed it holds what was offered
    LAPSED = "lapsed"  # the back-fill ended unconfirmed (time-out) or was confirmed by a broker no longer next
    ALONE = "alone"  # no next holder (no secondary; a copy ranked last; a former primary that handed a move over)


_C, _E = CopyStage, CopyEvent
_COPY_TRANSITIONS: Final[dict[tuple[CopyStage, CopyEvent], CopyStage]] = {
    (_C.ALONE, _E.WANT): _C.WANTED,
    (_C.WANTED, _E.WANT): _C.WANTED,
    (_C.HELD, _E.WANT): _C.WANTED,
    (_C.OFFERED, _E.WANT): _C.OFFERED_WANTED,
    (_C.OFFERED_WANTED, _E.WANT): _C.OFFERED_WANTED,
    (_C.WANTED, _E.OFFER): _C.OFFERED,
    # A primary offers again at once (its next flush): the new offer, from what it holds now, replaces the old.
    (_C.OFFERED_WANTED, _E.OFFER): _C.OFFERED,
    (_C.OFFERED, _E.CONFIRMED): _C.HELD,
    (_C.OFFERED_WANTED, _E.CONFIRMED): _C.WANTED,
    (_C.OFFERED, _E.LAPSED): _C.WANTED,
    (_C.OFFERED_WANTED, _E.LAPSED): _C.WANTED,
    **{(c, _E.ALONE): _C.ALONE for c in CopyStage},
}
# Stages in which the next holder does not yet hold the whole history.
COPYING: Final = frozenset({CopyStage.WANTED, CopyStage.OFFERED, CopyStage.OFFERED_WANTED})


class IllegalCopyTransition(IllegalTransition):
    """A step of the copy at the next holder that _COPY_TRANSITIONS does not allow."""

    def __init__(self, topic: str, stage: CopyStage, event: CopyEvent) -> None:
        super().__init__(topic, "copy stage", stage, event, _COPY_TRANSITIONS)
        self.stage = stage
        self.event = event


def copy_transitions() -> dict[tuple[CopyStage, CopyEvent], CopyStage]:
    """A copy of the copy machine's table (for tests and documentation)."""
    return dict(_COPY_TRANSITIONS)


@dataclass(slots=True)
class Copy:
    """A replica's history at its next holder: the stage (`_COPY_TRANSITIONS`), the back-fill under way (OFFERED,
    OFFERED_WANTED) and the last next holder known to hold the history (`holder`, kept while a merge since wants
    another back-fill: it lacks only what that brought)."""

    topic: str
    stage: CopyStage = CopyStage.WANTED  # a new replica's next holder gets the history
    offer: Backfill | None = None
    holder: str | None = None

    def _step(self, event: CopyEvent) -> None:
        new = _COPY_TRANSITIONS.get((self.stage, event))
        if new is None:
            raise IllegalCopyTransition(self.topic, self.stage, event)
        self.stage = new
        if new not in (CopyStage.OFFERED, CopyStage.OFFERED_WANTED):
            self.offer = None

    def want(self, *, new_holder: bool = False) -> None:
        """The next holder is to be given the history; new_holder: it is not the one that held it."""
        self._step(CopyEvent.WANT)
        if new_holder:
            self.holder = None

    def offered(self, backfill: Backfill) -> None:
        self._step(CopyEvent.OFFER)
        self.offer = backfill

    def confirmed(self, node: str) -> None:
        """node, the next holder, holds what was offered: HELD, or WANTED again if records came meanwhile (then
        holder stays as it was: node may lack what they brought)."""
        if self.stage is CopyStage.OFFERED:
            self.holder = node
        self._step(CopyEvent.CONFIRMED)

    def lapsed(self) -> None:
        self._step(CopyEvent.LAPSED)

    def alone(self) -> None:
        self._step(CopyEvent.ALONE)
        self.holder = None

    @property
    def wanted(self) -> bool:
        return self.stage is CopyStage.WANTED or self.stage is CopyStage.OFFERED_WANTED

    def knows(self, node: str) -> bool:
        """node holds the history, or is being given it."""
        return self.holder == node or (self.offer is not None and self.offer.target == node)

    def next_is(self, node: str) -> bool:
        """node is the next holder now: unless it holds the history or is being given it, the history is wanted
        for it (the holder that had it no longer counts).  True if it was new."""
        if self.knows(node):
            return False
        self.want(new_holder=True)
        return True


@dataclass(slots=True)
class Pulling:
    """SYNCING, TAKING_OVER: the pull from the topic's other holders (sync.py `start_pull`)."""

    asked: dict[int, str] = field(default_factory=dict)  # pull corr -> the node asked, until it answered
    started: float = 0.0
    heard: float = 0.0  # when the last chunk of an answer came: a long history still streaming is no time-out
    retried: bool = False  # asked again once (sync.py `retry_pull`)
    held_until: float = 0.0  # not asked again before this: an asked holder still answered earlier questions
    answered_in: float = 0.0  # how long the first holder to answer took (0: none has yet)
    # A serving primary that found another holder had records it lacks (the other side of a healed partition)
    # pulls them, and its subscribers, who never got them, receive them like new ones (holder.merged).
    push_merged: bool = False
    # ... and the digests of the OFFERs that started it, by offerer: subscribers the offerer hands over with its
    # answer get what it lacked (replication.py `replicate_arrived`).
    offered: dict[str, dict[str, SeqRanges]] = field(default_factory=dict)

    def answered(self, now: float) -> None:
        """One asked holder answered completely (others may still be asked)."""
        if not self.answered_in:
            self.answered_in = max(now - self.started, 1e-9)

    def retry_due(self, now: float, pull_timeout: float) -> bool:
        """Time to ask the holders that have not answered once more (see PULL_RETRY_FACTOR)."""
        return now > self.retry_at(pull_timeout)

    def retry_at(self, pull_timeout: float) -> float:
        """When the holders that have not answered are asked once more (math.inf: not again)."""
        if self.retried or not self.asked:
            return math.inf
        after = pull_timeout / 4
        if self.answered_in:
            after = min(after, max(PULL_RETRY_MIN, PULL_RETRY_FACTOR * self.answered_in))
        return max(self.started + after, self.held_until)

    def timeout_at(self, pull_timeout: float) -> float:
        """When the pull finishes with what came, if some asked holders still have not answered (`retry_pull`)."""
        return max(self.started, self.heard) + pull_timeout if self.asked else math.inf


@dataclass(slots=True)
class Move:
    """HANDING_OVER: the move in progress at the old primary."""

    corr: int
    to: Coord
    started: float
    reply: tuple[NodeInfo, str, int] | None  # (access, session, corr) of an operator's MOVE_TOPIC
    leased: bool = False
    force: bool = False

    def until(self, move_timeout: float) -> float:
        """When the move is given up if the new coordinate has not confirmed it (moves.py `tick`)."""
        return self.started + move_timeout


@dataclass(slots=True)
class Staged:
    """RECEIVING: a hand-over at the new primary, waiting for its replica and then for ACTIVATE."""

    origin: NodeInfo
    corr: int
    since: float
    waiters: tuple[Waiter, ...]
    confirmed: bool = False

    def until(self, move_timeout: float) -> float:
        """When the hand-over is dropped if it never activated: the old primary gives up its side after
        move_timeout, and its ACTIVATE or abandonment may take as long again to arrive."""
        return self.since + 2 * move_timeout + 1.0


@dataclass(slots=True)
class Replica:
    """What the holder side keeps per topic besides the stored data (see the module docstring)."""

    name: str
    log: TopicLog
    coord: Coord
    home: Coord
    delegates: list[Delegation]
    stage: Stage = Stage.HOLDING
    subscribers: dict[tuple[str, str], SubRef] = field(default_factory=dict)
    rank: int = 0  # 1 primary, 2 secondary, 3 tertiary, 0 none
    # The history at the next holder (a primary's secondary; at level 3 a secondary's tertiary): `Copy`, made in
    # __post_init__.  Publishes are acknowledged meanwhile on the strength of the batches, the first of which to
    # a new secondary carries every record not yet confirmed.
    copy: Copy = field(init=False)
    # After a take-over: the newest record of the last moments that the first batch copies to the secondary
    # again (sync `redeliver`).  Until confirmed_upto reaches it, a re-send of a stored message waits for
    # a batch (the dead primary may never have acknowledged it, and the new secondary may not hold it yet).
    recopy_from: float = 0.0
    recopy_upto: float = 0.0
    # At a copy: the primary's last word (REPLICATE.delivered_upto, with every batch) on how far it delivered and
    # acknowledged; a take-over re-delivers and re-copies at least what came after it (sync `redeliver`).
    delivered_upto: float = 0.0
    last_ts: float = 0.0
    outbox: list[Record] = field(default_factory=list)  # stored, not yet sent to the secondary
    waiting: list[Waiting] = field(default_factory=list)  # stored, not yet acknowledged to the publisher
    # Indexes over `waiting` so a re-sent message costs O(1): the lowest waiting seq per publisher, and the
    # highest seq each (access, session, publisher) already waits for (a cumulative ACK will cover it).
    first_waiting: dict[str, int] = field(default_factory=dict)
    waiter_max: dict[tuple[str, str, str], int] = field(default_factory=dict)
    undelivered: list[Record] = field(default_factory=list)  # stored, waiting for the replica before delivery
    # What may be acknowledged (holder.commit): every record stored up to confirmed_upto satisfied the copies the
    # resilience level asks for, and up to synced_upto is on this broker's disk (always/batch: group commit).
    confirmed_upto: float = 0.0
    synced_upto: float = 0.0
    # Batches sent to the secondary and not yet confirmed in order, oldest first (replication.py `flush`).
    window: list[Batch] = field(default_factory=list)
    rto: float = REPLICATION_TIMEOUT  # current re-send timeout; doubles while the replica stays silent
    # At the primary: why a copy refused this topic's batches (its disk is full, or its memory over --max-memory),
    # "" while none does.  New publishes get NACK storage_full with that text, before they are stored, until a
    # copy confirms a batch again (a new secondary's first confirmation too), no copy is left, or this broker is
    # no longer primary (replication.py `copy_refused`).
    copy_refused: str = ""
    # Per publisher, the first seq this primary refused with storage_full (nothing from there on was stored):
    # the client fails those publishes and goes on past them, so that jump in its sequence is no loss.
    refused_from: dict[str, int] = field(default_factory=dict)
    queued: list[tuple[NodeInfo, str, Message]] = field(default_factory=list)  # requests held while WAITING
    meta_dirty: bool = False  # subscribers changed: the secondary needs the new list
    # The subscriber list, delegates and publisher table ("meta") travel only until the secondary confirmed
    # them (REPLICATE.meta): a topic with a thousand subscribers or publishers sent them with every message
    # before.  At the primary: the version of the current meta (one more per change sent), and whether the
    # secondary confirmed a batch that carried it.  At a copy: whether it received them from its primary since
    # it was made (a copy read back from disk, or made by a records-only batch, has not: it confirms nothing
    # until a batch brings them).  At a level-3 secondary: the tertiary it last passed them on to.
    meta_version: int = 0
    meta_confirmed: bool = False
    meta_known: bool = False
    meta_chained_to: str | None = None
    moved_at: float = 0.0
    pull: Pulling | None = None  # SYNCING, TAKING_OVER
    move: Move | None = None  # HANDING_OVER
    staged: Staged | None = None  # RECEIVING
    # Offers of this replica's records not yet confirmed: corr -> the node offered to, and when they went out.
    offers: dict[int, str] = field(default_factory=dict)
    offered_at: float = 0.0
    offer_mark: int = 0  # where the offers, or the last answer to their PULLs, stand among what went out (PeerProgress)
    # Stored something since the primary last compared digests with its copies (anti-entropy), and where the
    # last such store stands among what went out (`PeerProgress.mark`): a back-fill offered after it compared
    # them already (replication `_backfilled`).
    unchecked: bool = False
    unchecked_mark: int = 0
    # At a primary: publishers last seen up to here were named in a HEADS already (replication `_tell_heads`).
    heads_at: float = 0.0
    # When its last anti-entropy round was (replication `tick`): each replica has its own, a sweep apart.
    checked_at: float = 0.0
    # When a look of holder `sweep_empty` first found it empty (-1: the last look did not), and when home's
    # `_check_location` last compared its delegate list (0: not yet looked at).  Both looks go by slices.
    empty_since: float = -1.0
    located_at: float = 0.0
    # When the timers look at it next for its work under way (core.TopicTable `wake`, `due`; math.inf: not armed).
    due_at: float = math.inf

    def __post_init__(self) -> None:
        self.copy = Copy(self.name)

    def timing_out(self) -> bool:
        """Work with a precise time-out is under way: an unconfirmed batch, an offer, a pull, a back-fill, a move
        or a hand-over (the timers look at it when the earliest time-out is up: core.TopicTable.wake)."""
        return bool(
            self.window
            or self.offers
            or self.copy.offer is not None
            or (self.pull is not None and self.pull.asked)
            or self.move is not None
            or self.staged is not None
        )

    def enter(self, transition: Transition) -> Stage:
        """Take a transition of the table; the stage-bound data of the stage left is dropped.  The pull
        bookkeeping is made on entering a pulling stage and kept from one to the other (a failure while syncing
        turns the pull into a take-over: the holders already asked still answer it)."""
        new = next_stage(self.name, self.stage, transition)
        if new in PULLING and self.stage not in PULLING:
            self.pull = Pulling()
        elif new not in PULLING:
            self.pull = None
        if self.stage is Stage.HANDING_OVER:
            self.move = None
        if self.stage is Stage.RECEIVING:
            self.staged = None
        self.stage = new
        return new

    @property
    def waits(self) -> bool:
        """Requests for the topic are held (a pull, a placement or a move is under way)."""
        return self.stage in WAITING

    @property
    def recopying(self) -> bool:
        """After a take-over: the batch copying the last moments to the secondary is not yet confirmed."""
        return self.confirmed_upto < self.recopy_upto

    def unconfirmed(self) -> list[Record]:
        """Everything a batch must carry to prove alone that the secondary holds what is not yet confirmed: the
        records not yet acknowledged and, while `recopying`, the last moments (sync `redeliver`), oldest
        first."""
        if not self.recopying:
            return list(self.undelivered)
        recent = [x for x in self.log.since(self.recopy_from) if x.ts <= self.recopy_upto]
        return recent + self.undelivered

    @property
    def delivered_mark(self) -> float:
        """At a primary: every record stored up to this timestamp was delivered and its publisher acknowledged
        (holder.commit does both for the same records; what waits is still in `undelivered`)."""
        return self.undelivered[0].ts - TS_EPSILON / 2 if self.undelivered else self.last_ts

    @property
    def copying(self) -> bool:
        """At a primary: the secondary does not hold the whole history yet (a back-fill is wanted or under way)."""
        return self.copy.stage in COPYING

    def meta(self) -> tuple[tuple[SubRef, ...], tuple[Delegation, ...], dict[str, int]]:
        """What a copy needs besides the records (REPLICATE's subscribers, delegates and last_seq), as sent."""
        return tuple(self.subscribers.values()), tuple(self.delegates), dict(self.log.last_seq)

    def forget_primary_work(self) -> None:
        """Drop what only a serving primary keeps: batches in flight, publishes waiting for their acknowledgement
        (their publishers re-send them to whoever is primary now), what is not yet copied or delivered."""
        self.window.clear()
        self.waiting.clear()
        self.first_waiting.clear()
        self.waiter_max.clear()
        self.outbox.clear()
        self.undelivered.clear()
        self.copy_refused = ""

    def place(self, coord: Coord, delegates: list[Delegation]) -> None:
        """Hold the topic for coord, with delegates as its list (a move; a newer list learned): on the disk too
        (meta.json), so that a broker started again takes its copy back where the topic was and knows how recent
        that is.  (Only the coordinate the copy was first made for was written: after a full restart the old
        primary of a moved topic, still a holder where it moved, served it again at its home.)"""
        delegates = held_list(coord, delegates, self.home)
        if coord == self.coord and delegates == self.delegates:
            return
        self.coord = coord
        self.delegates = delegates
        self.log.relocate(coord, journal_list(delegates))

    def settle(self) -> None:
        """After the rank changed: a steady copy that became closest serves, a steady primary that did not holds."""
        if self.stage is Stage.RETIRING and self.rank != 0:
            self.enter(Transition.KEEP)
        if self.stage is Stage.HOLDING and self.rank == 1:
            self.enter(Transition.PROMOTE)
        elif self.stage is Stage.SERVING and self.rank != 1:
            self.enter(Transition.DEMOTE)


def held_list(coord: Coord, delegates: list[Delegation], home: Coord) -> list[Delegation]:
    """The delegate list a copy held for coord keeps: delegates if it ends at coord.  A list that ends elsewhere
    does not say when the topic came here (a copy made for a coordinate the topic has left, from a sender that
    had not heard): this copy's own list is unknown, the oldest there is ([home@0]), so that any copy whose list
    ends where it is held counts as later (overlay.pubsub.later)."""
    if not delegates or delegates[-1].coord != coord:
        return [Delegation(home, 0.0)]
    return delegates


def journal_list(delegates: list[Delegation]) -> tuple[tuple[Coord, float], ...]:
    """The list as meta.json keeps it: ((x, y), start) per entry, () for a topic that never left its home."""
    return tuple((d.coord, d.start) for d in delegates) if len(delegates) > 1 else ()
