"""The request routers alive in this process, by deployment name.

Ray Serve builds the request router itself (from a copy of ``request_router``'s code: it pickles
that module by value), in the process that holds the deployment handle, the front end. This table,
in a module Ray Serve does not copy, is how the front end finds it: the live replicas for its
per-replica fan-out, the decision counts for ``/metrics``. Imports no torch, no Ray.
"""

from __future__ import annotations

import weakref
from typing import Any

routers: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
"""Deployment name -> its ``HotprefixRequestRouter`` in this process."""
