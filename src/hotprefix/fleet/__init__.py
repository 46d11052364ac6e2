"""A fleet: N engine replicas as a Ray Serve deployment behind one OpenAI-compatible front end,
routed by the prefix-aware routing core (``hotprefix.router``) as a Ray Serve ``RequestRouter``.

  * ``config``   ``FleetConfig`` (replicas, router policy, Ray resources), torch- and Ray-free.
  * ``hints``    what the front end tells the router about a request (its block keys), Ray-free.
  * ``merge``    fleet-wide cache stats and metrics from the replicas' own, Ray-free.
  * ``asgi``     calls the single server's app in-process (how a replica serves a request).
  * ``replica``  the Ray Serve deployment of one engine (the single server's app inside).
  * ``request_router``  the routing core as a Ray Serve ``RequestRouter``; ``live``: where the
    front end finds it in its process.
  * ``frontend`` the ingress deployment: tenants, tokenization for routing, retries, fan-out.
  * ``app``      ``build_app`` (for ``serve run``) and ``serve_fleet`` (``hotprefix serve --replicas N``).

Importing ``hotprefix`` (or this package) imports no Ray: only ``replica``, ``request_router``,
``frontend`` and ``app`` do.
"""
