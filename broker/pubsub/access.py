"""The access role: the client sessions attached to this broker and their requests.

A client request (SUBSCRIBE, PUBLISH, ...) is wrapped in a TOPIC_REQUEST and routed to the topic's
coordinate C(t) (h(t) unless a redirect taught us otherwise); answers come back as TOPIC_REPLY routed to this
broker's own coordinate and are handed to the sessions.  Requests for the same coordinate that arrive in one
loop turn travel in one TOPIC_REQUEST, whichever sessions they come from (each with its own identity).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final

from broker.acl import refusal
from broker.pubsub.core import TopicTable, control_frame, frame_chunks, same
from broker.pubsub.settings import REGISTER_AGAIN
from overlay.delegation import MoveTopic
from overlay.geometry import Coord
from overlay.protocol import Message, RemoteProtocolError, decode_message, encode_message
from overlay.pubsub import (
    MAX_PAYLOAD_SIZE,
    Deliver,
    Failed,
    Fetch,
    Locate,
    Nack,
    Publish,
    Redirect,
    SessionGone,
    SessionRequests,
    Subscribe,
    TopicReply,
    TopicRequest,
    Unsubscribe,
)
from overlay.topics import BadTopic, validate_topic

if TYPE_CHECKING:
    from broker.pubsub.holder import HolderRole
    from overlay.delegation import TopicMoved


class AccessRole:
    """Client sessions of this broker: requests out, answers in (see the module docstring)."""

    def __init__(self, table: TopicTable) -> None:
        self.t = table
        self.holder: HolderRole  # wired by the engine
        self.session_topics: dict[str, set[str]] = {}  # what each local session subscribed
        self.coords: dict[str, Coord] = {}  # C(t) of topics, learned from redirects
        # Who each local session authenticated as; sent along in TOPIC_REQUEST for the holder's ACL.
        self.identities: dict[str, str] = {}
        # This turn's requests for other brokers: coordinate -> session -> encoded requests, in order.
        self._outgoing: dict[Coord, dict[str, list[bytes]]] = {}
        self._valid_topics: set[str] = set()
        # Each topic a local session subscribed: the broker its requests went to (N1 of its coordinate when the
        # view last changed) and how many local sessions subscribe it.  Registrations are soft state at the
        # holders (a primary that restarts reads its records back, not its subscribers); this broker owns them,
        # so when another broker becomes N1 it registers its sessions there again (`view_changed`).
        self._primaries: dict[str, tuple[str, int]] = {}
        # Topics registered again at a view change, and when to register them once more (`tick`).
        self._again: dict[str, float] = {}

    def client_message(self, session: str, msg: Message) -> None:
        """A message from a client attached to this broker."""
        match msg:
            case Publish():
                if refusal := self.check_publish(msg):
                    self.to_local(session, refusal)
                    return
            case Subscribe() | Unsubscribe() | Fetch() | Locate() | MoveTopic():
                try:
                    validate_topic(msg.topic)
                except BadTopic as exc:
                    self.to_local(session, Failed(msg.corr, msg.topic, "bad_topic", str(exc)))
                    return
                if isinstance(msg, MoveTopic) and not self.t.config.space.contains(msg.to):
                    s = self.t.config.space
                    text = (
                        f"({msg.to[0]}, {msg.to[1]}) is outside the space [{s.xmin}, {s.xmax}] x [{s.ymin}, {s.ymax}]"
                    )
                    self.to_local(session, Failed(msg.corr, msg.topic, "bad_request", text))
                    return
                if isinstance(msg, Subscribe):
                    if not msg.corr:  # (corr 0 is this broker's own registration again: no answer comes)
                        text = "a SUBSCRIBE needs a correlation id above 0"
                        self.to_local(session, Failed(0, msg.topic, "bad_request", text))
                        return
                    topics = self.session_topics.setdefault(session, set())
                    if msg.topic in topics:
                        self.to_local(
                            session,
                            Failed(
                                msg.corr,
                                msg.topic,
                                "already_subscribed",
                                f"this session is already subscribed to {msg.topic!r}; unsubscribe first",
                            ),
                        )
                        return
                    topics.add(msg.topic)
                    self._count(msg.topic, +1)
                elif isinstance(msg, Unsubscribe):
                    self._forget(session, msg.topic)
            case _:
                raise RemoteProtocolError(f"{msg.op} is not a client request")
        self.send_request(msg.topic, session, msg)

    def check_publish(self, msg: Publish) -> Nack | None:
        """The refusal of a malformed PUBLISH: the whole batch at its start, or at its first oversized payload."""
        if msg.topic not in self._valid_topics:
            try:
                validate_topic(msg.topic)
            except BadTopic as exc:
                return Nack(msg.topic, msg.publisher, msg.seq, "bad_topic", str(exc))
            if len(self._valid_topics) < 100_000:  # a cache, not a second topic table
                self._valid_topics.add(msg.topic)
        if (i := msg.oversized(MAX_PAYLOAD_SIZE)) is not None:
            size = len(msg.payloads()[i])
            text = f"payload of seq {msg.seq + i} is {size} bytes, over the limit of {MAX_PAYLOAD_SIZE}"
            return Nack(msg.topic, msg.publisher, msg.seq + i, "too_large", text)
        return None

    def send_request(self, topic: str, session: str, msg: Message) -> None:
        """Hand a request to the topic's primary: at once if that is this broker, else in this turn's batch."""
        coord = self.coords.get(topic) or self.t.home(topic)  # (`coord`, inlined: once per request)
        me = self.t.ov.me
        r = self.t.replicas.get(topic)
        if (r.rank == 1 and r.coord == coord) if r is not None else self.t.closest_id(coord) == me.id:
            if r is not None and type(msg) is Publish and not r.waits and self.t.config.acl is None:
                # The common 0-hop case, a publish to a topic this broker serves as its primary: what
                # handle_request would decide (no ACL, nothing queued, the primary at the coordinate asked for),
                # without deciding it again per message.
                self.holder.publish_checked(r, me, session, msg)
                return
            self.holder.handle_request(me, session, msg, coord, identity=self.identities.get(session, ""))  # 0 hops
        else:
            self._outgoing.setdefault(coord, {}).setdefault(session, []).append(encode_message(msg))
            self.t.schedule()

    def flush(self) -> None:
        """Send this turn's requests, one TOPIC_REQUEST per coordinate (and frame-sized chunk)."""
        out, self._outgoing = self._outgoing, {}
        me = self.t.ov.me
        identities = self.identities
        for coord, by_session in out.items():
            items = [(session, raw) for session, reqs in by_session.items() for raw in reqs]
            for chunk in frame_chunks(items, _request_size):
                self.t.ov.route(coord, TopicRequest(me, _by_session(chunk, identities), dest=coord))

    def session_closed(self, session: str) -> None:
        """A local client went away: end its subscriptions at the topics' primaries."""
        for topic in self.session_topics.pop(session, set()):
            self._count(topic, -1)
            self.send_request(topic, session, Unsubscribe(0, topic))
        self.identities.pop(session, None)

    def acl_reloaded(self) -> int:
        """The ACL was read again: end each local subscription it no longer allows.  The topic's primary is told
        (UNSUBSCRIBE, as when the client leaves) and the client gets a FAILED not_allowed with corr 0, which ends
        that subscription with the reason; a client that subscribes again is refused as any new one is.  Returns
        how many subscriptions ended."""
        acl = self.t.config.acl
        if acl is None:
            return 0
        ended = 0
        for session, topics in self.session_topics.items():
            identity = self.identities.get(session, "")
            for topic in sorted(topics):
                denied = refusal(acl, identity, Subscribe(0, topic), "access")
                if denied is None:
                    continue
                self._forget(session, topic)
                self.send_request(topic, session, Unsubscribe(0, topic))
                self.to_local(session, denied)
                ended += 1
        return ended

    def _forget(self, session: str, topic: str) -> None:
        """The session no longer subscribes topic (unsubscribed, or refused by the primary)."""
        topics = self.session_topics.get(session)
        if topics is not None and topic in topics:
            topics.discard(topic)
            self._count(topic, -1)

    def _count(self, topic: str, delta: int) -> None:
        """One local subscription of topic more or fewer; a topic with none is no longer followed."""
        entry = self._primaries.get(topic)
        n = (entry[1] if entry is not None else 0) + delta
        if n <= 0:
            self._primaries.pop(topic, None)
        elif entry is not None:
            self._primaries[topic] = (entry[0], n)
        else:
            self._primaries[topic] = (self.t.closest_id(self.coord(topic)), n)

    def coord(self, topic: str) -> Coord:
        """Where this broker sends a topic's requests: C(t) as a redirect taught it, else h(t)."""
        return self.coords.get(topic) or self.t.home(topic)

    def view_changed(self) -> None:
        """The overlay changed: a subscribed topic whose coordinate another broker is now closest to has this
        broker's sessions registered there again, each by a SUBSCRIBE with corr 0 (no answer, nothing replayed).

        A holder keeps subscriptions in memory: a level-1 primary that restarts reads its records back, not its
        subscribers, and every holder of a topic may restart while the subscribers' access broker stays up (a
        rolling restart).  The broker that took over, and the one that came back, hear of the subscriptions at
        once instead of after the client's lease (SUBSCRIPTION_LEASE, 20 s of silence).  What was published in
        between reaches the subscription as a gap it fetches (at its next message, or at the primary's HEADS).
        A registration that was never lost is registered again harmlessly (one entry per access broker and
        session)."""
        changed: set[str] = set()
        coords = {topic: self.coord(topic) for topic in self._primaries}
        self.t.rank_many(coords.values())
        for topic, (before, n) in self._primaries.items():
            n1 = self.t.closest_id(coords[topic])
            if n1 != before:
                self._primaries[topic] = (n1, n)  # (an existing key: the dict's size does not change)
                changed.add(topic)
        if not changed:
            return
        self._register_again(changed)
        # While the overlay forms, the new N1 can be in the view before a link leads there: routing holds the
        # registration until one does, for up to a second (routing.HOLD_FOR), and nobody waits for it to ask
        # again if a link takes longer: made once more a second later.
        again = self.t.ov.now() + REGISTER_AGAIN
        for topic in changed:
            self._again[topic] = again

    def tick(self, now: float) -> None:
        """Registrations made at a view change, made once more (`view_changed`)."""
        if not self._again:
            return
        due = {topic for topic, at in self._again.items() if at <= now}
        for topic in due:
            del self._again[topic]
        self._register_again(due & self._primaries.keys())

    def _register_again(self, topics: set[str]) -> None:
        """Register every local session's subscription of these topics again at the topic's N1 (corr 0)."""
        if not topics:
            return
        for session, subscribed in self.session_topics.items():
            for topic in subscribed & topics:
                self.t.counters["resubscribed"] += 1
                self.send_request(topic, session, Subscribe(0, topic))

    def subscriptions(self, session: str) -> int:
        """How many topics a local session is subscribed to."""
        return len(self.session_topics.get(session, ()))

    def to_local(self, session: str, msg: Message) -> None:
        self.t.ov.to_session(session, control_frame(encode_message(msg)))

    def reply_arrived(self, rep: TopicReply) -> None:
        """TOPIC_REPLY: hand the answers to their sessions here, in order."""
        if rep.access != self.t.ov.me.id:
            # The access broker the reply was for is gone and this broker is now closest to its coordinate.
            for sessions, body in rep.answers:
                self._sessions_gone(sessions, body)
            return
        for sessions, body in rep.answers:
            self.local_reply(sessions, body)

    def local_reply(self, sessions: Sequence[str], reply: bytes, sent: Message | None = None) -> None:
        """An answer (an encoded message) for sessions of this broker, from a TOPIC_REPLY or a local holder (which
        passes the message itself too, as `sent`)."""
        if reply.startswith(_FAILED_HEAD):
            self._refused(sessions, reply)
        frame = control_frame(reply)
        to_session = self.t.ov.to_session
        if len(sessions) == 1:  # an ACK, a reply, a DELIVER to one subscriber here: no list per message
            if not to_session(sessions[0], frame, sent):
                self._sessions_gone(sessions, reply)
            return
        missing = [s for s in sessions if not to_session(s, frame, sent)]
        if missing:
            self._sessions_gone(missing, reply)

    def _refused(self, sessions: Sequence[str], reply: bytes) -> None:
        """A FAILED for these sessions: a SUBSCRIBE the topic's primary refused (topic_full) is no subscription
        here either, so the session may ask again later."""
        try:
            msg = decode_message(reply)
        except RemoteProtocolError:
            return
        if isinstance(msg, Failed) and msg.code == "topic_full":
            for s in sessions:
                self._forget(s, msg.topic)

    def _sessions_gone(self, sessions: Iterable[str], reply: bytes) -> None:
        try:
            msg = decode_message(reply)
        except RemoteProtocolError:
            return
        if isinstance(msg, Deliver):
            coord = self.coord(msg.topic)
            for s in sessions:
                self.t.ov.route(coord, SessionGone(msg.topic, self.t.ov.me.id, s))

    def topic_moved_arrived(self, m: TopicMoved) -> None:
        """TOPIC_MOVED: address the topic's later requests to its new coordinate and tell the sessions."""
        if m.access != self.t.ov.me.id:
            return
        if same(m.coord, self.t.home(m.topic)):
            self.coords.pop(m.topic, None)
        elif len(self.coords) < 100_000 or m.topic in self.coords:
            self.coords[m.topic] = m.coord
        if (entry := self._primaries.get(m.topic)) is not None:
            self._primaries[m.topic] = (self.t.closest_id(self.coord(m.topic)), entry[1])  # (the move carried them)
        frame = control_frame(encode_message(Redirect(m.topic, m.coord)))
        for s in m.sessions:
            self.t.ov.to_session(s, frame)


# How every encoded FAILED starts (its array header and op), so an answer passed on as bytes is told apart
# without decoding the ACKs and DELIVERs around it.
_FAILED_HEAD: Final = encode_message(Failed(1, "t", "bad_request", ""))[:8]


def _request_size(item: tuple[str, bytes]) -> int:
    return len(item[0]) + len(item[1])


def _by_session(items: list[tuple[str, bytes]], identities: dict[str, str]) -> tuple[SessionRequests, ...]:
    """(session, request) pairs, grouped by session in order (each session's are consecutive)."""
    out: list[SessionRequests] = []
    session = ""
    reqs: list[bytes] = []
    for s, raw in items:
        if s != session and reqs:
            out.append(SessionRequests(session, identities.get(session, ""), tuple(reqs)))
            reqs = []
        session = s
        reqs.append(raw)
    if reqs:
        out.append(SessionRequests(session, identities.get(session, ""), tuple(reqs)))
    return tuple(out)
