"""The link state table and close reasons (pure)."""

from __future__ import annotations

import pytest

from broker.link import _TRANSITIONS, CloseReason, LinkState, next_state
from overlay.protocol import LocalProtocolError


def test_happy_paths() -> None:
    s = LinkState.CONNECTING
    for nxt in (LinkState.HELLO_SENT, LinkState.ESTABLISHED, LinkState.DRAINING, LinkState.CLOSED):
        s = next_state(s, nxt)
    assert s is LinkState.CLOSED
    assert next_state(LinkState.CONNECTING, LinkState.ESTABLISHED) is LinkState.ESTABLISHED  # inbound


@pytest.mark.parametrize("final", [LinkState.CLOSED, LinkState.ERROR])
def test_final_states_are_sticky(final: LinkState) -> None:
    for target in LinkState:
        with pytest.raises(LocalProtocolError, match="illegal link transition"):
            next_state(final, target)


def test_no_way_back() -> None:
    with pytest.raises(LocalProtocolError):
        next_state(LinkState.ESTABLISHED, LinkState.HELLO_SENT)
    with pytest.raises(LocalProtocolError):
        next_state(LinkState.DRAINING, LinkState.ESTABLISHED)
    assert set(_TRANSITIONS) == set(LinkState)


def test_failure_reasons() -> None:
    assert CloseReason.HEARTBEAT_TIMEOUT.is_failure
    assert CloseReason.PEER_CLOSED.is_failure
    assert not CloseReason.PEER_LEFT.is_failure
    assert not CloseReason.UNLINKED.is_failure
    assert not CloseReason.SHUTDOWN.is_failure
