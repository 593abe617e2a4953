"""The block store: the on-disk block format (codec), tiers and their eviction
policies, the tiered cache over them, the block index, and the cache
directory's lifecycle (open with its lock, reconcile, verify, gc)."""
