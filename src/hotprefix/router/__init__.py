"""The prefix-aware routing core, as a library: ``Router`` (scoring and policies, ``core``),
``RouterConfig`` (``config``), the block index fed by KV events (``index``), the TTL memory of
its own decisions (``memory``) and the ZeroMQ event subscriptions (``feed``).

Torch-free, and free of any serving framework: the simulator replays traces through it, and a
Ray Serve request router can call it. pyzmq loads only with ``feed``.
"""

from hotprefix.router.config import POLICIES, RouterConfig
from hotprefix.router.core import Decision, Router
from hotprefix.router.index import BlockIndex

__all__ = ["POLICIES", "BlockIndex", "Decision", "Router", "RouterConfig"]
