"""The OpenAI-compatible HTTP server.

``app`` builds the FastAPI app (``create_app``) and serves it; the routes are in ``generate``
(completions, chat), ``cache_routes`` (stats, warm, reset) and ``ops_routes`` (models, health,
metrics); ``deps`` resolves the server state and the caller's tenant; ``errors`` answers every
error as OpenAI-style JSON; ``streaming`` sends outputs as JSON or server-sent events;
``limits`` refuses oversized bodies; ``protocol`` holds the request schemas; ``tenants`` maps API
keys to tenants and salts; ``metrics`` renders Prometheus metrics; ``state`` is what routes share.

Knows the engine only through ``AsyncEngine`` and the engine's public methods (never its cache,
scheduler or runner), and knows nothing about tensors.
"""
