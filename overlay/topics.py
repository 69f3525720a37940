"""Topic names and topic patterns: what a valid name is, and matching names against ACL patterns.

Pure and dependency-free so clients validate before sending and brokers validate what they receive.
"""

from __future__ import annotations

from typing import Final

# A topic name is hashed, logged, stored per message and listed in status output; 256 bytes is ample for
# hierarchical smart-grid names such as "grid/substation-17/feeder-3/voltage" and bounds all of that.
MAX_TOPIC_LEN: Final = 256
SEPARATOR: Final = "/"
WILDCARD_ONE: Final = "+"  # one level in a pattern
WILDCARD_REST: Final = "#"  # zero or more further levels, last in a pattern


class BadTopic(ValueError):
    """A topic name or pattern is malformed; the message says what rule it breaks."""


def _check_common(name: str, what: str) -> list[str]:
    if not isinstance(name, str):
        raise BadTopic(f"{what} must be a string, got {type(name).__name__}")
    size = len(name.encode("utf-8", errors="surrogatepass"))
    if not 0 < size <= MAX_TOPIC_LEN:
        raise BadTopic(f"{what} must be 1..{MAX_TOPIC_LEN} bytes of UTF-8, got {size}")
    for ch in name:
        if ch.isspace() or not ch.isprintable():
            raise BadTopic(f"{what} {name!r} contains whitespace or a control character")
    levels = name.split(SEPARATOR)
    if any(level == "" for level in levels):
        raise BadTopic(f"{what} {name!r} has an empty level (leading, trailing or double '/')")
    return levels


def validate_topic(name: str) -> str:
    """Return name if it is a valid topic name, else raise BadTopic.

    Levels are separated by '/', none empty; '+' and '#' are reserved for patterns.
    """
    for level in _check_common(name, "topic name"):
        if WILDCARD_ONE in level or WILDCARD_REST in level:
            # Said in full because MQTT users expect wildcard subscriptions: here each topic lives at its own
            # coordinate h(t), so a subscription cannot span topics; '+' and '#' exist only in ACL patterns.
            raise BadTopic(
                f"topic name {name!r} contains '+' or '#': wildcards exist only in ACL patterns; name one topic in "
                "full (each topic lives at its own coordinate; `sedax topics` lists them)"
            )
    return name


def validate_pattern(pattern: str) -> str:
    """Return pattern if it is a valid topic pattern ('+' = one level, '#' = the rest, last), else raise."""
    levels = _check_common(pattern, "topic pattern")
    for i, level in enumerate(levels):
        if (WILDCARD_ONE in level and level != WILDCARD_ONE) or (WILDCARD_REST in level and level != WILDCARD_REST):
            raise BadTopic(f"pattern {pattern!r}: a wildcard must be a whole level")
        if level == WILDCARD_REST and i != len(levels) - 1:
            raise BadTopic(f"pattern {pattern!r}: '#' may only be the last level")
    return pattern


def matches(pattern: str, name: str) -> bool:
    """True if the topic name matches the pattern (both assumed valid)."""
    p_levels = pattern.split(SEPARATOR)
    n_levels = name.split(SEPARATOR)
    for i, p in enumerate(p_levels):
        if p == WILDCARD_REST:
            return True  # '#' matches the parent level too, as in MQTT: "grid/#" matches "grid"

        if i >= len(n_levels):
            return False
        if p != WILDCARD_ONE and p != n_levels[i]:
            return False
    return len(p_levels) == len(n_levels)
