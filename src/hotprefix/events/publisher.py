"""Publish KV events on ZeroMQ in vLLM's framing, with a replay socket for missed batches.

One background thread owns both sockets. Every ``FLUSH_INTERVAL_S`` (and on ``flush``) it drains
the recorder; a non-empty drain becomes one ``KVEventBatch(ts, events)``, numbered by a sequence
that starts at 0 and grows by one per batch, and is sent on the PUB socket as the multipart
message ``(topic, seq as 8-byte big-endian, msgpack payload)`` — vLLM's ``ZmqEventPublisher``
framing. The last ``REPLAY_BUFFER_BATCHES`` payloads are kept: a subscriber that sees a gap in the
sequence sends the first sequence number it missed (8 bytes, big-endian) to the ROUTER replay
socket and gets back every kept batch from there on as ``(seq, payload)`` messages, then the
end marker ``(-1, b"")``. Events are published on the timer whether or not the engine steps, so
an eviction or reset is seen even by an idle engine's subscribers.

The PUB socket binds its address (a replica is the stable end; routers connect). A PUB socket
drops messages for a subscriber that is too slow (past its high-water mark) or not yet connected:
that is what the replay socket is for. Imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from hotprefix.events.recorder import PoolEventRecorder

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.02
"""How often the publisher thread drains the recorder (seconds)."""
REPLAY_BUFFER_BATCHES = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps`` default)."""
PUB_HWM = 100_000
"""ZeroMQ high-water mark of the PUB socket (messages queued per subscriber)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence number of the replay's end marker."""


def replay_endpoint_for(endpoint: str, replay: str | None) -> str | None:
    """The replay socket's address: ``replay`` when given (``none`` = no replay socket), else the
    events address with its TCP port + 1 (``*`` stays ``*``: a random port of its own).

    Raises:
        ValueError: no replay address given and ``endpoint`` is not ``tcp://HOST:PORT``.
    """
    if replay is not None:
        return None if replay.lower() == "none" else replay
    host, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep:
        raise ValueError(f"cannot derive a replay address from {endpoint!r}: give kv_events_replay")
    if port == "*":
        return endpoint
    try:
        return f"{host}:{int(port) + 1}"
    except ValueError:
        raise ValueError(f"bad port in KV events address {endpoint!r}") from None


class ZmqEventPublisher:
    """Publishes a ``PoolEventRecorder``'s events (PUB) and serves replays (ROUTER).

    Args:
        recorder: where the events come from.
        endpoint: address the PUB socket binds, e.g. ``tcp://*:5557`` or ``tcp://127.0.0.1:*``.
        replay_endpoint: address the ROUTER socket binds, or None for no replay socket.
        topic: first frame of every message (subscribers filter on it).
    Raises:
        zmq.ZMQError: an address cannot be bound (in use, bad host).
    """

    def __init__(self, recorder: PoolEventRecorder, endpoint: str, replay_endpoint: str | None,
                 topic: str = "", interval_s: float = FLUSH_INTERVAL_S,
                 buffer_batches: int = REPLAY_BUFFER_BATCHES):
        self.recorder = recorder
        self.topic = topic.encode()
        self.interval_s = interval_s
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(PUB_HWM)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            """The bound PUB address (with the port chosen for ``*``)."""
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.replay_endpoint: str | None = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None)
        """The bound replay address, or None."""
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._encoder = msgspec.msgpack.Encoder()
        self.next_seq = 0
        """Sequence number of the next batch (= batches published so far)."""
        self.num_events = 0
        """Events published so far."""
        self._cv = threading.Condition()
        self._flush_wanted = 0  # flush requests made
        self._flush_done = 0  # requests served
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hotprefix-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events on %s (replay %s, topic %r)", self.endpoint, self.replay_endpoint, topic)

    # ------------------------------------------------------------------ caller side
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Publish every event recorded so far now; True once done (False: timed out, or closed)."""
        with self._cv:
            if self._stop:
                return False
            self._flush_wanted += 1
            ticket = self._flush_wanted
            return self._cv.wait_for(lambda: self._flush_done >= ticket or self._stop, timeout_s) \
                and self._flush_done >= ticket

    def close(self) -> None:
        """Publish what is recorded, stop the thread, close the sockets (idempotent)."""
        with self._cv:
            if self._stop:
                return
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)
        self.recorder.detach()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        next_flush = time.monotonic() + self.interval_s
        while True:
            with self._cv:
                stopping, wanted = self._stop, self._flush_wanted
            now = time.monotonic()
            urgent = stopping or wanted > self._flush_done
            wait_ms = 0 if urgent else max(0, min(next_flush - now, self.interval_s)) * 1000
            try:
                if self._replay is not None:
                    if dict(poller.poll(wait_ms)).get(self._replay):
                        self._serve_replays()
                elif wait_ms:
                    time.sleep(wait_ms / 1000)
                if urgent or time.monotonic() >= next_flush:
                    self._publish(self.recorder.drain())
                    next_flush = time.monotonic() + self.interval_s
            except Exception:  # a bad request or a socket error must not end the thread
                log.exception("KV events publisher")
                time.sleep(self.interval_s)
            if urgent:
                with self._cv:
                    self._flush_done = max(self._flush_done, wanted)
                    self._cv.notify_all()
            if stopping:
                return

    def _publish(self, events: list) -> None:
        if not events:
            return
        batch = self.recorder.types.KVEventBatch(ts=time.time(), events=events)
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.next_seq = seq + 1
        self.num_events += len(events)

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            buf = self._buffer
            first = buf[0][0] if buf else self.next_seq
            for i in range(max(0, start - first), len(buf)):
                seq, payload = buf[i]
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
