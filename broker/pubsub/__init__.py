"""Pub/sub on one broker: the engine (engine.py) and its roles; see engine.py for the map of the package."""

from broker.pubsub.core import Overlay, control_frame
from broker.pubsub.engine import PubSub
from broker.pubsub.replica import IllegalReplicaTransition, Replica, Stage, Transition
from broker.pubsub.settings import PubSubConfig

__all__ = [
    "IllegalReplicaTransition",
    "Overlay",
    "PubSub",
    "PubSubConfig",
    "Replica",
    "Stage",
    "Transition",
    "control_frame",
]
