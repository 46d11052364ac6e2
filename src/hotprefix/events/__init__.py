"""KV events: what each engine's prefix cache gains and loses, in vLLM's schema and framing.

``schema`` has vLLM's event types (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in a
``KVEventBatch``) as msgspec structs; ``recorder`` listens to a ``BlockPool`` and turns its changes
into those events; ``publisher`` sends them on a ZeroMQ PUB socket with sequence numbers and a
replay socket; ``subscriber`` reads them back (a router's side). ``open_kv_events`` wires the
first three for an engine from ``CacheConfig.kv_events``. Imports no torch; pyzmq loads only when
events are configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from hotprefix.config.sections import CacheConfig, ConfigError

if TYPE_CHECKING:
    from hotprefix.cache.block_pool import BlockPool
    from hotprefix.events.publisher import ZmqEventPublisher


def open_kv_events(cfg: CacheConfig, pool: "BlockPool", tier_kinds: Sequence[str] = (),
                   windows: Mapping[int, int] | None = None) -> "ZmqEventPublisher | None":
    """The publisher of ``pool``'s events on ``cfg.kv_events`` (None when not configured).

    Args:
        tier_kinds: kinds of the KV tiers below the pool (``host``, ``disk``, ``redis``), whose
            media evicted blocks are reported in.
        windows: a hybrid pool's groups past 0 -> their windows (``WindowGroups``' argument):
            their blocks are announced too, every event with its group.
    Raises:
        ConfigError: a bad or unusable address (in use, no replay address derivable).
    """
    if not cfg.kv_events:
        return None
    import zmq

    from hotprefix.events.publisher import ZmqEventPublisher, replay_endpoint_for
    from hotprefix.events.recorder import PoolEventRecorder
    from hotprefix.events.schema import TIER_MEDIA

    try:
        replay = replay_endpoint_for(cfg.kv_events, cfg.kv_events_replay)
    except ValueError as e:
        raise ConfigError(f"kv_events: {e}") from None
    media = [TIER_MEDIA[k] for k in tier_kinds if k in TIER_MEDIA]
    recorder = PoolEventRecorder(pool, media, cfg.kv_events_format, windows)
    try:
        return ZmqEventPublisher(recorder, cfg.kv_events, replay, cfg.kv_events_topic)
    except zmq.ZMQError as e:
        recorder.detach()
        raise ConfigError(f"kv_events: cannot bind {cfg.kv_events} / {replay}: {e}") from None
