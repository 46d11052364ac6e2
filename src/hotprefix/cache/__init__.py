"""The prefix cache: everything about blocks, keys and what to keep. Imports no torch.

What it holds, one concern a module:
  * ``hashing``     chained, type-tagged block keys rooted in the model+tokenizer namespace
  * ``block``       ``KVBlock`` and ``AdmitInfo`` (a leaf every other module may import)
  * ``block_pool``  refcounts, the key index, the three block states, pins, the ghost list
  * ``eviction``    the policy registry (``freq``, ``lru``); ``lazy_heap`` their shared heap
  * ``request``     ``CacheRequest``: what the cache knows of a request
  * ``manager``     ``KVCacheManager``: lookup / allocate / commit / free, per-tenant statistics
  * ``rules``       rules written once (the last prompt token is never served from cache)
  * ``report``      ``CacheReport`` and ``MissReason``: the per-request report, defined once
  * ``diagnosis``   why a prompt stopped hitting, from what the requesting tenant may read only
  * ``stats``       lifetime and windowed hit rates, miss reasons and causes
  * ``ledger``      the per-tenant, secret-keyed ledger of cached content (across restarts)
  * ``state_dir``   the checked, private ``--state-dir`` and its secret
  * ``tier_link``   between the pool and the KV tiers: background fetch, install, write-through
  * ``tiers/``      the KV tier backends (host, disk, redis) and their verified blob format

It knows nothing about tensors (the runner moves K/V bytes), text (the engine decodes excerpts),
HTTP or tenants' names (a tenant is its salt here).
"""
