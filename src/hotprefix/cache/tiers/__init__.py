"""KV tiers below the pool: host RAM, a local disk directory, a shared Redis/Valkey server.

The storage half only: blobs (``blob``), backends (``host``, ``disk``, ``redis_tier``) and the
stack that reads and verifies runs of blocks and writes them in the background (``stack``). Moving
K/V between the pool and bytes is the runner's job. Imports no torch.
"""

from hotprefix.cache.tiers.blob import BLOB_VERSION, BadSignature, CorruptEntry, decode_blob, encode_blob
from hotprefix.cache.tiers.registry import TIER_KINDS, make_tier
from hotprefix.cache.tiers.stack import FetchedBlock, TierEntry, TierStack

__all__ = ["BLOB_VERSION", "BadSignature", "CorruptEntry", "FetchedBlock", "TIER_KINDS", "TierEntry",
           "TierStack", "decode_blob", "encode_blob", "make_tier"]
