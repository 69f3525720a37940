"""The settings of the pub/sub engine: its time-outs and windows, and `PubSubConfig`.

Each setting has one default: here, or in broker/defaults.py for the ones a broker also exposes as flags
(--resilience, --move-cooldown), which BrokerConfig starts from too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from broker import defaults
from broker.store import Retention
from overlay.geometry import UNIT_SQUARE, Space
from overlay.pubsub import MAX_TOPIC_ENTRIES

if TYPE_CHECKING:  # broker.acl imports broker.config, which takes its defaults from here
    from broker.acl import Acl

# A replica that has not confirmed a batch in this long is presumed gone; the batch goes to whoever is the
# secondary by then.  Well under a second, so a publisher's acknowledgement is not held up for long.
REPLICATION_TIMEOUT: Final = 0.5
# The re-send time-out doubles while a replica stays silent (a busy machine), up to this.
MAX_RTO: Final = 8.0
# Replication batches a primary keeps in flight per topic (level >= 2), confirmed in order.  With one (stop
# and wait) a message stored during a round trip to the secondary waited for that round trip, then for its
# own.  A round trip spans a few of the primary's loop turns (one batch each) under load; more in flight buy
# nothing: while the window is full the outbox grows and leaves as one larger batch on the next confirmation.
# The bound also caps what a secondary holds chained to its tertiary per topic (level 3).
REPLICATION_WINDOW: Final = 8
# Batches a re-send superseded, kept for their late confirmations (the newest re-send carries their records;
# older ones are forgotten).
MAX_SUPERSEDED: Final = 64
# How long a broker that became closest waits for the previous holders to hand a topic over before it
# serves the topic from what it has.
PULL_TIMEOUT: Final = 1.0
# A pull waits this long at most for a holder still in the view that has answered nothing of this broker's yet
# (sync.py `retry_pull`): a broker that just joined asks brokers still busy with the join's other work.
PULL_WAIT_MAX: Final = 5.0
# An asked holder that has not answered a pull is asked once more (its answer, or the pull, may have been lost
# on a route through a broker that had not yet noticed a failure).  Once another holder has answered, after
# PULL_RETRY_FACTOR times that answer's delay (at least PULL_RETRY_MIN s); before any answer, after a quarter
# of the pull time-out.  A SIGKILL failover waited ~280 ms for such a lost answer in 1 of ~10 trials
# (docs/benchmarks-latency.md, "Eleventh round").
PULL_RETRY_FACTOR: Final = 10.0
PULL_RETRY_MIN: Final = 0.02
# After a take-over the new primary re-delivers what it received in this window before the failure: the
# old primary may have died between replicating and delivering.  Subscribers drop what they already had.
REDELIVER_WINDOW: Final = 2.0
# How long a primary waits for the new coordinate's holders to confirm a hand-over before it aborts the move
# and keeps serving the topic where it was.
MOVE_TIMEOUT: Final = 5.0
# Replicas re-ranked per turn of the event loop after a view change (RankRole.view_changed): the walk of every
# topic held, with the offers and back-fills it starts, cost ~40-90 us a replica, 1.7-1.9 s in one turn at
# 20,000 replicas, and a broker that silent is taken for dead (bench_join.py, docs/benchmarks-scale.md).
RERANK_SLICE: Final = 256
# Requests of a view change's walk (offers, back-fills, pulls) one peer may have unanswered before the walk waits
# for its answers (RankRole `step`, PeerProgress `room`).  Links deliver in order: everything the walk sends a
# peer is queued there ahead of the next batch, confirmation or pull answer of a topic with publishers waiting.
# Unpaced, a broker that joined next to 30,000 topics was sent ~100,000 offers at once by its neighbours, and
# publishes to topics it took on waited up to 8.5 s, four or five past the client's 10 s time-out (bench_join.py).
# Paced, at 30,000 topics, ACK p50 / p99 through the join and its time until nothing lagged (a run or two): 1,024:
# 8 / 2,279 ms, 27 s; 256: 12 / 968 ms, 27 s; 128: 124 / 534 ms, 27 s; 64: 77-81 / 418-439 ms, 32-35 s; 32: 58 / 338
# ms, 45 s.  Unpaced: 5-9 / 6,600-8,200 ms, 23-24 s, and 4-6 publishes failed.
BULK_WINDOW: Final = 64
# How often a broker sums what its stored messages take in memory against --max-memory (HolderRole.check_memory):
# a sum over the topics held, not a count kept on every store.
MEMORY_CHECK: Final = 0.5
# A former primary forwards requests that still reach it for this long after a move (clients it could not
# redirect, the home's list not yet updated), then forgets the topic.
FORWARD_TTL: Final = 60.0
# A holder that offered its records (leaving the top ranks, shutting down) offers again to whoever holds the
# topic by then when an offer is not confirmed in this long.
OFFER_TIMEOUT: Final = 2.0
# A primary compares digests with its copies this often, for the topics that stored something since the last
# comparison (anti-entropy: a stretch a copy missed is sent again; an idle topic costs nothing).
ANTI_ENTROPY_INTERVAL: Final = 5.0
# An access broker that registered its sessions again where a view change moved a topic's N1 does so once more
# after this long (access `view_changed`): the first may have been dropped while the links formed.
REGISTER_AGAIN: Final = 1.0
# A long answer to a pull (a new holder's history) goes SYNC_WINDOW chunks of SYNC_CHUNK records at a time
# (sync.py `_Answer`): the next leaves when the asker confirmed one.  Sent all at once, 300,000 records
# stalled the answering broker's event loop ~0.4 s and queued 36 MB ahead of the topic's next batches on the
# link.  A batch now waits behind at most the chunks in flight at the secondary: with 4 x 512 each publish took
# ~4.5 ms while the history streamed, with 2 x 128 ~1 ms, and the stream took as long (~0.7 s for 300,000
# records, bench_anti_entropy.py; docs/benchmarks-latency.md "Thirteenth round").  Answers of at most
# SYNC_WINDOW x SYNC_CHUNK records leave at once.
SYNC_WINDOW: Final = 2
SYNC_CHUNK: Final = 128  # (at most MAX_BATCH; a chunk is split further if its bytes need it)
# Level 3: batches a secondary passed on to the tertiary and awaits the confirmation of (older ones are
# forgotten: the primary re-sends what stays unconfirmed).
MAX_CHAINED: Final = 4096
# A graceful shutdown waits at most this long for the topics' next holders to confirm they hold everything
# (with the links' drain time it stays within the 10 s a supervisor such as Docker grants before SIGKILL).
HANDOFF_TIMEOUT: Final = 2.5
# A topic with nothing in it (no message kept, no publisher remembered, no subscriber, nothing under way) is
# forgotten by each of its holders once two looks found it so, EMPTY_TOPIC_SWEEP apart: a subscription
# taken and dropped, or a FETCH of a name nobody used, must not leave a replica (and a file in the data
# directory) on two or three brokers for ever.
EMPTY_TOPIC_SWEEP: Final = 60.0
# Coordinates closer than this are the same coordinate (they travel as floats through JSON and msgpack).
SAME_COORD: Final = 1e-12
# How often the holders of a moved topic compare its delegate list with the home's (HomeRole `_check_location`):
# a copy held at another coordinate than the home gives the home its list, and the home gives its list to the
# home coordinate's other holders.  A copy a move left behind that nothing else talks to (its own secondary
# stale too, or the home's secondary, cut off during the move) so learns the later list and follows the topic,
# and a home that lost its list learns it again.  Before, such a copy stayed where it was until the next view
# change near it, holding disk and counting in its brokers' loads.
LOCATION_CHECK_INTERVAL: Final = 30.0
# Every anti-entropy round a primary tells its subscribers the newest seq of each publisher that went quiet
# since the last round, once it has been quiet this long (HEADS; a publisher still publishing shows a gap with
# its next message).  A subscriber that lost such a publisher's last messages on the way (a DELIVER lost with a
# link, records merged from another holder without a push) so fetches them within a round or two, instead of
# never if the publisher stays quiet.  Long enough that what it names was delivered (replication takes ms).
HEADS_QUIET: Final = 1.0


@dataclass(frozen=True, slots=True)
class PubSubConfig:
    """Settings of the pub/sub layer."""

    resilience: int = defaults.RESILIENCE
    retention: Retention = field(default_factory=Retention)
    replication_timeout: float = REPLICATION_TIMEOUT
    pull_timeout: float = PULL_TIMEOUT
    redeliver_window: float = REDELIVER_WINDOW
    move_timeout: float = MOVE_TIMEOUT
    offer_timeout: float = OFFER_TIMEOUT
    bulk_window: int = BULK_WINDOW
    anti_entropy_interval: float = ANTI_ENTROPY_INTERVAL
    location_check_interval: float = LOCATION_CHECK_INTERVAL
    heads_quiet: float = HEADS_QUIET
    handoff_timeout: float = HANDOFF_TIMEOUT
    forward_ttl: float = FORWARD_TTL
    move_cooldown: float = defaults.MOVE_COOLDOWN
    space: Space = UNIT_SQUARE
    # A tertiary forgets a TERTIARY_NOTE this long after it was sent (primaries repeat theirs every load report
    # interval), so a topic that moved away stops weighing on its former tertiary's L3_N at once.
    note_ttl: float = 4.0
    acl: Acl | None = None  # topic ACL the holder enforces (broker/acl.py); None = everything allowed
    # Subscribers plus publishers in its table one topic holds (overlay.pubsub.MAX_TOPIC_ENTRIES: what a frame
    # between brokers carries); the primary refuses a new one beyond it (topic_full).
    max_topic_entries: int = MAX_TOPIC_ENTRIES
    # Bytes the stored messages of every topic held here may take in memory (TopicStore.memory); beyond it new
    # publishes and copies of new messages are refused (storage_full).  0: no limit.
    max_memory: int = 0
