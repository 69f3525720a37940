"""Topic ACLs: which identity may publish or subscribe to which topics.

An ACL file has one rule per line; ``#`` starts a comment::

    # effect  action     identity   topic pattern
    allow     publish    meter-*    grid/+/voltage
    deny      subscribe  *          grid/private/#
    allow     any        operator   #

* effect: ``allow`` or ``deny``.
* action: ``publish``, ``subscribe`` (which also covers FETCH, reading stored messages) or ``any``.
* identity: the authenticated name (a certificate's CN, a token's name, ``anonymous`` on an --insecure
  broker without tokens), matched as a shell glob (``*`` = everyone).
* topic pattern: MQTT-like over '/'-separated levels, ``+`` one level, ``#`` the remaining levels (also
  none: ``grid/#`` matches ``grid``).

The first rule that matches decides; when none matches, the request is denied.  UNSUBSCRIBE and LOCATE
are never denied: they reveal or change nothing a client is not entitled to.  Without an ACL file every
authenticated identity may do everything.  Every broker of an overlay should load the same file: the
topic's holder enforces it (TOPIC_REQUEST carries the identity), and the access broker applies it too so a
denied request is answered at once without crossing the overlay.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, TypeAlias

from broker.config import ConfigError
from overlay.delegation import MoveTopic
from overlay.protocol import Message
from overlay.pubsub import Failed, Fetch, Nack, Publish, Subscribe
from overlay.topics import BadTopic, matches, validate_pattern

Action: TypeAlias = Literal["publish", "subscribe"]
ACTIONS: Final = ("publish", "subscribe")
ANONYMOUS: Final = "anonymous"
# Decisions are cached per (identity, action, topic): a publisher's stream costs one lookup per message.
_CACHE_LIMIT: Final = 100_000


class AclError(ConfigError):
    """The ACL file is unreadable or a rule is malformed; the message names file, line and rule."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One ACL line."""

    allow: bool
    actions: frozenset[str]
    identity: str
    pattern: str
    where: str  # "file:line", for the denial text and logs

    def applies(self, identity: str, action: str, topic: str) -> bool:
        """True if the rule speaks about this identity, action and topic."""
        return action in self.actions and fnmatch.fnmatchcase(identity, self.identity) and matches(self.pattern, topic)


class Acl:
    """An ordered rule list; first match decides, default deny."""

    def __init__(self, rules: list[Rule], source: str = "<rules>") -> None:
        self.rules = rules
        self.source = source
        # Requests refused, by where the check ran: at the client's access broker or at the topic's holder.
        self.denied: dict[str, int] = {"access": 0, "holder": 0}
        self._cache: dict[tuple[str, str, str], Rule | None] = {}

    def replace(self, other: Acl) -> None:
        """Take other's rules (a reload of the file): this object is shared by the access and holder checks,
        so it changes in place; the denial counters carry on."""
        self.rules = other.rules
        self.source = other.source
        self._cache.clear()

    def decide(self, identity: str, action: Action, topic: str) -> Rule | None:
        """The first rule that applies, or None (denied by default)."""
        key = (identity, action, topic)
        try:
            return self._cache[key]
        except KeyError:
            pass
        found = next((r for r in self.rules if r.applies(identity, action, topic)), None)
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = found
        return found

    def allows(self, identity: str, action: Action, topic: str) -> tuple[bool, str]:
        """(allowed?, why) for the denial text."""
        rule = self.decide(identity, action, topic)
        if rule is None:
            return False, f"no rule of {self.source} allows it (default deny)"
        verb = "allowed" if rule.allow else "denied"
        return rule.allow, f"{verb} by {rule.where}: {'allow' if rule.allow else 'deny'} {rule.identity} {rule.pattern}"


def parse_acl(text: str, source: str = "<acl>") -> Acl:
    """Parse ACL text (see the module docstring); AclError names the line of the first bad rule."""
    rules: list[Rule] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        # '#' is also the multi-level wildcard, so a comment is a line starting with '#' or anything after
        # the fourth field (the pattern), not every '#'.
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) < 4 or (len(fields) > 4 and not fields[4].startswith("#")):
            raise AclError(f"{source}:{number}: expected 'allow|deny ACTION IDENTITY PATTERN', got {raw.strip()!r}")
        effect, action, identity, pattern = fields[:4]
        if effect not in ("allow", "deny"):
            raise AclError(f"{source}:{number}: the first word must be allow or deny, got {effect!r}")
        if action not in (*ACTIONS, "any"):
            raise AclError(f"{source}:{number}: the action must be publish, subscribe or any, got {action!r}")
        try:
            validate_pattern(pattern)
        except BadTopic as exc:
            raise AclError(f"{source}:{number}: {exc}") from None
        actions = frozenset(ACTIONS) if action == "any" else frozenset({action})
        rules.append(Rule(effect == "allow", actions, identity, pattern, f"{source}:{number}"))
    return Acl(rules, source)


def load_acl(path: str | Path) -> Acl:
    """Read and parse an ACL file."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise AclError(f"cannot read the ACL file {p} (--acl): {exc}") from None
    return parse_acl(text, str(p))


def action_of(msg: Message) -> Action | None:
    """The ACL action a client request needs, or None if it is always allowed."""
    if isinstance(msg, Publish | MoveTopic):  # moving a topic needs the right to publish to it
        return "publish"
    if isinstance(msg, Subscribe | Fetch):
        return "subscribe"
    return None


def refusal(acl: Acl, identity: str, msg: Message, where: Literal["access", "holder"]) -> Nack | Failed | None:
    """The answer denying msg to identity (NACK for PUBLISH, FAILED otherwise), or None if allowed.

    `where` says which check this is (access broker or topic holder), for the counters.
    """
    action = action_of(msg)
    if action is None:
        return None
    topic: str = getattr(msg, "topic")  # noqa: B009 - every request with an action names a topic
    ok, why = acl.allows(identity or ANONYMOUS, action, topic)
    if ok:
        return None
    acl.denied[where] += 1
    text = f"{identity or ANONYMOUS!r} may not {action} to {topic!r}: {why}"
    if isinstance(msg, Publish):
        return Nack(msg.topic, msg.publisher, msg.seq, "not_allowed", text)
    corr: int = getattr(msg, "corr")  # noqa: B009
    return Failed(corr, topic, "not_allowed", text)
