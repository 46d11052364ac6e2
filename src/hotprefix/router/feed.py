"""Keep a router's index current from its replicas' KV event streams (ZeroMQ).

One ``EventSubscriber`` per replica; ``poll`` applies every batch received, in sequence order, to
the router. A batch that is lost for good (a gap the replay socket could no longer fill) makes the
router forget that replica's blocks: from then on it knows less than the truth (blocks stored
later are learnt again), never more. Imports no torch.
"""

from __future__ import annotations

from hotprefix.events.subscriber import EventSubscriber
from hotprefix.router.core import Router


class EventFeed:
    """The KV event subscriptions of one router."""

    def __init__(self, router: Router):
        self.router = router
        self.subscribers: dict[str, EventSubscriber] = {}
        self.num_batches = 0
        """Batches applied so far."""
        self.num_forgotten = 0
        """Times a replica's blocks were forgotten after a lost batch."""

    def connect(self, replica: str, endpoint: str, replay_endpoint: str | None = None,
                topic: str = "", fmt: str = "array") -> None:
        """Follow ``replica``'s events (its ``--kv-events`` address and replay address)."""
        self.disconnect(replica)
        self.subscribers[replica] = EventSubscriber(endpoint, replay_endpoint, topic, fmt)

    def disconnect(self, replica: str) -> None:
        sub = self.subscribers.pop(replica, None)
        if sub is not None:
            sub.close()

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what every replica sent (waiting up to ``timeout_s`` on each); batches applied."""
        n = 0
        for replica, sub in list(self.subscribers.items()):
            for _, batch in sub.poll(timeout_s):
                if batch is None:
                    self.router.index.forget(replica)
                    self.num_forgotten += 1
                else:
                    self.router.apply_events(replica, batch.events)
                    n += 1
        self.num_batches += n
        return n

    def close(self) -> None:
        for replica in list(self.subscribers):
            self.disconnect(replica)
