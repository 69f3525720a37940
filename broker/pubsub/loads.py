"""The load role: what this broker holds, by role, in the units of the paper's load model (Sec. IV).

L1_N, L2_N and L3_N (eqs. 1, 2, 4) are computed by overlay.load from the stored bytes of the topics held; the
tertiary side of L3_N (eq. 3) needs to know which topics this broker would take over after a failure, which
the primaries tell it in TERTIARY_NOTEs (kept for `note_ttl`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final

from broker.pubsub.core import TopicTable, same
from broker.pubsub.replica import OPERATOR_STATE, Replica, Stage
from broker.stats import TopicCensus
from broker.sweep import Sweep
from overlay.delegation import NodeLoad, TertiaryNote
from overlay.geometry import Coord
from overlay.load import failure_sums, l3_additional
from overlay.protocol import NodeInfo
from overlay.pubsub import Delegation

if TYPE_CHECKING:
    from broker.pubsub.home import HomeRole


# Replicas a scrape's census counts per step (`LoadRole.census`): ~1-2 ms of the event loop each.
CENSUS_SLICE: Final = 2000
_RANK_ROLE: Final = {2: "secondary", 3: "tertiary"}


def _role(r: Replica) -> str:
    """This broker's role for r's topic: primary (at the topic's home coordinate), delegate (primary at a
    delegate coordinate), secondary, tertiary, none."""
    if r.rank == 1:
        return "primary" if same(r.coord, r.home) else "delegate"
    return _RANK_ROLE.get(r.rank, "none")


def _state(r: Replica) -> tuple[str, int, int]:
    """(state with the other holders, bytes behind, pulls or offers pending) of r (TopicHeld says what each means)."""
    state = OPERATOR_STATE[r.stage]
    if r.copy.offer is not None and r.stage in (Stage.SERVING, Stage.HOLDING):
        state = "backfilling"  # the next holder is being given the history (replication.py `backfill`)
    if r.stage is Stage.RETIRING:
        behind = r.log.size
    elif r.rank == 1:
        behind = sum(len(x.payload) for x in r.undelivered)
    else:
        behind = 0
    pending = (len(r.pull.asked) if r.pull is not None else 0) + len(r.offers) + (r.copy.offer is not None)
    return state, behind, pending


class LoadRole:
    """Topic listings and load accounting (see the module docstring)."""

    def __init__(self, table: TopicTable, home: HomeRole) -> None:
        self.t = table
        self.home = home
        self._t3notes: dict[str, tuple[str, str, float, float]] = {}  # topic -> (N1, N2, size, until)
        self._note_sweep: Sweep[str] = Sweep()

    def tertiary_note_arrived(self, m: TertiaryNote) -> None:
        """TERTIARY_NOTE: the topics this broker would take over if both their N1 and N2 failed."""
        until = self.t.ov.now() + self.t.config.note_ttl
        for (topic, n1, n2), size in zip(m.pairs, m.sizes, strict=True):
            self._t3notes[topic] = (n1, n2, size, until)

    def forget_note(self, topic: str) -> None:
        self._t3notes.pop(topic, None)

    def topics(self, names: Iterable[str]) -> list[tuple[str, str, int]]:
        """(topic, role, stored bytes) of those of `names` held here, and of the delegated topics among them this
        broker is home of (a page of STATUS; a name held in no role has no entry; every topic: `rows`).

        Roles: primary (at the topic's home coordinate), delegate (primary at a delegate coordinate),
        secondary, tertiary, home (keeps the delegate list of a topic that lives elsewhere).
        """
        replicas, lists = self.t.replicas, self.home.delegate_lists
        wanted = list(names)
        out = [(r.name, _role(r), r.log.size) for n in wanted if (r := replicas.get(n)) is not None]
        out.extend((n, "home", 0) for n in wanted if (dl := lists.get(n)) is not None and self._home_of(n, dl))
        return out

    def _home_of(self, topic: str, dl: list[Delegation]) -> bool:
        """This broker keeps the delegate list of a topic that lives elsewhere (the "home" role)."""
        home = self.t.home(topic)
        return not same(dl[-1].coord, home) and self.t.closest_id(home) == self.t.ov.me.id

    def held_names(self) -> list[str]:
        """The names `topics` may list, sorted: every replica's, and every delegate list's (whether this broker
        is the home of it now is up to the view)."""
        return sorted(self.t.replicas.keys() | self.home.delegate_lists.keys())

    def held_count(self) -> int:
        """How many entries all pages of `topics` have, without making them (the delegate lists are the moved
        topics)."""
        return len(self.t.replicas) + len(self._homes())

    def replica_states(self, topics: Iterable[str]) -> dict[str, tuple[str, int, int]]:
        """topic -> (state, bytes behind, pulls or offers pending) for those of topics held here (TopicHeld says
        what each means): what an operator watches while data follows a membership change.  A page of STATUS
        asks for its topics only (every topic: `census`): the sums are over each primary's undelivered records."""
        replicas = self.t.replicas
        return {r.name: _state(r) for t in topics if (r := replicas.get(t)) is not None}

    def _in_slices(self, take: Callable[[list[Replica]], None]) -> Iterator[None]:
        """Give `take` the replicas held, CENSUS_SLICE at a time, a step apart: the caller lets the event loop run
        at each step, and each slice is of those still held when it is taken."""
        replicas = self.t.replicas
        held = list(replicas.values())
        for start in range(0, len(held), CENSUS_SLICE):
            if start:
                yield
            take([r for r in held[start : start + CENSUS_SLICE] if replicas.get(r.name) is r])

    def _homes(self) -> list[str]:
        """The topics this broker keeps the delegate list of while they live elsewhere (the "home" role)."""
        return [topic for topic, dl in list(self.home.delegate_lists.items()) if self._home_of(topic, dl)]

    def rows(self, into: list[tuple[str, str, int]]) -> Iterator[None]:
        """Every row `topics` has for all names held, into `into`, a slice of the replicas per step: the caller
        lets the event loop run between steps (a metrics log snapshot: at 100,000 topics one listing held the loop
        ~0.1 s)."""
        yield from self._in_slices(lambda held: into.extend((r.name, _role(r), r.log.size) for r in held))
        into.extend((topic, "home", 0) for topic in self._homes())

    def census(self, into: TopicCensus) -> Iterator[None]:
        """Count the topics held into `into` (what `topics` and `replica_states` list, summed), a slice of the
        replicas per step: the caller lets the event loop run between steps.  A scrape of the metrics that
        listed every topic at once held the loop for ~0.2 s at 100,000 topics."""
        roles, stored, states = into.roles, into.stored, into.states

        def count(held: list[Replica]) -> None:
            for r in held:
                role = _role(r)
                roles[role] = roles.get(role, 0) + 1
                stored[role] = stored.get(role, 0) + r.log.size
                state, behind, pending = _state(r)
                states[state] = states.get(state, 0) + 1
                into.behind += behind
                into.pending += pending

        yield from self._in_slices(count)
        roles["home"] = roles.get("home", 0) + len(self._homes())

    def topic_coord(self, topic: str) -> Coord | None:
        """C(t) of a topic this broker holds, or None."""
        r = self.t.replicas.get(topic)
        return r.coord if r is not None else None

    def primary_topics(self) -> dict[str, int]:
        """Topics this broker is responsible for and free to move (Alg. 2's candidates): name -> bytes."""
        return {r.name: r.log.size for r in self._of_rank(1) if r.stage is Stage.SERVING}

    def topic_triple(self, topic: str) -> tuple[str, str, str]:
        """N1, N2, N3 node ids of a topic's coordinate ('' where there is none)."""
        r = self.t.replicas.get(topic)
        coord = r.coord if r is not None else self.t.home(topic)
        ids = [n.id for n in self.t.ranked(coord)]
        return (ids[0], ids[1] if len(ids) > 1 else "", ids[2] if len(ids) > 2 else "")

    def _t3_items(self) -> list[tuple[str, str, float]]:
        items: dict[str, tuple[str, str, float]] = {}
        for topic, (n1, n2, size, _) in self._t3notes.items():
            items[topic] = (n1, n2, size)
        for r in self._of_rank(3):
            ranked = self.t.ranked(r.coord)
            items[r.name] = (ranked[0].id, ranked[1].id, float(r.log.size))
        return list(items.values())

    def _of_rank(self, rank: int) -> list[Replica]:
        """The replicas this broker holds at rank (the store's tally of them knows which: no walk of all)."""
        replicas = self.t.replicas
        return [r for name in self.t.store.tallies[rank].names if (r := replicas.get(name)) is not None]

    def load_record(self) -> NodeLoad:
        """This broker's load record for LOAD_REPORT: t1, t2 and the eq. (3) failure sums, in bytes."""
        t1, t2 = float(self.t.store.held(1)), float(self.t.store.held(2))
        return NodeLoad(self.t.ov.me, t1, t2, failure_sums(self._t3_items()), self.t.ov.now())

    def loads(self) -> dict[str, int]:
        """L1_N, L2_N, L3_N of this broker in bytes (eqs. 1, 2, 4) from the topics it holds."""
        l1 = self.t.store.held(1)
        l2 = l1 + self.t.store.held(2)
        return {"L1": l1, "L2": l2, "L3": l2 + int(l3_additional(failure_sums(self._t3_items())))}

    def tertiary_notes(self) -> dict[str, tuple[NodeInfo, list[tuple[str, str, str]], list[float]]]:
        """Level 3: for each third-closest node of this broker's topics, what it would take over (eq. 3)."""
        out: dict[str, tuple[NodeInfo, list[tuple[str, str, str]], list[float]]] = {}
        if self.t.config.resilience < 3:
            return out
        for r in self._of_rank(1):
            ranked = self.t.ranked(r.coord)
            if len(ranked) < 3:
                continue
            entry = out.setdefault(ranked[2].id, (ranked[2], [], []))
            entry[1].append((r.name, ranked[0].id, ranked[1].id))
            entry[2].append(float(r.log.size))
        return out

    def tick(self, now: float) -> None:
        """Forget expired notes: a slice of them per tick (broker/sweep.py), as many as the topics held at level 3."""
        notes = self._t3notes
        for topic in self._note_sweep.take(notes, now):
            if (note := notes.get(topic)) is not None and note[3] < now:
                del notes[topic]
