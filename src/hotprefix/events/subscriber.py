"""Read a replica's KV events: SUB socket, sequence check, replay of what was missed.

``poll`` returns the batches in sequence order. When a batch's sequence number jumps past the
next expected one, the subscriber asks the publisher's replay socket for the missing range and
puts what comes back in its place; a number the publisher no longer holds is returned as
``(seq, None)`` so the caller knows its view may be incomplete (a router then forgets that
replica's blocks). With ``catch_up`` a subscriber that joins late also asks for everything from
sequence 0 (the publisher's start, an ``AllBlocksCleared``) on its first message.

A jump shows a gap only when a later batch arrives. The batches published just before a
subscriber's connection was set up (ZeroMQ's "slow joiner"), or the last ones before the publisher
went quiet, would stay missing until then; so a subscriber that has heard nothing for
``IDLE_SYNC_S`` asks the replay socket for whatever follows its next expected sequence.

The replay request is vLLM's: one 8-byte big-endian start sequence to a ROUTER socket, answered by
``(seq, payload)`` messages and an end marker of sequence -1; this subscriber talks to it through a
DEALER socket (an empty delimiter frame first, as REQ would send). Imports no torch.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from hotprefix.events.publisher import END_SEQ
from hotprefix.events.schema import decoder

REPLAY_TIMEOUT_S = 2.0
"""How long a replay may take before the range is given up as lost."""
IDLE_SYNC_S = 1.0
"""Silence after which ``poll`` asks the replay socket for batches it may have missed."""


class EventSubscriber:
    """Subscribes to one publisher.

    Args:
        endpoint: the publisher's PUB address (``tcp://HOST:PORT``).
        replay_endpoint: its replay (ROUTER) address, or None (gaps are then reported as lost).
        topic: topic prefix to subscribe to (``""``: everything).
        fmt: the events' encoding, ``array`` or ``map`` (``CacheConfig.kv_events_format``).
        catch_up: on the first message, replay from sequence 0 what the publisher still holds.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 fmt: str = "array", catch_up: bool = True):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self._decode = decoder(fmt).decode
        self.next_seq: int | None = 0 if catch_up else None
        """The sequence number expected next (None: take the first one seen)."""
        self.num_lost = 0
        """Batches missed that the replay could not supply."""
        self.num_replayed = 0
        """Batches recovered from the replay socket."""
        self._heard_at = time.monotonic()

    def poll(self, timeout_s: float = 0.0) -> list[tuple[int, Any]]:
        """Batches received (waiting up to ``timeout_s`` for the first), in sequence order:
        ``(seq, KVEventBatch)``, or ``(seq, None)`` for one that is lost."""
        out: list[tuple[int, Any]] = []
        wait_ms = int(timeout_s * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            if self.next_seq is None:
                self.next_seq = seq
            if seq < self.next_seq:
                continue  # already had it (from a replay)
            if seq > self.next_seq:
                out.extend(self._recover(self.next_seq, seq))
            out.append((seq, self._decode(frames[2])))
            self.next_seq = seq + 1
        now = time.monotonic()
        if out:
            self._heard_at = now
        elif (self._replay is not None and self.next_seq is not None
              and now - self._heard_at >= IDLE_SYNC_S):
            self._heard_at = now
            out = self._recover(self.next_seq, None)
            if out:
                self.next_seq = out[-1][0] + 1
        return out

    def _recover(self, start: int, stop: int | None) -> list[tuple[int, Any]]:
        """Batches ``start`` .. ``stop - 1`` from the replay socket, the ones it lacks as lost
        (``stop`` None: whatever it holds from ``start`` on, and the numbers before the first one
        it holds as lost)."""
        got: dict[int, Any] = {}
        if self._replay is not None:
            self._replay.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while (left := deadline - time.monotonic()) > 0 and self._replay.poll(int(left * 1000)):
                frames = self._replay.recv_multipart()
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if start <= seq and (stop is None or seq < stop):
                    got[seq] = self._decode(payload)
        if stop is None:
            if not got:
                return []
            stop = max(got) + 1
        self.num_replayed += len(got)
        self.num_lost += (stop - start) - len(got)
        return [(s, got.get(s)) for s in range(start, stop)]

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
