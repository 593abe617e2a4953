"""The block cache: levels behind one protocol (``blocks``), composed in
lookup order (``layered``): the blocks read lately, in RAM (``recent``),
the local tiers (``tiered``, over ``tier``, ``policy``, ``codec`` and the
block ``index``), the shared tier in a bucket (``shared``); and the cache
directory's lifecycle (open with its lock, reconcile, verify, gc)."""
