"""The prefix cache: block keys, the block pool, eviction policies, the manager. Imports no torch."""
